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

#include <curl/curl.h>

#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"

#include "effect.h"
#include "executor.h"
#include "jsonutil.h"
#include "retry.h"
#include "template.h"
#include "tuvl.h"
#include "workflow.h"

/* Longest Retry-After honoured, in milliseconds (RetryAfterMs). */
#define MAX_RETRY_AFTER_MS (5 * 60 * 1000)

/*
 * http.retry: no retry unless asked (one attempt); when asked, on 429, 5xx,
 * timeout and error unless "on" says otherwise (retry.c).
 */
#define HTTP_DEFAULT_ATTEMPTS 1

static char *
url_with_query(const char *url, Jsonb *query, Jsonb *ctx, SecretUse *use)
{
	StringInfoData buf;
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;
	bool		first = strchr(url, '?') == NULL;

	if (query == NULL || !JsonIsObject(query))
		return (char *) url;
	initStringInfo(&buf);
	appendStringInfoString(&buf, url);
	it = JsonbIteratorInit(&query->root);
	while (JsonObjectNext(&it, &key, &v))
	{
		JsonbValue *val = TemplateRenderValue(&v, ctx, &use->opts);
		char	   *text;
		char	   *ek;
		char	   *ev;

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

/* Add a header to a request (name and value are not copied). */
static void
add_header(EffectRequest *req, const char *name, const char *value)
{
	HttpHeader *h = palloc(sizeof(HttpHeader));

	h->name = (char *) name;
	h->value = (char *) value;
	req->http.headers = lappend(req->http.headers, h);
}

/* Render http.headers into the request; true when one is Content-Type. */
static bool
render_headers(EffectRequest *req, JsonbValue *headers, Jsonb *ctx, SecretUse *use)
{
	JsonbIterator *it;
	JsonbValue	v;
	char	   *name;
	bool		has_ctype = false;

	if (headers == NULL || headers->type != jbvBinary)
		return false;
	it = JsonbIteratorInit(headers->val.binary.data);
	while (JsonObjectNext(&it, &name, &v))
	{
		char	   *value = JsonValueToText(TemplateRenderValue(&v, ctx, &use->opts));

		if (strpbrk(name, "\r\n:") || strpbrk(value, "\r\n"))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("HTTP header \"%s\" contains a line break or an invalid character",
							SecretScrub(name, use->values)),
					 errhint("Header names and values must be single lines.")));
		if (pg_strcasecmp(name, "content-type") == 0)
			has_ctype = true;
		add_header(req, name, value);
	}
	return has_ctype;
}

/*
 * Render http.body into the request: a string is sent as text, anything
 * else as JSON, with a Content-Type to match unless one was given.
 */
static void
render_body(EffectRequest *req, JsonbValue *body, Jsonb *ctx, SecretUse *use, bool has_ctype)
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
		add_header(req, "Content-Type",
				   rendered->type == jbvString ? "text/plain; charset=utf-8" : "application/json");
}

/*
 * The journal form of a request: the method and the URL with secrets and
 * credentials removed, the idempotency key, and the digest of the body
 * sent, without its secrets (replay compares it).
 */
static Jsonb *
journal_form(EffectRequest *req, SecretUse *use)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "method", req->http.method);
	JsonObjAddString(&b, "url", SecretScrub(HttpRedactUrl(req->http.url), use->values));
	if (req->idempotency_key)
		JsonObjAddString(&b, "idempotency_key", req->idempotency_key);
	if (req->http.body)
	{
		char		digest[33];
		const char *errstr = NULL;
		char	   *scrubbed = SecretScrub(req->http.body, use->values);

		if (pg_md5_hash(scrubbed, strlen(scrubbed), digest, &errstr))
			JsonObjAddString(&b, "body_md5", digest);
	}
	return JsonObjEnd(&b);
}

/*
 * Render the http block into a request.  The journal form carries the
 * method and the URL with secrets and credentials removed.
 */
static EffectRequest *
build_request(RunState *run, const StepDef *step, Jsonb *http, Jsonb *ctx, SecretUse *use)
{
	EffectRequest *req = palloc0(sizeof(EffectRequest));
	char	   *method = JsonGetString(http, "method");
	char	   *url;
	JsonbValue *body = JsonGetField(http, "body");
	char	   *idem = JsonGetString(http, "idempotency");
	bool		has_ctype;
	int			timeout_ms = tuvl_http_timeout;

	ExecutorErrorType = "template_error";
	url = TemplateRenderText(JsonGetString(http, "url"), ctx, &use->opts);
	url = url_with_query(url, JsonGetJsonb(http, "query"), ctx, use);
	req->http.method = pstrdup(method ? method : (body ? "POST" : "GET"));
	for (char *c = (char *) req->http.method; *c; c++)
		*c = pg_toupper((unsigned char) *c);
	req->http.url = url;
	(void) DurationFromJson(JsonGetField(http, "timeout"), &timeout_ms);
	req->http.timeout_ms = timeout_ms;

	has_ctype = render_headers(req, JsonGetField(http, "headers"), ctx, use);
	if (body && body->type != jbvNull)
		render_body(req, body, ctx, use, has_ctype);
	if (idem && strcmp(idem, "auto") == 0)
	{
		req->idempotency_key = EffectKey(run, 0);
		add_header(req, "Idempotency-Key", req->idempotency_key);
	}
	ExecutorErrorType = "http_error";
	EffectCheckAllowed(url, use->values);

	req->secrets = use->values;
	req->journal = journal_form(req, use);
	return req;
}

