/*-------------------------------------------------------------------------
 *
 * step_agent.c
 *	  The Agent step.  This file holds the completion mode: one model call
 *	  (retried on transport failures), its answer written to the context.
 *
 * The system and prompt templates are rendered against the public
 * context only: keys starting with "_" never reach a model, and a
 * template that names one fails.  With outcome.enum the model must answer
 * {"outcome": <one of the enum>, "result": <payload>} (code fences are
 * stripped); the outcome becomes the step's signal and an answer outside
 * the enum takes the error route, never an invented signal.  The call is
 * an effect journaled as llm_turn (effect.c, llm.c).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>
#include <math.h>

#include "common/pg_prng.h"
#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/json.h"
#include "utils/jsonb.h"

#include "agent.h"
#include "artifact.h"
#include "effect.h"
#include "executor.h"
#include "jsonutil.h"
#include "llm.h"
#include "retry.h"
#include "template.h"
#include "workflow.h"

/* agent.retry: on [timeout, error] unless "on" says otherwise (retry.c). */
#define AGENT_DEFAULT_ATTEMPTS 3

/* The enum values of agent.outcome, or NIL. */
List *
AgentOutcomeEnum(Jsonb *agent)
{
	Jsonb	   *outcome = JsonGetJsonb(agent, "outcome");
	JsonbValue *e = outcome && JsonIsObject(outcome) ? JsonGetField(outcome, "enum") : NULL;
	List	   *values = NIL;

	if (e == NULL || e->type != jbvBinary)
		return NIL;
	for (int i = 0; i < (int) JsonContainerSize(e->val.binary.data); i++)
	{
		JsonbValue *v = getIthJsonbValueFromContainer(e->val.binary.data, i);

		values = lappend(values, JsonValueToText(v));
	}
	return values;
}

/* The strict final-answer format, for a declared enum. */
char *
AgentFinalFormat(List *values)
{
	StringInfoData buf;
	ListCell   *lc;

	initStringInfo(&buf);
	appendStringInfoString(&buf, "Answer with a single JSON object and nothing else: "
						   "{\"outcome\": <one of ");
	foreach(lc, values)
	{
		if (lc != list_head(values))
			appendStringInfoString(&buf, ", ");
		appendStringInfo(&buf, "\"%s\"", (char *) lfirst(lc));
	}
	appendStringInfoString(&buf, ">, \"result\": <your answer>}. Do not wrap it in markdown code fences.");
	return buf.data;
}

/* Text without surrounding whitespace and ``` fences. */
char *
AgentStripFences(const char *text)
{
	const char *s = text;
	const char *e;
	char	   *out;

	while (*s && isspace((unsigned char) *s))
		s++;
	e = s + strlen(s);
	while (e > s && isspace((unsigned char) e[-1]))
		e--;
	if (e - s >= 6 && strncmp(s, "```", 3) == 0 && strncmp(e - 3, "```", 3) == 0)
	{
		const char *nl = memchr(s, '\n', e - s);

		s = nl ? nl + 1 : s + 3;
		e -= 3;
		while (e > s && isspace((unsigned char) e[-1]))
			e--;
	}
	out = pnstrdup(s, e - s);
	return out;
}

/*
 * Apply the outcome contract to a final answer: set the signal and what
 * to write.  Raises (error route) for an answer outside the contract.
 */
static void
AgentFinalize(const StepDef *step, const char *text, List *values, StepResult *result)
{
	char	   *clean;
	Jsonb	   *obj;
	JsonbValue *o;
	char	   *outcome;
	ListCell   *lc;
	bool		known = false;

	result->has_output = true;
	if (values == NIL)
	{
		result->output = JsonStringValue(text ? text : "");
		return;
	}
	clean = AgentStripFences(text ? text : "");
	obj = JsonParseSafe(clean, strlen(clean));
	StepErrorType = "invalid_outcome";
	if (obj == NULL || !JsonIsObject(obj))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("the model's final answer is not a JSON object with an \"outcome\""),
				 errdetail("The answer was: %s", JsonClipText(clean, 200))));
	o = JsonGetField(obj, "outcome");
	if (o == NULL || o->type != jbvString)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("the model's final answer has no \"outcome\" string"),
				 errdetail("The answer was: %s", JsonClipText(clean, 200))));
	outcome = pnstrdup(o->val.string.val, o->val.string.len);
	foreach(lc, values)
		known |= strcmp(lfirst(lc), outcome) == 0;
	if (!known)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("the model answered outcome \"%s\", which is not in outcome.enum", outcome),
				 errhint("Step \"%s\" accepts only the declared outcomes.", step->id)));
	result->signal = outcome;
	result->output = JsonGetField(obj, "result") ? JsonGetJsonb(obj, "result") : obj;
}

