/*-------------------------------------------------------------------------
 *
 * step_http.c
 *	  The APICall step: one HTTP request as an effect, with retries.
 *
 * Each transition re-renders the request from the context (templates are
 * deterministic) and looks at the results journaled so far for this
 * step: none yet means "send the first attempt"; a retryable failure with
 * attempts left means "send again after a backoff"; anything else is the
 * outcome.  All attempts carry the same Idempotency-Key when the step
 * asks for one.  2xx gives the default signal and writes {status,
 * headers, body} to the output key; any other outcome raises, which the
 * runtime turns into the error signal with _last_error naming the status.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "common/md5.h"

#include <math.h>
#include <curl/curl.h>

#include "common/pg_prng.h"
#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"

#include "effect.h"
#include "executor.h"
#include "jsonutil.h"
#include "template.h"
#include "tuvl.h"
#include "workflow.h"

/* Longest Retry-After honoured, in milliseconds. */
#define MAX_RETRY_AFTER_MS (5 * 60 * 1000)

typedef struct RetryPolicy
{
	int			attempts;
	int			backoff_ms;
	bool		on_timeout;
	bool		on_error;
	bool		on_429;
	bool		on_5xx;
} RetryPolicy;

static void
parse_retry(Jsonb *http, RetryPolicy *rp)
{
	JsonbValue *r = JsonGetField(http, "retry");
	Jsonb	   *retry;
	JsonbValue *v;

	memset(rp, 0, sizeof(RetryPolicy));
	rp->attempts = 1;
	rp->backoff_ms = 1000;
	if (r == NULL || r->type != jbvBinary)
		return;
	retry = JsonValueToJsonb(r);
	v = JsonGetField(retry, "attempts");
	if (v && v->type == jbvNumeric)
		rp->attempts = Max(1, DatumGetInt32(DirectFunctionCall1(numeric_int4,
																NumericGetDatum(v->val.numeric))));
	(void) DurationFromJson(JsonGetField(retry, "backoff"), &rp->backoff_ms);
	v = JsonGetField(retry, "on");
	if (v && v->type == jbvBinary)
	{
		int			n = JsonContainerSize(v->val.binary.data);

		for (int i = 0; i < n; i++)
		{
			JsonbValue *e = getIthJsonbValueFromContainer(v->val.binary.data, i);
			char	   *s;

			if (e->type == jbvNumeric)
				s = DatumGetCString(DirectFunctionCall1(numeric_out, NumericGetDatum(e->val.numeric)));
			else if (e->type == jbvString)
				s = pnstrdup(e->val.string.val, e->val.string.len);
			else
				continue;
			rp->on_timeout |= strcmp(s, "timeout") == 0;
			rp->on_error |= strcmp(s, "error") == 0;
			rp->on_429 |= strcmp(s, "429") == 0;
			rp->on_5xx |= strcmp(s, "5xx") == 0;
		}
	}
	else
		rp->on_timeout = rp->on_error = rp->on_429 = rp->on_5xx = true;
}

static char *
json_text_field(Jsonb *j, const char *key)
{
	JsonbValue *v = JsonGetField(j, key);

	return v && v->type == jbvString ? pnstrdup(v->val.string.val, v->val.string.len) : NULL;
}

static int
result_status(Jsonb *res)
{
	JsonbValue *v = JsonGetField(res, "status");

	if (v == NULL || v->type != jbvNumeric)
		return 0;
	return DatumGetInt32(DirectFunctionCall1(numeric_int4, NumericGetDatum(v->val.numeric)));
}

/* Should this result be retried under the policy? */
static bool
retryable(Jsonb *res, RetryPolicy *rp)
{
	int			status = result_status(res);
	char	   *kind = json_text_field(res, "error_kind");

	if (status == 429)
		return rp->on_429;
	if (status >= 500)
		return rp->on_5xx;
	if (kind && strcmp(kind, "timeout") == 0)
		return rp->on_timeout;
	if (kind && strcmp(kind, "error") == 0)
		return rp->on_error;
	return false;
}

