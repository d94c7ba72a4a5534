/*-------------------------------------------------------------------------
 *
 * mcp.c
 *	  A Model Context Protocol client over the streamable HTTP transport
 *	  (protocol revision 2025-11-25), which the MCP step (step_mcp.c) and
 *	  tuvl.mcp_list_tools() speak through.
 *
 * Every message is one HTTP POST of a JSON-RPC message, made as an effect
 * (effect.c), so each is journaled before use and a crashed step resumes
 * where it was.  A step's effects are, in order: `initialize` (unless the
 * process already holds a session for the server's URL), the
 * `notifications/initialized` notification, and `tools/call`.  Each
 * effect's journaled result is tagged with what it was ({"op", "session"}),
 * so re-executing the step walks the same path whatever the session cache
 * holds now.  A call answered 404 or 400 on a cached session means the
 * server lost it: the step initializes again and repeats the call.
 *
 * Responses arrive as application/json or text/event-stream; in a stream,
 * priming events (empty data), comments and notifications (progress) are
 * skipped, multi-line data is joined, and the response is the message
 * whose id matches the request.
 *
 * Revisions.  A step first asks a server it does not know yet which
 * revisions it speaks (`server/discover`, an effect like the others) and
 * the process remembers the answer per URL for MCP_REVISION_TTL_MS.  A
 * server that offers the stateless revision 2026-07-28 is called without
 * any handshake or session: one `tools/call` carrying the revision and
 * tuvl's capabilities in `_meta`, with the MCP-Protocol-Version, Mcp-Method
 * and Mcp-Name headers.  Any other answer to `server/discover` (an error, a
 * 4xx, a result without 2026-07-28) means a 2025 server: `initialize` and
 * sessions as above.  A stateless call answered 400 with error -32022 (the
 * server no longer speaks 2026-07-28) negotiates down to `initialize` within
 * the step; an `initialize` answered -32022 by a server that names
 * 2026-07-28 among its revisions negotiates up.
 *
 * Input requests.  A stateless call answered with resultType
 * "input_required" is sent again with inputResponses: answered as
 * mcp.elicitation says, unattended (accept_defaults, decline) or, with ask
 * (the default), by a person: the run parks as waiting_human with the
 * question as its awaiting (step_mcp.c), tuvl.submit() or tuvl.reject()
 * record the answer among the step's records (run_control.c), and the
 * step, executed again, retries the call.  A 2025-11-25 server that asks
 * on the call's event stream fails the call (fail_if_stream_asks).
 *
 * Tasks.  A step that can wait (not an agent's tool call) declares the
 * tasks extension; a server may then answer the call with a task
 * (resultType "task"): the step polls it with tasks/get, one effect per
 * poll, the run parked as sleeping until the next (task_wait records the
 * time), and the completed task's result is the call's.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "common/jsonapi.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "storage/ipc.h"
#include "fmgr.h"
#include "miscadmin.h"

#include "effect.h"
#include "http.h"
#include "jsonutil.h"
#include "mcp.h"
#include "security.h"
#include "spiutil.h"
#include "template.h"
#include "tuvl.h"
#include "tokens.h"

PG_FUNCTION_INFO_V1(tuvl_mcp_list_tools);

/* A session id as long as this is refused (it could not be kept whole). */
#define MCP_MAX_SESSION_ID 256

/* Sessions this process holds, by server URL. */
typedef struct McpSession
{
	char		url[1024];		/* hash key: the URL and its headers' hash */
	char		session_id[MCP_MAX_SESSION_ID];
	char		version[32];
	char		server[1024];	/* the URL, to close the session at exit */
	List	   *headers;		/* the headers sent with it, in
								 * TopMemoryContext */
} McpSession;

static HTAB *sessions = NULL;

/*
 * The revision servers speak, by URL, as this process learned it from
 * server/discover (or a -32022 answer); forgotten after
 * MCP_REVISION_TTL_MS so that a server upgraded in place is found out.
 */
typedef struct McpServerRevision
{
	char		url[1024];		/* hash key */
	bool		stateless;		/* it speaks MCP_STATELESS_VERSION */
	TimestampTz learned;
} McpServerRevision;

#define MCP_REVISION_TTL_MS (10 * 60 * 1000)

static HTAB *revisions = NULL;

/*
 * The entry of url in *table, a hash by URL of this process made on first
 * use (name, entries of entrysize that open with a char[1024] key), or
 * NULL when url is too long to be a key.
 */
static void *
url_entry(HTAB **table, const char *name, Size entrysize, const char *url, bool create,
		  bool *found)
{
	char		key[1024];

	if (*table == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(key);
		ctl.entrysize = entrysize;
		*table = hash_create(name, 16, &ctl, HASH_ELEM | HASH_STRINGS);
	}
	if (strlen(url) >= sizeof(key))
		return NULL;
	memset(key, 0, sizeof(key));
	strlcpy(key, url, sizeof(key));
	return hash_search(*table, key, create ? HASH_ENTER : HASH_FIND, found);
}

static McpServerRevision *
revision_lookup(const char *url, bool create)
{
	return url_entry(&revisions, "tuvl MCP server revisions", sizeof(McpServerRevision), url,
					 create, NULL);
}

/* What the process knows of url: 1 stateless, 0 a 2025 server, -1 nothing. */
int
McpRevisionKnown(const char *url)
{
	McpServerRevision *r = revision_lookup(url, false);

	if (r == NULL)
		return -1;
	if (TimestampDifferenceExceeds(r->learned, GetCurrentTimestamp(), MCP_REVISION_TTL_MS))
	{
		hash_search(revisions, r->url, HASH_REMOVE, NULL);
		return -1;
	}
	return r->stateless ? 1 : 0;
}

void
McpRevisionRemember(const char *url, bool stateless)
{
	McpServerRevision *r;

	/* bounded like the sessions: past the bound, nothing more is learned */
	if (revision_lookup(url, false) == NULL && revisions &&
		hash_get_num_entries(revisions) >= 1024)
		return;
	r = revision_lookup(url, true);
	if (r)
	{
		r->stateless = stateless;
		r->learned = GetCurrentTimestamp();
	}
}

static McpSession *
session_lookup(const char *url, bool create)
{
	bool		found;
	McpSession *s;

	s = url_entry(&sessions, "tuvl MCP sessions", sizeof(McpSession), url, create, &found);
	/* a new entry has its key; the rest starts empty */
	if (s && !found)
		memset((char *) s + sizeof(s->url), 0, sizeof(McpSession) - sizeof(s->url));
	return s;
}

/* Forget the cached session of url, if it is still the given one. */
static void
session_forget(const char *url, const char *session)
{
	McpSession *s = session_lookup(url, false);

	if (s && session && strcmp(s->session_id, session) == 0)
		hash_search(sessions, s->url, HASH_REMOVE, NULL);
}

/*
 * Is msg the JSON-RPC response to request id?  Ids are strings (an
 * effect's idempotency key: unique in every session); a numeric id
 * answers the request whose id is its digits (a recording from before).
 */
static bool
is_response_to(Jsonb *msg, const char *id)
{
	JsonbValue *v = JsonGetField(msg, "id");

	if (v == NULL || (JsonGetField(msg, "result") == NULL && JsonGetField(msg, "error") == NULL))
		return false;
	if (v->type == jbvString)
		return strlen(id) == (size_t) v->val.string.len &&
			strncmp(v->val.string.val, id, v->val.string.len) == 0;
	if (v->type == jbvNumeric)
		return strcmp(JsonValueToText(v), id) == 0;
	return false;
}

/*
 * The data of the next event of the event stream at *pos (its data:
 * lines, joined by newlines) into data, *pos moved past it.  An event
 * ends at a blank line or with the stream; one without data is skipped,
 * and id:, event:, retry: and ":" comments need nothing.  Returns false
 * at the end of the stream.
 */
