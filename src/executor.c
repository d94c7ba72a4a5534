/*-------------------------------------------------------------------------
 *
 * executor.c
 *	  The one dispatch table of step kinds, and the Router.
 *
 * Every kind has an entry: the workers, tuvl.run(), tuvl.replay() and an
 * agent dispatching a tool all execute a step through it, and ask it
 * what they need to know about the kind.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "utils/builtins.h"

#include "executor.h"
#include "jsonutil.h"
#include "template.h"

const char *StepErrorType = "error";

/* Router: the rendered value of "on" is the signal. */
static void
execute_router(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	JsonbValue *on = JsonGetField(step->spec, "on");
	JsonbValue *v;

	StepErrorType = "template_error";
	v = TemplateRenderValue(on, ctx, NULL);
	if (v->type == jbvNull)
		result->signal = "default";
	else
		result->signal = JsonValueToText(v);
	result->has_output = false;
}

static const StepExecutor executors[STEP_KIND_COUNT] = {
	/* kind, execute, in_transaction, tool_callable, reserved_exits, controls_itself, default_catches_all */
	{STEP_FUNCTIONAL, StepExecuteFunctional, true, true, false, false, false},
	{STEP_MODELOP, StepExecuteModelOp, true, true, false, false, false},
	{STEP_ROUTER, execute_router, true, true, false, false, true},
	{STEP_APICALL, StepExecuteAPICall, false, true, false, false, false},
	{STEP_MCP, StepExecuteMCP, false, true, false, false, false},
	{STEP_AGENT, StepExecuteAgent, false, false, true, true, false},
	{STEP_HUMAN, StepExecuteHuman, false, false, false, false, false},
};

const StepExecutor *
ExecutorFor(StepKind kind)
{
	Assert(kind >= 0 && kind < STEP_KIND_COUNT);
	return &executors[kind];
}

/* Did step end on one of the reserved exits of its kind? */
bool
ExecutorIsReservedExit(const StepDef *step, const char *signal)
{
	return ExecutorFor(step->kind)->reserved_exits && AgentIsReservedExit(signal);
}
