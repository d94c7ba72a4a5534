/*-------------------------------------------------------------------------
 *
 * fuzz.c
 *	  libFuzzer harness: tuvl's readers of outside input, run inside a
 *	  single-user PostgreSQL backend.
 *
 * test/fuzz/Makefile links this file, every C file of src/ and libFuzzer's
 * runtime into a fuzzing build of tuvl.so (coverage and AddressSanitizer
 * instrumentation).  run.sh installs it in a private copy of PostgreSQL,
 * creates the extension and the SQL function tuvl_fuzz(text[]) in a
 * database, and calls that function from "postgres --single".  The first
 * argument names a target, the others are libFuzzer's flags and corpus
 * directories; LLVMFuzzerRunDriver then feeds each input to the target in
 * this backend, inside the statement's transaction, with the catalogs and
 * tuvl's tables at hand (the route OSS-Fuzz takes for PostgreSQL, where
 * the backend is initialised in-process instead).
 *
 * Each target runs its input in stages (see run_stage): every stage in a
 * subtransaction, so an ERROR is caught, flushed and rolled back like in
 * a PL/pgSQL exception block, and the next input finds the backend as the
 * previous one found it.  An ERROR is a normal outcome.  A crash, a
 * sanitizer report, a failed assertion (tuvl is built with
 * USE_ASSERT_CHECKING) or a hang is a finding, which libFuzzer reports and
 * saves.  So is a WARNING while an input runs (a leaked resource at
 * subtransaction end, for instance): the harness aborts on it.  Two kinds
 * of ERROR are notes rather than crashes: one from a stage whose function
 * promises never to raise (JsonParseSafe, McpParseMessage,
 * ValidateWorkflow), and an internal error (elog(ERROR), SQLSTATE XX000),
 * which tuvl keeps for what cannot happen.  A note is printed and its
 * input saved once per stage and SQLSTATE; with TUVL_FUZZ_STRICT set in
 * the environment a note aborts too, for a stack trace.
 *
 * Memory: an input's allocations go into a context reset after every
 * input.  It is made with 1 kB blocks, so every allocation over 128 bytes
 * is a malloc block of its own and AddressSanitizer sees overruns of it.
 *
 * test/fuzz/fuzz.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/elog.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/resowner.h"

#include "agent.h"
#include "effect.h"
#include "executor.h"
#include "http.h"
#include "jsonschema.h"
#include "jsonutil.h"
#include "llm.h"
#include "mcp.h"
#include "retry.h"
#include "template.h"
#include "validate.h"
#include "workflow.h"
#include "yamlparse.h"

#include "sanitizer_hooks.h"

/* libFuzzer's entry point for a driver of its own (LLVM 12 and later) */
typedef int (*FuzzCallback) (const uint8_t *data, size_t size);
extern int	LLVMFuzzerRunDriver(int *argc, char ***argv, FuzzCallback callback);

/* asan_preload.c's, when it is preloaded */
typedef void (*SetHooksFn) (void *const *fns, int n);

/* A target: one entry point of tuvl fed from an input. */
typedef struct FuzzTarget
{
	const char *name;
	void		(*run) (const char *data, size_t size);
} FuzzTarget;

/* A stage of a target: a function and its argument. */
typedef void (*StageFn) (void *arg);

/* The distinct notes seen (stage and SQLSTATE), printed once each. */
#define MAX_NOTES 64

static const FuzzTarget *target;
static MemoryContext input_cxt;
static bool in_input;
static const uint8_t *input_data;
static size_t input_size;
static char *notes[MAX_NOTES];
static int	nnotes;
static uint64 ninputs;
static Size mem_baseline;
static emit_log_hook_type prev_emit_log_hook;

/* Growth of the backend's memory over this many bytes is a leak. */
#define LEAK_LIMIT ((Size) 256 * 1024 * 1024)

/* The id every MCP request of the mcp target asks about. */
#define MCP_ID "1"

PG_FUNCTION_INFO_V1(tuvl_fuzz);

/*
 * A WARNING while an input runs is a finding: tuvl raises none on these
 * paths, and PostgreSQL raises them for leaked resources.
 */
static void
fuzz_emit_log(ErrorData *edata)
{
	if (prev_emit_log_hook)
		prev_emit_log_hook(edata);
	if (in_input && edata->elevel == WARNING)
	{
		fprintf(stderr, "tuvl fuzz: WARNING while running an input: %s\n", edata->message);
		abort();
	}
}

