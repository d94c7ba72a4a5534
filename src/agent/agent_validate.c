/*-------------------------------------------------------------------------
 *
 * agent_validate.c
 *	  The Agent step's static checks: its mode, the agent mapping (model,
 *	  texts, artifacts, outcome, retry, guardrails), and for an autonomous
 *	  agent its tools, limits and reserved exits.  Called by validate.c
 *	  through the step table; every finding goes through its helpers
 *	  (validate.h), and nothing here raises.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "utils/builtins.h"
#include "utils/jsonb.h"

#include "agent.h"
#include "artifact.h"
#include "duration.h"
#include "executor.h"
#include "jsonutil.h"
#include "llm.h"
#include "uses.h"
#include "validate.h"

/* Keys of agent: removed in 0.1.0, each reported with what replaces it. */
static const char *const agent_keys_removed[] = {"output", "steering_files", NULL};

/*
 * approval: a boolean; approval_timeout: a duration, on an entry with
 * approval: true.
 */
static void
check_approval(ValidateState *vs, Jsonb *entry, const char *epath)
{
	JsonbValue *v = JsonGetField(entry, "approval");
	int			ms;

	if (v && v->type != jbvBool)
		ValidateFinding(vs, "error", psprintf("%s.approval", epath),
						"approval must be true (ask a person before each call) or false");
	v = JsonGetField(entry, "approval_timeout");
	if (v == NULL)
		return;
	if (!DurationFromJson(v, &ms) || ms <= 0)
		ValidateFinding(vs, "error", psprintf("%s.approval_timeout", epath),
						"approval_timeout must be a duration such as 30m: how long a call waits for tuvl.decide() before it is rejected");
	else if (!JsonGetBool(entry, "approval", false))
		ValidateFinding(vs, "error", psprintf("%s.approval_timeout", epath),
						"approval_timeout needs approval: true");
}

/*
 * A tool entry naming a whole MCP server: {mcp: url, allow: [...],
 * prefix, headers, approval}.  Its tools are those tuvl.mcp_list_tools()
 * listed for the URL, so the URL is written literally.
 */
static void
check_mcp_server_tools(ValidateState *vs, Jsonb *entry, const char *epath)
{
	static const char *const server_keys[] = {"mcp", "allow", "prefix", "headers", "approval",
	"approval_timeout", NULL};
	JsonbValue *v = JsonGetField(entry, "mcp");
	char	   *url;

	ValidateUnknownKeys(vs, entry, epath, server_keys, NULL);
	url = v && v->type == jbvString ? pnstrdup(v->val.string.val, v->val.string.len) : NULL;
	if (url == NULL || (strncmp(url, "http://", 7) != 0 && strncmp(url, "https://", 8) != 0) ||
		strstr(url, "{{") != NULL)
		ValidateFinding(vs, "error", psprintf("%s.mcp", epath),
						"mcp must be the server's URL, written literally, such as \"http://127.0.0.1:3001/mcp\": "
						"the agent is offered the tools tuvl.mcp_list_tools() listed for it");
	v = JsonGetField(entry, "allow");
	if (v)
	{
		bool		ok = ValidateIsList(v) && JsonContainerSize(v->val.binary.data) > 0;

		for (int i = 0; ok && i < (int) JsonContainerSize(v->val.binary.data); i++)
		{
			JsonbValue *n = getIthJsonbValueFromContainer(v->val.binary.data, i);

			ok = n->type == jbvString && n->val.string.len > 0;
		}
		if (!ok)
			ValidateFinding(vs, "error", psprintf("%s.allow", epath),
							"allow must be a non-empty list of the server's tool names, such as [echo, get-sum]");
	}
	v = JsonGetField(entry, "prefix");
	if (v)
	{
		bool		ok = v->type == jbvString && v->val.string.len <= 32;

		for (int i = 0; ok && i < v->val.string.len; i++)
			ok = isalnum((unsigned char) v->val.string.val[i]) || v->val.string.val[i] == '_' ||
				v->val.string.val[i] == '-';
		if (!ok)
			ValidateFinding(vs, "error", psprintf("%s.prefix", epath),
							"prefix must be at most 32 letters, digits, _ and -, such as \"docs_\": "
							"it is put before each tool's name");
	}
	ValidateScalarMapping(vs, entry, "headers", epath,
						  "{ Authorization: \"Bearer {{ secrets.mcp_token }}\" }");
	check_approval(vs, entry, epath);
}

