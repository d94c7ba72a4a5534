/*-------------------------------------------------------------------------
 *
 * ratelimit.c
 *	  Rate limits: at most limit starts of a run, or entries into a step,
 *	  in any window of length per, per rendered key.
 *
 * A workflow's top-level rate_limit admits runs; a step's (APICall, MCP,
 * Agent) admits each entry into the step.  Each admission reserves a
 * time in tuvl.rate_limit_grants, the log of a bucket: the run or the step
 * may go at the earliest time t, not before the bucket's latest
 * reservation (admissions keep the order they were asked in), such that
 * the limit-th latest reservation is at least per before t.  Then no
 * window of length per holds more than limit reservations.  A run or step
 * whose time is later sleeps until then (tuvl.runs.wake_at, woken by the
 * workers' maintenance as any Sleep step): no worker holds it, and the
 * time is in its row, so it survives a restart or a failover and goes
 * once.  Reservations older than per are pruned when the bucket is used.
 * A start for later (not_before, debounce) reserves for that time, and the
 * bucket's later starts keep their order behind it.
 *
 * A bucket is the workflow's, the principal's and the key's (and the
 * limit's and per's): as for concurrency keys, the runs one role starts
 * never use, hold back or learn of another role's budget, and no SQL
 * reaches the log.  Reservations of one bucket are serialized by tuvl's
 * own lock on it (SecurityLockKey); only sessions of the bucket's role
 * and the workers take it.  A session waits for it; a worker never does:
 * finding it taken, it postpones the run as for any lock held by another
 * session (RateLimitBusy), and tries again a second later.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "duration.h"
#include "ratelimit.h"
#include "security.h"
#include "spiutil.h"
#include "template.h"
#include "tuvl.h"

bool		RateLimitBusy = false;

/*
 * The rate_limit of spec (a workflow's definition or a step's mapping),
 * its key rendered against ctx; rl->key NULL when there is none.
 * Registration checked its form.
 */
void
RateLimitOf(Jsonb *spec, Jsonb *ctx, RateLimit *rl)
{
	Jsonb	   *r = JsonGetJsonb(spec, "rate_limit");
	char	   *tmpl = r && JsonIsObject(r) ? JsonGetString(r, "key") : NULL;
	JsonbValue *per;

	rl->key = NULL;
	rl->limit = 0;
	rl->per_ms = 0;
	if (tmpl == NULL)
		return;
	per = JsonGetField(r, "per");
	if (per == NULL || !DurationFromJson(per, &rl->per_ms) || rl->per_ms <= 0)
		rl->per_ms = 1000;
	rl->limit = Max(JsonGetInt32(r, "limit", 1), 1);
	rl->key = TemplateRenderText(tmpl, ctx, NULL);
}

/*
 * The bucket of a rate limit: scope ("run" for a workflow's admission of
 * runs, "step" for its steps'), the workflow, the principal, the limit,
 * per and the key.
 */
char *
RateLimitBucket(const char *scope, const char *workflow, Oid principal, const RateLimit *rl)
{
	return psprintf("%s/%s/%u/%d/%d/%s", scope, workflow, principal, rl->limit, rl->per_ms,
					rl->key);
}

/*
 * Reserve the earliest time at or after base when one more may go in
 * bucket; returns it.  SPI connected.
 */
TimestampTz
RateLimitReserve(const char *bucket, const RateLimit *rl, TimestampTz base)
{
	static const Oid types[4] = {TEXTOID, INT4OID, INT4OID, TIMESTAMPTZOID};
	Datum		values[4];
	SecurityFrame frame;
	Datum		d;

	if (MyTuvlSlot == NULL)
		SecurityLockKey("rate_limit", bucket);
	else if (!SecurityTryLockKey("rate_limit", bucket))
	{
		RateLimitBusy = true;
		ereport(ERROR,
				(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
				 errmsg("rate limit key \"%s\" is being admitted by another session", rl->key)));
	}
	values[0] = CStringGetTextDatum(bucket);
	values[1] = Int32GetDatum(rl->limit);
	values[2] = Int32GetDatum(rl->per_ms);
	values[3] = TimestampTzGetDatum(base);
	SecurityAsOwner(&frame);
	SpiExec("WITH pruned AS ( "
			"  DELETE FROM tuvl.rate_limit_grants o "
			"  WHERE o.bucket OPERATOR(pg_catalog.=) $1 "
			"    AND o.at OPERATOR(pg_catalog.<) (pg_catalog.statement_timestamp() OPERATOR(pg_catalog.-) "
			"        pg_catalog.make_interval(secs => ($3::pg_catalog.float8 OPERATOR(pg_catalog./) 1000)))), "
			"latest AS ( "
			"  SELECT g.at FROM tuvl.rate_limit_grants g WHERE g.bucket OPERATOR(pg_catalog.=) $1 "
			"  ORDER BY g.at DESC LIMIT $2) "
			"INSERT INTO tuvl.rate_limit_grants (bucket, at) "
			"SELECT $1, GREATEST($4, (SELECT pg_catalog.max(l.at) FROM latest l), "
			"  (SELECT CASE WHEN pg_catalog.count(*) OPERATOR(pg_catalog.=) $2 THEN pg_catalog.min(l.at) END "
			"   FROM latest l) OPERATOR(pg_catalog.+) "
			"  pg_catalog.make_interval(secs => ($3::pg_catalog.float8 OPERATOR(pg_catalog./) 1000))) "
			"RETURNING at",
			4, types, values, NULL, SPI_OK_INSERT_RETURNING);
	if (!SpiValue(1, &d))
		elog(ERROR, "no reservation in rate limit bucket \"%s\"", bucket);
	SecurityRestore(&frame);
	return DatumGetTimestampTz(d);
}

