/*-------------------------------------------------------------------------
 *
 * executor.c
 *	  The one dispatch table of step kinds, and the Router.
 *
 * Kinds whose executors arrive in later versions have an entry that
 * raises a clear error, so a workflow using them fails on the error
 * signal instead of crashing a worker.
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
	{STEP_FUNCTIONAL, StepExecuteFunctional},
	{STEP_MODELOP, StepExecuteModelOp},
	{STEP_ROUTER, execute_router},
	{STEP_APICALL, StepExecuteAPICall},
	{STEP_MCP, StepExecuteMCP},
	{STEP_AGENT, StepExecuteAgent},
	{STEP_HUMAN, StepExecuteHuman},
};

const StepExecutor *
ExecutorFor(StepKind kind)
{
	Assert(kind >= 0 && kind < STEP_KIND_COUNT);
	return &executors[kind];
}