static bool
next_event_data(const char **pos, StringInfo data)
{
	const char *p = *pos;

	resetStringInfo(data);
	while (p)
	{
		const char *eol = strpbrk(p, "\r\n");
		size_t		len = eol ? (size_t) (eol - p) : strlen(p);

		if (len >= 5 && strncmp(p, "data:", 5) == 0)
		{
			const char *v = p + 5 + (p[5] == ' ');

			if (data->len > 0)
				appendStringInfoChar(data, '\n');
			appendBinaryStringInfo(data, v, p + len - v);
		}
		p = eol ? eol + ((eol[0] == '\r' && eol[1] == '\n') ? 2 : 1) : NULL;
		if ((len == 0 || p == NULL) && data->len > 0)
			break;
	}
	*pos = p;
	return data->len > 0;
}

/*
 * Find the JSON-RPC response to request id in a response body, which is
 * either one JSON message (or a batch array) or a text/event-stream.
 * Returns NULL with *error set when there is none.
 */
Jsonb *
McpParseMessage(const char *body, const char *content_type, const char *id, char **error)
{
	*error = NULL;
	if (body == NULL || *body == '\0')
	{
		*error = "the server sent an empty response";
		return NULL;
	}
	if (content_type && strstr(content_type, "text/event-stream"))
	{
		StringInfoData data;
		const char *p = body;

		initStringInfo(&data);
		while (next_event_data(&p, &data))
		{
			/* an event that is not a JSON message is skipped */
			Jsonb	   *msg = JsonParseExternal(data.data, data.len, NULL);

			if (msg && JsonIsObject(msg) && is_response_to(msg, id))
				return msg;
		}
		*error = psprintf("the event stream holds no response to request %s", id);
		return NULL;
	}
	{
		const char *why;
		Jsonb	   *msg = JsonParseExternal(body, strlen(body), &why);

		if (msg == NULL)
		{
			*error = psprintf("the response %s", why);
			return NULL;
		}

		if (JsonIsObject(msg) && is_response_to(msg, id))
			return msg;
		if (JB_ROOT_IS_ARRAY(msg) && !JB_ROOT_IS_SCALAR(msg))
		{
			int			n = JsonContainerSize(&msg->root);

			for (int i = 0; i < n; i++)
			{
				Jsonb	   *m = JsonValueToJsonb(getIthJsonbValueFromContainer(&msg->root, i));

				if (JsonIsObject(m) && is_response_to(m, id))
					return m;
			}
		}
	}
	*error = psprintf("the response holds no answer to request %s", id);
	return NULL;
}

/*
 * mcp.headers rendered against ctx (secrets allowed, remembered in use):
 * a list of HttpHeader for every message of the step.
 */
List *
McpRenderHeaders(JsonbValue *headers, Jsonb *ctx, SecretUse *use)
{
	JsonbIterator *it;
	JsonbValue	v;
	char	   *name;
	List	   *out = NIL;

	if (headers == NULL || headers->type != jbvBinary || !JsonContainerIsObject(headers->val.binary.data))
		return NIL;
	it = JsonbIteratorInit(headers->val.binary.data);
	while (JsonObjectNext(&it, &name, &v))
	{
		HttpHeader *h = palloc(sizeof(HttpHeader));
		char	   *value = JsonValueToText(TemplateRenderValue(&v, ctx, &use->opts));

		if (strpbrk(name, "\r\n:") || strpbrk(value, "\r\n"))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("MCP header \"%s\" contains a line break or an invalid character",
							SecretScrub(name, use->values)),
					 errhint("Header names and values must be single lines.")));
		h->name = pstrdup(name);
		h->value = value;
		out = lappend(out, h);
	}
	return out;
}

/*
 * The key of a session in this process's cache: the URL, and the headers
 * (hashed), so that steps that present other credentials to the same
 * server never share a session.
 */
char *
McpSessionKey(const char *url, List *headers)
{
	StringInfoData buf;
	ListCell   *lc;

	if (headers == NIL)
		return (char *) url;
	initStringInfo(&buf);
	foreach(lc, headers)
	{
		appendStringInfo(&buf, "%s\x1f%s\x1e", ((HttpHeader *) lfirst(lc))->name,
						 ((HttpHeader *) lfirst(lc))->value);
	}
	return psprintf("%s#%016" INT64_MODIFIER "x", url,
					(uint64) hash_bytes_extended((const unsigned char *) buf.data, buf.len, 0));
}

/* A JSON-RPC request as an HTTP effect. */
static EffectRequest *
rpc_request(const char *url, const char *method, Jsonb *params, const char *id,
			const char *session, const char *version, const char *op, int timeout_ms,
			List *extra)
{
	EffectRequest *req = palloc0(sizeof(EffectRequest));
	JsonObjBuilder b;
	Jsonb	   *msg;
	HttpHeader *h;

	JsonObjStart(&b);
	JsonObjAddString(&b, "jsonrpc", "2.0");
	if (id)
		JsonObjAddString(&b, "id", id);
	JsonObjAddString(&b, "method", method);
	if (params)
		JsonObjAddJsonb(&b, "params", params);
	msg = JsonObjEnd(&b);

	req->http.method = "POST";
	req->http.url = pstrdup(url);
	req->http.body = JsonbToCString(NULL, &msg->root, VARSIZE(msg));
	req->http.body_len = strlen(req->http.body);
	req->http.timeout_ms = timeout_ms;
	h = palloc(sizeof(HttpHeader));
	h->name = "Content-Type";
	h->value = "application/json";
	req->http.headers = lappend(req->http.headers, h);
	h = palloc(sizeof(HttpHeader));
	h->name = "Accept";
	h->value = "application/json, text/event-stream";
	req->http.headers = lappend(req->http.headers, h);
	if (session)
	{
		h = palloc(sizeof(HttpHeader));
		h->name = "Mcp-Session-Id";
		h->value = pstrdup(session);
		req->http.headers = lappend(req->http.headers, h);
	}
	if (version)
	{
		h = palloc(sizeof(HttpHeader));
		h->name = "MCP-Protocol-Version";
		h->value = pstrdup(version);
		req->http.headers = lappend(req->http.headers, h);
	}
	/* the step's own headers (a bearer token, say) go with every message */
	req->http.headers = list_concat(req->http.headers, extra);

	JsonObjStart(&b);
	JsonObjAddString(&b, "method", "POST");
	JsonObjAddString(&b, "url", HttpRedactUrl(url));
	JsonObjAddString(&b, "rpc", method);
	req->journal = JsonObjEnd(&b);

	JsonObjStart(&b);
	JsonObjAddString(&b, "op", op);
	if (id)
		JsonObjAddString(&b, "rpc_id", id); /* to find its answer by */
	if (session)
		JsonObjAddString(&b, "session", session);
	if (version)
		JsonObjAddString(&b, "version", version);
	req->tag = JsonObjEnd(&b);
	return req;
}

static void
add_header(EffectRequest *req, const char *name, const char *value)
{
	HttpHeader *h = palloc(sizeof(HttpHeader));

	h->name = (char *) name;
	h->value = pstrdup(value);
	req->http.headers = lappend(req->http.headers, h);
}

/* The tasks extension's identifier (2026-07-28). */
#define MCP_TASKS_EXTENSION "io.modelcontextprotocol/tasks"

/*
 * A request of the stateless revision: params with the _meta every
 * 2026-07-28 request carries (the revision, tuvl's capabilities: form
 * elicitation when elicit, the step answering input requests, and the
 * tasks extension when tasks, the step able to poll a task, else none;
 * and its name), and the headers the revision asks for, which the server
 * checks against the body: MCP-Protocol-Version, Mcp-Method and, when name
 * is given (tools/call), Mcp-Name.
 */
