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

	StepErrorType = "template_error";
	v = TemplateRenderValue(on, ctx, NULL);
	if (v->type == jbvNull)
		result->signal = "default";
	else
		result->signal = JsonValueToText(v);
	result->has_output = false;
}
