/*-------------------------------------------------------------------------
 *
 * retry.c
 *	  Retry policies of effects: the retry block of a step, the backoff
 *	  between attempts and the server's Retry-After.
 *
 * The APICall step (step_http.c) and the Agent step (agent_completion.c,
 * agent_loop.c) read the same retry block {on: [...], attempts: n, backoff: duration}
 * and wait the same way: base * 2^(failures - 1) plus up to half again of
 * jitter, at most RETRY_MAX_BACKOFF_MS, unless the server said how long
 * (Retry-After), which wins.  What differs is kept by the callers:
 *
 * - the default number of attempts: 1 for APICall (no retry unless asked),
 *   3 for Agent;
 * - the conditions consulted: APICall retries on 429, 5xx, timeout and
 *   error; Agent passes no status (llm.c has already classified a model's
 *   429 and 5xx as "error") and retries only what llm.c marked transient;
 * - how Retry-After is read (RetryAfterMs flags and cap): APICall accepts
 *   RFC 9110 delta-seconds or an HTTP date, capped at 5 minutes; llm.c
 *   reads retry-after-ms first, then decimal seconds only, capped at 60
 *   seconds.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <math.h>
#include <time.h>
#include <curl/curl.h>

#include "common/pg_prng.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"

#include "jsonutil.h"
#include "retry.h"
#include "workflow.h"

/* Set the condition named by one element of retry.on (a string or a number). */
static void
parse_condition(JsonbValue *e, RetryPolicy *rp)
{
	char	   *s;

	if (e->type == jbvNumeric)
		s = DatumGetCString(DirectFunctionCall1(numeric_out, NumericGetDatum(e->val.numeric)));
	else if (e->type == jbvString)
		s = pnstrdup(e->val.string.val, e->val.string.len);
	else
		return;
	rp->on_timeout |= strcmp(s, "timeout") == 0;
	rp->on_error |= strcmp(s, "error") == 0;
	rp->on_429 |= strcmp(s, "429") == 0;
	rp->on_5xx |= strcmp(s, "5xx") == 0;
}

/*
 * Read a retry block (NULL, or anything but an object: the defaults).
 * Without "on", every condition retries; attempts default to
 * default_attempts, backoff to RETRY_DEFAULT_BACKOFF_MS.
 */
void
RetryParse(Jsonb *retry, int default_attempts, RetryPolicy *rp)
{
	JsonbValue *on;

	rp->attempts = default_attempts;
	rp->backoff_ms = RETRY_DEFAULT_BACKOFF_MS;
	rp->on_timeout = rp->on_error = rp->on_429 = rp->on_5xx = true;
	if (!JsonIsObject(retry))
		return;
	rp->attempts = Max(1, JsonGetInt32(retry, "attempts", default_attempts));
	(void) DurationFromJson(JsonGetField(retry, "backoff"), &rp->backoff_ms);
	on = JsonGetField(retry, "on");
	if (on == NULL || on->type != jbvBinary)
		return;
	rp->on_timeout = rp->on_error = rp->on_429 = rp->on_5xx = false;
	for (int i = 0; i < (int) JsonContainerSize(on->val.binary.data); i++)
		parse_condition(getIthJsonbValueFromContainer(on->val.binary.data, i), rp);
}

/*
 * May a failure be retried, after attempts_made attempts?  status is the
 * HTTP status (0: none, or not to be consulted), error_kind the kind of
 * transport failure ("timeout", "error") or NULL.
 */
bool
RetryAllowed(const RetryPolicy *rp, int attempts_made, int status, const char *error_kind)
{
	if (attempts_made >= rp->attempts)
		return false;
	if (status == 429)
		return rp->on_429;
	if (status >= 500)
		return rp->on_5xx;
	if (error_kind && strcmp(error_kind, "timeout") == 0)
		return rp->on_timeout;
	if (error_kind && strcmp(error_kind, "error") == 0)
		return rp->on_error;
	return false;
}

/* Exponential backoff with jitter: base * 2^(n-1), plus up to half again. */
int
RetryBackoffMs(const RetryPolicy *rp, int failures)
{
	double		d = rp->backoff_ms * pow(2.0, Max(failures - 1, 0));

	d += d * 0.5 * pg_prng_double(&pg_global_prng_state);
	return (int) Min(d, RETRY_MAX_BACKOFF_MS);
}

/* The wait before the next attempt: the server's word (>= 0), else backoff. */
int
RetryDelayMs(const RetryPolicy *rp, int failures, int retry_after_ms)
{
	return retry_after_ms >= 0 ? retry_after_ms : RetryBackoffMs(rp, failures);
}

/* Milliseconds from RFC 9110 Retry-After (seconds or HTTP date), or -1. */
static int
http_retry_after(const char *ra, int cap_ms)
{
	char	   *end;
	double		secs = strtod(ra, &end);
	time_t		when;

	if (end != ra && *end == '\0' && secs >= 0)
		return (int) Min(secs * 1000, cap_ms);
	when = curl_getdate(ra, NULL);
	if (when > 0)
	{
		double		delta = difftime(when, time(NULL));

		return (int) Min(Max(delta, 0) * 1000, cap_ms);
	}
	return -1;
}

/*
 * Milliseconds the journaled result of a request (its "headers", names
 * lower-case) asks to wait, at most cap_ms; -1 when it does not say.  With
 * RETRY_AFTER_MS_HEADER, retry-after-ms comes first; with
 * RETRY_AFTER_HTTP_DATE, Retry-After is RFC 9110's, else only digits and
 * dots (decimal seconds) are accepted.
 */
int
RetryAfterMs(Jsonb *result, int cap_ms, int flags)
{
	Jsonb	   *h = JsonGetJsonb(result, "headers");
	char	   *ms = h && (flags & RETRY_AFTER_MS_HEADER) ? JsonGetString(h, "retry-after-ms") : NULL;
	char	   *s = h ? JsonGetString(h, "retry-after") : NULL;

	if (ms && atof(ms) >= 0)
		return (int) Min(atof(ms), cap_ms);
	if (s == NULL)
		return -1;
	if (flags & RETRY_AFTER_HTTP_DATE)
		return http_retry_after(s, cap_ms);
	if (atof(s) >= 0 && strspn(s, "0123456789.") == strlen(s))
		return (int) Min(atof(s) * 1000, cap_ms);
	return -1;
}