EffectRequest *
McpStatelessRequest(const char *url, const char *method, Jsonb *params, const char *name,
					const char *id, const char *op, int timeout_ms, List *extra, bool elicit,
					bool tasks)
{
	Jsonb	   *meta = JsonFromCString(psprintf("{\"io.modelcontextprotocol/protocolVersion\": \""
												MCP_STATELESS_VERSION "\", "
												"\"io.modelcontextprotocol/clientCapabilities\": {%s%s%s}, "
												"\"io.modelcontextprotocol/clientInfo\": "
												"{\"name\": \"tuvl\", \"version\": \"" TUVL_VERSION "\"}}",
												elicit ? "\"elicitation\": {\"form\": {}}" : "",
												elicit && tasks ? ", " : "",
												tasks ? "\"extensions\": {\"" MCP_TASKS_EXTENSION "\": {}}" : ""));
	EffectRequest *req;

	if (name && strpbrk(name, "\r\n"))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("MCP tool name contains a line break"),
				 errdetail("Revision %s sends the tool's name as the Mcp-Name header.",
						   MCP_STATELESS_VERSION)));
	params = JsonSetKey(params ? params : JsonEmptyObject(), "_meta", meta);
	req = rpc_request(url, method, params, id, NULL, MCP_STATELESS_VERSION, op, timeout_ms, NIL);
	add_header(req, "Mcp-Method", method);
	if (name)
		add_header(req, "Mcp-Name", name);
	/* the step's own headers last, as rpc_request places them */
	req->http.headers = list_concat(req->http.headers, extra);
	return req;
}

static Jsonb *
initialize_params(void)
{
	return JsonFromCString("{\"protocolVersion\": \"" MCP_PROTOCOL_VERSION "\", "
						   "\"capabilities\": {}, "
						   "\"clientInfo\": {\"name\": \"tuvl\", \"version\": \"" TUVL_VERSION "\"}}");
}

static char *
header_of(Jsonb *result, const char *name)
{
	Jsonb	   *h = JsonGetJsonb(result, "headers");

	return h ? JsonGetString(h, name) : NULL;
}

/*
 * The session id a server gave in its answer to initialize, or NULL.  The
 * spec allows visible ASCII only (0x21 to 0x7E); anything else, or one too
 * long to keep, is the server's error.
 */
static char *
session_of(Jsonb *result)
{
	char	   *sid = header_of(result, "mcp-session-id");

	if (sid == NULL)
		return NULL;
	for (const char *c = sid; *c; c++)
		if (*c < 0x21 || *c > 0x7e)
			ereport(ERROR,
					(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
					 errmsg("MCP initialize failed: the server's session id holds characters other than visible ASCII")));
	if (strlen(sid) >= MCP_MAX_SESSION_ID)
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP initialize failed: the server's session id is longer than %d bytes",
						MCP_MAX_SESSION_ID - 1)));
	return sid;
}

/* Does list (a JSON array) name the stateless revision? */
static bool
names_stateless(Jsonb *list)
{
	int			n;

	if (list == NULL || !JB_ROOT_IS_ARRAY(list) || JB_ROOT_IS_SCALAR(list))
		return false;
	n = JsonContainerSize(&list->root);
	for (int i = 0; i < n; i++)
	{
		JsonbValue *v = getIthJsonbValueFromContainer(&list->root, i);

		if (v->type == jbvString && v->val.string.len == strlen(MCP_STATELESS_VERSION) &&
			strncmp(v->val.string.val, MCP_STATELESS_VERSION, v->val.string.len) == 0)
			return true;
	}
	return false;
}

/*
 * Does the answer to server/discover (the effect result r, request id)
 * offer the stateless revision?  Anything but a result whose
 * supportedVersions names it (an error, a 4xx such as a 2025 server's
 * "no session", a body that is not JSON) says no.
 */
static bool
discover_offers_stateless(Jsonb *r, const char *id)
{
	int			status = JsonGetInt32(r, "status", 0);
	char	   *error;
	Jsonb	   *msg;
	Jsonb	   *res;

	if (status < 200 || status >= 300)
		return false;
	msg = McpParseMessage(JsonGetText(r, "body"), header_of(r, "content-type"), id, &error);
	res = msg ? JsonGetJsonb(msg, "result") : NULL;
	return res && JsonIsObject(res) && names_stateless(JsonGetJsonb(res, "supportedVersions"));
}

/*
 * Is the effect result r the revision's "unsupported protocol version":
 * HTTP 400 with JSON-RPC error -32022?  *offers_stateless tells whether its
 * data.supported names the stateless revision.
 */
static bool
version_mismatch(Jsonb *r, bool *offers_stateless)
{
	char	   *body = JsonGetText(r, "body");
	Jsonb	   *msg;
	Jsonb	   *e;
	Jsonb	   *data;

	*offers_stateless = false;
	if (JsonGetInt32(r, "status", 0) != 400 || body == NULL)
		return false;
	msg = JsonParseExternal(body, strlen(body), NULL);
	e = msg && JsonIsObject(msg) ? JsonGetJsonb(msg, "error") : NULL;
	if (e == NULL || !JsonIsObject(e) || JsonGetInt32(e, "code", 0) != -32022)
		return false;
	data = JsonGetJsonb(e, "data");
	*offers_stateless = data && JsonIsObject(data) && names_stateless(JsonGetJsonb(data, "supported"));
	return true;
}

/* Fail the step with what a transport-level failure says. */
static void
fail_transport(Jsonb *result, const char *what)
{
	int			status = JsonGetInt32(result, "status", 0);
	char	   *err = JsonGetString(result, "error");

	if (status == 0)
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP %s failed: %s", what, err ? err : "no response")));
	ereport(ERROR,
			(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
			 errmsg("MCP %s failed: the server answered HTTP %d", what, status),
			 errdetail("%s", JsonClipText(JsonGetText(result, "body"), 1000))));
}

/* The JSON-RPC message answering request id in an effect result. */
static Jsonb *
rpc_answer(Jsonb *result, const char *id, const char *what)
{
	char	   *error;
	Jsonb	   *msg = McpParseMessage(JsonGetText(result, "body"), header_of(result, "content-type"),
									  id, &error);

	if (msg == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP %s failed: %s", what, error)));
	if (JsonGetField(msg, "error"))
	{
		Jsonb	   *e = JsonGetJsonb(msg, "error");
		char	   *m = JsonIsObject(e) ? JsonGetString(e, "message") : NULL;

		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP %s failed: %s", what, m ? m : "JSON-RPC error"),
				 errdetail("JSON-RPC error code %s.",
						   JsonIsObject(e) && JsonGetField(e, "code") ?
						   JsonClipText(JsonGetText(e, "code"), 40) : "0")));
	}
	return JsonGetJsonb(msg, "result");
}

/* A call's event stream is resumed at most this often. */
#define MCP_MAX_RESUMES 3
/* The delay before resuming when the server gave no retry field. */
#define MCP_DEFAULT_RETRY_MS 1000

/* A server asking for input more often than this in one call fails it. */
#define MCP_MAX_INPUT_ROUNDS 8

/*
 * The revisions of the protocol this client implements: the one it asks
 * for, and the earlier ones whose messages it sends and reads the same.
 */
static const char *const known_versions[] = {MCP_PROTOCOL_VERSION, "2025-06-18", "2025-03-26", NULL};

