/*-------------------------------------------------------------------------
 *
 * llm.c
 *	  The two wire formats that cover nearly every provider: OpenAI Chat
 *	  Completions (and every compatible server: Ollama, vLLM, LiteLLM)
 *	  and Anthropic Messages.  The configurations are model.c's.
 *
 * Callers speak a provider-neutral conversation: a jsonb array of
 * {role: system|user|assistant|tool, content, tool_calls: [{id, name,
 * arguments}], tool_call_id}.  LlmBuildRequest turns it into the
 * provider's request as an effect (effect.c), with the API key read from
 * tuvl.secrets into a header only; LlmParseResult turns the journaled
 * response back into an LlmReply, classifying failures as transient
 * (408, 429, 529, 5xx, timeouts, transport errors) or final (other 4xx,
 * the 429s and 400s that mean the account is out of money, malformed
 * bodies).  Every call is journaled as one llm_turn event carrying the
 * request and response bodies, which hold no credentials.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "common/hashfn.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/json.h"
#include "utils/jsonb.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/numeric.h"
#include "utils/timestamp.h"

#include "admission.h"
#include "jsonutil.h"
#include "llm.h"
#include "template.h"
#include "retry.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"
#include "uses.h"
#include "workflow.h"
#include "yamlparse.h"
#include "tokens.h"


#define ANTHROPIC_VERSION "2023-06-01"
#define DEFAULT_MAX_TOKENS 1024
/* Longest Retry-After honoured, in milliseconds (RetryAfterMs). */
#define MAX_RETRY_AFTER_MS (60 * 1000)

static Jsonb *price_jsonb(const LlmConfig *cfg);

/* Add a float8 as a JSON number. */
static void
add_float(JsonObjBuilder *b, const char *key, double value)
{
	JsonbValue	v;

	v.type = jbvNumeric;
	v.val.numeric = DatumGetNumeric(DirectFunctionCall1(float8_numeric, Float8GetDatum(value)));
	JsonObjAddValue(b, key, &v);
}

/* Append ', "key": ' to an object being written. */
static void
append_key(StringInfo buf, const char *key)
{
	appendStringInfoString(buf, ", ");
	escape_json(buf, key);
	appendStringInfoString(buf, ": ");
}

/* Append "key": <json text of a jsonb value> to an object being written. */
static void
append_json(StringInfo buf, const char *key, Jsonb *value)
{
	append_key(buf, key);
	appendStringInfoString(buf, JsonText(value));
}

/* Append "key": <a string, or null> to an object being written. */
static void
append_str(StringInfo buf, const char *key, const char *value)
{
	append_key(buf, key);
	if (value == NULL)
		appendStringInfoString(buf, "null");
	else
		escape_json(buf, value);
}

/* Extra request fields from params, except those listed. */
static void
append_params(StringInfo buf, Jsonb *params, const char *skip)
{
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (params == NULL)
		return;
	it = JsonbIteratorInit(&params->root);
	while (JsonObjectNext(&it, &key, &v))
	{
		if (strcmp(key, "model") == 0 || strcmp(key, "messages") == 0 ||
			strcmp(key, "input") == 0 || strcmp(key, "instructions") == 0 ||
			(skip && strcmp(key, skip) == 0))
			continue;
		append_json(buf, key, JsonValueToJsonb(&v));
	}
}

/*
 * OpenAI: messages pass through, tool calls in their function form.
 * starts, when not NULL, gets where each message's text begins in the
 * body, and starts[n] where the array closes.
 */
static char *
openai_body(LlmConfig *cfg, Jsonb *messages, Jsonb *tools, int *starts)
{
	StringInfoData buf;
	int			n = JsonArraySize(messages);

	initStringInfo(&buf);
	appendStringInfoString(&buf, "{\"model\": ");
	escape_json(&buf, cfg->model);
	appendStringInfoString(&buf, ", \"messages\": [");
	for (int i = 0; i < n; i++)
	{
		Jsonb	   *m = JsonArrayAt(messages, i);
		char	   *role = JsonGetString(m, "role");
		Jsonb	   *calls = JsonGetJsonb(m, "tool_calls");

		if (i > 0)
			appendStringInfoString(&buf, ", ");
		if (starts)
			starts[i] = buf.len;
		appendStringInfoString(&buf, "{\"role\": ");
		escape_json(&buf, role);
		if (strcmp(role, "assistant") == 0 && JsonArraySize(calls) > 0)
		{
			JsonbValue *c = JsonGetField(m, "content");

			if (c && c->type == jbvString)
				append_str(&buf, "content", JsonGetText(m, "content"));
			else
				appendStringInfoString(&buf, ", \"content\": null");
			appendStringInfoString(&buf, ", \"tool_calls\": [");
			for (int j = 0; j < JsonArraySize(calls); j++)
			{
				Jsonb	   *tc = JsonArrayAt(calls, j);

				appendStringInfoString(&buf, j > 0 ? ", {\"id\": " : "{\"id\": ");
				escape_json(&buf, JsonGetText(tc, "id"));
				appendStringInfoString(&buf, ", \"type\": \"function\", \"function\": {\"name\": ");
				escape_json(&buf, JsonGetText(tc, "name"));
				append_str(&buf, "arguments", JsonGetText(tc, "arguments"));
				appendStringInfoString(&buf, "}}");
			}
			appendStringInfoChar(&buf, ']');
		}
		else
			append_str(&buf, "content", JsonGetText(m, "content"));
		if (strcmp(role, "tool") == 0)
			append_str(&buf, "tool_call_id", JsonGetText(m, "tool_call_id"));
		appendStringInfoChar(&buf, '}');
	}
	if (starts)
		starts[n] = buf.len;
	appendStringInfoChar(&buf, ']');
	if (JsonArraySize(tools) > 0)
	{
		appendStringInfoString(&buf, ", \"tools\": [");
		for (int i = 0; i < JsonArraySize(tools); i++)
		{
			Jsonb	   *t = JsonArrayAt(tools, i);

			appendStringInfoString(&buf, i > 0 ? ", {\"type\": \"function\", \"function\": {\"name\": "
								   : "{\"type\": \"function\", \"function\": {\"name\": ");
			escape_json(&buf, JsonGetText(t, "name"));
			append_str(&buf, "description", JsonGetText(t, "description"));
			append_json(&buf, "parameters", JsonGetJsonb(t, "parameters"));
			appendStringInfoString(&buf, "}}");
		}
		appendStringInfoChar(&buf, ']');
	}
	append_params(&buf, cfg->params, NULL);
	appendStringInfoChar(&buf, '}');
	return buf.data;
}

