/*-------------------------------------------------------------------------
 *
 * queue.h
 *	  Which roles have queued runs, and where each one's claims go on:
 *	  the per-database registry in shared memory that lets a claim skip
 *	  what earlier claims took.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_QUEUE_H
#define TUVL_QUEUE_H

#include "access/xact.h"
#include "utils/timestamp.h"

/* Roles the registry of one database holds at once. */
#define TUVL_QUEUE_ROLES 64

/*
 * A position in a role's queue, in claim order: higher priority first
 * (key = -priority), then older (id).
 */
typedef struct QueuePos
{
	int64		key;
	int64		id;
} QueuePos;

/* <0, 0 or >0 as a comes before, at or after b in claim order. */
static inline int
QueuePosCmp(QueuePos a, QueuePos b)
{
	if (a.key != b.key)
		return a.key < b.key ? -1 : 1;
	if (a.id != b.id)
		return a.id < b.id ? -1 : 1;
	return 0;
}

/* One role's queue as a claim sees it. */
typedef struct QueueRoleState
{
	Oid			role;			/* InvalidOid: free */
	bool		queued;			/* may have queued runs */
	uint32		gen;			/* bumped by every run queued */
	int			scanners;		/* claims in progress over its runs */
	QueuePos	cursor;			/* every queued run at or before it is claimed
								 * or being claimed */
	QueuePos	low;			/* the first position queued while claims were
								 * in progress (key INT64_MAX: none) */
	TimestampTz full_at;		/* when a claim last scanned from the start */
} QueueRoleState;

typedef struct QueueState
{
	bool		complete;		/* every role with queued runs is here */
	uint32		overflow_gen;	/* bumped when a role found no room */
	QueueRoleState roles[TUVL_QUEUE_ROLES];
} QueueState;

/* What one claim takes over for a role (see QueueClaimBegin). */
typedef struct QueueClaim
{
	Oid			role;
	uint32		gen;
	QueuePos	after;			/* claim the runs after this position */
	bool		from_start;		/* after is the start of the queue */
	int			quota;			/* set by the caller: how many to take */
	int			got;			/* set by the caller: how many it took */
	QueuePos	last;			/* set by the caller: the last one taken */
	bool		skipped;		/* set by the caller: a queued run it passed
								 * over (locked by another transaction) */
	QueuePos	first_skipped;	/* set by the caller: the first of them */
} QueueClaim;

/* Any backend: a run of role became queued; registered at commit. */
extern void QueueNoteAtCommit(Oid role, int32 priority, int64 id);
extern void QueueNoteReturnedAtCommit(void);
extern void QueueXactCallback(XactEvent event, void *arg);
extern void QueueResetState(QueueState *q);

/* Workers. */
extern bool QueueNeedsDiscovery(uint32 *overflow_gen);
extern void QueueLearn(const Oid *roles, int n, bool complete, uint32 overflow_gen);
extern int	QueueClaimBegin(QueueClaim *claims, int max);
extern void QueueClaimEnd(QueueClaim *claims, int n);
extern void QueueClaimAbandon(void);
extern void QueueClaimCommitted(void);

#endif							/* TUVL_QUEUE_H */