/*
 * After a failed call: should it be retried (per agent.retry), and after
 * how long?
 */
bool
AgentShouldRetry(Jsonb *agent, LlmReply *reply, int attempts_made, int *delay_ms)
{
	RetryPolicy r;

	/* agent.retry, default {on: [timeout, error], attempts: 3, backoff: 1s} */
	RetryParse(JsonGetJsonb(agent, "retry"), AGENT_DEFAULT_ATTEMPTS, &r);

	/*
	 * No status: llm.c has classified the failure (a model's 429 and 5xx
	 * are "error"), so only on_timeout and on_error count.
	 */
	if (reply->retryable && RetryAllowed(&r, attempts_made, 0, reply->error_class))
	{
		*delay_ms = RetryDelayMs(&r, attempts_made, reply->retry_after_ms);
		return true;
	}
	return false;
}

/* _last_error_type of a failed call. */
const char *
AgentFailureType(LlmReply *reply)
{
	return strcmp(reply->error_class ? reply->error_class : "error", "timeout") == 0
		? "timeout" : "llm_error";
}

/*
 * After a failed call: retry (returns true with the request's delay set)
 * or give up (raises).
 */
static bool
AgentRetryOrFail(Jsonb *agent, LlmReply *reply, int attempts_made, EffectRequest *next)
{
	if (AgentShouldRetry(agent, reply, attempts_made, &next->delay_ms))
		return true;
	StepErrorType = AgentFailureType(reply);
	ereport(ERROR,
			(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
			 errmsg("%s", reply->error),
			 attempts_made > 1 ? errdetail("Gave up after %d attempts.", attempts_made) : 0));
	return false;
}

static void
execute_completion(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	Jsonb	   *agent = JsonGetJsonb(step->spec, "agent");
	Jsonb	   *public = JsonPublicContext(ctx);
	char	   *model = JsonGetString(agent, "model");
	char	   *system = JsonGetString(agent, "system");
	char	   *prompt = JsonGetString(agent, "prompt");
	List	   *values = AgentOutcomeEnum(agent);
	LlmConfig  *cfg;
	StringInfoData msgs;
	EffectRequest *req;
	int			n = EffectCount(run);

	StepErrorType = "llm_error";
	cfg = LlmConfigLoad(model ? model : "default");

	StepErrorType = "error";
	if (system)
		system = ArtifactResolveText(run, system, SITE_STEERING, psprintf("agent.system of step \"%s\"", step->id));
	if (prompt)
		prompt = ArtifactResolveText(run, prompt, SITE_PROMPT, psprintf("agent.prompt of step \"%s\"", step->id));
	StepErrorType = "template_error";
	initStringInfo(&msgs);
	appendStringInfoChar(&msgs, '[');
	if (system || values)
	{
		StringInfoData sys;

		initStringInfo(&sys);
		if (system)
			appendStringInfoString(&sys, TemplateRenderText(system, public, NULL));
		if (values)
		{
			if (sys.len > 0)
				appendStringInfoString(&sys, "\n\n");
			appendStringInfoString(&sys, AgentFinalFormat(values));
		}
		appendStringInfoString(&msgs, "{\"role\": \"system\", \"content\": ");
		escape_json(&msgs, sys.data);
		appendStringInfoString(&msgs, "}, ");
	}
	appendStringInfoString(&msgs, "{\"role\": \"user\", \"content\": ");
	escape_json(&msgs, prompt ? TemplateRenderText(prompt, public, NULL) : "Begin.");
	appendStringInfoString(&msgs, "}]");

	StepErrorType = "llm_error";
	req = LlmBuildRequest(run, cfg, JsonFromCString(msgs.data), NULL, -1);
	if (n > 0)
	{
		LlmReply	reply;

		LlmParseResult(cfg, EffectAt(run, n - 1), &reply);
		if (reply.ok)
		{
			AgentFinalize(step, reply.text, values, result);
			return;
		}
		(void) AgentRetryOrFail(agent, &reply, n, req);
	}
	result->pending = true;
	result->effect = req;
}

/*
 * The Agent step: mode completion here; autonomous in agent.c.
 */
void
StepExecuteAgent(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	char	   *mode = JsonGetString(step->spec, "mode");

	if (mode && strcmp(mode, "completion") == 0)
		execute_completion(run, step, ctx, result);
	else if (mode && strcmp(mode, "autonomous") == 0)
		StepExecuteAutonomous(run, step, ctx, result);
	else
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("Agent step \"%s\" has mode \"%s\"", step->id, mode ? mode : ""),
				 errhint("Use mode: completion or mode: autonomous.")));
}