/* agent.tools of an autonomous agent. */
static void
check_agent_tools(ValidateState *vs, Jsonb *agent, const char *apath, const char *self)
{
	static const char *const tool_keys[] = {"ref", "description", "parameters", "writes_context",
	"approval", "approval_timeout", NULL};
	JsonbValue *tv = JsonGetField(agent, "tools");
	char	   *tpath = psprintf("%s.tools", apath);
	int			n;

	if (tv == NULL || (ValidateIsList(tv) && JsonContainerSize(tv->val.binary.data) == 0))
	{
		ValidateFinding(vs, "error", apath,
						"an autonomous agent needs agent.tools: the steps it may call, as [{ref: step_id}]");
		return;
	}
	n = ValidateListLength(vs, tv, tpath, "tools must be a list such as [{ref: lookup_order}]");
	for (int i = 0; i < n; i++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(tv->val.binary.data, i);
		char	   *epath = psprintf("%s[%d]", tpath, i);
		Jsonb	   *entry;
		Jsonb	   *target;
		char	   *ref;
		char	   *kind;
		JsonbValue *v;

		if (!ValidateIsMapping(e))
		{
			ValidateFinding(vs, "error", epath, "a tool must be a mapping such as {ref: lookup_order}");
			continue;
		}
		entry = JsonValueToJsonb(e);
		if (JsonGetField(entry, "mcp") && JsonGetField(entry, "ref") == NULL)
		{
			check_mcp_server_tools(vs, entry, epath);
			continue;
		}
		ValidateUnknownKeys(vs, entry, epath, tool_keys, NULL);
		ValidateText(vs, entry, "description", epath);
		ref = JsonGetString(entry, "ref");
		if (ref == NULL)
		{
			ValidateFinding(vs, "error", epath,
							"the tool is missing ref, the id of the step it calls (or mcp, the URL of a server whose tools it may call)");
			continue;
		}
		if (strcmp(ref, self) == 0)
		{
			ValidateFinding(vs, "error", psprintf("%s.ref", epath), "an agent cannot call itself as a tool");
			continue;
		}
		target = ValidateFindStep(vs, ref);
		if (target == NULL)
		{
			ValidateFinding(vs, "error", psprintf("%s.ref", epath),
							"tool \"%s\" is not a step of this workflow", ref);
			continue;
		}
		kind = JsonGetString(target, "kind");
		if (kind && (strcmp(kind, "Agent") == 0 || strcmp(kind, "Human") == 0))
			ValidateFinding(vs, "error", psprintf("%s.ref", epath),
							"step \"%s\" is a%s %s step, which cannot be called as a tool; "
							"tools are Functional, ModelOp, Router, APICall or MCP steps",
							ref, strcmp(kind, "Agent") == 0 ? "n" : "", kind);
		if (JsonGetField(target, "compensate"))
			ValidateFinding(vs, "warning", psprintf("%s.ref", epath),
							"step \"%s\" declares compensate, but a tool call is never compensated; undo its work in another tool the agent can call",
							ref);
		if (JsonGetString(target, "description") == NULL && JsonGetString(entry, "description") == NULL)
			ValidateFinding(vs, "error", epath,
							"tool \"%s\" has no description; give step \"%s\" a description, or the tool entry one, so the model knows what it does",
							ref, ref);
		v = JsonGetField(entry, "parameters");
		if (v && !ValidateIsMapping(v))
			ValidateFinding(vs, "error", psprintf("%s.parameters", epath),
							"parameters must be a JSON Schema object such as {type: object, properties: {...}}");
		v = JsonGetField(entry, "writes_context");
		if (v && v->type != jbvBool)
			ValidateFinding(vs, "error", psprintf("%s.writes_context", epath),
							"writes_context must be true or false");
		check_approval(vs, entry, epath);
	}
}