/* Milliseconds from a Retry-After header (seconds or HTTP date), or -1. */
static int
retry_after_ms(Jsonb *res)
{
	Jsonb	   *headers = JsonGetJsonb(res, "headers");
	char	   *ra = headers ? json_text_field(headers, "retry-after") : NULL;
	char	   *end;
	double		secs;

	if (ra == NULL)
		return -1;
	secs = strtod(ra, &end);
	if (end != ra && *end == '\0' && secs >= 0)
		return (int) Min(secs * 1000, MAX_RETRY_AFTER_MS);
	{
		time_t		when = curl_getdate(ra, NULL);

		if (when > 0)
		{
			double		delta = difftime(when, time(NULL));

			return (int) Min(Max(delta, 0) * 1000, MAX_RETRY_AFTER_MS);
		}
	}
	return -1;
}

/* Exponential backoff with jitter: base * 2^(n-1), plus up to half again. */
static int
backoff_ms(RetryPolicy *rp, int failures)
{
	double		d = rp->backoff_ms * pow(2.0, Max(failures - 1, 0));

	d += d * 0.5 * pg_prng_double(&pg_global_prng_state);
	return (int) Min(d, 10 * 60 * 1000);
}

static char *
url_with_query(const char *url, Jsonb *query, Jsonb *ctx, SecretUse *use)
{
	StringInfoData buf;
	JsonbIterator *it;
	JsonbValue	v;
	JsonbIteratorToken tok;
	bool		first = strchr(url, '?') == NULL;

	if (query == NULL || !JsonIsObject(query))
		return (char *) url;
	initStringInfo(&buf);
	appendStringInfoString(&buf, url);
	it = JsonbIteratorInit(&query->root);
	while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
	{
		char	   *key;
		JsonbValue *val;
		char	   *text;
		char	   *ek;
		char	   *ev;

		if (tok != WJB_KEY)
			continue;
		key = pnstrdup(v.val.string.val, v.val.string.len);
		tok = JsonbIteratorNext(&it, &v, true);
		val = TemplateRenderValue(&v, ctx, &use->opts);
		if (val->type == jbvNull)
			continue;
		text = JsonValueToText(val);
		ek = curl_easy_escape(NULL, key, 0);
		ev = curl_easy_escape(NULL, text, 0);
		appendStringInfo(&buf, "%c%s=%s", first ? '?' : '&', ek, ev);
		curl_free(ek);
		curl_free(ev);
		first = false;
	}
	return buf.data;
}

/*
 * Render the http block into a request.  The journal form carries the
 * method and the URL with secrets and credentials removed.
 */
static EffectRequest *
build_request(RunState *run, const StepDef *step, Jsonb *http, Jsonb *ctx, SecretUse *use)
{
	EffectRequest *req = palloc0(sizeof(EffectRequest));
	char	   *method = json_text_field(http, "method");
	char	   *url;
	JsonbValue *headers = JsonGetField(http, "headers");
	JsonbValue *body = JsonGetField(http, "body");
	char	   *idem = json_text_field(http, "idempotency");
	bool		has_ctype = false;
	JsonObjBuilder b;
	int			timeout_ms = tuvl_http_timeout;

	StepErrorType = "template_error";
	url = TemplateRenderText(json_text_field(http, "url"), ctx, &use->opts);
	url = url_with_query(url, JsonGetJsonb(http, "query"), ctx, use);
	req->http.method = pstrdup(method ? method : (body ? "POST" : "GET"));
	for (char *c = (char *) req->http.method; *c; c++)
		*c = pg_toupper((unsigned char) *c);
	req->http.url = url;
	(void) DurationFromJson(JsonGetField(http, "timeout"), &timeout_ms);
	req->http.timeout_ms = timeout_ms;

	if (headers && headers->type == jbvBinary)
	{
		JsonbIterator *it = JsonbIteratorInit(headers->val.binary.data);
		JsonbValue	v;
		JsonbIteratorToken tok;

		while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
		{
			HttpHeader *h;

			if (tok != WJB_KEY)
				continue;
			h = palloc(sizeof(HttpHeader));
			h->name = pnstrdup(v.val.string.val, v.val.string.len);
			tok = JsonbIteratorNext(&it, &v, true);
			h->value = JsonValueToText(TemplateRenderValue(&v, ctx, &use->opts));
			if (strpbrk(h->name, "\r\n:") || strpbrk(h->value, "\r\n"))
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("HTTP header \"%s\" contains a line break or an invalid character",
								SecretScrub(h->name, use->values)),
						 errhint("Header names and values must be single lines.")));
			if (pg_strcasecmp(h->name, "content-type") == 0)
				has_ctype = true;
			req->http.headers = lappend(req->http.headers, h);
		}
	}
	if (body && body->type != jbvNull)
	{
		JsonbValue *rendered = TemplateRenderValue(body, ctx, &use->opts);
		char	   *text;

		if (rendered->type == jbvString)
			text = pnstrdup(rendered->val.string.val, rendered->val.string.len);
		else
		{
			Jsonb	   *j = JsonValueToJsonb(rendered);

			text = JsonbToCString(NULL, &j->root, VARSIZE(j));
		}
		req->http.body = text;
		req->http.body_len = strlen(text);
		if (!has_ctype)
		{
			HttpHeader *h = palloc(sizeof(HttpHeader));

			h->name = "Content-Type";
			h->value = rendered->type == jbvString ? "text/plain; charset=utf-8" : "application/json";
			req->http.headers = lappend(req->http.headers, h);
		}
	}
	if (idem && strcmp(idem, "auto") == 0)
	{
		HttpHeader *h = palloc(sizeof(HttpHeader));

		req->idempotency_key = EffectKey(run, 0);
		h->name = "Idempotency-Key";
		h->value = req->idempotency_key;
		req->http.headers = lappend(req->http.headers, h);
	}
	StepErrorType = "http_error";
	EffectCheckAllowed(url, use->values);

	req->secrets = use->values;
	JsonObjStart(&b);
	JsonObjAddString(&b, "method", req->http.method);
	JsonObjAddString(&b, "url", SecretScrub(HttpRedactUrl(url), use->values));
	if (req->idempotency_key)
		JsonObjAddString(&b, "idempotency_key", req->idempotency_key);
	/* what was sent, without its secrets: replay compares it */
	if (req->http.body)
	{
		char		digest[33];
		const char *errstr = NULL;
		char	   *scrubbed = SecretScrub(req->http.body, use->values);

		if (pg_md5_hash(scrubbed, strlen(scrubbed), digest, &errstr))
			JsonObjAddString(&b, "body_md5", digest);
	}
	req->journal = JsonObjEnd(&b);
	return req;
}