/* Save the current input as path; best effort. */
static void
save_input(const char *path)
{
	FILE	   *f = fopen(path, "wb");

	if (f == NULL)
		return;
	if (input_size > 0)
		(void) fwrite(input_data, 1, input_size, f);
	fclose(f);
}

/*
 * Note an ERROR that is a finding but not a crash: print it and save the
 * input, once per stage and SQLSTATE.  TUVL_FUZZ_STRICT makes it a crash.
 */
static void
note_error(const char *stage, const char *why, ErrorData *edata)
{
	const char *state = unpack_sql_state(edata->sqlerrcode);
	char		key[256];
	const char *dir = getenv("TUVL_FUZZ_ARTIFACTS");
	char		path[MAXPGPATH];

	snprintf(key, sizeof(key), "%s-%s-%s", target->name, stage, state);
	for (int i = 0; i < nnotes; i++)
		if (strcmp(notes[i], key) == 0)
			return;
	if (nnotes < MAX_NOTES)
		notes[nnotes++] = strdup(key);
	snprintf(path, sizeof(path), "%s/note-%s", dir ? dir : ".", key);
	for (char *c = path + strlen(path) - strlen(key); *c; c++)
		if (!isalnum((unsigned char) *c) && *c != '-' && *c != '_')
			*c = '_';
	save_input(path);
	fprintf(stderr, "NOTE: %s: %s raised ERROR %s: %s%s%s (input saved as %s)\n",
			target->name, stage, state, edata->message,
			edata->detail ? ": " : "", edata->detail ? edata->detail : "", path);
	if (getenv("TUVL_FUZZ_STRICT"))
	{
		fprintf(stderr, "tuvl fuzz: %s\n", why);
		abort();
	}
}

/*
 * Run one stage of a target in a subtransaction.  Returns false when it
 * raised an ERROR (caught, noted when it is one the contract excludes,
 * flushed and rolled back).  must_not_raise says the function promises
 * never to raise for any input.  Memory allocated by the stage stays in
 * the input's context.
 */
static bool
run_stage(const char *stage, bool must_not_raise, StageFn fn, void *arg)
{
	MemoryContext cxt = CurrentMemoryContext;
	ResourceOwner owner = CurrentResourceOwner;
	bool		ok = true;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(cxt);
	PG_TRY();
	{
		fn(arg);
		ReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(cxt);
		CurrentResourceOwner = owner;
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(cxt);
		CurrentResourceOwner = owner;
		if (edata->sqlerrcode == ERRCODE_INTERNAL_ERROR)
			note_error(stage, "an internal error (elog) on outside input", edata);
		else if (must_not_raise)
			note_error(stage, "a function that never raises raised", edata);
		ok = false;
	}
	PG_END_TRY();
	return ok;
}

/*
 * Input helpers.  All results are palloc'd in the input's context.
 */

/* The input as a NUL-terminated string (cut at its first NUL byte). */
static char *
input_text(const char *data, size_t size)
{
	return pnstrdup(data, size);
}

/*
 * A two-part input: the parts are joined by a NUL byte; without one the
 * second part is empty.
 */
static void
input_split(const char *data, size_t size, char **first, char **second)
{
	const char *nul = memchr(data, '\0', size);

	*first = pnstrdup(data, nul ? (size_t) (nul - data) : size);
	*second = nul ? pnstrdup(nul + 1, size - (nul - data) - 1) : pstrdup("");
}

/* JSON text as jsonb, or as a JSON string when it is not valid JSON. */
static Jsonb *
json_or_string(const char *text)
{
	Jsonb	   *j = JsonParseSafe(text, strlen(text));

	return j ? j : JsonStringValue(text);
}

/* The transport failures HttpTakeResult reports. */
static const char *const error_kinds[] = {
	"timeout", "too_large", "not_allowed", "redirects", "error"
};

/* Headers, one "name: value" line each, as parse_headers (http.c) reads. */
static List *
response_headers(const char *block)
{
	List	   *headers = NIL;
	const char *p = block;

	while (*p)
	{
		const char *eol = strchr(p, '\n');
		size_t		len = eol ? (size_t) (eol - p) : strlen(p);
		const char *colon = memchr(p, ':', len);

		if (len > 0 && p[len - 1] == '\r')
			len--;
		if (colon && colon < p + len)
		{
			HttpHeader *h = palloc(sizeof(HttpHeader));
			const char *v = colon + 1;

			h->name = pnstrdup(p, colon - p);
			for (char *c = h->name; *c; c++)
				*c = pg_tolower((unsigned char) *c);
			while (v < p + len && (*v == ' ' || *v == '\t'))
				v++;
			h->value = pnstrdup(v, p + len - v);
			headers = lappend(headers, h);
		}
		if (eol == NULL)
			break;
		p = eol + 1;
	}
	return headers;
}

