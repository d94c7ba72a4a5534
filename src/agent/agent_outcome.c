/*-------------------------------------------------------------------------
 *
 * agent_outcome.c
 *	  What the two modes of the Agent step share: the outcome contract and
 *	  when a failed model call is retried.
 *
 * The completion mode (agent_completion.c) and the autonomous loop
 * (agent_loop.c) end the same way: the model's final answer goes through
 * AgentApplyOutcome, and a transport failure is retried per agent.retry
 * (retry.c) or gives up with the same _last_error_type.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "storage/proc.h"
#include "utils/memutils.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"

#include "agent.h"
#include "artifact.h"
#include "executor.h"
#include "journal.h"
#include "jsonutil.h"
#include "security.h"
#include "spiutil.h"
#include "judge.h"
#include "retry.h"
#include "uses.h"

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

/* The final answer's JSON Schema, for a declared enum (NULL: none). */
Jsonb *
AgentAnswerSchema(List *values)
{
	const char **v;
	int			n = list_length(values);
	ListCell   *lc;
	int			i = 0;

	if (n == 0)
		return NULL;
	v = palloc(n * sizeof(char *));
	foreach(lc, values)
		v[i++] = lfirst(lc);
	return LlmEnumAnswerSchema("outcome", v, n, "result", NULL);
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
	char	   *clean = TextStripFences(text ? text : "");
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
 * The step ends on exit_name (its error type too) for why: it sets
 * _last_error and _last_error_type, and writes nothing else.
 */
static void
end_on_exit(StepResult *result, char *exit_name, const char *why)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "_last_error", why);
	JsonObjAddString(&b, "_last_error_type", exit_name);
	result->signal = exit_name;
	result->exit_error = pstrdup(why);
	result->has_output = false;
	result->context_merge = JsonObjEnd(&b);
}

/* A guardrail stopped the step: it ends on guardrail_violation. */
void
AgentViolation(StepResult *result, const char *why)
{
	end_on_exit(result, "guardrail_violation", why);
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
	 * No status: llm.c has classified the failure (a model's 429 and 5xx are
	 * "error"), so only on_timeout and on_error count.
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
	if (reply->error_type)
		return reply->error_type;
	return strcmp(reply->error_class ? reply->error_class : "error", "timeout") == 0
		? "timeout" : "llm_error";
}

/* The references attached to gate: agent.guardrails, then the step's. */
static List *
gate_refs(const StepDef *step, GuardrailGate gate)
{
	Jsonb	   *agent = JsonGetJsonb(step->spec, "agent");
	Jsonb	   *sources[2];
	List	   *refs = NIL;

	sources[0] = agent ? JsonGetJsonb(agent, "guardrails") : NULL;
	sources[1] = JsonGetJsonb(step->spec, "guardrails");
	for (int s = 0; s < 2; s++)
	{
		JsonbValue *list = sources[s] && JsonIsObject(sources[s])
		? JsonGetField(sources[s], GuardrailGateName(gate)) : NULL;

		if (list == NULL || list->type != jbvBinary)
			continue;
		for (int i = 0; i < (int) JsonContainerSize(list->val.binary.data); i++)
		{
			JsonbValue *r = getIthJsonbValueFromContainer(list->val.binary.data, i);

			if (r->type == jbvString)
				refs = lappend(refs, pnstrdup(r->val.string.val, r->val.string.len));
		}
	}
	return refs;
}

/*
 * The guardrail gates (guardrail.c) of an Agent step, in either mode:
 * run the guardrails attached to step's gate on *content, which a
 * pii_mask check replaces with its masked form.  Returns NULL when every
 * check passes, else why the first failing check failed: the guardrail,
 * its version, the check and the gate.  Raises when a reference cannot be
 * resolved (as any broken artifact reference does).
 */
/*
 * The guardrails a transaction resolved: a gate's checks, its judges and
 * its masks read the same references, and each costs a lookup.  Valid for
 * one transaction of this backend (the pinned versions do not change).
 */
typedef struct ResolvedGuardrail
{
	int64		run;
	char	   *text;
	ArtifactRef ref;
} ResolvedGuardrail;

static MemoryContext resolved_cxt = NULL;
static List *resolved = NIL;
static LocalTransactionId resolved_in = InvalidLocalTransactionId;