/* What went wrong with a final result, for _last_error. */
static char *
describe_failure(const char *method, Jsonb *journal, Jsonb *res)
{
	int			status = result_status(res);
	char	   *url = json_text_field(journal, "url");
	char	   *err = json_text_field(res, "error");
	char	   *body_error = json_text_field(res, "body_error");

	if (status > 0 && body_error)
		return psprintf("%s %s: %s", method, url, body_error);
	if (status > 0)
		return psprintf("%s %s returned HTTP %d", method, url, status);
	return psprintf("%s %s failed: %s", method, url, err ? err : "unknown error");
}

void
StepExecuteAPICall(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	Jsonb	   *http = JsonGetJsonb(step->spec, "http");
	RetryPolicy rp;
	SecretUse	use;
	EffectRequest *req;
	int			n = EffectCount(run);
	Jsonb	   *last = n > 0 ? EffectAt(run, n - 1) : NULL;

	parse_retry(http, &rp);
	SecretUseInit(&use, run);
	req = build_request(run, step, http, ctx, &use);

	if (last == NULL)
	{
		result->pending = true;
		result->effect = req;
		return;
	}

	{
		int			status = result_status(last);
		bool		ok = status >= 200 && status < 300 &&
			JsonGetField(last, "body_error") == NULL;

		if (ok)
		{
			JsonObjBuilder b;

			JsonObjStart(&b);
			JsonObjAddInt(&b, "status", status);
			JsonObjAddValue(&b, "headers", JsonGetField(last, "headers"));
			JsonObjAddValue(&b, "body", JsonGetField(last, "body"));
			result->output = JsonObjEnd(&b);
			result->has_output = true;
			return;
		}
		if (retryable(last, &rp) && n < rp.attempts)
		{
			int			ra = retry_after_ms(last);

			req->delay_ms = ra >= 0 ? Max(ra, 0) : backoff_ms(&rp, n);
			result->pending = true;
			result->effect = req;
			return;
		}
		StepErrorType = status == 429 ? "http_429" : status >= 500 ? "http_5xx" :
			status >= 400 ? "http_4xx" : "http_error";
		{
			char	   *kind = json_text_field(last, "error_kind");

			if (kind && strcmp(kind, "timeout") == 0)
				StepErrorType = "timeout";
		}
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("%s", describe_failure(req->http.method, req->journal, last)),
				 n > 1 ? errdetail("Gave up after %d attempts.", n) : 0));
	}
}