/*
 * An HttpResult from an input written as a response:
 *
 *		200
 *		content-type: application/json
 *
 *		{"choices": []}
 *
 * The first line is the status; 0 (or no number) is a transport failure,
 * the rest of the line its kind (timeout, too_large, ...).  Header lines
 * follow up to an empty line, the rest is the body, NUL bytes and all.
 * Built as HttpTakeResult builds one: names lower-cased, the body copied
 * with pnstrdup (to its first NUL) while body_len counts every byte.
 */
static HttpResult *
input_response(const char *data, size_t size)
{
	HttpResult *res = palloc0(sizeof(HttpResult));
	const char *end = data + size;
	const char *nl = memchr(data, '\n', size);
	const char *head = nl ? nl + 1 : end;
	const char *body = end;
	char	   *status = pnstrdup(data, nl ? (size_t) (nl - data) : size);
	char	   *rest;

	/* the header block ends at the first empty line */
	for (const char *p = head; p < end; p++)
	{
		if (p == head || p[-1] == '\n')
		{
			if (*p == '\n' || (*p == '\r' && p + 1 < end && p[1] == '\n'))
			{
				body = p + (*p == '\r' ? 2 : 1);
				break;
			}
		}
	}
	res->headers = response_headers(pnstrdup(head, body > head ? body - head : 0));
	res->body = pnstrdup(body, end - body);
	res->body_len = end - body;
	res->status = (int) strtol(status, &rest, 10);
	if (res->status < 0 || res->status > 999)
		res->status = 0;
	if (res->status == 0)
	{
		while (*rest == ' ')
			rest++;
		res->error_kind = "error";
		for (int i = 0; i < (int) lengthof(error_kinds); i++)
			if (strncmp(rest, error_kinds[i], strlen(error_kinds[i])) == 0)
				res->error_kind = error_kinds[i];
		res->error = pstrdup(*rest ? rest : "could not connect to server");
	}
	res->latency_ms = 12.5;
	res->final_url = "http://127.0.0.1:8080/fuzz";
	return res;
}

/* Secrets a request might have used: scrubbed from every result. */
static List *
fuzz_secrets(void)
{
	return list_make3(pstrdup("sk-fuzz-secret"), pstrdup("p@ss w/rd&\"x\""),
					  pstrdup("\xc3\xa9t\xc3\xa9"));
}

/*
 * yaml: YamlToJsonb on the input as a workflow source, with positions.
 */
typedef struct YamlState
{
	const char *source;
	Jsonb	   *def;
	Jsonb	   *positions;
	List	   *findings;
	Jsonb	   *refs;			/* the owners pinned, as register_workflow
								 * asks for them */
} YamlState;

static void
stage_yaml(void *arg)
{
	YamlState  *s = arg;

	s->def = YamlToJsonb(s->source, "workflow", &s->positions);
	(void) YamlPositionText(s->positions, "name");
	(void) YamlPositionText(s->positions, "steps[0]");
	(void) JsonText(s->def);
}

static void
target_yaml(const char *data, size_t size)
{
	YamlState	s = {0};

	s.source = input_text(data, size);
	(void) run_stage("YamlToJsonb", false, stage_yaml, &s);
}

/*
 * validate: what tuvl.validate(source) does (parse, ValidateWorkflow),
 * then, for a workflow without errors, what a run of it does first
 * (WorkflowCompile).  ValidateWorkflow reports findings and never raises.
 */
static void
stage_validate(void *arg)
{
	YamlState  *s = arg;

	s->findings = ValidateWorkflow(s->def, s->positions, false, &s->refs);
	(void) FindingsFormat(s->findings, "error");
	(void) FindingsFormat(s->findings, "warning");
	if (s->refs)
		(void) JsonText(s->refs);
}