/* Raise when the server answered initialize with a revision not known here. */
static void
check_version(const char *version)
{
	for (int i = 0; known_versions[i]; i++)
		if (strcmp(known_versions[i], version) == 0)
			return;
	ereport(ERROR,
			(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
			 errmsg("MCP initialize failed: the server speaks protocol revision %s, which tuvl does not implement",
					version),
			 errdetail("tuvl speaks %s, 2025-06-18 and 2025-03-26.", MCP_PROTOCOL_VERSION),
			 errhint("Use a server (or a version of it) that supports one of these revisions.")));
}

/* The id of the request whose result r is (at position i). */
static const char *
answer_id(Jsonb *r, int i)
{
	char	   *id = JsonGetString(r, "rpc_id");

	/* recorded before ids were keys: the position */
	return id ? id : psprintf("%d", i + 1);
}

/*
 * Does the answer to a stateless call ask for input (resultType
 * "input_required")?  With mcp.elicitation set, p remembers it for the
 * retry; without, or past MCP_MAX_INPUT_ROUNDS, the step fails.  Any
 * other resultType than "complete" is an error too.
 */
static bool
input_required(Jsonb *answer, McpProgress *p)
{
	char	   *type = answer ? JsonGetString(answer, "resultType") : NULL;

	if (type == NULL || strcmp(type, "complete") == 0)
		return false;
	if (strcmp(type, "input_required") != 0)
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP tools/call failed: the server answered with resultType \"%s\"", type)));
	if (strcmp(p->elicitation, "ask") == 0 && !p->can_ask)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("MCP tools/call failed: the server answered with resultType \"input_required\""),
				 errdetail("The server needs a person's answer, and an agent's tool call cannot wait for one."),
				 errhint("Set mcp.elicitation to accept_defaults or decline to answer it unattended.")));
	if (++p->rounds > MCP_MAX_INPUT_ROUNDS)
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP tools/call failed: the server asked for input %d times", p->rounds),
				 errdetail("tuvl answers at most %d input requests in one call.", MCP_MAX_INPUT_ROUNDS)));
	p->input_required = answer;
	return true;
}

/*
 * The values of a requested schema's properties that have a default:
 * accept_defaults's answer to a form elicitation.
 */
static Jsonb *
schema_defaults(Jsonb *schema)
{
	Jsonb	   *props = schema && JsonIsObject(schema) ? JsonGetJsonb(schema, "properties") : NULL;
	Jsonb	   *out = JsonEmptyObject();
	JsonbIterator *it;
	JsonbValue	v;
	char	   *name;

	if (props == NULL || !JsonIsObject(props))
		return out;
	it = JsonbIteratorInit(&props->root);
	while (JsonObjectNext(&it, &name, &v))
	{
		Jsonb	   *prop = JsonValueToJsonb(&v);

		if (JsonIsObject(prop) && JsonGetField(prop, "default"))
			out = JsonSetKey(out, name, JsonGetJsonb(prop, "default"));
	}
	return out;
}

/*
 * The inputRequests of an input_required answer, an object; each must be
 * an elicitation/create (tuvl answers nothing else: sampling, roots).
 */
Jsonb *
McpInputRequests(Jsonb *answer)
{
	Jsonb	   *requests = JsonGetJsonb(answer, "inputRequests");
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (requests == NULL || !JsonIsObject(requests))
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP tools/call failed: an input_required answer without an inputRequests object")));
	it = JsonbIteratorInit(&requests->root);
	while (JsonObjectNext(&it, &key, &v))
	{
		Jsonb	   *req = JsonValueToJsonb(&v);
		char	   *method = JsonIsObject(req) ? JsonGetString(req, "method") : NULL;

		if (method == NULL || strcmp(method, "elicitation/create") != 0)
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("MCP tools/call failed: the server asked for %s, which tuvl does not answer",
							method ? method : "an input without a method"),
					 errdetail("tuvl answers elicitation/create only.")));
	}
	return requests;
}

/* The params of input request req (an object), or NULL. */
Jsonb *
McpRequestParams(Jsonb *req)
{
	Jsonb	   *params = JsonGetField(req, "params") ? JsonGetJsonb(req, "params") : NULL;

	return params && JsonIsObject(params) ? params : NULL;
}

/* Is input request req a form (not one sending the person to a URL)? */
bool
McpRequestIsForm(Jsonb *req)
{
	Jsonb	   *params = McpRequestParams(req);
	char	   *mode = params ? JsonGetString(params, "mode") : NULL;

	return mode == NULL || strcmp(mode, "form") == 0;
}

/*
 * inputResponses for the inputRequests of an input_required answer, as
 * mcp.elicitation says: accept_defaults accepts each form elicitation
 * with its schema's defaults (and declines one that sends the person to a
 * URL, which nobody will visit); decline declines them all; ask sends
 * what people answered (answers, by request key: every request has one).
 */
static Jsonb *
input_responses(Jsonb *answer, const char *policy, Jsonb *answers)
{
	Jsonb	   *requests = McpInputRequests(answer);
	Jsonb	   *out = JsonEmptyObject();
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	it = JsonbIteratorInit(&requests->root);
	while (JsonObjectNext(&it, &key, &v))
	{
		Jsonb	   *req = JsonValueToJsonb(&v);
		Jsonb	   *params = McpRequestParams(req);
		bool		accept = strcmp(policy, "accept_defaults") == 0 && McpRequestIsForm(req);
		Jsonb	   *resp;

		if (strcmp(policy, "ask") == 0)
		{
			resp = answers ? JsonGetJsonb(answers, key) : NULL;
			if (resp == NULL)
				elog(ERROR, "MCP input request \"%s\" has no answer", key);
			out = JsonSetKey(out, key, resp);
			continue;
		}
		resp = JsonSetKey(JsonEmptyObject(), "action", JsonStringValue(accept ? "accept" : "decline"));
		if (accept)
			resp = JsonSetKey(resp, "content",
							  schema_defaults(params ? JsonGetJsonb(params, "requestedSchema") : NULL));
		out = JsonSetKey(out, key, resp);
	}
	return out;
}

/*
 * The method of the first request the server sent on an event stream
 * (body), such as elicitation/create, or NULL: a message with an id and a
 * method, not a notification.
 */
static char *
stream_request_method(const char *body)
{
	StringInfoData data;
	const char *p = body;

	initStringInfo(&data);
	while (next_event_data(&p, &data))
	{
		Jsonb	   *msg = JsonParseExternal(data.data, data.len, NULL);

		if (msg && JsonIsObject(msg) && JsonGetField(msg, "id") && JsonGetString(msg, "method"))
			return JsonGetString(msg, "method");
	}
	return NULL;
}

/*
 * A 2025-11-25 server that asks for input on the call's event stream
 * (elicitation/create: the stream was ended there, see McpNextRequest)
 * waits for the answer on that stream, which cannot stay open while a run
 * waits for a person, nor be resumed after a crash: the call fails
 * clearly.  tuvl declares no elicitation capability on that revision, so a
 * server that follows it does not ask.
 */
static void
fail_if_stream_asks(Jsonb *r, const char *id)
{
	char	   *ctype = header_of(r, "content-type");
	char	   *body = JsonGetText(r, "body");
	char	   *error;
	char	   *method;

	if (ctype == NULL || strstr(ctype, "text/event-stream") == NULL || body == NULL ||
		McpParseMessage(body, ctype, id, &error) != NULL)
		return;
	method = stream_request_method(body);
	if (method == NULL)
		return;
	ereport(ERROR,
			(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
			 errmsg("MCP tools/call failed: the server asked for input (%s) on the call's event stream of a %s session",
					method, JsonGetString(r, "version") ? JsonGetString(r, "version") : MCP_PROTOCOL_VERSION),
			 errdetail("On this revision the server waits for the answer on the open stream, which cannot outlive a run waiting for a person or a crash; tuvl declared no elicitation capability."),
			 errhint("Use a server that speaks the stateless revision %s, where the run waits for a person's answer or mcp.elicitation accept_defaults or decline answers it.",
					 MCP_STATELESS_VERSION)));
}

