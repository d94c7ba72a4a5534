/*-------------------------------------------------------------------------
 *
 * executor.c
 *	  The one dispatch table of step kinds.
 *
 * Every kind has an entry: the workers, tuvl.run(), tuvl.replay() and an
 * agent dispatching a tool all execute a step through it, and ask it
 * what they need to know about the kind.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "executor.h"

const char *ExecutorErrorType = "error";

Jsonb	   *(*ExecutorReplayChildren) (RunState *run, const char *step) = NULL;
Jsonb	   *(*ExecutorReplayControl) (RunState *run, const char *step, Jsonb *control) = NULL;

/* The kinds, as init.c registers them when the library is loaded. */
static const StepExecutor *executors[STEP_KIND_COUNT];

void
ExecutorRegister(const StepExecutor *executor)
{
	Assert(executor->kind >= 0 && executor->kind < STEP_KIND_COUNT);
	executors[executor->kind] = executor;
}

const StepExecutor *
ExecutorFor(StepKind kind)
{
	Assert(kind >= 0 && kind < STEP_KIND_COUNT && executors[kind] != NULL);
	return executors[kind];
}

/* Did step end on one of the reserved exits of its kind? */
bool
ExecutorIsReservedExit(const StepDef *step, const char *signal)
{
	const char *const *exits = ExecutorFor(step->kind)->reserved_exits;

	for (int i = 0; exits && exits[i]; i++)
		if (strcmp(exits[i], signal) == 0)
			return true;
	return false;
}
