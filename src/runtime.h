/*-------------------------------------------------------------------------
 *
 * runtime.h
 *	  A run as a state machine: one transition per step.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_RUNTIME_H
#define TUVL_RUNTIME_H

#include "utils/jsonb.h"
#include "utils/palloc.h"

#include "workflow.h"

/*
 * A run held by a worker or by the synchronous path.  The committed
 * checkpoint lives in the top fields; a transition stages its results in
 * the "next" fields, which RunApplyTransition copies over once the
 * transaction that wrote them has committed.
 */
typedef struct RunState
{
	int64		id;
	int			attempt;		/* the lease fence */
	char	   *workflow;
	int			version;
	Oid			principal;
	char	   *principal_name;
	Oid			owner;			/* internal writes run as this role */
	Jsonb	   *context;
	int			step;			/* index of the current step; -1: start */
	int			last_seq;
	MemoryContext cxt;			/* "tuvl run": owns the fields above */

	/* staged by RunAdvance, applied by RunApplyTransition */
	Jsonb	   *next_context;
	int			next_step;
	int			next_seq;
	const char *next_status;	/* "running" or a terminal status */
	char	   *next_error;
} RunState;

extern RunState *RunStateCreate(MemoryContext parent, int64 id, int attempt,
								const char *workflow, int version,
								const char *principal, Jsonb *context,
								const char *current_step, int last_seq);
extern void RunStateFree(RunState *run);
extern void RunAdvance(RunState *run, int lease_ms);
extern void RunApplyTransition(RunState *run);
extern bool RunIsTerminalStatus(const char *status);

#endif							/* TUVL_RUNTIME_H */