/*
 * An event stream that ended before it held the answer to request id,
 * but named its events: resume it (GET with Last-Event-ID, after the
 * server's retry delay), as the transport says.  Returns true with p's
 * resume fields set; false when r holds the answer or cannot be resumed.
 */
static bool
stream_resumable(Jsonb *r, const char *id, McpProgress *p)
{
	char	   *ctype = header_of(r, "content-type");
	char	   *body = JsonGetText(r, "body");
	char	   *error;
	char	   *last = NULL;
	int			retry = MCP_DEFAULT_RETRY_MS;
	const char *line;

	if (ctype == NULL || strstr(ctype, "text/event-stream") == NULL || body == NULL ||
		McpParseMessage(body, ctype, id, &error) != NULL)
		return false;
	for (line = body; line && *line; line = strpbrk(line, "\n") ? strpbrk(line, "\n") + 1 : NULL)
	{
		size_t		len = strcspn(line, "\r\n");

		if (len >= 3 && strncmp(line, "id:", 3) == 0)
		{
			const char *v = line + 3 + (line[3] == ' ');

			last = pnstrdup(v, line + len - v);
		}
		else if (len >= 6 && strncmp(line, "retry:", 6) == 0)
			retry = atoi(line + 6);
	}
	if (last == NULL || *last == '\0' || strpbrk(last, "\r\n"))
		return false;
	if (++p->resumes > MCP_MAX_RESUMES)
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP tools/call failed: the event stream ended %d times without the answer",
						p->resumes),
				 errdetail("tuvl resumes a call's stream at most %d times.", MCP_MAX_RESUMES)));
	p->resume_id = last;
	p->resume_ms = Max(0, Min(retry, 30000));
	p->resume_rpc = id;
	return true;
}

/* A task's poll interval is kept within these bounds. */
#define MCP_TASK_MIN_POLL_MS 100
#define MCP_TASK_MAX_POLL_MS (10 * 60 * 1000)
#define MCP_TASK_DEFAULT_POLL_MS 1000

/* The task's pollIntervalMs (or the last one), within the bounds. */
static void
task_poll_interval(Jsonb *task, McpProgress *p)
{
	JsonbValue *v = JsonGetField(task, "pollIntervalMs");

	if (v && v->type == jbvNumeric)
		p->task_poll_ms = Max(MCP_TASK_MIN_POLL_MS,
							  Min(MCP_TASK_MAX_POLL_MS, JsonGetInt32(task, "pollIntervalMs", 0)));
	else if (p->task_poll_ms == 0)
		p->task_poll_ms = MCP_TASK_DEFAULT_POLL_MS;
}

/*
 * Did the server answer the call with a task (resultType "task", the
 * tasks extension)?  Then p remembers it, to poll with tasks/get.
 */
static bool
task_created(Jsonb *answer, McpProgress *p)
{
	char	   *type = answer ? JsonGetString(answer, "resultType") : NULL;
	char	   *id;

	if (type == NULL || strcmp(type, "task") != 0)
		return false;
	if (!p->can_ask)
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP tools/call failed: the server answered with a task, which tuvl did not ask for"),
				 errdetail("An agent's tool call does not declare the %s extension.", MCP_TASKS_EXTENSION)));
	id = JsonGetString(answer, "taskId");
	if (id == NULL || *id == '\0' || strlen(id) > 512)
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP tools/call failed: the server's task has no taskId")));
	p->task_id = id;
	p->task_poll_ms = 0;
	p->task_until = 0;
	task_poll_interval(answer, p);
	return true;
}

/*
 * The state of the task (a tasks/get answer): its result when completed
 * (returns true), false while it works; raises when it failed, was
 * cancelled or asks for input.
 */
static bool
task_done(Jsonb *task, const char *tool, McpProgress *p, Jsonb **answer)
{
	char	   *status = task ? JsonGetString(task, "status") : NULL;
	char	   *message = task ? JsonGetString(task, "statusMessage") : NULL;

	if (status == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP tasks/get failed: the answer for task %s has no status", p->task_id)));
	if (strcmp(status, "completed") == 0)
	{
		*answer = JsonGetField(task, "result") ? JsonGetJsonb(task, "result") : NULL;
		if (*answer == NULL || !JsonIsObject(*answer))
			ereport(ERROR,
					(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
					 errmsg("MCP tasks/get failed: task %s completed without a result object", p->task_id)));
		return true;
	}
	if (strcmp(status, "failed") == 0)
	{
		Jsonb	   *e = JsonGetField(task, "error") ? JsonGetJsonb(task, "error") : NULL;
		char	   *m = e && JsonIsObject(e) ? JsonGetString(e, "message") : NULL;

		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP tool \"%s\" failed: its task %s failed: %s", tool, p->task_id,
						m ? m : message ? message : "no message"),
				 e && JsonGetField(e, "code") ?
				 errdetail("JSON-RPC error code %s.", JsonClipText(JsonGetText(e, "code"), 40)) : 0));
	}
	if (strcmp(status, "cancelled") == 0)
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP tool \"%s\" failed: the server cancelled its task %s%s%s", tool, p->task_id,
						message ? ": " : "", message ? message : "")));
	if (strcmp(status, "input_required") == 0)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("MCP tool \"%s\" failed: its task %s asks for input, which tuvl does not answer for a task yet",
						tool, p->task_id),
				 errhint("A server that asks before it creates the task (input_required on tools/call) is answered.")));
	/* working (or a status to come): poll again */
	task_poll_interval(task, p);
	return false;
}

/*
 * The result r (at position i) of a stateless call: true with the tool's
 * result in *answer; false when the server no longer speaks the revision
 * (negotiate down), made the call a task, or asks for input.
 */
static bool
walk_stateless_call(Jsonb *r, int i, McpProgress *p, Jsonb **answer)
{
	int			status = JsonGetInt32(r, "status", 0);
	bool		up;

	if (version_mismatch(r, &up))
	{
		/* the server no longer speaks it: negotiate down */
		p->stateless = false;
		p->downgraded = p->learned = true;
		return false;
	}
	if (status < 200 || status >= 300)
		fail_transport(r, "tools/call");
	*answer = rpc_answer(r, answer_id(r, i), "tools/call");
	p->input_required = NULL;
	p->answers = p->waits = NULL;
	if (task_created(*answer, p) || input_required(*answer, p))
		return false;
	return true;
}

/*
 * What follows a stateless call's answer, at position i of the step's
 * records (r, whose op is op): a poll of the task the call became
 * (task_get), the time of the next (task_wait), a person's answer to an
 * input request (elicitation) or its deadline (elicit_wait).  Returns
 * false for any other record; *done says that the call's answer is in
 * *answer.
 */
static bool
walk_after_call(Jsonb *r, int i, const char *op, const char *tool, McpProgress *p, Jsonb **answer,
				bool *done)
{
	int			status = JsonGetInt32(r, "status", 0);

	*done = false;
	if (strcmp(op, "task_get") == 0 && p->task_id)
	{
		if (status < 200 || status >= 300)
			fail_transport(r, "tasks/get");
		p->task_until = 0;
		*done = task_done(rpc_answer(r, answer_id(r, i), "tasks/get"), tool, p, answer);
	}
	else if (strcmp(op, "task_wait") == 0 && p->task_id)
		p->task_until = (TimestampTz) JsonGetInt(r, "until_us", 0);
	else if (strcmp(op, "elicitation") == 0 && p->input_required)
	{
		/* a person's answer (or a timeout's) to one input request */
		char	   *key = JsonGetString(r, "request");
		Jsonb	   *resp = JsonSetKey(JsonEmptyObject(), "action",
									  JsonStringValue(JsonGetString(r, "action")));

		if (JsonGetField(r, "content"))
			resp = JsonSetKey(resp, "content", JsonGetJsonb(r, "content"));
		if (key)
			p->answers = JsonSetKey(p->answers ? p->answers : JsonEmptyObject(), key, resp);
	}
	else if (strcmp(op, "elicit_wait") == 0 && p->input_required && JsonGetString(r, "request"))
		p->waits = JsonSetKey(p->waits ? p->waits : JsonEmptyObject(), JsonGetString(r, "request"),
							  JsonGetJsonb(r, "until_us"));
	else
		return false;
	return true;
}

