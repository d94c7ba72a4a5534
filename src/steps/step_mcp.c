/*-------------------------------------------------------------------------
 *
 * step_mcp.c
 *	  The MCP step: one tool of an MCP server, called through the client
 *	  of mcp.c; its checks and its row of the step table.
 *
 * Each transition renders the mcp mapping (url, tool, arguments, headers)
 * from the context, lets mcp_oauth.c fetch a token first when mcp.auth
 * asks for one, walks the step's journaled effects (McpWalkEffects) and
 * returns the next message the client builds (McpNextRequest) as an
 * effect.  What is the step's own: it parks the run for a person's answer
 * to the server's question (mcp.elicitation ask, await_person) and
 * between the polls of a task (poll_task), and turns the tool's answer
 * into its output (call_output).
 *
 * After a crash the step is executed again and walks the same journaled
 * effects: nothing already answered is sent again, and the message that
 * was in flight goes again with the same JSON-RPC id (its effect's
 * idempotency key), so a tools/call in flight may reach the server twice.
 * A failure is an mcp_error (set before the client is called: the client
 * classifies nothing), except a template's (template_error), the tool's
 * own (mcp_tool_error) and a refused token's (mcp_oauth.c).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "lib/stringinfo.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"

#include "duration.h"
#include "effect.h"
#include "executor.h"
#include "http.h"
#include "journal.h"
#include "jsonutil.h"
#include "mcp.h"
#include "mcp_oauth.h"
#include "secret.h"
#include "template.h"
#include "tuvl.h"

/*
 * Turn a tools/call result into the step output: the joined text
 * content, the content list, and structuredContent when present.
 */
static Jsonb *
call_output(Jsonb *res, const char *tool)
{
	Jsonb	   *content = JsonGetJsonb(res, "content");
	StringInfoData text;
	JsonObjBuilder b;

	initStringInfo(&text);
	if (content && JB_ROOT_IS_ARRAY(content) && !JB_ROOT_IS_SCALAR(content))
	{
		int			n = JsonContainerSize(&content->root);

		for (int i = 0; i < n; i++)
		{
			Jsonb	   *c = JsonValueToJsonb(getIthJsonbValueFromContainer(&content->root, i));
			char	   *type = JsonIsObject(c) ? JsonGetString(c, "type") : NULL;
			char	   *t = type && strcmp(type, "text") == 0 ? JsonGetString(c, "text") : NULL;

			if (t)
			{
				if (text.len > 0)
					appendStringInfoChar(&text, '\n');
				appendStringInfoString(&text, t);
			}
		}
	}
	if (JsonGetBool(res, "isError", false))
	{
		ExecutorErrorType = "mcp_tool_error";
		ereport(ERROR,
				(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
				 errmsg("MCP tool \"%s\" failed: %s", tool, text.len > 0 ? text.data : "no message")));
	}
	JsonObjStart(&b);
	JsonObjAddString(&b, "text", text.data);
	JsonObjAddJsonb(&b, "content", content ? content : JsonFromCString("[]"));
	if (JsonGetField(res, "structuredContent"))
		JsonObjAddJsonb(&b, "structuredContent", JsonGetJsonb(res, "structuredContent"));
	return JsonObjEnd(&b);
}

/*
 * Called as an agent's tool, the model's arguments are the tool's: with
 * no mcp.arguments they are passed as they are; else each declared
 * argument the model gave replaces the rendered one.
 */
static Jsonb *
agent_arguments(JsonbValue *declared, Jsonb *rendered, Jsonb *model)
{
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (declared == NULL)
		return model;
	if (!JsonIsObject(rendered))
		return rendered;
	it = JsonbIteratorInit(&model->root);
	while (JsonObjectNext(&it, &key, &v))
		if (JsonGetField(rendered, key))
			rendered = JsonSetKey(rendered, key, JsonValueToJsonb(&v));
	return rendered;
}

