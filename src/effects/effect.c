/*-------------------------------------------------------------------------
 *
 * effect.c
 *	  Effects: work outside the database whose results are journaled
 *	  before anything uses them.
 *
 * A step that needs an effect returns it as an EffectRequest; the runtime
 * journals tool_call, commits, and the worker (or the synchronous path)
 * performs the request outside any transaction.  The next transition
 * journals the result as tool_result, appends it to the run's step_state
 * and executes the step again, which now finds the result at the effect's
 * position (EffectAt) and continues.  A run reclaimed after a crash sees
 * exactly the results that were journaled, so only the effect in flight
 * at the crash is repeated, with the same idempotency key.
 *
 * The secrets a request was rendered with are secret.c's.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <curl/curl.h>

#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "common/hashfn.h"
#include "common/jsonapi.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "storage/latch.h"
#include "utils/builtins.h"
#include "utils/json.h"
#include "utils/memutils.h"
#include "utils/numeric.h"
#include "pgstat.h"

#include "admission.h"
#include "effect.h"
#include "jsonutil.h"
#include "retry.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"

/*
 * Raise when url may not be reached, naming it without its secrets.
 */
void
EffectCheckAllowed(const char *url, List *secrets)
{
	char	   *reason;

	if (!HttpUrlAllowed(url, &reason))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("HTTP request to %s is not allowed",
						SecretScrub(HttpRedactUrl(url), secrets)),
				 errdetail("%s.", SecretScrub(reason, secrets)),
				 errhint("A superuser can add the host to tuvl.http_allowed_hosts, for example 'api.example.com:443'.")));
}

int
EffectCount(RunState *run)
{
	int			folded = run->working_effects ? JsonContainerSize(&run->working_effects->root) : 0;

	return folded + list_length(run->effects_added);
}

/* The journaled result of the step's effect at position, or NULL. */
Jsonb *
EffectAt(RunState *run, int position)
{
	int			folded = run->working_effects ? JsonContainerSize(&run->working_effects->root) : 0;

	if (position < 0 || position >= EffectCount(run))
		return NULL;
	if (position >= folded)
		return list_nth(run->effects_added, position - folded);
	return JsonValueToJsonb(getIthJsonbValueFromContainer(&run->working_effects->root,
														  position));
}

/*
 * The step's records as one array (NULL: none yet), with those
 * EffectRecord appended folded in: one copy of the array per call that
 * folds something, not one per record, so a step that records many
 * things in a transition (an agent's tool calls) stays linear.
 */
Jsonb *
EffectRecords(RunState *run)
{
	if (run->effects_added != NIL)
	{
		JsonArrayBuilder ab;
		ListCell   *lc;

		JsonArrayBuildStart(&ab, run->working_effects);
		foreach(lc, run->effects_added)
			JsonArrayBuildAdd(&ab, lfirst(lc));
		run->working_effects = JsonArrayBuildEnd(&ab);
		run->effects_added = NIL;
	}
	return run->working_effects;
}

/* The step's latest effect record whose "op" is op, or NULL. */
Jsonb *
EffectFindOp(RunState *run, const char *op)
{
	for (int i = EffectCount(run) - 1; i >= 0; i--)
	{
		Jsonb	   *rec = EffectAt(run, i);
		char	   *o = JsonGetString(rec, "op");

		if (o && strcmp(o, op) == 0)
			return rec;
	}
	return NULL;
}

/*
 * What tells this installation of tuvl apart from every other: the
 * cluster's system identifier, the database and the extension's OID
 * (which a DROP and CREATE EXTENSION changes, while run ids restart).
 */
static const char *
installation_tag(void)
{
	static Oid	cached_ext = InvalidOid;
	static TimestampTz looked_up_in = 0;
	static char tag[17];
	Oid			ext = cached_ext;

	/* look the extension up once per transaction, not once per step */
	if (looked_up_in != GetCurrentTransactionStartTimestamp())
	{
		ext = get_extension_oid("tuvl", false);
		looked_up_in = GetCurrentTransactionStartTimestamp();
	}
	if (ext != cached_ext)
	{
		uint64		parts[3];

		parts[0] = GetSystemIdentifier();
		parts[1] = MyDatabaseId;
		parts[2] = ext;
		snprintf(tag, sizeof(tag), "%016" INT64_MODIFIER "x",
				 (uint64) hash_bytes_extended((const unsigned char *) parts, sizeof(parts), 0));
		cached_ext = ext;
	}
	return tag;
}