/*
 * Give back a time reserved in bucket that will not be used (a start that
 * found its key's run, a debounced start that moved on).  Reservations
 * at one time are alike: any one of them goes.  SPI connected.
 */
void
RateLimitRelease(const char *bucket, TimestampTz at)
{
	static const Oid types[2] = {TEXTOID, TIMESTAMPTZOID};
	Datum		values[2];
	SecurityFrame frame;

	values[0] = CStringGetTextDatum(bucket);
	values[1] = TimestampTzGetDatum(at);
	SecurityAsOwner(&frame);
	SpiExec("DELETE FROM tuvl.rate_limit_grants WHERE ctid OPERATOR(pg_catalog.=) ("
			"  SELECT g.ctid FROM tuvl.rate_limit_grants g WHERE g.bucket OPERATOR(pg_catalog.=) $1 "
			"    AND g.at OPERATOR(pg_catalog.=) $2 LIMIT 1)",
			2, types, values, NULL, SPI_OK_DELETE);
	SecurityRestore(&frame);
}

/* per, for people: "1 s", "500 ms" */
char *
RateLimitPerText(int per_ms)
{
	return per_ms % 1000 == 0 ? psprintf("%d s", per_ms / 1000) : psprintf("%d ms", per_ms);
}

/*
 * What a run or step waiting for rl waits for: the key, the limit, per
 * and until (with until_us and wake_epoch, from which the checkpoint sets
 * wake_at).
 */
void
RateLimitDescribe(JsonObjBuilder *b, const RateLimit *rl, TimestampTz until)
{
	JsonObjAddString(b, "key", rl->key);
	JsonObjAddInt(b, "limit", rl->limit);
	JsonObjAddString(b, "per", RateLimitPerText(rl->per_ms));
	JsonObjAddInt(b, "until_us", until);

	/*
	 * as a Sleep step's (step_sleep.c), from which the checkpoint sets
	 * wake_at
	 */
	JsonObjAddString(b, "until", timestamptz_to_str(until));
	JsonObjAddJsonb(b, "wake_epoch",
					JsonFromCString(psprintf("%.6f", (double) until / USECS_PER_SEC +
											 (double) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * SECS_PER_DAY)));
}

/*
 * A step with a rate_limit, about to execute: on entering it, reserve its
 * time; a step whose time has not come parks the run sleeping until then
 * (result->park, true).  Woken, it goes on (false).  A replay ignores
 * limits.  In the transition's subtransaction, as the step.
 */
bool
RateLimitStep(RunState *run, const StepDef *step, Jsonb *ctx, bool first_entry,
			  StepResult *result)
{
	Jsonb	   *awaiting;
	TimestampTz now;
	TimestampTz until;
	RateLimit	rl;
	JsonObjBuilder b;
	char	   *kind;

	if (run->replay || JsonGetField(step->spec, "rate_limit") == NULL)
		return false;
	now = GetCurrentTimestamp();
	if (!first_entry)
	{
		/* woken from its wait, or going on after an effect: admitted */
		awaiting = run->step_state ? JsonGetJsonb(run->step_state, "awaiting") : NULL;
		kind = awaiting ? JsonGetString(awaiting, "kind") : NULL;
		if (kind == NULL || strcmp(kind, "rate_limit") != 0)
			return false;
		until = (TimestampTz) JsonGetInt(awaiting, "until_us", 0);
		if (now >= until)
			return false;
		result->park = RUN_SLEEPING;
		result->park_info = awaiting;
		return true;
	}

	ExecutorErrorType = "template_error";
	RateLimitOf(step->spec, ctx, &rl);
	ExecutorErrorType = "error";
	until = RateLimitReserve(RateLimitBucket("step", run->workflow, run->principal, &rl),
							 &rl, now);
	if (until <= now)
		return false;
	JsonObjStart(&b);
	JsonObjAddString(&b, "kind", "rate_limit");
	RateLimitDescribe(&b, &rl, until);
	result->park = RUN_SLEEPING;
	result->park_info = JsonObjEnd(&b);
	return true;
}