/*
 * mcp.elicitation ask: the input requests of the last answer that nobody
 * has answered yet park the run for a person, one at a time, as a Human
 * step waits (waiting_human, tuvl.people_queue): tuvl.submit() accepts
 * with the content, tuvl.reject() declines or cancels (run_control.c
 * records the answer in the step's records).  A request whose
 * elicitation_timeout (wait_ms; 0: none) passed unanswered is answered
 * "cancel", as a person who dismissed it.  Returns true with the run
 * parked in result; false once every request has its answer.
 */
static bool
await_person(RunState *run, const char *step_id, McpProgress *p, const char *url, const char *tool,
			 int wait_ms, List *secrets, StepResult *result)
{
	Jsonb	   *requests = McpInputRequests(p->input_required);
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;
	JsonObjBuilder b;

	it = JsonbIteratorInit(&requests->root);
	while (JsonObjectNext(&it, &key, &v))
	{
		Jsonb	   *req = JsonValueToJsonb(&v);
		Jsonb	   *params = McpRequestParams(req);
		TimestampTz until = 0;
		Jsonb	   *info;

		if (p->answers && JsonGetField(p->answers, key))
			continue;
		if (p->waits && JsonGetField(p->waits, key))
			until = (TimestampTz) JsonGetInt(p->waits, key, 0);
		else if (wait_ms > 0)
		{
			until = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), wait_ms);
			JsonObjStart(&b);
			JsonObjAddString(&b, "op", "elicit_wait");
			JsonObjAddString(&b, "request", key);
			JsonObjAddInt(&b, "until_us", until);
			EffectRecord(run, JsonObjEnd(&b));
		}
		if (until != 0 && GetCurrentTimestamp() >= until)
		{
			/* nobody answered in time: as a person who dismissed it */
			JsonObjStart(&b);
			JsonObjAddString(&b, "op", "elicitation");
			JsonObjAddString(&b, "request", key);
			JsonObjAddString(&b, "action", "cancel");
			JsonObjAddString(&b, "by", "tuvl");
			JsonObjAddBool(&b, "timed_out", true);
			EffectRecord(run, JsonObjEnd(&b));
			/* journaled as a person's answer, so that a replay serves it */
			JsonObjStart(&b);
			JsonObjAddString(&b, "action", "cancel");
			JsonObjAddString(&b, "by", "tuvl");
			JsonObjAddString(&b, "request", key);
			JsonObjAddString(&b, "tool", tool);
			JsonObjAddString(&b, "reason", psprintf("no answer within the elicitation_timeout of %s",
													wait_ms % 1000 == 0 ? psprintf("%d s", wait_ms / 1000) :
													psprintf("%d ms", wait_ms)));
			JournalAdd(&run->step_events, "decision", step_id, "MCP", JsonObjEnd(&b));
			p->answers = JsonSetKey(p->answers ? p->answers : JsonEmptyObject(), key,
									JsonSetKey(JsonEmptyObject(), "action", JsonStringValue("cancel")));
			continue;
		}

		/* what people_queue shows and tuvl.submit() checks the answer with */
		JsonObjStart(&b);
		JsonObjAddString(&b, "kind", "mcp_elicitation");
		JsonObjAddString(&b, "server", HttpRedactUrl(url));
		JsonObjAddString(&b, "tool", tool);
		JsonObjAddString(&b, "request", key);
		JsonObjAddString(&b, "mode", McpRequestIsForm(req) ? "form" : "url");
		JsonObjAddString(&b, "message", params ? JsonGetString(params, "message") : NULL);
		if (McpRequestIsForm(req))
			JsonObjAddJsonb(&b, "form", params && JsonGetField(params, "requestedSchema") ?
							JsonGetJsonb(params, "requestedSchema") :
							JsonFromCString("{\"type\": \"object\"}"));
		else
			JsonObjAddString(&b, "url", params ? JsonGetString(params, "url") : NULL);
		JsonObjAddInt(&b, "round", p->rounds);
		if (until != 0)
			StepSleepAddWake(&b, until);
		info = SecretScrubJsonb(JsonObjEnd(&b), secrets);
		result->park = RUN_WAITING_HUMAN;
		result->park_info = info;
		return true;
	}
	return false;
}