/*
 * The idempotency key of the step's logical call number `logical`: made
 * only of the installation, the run, the journal position where the step
 * was entered (and, for an agent's tool, the tool call's number) and the
 * call's number, so retries, crash recovery and
 * replay agree on it, and no other database or reinstallation reuses it.
 */
char *
EffectKey(RunState *run, int logical)
{
	/* a replay computes the keys of the run it replays */
	const char *base = run->key_base ? run->key_base : EffectKeyBase(run);

	if (run->effect_call > 0)
		return psprintf("%s-%d-t%d-%d", base, run->entry_seq, run->effect_call, logical);
	return psprintf("%s-%d-%d", base, run->entry_seq, logical);
}

/* The part of every key of this run before the step's entry seq. */
char *
EffectKeyBase(RunState *run)
{
	return psprintf("tuvl-%s-" INT64_FORMAT, installation_tag(), run->id);
}

/*
 * Append a record the step made itself (not an effect's result) to its
 * step_state, where a later transition of the same step finds it with
 * EffectAt.  It commits with the transition that made it.
 */
void
EffectRecord(RunState *run, Jsonb *record)
{
	run->effects_added = lappend(run->effects_added, record);
}

EffectRequest *
EffectRequestCopy(EffectRequest *req, MemoryContext cxt)
{
	MemoryContext old = MemoryContextSwitchTo(cxt);
	EffectRequest *c = palloc0(sizeof(EffectRequest));
	ListCell   *lc;

	c->http.method = pstrdup(req->http.method);
	c->http.url = pstrdup(req->http.url);
	foreach(lc, req->http.headers)
	{
		HttpHeader *h = lfirst(lc);
		HttpHeader *hc = palloc(sizeof(HttpHeader));

		hc->name = pstrdup(h->name);
		hc->value = pstrdup(h->value);
		c->http.headers = lappend(c->http.headers, hc);
	}
	if (req->http.body)
	{
		char	   *b = palloc(req->http.body_len + 1);

		memcpy(b, req->http.body, req->http.body_len);
		b[req->http.body_len] = '\0';
		c->http.body = b;
		c->http.body_len = req->http.body_len;
	}
	c->http.timeout_ms = req->http.timeout_ms;
	c->http.stop_after = req->http.stop_after ? pstrdup(req->http.stop_after) : NULL;
	c->journal = req->journal ? DatumGetJsonbPCopy(JsonbPGetDatum(req->journal)) : NULL;
	c->idempotency_key = req->idempotency_key ? pstrdup(req->idempotency_key) : NULL;
	c->delay_ms = req->delay_ms;
	foreach(lc, req->secrets)
		c->secrets = lappend(c->secrets, pstrdup(lfirst(lc)));
	c->tag = req->tag ? DatumGetJsonbPCopy(JsonbPGetDatum(req->tag)) : NULL;
	if (req->admit)
	{
		c->admit = palloc(sizeof(AdmitSpec));
		*c->admit = *req->admit;
	}
	MemoryContextSwitchTo(old);
	return c;
}

/*
 * A response body as a JSON value: parsed when it is valid JSON and the
 * server said JSON (or it plainly looks like JSON), else a string.  Bytes
 * that cannot be text in this database, and JSON that cannot be stored
 * (see JsonParseExternal), become a body_error instead: the step's error,
 * never the worker's.
 */
static void
add_body(JsonObjBuilder *b, HttpResult *res)
{
	const char *ctype = HttpResultHeader(res, "content-type");
	bool		says_json = ctype && strstr(ctype, "json") != NULL;
	bool		looks_json;
	Jsonb	   *parsed;
	const char *why;

	if (memchr(res->body, '\0', res->body_len) != NULL)
	{
		JsonObjAddNull(b, "body");
		JsonObjAddString(b, "body_error", "response body contains NUL bytes");
		return;
	}
	if (!pg_verifymbstr(res->body, res->body_len, true))
	{
		JsonObjAddNull(b, "body");
		JsonObjAddString(b, "body_error", "response body is not valid text in the database encoding");
		return;
	}
	looks_json = res->body_len > 0 && (res->body[0] == '{' || res->body[0] == '[');
	if (res->body_len > 0 && (says_json || looks_json))
	{
		parsed = JsonParseExternal(res->body, res->body_len, &why);
		if (parsed != NULL)
		{
			JsonObjAddJsonb(b, "body", parsed);
			return;
		}
		if (says_json)
		{
			JsonObjAddString(b, "body", res->body);
			JsonObjAddString(b, "body_error", psprintf("response body %s", why));
			return;
		}
	}
	JsonObjAddString(b, "body", res->body);
}

/*
 * The journal form of an HTTP result: {status, headers, body, error,
 * error_kind, latency_ms}, with every secret scrubbed.
 */