/* Append one input item of the Responses API to buf. */
static void
responses_item(StringInfo buf, bool *first, const char *json)
{
	appendStringInfoString(buf, *first ? "" : ", ");
	appendStringInfoString(buf, json);
	*first = false;
}

/* An assistant message as Responses input items: text, reasoning, calls. */
static void
responses_assistant(StringInfo buf, bool *first, Jsonb *m)
{
	Jsonb	   *calls = JsonGetJsonb(m, "tool_calls");
	Jsonb	   *reasoning = JsonGetJsonb(m, "thinking");
	char	   *text = JsonGetText(m, "content");
	StringInfoData item;

	initStringInfo(&item);
	/* reasoning items go back as they came, first, as the answer gave them */
	for (int j = 0; j < JsonArraySize(reasoning); j++)
		responses_item(buf, first, JsonText(JsonArrayAt(reasoning, j)));
	if (*text)
	{
		appendStringInfoString(&item, "{\"role\": \"assistant\"");
		append_str(&item, "content", text);
		appendStringInfoChar(&item, '}');
		responses_item(buf, first, item.data);
	}
	for (int j = 0; j < JsonArraySize(calls); j++)
	{
		Jsonb	   *tc = JsonArrayAt(calls, j);

		resetStringInfo(&item);
		appendStringInfoString(&item, "{\"type\": \"function_call\"");
		append_str(&item, "call_id", JsonGetText(tc, "id"));
		append_str(&item, "name", JsonGetText(tc, "name"));
		append_str(&item, "arguments", JsonGetText(tc, "arguments"));
		appendStringInfoChar(&item, '}');
		responses_item(buf, first, item.data);
	}
}

/*
 * OpenAI Responses: system messages become instructions; tool calls and
 * their results are function_call and function_call_output items.
 */
static char *
responses_body(LlmConfig *cfg, Jsonb *messages, Jsonb *tools)
{
	StringInfoData buf;
	StringInfoData instructions;
	StringInfoData item;
	bool		first = true;

	initStringInfo(&buf);
	initStringInfo(&instructions);
	initStringInfo(&item);
	appendStringInfoString(&buf, "{\"model\": ");
	escape_json(&buf, cfg->model);
	appendStringInfoString(&buf, ", \"input\": [");
	for (int i = 0; i < JsonArraySize(messages); i++)
	{
		Jsonb	   *m = JsonArrayAt(messages, i);
		char	   *role = JsonGetString(m, "role");

		resetStringInfo(&item);
		if (strcmp(role, "system") == 0)
		{
			if (instructions.len > 0)
				appendStringInfoString(&instructions, "\n\n");
			appendStringInfoString(&instructions, JsonGetText(m, "content"));
		}
		else if (strcmp(role, "assistant") == 0)
			responses_assistant(&buf, &first, m);
		else if (strcmp(role, "tool") == 0)
		{
			appendStringInfoString(&item, "{\"type\": \"function_call_output\"");
			append_str(&item, "call_id", JsonGetText(m, "tool_call_id"));
			append_str(&item, "output", JsonGetText(m, "content"));
			appendStringInfoChar(&item, '}');
			responses_item(&buf, &first, item.data);
		}
		else
		{
			appendStringInfoString(&item, "{\"role\": \"user\"");
			append_str(&item, "content", JsonGetText(m, "content"));
			appendStringInfoChar(&item, '}');
			responses_item(&buf, &first, item.data);
		}
	}
	appendStringInfoChar(&buf, ']');
	if (instructions.len > 0)
		append_str(&buf, "instructions", instructions.data);
	if (JsonArraySize(tools) > 0)
	{
		appendStringInfoString(&buf, ", \"tools\": [");
		for (int i = 0; i < JsonArraySize(tools); i++)
		{
			Jsonb	   *t = JsonArrayAt(tools, i);

			appendStringInfoString(&buf, i > 0 ? ", {\"type\": \"function\", \"name\": "
								   : "{\"type\": \"function\", \"name\": ");
			escape_json(&buf, JsonGetText(t, "name"));
			append_str(&buf, "description", JsonGetText(t, "description"));
			append_json(&buf, "parameters", JsonGetJsonb(t, "parameters"));
			appendStringInfoChar(&buf, '}');
		}
		appendStringInfoChar(&buf, ']');
	}
	append_params(&buf, cfg->params, NULL);
	appendStringInfoChar(&buf, '}');
	return buf.data;
}

/* Append a tool message as an Anthropic tool_result block. */
static void
anthropic_tool_result(StringInfo pending, Jsonb *m)
{
	if (pending->len > 0)
		appendStringInfoString(pending, ", ");
	appendStringInfoString(pending, "{\"type\": \"tool_result\", \"tool_use_id\": ");
	escape_json(pending, JsonGetText(m, "tool_call_id"));
	append_str(pending, "content", JsonGetText(m, "content"));
	if (JsonGetBool(m, "is_error", false))
		appendStringInfoString(pending, ", \"is_error\": true");
	appendStringInfoChar(pending, '}');
}

/* Append a user message, opened by the tool results pending (then reset). */
static void
anthropic_user(StringInfo buf, Jsonb *m, StringInfo pending)
{
	appendStringInfoString(buf, "{\"role\": \"user\", \"content\": [");
	if (pending->len > 0)
	{
		appendStringInfo(buf, "%s, ", pending->data);
		resetStringInfo(pending);
	}
	appendStringInfoString(buf, "{\"type\": \"text\", \"text\": ");
	escape_json(buf, JsonGetText(m, "content"));
	appendStringInfoString(buf, "}]}");
}