/*
 * The call became task p->task_id: sleep until its next poll (parking the
 * run; a task_wait record holds the time), or poll it now with tasks/get.
 * A replay polls at once: the answers are the recording's.
 */
static void
poll_task(RunState *run, McpProgress *p, const char *url, const char *tool, int timeout_ms,
		  List *extra, List *secrets, StepResult *result)
{
	TimestampTz now = GetCurrentTimestamp();
	JsonObjBuilder b;
	EffectRequest *req;
	int			n;

	if (p->task_until == 0 && !run->replay)
	{
		p->task_until = TimestampTzPlusMilliseconds(now, p->task_poll_ms);
		JsonObjStart(&b);
		JsonObjAddString(&b, "op", "task_wait");
		JsonObjAddInt(&b, "until_us", p->task_until);
		EffectRecord(run, JsonObjEnd(&b));
	}
	if (p->task_until > now && !run->replay)
	{
		JsonObjStart(&b);
		JsonObjAddString(&b, "kind", "mcp_task");
		JsonObjAddString(&b, "server", HttpRedactUrl(url));
		JsonObjAddString(&b, "tool", tool);
		JsonObjAddString(&b, "task", p->task_id);
		StepSleepAddWake(&b, p->task_until);
		result->park = RUN_SLEEPING;
		result->park_info = SecretScrubJsonb(JsonObjEnd(&b), secrets);
		return;
	}
	n = EffectCount(run);
	req = McpStatelessRequest(url, "tasks/get",
							  JsonSetKey(JsonEmptyObject(), "taskId", JsonStringValue(p->task_id)),
							  NULL, EffectKey(run, n), "task_get", timeout_ms, extra, false, true);
	req->journal = JsonSetKey(req->journal, "task", JsonStringValue(p->task_id));
	req->secrets = secrets;
	req->journal = SecretScrubJsonb(req->journal, secrets);
	result->pending = true;
	result->effect = req;
}

/*
 * The MCP step: see the file header.  A request's JSON-RPC id is its
 * effect's idempotency key, so ids never repeat within a session that
 * the runs of a worker share.
 */
void
StepExecuteMCP(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	Jsonb	   *mcp = JsonGetJsonb(step->spec, "mcp");
	char	   *url;
	char	   *tool = JsonGetString(mcp, "tool");
	JsonbValue *argv = JsonGetField(mcp, "arguments");
	Jsonb	   *args;
	Jsonb	   *answer;
	int			n = EffectCount(run);
	int			timeout_ms = tuvl_http_timeout;
	McpProgress p;
	SecretUse	use;
	EffectRequest *req;
	List	   *extra;
	char	   *skey;
	int			first = 0;		/* the step's first MCP message (after OAuth) */

	SecretUseInit(&use, run);
	ExecutorErrorType = "template_error";
	url = TemplateRenderText(JsonGetString(mcp, "url"), ctx, &use.opts);
	extra = McpRenderHeaders(JsonGetField(mcp, "headers"), ctx, &use);
	tool = TemplateRenderText(tool, ctx, &use.opts);
	args = argv ? JsonValueToJsonb(TemplateRenderValue(argv, ctx, &use.opts)) : JsonEmptyObject();
	if (run->tool_args)
		args = agent_arguments(argv, args, run->tool_args);
	(void) DurationFromJson(JsonGetField(mcp, "timeout"), &timeout_ms);
	ExecutorErrorType = "mcp_error";
	EffectCheckAllowed(url, use.values);
	if (JsonGetField(mcp, "auth"))
	{
		/* OAuth first: discovery and a grant, or the token the role holds */
		HttpHeader *bearer = NULL;

		req = McpOAuthStep(run, JsonGetJsonb(mcp, "auth"), url, &use, timeout_ms, &bearer, &first);
		if (req)
		{
			result->pending = true;
			result->effect = req;
			return;
		}
		ExecutorErrorType = "mcp_error";
		extra = lappend(extra, bearer);
	}
	skey = McpSessionKey(url, extra);

	/* walk what happened so far */
	memset(&p, 0, sizeof(p));
	p.elicitation = JsonGetString(mcp, "elicitation");
	if (p.elicitation == NULL)
		p.elicitation = "ask";
	/* an agent's tool call cannot wait for a person */
	p.can_ask = run->effect_call == 0 && run->tool_args == NULL;
	p.oauth_url = JsonGetField(mcp, "auth") ? url : NULL;
	p.oauth_refused = McpOAuthCheckRefused;
	if (McpWalkEffects(run, first, n, skey, tool, &p, &answer))
	{
		if (p.learned)
			McpRevisionRemember(url, p.stateless);
		McpEndOwnSession(skey, &p, url, extra);
		result->output = call_output(answer, tool);
		result->output = SecretScrubJsonb(result->output, use.values);
		result->has_output = true;
		return;
	}

	/* what next */
	if (p.learned)
		McpRevisionRemember(url, p.stateless);
	if (p.task_id)
	{
		/* a task: poll it with tasks/get, the run sleeping in between */
		poll_task(run, &p, url, tool, timeout_ms, extra, use.values, result);
		return;
	}
	if (p.input_required && strcmp(p.elicitation, "ask") == 0)
	{
		/* the server needs a person's answer: wait for it */
		int			wait_ms = 0;

		(void) DurationFromJson(JsonGetField(mcp, "elicitation_timeout"), &wait_ms);
		if (await_person(run, step->id, &p, url, tool, wait_ms, use.values, result))
			return;
		n = EffectCount(run);	/* a timeout's answer was recorded */
	}
	McpSyncSessionCache(skey, n - first, &p, url, extra);
	if (n == first)
	{
		/* a cached session is a 2025 server's; else what the process knows */
		int			known = p.session ? 0 : McpRevisionKnown(url);

		p.discovered = known >= 0;
		p.stateless = known == 1;
	}
	/* the effect's idempotency key: no other request of any run repeats it */
	req = McpNextRequest(url, tool, args, EffectKey(run, n), &p, timeout_ms, extra);
	req->secrets = use.values;
	req->journal = SecretScrubJsonb(req->journal, use.values);
	result->pending = true;
	result->effect = req;
}