static void
resolve_guardrail(RunState *run, const StepDef *step, GuardrailGate gate, const char *text,
				  ArtifactRef *ref)
{
	ListCell   *lc;
	ResolvedGuardrail *r;
	MemoryContext old;

	if (resolved_cxt == NULL)
		resolved_cxt = AllocSetContextCreate(TopMemoryContext, "tuvl guardrails",
											 ALLOCSET_SMALL_SIZES);
	if (resolved_in != MyProc->lxid)
	{
		MemoryContextReset(resolved_cxt);
		resolved = NIL;
		resolved_in = MyProc->lxid;
	}
	foreach(lc, resolved)
	{
		r = lfirst(lc);
		if (r->run == run->id && strcmp(r->text, text) == 0)
		{
			*ref = r->ref;
			return;
		}
	}
	ArtifactResolve(run, text, SITE_GUARDRAIL,
					psprintf("the %s gate of step \"%s\"", GuardrailGateName(gate), step->id), ref);
	old = MemoryContextSwitchTo(resolved_cxt);
	r = palloc0(sizeof(ResolvedGuardrail));
	r->run = run->id;
	r->text = pstrdup(text);
	r->ref.name = pstrdup(ref->name);
	r->ref.version = ref->version;
	r->ref.type = ref->type ? pstrdup(ref->type) : NULL;
	r->ref.definition = ref->definition ? JsonCopyTo(ref->definition, resolved_cxt) : NULL;
	r->ref.owner = ref->owner;
	resolved = lcons(r, resolved);	/* the run at hand is at the front */
	MemoryContextSwitchTo(old);
}

/* Why guardrail ref stopped the content of gate at check check_no. */
static char *
stop_message(ArtifactRef *ref, GuardrailGate gate, int check_no, const char *check_name,
			 const char *why)
{
	return psprintf("guardrail \"%s\" (version %d) stopped the %s at the %s gate: check %d (%s): %s",
					ref->name, ref->version,
					gate == GATE_INPUT ? "model's input" :
					gate == GATE_TOOLS ? "tool's result" : "final answer",
					GuardrailGateName(gate), check_no, check_name, why);
}

char *
AgentGateCheck(RunState *run, const StepDef *step, GuardrailGate gate, char **content)
{
	ListCell   *lc;

	foreach(lc, gate_refs(step, gate))
	{
		ArtifactRef ref;
		int			check_no;
		char	   *check_name;
		char	   *why;

		resolve_guardrail(run, step, gate, lfirst(lc), &ref);
		why = GuardrailRun(ref.definition, content, &check_no, &check_name);
		if (why)
			return stop_message(&ref, gate, check_no, check_name, why);
	}
	return NULL;
}

/*
 * value with the pii_mask checks of step's gate applied: what is journaled
 * of content the gate masked.
 */
Jsonb *
AgentGateMask(RunState *run, const StepDef *step, GuardrailGate gate, Jsonb *value)
{
	ListCell   *lc;

	foreach(lc, gate_refs(step, gate))
	{
		ArtifactRef ref;

		resolve_guardrail(run, step, gate, lfirst(lc), &ref);
		value = GuardrailMaskJsonb(ref.definition, value);
	}
	return value;
}

static const char *const judge_verdicts[] = {"pass", "violation", NULL};

/* Journal what a judge of step's gate answered. */
static void
journal_verdict(RunState *run, const StepDef *step, GuardrailGate gate, ArtifactRef *ref,
				int check_no, JudgeAnswer *a, bool stop)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "source", "guardrail");
	JsonObjAddString(&b, "rule", "llm_judge");
	JsonObjAddString(&b, "guardrail", ref->name);
	JsonObjAddInt(&b, "version", ref->version);
	JsonObjAddInt(&b, "check", check_no);
	JsonObjAddString(&b, "gate", GuardrailGateName(gate));
	JsonObjAddString(&b, "verdict", a->error ? "error" : a->verdict);
	JsonObjAddString(&b, "action", stop ? "violation" : "pass");
	JsonObjAddString(&b, "reason", a->reason);
	JournalAdd(&run->step_events, "judge_verdict", step->id, step->kind_name, JsonObjEnd(&b));
}

/*
 * The llm_judge checks of step's gate (judge.c), on content: what the
 * gate's other checks let through.  subject tells this content from other
 * content judged at the same gate of the step ("input.1", "tools.3",
 * "output.4").  Returns NULL when every judge passes, or could not answer
 * and fails open (on_judge_error: pass, the default); else why the
 * content is stopped.  A verdict not yet recorded makes the step wait for
 * it: NULL, with result->pending set and the call as result->effect.
 * *tokens (when given) grows by what the recorded calls cost.
 */