/* Append an assistant message: its text, then its tool calls as tool_use. */
static void
anthropic_assistant(StringInfo buf, Jsonb *m)
{
	Jsonb	   *calls = JsonGetJsonb(m, "tool_calls");
	Jsonb	   *thinking = JsonGetJsonb(m, "thinking");
	bool		any = false;
	char	   *text = JsonGetText(m, "content");

	appendStringInfoString(buf, "{\"role\": \"assistant\", \"content\": [");

	/*
	 * extended thinking: the answer's thinking blocks go back first,
	 * untouched
	 */
	for (int j = 0; j < JsonArraySize(thinking); j++)
	{
		appendStringInfoString(buf, any ? ", " : "");
		appendStringInfoString(buf, JsonText(JsonArrayAt(thinking, j)));
		any = true;
	}
	if (*text)
	{
		appendStringInfoString(buf, "{\"type\": \"text\", \"text\": ");
		escape_json(buf, text);
		appendStringInfoChar(buf, '}');
		any = true;
	}
	for (int j = 0; j < JsonArraySize(calls); j++)
	{
		Jsonb	   *tc = JsonArrayAt(calls, j);
		char	   *args = JsonGetText(tc, "arguments");
		Jsonb	   *input = JsonParseSafe(args, strlen(args));

		appendStringInfoString(buf, any ? ", " : "");
		appendStringInfoString(buf, "{\"type\": \"tool_use\", \"id\": ");
		escape_json(buf, JsonGetText(tc, "id"));
		append_str(buf, "name", JsonGetText(tc, "name"));
		/* input must be an object; the parsed arguments were kept */
		if (input && JsonIsObject(input))
			append_json(buf, "input", input);
		else
			appendStringInfoString(buf, ", \"input\": {}");
		appendStringInfoChar(buf, '}');
		any = true;
	}
	/* Anthropic refuses empty text blocks */
	if (!any)
		appendStringInfoString(buf, "{\"type\": \"text\", \"text\": \"(no answer)\"}");
	appendStringInfoString(buf, "]}");
}

/* Append the tools, if any, in Anthropic's form. */
static void
anthropic_tools(StringInfo buf, Jsonb *tools)
{
	if (JsonArraySize(tools) == 0)
		return;
	appendStringInfoString(buf, ", \"tools\": [");
	for (int i = 0; i < JsonArraySize(tools); i++)
	{
		Jsonb	   *t = JsonArrayAt(tools, i);

		appendStringInfoString(buf, i > 0 ? ", {\"name\": " : "{\"name\": ");
		escape_json(buf, JsonGetText(t, "name"));
		append_str(buf, "description", JsonGetText(t, "description"));
		append_json(buf, "input_schema", JsonGetJsonb(t, "parameters"));
		appendStringInfoChar(buf, '}');
	}
	appendStringInfoChar(buf, ']');
}

/* Is message i + 1 of messages (n of them) one of this role? */
static bool
next_role_is(Jsonb *messages, int i, int n, const char *role)
{
	return i + 1 < n && strcmp(JsonGetString(JsonArrayAt(messages, i + 1), "role"), role) == 0;
}

/*
 * Anthropic: system messages become the top-level system prompt; tool
 * results become tool_result blocks opening the next user message.
 */
static char *
anthropic_body(LlmConfig *cfg, Jsonb *messages, Jsonb *tools)
{
	StringInfoData buf;
	StringInfoData system;
	StringInfoData pending;		/* tool_result blocks awaiting a user turn */
	int			n = JsonArraySize(messages);
	bool		first = true;
	JsonbValue *mt = JsonGetField(cfg->params, "max_tokens");

	initStringInfo(&buf);
	initStringInfo(&system);
	initStringInfo(&pending);
	appendStringInfoString(&buf, "{\"model\": ");
	escape_json(&buf, cfg->model);
	if (mt)
		append_json(&buf, "max_tokens", JsonValueToJsonb(mt));
	else
		appendStringInfo(&buf, ", \"max_tokens\": %d", DEFAULT_MAX_TOKENS);
	appendStringInfoString(&buf, ", \"messages\": [");
	for (int i = 0; i < n; i++)
	{
		Jsonb	   *m = JsonArrayAt(messages, i);
		char	   *role = JsonGetString(m, "role");

		if (strcmp(role, "system") == 0)
		{
			if (system.len > 0)
				appendStringInfoString(&system, "\n\n");
			appendStringInfoString(&system, JsonGetText(m, "content"));
			continue;
		}
		if (strcmp(role, "tool") == 0)
		{
			anthropic_tool_result(&pending, m);
			/* flush unless a user message follows to carry them */
			if (next_role_is(messages, i, n, "tool") || next_role_is(messages, i, n, "user"))
				continue;
			appendStringInfoString(&buf, first ? "" : ", ");
			appendStringInfo(&buf, "{\"role\": \"user\", \"content\": [%s]}", pending.data);
			resetStringInfo(&pending);
			first = false;
			continue;
		}
		appendStringInfoString(&buf, first ? "" : ", ");
		first = false;
		if (strcmp(role, "user") == 0)
			anthropic_user(&buf, m, &pending);
		else
			anthropic_assistant(&buf, m);
	}
	appendStringInfoChar(&buf, ']');
	if (system.len > 0)
		append_str(&buf, "system", system.data);
	anthropic_tools(&buf, tools);
	append_params(&buf, cfg->params, "max_tokens");
	appendStringInfoChar(&buf, '}');
	return buf.data;
}

static void
add_header(EffectRequest *req, const char *name, const char *value)
{
	HttpHeader *h = palloc(sizeof(HttpHeader));

	h->name = pstrdup(name);
	h->value = pstrdup(value);
	req->http.headers = lappend(req->http.headers, h);
}

/* Does the config set header name (any case)? */
static bool
has_header(LlmConfig *cfg, const char *name)
{
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (cfg->headers == NULL)
		return false;
	it = JsonbIteratorInit(&cfg->headers->root);
	while (JsonObjectNext(&it, &key, &v))
		if (pg_strcasecmp(key, name) == 0)
			return true;
	return false;
}

/* The config's headers, rendered: the secrets they name are remembered in use. */
static void
add_config_headers(EffectRequest *req, LlmConfig *cfg, SecretUse *use)
{
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (cfg->headers == NULL)
		return;
	it = JsonbIteratorInit(&cfg->headers->root);
	while (JsonObjectNext(&it, &key, &v))
		add_header(req, key, TemplateRenderText(pnstrdup(v.val.string.val, v.val.string.len),
												JsonEmptyObject(), &use->opts));
}

/* base_url + path, without a doubled slash. */
static char *
join_url(const char *base, const char *path)
{
	size_t		l = strlen(base);

	if (l > 0 && base[l - 1] == '/')
		return psprintf("%.*s%s", (int) (l - 1), base, path);
	return psprintf("%s%s", base, path);
}

/*
 * The JSON Schema of an answer {key: <one of values>, other: <other_type,
 * or anything when NULL>}, both required: the contract of an agent's
 * outcome and of a judge's verdict.
 */