/* context_injection: a list of public context keys. */
static void
check_context_injection(ValidateState *vs, Jsonb *step, const char *path)
{
	JsonbValue *v = JsonGetField(step, "context_injection");
	char	   *cpath = psprintf("%s.context_injection", path);
	int			n;

	if (v == NULL)
		return;
	n = ValidateListLength(vs, v, cpath, "context_injection must be a list of context keys");
	for (int i = 0; i < n; i++)
	{
		JsonbValue *k = getIthJsonbValueFromContainer(v->val.binary.data, i);

		if (k->type != jbvString || k->val.string.len == 0)
			ValidateFinding(vs, "error", psprintf("%s[%d]", cpath, i), "a context key must be a non-empty string");
		else if (k->val.string.val[0] == '_')
			ValidateFinding(vs, "error", psprintf("%s[%d]", cpath, i),
							"\"%s\" is a private key; private keys are never shown to a model",
							pnstrdup(k->val.string.val, k->val.string.len));
	}
}

/* Keys of the agent mapping: removed ones are errors, unknown ones warnings. */
static void
check_agent_keys(ValidateState *vs, Jsonb *agent, const char *apath)
{
	static const char *const agent_keys[] = {"model", "system", "prompt", "steering", "skills",
		"tools", "outcome", "max_iterations", "max_tool_calls", "token_budget", "guardrails", "retry",
	"max_cost", NULL};
	static const struct
	{
		const char *key;
		const char *instead;
	}			removed[] = {
		{"output", "agent.outcome.write"},
		{"steering_files", "agent.steering (inline text or an artifact:// reference)"},
	};
	Jsonb	   *oc = JsonGetJsonb(agent, "outcome");

	for (int i = 0; i < (int) lengthof(removed); i++)
		if (JsonGetField(agent, removed[i].key))
			ValidateFinding(vs, "error", psprintf("%s.%s", apath, removed[i].key),
							"agent.%s was removed; use %s", removed[i].key, removed[i].instead);
	if (oc && JsonIsObject(oc) && JsonGetField(oc, "output_key"))
		ValidateFinding(vs, "error", psprintf("%s.outcome.output_key", apath),
						"outcome.output_key was removed; use outcome.write");
	if (oc && JsonIsObject(oc) && JsonGetField(oc, "signal_from"))
		ValidateFinding(vs, "error", psprintf("%s.outcome.signal_from", apath),
						"outcome.signal_from was removed; the outcome is the \"outcome\" field of the final answer, one of outcome.enum");
	ValidateUnknownKeysExcept(vs, agent, apath, agent_keys, agent_keys_removed);
}

/*
 * The fields of an autonomous agent: no completion-mode texts, steering,
 * tools, limits, and routes for its reserved exits.
 */
static void
check_autonomous_agent(ValidateState *vs, Jsonb *step, Jsonb *agent, const char *path,
					   const char *apath, Jsonb *routes)
{
	static const char *const exits[] = {"max_iterations", "budget_exceeded", "aborted", NULL};

	if (JsonGetField(agent, "system"))
		ValidateFinding(vs, "error", psprintf("%s.system", apath),
						"system is a completion-mode field; an autonomous agent takes its instructions from agent.steering");
	if (JsonGetField(agent, "prompt"))
		ValidateFinding(vs, "error", psprintf("%s.prompt", apath),
						"prompt is a completion-mode field; an autonomous agent reads the public context instead");
	if (JsonGetField(agent, "steering") == NULL)
		ValidateFinding(vs, "warning", apath,
						"agent.steering is missing; without it the model knows only the context and the tools");
	check_agent_tools(vs, agent, apath, JsonGetString(step, "id") ? JsonGetString(step, "id") : "");
	ValidatePositiveInt(vs, agent, "max_iterations", apath);
	ValidatePositiveInt(vs, agent, "max_tool_calls", apath);
	ValidatePositiveInt(vs, agent, "token_budget", apath);
	ValidatePositiveNumber(vs, agent, "max_cost", apath);
	for (int i = 0; exits[i]; i++)
		if ((strcmp(exits[i], "budget_exceeded") != 0 || JsonGetField(agent, "token_budget") ||
			 JsonGetField(agent, "max_cost")) &&
			(routes == NULL || JsonGetField(routes, exits[i]) == NULL))
			ValidateFinding(vs, "warning", psprintf("%s.routes", path),
							strcmp(exits[i], "aborted") == 0
							? "the reserved exit \"%s\" has no route: an abort stops the run without a routed exit"
							: "the reserved exit \"%s\" has no route: the run fails if the agent takes it",
							exits[i]);
}