static void
stage_compile(void *arg)
{
	YamlState  *s = arg;
	char	   *name = JsonGetString(s->def, "name");
	WorkflowDef *wf = WorkflowCompile(name ? name : "fuzz", 1, s->def);

	for (int i = 0; i < wf->nsteps; i++)
		(void) WorkflowFindStep(wf, wf->steps[i].id ? wf->steps[i].id : "");
	for (int i = 0; i < wf->nends; i++)
		(void) WorkflowFindEnd(wf, wf->ends[i].id ? wf->ends[i].id : "");
}

static void
target_validate(const char *data, size_t size)
{
	YamlState	s = {0};

	s.source = input_text(data, size);
	if (!run_stage("YamlToJsonb", false, stage_yaml, &s))
		return;
	if (run_stage("ValidateWorkflow", true, stage_validate, &s) &&
		!FindingsHaveErrors(s.findings))
		(void) run_stage("WorkflowCompile", false, stage_compile, &s);
}

/*
 * template: a template and a JSON context, joined by a NUL byte.  The
 * template is rendered as text and, parsed as JSON when it is JSON (else
 * as a JSON string), as a document; its placeholders are listed and it
 * is looked up as a path.  The secret hook knows one secret, "key".
 */
typedef struct TemplateState
{
	char	   *tmpl;
	Jsonb	   *doc;
	Jsonb	   *context;
	TemplateOptions opts;
} TemplateState;

static const char *
fuzz_secret(const char *name, void *arg)
{
	return strcmp(name, "key") == 0 ? pstrdup("sk-fuzz-secret") : NULL;
}

static void
stage_render_text(void *arg)
{
	TemplateState *s = arg;

	(void) TemplateHasPlaceholders(s->tmpl);
	(void) TemplateRenderText(s->tmpl, s->context, &s->opts);
}

static void
stage_render_jsonb(void *arg)
{
	TemplateState *s = arg;

	(void) JsonText(TemplateRenderJsonb(s->doc, s->context, &s->opts));
}

static void
stage_placeholders(void *arg)
{
	TemplateState *s = arg;

	(void) TemplatePlaceholders(s->doc);
}

static void
stage_lookup(void *arg)
{
	TemplateState *s = arg;
	JsonbValue *v = TemplateLookupPath(s->context, s->tmpl);

	if (v)
		(void) JsonValueToText(v);
}

static void
target_template(const char *data, size_t size)
{
	TemplateState s = {0};
	char	   *ctx;

	input_split(data, size, &s.tmpl, &ctx);
	s.doc = json_or_string(s.tmpl);
	s.context = JsonParseSafe(ctx, strlen(ctx));
	if (s.context == NULL)
		s.context = JsonEmptyObject();
	s.opts.secret_hook = fuzz_secret;
	(void) run_stage("TemplateRenderText", false, stage_render_text, &s);
	(void) run_stage("TemplateRenderJsonb", false, stage_render_jsonb, &s);
	(void) run_stage("TemplatePlaceholders", false, stage_placeholders, &s);
	(void) run_stage("TemplateLookupPath", false, stage_lookup, &s);
}

/*
 * schema: a JSON Schema and an instance, joined by a NUL byte.  The schema
 * is checked (JsonSchemaCheck); an object schema also validates the
 * instance whatever the check found, as an MCP server's input schema
 * does (agent.c validates model arguments against it unchecked).
 */
typedef struct SchemaState
{
	Jsonb	   *schema;
	Jsonb	   *instance;
} SchemaState;

static void
stage_schema_check(void *arg)
{
	SchemaState *s = arg;
	ListCell   *lc;

	foreach(lc, JsonSchemaCheck(s->schema, NULL))
	{
		JsonSchemaError *e = lfirst(lc);

		(void) psprintf("%s %s %s", e->path, e->rule, e->message);
	}
}

static void
stage_schema_validate(void *arg)
{
	SchemaState *s = arg;
	JsonSchemaError *e = JsonSchemaValidate(s->schema, s->instance);

	if (e)
		(void) psprintf("%s %s %s", e->path, e->rule, e->message);
}

static void
target_schema(const char *data, size_t size)
{
	SchemaState s;
	char	   *schema;
	char	   *instance;

	input_split(data, size, &schema, &instance);
	s.schema = JsonParseSafe(schema, strlen(schema));
	if (s.schema == NULL)
		return;
	s.instance = json_or_string(instance);
	(void) run_stage("JsonSchemaCheck", false, stage_schema_check, &s);
	if (JsonIsObject(s.schema))
		(void) run_stage("JsonSchemaValidate", false, stage_schema_validate, &s);
}