Jsonb *
LlmEnumAnswerSchema(const char *key, const char *const *values, int nvalues, const char *other,
					const char *other_type)
{
	StringInfoData buf;

	initStringInfo(&buf);
	appendStringInfoString(&buf, "{\"type\": \"object\", \"properties\": {");
	escape_json(&buf, key);
	appendStringInfoString(&buf, ": {\"type\": \"string\", \"enum\": [");
	for (int i = 0; i < nvalues; i++)
	{
		if (i > 0)
			appendStringInfoString(&buf, ", ");
		escape_json(&buf, values[i]);
	}
	appendStringInfoString(&buf, "]}, ");
	escape_json(&buf, other);
	if (other_type)
		appendStringInfo(&buf, ": {\"type\": \"%s\"}}", other_type);
	else
		appendStringInfoString(&buf, ": {}}");
	appendStringInfoString(&buf, ", \"required\": [");
	escape_json(&buf, key);
	appendStringInfoString(&buf, ", ");
	escape_json(&buf, other);
	appendStringInfoString(&buf, "]}");
	return JsonFromCString(buf.data);
}

/*
 * Add the answer's schema to a request body as the provider's structured
 * output format (OpenAI response_format, Responses text.format), unless
 * params set one.
 */
static char *
with_answer_schema(LlmConfig *cfg, char *body, Jsonb *schema)
{
	bool		responses = strcmp(cfg->provider, "openai_responses") == 0;
	size_t		len = strlen(body);
	StringInfoData buf;

	if (schema == NULL || !cfg->structured_outputs || strcmp(cfg->provider, "anthropic") == 0 ||
		(cfg->params && JsonGetField(cfg->params, responses ? "text" : "response_format")))
		return body;
	initStringInfo(&buf);
	/* the body is one object: replace its closing brace */
	appendBinaryStringInfo(&buf, body, len - 1);
	if (responses)
		appendStringInfo(&buf, ", \"text\": {\"format\": {\"type\": \"json_schema\", \"name\": \"tuvl_answer\", "
						 "\"schema\": %s}}}", JsonText(schema));
	else
		appendStringInfo(&buf, ", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": "
						 "{\"name\": \"tuvl_answer\", \"schema\": %s}}}", JsonText(schema));
	return buf.data;
}

/*
 * The provider request for a conversation, as an effect tagged "llm".  The
 * key comes from tuvl.secrets into a header; the journaled request body
 * never contains it.
 */
EffectRequest *
LlmBuildRequest(RunState *run, LlmConfig *cfg, Jsonb *messages, Jsonb *tools, Jsonb *answer_schema,
				int timeout_ms)
{
	return LlmBuildRequestReusing(run, cfg, messages, tools, answer_schema, timeout_ms, NULL);
}

/* A conversation shorter than this is parsed whole: no cache to keep. */
#define LLM_WIRE_CACHE_MIN 8

/*
 * The journal form of an OpenAI body (what JsonFromCString of its scrubbed
 * text gives) without parsing the messages cache has: the body around the
 * messages, then the messages after cache->count, are parsed, and the
 * array is cache's with those appended.  Secrets are scrubbed from each
 * piece (they cannot span the boundaries, which lie between JSON values).
 * cache gets the whole array.
 */
static Jsonb *
request_reusing(const char *body, const int *starts, int n, LlmWireCache *cache, List *secrets)
{
	int			k = cache->messages && cache->count <= n ? cache->count : 0;
	int			body_len = strlen(body);
	StringInfoData text;
	Jsonb	   *shell;
	Jsonb	   *fresh;
	JsonArrayBuilder ab;
	JsonObjBuilder b;
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	initStringInfo(&text);
	appendBinaryStringInfo(&text, body, starts[0]);
	appendBinaryStringInfo(&text, body + starts[n], body_len - starts[n]);
	shell = JsonFromCString(SecretScrub(text.data, secrets));
	resetStringInfo(&text);
	appendStringInfoChar(&text, '[');
	appendBinaryStringInfo(&text, body + starts[k], starts[n] - starts[k]);
	appendStringInfoChar(&text, ']');
	fresh = JsonFromCString(SecretScrub(text.data, secrets));
	pfree(text.data);

	JsonArrayBuildStart(&ab, k > 0 ? cache->messages : NULL);
	for (int i = 0; i < JsonArraySize(fresh); i++)
		JsonArrayBuildAdd(&ab, JsonArrayAt(fresh, i));
	cache->messages = JsonArrayBuildEnd(&ab);
	cache->count = n;

	JsonObjStart(&b);
	it = JsonbIteratorInit(&shell->root);
	while (JsonObjectNext(&it, &key, &v))
	{
		if (strcmp(key, "messages") == 0)
			JsonObjAddJsonb(&b, key, cache->messages);
		else
			JsonObjAddValue(&b, key, &v);
	}
	return JsonObjEnd(&b);
}

/*
 * LlmBuildRequest, given (in cache) the journal form of this
 * conversation's first messages as its previous request sent them: an
 * OpenAI request then parses only the messages after those, and cache
 * gets its messages for the next one.  cache may be NULL.
 */