/* ---------------------------------------------------------------- validation */

static const char *const mcp_keys[] = {"mcp", "rate_limit", NULL};

/*
 * v as a mapping, its keys checked against keys; NULL, with the finding
 * message at path, when it is not a mapping.
 */
static Jsonb *
known_mapping(ValidateState *vs, JsonbValue *v, const char *path, const char *const *keys,
			  const char *message)
{
	Jsonb	   *m;

	if (!ValidateIsMapping(v))
	{
		ValidateFinding(vs, "error", path, "%s", message);
		return NULL;
	}
	m = JsonValueToJsonb(v);
	ValidateUnknownKeys(vs, m, path, keys, NULL);
	return m;
}

/*
 * mcp.auth: { oauth: { grant, client_id, client_secret_secret, scopes } }
 * (docs/mcp.md#oauth).
 */
static void
check_mcp_auth(ValidateState *vs, JsonbValue *auth, const char *path)
{
	static const char *const auth_keys[] = {"oauth", NULL};
	static const char *const oauth_keys[] = {"grant", "client_id", "client_secret_secret", "scopes",
	NULL};
	Jsonb	   *a;
	Jsonb	   *o;
	char	   *opath = psprintf("%s.oauth", path);
	char	   *grant;
	JsonbValue *v;

	if (auth == NULL)
		return;
	a = known_mapping(vs, auth, path, auth_keys,
					  "auth must be a mapping such as { oauth: { grant: client_credentials, client_id: my-client, client_secret_secret: my_secret } }");
	if (a == NULL)
		return;
	o = known_mapping(vs, JsonGetField(a, "oauth"), opath, oauth_keys,
					  "oauth must be a mapping with grant (client_credentials or authorization_code)");
	if (o == NULL)
		return;
	grant = JsonGetString(o, "grant");
	if (grant == NULL || (strcmp(grant, "client_credentials") != 0 &&
						  strcmp(grant, "authorization_code") != 0))
		ValidateFinding(vs, "error", psprintf("%s.grant", opath),
						"grant must be client_credentials (a server-to-server client with a secret) or "
						"authorization_code (a person connects with tuvl.mcp_connect())");
	else if (strcmp(grant, "client_credentials") == 0 &&
			 (JsonGetString(o, "client_id") == NULL || JsonGetString(o, "client_secret_secret") == NULL))
		ValidateFinding(vs, "error", opath,
						"the client_credentials grant needs client_id and client_secret_secret (the name of a secret holding the client's secret)");
	v = JsonGetField(o, "client_id");
	if (v && (v->type != jbvString || v->val.string.len == 0))
		ValidateFinding(vs, "error", psprintf("%s.client_id", opath), "client_id must be a non-empty string");
	v = JsonGetField(o, "client_secret_secret");
	if (v && (v->type != jbvString || v->val.string.len == 0))
		ValidateFinding(vs, "error", psprintf("%s.client_secret_secret", opath),
						"client_secret_secret must be the name of a secret (tuvl.set_secret())");
	v = JsonGetField(o, "scopes");
	if (v)
	{
		Jsonb	   *sc = JsonValueToJsonb(v);
		bool		ok = JB_ROOT_IS_ARRAY(sc) && !JB_ROOT_IS_SCALAR(sc);

		for (int i = 0; ok && i < (int) JsonContainerSize(&sc->root); i++)
		{
			JsonbValue *e = getIthJsonbValueFromContainer(&sc->root, i);

			ok = e->type == jbvString && e->val.string.len > 0 &&
				memchr(e->val.string.val, ' ', e->val.string.len) == NULL;
		}
		if (!ok)
			ValidateFinding(vs, "error", psprintf("%s.scopes", opath),
							"scopes must be a list of scope names such as [mcp:read, mcp:write]");
	}
}