Jsonb *
EffectResultToJsonb(HttpResult *res, List *secrets)
{
	JsonObjBuilder b;
	JsonObjBuilder h;
	ListCell   *lc;

	JsonObjStart(&b);
	if (res->status > 0)
		JsonObjAddInt(&b, "status", res->status);
	else
		JsonObjAddNull(&b, "status");
	JsonObjStart(&h);
	foreach(lc, res->headers)
	{
		HttpHeader *hd = lfirst(lc);

		JsonObjAddString(&h, hd->name, hd->value);
	}
	JsonObjAddJsonb(&b, "headers", JsonObjEnd(&h));
	add_body(&b, res);
	if (res->error)
	{
		JsonObjAddString(&b, "error", res->error);
		JsonObjAddString(&b, "error_kind", res->error_kind);
	}
	JsonObjAddInt(&b, "latency_ms", (int64) res->latency_ms);
	return SecretScrubJsonb(JsonObjEnd(&b), secrets);
}

EffectFinishHookType EffectFinishHook = NULL;

/* The journal form of a request's result, with the request's tag. */
Jsonb *
EffectFinish(EffectRequest *req, HttpResult *res)
{
	List	   *secrets = req->secrets;
	Jsonb	   *j;

	if (EffectFinishHook && req->tag)
		secrets = EffectFinishHook(req, res, secrets);
	j = EffectResultToJsonb(res, secrets);

	return req->tag ? JsonMerge(j, req->tag) : j;
}

/*
 * Perform an effect in this backend (the synchronous path): wait out its
 * delay, then the request, checking for interrupts all along.
 */
Jsonb *
EffectPerform(EffectRequest *req)
{
	if (req->delay_ms > 0)
	{
		TimestampTz until = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), req->delay_ms);

		for (;;)
		{
			long		ms = (long) ((until - GetCurrentTimestamp()) / 1000);

			if (ms <= 0)
				break;
			(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
							 ms, PG_WAIT_EXTENSION);
			ResetLatch(MyLatch);
			CHECK_FOR_INTERRUPTS();
		}
	}
	if (req->admit)
	{
		HttpResult *volatile res = NULL;

		/* the ticket goes back however the call ends (an error, a cancel) */
		PG_TRY();
		{
			TimestampTz retry_at;

			do
				AdmissionWait(req->admit);
			while (!AdmissionSent(req->admit, &retry_at));
			res = HttpPerform(&req->http, req->secrets);
		}
		PG_FINALLY();
		{
			if (res == NULL)
				AdmissionDone(req->admit, -1, 0, 0);
		}
		PG_END_TRY();
		{
			Jsonb	   *result = EffectFinish(req, res);

			EffectAdmissionDone(req, result);
			return result;
		}
	}
	return EffectFinish(req, HttpPerform(&req->http, req->secrets));
}

/* A token count of a provider's usage, never raising; -1: none. */
static int64
usage_tokens(Jsonb *usage, const char *key)
{
	JsonbValue *v = JsonGetField(usage, key);
	bool		bad = false;
	int32		n;

	if (v == NULL || v->type != jbvNumeric)
		return -1;
	n = numeric_int4_opt_error(v->val.numeric, &bad);
	return bad || n < 0 ? -1 : n;
}

/*
 * A model call with limits ended with result: its ticket goes back with
 * the tokens its answer reports, and a 429 pauses its config.
 */
void
EffectAdmissionDone(EffectRequest *req, Jsonb *result)
{
	int			status;
	int64		tokens = -1;
	int			retry_after = -1;

	if (req == NULL || req->admit == NULL || req->admit->ticket < 0)
		return;
	status = result ? JsonGetInt32(result, "status", 0) : 0;
	if (status >= 200 && status < 300)
	{
		Jsonb	   *body = JsonGetJsonb(result, "body");
		Jsonb	   *usage = body && JsonIsObject(body) ? JsonGetJsonb(body, "usage") : NULL;

		if (usage && JsonIsObject(usage))
		{
			int64		total = usage_tokens(usage, "total_tokens");

			if (total < 0)
				total = Max(usage_tokens(usage, "prompt_tokens"), 0) +
					Max(usage_tokens(usage, "completion_tokens"), 0) +
					Max(usage_tokens(usage, "input_tokens"), 0) +
					Max(usage_tokens(usage, "output_tokens"), 0);
			tokens = total;
		}
	}
	else if (status == 429)
		retry_after = RetryAfterMs(result, 60 * 1000, RETRY_AFTER_MS_HEADER);
	AdmissionDone(req->admit, tokens, status, retry_after);
}