EffectRequest *
LlmBuildRequestReusing(RunState *run, LlmConfig *cfg, Jsonb *messages, Jsonb *tools,
					   Jsonb *answer_schema, int timeout_ms, LlmWireCache *cache)
{
	EffectRequest *req = palloc0(sizeof(EffectRequest));
	SecretUse	use;
	const char *key = NULL;
	bool		anthropic = strcmp(cfg->provider, "anthropic") == 0;
	bool		responses = strcmp(cfg->provider, "openai_responses") == 0;
	char	   *body;
	int		   *starts = NULL;
	int			nmsgs = JsonArraySize(messages);
	JsonObjBuilder b;

	/*
	 * The run's principal must hold a grant for the config's key, and so must
	 * the role that wrote the config: a config of another role that names
	 * your secret would send it where that role chose.
	 */
	SecretUseInit(&use, run);
	use.named_by = psprintf("LLM config \"%s\"", cfg->name);
	use.author = cfg->owner;
	if (cfg->api_key_secret)
		key = use.opts.secret_hook(cfg->api_key_secret, use.opts.secret_arg);
	if (cache && !anthropic && !responses && nmsgs >= LLM_WIRE_CACHE_MIN)
		starts = palloc(sizeof(int) * (nmsgs + 1));
	body = anthropic ? anthropic_body(cfg, messages, tools) :
		responses ? responses_body(cfg, messages, tools) : openai_body(cfg, messages, tools, starts);
	body = with_answer_schema(cfg, body, answer_schema);
	req->http.method = "POST";
	req->http.url = join_url(cfg->base_url, anthropic ? "/messages" :
							 responses ? "/responses" : "/chat/completions");
	req->http.body = body;
	req->http.body_len = strlen(body);
	req->http.timeout_ms = timeout_ms > 0 ? timeout_ms : cfg->timeout_ms;
	add_header(req, "Content-Type", "application/json");
	if (anthropic)
	{
		add_header(req, "anthropic-version", ANTHROPIC_VERSION);
		if (key && !has_header(cfg, "x-api-key"))
			add_header(req, "x-api-key", key);
	}
	else if (key && !has_header(cfg, "authorization"))
		add_header(req, "Authorization", psprintf("Bearer %s", key));
	add_config_headers(req, cfg, &use);
	HttpCheckAllowed(req->http.url);
	req->secrets = use.values;

	JsonObjStart(&b);
	JsonObjAddString(&b, "method", "POST");
	JsonObjAddString(&b, "url", HttpRedactUrl(req->http.url));
	req->journal = JsonObjEnd(&b);

	JsonObjStart(&b);
	JsonObjAddString(&b, "op", "llm");
	JsonObjAddString(&b, "provider", cfg->provider);
	JsonObjAddString(&b, "model", cfg->model);
	JsonObjAddString(&b, "config", cfg->name);
	JsonObjAddInt(&b, "config_version", cfg->version);
	/* scrubbed as text, then parsed once (SecretScrubJsonb would parse twice) */
	JsonObjAddJsonb(&b, "request", starts ? request_reusing(body, starts, nmsgs, cache, use.values)
					: JsonFromCString(SecretScrub(body, use.values)));
	if (cfg->has_price)
		JsonObjAddJsonb(&b, "price", price_jsonb(cfg));
	req->tag = JsonObjEnd(&b);
	if (cfg->has_limits && !run->replay)
	{
		AdmitSpec  *a = palloc0(sizeof(AdmitSpec));

		strlcpy(a->config, cfg->name, NAMEDATALEN);
		a->owner = cfg->owner;
		a->rpm = cfg->rpm;
		a->tpm = cfg->tpm;
		a->concurrency = cfg->concurrency;
		a->tokens = AdmissionEstimateTokens(req->http.body_len);
		a->priority = run->priority;
		a->age = run->created_at;
		a->principal = run->principal;
		a->run_id = run->id;
		a->ticket = -1;
		req->admit = a;
	}
	return req;
}

/* A config's price as journaled with each call: {input, output, cached_input}. */
static Jsonb *
price_jsonb(const LlmConfig *cfg)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	add_float(&b, "input", cfg->price_input);
	add_float(&b, "output", cfg->price_output);
	add_float(&b, "cached_input", cfg->price_cached);
	return JsonObjEnd(&b);
}

/*
 * What a call cost at cfg's price (per million tokens): the uncached
 * input, the cached input and the output.
 */
double
LlmCost(const LlmConfig *cfg, int64 prompt, int64 cached, int64 completion)
{
	int64		uncached = Max((int64) 0, prompt - cached);

	return ((double) uncached * cfg->price_input + (double) Min(cached, prompt) * cfg->price_cached +
			(double) completion * cfg->price_output) / 1000000.0;
}

/*
 * What req will cost at most, as ../CONTRACT.md says: its input tokens
 * (estimated as admission does) plus output_tokens (the previous turn's
 * output, or the config's max_tokens).
 */
double
LlmEstimateCost(const LlmConfig *cfg, EffectRequest *req, int64 output_tokens)
{
	return LlmCost(cfg, AdmissionEstimateTokens(req->http.body_len), 0, output_tokens);
}

/* The output tokens a config allows a call (params), or 0: not said. */
int64
LlmMaxOutputTokens(const LlmConfig *cfg)
{
	static const char *const keys[] = {"max_tokens", "max_completion_tokens", "max_output_tokens", NULL};

	for (int i = 0; keys[i] && cfg->params; i++)
		if (JsonGetField(cfg->params, keys[i]))
			return JsonGetInt(cfg->params, keys[i], 0);
	return strcmp(cfg->provider, "anthropic") == 0 ? DEFAULT_MAX_TOKENS : 0;
}

/* The provider's error message in a response body, if any. */
static char *
provider_message(Jsonb *body, char **type, char **code)
{
	Jsonb	   *err = JsonIsObject(body) ? JsonGetJsonb(body, "error") : NULL;

	*type = NULL;
	*code = NULL;
	if (err == NULL || !JsonIsObject(err))
		return NULL;
	*type = JsonGetString(err, "type");
	*code = JsonGetString(err, "code");
	return JsonGetString(err, "message");
}

/*
 * A tool call's id as the provider gave it; when it gave none (some
 * OpenAI-compatible servers do not), one made of the call's place and
 * content, the same whenever the answer is read again, for the tool's
 * answer to refer to.
 */
static char *
call_id(const char *given, int i, const char *name, const char *arguments)
{
	char	   *what;

	if (given && *given)
		return (char *) given;
	what = psprintf("%d\x1f%s\x1f%s", i, name ? name : "", arguments ? arguments : "");
	return psprintf("call_tuvl_%d_%08x", i,
					(uint32) hash_bytes((const unsigned char *) what, strlen(what)));
}

/*
 * Where a provider puts its token counts: keys of usage, and of the
 * objects in usage that hold the cached and the reasoning tokens (NULL:
 * usage itself; a NULL count: none).
 */
typedef struct UsageShape
{
	const char *prompt;
	const char *completion;
	const char *total;			/* NULL: prompt + completion */
	const char *cached_in;
	const char *cached;
	const char *reasoning_in;
	const char *reasoning;
} UsageShape;

static const UsageShape openai_usage = {
	"prompt_tokens", "completion_tokens", "total_tokens",
	"prompt_tokens_details", "cached_tokens", "completion_tokens_details", "reasoning_tokens"
};
static const UsageShape anthropic_usage = {
	"input_tokens", "output_tokens", NULL, NULL, "cache_read_input_tokens", NULL, NULL
};
static const UsageShape responses_usage = {
	"input_tokens", "output_tokens", "total_tokens",
	"input_tokens_details", "cached_tokens", "output_tokens_details", "reasoning_tokens"
};