/* An agent text field (steering, system, prompt), when present, is a string. */
static void
check_agent_text(ValidateState *vs, Jsonb *agent, const char *key, const char *apath)
{
	JsonbValue *tv = JsonGetField(agent, key);

	if (tv && tv->type != jbvString)
		ValidateFinding(vs, "error", psprintf("%s.%s", apath, key),
						"%s must be text or an artifact:// reference", key);
}

/* The agent's artifact references: steering, system, prompt and skills. */
static void
check_agent_artifacts(ValidateState *vs, Jsonb *agent, const char *apath)
{
	JsonbValue *sk = JsonGetField(agent, "skills");

	check_agent_text(vs, agent, "steering", apath);
	(void) ValidateArtifactRef(vs, JsonGetField(agent, "steering"), psprintf("%s.steering", apath),
							   SITE_STEERING);
	(void) ValidateArtifactRef(vs, JsonGetField(agent, "system"), psprintf("%s.system", apath),
							   SITE_STEERING);
	(void) ValidateArtifactRef(vs, JsonGetField(agent, "prompt"), psprintf("%s.prompt", apath),
							   SITE_PROMPT);
	if (sk && !ValidateIsList(sk))
		ValidateFinding(vs, "error", psprintf("%s.skills", apath),
						"skills must be a list of texts or artifact:// references to skill artifacts");
	else if (sk)
		for (int i = 0; i < (int) JsonContainerSize(sk->val.binary.data); i++)
		{
			JsonbValue *e = getIthJsonbValueFromContainer(sk->val.binary.data, i);

			if (e->type != jbvString)
				ValidateFinding(vs, "error", psprintf("%s.skills[%d]", apath, i),
								"a skill must be text or an artifact:// reference");
			else
				(void) ValidateArtifactRef(vs, e, psprintf("%s.skills[%d]", apath, i), SITE_SKILL);
		}
}

/* agent.model names a string; one not registered yet is a warning. */
static void
check_agent_model(ValidateState *vs, Jsonb *agent, const char *apath)
{
	JsonbValue *model = JsonGetField(agent, "model");

	if (model == NULL)
		ValidateFinding(vs, "error", apath, "agent.model is missing; name a model given to tuvl.register_llm()");
	else if (model->type != jbvString)
		ValidateFinding(vs, "error", psprintf("%s.model", apath),
						"model must name a model given to tuvl.register_llm()");
	else
		ValidateUse(vs, USE_LLM, JsonGetString(agent, "model"), 0, psprintf("%s.model", apath));
}

/* outcome.enum: names that are not reserved exits, each with a route. */
static void
check_outcome_enum(ValidateState *vs, JsonbValue *e, const char *apath, Jsonb *routes)
{
	static const char *const reserved[] = {"max_iterations", "budget_exceeded", "error", "aborted",
	"guardrail_violation", "default", NULL};
	int			n = ValidateListLength(vs, e, psprintf("%s.outcome.enum", apath),
									   "outcome.enum must be a list of outcome names");

	for (int i = 0; i < n; i++)
	{
		JsonbValue *x = getIthJsonbValueFromContainer(e->val.binary.data, i);
		char	   *epath = psprintf("%s.outcome.enum[%d]", apath, i);
		char	   *name;

		if (x->type != jbvString)
		{
			ValidateFinding(vs, "error", epath, "outcome names must be strings");
			continue;
		}
		name = pnstrdup(x->val.string.val, x->val.string.len);
		if (ValidateStringIn(x, reserved))
			ValidateFinding(vs, "error", epath,
							"\"%s\" is a reserved exit and cannot be an outcome; choose another name", name);
		else if (routes == NULL || JsonGetField(routes, name) == NULL)
			ValidateFinding(vs, "error", epath,
							"outcome \"%s\" has no route; add routes: { %s: <step or end> }", name, name);
	}
}

/* agent.outcome: a mapping of enum and write. */
static void
check_agent_outcome(ValidateState *vs, Jsonb *agent, const char *apath, Jsonb *routes)
{
	static const char *const outcome_keys[] = {"enum", "write", "output_key", "signal_from", NULL};
	JsonbValue *o = JsonGetField(agent, "outcome");
	Jsonb	   *outcome;
	JsonbValue *e;
	JsonbValue *w;

	if (o == NULL)
		return;
	if (!ValidateIsMapping(o))
	{
		ValidateFinding(vs, "error", psprintf("%s.outcome", apath),
						"outcome must be a mapping such as { enum: [approve, reject], write: decision }");
		return;
	}
	outcome = JsonValueToJsonb(o);
	e = JsonGetField(outcome, "enum");
	w = JsonGetField(outcome, "write");
	ValidateUnknownKeys(vs, outcome, psprintf("%s.outcome", apath), outcome_keys, NULL);
	if (w && (w->type != jbvString || w->val.string.len == 0))
		ValidateFinding(vs, "error", psprintf("%s.outcome.write", apath),
						"outcome.write must name the context key the answer is written to");
	if (e)
		check_outcome_enum(vs, e, apath, routes);
}