/*
 * apicall: an APICall step's response (see input_response) in its journal
 * form (EffectResultToJsonb, scrubbing secrets), and its Retry-After read
 * both ways (APICall's and the model calls').
 */
typedef struct ResponseState
{
	HttpResult *res;
	Jsonb	   *result;
	LlmReply	reply;
} ResponseState;

static void
stage_effect_result(void *arg)
{
	ResponseState *s = arg;

	s->result = EffectResultToJsonb(s->res, fuzz_secrets());
	(void) JsonText(s->result);
}

static void
stage_retry_after(void *arg)
{
	ResponseState *s = arg;

	(void) RetryAfterMs(s->result, 60000, RETRY_AFTER_HTTP_DATE);
	(void) RetryAfterMs(s->result, 60000, RETRY_AFTER_MS_HEADER);
}

static void
target_apicall(const char *data, size_t size)
{
	ResponseState s = {0};

	s.res = input_response(data, size);
	if (run_stage("EffectResultToJsonb", false, stage_effect_result, &s))
		(void) run_stage("RetryAfterMs", false, stage_retry_after, &s);
}

/*
 * llm: a model's response (see input_response), in its journal form, read
 * by each of the three wire formats (LlmParseResult), then as the runtime
 * and the agent use it: the llm_turn payload, each tool call's arguments,
 * and the outcome contract on the answer's text.
 */
static const char *const providers[] = {"openai", "anthropic", "openai_responses"};

static void
stage_journal_result(void *arg)
{
	ResponseState *s = arg;

	s->result = EffectResultToJsonb(s->res, NIL);
}

/* What the agent does with a reply: tool arguments, outcome, failure. */
static void
use_reply(LlmReply *r)
{
	StepResult	sr;

	for (int i = 0; i < JsonArraySize(r->tool_calls); i++)
	{
		Jsonb	   *tc = JsonArrayAt(r->tool_calls, i);
		char	   *args = JsonGetString(tc, "arguments");

		(void) JsonGetString(tc, "id");
		(void) JsonGetString(tc, "name");
		if (args)
			(void) JsonParseSafe(args, strlen(args));
	}
	if (r->thinking)
		(void) JsonText(r->thinking);
	memset(&sr, 0, sizeof(sr));
	(void) AgentApplyOutcome(r->text, list_make2(pstrdup("approve"), pstrdup("reject")), &sr);
	(void) AgentFailureType(r);
	if (!r->ok)
	{
		int			delay;

		(void) AgentShouldRetry(JsonFromCString("{\"retry\": {\"attempts\": 3}}"), r, 1, &delay);
	}
	(void) psprintf("%s %s %s %d %d", r->text ? r->text : "",
					r->finish_reason ? r->finish_reason : "",
					r->error ? r->error : "", r->total_tokens, r->retry_after_ms);
}

static void
stage_llm_parse(void *arg)
{
	ResponseState *s = arg;

	for (int i = 0; i < (int) lengthof(providers); i++)
	{
		LlmConfig	cfg;

		memset(&cfg, 0, sizeof(cfg));
		cfg.name = "fuzz";
		cfg.provider = (char *) providers[i];
		cfg.model = "fuzz-model";
		LlmParseResult(&cfg, s->result, &s->reply);
		use_reply(&s->reply);
	}
}

static void
stage_llm_payload(void *arg)
{
	ResponseState *s = arg;
	int			tokens;

	for (int i = 0; i < (int) lengthof(providers); i++)
	{
		Jsonb	   *r = JsonSetKey(s->result, "provider", JsonStringValue(providers[i]));

		(void) JsonText(LlmTurnPayload(r, &tokens));
		(void) LlmStripRequest(r);
	}
}

static void
target_llm(const char *data, size_t size)
{
	ResponseState s = {0};

	s.res = input_response(data, size);
	if (!run_stage("EffectResultToJsonb", false, stage_journal_result, &s))
		return;
	(void) run_stage("LlmParseResult", false, stage_llm_parse, &s);
	(void) run_stage("LlmTurnPayload", false, stage_llm_payload, &s);
}

/*
 * mcp: an MCP server's response (see input_response) to request "1", in
 * JSON or as an event stream, read by McpParseMessage twice: from the
 * body as received and from the journal form, as the MCP step reads it.
 * The tools a tools/list result holds then have their input schemas used
 * as the agent uses them: unchecked, to validate arguments.
 */