char *
AgentGateJudge(RunState *run, const StepDef *step, GuardrailGate gate, const char *subject,
			   const char *content, StepResult *result, int64 *tokens)
{
	ListCell   *lc;

	foreach(lc, gate_refs(step, gate))
	{
		ArtifactRef ref;
		Jsonb	   *checks;
		UseReferrer by;

		resolve_guardrail(run, step, gate, lfirst(lc), &ref);
		/* what the guardrail names, it names as its owner (uses.c) */
		by.owner = ref.owner;
		by.pins = NULL;
		by.unpinned = false;
		by.what = psprintf("guardrail artifact \"%s\" version %d", ref.name, ref.version);
		checks = JsonGetJsonb(ref.definition, "checks");
		for (int i = 0; i < JsonArraySize(checks); i++)
		{
			Jsonb	   *check = JsonArrayAt(checks, i);
			char	   *model = JsonGetString(check, "model");
			char	   *on_error = JsonGetString(check, "on_judge_error");
			char	   *prompt;
			JudgeAnswer a;
			EffectRequest *req;
			bool		stop;

			if (strcmp(JsonGetString(check, "check"), "llm_judge") != 0)
				continue;
			prompt = ArtifactResolveTextBy(run, JsonGetString(check, "prompt"), SITE_PROMPT,
										   psprintf("the prompt of check %d of guardrail \"%s\"",
													i + 1, ref.name), &by);
			if (!JudgeAsk(run, psprintf("%s:%s:%d", subject, ref.name, i + 1),
						  model ? model : "default", &by, prompt, content, judge_verdicts, &a, &req))
			{
				result->pending = true;
				result->effect = req;
				return NULL;
			}
			if (tokens)
				*tokens += a.tokens;
			stop = a.error ? (on_error && strcmp(on_error, "violation") == 0)
				: strcmp(a.verdict, "violation") == 0;
			if (a.fresh)
				journal_verdict(run, step, gate, &ref, i + 1, &a, stop);
			if (stop)
				return stop_message(&ref, gate, i + 1, "llm_judge",
									a.error ? psprintf("%s, and on_judge_error is violation", a.reason)
									: psprintf("the judge's verdict is violation: %s",
											   a.reason ? a.reason : "no reason given"));
		}
	}
	return NULL;
}

/* A cost cap's value (0: none). */
static double
cap_of(Jsonb *obj, const char *key)
{
	JsonbValue *v = obj ? JsonGetField(obj, key) : NULL;

	if (v == NULL || v->type != jbvNumeric)
		return 0;
	return DatumGetFloat8(DirectFunctionCall1(numeric_float8, NumericGetDatum(v->val.numeric)));
}

/* What the run's priced model calls cost so far (tuvl.runs.cost). */
static double
run_cost(RunState *run)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1] = {Int64GetDatum(run->id)};
	SecurityFrame frame;
	double		cost = 0;
	bool		isnull;

	SecurityAsOwner(&frame);
	if (SpiExec("SELECT cost FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1", 1,
				types, values, NULL, SPI_OK_SELECT) == 1)
	{
		Datum		d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);

		cost = isnull ? 0 : DatumGetFloat8(d);
	}
	SecurityRestore(&frame);
	return cost;
}

/*
 * Would sending req pass a cost cap: agent.max_cost (step_spent: what
 * the step's calls cost so far) or the workflow's max_cost (the run's
 * tuvl.runs.cost)?  The call is estimated as ../CONTRACT.md says: its
 * input tokens (characters / 4) at the input price, plus prev_output
 * tokens (the previous turn's output; < 0: the config's max_tokens) at
 * the output price.  Returns why it would, or NULL.  SPI is connected.
 */
char *
AgentCostCheck(RunState *run, Jsonb *agent, LlmConfig *cfg, EffectRequest *req,
			   double step_spent, int64 prev_output)
{
	double		agent_cap = cap_of(agent, "max_cost");
	double		wf_cap = cap_of(run->wf->definition, "max_cost");
	double		est;

	if (agent_cap <= 0 && wf_cap <= 0)
		return NULL;
	est = LlmEstimateCost(cfg, req, prev_output >= 0 ? prev_output : LlmMaxOutputTokens(cfg));
	if (agent_cap > 0 && step_spent + est > agent_cap)
		return psprintf("the next model call (about %.6g) would bring the agent's cost from %.6g past its agent.max_cost of %g; it was not sent",
						est, step_spent, agent_cap);
	if (wf_cap > 0)
	{
		double		spent = run_cost(run);

		if (spent + est > wf_cap)
			return psprintf("the next model call (about %.6g) would bring the run's cost from %.6g past the workflow's max_cost of %g; it was not sent",
							est, spent, wf_cap);
	}
	return NULL;
}

/* End a step on budget_exceeded for why. */
void
AgentBudgetExceeded(StepResult *result, const char *why)
{
	end_on_exit(result, "budget_exceeded", why);
}