/*
 * Walk the step's effects so far, updating p.  Returns true with *answer
 * set to the result of tools/call when it arrived (the step is done);
 * raises for a failure.
 */
bool
McpWalkEffects(RunState *run, int first, int n, const char *url, const char *tool, McpProgress *p,
			   Jsonb **answer)
{
	for (int i = first; i < n; i++)
	{
		Jsonb	   *r = EffectAt(run, i);
		char	   *op = JsonGetString(r, "op");
		int			status = JsonGetInt32(r, "status", 0);
		bool		done;

		if (op == NULL)
			continue;
		/* the token was refused: a person has to connect (again) */
		if (p->oauth_url)
			p->oauth_refused(r, p->oauth_url);
		if (strcmp(op, "discover") == 0)
		{
			/* a server that cannot be reached fails here, not in initialize */
			if (status == 0)
				fail_transport(r, "server/discover");
			p->discovered = p->learned = true;
			p->stateless = discover_offers_stateless(r, answer_id(r, i));
		}
		else if (strcmp(op, "initialize") == 0)
		{
			Jsonb	   *init;
			bool		up;

			/* a server that speaks the stateless revision only: use it */
			if (version_mismatch(r, &up) && up && !p->downgraded)
			{
				p->discovered = p->stateless = p->learned = true;
				continue;
			}
			p->discovered = true;
			p->stateless = false;
			if (status < 200 || status >= 300)
				fail_transport(r, "initialize");
			init = rpc_answer(r, answer_id(r, i), "initialize");
			p->session = session_of(r);
			p->version = init ? JsonGetString(init, "protocolVersion") : NULL;
			if (p->version == NULL)
				p->version = MCP_PROTOCOL_VERSION;
			check_version(p->version);
			p->notified = false;
			p->from_cache = false;
		}
		else if (strcmp(op, "initialized") == 0)
		{
			if (status >= 400 || status == 0)
				fail_transport(r, "notifications/initialized");
			p->notified = true;
		}
		else if (strcmp(op, "call") == 0 && JsonGetString(r, "session") == NULL &&
				 JsonGetString(r, "version") &&
				 strcmp(JsonGetString(r, "version"), MCP_STATELESS_VERSION) == 0)
		{
			/* a stateless call; the first effect: the server was known */
			if (i == first)
				p->discovered = p->stateless = true;
			if (walk_stateless_call(r, i, p, answer))
				return true;
		}
		else if (walk_after_call(r, i, op, tool, p, answer, &done))
		{
			if (done)
				return true;
		}
		else if (strcmp(op, "call") == 0)
		{
			if (i == first)
			{
				/* the first call used a session cached by this process */
				p->discovered = true;
				p->session = JsonGetString(r, "session");
				p->version = JsonGetString(r, "version");
				p->from_cache = true;
			}
			if ((status == 404 || status == 400) && p->from_cache)
			{
				/* the server lost the session: initialize again */
				const char *elicitation = p->elicitation;
				bool		can_ask = p->can_ask;
				const char *oauth_url = p->oauth_url;
				void		(*oauth_refused) (Jsonb *r, const char *url) = p->oauth_refused;

				session_forget(url, p->session);
				memset(p, 0, sizeof(McpProgress));
				p->discovered = true;	/* still a 2025 server */
				p->elicitation = elicitation;
				p->can_ask = can_ask;
				p->oauth_url = oauth_url;
				p->oauth_refused = oauth_refused;
				continue;
			}
			if (status < 200 || status >= 300)
				fail_transport(r, "tools/call");
			fail_if_stream_asks(r, answer_id(r, i));
			if (stream_resumable(r, answer_id(r, i), p))
				continue;
			*answer = rpc_answer(r, answer_id(r, i), "tools/call");
			return true;
		}
		else if (strcmp(op, "resume") == 0)
		{
			/* the call's stream, resumed with GET after it ended */
			p->resume_id = NULL;
			if (status < 200 || status >= 300)
				fail_transport(r, "tools/call (resuming its event stream)");
			if (stream_resumable(r, answer_id(r, i), p))
				continue;
			*answer = rpc_answer(r, answer_id(r, i), "tools/call");
			return true;
		}
	}
	return false;
}

static bool close_at_exit = false;

/* headers, copied into TopMemoryContext (they outlive the step). */
static List *
copy_headers(List *headers)
{
	MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);
	List	   *out = NIL;
	ListCell   *lc;

	foreach(lc, headers)
	{
		HttpHeader *h = palloc(sizeof(HttpHeader));

		h->name = pstrdup(((HttpHeader *) lfirst(lc))->name);
		h->value = pstrdup(((HttpHeader *) lfirst(lc))->value);
		out = lappend(out, h);
	}
	MemoryContextSwitchTo(old);
	return out;
}

/*
 * At exit: end the sessions this process holds with DELETE, as the
 * transport asks of a client that no longer needs one (a server, or a
 * stdio bridge, then frees what it keeps for it).  Each gets at most
 * MCP_CLOSE_TIMEOUT_MS, the process waits for no more than
 * MCP_CLOSE_BUDGET_MS in all, and a failure is ignored.
 */
#define MCP_CLOSE_TIMEOUT_MS 500
#define MCP_CLOSE_BUDGET_MS 2000

static void
close_sessions(int code, Datum arg)
{
	HASH_SEQ_STATUS seq;
	McpSession *s;
	TimestampTz until = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), MCP_CLOSE_BUDGET_MS);

	if (sessions == NULL)
		return;
	hash_seq_init(&seq, sessions);
	while ((s = hash_seq_search(&seq)) != NULL)
	{
		List	   *headers = list_copy(s->headers);
		HttpHeader	sid = {"Mcp-Session-Id", s->session_id};
		HttpHeader	ver = {"MCP-Protocol-Version", s->version};

		if (s->session_id[0] == '\0' || s->server[0] == '\0' || GetCurrentTimestamp() >= until)
			continue;
		headers = lappend(lappend(headers, &sid), &ver);
		(void) HttpSendAtExit("DELETE", s->server, headers, MCP_CLOSE_TIMEOUT_MS);
	}
}

/*
 * At most this many sessions are kept per process (one per server and set
 * of headers); a step that opens one more ends it when it is done.
 */
#define MCP_MAX_SESSIONS 64

/*
 * End a session the process does not keep: with DELETE, sent and not
 * waited for in a worker (whose loop collects and ignores the answer),
 * made at once with a short timeout elsewhere (tuvl.run()).  A failure
 * is ignored: the server expires the session itself.
 */