/*
 * A token count of obj (the object at where): a whole number from 0 to
 * PG_INT32_MAX, or absent or null (0).  Anything else (a string, a
 * fraction, a negative or larger number) counts 0 and is noted in
 * r->malformed, the first one only: the answer is refused as a whole.
 */
static int
usage_count(Jsonb *obj, const char *where, const char *key, LlmReply *r)
{
	JsonbValue *v = key && obj ? JsonGetField(obj, key) : NULL;
	bool		bad = false;
	int32		n = 0;

	if (v == NULL || v->type == jbvNull)
		return 0;
	if (v->type != jbvNumeric)
		bad = true;
	else
	{
		Numeric		num = v->val.numeric;
		Datum		fl = DirectFunctionCall1(numeric_floor, NumericGetDatum(num));

		bad = DatumGetInt32(DirectFunctionCall2(numeric_cmp, fl, NumericGetDatum(num))) != 0;
		if (!bad)
			n = numeric_int4_opt_error(num, &bad);
		bad = bad || n < 0;
	}
	if (bad && r->malformed == NULL)
		r->malformed = psprintf("%s.%s is %s, not a token count (a whole number from 0 to %d)",
								where, key, JsonClipText(JsonText(JsonValueToJsonb(v)), 40), PG_INT32_MAX);
	return bad ? 0 : n;
}

/* The token counts of a response's usage, in the provider's shape. */
static void
parse_usage(Jsonb *body, const UsageShape *shape, LlmReply *r)
{
	JsonbValue *u = JsonGetField(body, "usage");
	Jsonb	   *usage;
	Jsonb	   *in;
	int64		sum;

	if (u == NULL || u->type == jbvNull)
		return;
	usage = JsonValueToJsonb(u);
	if (!JsonIsObject(usage))
	{
		r->malformed = psprintf("usage is %s, not an object", JsonClipText(JsonText(usage), 40));
		return;
	}
	r->prompt_tokens = usage_count(usage, "usage", shape->prompt, r);
	r->completion_tokens = usage_count(usage, "usage", shape->completion, r);
	r->total_tokens = usage_count(usage, "usage", shape->total, r);
	in = shape->cached_in ? JsonGetJsonb(usage, shape->cached_in) : usage;
	if (in && JsonIsObject(in))
		r->cached_tokens = usage_count(in, shape->cached_in ? psprintf("usage.%s", shape->cached_in) : "usage",
									   shape->cached, r);
	in = shape->reasoning_in ? JsonGetJsonb(usage, shape->reasoning_in) : usage;
	if (in && JsonIsObject(in))
		r->reasoning_tokens = usage_count(in, shape->reasoning_in ? psprintf("usage.%s", shape->reasoning_in) : "usage",
										  shape->reasoning, r);
	sum = (int64) r->prompt_tokens + r->completion_tokens;
	if (r->total_tokens == 0 && sum > PG_INT32_MAX && r->malformed == NULL)
		r->malformed = psprintf("usage.%s and usage.%s add up to " INT64_FORMAT ", more than %d tokens",
								shape->prompt, shape->completion, sum, PG_INT32_MAX);
	else if (r->total_tokens == 0)
		r->total_tokens = (int) sum;
}

static void
parse_openai(Jsonb *body, LlmReply *r)
{
	Jsonb	   *choices = JsonGetJsonb(body, "choices");
	Jsonb	   *choice;
	Jsonb	   *msg;
	Jsonb	   *calls;

	if (JsonArraySize(choices) == 0)
	{
		r->error = "the model's response has no choices";
		return;
	}
	choice = JsonArrayAt(choices, 0);
	msg = JsonGetJsonb(choice, "message");
	if (msg == NULL || !JsonIsObject(msg))
	{
		r->error = "the model's response has no message";
		return;
	}
	r->text = JsonGetString(msg, "content");
	r->finish_reason = JsonGetString(choice, "finish_reason");
	calls = JsonGetJsonb(msg, "tool_calls");
	if (JsonArraySize(calls) > 0)
	{
		StringInfoData buf;

		initStringInfo(&buf);
		appendStringInfoChar(&buf, '[');
		for (int i = 0; i < JsonArraySize(calls); i++)
		{
			Jsonb	   *c = JsonArrayAt(calls, i);
			Jsonb	   *f = JsonGetJsonb(c, "function");

			if (i > 0)
				appendStringInfoString(&buf, ", ");
			appendStringInfoString(&buf, "{\"id\": ");
			escape_json(&buf, call_id(JsonGetString(c, "id"), i, f ? JsonGetText(f, "name") : "",
									  f ? JsonGetText(f, "arguments") : ""));
			append_str(&buf, "name", f ? JsonGetText(f, "name") : "");
			append_str(&buf, "arguments", f ? JsonGetText(f, "arguments") : "");
			appendStringInfoChar(&buf, '}');
		}
		appendStringInfoChar(&buf, ']');
		r->tool_calls = JsonFromCString(buf.data);
	}
	parse_usage(body, &openai_usage, r);
	r->ok = true;
}

static void
parse_anthropic(Jsonb *body, LlmReply *r)
{
	Jsonb	   *content = JsonGetJsonb(body, "content");
	StringInfoData text;
	StringInfoData calls;
	StringInfoData thinking;
	int			ncalls = 0;

	if (content == NULL || !JB_ROOT_IS_ARRAY(content) || JB_ROOT_IS_SCALAR(content))
	{
		r->error = "the model's response has no content";
		return;
	}
	initStringInfo(&text);
	initStringInfo(&calls);
	initStringInfo(&thinking);
	appendStringInfoChar(&calls, '[');
	for (int i = 0; i < JsonArraySize(content); i++)
	{
		Jsonb	   *blk = JsonArrayAt(content, i);
		char	   *type = JsonGetString(blk, "type");

		if (type && strcmp(type, "text") == 0)
			appendStringInfoString(&text, JsonGetText(blk, "text"));
		else if (type && (strcmp(type, "thinking") == 0 || strcmp(type, "redacted_thinking") == 0))
		{
			/*
			 * sent back as they came (with their signature) before the tool
			 * calls
			 */
			appendStringInfoString(&thinking, thinking.len > 0 ? ", " : "[");
			appendStringInfoString(&thinking, JsonText(blk));
		}
		else if (type && strcmp(type, "tool_use") == 0)
		{
			Jsonb	   *input = JsonGetJsonb(blk, "input");
			char	   *args = input ? JsonbToCString(NULL, &input->root, VARSIZE(input)) : "{}";

			if (ncalls++ > 0)
				appendStringInfoString(&calls, ", ");

			appendStringInfoString(&calls, "{\"id\": ");
			escape_json(&calls, call_id(JsonGetString(blk, "id"), ncalls - 1, JsonGetText(blk, "name"), args));
			append_str(&calls, "name", JsonGetText(blk, "name"));
			append_str(&calls, "arguments", args);
			appendStringInfoChar(&calls, '}');
		}
	}
	appendStringInfoChar(&calls, ']');
	if (JsonArraySize(content) == 0)
	{
		r->finish_reason = JsonGetString(body, "stop_reason");
		r->error = "the model's response has no content (no text and no tool call)";
		return;
	}
	r->text = text.data;
	r->tool_calls = ncalls > 0 ? JsonFromCString(calls.data) : NULL;
	if (thinking.len > 0)
	{
		appendStringInfoChar(&thinking, ']');
		r->thinking = JsonFromCString(thinking.data);
	}
	r->finish_reason = JsonGetString(body, "stop_reason");
	parse_usage(body, &anthropic_usage, r);
	r->ok = true;
}

