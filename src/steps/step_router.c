/*-------------------------------------------------------------------------
 *
 * step_router.c
 *	  The Router step: the rendered value of "on" is the signal.
 *
 * A Router has no output and no effect: it only chooses the next step,
 * so it is safe to execute again after a crash.  A render error is a
 * template_error.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "utils/builtins.h"

#include "executor.h"
#include "jsonutil.h"
#include "template.h"

/* Router: the rendered value of "on" is the signal. */
void
StepExecuteRouter(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	JsonbValue *on = JsonGetField(step->spec, "on");
	JsonbValue *v;

	ExecutorErrorType = "template_error";
	v = TemplateRenderValue(on, ctx, NULL);
	if (v->type == jbvNull)
		result->signal = "default";
	else
		result->signal = JsonValueToText(v);
	result->has_output = false;
}


/* ---------------------------------------------------------------- validation */

static const char *const router_keys[] = {"on", NULL};

/* on: a template whose value is the signal; routes map its values. */
static void
validate_router(ValidateState *vs, Jsonb *step, const char *path)
{
	JsonbValue *on = JsonGetField(step, "on");

	if (on == NULL)
		ValidateFinding(vs, "error", path,
						"a Router step is missing required key \"on\"; write on: \"{{ some.key }}\"");
	else if (on->type != jbvString)
		ValidateFinding(vs, "error", psprintf("%s.on", path),
						"on must be a template whose value is the signal, such as \"{{ order.status }}\"");
	if (JsonGetField(step, "routes") == NULL)
		ValidateFinding(vs, "error", path,
						"a Router step needs routes mapping each value of \"on\" to a step or an end");
}

/* The Router's row of the step table (init.c). */
const StepExecutor StepKindRouter = {
	.kind = STEP_ROUTER,
	.execute = StepExecuteRouter,
	.in_transaction = true,
	.tool_callable = true,
	.default_catches_all = true,
	.keys = router_keys,
	.validate = validate_router,
};