/* What went wrong with a final result, for _last_error. */
static char *
describe_failure(const char *method, Jsonb *journal, Jsonb *res)
{
	int			status = JsonGetInt32(res, "status", 0);
	char	   *url = JsonGetString(journal, "url");
	char	   *err = JsonGetString(res, "error");
	char	   *body_error = JsonGetString(res, "body_error");

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

	RetryParse(JsonGetJsonb(http, "retry"), HTTP_DEFAULT_ATTEMPTS, &rp);
	SecretUseInit(&use, run);
	req = build_request(run, step, http, ctx, &use);

	if (last == NULL)
	{
		result->pending = true;
		result->effect = req;
		return;
	}

	{
		int			status = JsonGetInt32(last, "status", 0);
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
		if (RetryAllowed(&rp, n, status, JsonGetString(last, "error_kind")))
		{
			/* Retry-After in seconds or as an HTTP date, at most 5 minutes */
			req->delay_ms = RetryDelayMs(&rp, n, RetryAfterMs(last, MAX_RETRY_AFTER_MS,
															  RETRY_AFTER_HTTP_DATE));
			result->pending = true;
			result->effect = req;
			return;
		}
		ExecutorErrorType = status == 429 ? "http_429" : status >= 500 ? "http_5xx" :
			status >= 400 ? "http_4xx" : "http_error";
		{
			char	   *kind = JsonGetString(last, "error_kind");

			if (kind && strcmp(kind, "timeout") == 0)
				ExecutorErrorType = "timeout";
		}
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("%s", describe_failure(req->http.method, req->journal, last)),
				 n > 1 ? errdetail("Gave up after %d attempts.", n) : 0));
	}
}


/* ---------------------------------------------------------------- validation */

static const char *const apicall_keys[] = {"http", "rate_limit", NULL};

/* The http mapping of an APICall step. */
static void
check_http_block(ValidateState *vs, Jsonb *http, const char *hpath)
{
	static const char *const methods[] = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS",
	"get", "post", "put", "patch", "delete", "head", "options", NULL};
	static const char *const http_on[] = {"timeout", "error", "429", "5xx", NULL};
	static const char *const idem[] = {"auto", "none", NULL};
	static const char *const bodiless[] = {"GET", "get", "HEAD", "head", NULL};
	static const char *const http_keys[] = {"method", "url", "headers", "query", "body", "timeout",
	"idempotency", "retry", NULL};
	JsonbValue *v;

	ValidateUnknownKeys(vs, http, hpath, http_keys, NULL);
	ValidateRequireString(vs, http, "url", hpath, "the http mapping");
	ValidateDuration(vs, http, "timeout", hpath);
	v = JsonGetField(http, "method");
	if (v && !ValidateStringIn(v, methods))
		ValidateFinding(vs, "error", psprintf("%s.method", hpath),
						"method must be one of GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS");
	else if (v && JsonGetField(http, "body") &&
			 ValidateStringIn(v, bodiless))
		ValidateFinding(vs, "error", psprintf("%s.body", hpath),
						"a GET or HEAD request cannot carry a body; use POST, or move the values to query");
	ValidateScalarMapping(vs, http, "headers", hpath, "{ Content-Type: application/json }");
	ValidateScalarMapping(vs, http, "query", hpath, "{ q: \"{{ term }}\" }");
	v = JsonGetField(http, "idempotency");
	if (v && !ValidateStringIn(v, idem))
		ValidateFinding(vs, "error", psprintf("%s.idempotency", hpath),
						"idempotency must be auto or none");
	ValidateRetry(vs, http, hpath, http_on, "[timeout, error, 429, 5xx]");
}

static void
validate_apicall(ValidateState *vs, Jsonb *step, const char *path)
{
	ValidateStepMapping(vs, step, path, "http", check_http_block,
						"an APICall step needs an http mapping with at least a url");
}

/* The APICall's row of the step table (init.c). */
const StepExecutor StepKindAPICall = {
	.kind = STEP_APICALL,
	.execute = StepExecuteAPICall,
	.tool_callable = true,
	.keys = apicall_keys,
	.validate = validate_apicall,
	.rate_limited = true,
};