/* The text of a Responses message item: its output_text (and refusal) parts. */
static void
responses_text(Jsonb *item, StringInfo text)
{
	Jsonb	   *parts = JsonGetJsonb(item, "content");

	for (int j = 0; j < JsonArraySize(parts); j++)
	{
		Jsonb	   *part = JsonArrayAt(parts, j);
		char	   *type = JsonGetString(part, "type");

		if (type && strcmp(type, "output_text") == 0)
			appendStringInfoString(text, JsonGetText(part, "text"));
		else if (type && strcmp(type, "refusal") == 0)
			appendStringInfoString(text, JsonGetText(part, "refusal"));
	}
}

static void
parse_responses(Jsonb *body, LlmReply *r)
{
	Jsonb	   *output = JsonGetJsonb(body, "output");
	char	   *status = JsonGetString(body, "status");
	StringInfoData text;
	StringInfoData calls;
	StringInfoData reasoning;
	int			ncalls = 0;

	if (status && strcmp(status, "failed") == 0)
	{
		char	   *type;
		char	   *code;
		char	   *msg = provider_message(body, &type, &code);

		r->error = psprintf("the model's response failed: %s", msg ? msg : "no message");
		return;
	}
	if (output == NULL || !JB_ROOT_IS_ARRAY(output) || JB_ROOT_IS_SCALAR(output))
	{
		r->error = "the model's response has no output";
		return;
	}
	initStringInfo(&text);
	initStringInfo(&calls);
	initStringInfo(&reasoning);
	appendStringInfoChar(&calls, '[');
	for (int i = 0; i < JsonArraySize(output); i++)
	{
		Jsonb	   *item = JsonArrayAt(output, i);
		char	   *type = JsonGetString(item, "type");

		if (type && strcmp(type, "message") == 0)
			responses_text(item, &text);
		else if (type && strcmp(type, "function_call") == 0)
		{
			char	   *args = JsonGetText(item, "arguments");

			if (ncalls++ > 0)
				appendStringInfoString(&calls, ", ");
			appendStringInfoString(&calls, "{\"id\": ");
			escape_json(&calls, call_id(JsonGetString(item, "call_id"), ncalls - 1, JsonGetText(item, "name"), args));
			append_str(&calls, "name", JsonGetText(item, "name"));
			append_str(&calls, "arguments", args);
			appendStringInfoChar(&calls, '}');
		}
		else if (type && strcmp(type, "reasoning") == 0)
		{
			appendStringInfoString(&reasoning, reasoning.len > 0 ? ", " : "[");
			appendStringInfoString(&reasoning, JsonText(item));
		}
	}
	appendStringInfoChar(&calls, ']');
	if (text.len == 0 && ncalls == 0 && !(status && strcmp(status, "incomplete") == 0))
	{
		r->error = "the model's response has no output (no text and no tool call)";
		return;
	}
	r->text = text.data;
	r->tool_calls = ncalls > 0 ? JsonFromCString(calls.data) : NULL;
	if (reasoning.len > 0)
	{
		appendStringInfoChar(&reasoning, ']');
		r->thinking = JsonFromCString(reasoning.data);
	}
	if (ncalls > 0)
		r->finish_reason = "tool_calls";
	else if (status && strcmp(status, "incomplete") == 0)
	{
		Jsonb	   *why = JsonGetJsonb(body, "incomplete_details");
		char	   *reason = why && JsonIsObject(why) ? JsonGetString(why, "reason") : NULL;

		r->finish_reason = reason && strcmp(reason, "max_output_tokens") == 0 ? "length" :
			reason ? reason : "incomplete";
	}
	else
		r->finish_reason = "stop";
	parse_usage(body, &responses_usage, r);
	r->ok = true;
}

/*
 * Interpret the journaled result of an LLM call.
 */
void
LlmParseResult(LlmConfig *cfg, Jsonb *result, LlmReply *r)
{
	int			status = JsonGetInt32(result, "status", 0);
	char	   *kind = JsonGetString(result, "error_kind");
	Jsonb	   *body = JsonGetJsonb(result, "body");
	char	   *type;
	char	   *code;
	char	   *msg;

	memset(r, 0, sizeof(LlmReply));
	r->retry_after_ms = -1;
	if (status == 0)
	{
		char	   *err = JsonGetString(result, "error");

		r->error = psprintf("could not reach the model: %s", err ? err : "no response");
		r->error_class = kind && strcmp(kind, "timeout") == 0 ? "timeout" : "error";
		/* an oversized or refused response will not get better */
		r->retryable = !(kind && (strcmp(kind, "too_large") == 0 ||
								  strcmp(kind, "not_allowed") == 0));
		return;
	}
	msg = provider_message(body, &type, &code);
	if (status < 200 || status >= 300)
	{
		bool		no_money = (code && strcmp(code, "insufficient_quota") == 0) ||
		(type && (strcmp(type, "insufficient_quota") == 0 || strcmp(type, "billing_error") == 0)) ||
		(msg && (strstr(msg, "credit balance") || strstr(msg, "spend limit")));

		r->error = psprintf("the model answered HTTP %d%s%s", status,
							msg ? ": " : "", msg ? msg : "");
		r->error_class = "error";
		r->retryable = !no_money &&
			(status == 408 || status == 429 || status == 529 || status >= 500);
		/* retry-after-ms, else decimal seconds (no HTTP dates), at most 60 s */
		r->retry_after_ms = RetryAfterMs(result, MAX_RETRY_AFTER_MS, RETRY_AFTER_MS_HEADER);
		return;
	}
	if (JsonGetField(result, "body_error") || body == NULL || !JsonIsObject(body))
	{
		r->error = "the model's response is not a JSON object (malformed or truncated)";
		r->error_class = "error";
		return;
	}
	if (strcmp(cfg->provider, "anthropic") == 0)
		parse_anthropic(body, r);
	else if (strcmp(cfg->provider, "openai_responses") == 0)
		parse_responses(body, r);
	else
		parse_openai(body, r);

	/*
	 * a count that is not one: the answer is not used, the step's error route
	 * is taken
	 */
	if (r->ok && r->malformed)
	{
		r->ok = false;
		r->error = psprintf("the model's response is malformed: %s", r->malformed);
		r->error_class = "error";
		r->error_type = "bad_response";
	}
}

