/*-------------------------------------------------------------------------
 *
 * control.h
 *	  Operator control and people in the loop.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_CONTROL_H
#define TUVL_CONTROL_H

#include "utils/jsonb.h"

/* An abort directive, as tuvl.abort_run() writes it into tuvl.runs.control. */
typedef struct AbortDirective
{
	char	   *reason;			/* NULL: none given */
	char	   *by;				/* the role that aborted, or NULL */
	char	   *error;			/* "aborted by <by>: <reason>", the run's error */
} AbortDirective;

/* The answer to a run waiting for a person (tuvl.submit, tuvl.decide). */
typedef struct PersonAnswer
{
	bool		human;			/* data for a Human step, else a decision on
								 * an agent's tool call */
	Jsonb	   *data;			/* the Human step's data */
	bool		approved;		/* the decision */
	const char *note;			/* the decision's note, or NULL */
	const char *by;				/* who answered; NULL: the current role */
	bool		replayed;		/* tuvl.replay() answers from its recording */
} PersonAnswer;

extern void ControlAnswer(int64 run_id, const PersonAnswer *answer);
extern bool ControlAbortRequested(Jsonb *control, AbortDirective *abort);
extern char *ControlAbortError(const char *by, const char *reason);
extern int	ControlExpirePauses(void);
extern int	ControlWakeSleepers(void);
extern void ControlAbortRun(int64 id, const char *reason, const char *by);
extern void ControlAbortChildren(int64 parent_id, const char *reason, const char *by);
extern void ControlJournalRequeued(struct SPITupleTable *tt, uint64 i, const char *kind, Jsonb *payload);

#endif							/* TUVL_CONTROL_H */