typedef struct McpState
{
	HttpResult *res;
	Jsonb	   *result;
	Jsonb	   *msg;
} McpState;

static void
stage_mcp_raw(void *arg)
{
	McpState   *s = arg;
	char	   *error;

	s->msg = McpParseMessage(s->res->body, HttpResultHeader(s->res, "content-type"),
							 MCP_ID, &error);
	if (s->msg == NULL && error)
		(void) pstrdup(error);
}

static void
stage_mcp_journal(void *arg)
{
	McpState   *s = arg;
	Jsonb	   *headers;
	char	   *error;
	Jsonb	   *msg;

	s->result = EffectResultToJsonb(s->res, NIL);
	headers = JsonGetJsonb(s->result, "headers");
	msg = McpParseMessage(JsonGetText(s->result, "body"), JsonGetString(headers, "content-type"),
						  MCP_ID, &error);
	if (msg == NULL && error)
		(void) pstrdup(error);
}

static void
stage_mcp_tools(void *arg)
{
	McpState   *s = arg;
	Jsonb	   *result = JsonGetJsonb(s->msg, "result");
	Jsonb	   *tools = result && JsonIsObject(result) ? JsonGetJsonb(result, "tools") : NULL;

	for (int i = 0; i < JsonArraySize(tools); i++)
	{
		Jsonb	   *tool = JsonArrayAt(tools, i);
		Jsonb	   *schema = JsonIsObject(tool) ? JsonGetJsonb(tool, "inputSchema") : NULL;

		(void) JsonGetString(tool, "name");
		(void) JsonGetString(tool, "description");
		if (schema && JsonIsObject(schema))
			(void) JsonSchemaValidate(schema, JsonEmptyObject());
	}
}

static void
target_mcp(const char *data, size_t size)
{
	McpState	s = {0};

	s.res = input_response(data, size);
	if (run_stage("McpParseMessage", true, stage_mcp_raw, &s) && s.msg)
		(void) run_stage("MCP tools", false, stage_mcp_tools, &s);
	(void) run_stage("McpParseMessage (journal)", true, stage_mcp_journal, &s);
}

/*
 * json: JsonParseSafe on the input's bytes (NULs included), as it reads
 * a model's tool arguments or answer; then the answer's text helpers.
 */
typedef struct JsonState
{
	const char *data;
	size_t		size;
} JsonState;

static void
stage_json_parse(void *arg)
{
	JsonState  *s = arg;
	Jsonb	   *j = JsonParseSafe(s->data, s->size);

	if (j)
		(void) JsonText(j);
}

static void
stage_json_text(void *arg)
{
	JsonState  *s = arg;
	char	   *clean = TextStripFences(s->data);

	(void) JsonParseSafe(clean, strlen(clean));
	(void) JsonClipText(s->data, 200);
	(void) JsonClipText(s->data, 7);
}

static void
target_json(const char *data, size_t size)
{
	JsonState	s;
	char	   *copy = palloc(size + 1);

	/* the bytes as they are, with the NUL a C string ends with */
	memcpy(copy, data, size);
	copy[size] = '\0';
	s.data = copy;
	s.size = size;
	(void) run_stage("JsonParseSafe", true, stage_json_parse, &s);
	(void) run_stage("TextStripFences", true, stage_json_text, &s);
}

/*
 * selftest: shows that the harness sees what it must (run.sh smoke runs it
 * on each word, never fuzzes it).  "overflow" writes past a palloc'd
 * chunk, "assert" fails an assertion, "warning" raises a WARNING,
 * "internal" an internal error (a note); any other input does nothing.
 */
static void
stage_selftest(void *arg)
{
	const char *t = arg;

	if (strcmp(t, "overflow") == 0)
	{
		volatile char *p = palloc(200);

		p[200] = 'x';
	}
	else if (strcmp(t, "assert") == 0)
		Assert(strcmp(t, "assert") != 0);
	else if (strcmp(t, "warning") == 0)
		elog(WARNING, "the harness's self-test");
	else if (strcmp(t, "internal") == 0)
		elog(ERROR, "the harness's self-test");
}

static void
target_selftest(const char *data, size_t size)
{
	(void) run_stage("selftest", false, stage_selftest, input_text(data, size));
}

/*
 * Hand libFuzzer's comparison hooks to asan_preload.c, which the sanitizer's
 * interceptors call (it says why); nothing to do without it.
 */
