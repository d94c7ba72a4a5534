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
 * Secrets reach requests through templates and nothing else: every value
 * read is remembered (SecretUse) and scrubbed from whatever is journaled
 * or stored in the context, including response bodies that echo it.
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
#include "pgstat.h"

#include "effect.h"
#include "jsonutil.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"

#define REDACTED "[redacted]"

static const char secret_sql[] =
"SELECT s.value, "
"  EXISTS (SELECT 1 FROM tuvl.secret_grants g "
"          WHERE g.secret OPERATOR(pg_catalog.=) s.name "
"            AND pg_catalog.pg_has_role($2::pg_catalog.oid, g.grantee::pg_catalog.oid, 'USAGE')), "
"  EXISTS (SELECT 1 FROM tuvl.secret_grants g "
"          WHERE g.secret OPERATOR(pg_catalog.=) s.name "
"            AND pg_catalog.pg_has_role($3::pg_catalog.oid, g.grantee::pg_catalog.oid, 'USAGE')) "
"FROM tuvl.secrets s WHERE s.name OPERATOR(pg_catalog.=) $1";

/* Does role hold a grant of the secret (the column of secret_sql), or need none? */
static bool
holds_grant(int column, Oid role)
{
	bool		isnull;

	return DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, column,
									  &isnull)) || superuser_arg(role);
}

/*
 * Template hook: read a secret as the extension owner and remember its
 * value, if the run's principal holds a grant for it, and so does the
 * author of what names it when that is another role (superusers need
 * none).  A replay never reads secrets: it sends nothing, so a stand-in
 * does.  Never puts a value in an error; the error does not tell a
 * missing secret from one that was not granted.
 */
static const char *
secret_hook(const char *name, void *arg)
{
	SecretUse  *use = arg;
	static const Oid types[3] = {TEXTOID, OIDOID, OIDOID};
	Datum		values[3];
	SecurityFrame frame;
	char	   *value = NULL;
	bool		granted = false;
	bool		connected = false;

	if (use->run && use->run->replay)
		value = pstrdup("[replay]");
	else
	{
		if (SPI_connect() == SPI_OK_CONNECT)
			connected = true;
		values[0] = CStringGetTextDatum(name);
		values[1] = ObjectIdGetDatum(use->run ? use->run->principal : GetUserId());
		values[2] = OidIsValid(use->author) ? ObjectIdGetDatum(use->author) : values[1];
		SecurityAsOwner(&frame);
		if (SpiExec(secret_sql, 3, types, values, NULL, SPI_OK_SELECT) == 1)
		{
			char	   *v = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);

			granted = holds_grant(2, DatumGetObjectId(values[1])) &&
				holds_grant(3, DatumGetObjectId(values[2]));
			value = v && granted ? SPI_palloc(strlen(v) + 1) : NULL;
			if (value)
				strcpy(value, v);
		}
		SecurityRestore(&frame);
		if (connected)
			SPI_finish();
		if (value == NULL && OidIsValid(use->author))
			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("secret \"%s\"%s%s is not available to role \"%s\"", name,
							use->named_by ? " named by " : "", use->named_by ? use->named_by : "",
							use->run ? use->run->principal_name : GetUserNameFromId(GetUserId(), false)),
					 errdetail("It does not exist, or it has not been granted both to the role that started the run and to role \"%s\", which registered %s.",
							   GetUserNameFromId(use->author, false), use->named_by ? use->named_by : "it"),
					 errhint("A member of tuvl_admin stores it with tuvl.set_secret() and grants it with tuvl.grant_secret().")));
		if (value == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("secret \"%s\"%s%s is not available to role \"%s\"", name,
							use->named_by ? " named by " : "", use->named_by ? use->named_by : "",
							use->run ? use->run->principal_name : GetUserNameFromId(GetUserId(), false)),
					 errdetail("It does not exist, or it has not been granted to the role that started the run."),
					 errhint("A member of tuvl_admin stores it with tuvl.set_secret() and grants it with tuvl.grant_secret().")));
	}
	use->values = lappend(use->values, value);
	return value;
}

/* Start collecting the secrets run reads (run may be NULL outside a run). */
void
SecretUseInit(SecretUse *use, RunState *run)
{
	memset(use, 0, sizeof(SecretUse));
	use->opts.secret_hook = secret_hook;
	use->opts.secret_arg = use;
	use->run = run;
}

/*
 * text with every secret value replaced: raw, JSON-escaped and
 * percent-encoded (as in a URL's query).
 */
char *
SecretScrub(const char *text, List *secrets)
{
	ListCell   *lc;
	char	   *out = (char *) text;

	foreach(lc, secrets)
	{
		const char *s = lfirst(lc);
		StringInfoData esc;
		char	   *pct;

		if (s == NULL || *s == '\0')
			continue;
		out = TextReplaceAll(out, s, REDACTED);
		pct = curl_easy_escape(NULL, s, 0);
		if (pct)
		{
			if (strcmp(pct, s) != 0)
				out = TextReplaceAll(out, pct, REDACTED);
			curl_free(pct);
		}
		initStringInfo(&esc);
		escape_json(&esc, s);
		/* strip the quotes escape_json adds */
		esc.data[esc.len - 1] = '\0';
		if (strcmp(esc.data + 1, s) != 0)
			out = TextReplaceAll(out, esc.data + 1, REDACTED);
	}
	return out;
}

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

Jsonb *
SecretScrubJsonb(Jsonb *j, List *secrets)
{
	char	   *text;
	char	   *scrubbed;

	if (j == NULL || secrets == NIL)
		return j;
	text = JsonbToCString(NULL, &j->root, VARSIZE(j));
	scrubbed = SecretScrub(text, secrets);
	return scrubbed == text ? j : JsonFromCString(scrubbed);
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
	c->journal = req->journal ? DatumGetJsonbPCopy(JsonbPGetDatum(req->journal)) : NULL;
	c->idempotency_key = req->idempotency_key ? pstrdup(req->idempotency_key) : NULL;
	c->delay_ms = req->delay_ms;
	foreach(lc, req->secrets)
		c->secrets = lappend(c->secrets, pstrdup(lfirst(lc)));
	c->tag = req->tag ? DatumGetJsonbPCopy(JsonbPGetDatum(req->tag)) : NULL;
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

/* The journal form of a request's result, with the request's tag. */
Jsonb *
EffectFinish(EffectRequest *req, HttpResult *res)
{
	Jsonb	   *j = EffectResultToJsonb(res, req->secrets);

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
	return EffectFinish(req, HttpPerform(&req->http, req->secrets));
}