/* A price of a journaled price object (0: absent). */
static double
price_of(Jsonb *price, const char *key)
{
	JsonbValue *v = JsonGetField(price, key);

	if (v == NULL || v->type != jbvNumeric)
		return 0;
	return DatumGetFloat8(DirectFunctionCall1(numeric_float8, NumericGetDatum(v->val.numeric)));
}

/*
 * The llm_turn payload of a journaled LLM result, and its total tokens;
 * with the call's cost when its config has a price.
 */
Jsonb *
LlmTurnPayload(Jsonb *result, int *tokens)
{
	return LlmTurnPayloadAs(result, tokens, -1, "request", JsonGetJsonb(result, "request"));
}

/*
 * LlmTurnPayload with its "position" (when position >= 0) and the request
 * given under request_key ("request", or "request_delta"), all in one
 * build: a turn's payload is not copied again for each key it gets.
 */
Jsonb *
LlmTurnPayloadAs(Jsonb *result, int *tokens, int position, const char *request_key,
				 Jsonb *request)
{
	LlmConfig	cfg;
	LlmReply	r;
	JsonObjBuilder b;
	JsonObjBuilder t;

	memset(&cfg, 0, sizeof(cfg));
	cfg.provider = JsonGetString(result, "provider");
	if (cfg.provider == NULL)
		cfg.provider = "openai";
	LlmParseResult(&cfg, result, &r);
	*tokens = r.total_tokens;

	JsonObjStart(&b);
	JsonObjAddString(&b, "provider", cfg.provider);
	JsonObjAddString(&b, "model", JsonGetString(result, "model"));
	if (JsonGetField(result, "config"))
	{
		JsonObjAddString(&b, "config", JsonGetString(result, "config"));
		JsonObjAddJsonb(&b, "config_version", JsonGetJsonb(result, "config_version"));
	}
	JsonObjAddJsonb(&b, "status", JsonGetJsonb(result, "status"));
	JsonObjAddString(&b, "finish_reason", r.finish_reason);
	JsonObjStart(&t);
	JsonObjAddInt(&t, "prompt", r.prompt_tokens);
	JsonObjAddInt(&t, "completion", r.completion_tokens);
	JsonObjAddInt(&t, "total", r.total_tokens);
	if (r.cached_tokens > 0)
		JsonObjAddInt(&t, "cached", r.cached_tokens);
	if (r.reasoning_tokens > 0)
		JsonObjAddInt(&t, "reasoning", r.reasoning_tokens);
	JsonObjAddJsonb(&b, "tokens", JsonObjEnd(&t));
	if (JsonGetField(result, "price"))
	{
		Jsonb	   *price = JsonGetJsonb(result, "price");
		LlmConfig	p;

		memset(&p, 0, sizeof(p));
		p.price_input = price_of(price, "input");
		p.price_output = price_of(price, "output");
		p.price_cached = price_of(price, "cached_input");
		add_float(&b, "cost", LlmCost(&p, r.prompt_tokens, r.cached_tokens, r.completion_tokens));
		JsonObjAddJsonb(&b, "price", price);
	}
	JsonObjAddJsonb(&b, "latency_ms", JsonGetJsonb(result, "latency_ms"));
	if (!r.ok)
		JsonObjAddString(&b, "error", r.error);
	/* what a replay needs to rebuild the answer exactly */
	if (JsonGetField(result, "error_kind"))
	{
		JsonObjAddJsonb(&b, "error_kind", JsonGetJsonb(result, "error_kind"));
		JsonObjAddJsonb(&b, "transport_error", JsonGetJsonb(result, "error"));
	}
	if (JsonGetField(result, "body_error"))
		JsonObjAddJsonb(&b, "body_error", JsonGetJsonb(result, "body_error"));
	{
		Jsonb	   *h = JsonGetJsonb(result, "headers");
		JsonObjBuilder hb;

		if (h && (JsonGetField(h, "retry-after") || JsonGetField(h, "retry-after-ms")))
		{
			JsonObjStart(&hb);
			if (JsonGetField(h, "retry-after"))
				JsonObjAddJsonb(&hb, "retry-after", JsonGetJsonb(h, "retry-after"));
			if (JsonGetField(h, "retry-after-ms"))
				JsonObjAddJsonb(&hb, "retry-after-ms", JsonGetJsonb(h, "retry-after-ms"));
			JsonObjAddJsonb(&b, "headers", JsonObjEnd(&hb));
		}
	}
	/* a judge's call (judge.c) is known by its id */
	if (JsonGetField(result, "judge"))
		JsonObjAddJsonb(&b, "judge", JsonGetJsonb(result, "judge"));
	if (position >= 0)
		JsonObjAddInt(&b, "position", position);
	JsonObjAddJsonb(&b, request_key, request);
	JsonObjAddJsonb(&b, "response", JsonGetJsonb(result, "body"));
	return JsonObjEnd(&b);
}

/*
 * The result as kept in step_state: without the request body (the
 * journal's llm_turn has it), and, for an answer, without its headers,
 * which only an error's retry reads (LlmParseResult); a provider's run to
 * a kilobyte, and step_state is written again at every turn.
 */
Jsonb *
LlmStripRequest(Jsonb *result)
{
	int			status = JsonGetInt32(result, "status", 0);

	result = JsonRemoveKey(result, "request");
	if (status >= 200 && status < 300 && JsonGetField(result, "headers"))
		result = JsonRemoveKey(result, "headers");
	return result;
}
