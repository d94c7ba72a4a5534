/*-------------------------------------------------------------------------
 *
 * step_human.c
 *	  The Human step: wait for a person's data (tuvl.submit()).
 *
 * The step parks the run as waiting_human; tuvl.submit() records the data
 * in its step_state (ControlAnswer, run_control.c) and queues the run, and
 * the step, executed again, finds it there.  A timeout is a durable
 * wake-up, as a Sleep step's (timers.c).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "utils/jsonb.h"
#include "utils/timestamp.h"

#include "effect.h"
#include "executor.h"
#include "jsonutil.h"
#include "runtime.h"
#include "workflow.h"

/*
 * The Human step: wait for tuvl.submit(); its data is the output.  With
 * timeout:, the wait ends then (the run's wake_at, as a Sleep step's) and
 * the step takes the timeout signal.
 */
void
StepExecuteHuman(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	TimestampTz until = 0;
	JsonObjBuilder b;

	for (int i = EffectCount(run) - 1; i >= 0; i--)
	{
		Jsonb	   *rec = EffectAt(run, i);
		char	   *op = JsonGetString(rec, "op");

		if (op && strcmp(op, "human") == 0)
		{
			result->has_output = true;
			result->output = JsonGetJsonb(rec, "data");
			return;
		}
		if (op && strcmp(op, "human_wait") == 0 && until == 0)
			until = (TimestampTz) JsonGetInt(rec, "until_us", 0);
	}
	if (step->timeout_ms > 0 && until == 0)
	{
		until = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), step->timeout_ms);
		JsonObjStart(&b);
		JsonObjAddString(&b, "op", "human_wait");
		JsonObjAddInt(&b, "until_us", until);
		EffectRecord(run, JsonObjEnd(&b));
	}
	if (until != 0 && GetCurrentTimestamp() >= until)
	{
		result->signal = "timeout";
		result->has_output = false;
		return;
	}
	JsonObjStart(&b);
	JsonObjAddString(&b, "kind", "human");
	JsonObjAddJsonb(&b, "form", JsonGetJsonb(step->spec, "form"));
	if (until != 0)
		StepSleepAddWake(&b, until);
	result->park = RUN_WAITING_HUMAN;
	result->park_info = JsonObjEnd(&b);
}


/* ---------------------------------------------------------------- validation */

static const char *const human_keys[] = {"form", NULL};

/* form: the JSON Schema of what people submit; a timeout needs its route. */
static void
validate_human(ValidateState *vs, Jsonb *step, const char *path)
{
	Jsonb	   *routes = JsonGetJsonb(step, "routes");

	if (JsonGetField(step, "timeout") &&
		(routes == NULL || !JsonIsObject(routes) || JsonGetField(routes, "timeout") == NULL))
		ValidateFinding(vs, "error", psprintf("%s.routes", path),
						"a Human step with a timeout needs routes.timeout: where the run goes when nobody answered in time");
	ValidateStepMapping(vs, step, path, "form", ValidateSchema,
						"a Human step needs a form: a JSON Schema of the data people submit");
}

/* The Human step's row of the step table (init.c). */
const StepExecutor StepKindHuman = {
	.kind = STEP_HUMAN,
	.execute = StepExecuteHuman,
	.keys = human_keys,
	.validate = validate_human,
};
