/*-------------------------------------------------------------------------
 *
 * supervisor.h
 *	  The workflow's supervisor: rules and a judge that watch every
 *	  autonomous agent of a run at its turn boundaries.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_SUPERVISOR_H
#define TUVL_SUPERVISOR_H

#include "nodes/bitmapset.h"

#include "executor.h"
#include "runtime.h"
#include "workflow.h"

/* What an agent loop knows at a turn boundary, for the rules. */
typedef struct SupervisorWatch
{
	int			iteration;		/* the turn about to start (1, 2, ...) */
	int			tool_errors;	/* tool calls answered with an error so far */
	int			repeats;		/* most calls of one tool with the same
								 * arguments */
	char	   *repeated;		/* that tool */
	int			turn_tokens;	/* tokens of the last model turn */
	Bitmapset  *fired;			/* rules that acted before (never twice) */
	Bitmapset  *judged;			/* iterations whose judge verdict acted */
	const char *transcript;		/* the conversation so far, for the judge */
} SupervisorWatch;

typedef enum SupervisorAction
{
	SUPERVISE_CONTINUE,
	SUPERVISE_STEER,
	SUPERVISE_PAUSE,
	SUPERVISE_ABORT
} SupervisorAction;

/* One thing the supervisor does at a boundary. */
typedef struct SupervisorAct
{
	SupervisorAction action;
	int			rule;			/* the rule's index, or -1: the judge */
	char	   *message;		/* the steer text */
	char	   *reason;			/* why, for an abort or a pause */
} SupervisorAct;

extern bool SupervisorPresent(RunState *run);
extern List *SupervisorCheck(RunState *run, const StepDef *step, SupervisorWatch *w,
							 StepResult *result, int64 *tokens);
extern int	SupervisorJudgeTokens(RunState *run, int iteration);
extern const char *SupervisorActionName(SupervisorAction a);

#endif							/* TUVL_SUPERVISOR_H */