/* The mcp mapping of an MCP step. */
static void
check_mcp_block(ValidateState *vs, Jsonb *mcp, const char *mpath)
{
	static const char *const mcp_keys[] = {"url", "tool", "arguments", "timeout", "headers",
	"elicitation", "elicitation_timeout", "auth", NULL};
	static const char *const elicitations[] = {"ask", "accept_defaults", "decline", NULL};
	JsonbValue *args;
	JsonbValue *elicit;

	ValidateUnknownKeys(vs, mcp, mpath, mcp_keys, NULL);
	elicit = JsonGetField(mcp, "elicitation");
	if (elicit && !ValidateStringIn(elicit, elicitations))
		ValidateFinding(vs, "error", psprintf("%s.elicitation", mpath),
						"elicitation must be ask (the run waits for a person's answer, tuvl.submit() or "
						"tuvl.reject()), accept_defaults (answer the server's questions with the "
						"defaults of its schema) or decline");
	ValidateDuration(vs, mcp, "elicitation_timeout", mpath);
	ValidateScalarMapping(vs, mcp, "headers", mpath,
						  "{ Authorization: \"Bearer {{ secrets.mcp_token }}\" }");
	check_mcp_auth(vs, JsonGetField(mcp, "auth"), psprintf("%s.auth", mpath));
	ValidateRequireString(vs, mcp, "url", mpath, "the mcp mapping");
	ValidateRequireString(vs, mcp, "tool", mpath, "the mcp mapping");
	ValidateDuration(vs, mcp, "timeout", mpath);
	args = JsonGetField(mcp, "arguments");
	if (args && !ValidateIsMapping(args) && args->type != jbvString)
		ValidateFinding(vs, "error", psprintf("%s.arguments", mpath),
						"arguments must be a mapping of the tool's parameters, or one template such as \"{{ args }}\"");
}

static void
validate_mcp(ValidateState *vs, Jsonb *step, const char *path)
{
	ValidateStepMapping(vs, step, path, "mcp", check_mcp_block,
						"an MCP step needs an mcp mapping with url and tool");
}

/* The MCP step's row of the step table (init.c). */
const StepExecutor StepKindMCP = {
	.kind = STEP_MCP,
	.execute = StepExecuteMCP,
	.tool_callable = true,
	.keys = mcp_keys,
	.validate = validate_mcp,
	.rate_limited = true,
};