/* The agent mapping of an Agent step, and the step fields it governs. */
static void
check_agent_block(ValidateState *vs, Jsonb *step, const char *path)
{
	static const char *const agent_on[] = {"timeout", "error", NULL};
	JsonbValue *a = JsonGetField(step, "agent");
	char	   *apath = psprintf("%s.agent", path);
	Jsonb	   *agent;
	char	   *mode = JsonGetString(step, "mode");
	bool		autonomous = mode && strcmp(mode, "autonomous") == 0;
	Jsonb	   *routes = JsonGetJsonb(step, "routes");

	if (!ValidateIsMapping(a))
		return;
	agent = JsonValueToJsonb(a);
	check_agent_keys(vs, agent, apath);
	if (autonomous)
		check_autonomous_agent(vs, step, agent, path, apath, routes);
	else
	{
		/* a key tuvl accepts does something: these do only in autonomous mode */
		static const char *const limits[] = {"max_iterations", "token_budget", "max_cost", NULL};

		if (JsonGetField(agent, "tools"))
			ValidateFinding(vs, "error", psprintf("%s.tools", apath),
							"tools are used only by mode: autonomous; remove them from a completion agent");
		for (int i = 0; limits[i]; i++)
			if (JsonGetField(agent, limits[i]))
				ValidateFinding(vs, "error", psprintf("%s.%s", apath, limits[i]),
								"%s bounds the turns of mode: autonomous; a completion agent makes one model call: remove it",
								limits[i]);
	}
	check_context_injection(vs, step, path);
	check_agent_artifacts(vs, agent, apath);
	ValidateGuardrails(vs, JsonGetField(agent, "guardrails"), psprintf("%s.guardrails", apath), autonomous);
	ValidateGuardrails(vs, JsonGetField(step, "guardrails"), psprintf("%s.guardrails", path), autonomous);
	if ((JsonGetField(agent, "guardrails") || JsonGetField(step, "guardrails")) &&
		(routes == NULL || JsonGetField(routes, "guardrail_violation") == NULL))
		ValidateFinding(vs, "warning", psprintf("%s.routes", path),
						"guardrails are attached but \"guardrail_violation\" has no route: the run fails if a check fails");
	if (JsonGetField(step, "output"))
		ValidateFinding(vs, "error", psprintf("%s.output", path),
						"an Agent step writes its answer to agent.outcome.write (default <step id>_result), not to output; move the key there");
	check_agent_model(vs, agent, apath);
	check_agent_text(vs, agent, "system", apath);
	check_agent_text(vs, agent, "prompt", apath);
	if (!autonomous && mode && strcmp(mode, "completion") == 0 && JsonGetField(agent, "prompt") == NULL)
		ValidateFinding(vs, "error", apath, "a completion agent needs agent.prompt, the user message template");
	ValidateRetry(vs, agent, apath, agent_on, "[timeout, error]");
	check_agent_outcome(vs, agent, apath, routes);
}

/* mode: completion or autonomous, and the agent mapping. */
void
StepValidateAgent(ValidateState *vs, Jsonb *step, const char *path)
{
	static const char *const agent_modes[] = {"completion", "autonomous", NULL};
	JsonbValue *mode = JsonGetField(step, "mode");

	if (mode == NULL)
		ValidateFinding(vs, "error", path,
						"an Agent step needs mode: completion or mode: autonomous");
	else if (!ValidateStringIn(mode, agent_modes))
		ValidateFinding(vs, "error", psprintf("%s.mode", path),
						"mode must be completion or autonomous");
	if (!ValidateIsMapping(JsonGetField(step, "agent")))
		ValidateFinding(vs, "error", path,
						"an Agent step needs an agent mapping with at least a model");
	else
		check_agent_block(vs, step, path);
}