static void
end_session(const char *server, const char *session, const char *version, List *headers)
{
	HttpRequest del;
	HttpHeader	sid = {"Mcp-Session-Id", (char *) session};
	HttpHeader	ver = {"MCP-Protocol-Version", (char *) version};
	MemoryContext cxt = CurrentMemoryContext;

	memset(&del, 0, sizeof(del));
	del.method = "DELETE";
	del.url = (char *) server;
	del.headers = lappend(lappend(list_copy(headers), &sid), &ver);
	del.timeout_ms = MCP_CLOSE_TIMEOUT_MS;
	PG_TRY();
	{
		/* no owner: the worker's loop frees it when it is done (collect_done) */
		if (MyBackendType == B_BG_WORKER)
			(void) HttpStart(&del, NIL, NULL);
		else
			(void) HttpPerform(&del, NIL);
	}
	PG_CATCH();
	{
		/* not allowed any more: the server expires it; a cancel goes on */
		if (ERRCODE_TO_CATEGORY(geterrcode()) == ERRCODE_OPERATOR_INTERVENTION)
			PG_RE_THROW();
		MemoryContextSwitchTo(cxt);
		FlushErrorState();
	}
	PG_END_TRY();
}

/*
 * The step's call was answered: a session the step opened and the process
 * does not keep (another run's was cached first, or the cache is full) is
 * ended now.
 */
void
McpEndOwnSession(const char *url, McpProgress *p, const char *server, List *headers)
{
	McpSession *s;

	if (p->session == NULL || p->from_cache)
		return;
	s = session_lookup(url, false);
	if (s && strcmp(s->session_id, p->session) == 0)
		return;
	end_session(server, p->session, p->version ? p->version : MCP_PROTOCOL_VERSION, headers);
}

/*
 * Before the first effect, take a session this process holds for url;
 * after a fresh initialize, keep the new session unless the process holds
 * one for url already (opened by a run that started at the same time) or
 * holds MCP_MAX_SESSIONS: the step then uses its own and ends it.
 */
void
McpSyncSessionCache(const char *url, int n, McpProgress *p, const char *server, List *headers)
{
	McpSession *s;

	if (n == 0)
	{
		s = session_lookup(url, false);
		if (s && s->session_id[0])
		{
			p->session = s->session_id;
			p->version = s->version;
			p->notified = true;
			p->from_cache = true;
		}
	}
	else if (p->session && !p->from_cache)
	{
		s = session_lookup(url, false);
		if (s && s->session_id[0])
			return;
		if (s == NULL && sessions && hash_get_num_entries(sessions) >= MCP_MAX_SESSIONS)
			return;
		s = session_lookup(url, true);
		if (s)
		{
			strlcpy(s->session_id, p->session, sizeof(s->session_id));
			strlcpy(s->version, p->version, sizeof(s->version));
			strlcpy(s->server, server, sizeof(s->server));
			if (s->headers)
				list_free_deep(s->headers);
			s->headers = copy_headers(headers);
			if (!close_at_exit)
			{
				before_shmem_exit(close_sessions, (Datum) 0);
				close_at_exit = true;
			}
		}
	}
}

/* The next effect: initialize, notifications/initialized or tools/call. */
EffectRequest *
McpNextRequest(const char *url, const char *tool, Jsonb *args, const char *id, McpProgress *p,
			   int timeout_ms, List *extra)
{
	JsonObjBuilder b;
	EffectRequest *req;

	if (!p->discovered)
		return McpStatelessRequest(url, "server/discover", NULL, NULL, id, "discover", timeout_ms, extra,
								   false, false);
	if (p->stateless)
	{
		Jsonb	   *responses = NULL;

		JsonObjStart(&b);
		JsonObjAddString(&b, "name", tool);
		JsonObjAddJsonb(&b, "arguments", args);
		if (p->input_required)
		{
			/* the same call again, with the answers (and the server's state) */
			responses = input_responses(p->input_required, p->elicitation, p->answers);
			JsonObjAddJsonb(&b, "inputResponses", responses);
			if (JsonGetField(p->input_required, "requestState"))
				JsonObjAddJsonb(&b, "requestState", JsonGetJsonb(p->input_required, "requestState"));
		}
		req = McpStatelessRequest(url, "tools/call", JsonObjEnd(&b), tool, id, "call", timeout_ms, extra,
								  strcmp(p->elicitation, "ask") != 0 || p->can_ask, p->can_ask);
		req->journal = JsonMerge(req->journal, JsonSetKey(JsonSetKey(JsonEmptyObject(), "tool",
																	 JsonStringValue(tool)),
														  "arguments", args));
		if (responses)
			req->journal = JsonSetKey(req->journal, "input_responses", responses);
		return req;
	}
	if (p->session == NULL && p->version == NULL)
		return rpc_request(url, "initialize", initialize_params(), id, NULL, NULL,
						   "initialize", timeout_ms, extra);
	if (!p->notified)
		return rpc_request(url, "notifications/initialized", NULL, NULL, p->session, p->version,
						   "initialized", timeout_ms, extra);
	if (p->resume_id)
	{
		/* GET the call's stream again, after the last event seen */
		JsonObjBuilder t;

		req = palloc0(sizeof(EffectRequest));
		req->http.method = "GET";
		req->http.url = pstrdup(url);
		req->http.timeout_ms = timeout_ms;
		req->delay_ms = p->resume_ms;
		/* the server may keep the stream open: it is complete with the answer */
		req->http.stop_after = psprintf("\"%s\"", p->resume_rpc);
		add_header(req, "Accept", "text/event-stream");
		add_header(req, "Last-Event-ID", p->resume_id);
		if (p->session)
			add_header(req, "Mcp-Session-Id", p->session);
		if (p->version)
			add_header(req, "MCP-Protocol-Version", p->version);
		req->http.headers = list_concat(req->http.headers, extra);
		JsonObjStart(&b);
		JsonObjAddString(&b, "method", "GET");
		JsonObjAddString(&b, "url", HttpRedactUrl(url));
		JsonObjAddString(&b, "rpc", "tools/call");
		JsonObjAddString(&b, "last_event_id", p->resume_id);
		req->journal = JsonObjEnd(&b);
		JsonObjStart(&t);
		JsonObjAddString(&t, "op", "resume");
		JsonObjAddString(&t, "rpc_id", p->resume_rpc);
		if (p->session)
			JsonObjAddString(&t, "session", p->session);
		if (p->version)
			JsonObjAddString(&t, "version", p->version);
		req->tag = JsonObjEnd(&t);
		return req;
	}
	JsonObjStart(&b);
	JsonObjAddString(&b, "name", tool);
	JsonObjAddJsonb(&b, "arguments", args);
	req = rpc_request(url, "tools/call", JsonObjEnd(&b), id, p->session, p->version,
					  "call", timeout_ms, extra);
	/* a question on the stream waits for an answer there: stop reading */
	req->http.stop_after = "\"elicitation/create\"";
	req->journal = JsonMerge(req->journal, JsonSetKey(JsonSetKey(JsonEmptyObject(), "tool",
																 JsonStringValue(tool)),
													  "arguments", args));
	return req;
}

static const char cache_sql[] =
"INSERT INTO tuvl.mcp_tools AS c (url, name, description, input_schema, listed_at) "
"SELECT $1, t OPERATOR(pg_catalog.->>) 'name', t OPERATOR(pg_catalog.->>) 'description', "
"       t OPERATOR(pg_catalog.->) 'inputSchema', pg_catalog.now() "
"FROM pg_catalog.jsonb_array_elements($2) AS t "
"WHERE t OPERATOR(pg_catalog.->>) 'name' IS NOT NULL "
"ON CONFLICT (url, name) DO UPDATE SET description = excluded.description, "
"  input_schema = excluded.input_schema, listed_at = excluded.listed_at";

/*
 * Remember the tools a server listed, so that an agent calling one of
 * them without declared parameters offers the model the server's schema.
 */
static void
cache_tools(const char *url, Jsonb *tools)
{
	static const Oid types[2] = {TEXTOID, JSONBOID};
	Datum		values[2];
	SecurityFrame frame;

	values[0] = CStringGetTextDatum(url);
	values[1] = JsonbPGetDatum(tools);
	SPI_connect();
	SecurityAsOwner(&frame);
	SpiExec(cache_sql, 2, types, values, NULL, SPI_OK_INSERT);
	SecurityRestore(&frame);
	SPI_finish();
}