static void
register_cmp_hooks(void)
{
	SetHooksFn set = (SetHooksFn) dlsym(RTLD_DEFAULT, "tuvl_fuzz_set_hooks");
	void	   *const fns[] = {
		(void *) __sanitizer_weak_hook_memcmp,
		(void *) __sanitizer_weak_hook_strncmp,
		(void *) __sanitizer_weak_hook_strncasecmp,
		(void *) __sanitizer_weak_hook_strcmp,
		(void *) __sanitizer_weak_hook_strcasecmp,
		(void *) __sanitizer_weak_hook_strstr,
		(void *) __sanitizer_weak_hook_strcasestr,
		(void *) __sanitizer_weak_hook_memmem,
	};

	if (set)
		set(fns, lengthof(fns));
}

static const FuzzTarget targets[] = {
	{"yaml", target_yaml},
	{"validate", target_validate},
	{"template", target_template},
	{"schema", target_schema},
	{"apicall", target_apicall},
	{"llm", target_llm},
	{"mcp", target_mcp},
	{"json", target_json},
	{"selftest", target_selftest},
};

/*
 * libFuzzer's callback: one input, in the input context, reset after it.
 * The stages catch their ERRORs; one raised while a target prepares its
 * input (JsonParseSafe, which never raises) is a finding.  Every so many
 * inputs the backend's memory is compared with what it was after the
 * first ones: growth beyond LEAK_LIMIT is a leak.
 */
static int
fuzz_one(const uint8_t *data, size_t size)
{
	MemoryContext old = MemoryContextSwitchTo(input_cxt);

	input_data = data;
	input_size = size;
	in_input = true;
	PG_TRY();
	{
		target->run((const char *) data, size);
	}
	PG_CATCH();
	{
		/* a target reads its input with functions that never raise */
		ErrorData  *edata = CopyErrorData();

		fprintf(stderr, "tuvl fuzz: an ERROR while reading the input: %s\n", edata->message);
		abort();
	}
	PG_END_TRY();
	in_input = false;
	MemoryContextSwitchTo(old);
	MemoryContextReset(input_cxt);

	if (++ninputs % 1024 == 0)
	{
		Size		now = MemoryContextMemAllocated(TopMemoryContext, true);

		if (mem_baseline == 0)
			mem_baseline = now;
		else if (now > mem_baseline + LEAK_LIMIT)
		{
			fprintf(stderr, "tuvl fuzz: the backend's memory grew from %zu to %zu bytes\n",
					mem_baseline, now);
			MemoryContextStats(TopMemoryContext);
			abort();
		}
	}
	return 0;
}

/*
 * tuvl_fuzz(args text[]): args[1] names the target, the rest go to
 * libFuzzer.  Does not return when libFuzzer ends the process (it always
 * does after fuzzing or running inputs); returns libFuzzer's status else.
 */
Datum
tuvl_fuzz(PG_FUNCTION_ARGS)
{
	ArrayType  *arr = PG_GETARG_ARRAYTYPE_P(0);
	Datum	   *elems;
	bool	   *nulls;
	int			n;
	int			argc;
	char	  **argv;

	deconstruct_array(arr, TEXTOID, -1, false, TYPALIGN_INT, &elems, &nulls, &n);
	if (n < 1 || nulls[0])
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("the first argument must name a fuzz target")));
	for (int i = 0; i < (int) lengthof(targets); i++)
		if (strcmp(targets[i].name, TextDatumGetCString(elems[0])) == 0)
			target = &targets[i];
	if (target == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("unknown fuzz target \"%s\"", TextDatumGetCString(elems[0])),
				 errhint("The targets are yaml, validate, template, schema, apicall, llm, mcp and json.")));

	/* libFuzzer keeps argv: malloc'd, never freed */
	argv = malloc(sizeof(char *) * (n + 1));
	argv[0] = strdup(psprintf("tuvl-fuzz-%s", target->name));
	argc = 1;
	for (int i = 1; i < n; i++)
		if (!nulls[i])
			argv[argc++] = strdup(TextDatumGetCString(elems[i]));
	argv[argc] = NULL;

	input_cxt = AllocSetContextCreate(TopMemoryContext, "tuvl fuzz input", 0, 1024, 1024);
	prev_emit_log_hook = emit_log_hook;
	emit_log_hook = fuzz_emit_log;
	register_cmp_hooks();
	PG_RETURN_INT32(LLVMFuzzerRunDriver(&argc, &argv, fuzz_one));
}
