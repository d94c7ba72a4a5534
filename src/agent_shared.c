/*-------------------------------------------------------------------------
 *
 * agent_shared.c
 *	  What the two modes of the Agent step share: the outcome contract and
 *	  when a failed model call is retried.
 *
 * The completion mode (step_agent.c) and the autonomous loop (agent.c)
 * end the same way: the model's final answer goes through
 * AgentApplyOutcome, and a transport failure is retried per agent.retry
 * (retry.c) or gives up with the same _last_error_type.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"

#include "agent.h"
#include "executor.h"
#include "jsonutil.h"
#include "retry.h"

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
 * Apply the outcome contract to a final answer, in either mode: without
 * outcome.enum the step's signal is default, with it the answer must be
 * {"outcome": <one of the enum>, "result": <payload>} (code fences are
 * stripped).  The payload written is the answer's "result", else the
 * whole parsed answer, else its text.  Returns NULL, or why the answer is
 * outside the contract: the step then takes its error exit, never an
 * invented signal.
 */
char *
AgentApplyOutcome(const char *text, List *values, StepResult *result)
{
	char	   *clean = AgentStripFences(text ? text : "");
	Jsonb	   *parsed = JsonParseSafe(clean, strlen(clean));
	JsonbValue *o;
	char	   *outcome;
	ListCell   *lc;
	bool		known = false;
	Jsonb	   *payload;

	if (parsed && JsonIsObject(parsed) && JsonGetField(parsed, "result"))
		payload = JsonGetJsonb(parsed, "result");
	else
		payload = parsed ? parsed : JsonStringValue(text ? text : "");
	if (values == NIL)
	{
		result->has_output = true;
		result->output = payload;
		result->signal = "default";
		return NULL;
	}
	if (parsed == NULL || !JsonIsObject(parsed))
		return psprintf("the model's final answer is not a JSON object {\"outcome\", \"result\"}: %s",
						JsonClipText(clean, 200));
	o = JsonGetField(parsed, "outcome");
	if (o == NULL || o->type != jbvString)
		return psprintf("the model's final answer has no \"outcome\" string: %s",
						JsonClipText(clean, 200));
	outcome = pnstrdup(o->val.string.val, o->val.string.len);
	foreach(lc, values)
		known |= strcmp(lfirst(lc), outcome) == 0;
	if (!known)
		return psprintf("the model answered outcome \"%s\", which is not in outcome.enum", outcome);
	result->has_output = true;
	result->output = payload;
	result->signal = outcome;
	return NULL;
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
