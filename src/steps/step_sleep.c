/*-------------------------------------------------------------------------
 *
 * step_sleep.c
 *	  The Sleep step: a durable timer.
 *
 * The step's first execution works out when it ends (for: a duration from
 * then, until: a timestamp template) and records that time in its
 * step_state.  The run then parks as sleeping, with tuvl.runs.wake_at set
 * by its checkpoint (checkpoint.c): no worker holds it and nothing polls
 * it.  The workers' maintenance, each second, queues the runs whose time
 * has come (TimersWakeSleepers), and the step, executed again, finds its
 * time passed and ends with the default signal.  The time is in the row,
 * so a crash or a server restart only delays the wake-up until a worker
 * runs again.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "datatype/timestamp.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "effect.h"
#include "executor.h"
#include "jsonutil.h"
#include "template.h"
#include "workflow.h"

/* When the step ends, from its for: or until:, as it is first executed. */
static TimestampTz
sleep_until(const StepDef *step, Jsonb *ctx)
{
	JsonbValue *v = JsonGetField(step->spec, "for");
	int64		ms;

	if (v)
	{
		char	   *text = v->type == jbvString ? pnstrdup(v->val.string.val, v->val.string.len)
		: JsonValueToText(v);

		if (!DurationParseLong(text, &ms))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("Sleep step \"%s\": for must be a duration such as 10m, not \"%s\"",
							step->id, text)));
		return TimestampTzPlusMilliseconds(GetCurrentTimestamp(), ms);
	}
	ExecutorErrorType = "template_error";
	{
		char	   *text = TemplateRenderText(JsonGetString(step->spec, "until"), ctx, NULL);

		ExecutorErrorType = "error";
		return DatumGetTimestampTz(DirectFunctionCall3(timestamptz_in, CStringGetDatum(text),
													   ObjectIdGetDatum(InvalidOid),
													   Int32GetDatum(-1)));
	}
}

/*
 * Add until (for people) and wake_epoch (Unix seconds, from which the
 * checkpoint sets tuvl.runs.wake_at) to the awaiting object of a run that
 * parks until then: a Sleep step, a Human step's or an approval's timeout.
 */
void
StepSleepAddWake(JsonObjBuilder *b, TimestampTz until)
{
	JsonObjAddString(b, "until", timestamptz_to_str(until));
	JsonObjAddJsonb(b, "wake_epoch",
					JsonFromCString(psprintf("%.6f", (double) until / USECS_PER_SEC +
											 (double) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * SECS_PER_DAY)));
}

void
StepExecuteSleep(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	Jsonb	   *rec = EffectFindOp(run, "sleep");
	TimestampTz until = rec ? (TimestampTz) JsonGetInt(rec, "until_us", 0) : 0;
	JsonObjBuilder b;

	if (rec == NULL)
	{
		until = sleep_until(step, ctx);
		JsonObjStart(&b);
		JsonObjAddString(&b, "op", "sleep");
		JsonObjAddInt(&b, "until_us", until);
		EffectRecord(run, JsonObjEnd(&b));
	}
	result->has_output = false;
	/* its time has come (a replay does not wait) */
	if (run->replay || GetCurrentTimestamp() >= until)
		return;
	JsonObjStart(&b);
	JsonObjAddString(&b, "kind", "sleep");
	StepSleepAddWake(&b, until);
	result->park = RUN_SLEEPING;
	result->park_info = JsonObjEnd(&b);
}


/* ---------------------------------------------------------------- validation */

static const char *const sleep_keys[] = {"for", "until", NULL};

/*
 * A Sleep step: for (a duration, also in days: 2d) or until (a timestamp
 * template), exactly one; it writes no output.
 */
static void
validate_sleep(ValidateState *vs, Jsonb *step, const char *path)
{
	JsonbValue *f = JsonGetField(step, "for");
	JsonbValue *u = JsonGetField(step, "until");
	int64		ms;

	if ((f == NULL) == (u == NULL))
		ValidateFinding(vs, "error", path,
						"a Sleep step needs for: a duration such as 10m, or until: a time such as \"{{ remind_at }}\" (one of the two)");
	if (f)
	{
		char	   *text = f->type == jbvString ? pnstrdup(f->val.string.val, f->val.string.len) :
		f->type == jbvNumeric ? JsonValueToText(f) : NULL;

		if (text == NULL || !DurationParseLong(text, &ms))
			ValidateFinding(vs, "error", psprintf("%s.for", path),
							"for must be a duration such as 30s, 10m, 2h or 3d");
	}
	if (u && u->type != jbvString)
		ValidateFinding(vs, "error", psprintf("%s.until", path),
						"until must be a time, such as \"2026-12-24 09:00+01\" or \"{{ remind_at }}\"");
	if (JsonGetField(step, "output"))
		ValidateFinding(vs, "error", psprintf("%s.output", path), "a Sleep step writes no output");
}

/* The Sleep step's row of the step table (init.c). */
const StepExecutor StepKindSleep = {
	.kind = STEP_SLEEP,
	.execute = StepExecuteSleep,
	.keys = sleep_keys,
	.validate = validate_sleep,
};
