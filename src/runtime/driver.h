/*-------------------------------------------------------------------------
 *
 * driver.h
 *	  Driving a run: what follows a committed transition, and the loop
 *	  of the surfaces that drive a run in the calling backend.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_DRIVER_H
#define TUVL_DRIVER_H

#include "runtime.h"

/* What a held run needs once its transition committed. */
typedef enum RunNext
{
	RUN_NEXT_TRANSITION,		/* its next transition */
	RUN_NEXT_EFFECT,			/* run->send performed, then a transition */
	RUN_NEXT_RELEASE			/* nothing: it ended or waits for someone */
} RunNext;

/*
 * How a surface that drives a run in its own backend gets effects
 * performed and people answered.  The workers perform effects on their
 * curl multi handle instead (worker.c), but decide with the same
 * DriveNextAfter.
 */
typedef struct RunPerformer
{
	/* perform run->send now; its result goes to run->fresh_effect */
	void		(*perform) (RunState *run, void *arg);

	/*
	 * the run waits for someone (its status says whom): answer and return
	 * true to go on, or return false to leave it waiting; NULL: leave it
	 */
	bool		(*answer) (RunState *run, void *arg);

	/*
	 * before a transition that nothing is pending for: false stops the loop
	 * (the run was handed to the workers, say); NULL: go on
	 */
	bool		(*go_on) (RunState *run, void *arg);
	void	   *arg;
} RunPerformer;

/* How a run ended, as tuvl.runs records it. */
typedef struct RunEnd
{
	char	   *end_name;
	Jsonb	   *response;
	char	   *error;
} RunEnd;

extern void DriveReadEnd(int64 id, bool ended, RunEnd *end);
extern RunNext DriveNextAfter(RunState *run);
extern RunStatus DriveRun(RunState *run, const RunPerformer *performer, int *transitions);
extern void DriveHoldHere(RunState *run);

#endif							/* TUVL_DRIVER_H */