/*
 * The input schema of an MCP step's tool, when tuvl.mcp_list_tools() has
 * listed it for the step's (literal) url; else NULL.  SPI must be
 * connected.
 */
Jsonb *
McpKnownInputSchema(Jsonb *mcp)
{
	static const Oid types[2] = {TEXTOID, TEXTOID};
	char	   *url = mcp ? JsonGetString(mcp, "url") : NULL;
	char	   *tool = mcp ? JsonGetString(mcp, "tool") : NULL;
	Jsonb	   *schema = NULL;
	Datum		d;

	if (url == NULL || tool == NULL || TemplateHasPlaceholders(url) ||
		TemplateHasPlaceholders(tool))
		return NULL;
	if (SecurityExecArgs("SELECT input_schema FROM tuvl.mcp_tools "
						 "WHERE url OPERATOR(pg_catalog.=) $1 AND name OPERATOR(pg_catalog.=) $2 "
						 "  AND pg_catalog.jsonb_typeof(input_schema) OPERATOR(pg_catalog.=) 'object'",
						 SPI_OK_SELECT, 2, types, CStringGetTextDatum(url),
						 CStringGetTextDatum(tool)) == 1 && SpiValue(1, &d))
		schema = DatumGetJsonbPCopy(d);
	return schema;
}

/*
 * The tools tuvl.mcp_list_tools() listed for url, as a jsonb array of
 * {name, description, inputSchema} in name order (empty when it never
 * listed them).  SPI must be connected.
 */
Jsonb *
McpListedTools(const char *url)
{
	static const Oid types[1] = {TEXTOID};
	Datum		d;

	if (SecurityExecArgs("SELECT COALESCE(pg_catalog.jsonb_agg(pg_catalog.jsonb_strip_nulls("
						 "pg_catalog.jsonb_build_object('name', name, 'description', description, "
						 "'inputSchema', input_schema)) ORDER BY name), '[]'::pg_catalog.jsonb) "
						 "FROM tuvl.mcp_tools WHERE url OPERATOR(pg_catalog.=) $1",
						 SPI_OK_SELECT, 1, types, CStringGetTextDatum(url)) == 1 && SpiValue(1, &d))
		return DatumGetJsonbPCopy(d);
	return JsonFromCString("[]");
}

/*
 * tuvl.mcp_list_tools(url): ask the server's revisions (server/discover);
 * list its tools statelessly when it speaks 2026-07-28, else in a session
 * of its own (initialize, then DELETE); synchronously in this backend.
 * Returns the tools array.
 */
Datum
tuvl_mcp_list_tools(PG_FUNCTION_ARGS)
{
	char	   *url;
	Jsonb	   *hdrs = PG_NARGS() > 1 && !PG_ARGISNULL(1) ? PG_GETARG_JSONB_P(1) : NULL;
	SecretUse	use;
	List	   *extra;
	EffectRequest *req;
	Jsonb	   *r;
	Jsonb	   *init;
	Jsonb	   *list;
	char	   *session;
	char	   *version;
	bool		stateless;

	TokenRequireScope("workflows:write");
	if (PG_ARGISNULL(0))
		PG_RETURN_NULL();
	url = text_to_cstring(PG_GETARG_TEXT_PP(0));
	TuvlRefuseWhileReplaying("tuvl.mcp_list_tools()");
	SecretUseInit(&use, NULL);
	if (hdrs && !JsonIsObject(hdrs))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("headers must be a JSON object such as {\"Authorization\": \"Bearer {{ secrets.mcp_token }}\"}")));
	{
		JsonbValue	hv;

		hv.type = jbvBinary;
		hv.val.binary.data = hdrs ? &hdrs->root : NULL;
		hv.val.binary.len = hdrs ? VARSIZE(hdrs) : 0;
		extra = hdrs ? McpRenderHeaders(&hv, JsonEmptyObject(), &use) : NIL;
	}
	/* which revision: server/discover, as a step asks */
	req = McpStatelessRequest(url, "server/discover", NULL, NULL, "tuvl-list-0", "discover",
							  tuvl_http_timeout, list_copy(extra), false, false);
	req->secrets = use.values;
	r = EffectPerform(req);
	if (JsonGetInt32(r, "status", 0) == 0)
		fail_transport(r, "server/discover");
	stateless = discover_offers_stateless(r, "tuvl-list-0");
	McpRevisionRemember(url, stateless);
	session = NULL;
	version = MCP_STATELESS_VERSION;
	if (!stateless)
	{
		req = rpc_request(url, "initialize", initialize_params(), "tuvl-list-1", NULL, NULL, "initialize",
						  tuvl_http_timeout, extra);
		req->secrets = use.values;
		r = EffectPerform(req);
		if (JsonGetInt32(r, "status", 0) < 200 || JsonGetInt32(r, "status", 0) >= 300)
			fail_transport(r, "initialize");
		init = rpc_answer(r, "tuvl-list-1", "initialize");
		session = session_of(r);
		version = init ? JsonGetString(init, "protocolVersion") : NULL;
		if (version)
			check_version(version);
		else
			version = MCP_PROTOCOL_VERSION;
		req = rpc_request(url, "notifications/initialized", NULL, NULL, session, version, "initialized",
						  tuvl_http_timeout, list_copy(extra));
		req->secrets = use.values;
		r = EffectPerform(req);
		if (JsonGetInt32(r, "status", 0) >= 400 || JsonGetInt32(r, "status", 0) == 0)
			fail_transport(r, "notifications/initialized");
	}
	{
		Jsonb	   *all = JsonFromCString("[]");
		char	   *cursor = NULL;

		/* follow nextCursor through every page (bounded) */
		for (int page = 0; page < 100; page++)
		{
			Jsonb	   *params = cursor ? JsonSetKey(JsonEmptyObject(), "cursor", JsonStringValue(cursor))
			: JsonEmptyObject();
			Jsonb	   *tools;

			if (stateless)
				req = McpStatelessRequest(url, "tools/list", params, NULL, psprintf("tuvl-list-%d", 2 + page),
										  "list", tuvl_http_timeout, list_copy(extra), false, false);
			else
				req = rpc_request(url, "tools/list", params, psprintf("tuvl-list-%d", 2 + page), session,
								  version, "list", tuvl_http_timeout, list_copy(extra));
			req->secrets = use.values;
			r = EffectPerform(req);
			if (JsonGetInt32(r, "status", 0) < 200 || JsonGetInt32(r, "status", 0) >= 300)
				fail_transport(r, "tools/list");
			list = rpc_answer(r, psprintf("tuvl-list-%d", 2 + page), "tools/list");
			tools = list ? JsonGetJsonb(list, "tools") : NULL;
			if (tools && JB_ROOT_IS_ARRAY(tools) && !JB_ROOT_IS_SCALAR(tools))
				all = JsonMerge(all, tools);
			cursor = list ? JsonGetString(list, "nextCursor") : NULL;
			if (cursor == NULL || *cursor == '\0')
				break;
		}
		cache_tools(url, all);
		/* the session was for this listing only: end it */
		if (session)
		{
			HttpRequest del;
			HttpHeader	sid = {"Mcp-Session-Id", session};

			memset(&del, 0, sizeof(del));
			del.method = "DELETE";
			del.url = url;
			del.headers = lappend(list_copy(extra), &sid);
			del.timeout_ms = tuvl_http_timeout;
			(void) HttpPerform(&del, use.values);
		}
		PG_RETURN_JSONB_P(all);
	}
}
