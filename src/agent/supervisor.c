/*-------------------------------------------------------------------------
 *
 * supervisor.c
 *	  The workflow's supervisor: deterministic rules and an LLM judge that
 *	  watch every autonomous agent of a run at its turn boundaries.
 *
 *	  supervisor:
 *		rules:
 *		  - { rule: repeated_tool_call, count: 3, action: abort }
 *		  - { rule: tool_errors, count: 3, action: steer, message: "Stop retrying; answer." }
 *		  - { rule: tokens_per_turn, max: 4000, action: pause }
 *		  - { rule: wall_time, max: 10m, action: abort }
 *		  - { rule: iterations, max: 6, action: steer, message: "Wrap up now." }
 *		judge: { model: judge, prompt: artifact://judge_prompt@1, every: 2, on_error: pass }
 *
 * The agent loop (agent_loop.c) asks SupervisorCheck at the top of a turn it
 * is about to take, right after the operator's control checkpoint: in
 * the worker (or the backend running tuvl.run()), with no process of its
 * own, and not at all when the workflow has no supervisor.  The rules
 * read what the loop knows (SupervisorWatch); the first hit of each rule
 * acts once.  Then, every `every` turns, the judge model is asked
 * {"verdict": "continue" | "steer" | "pause" | "abort", "reason", "message"}
 * about the conversation so far, a durable call like a guardrail's
 * (judge.c).  An answer that does not parse, or no answer, is handled by
 * on_error: pass goes on, abort aborts.
 *
 * The actions are those an operator has (control.c): steer appends
 * guidance before the next model call, pause parks the run until
 * tuvl.resume_run(), abort ends the step on its aborted exit.  The agent
 * records each action in its step_state, so a transition that executes
 * the step again puts steers back in place and never acts twice.  Every
 * rule hit and every judge answer is journaled as judge_verdict.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "artifact.h"
#include "journal.h"
#include "jsonutil.h"
#include "judge.h"
#include "metrics.h"
#include "security.h"
#include "spiutil.h"
#include "supervisor.h"
#include "uses.h"

static const char *const action_names[] = {"continue", "steer", "pause", "abort"};
static const char *const judge_verdicts[] = {"continue", "steer", "pause", "abort", NULL};

#define DEFAULT_STEER "A supervisor asks you to reconsider your approach and finish the task."

/* The workflow's supervisor block, or NULL. */
static Jsonb *
supervisor_of(RunState *run)
{
	return run->wf && JsonGetField(run->wf->definition, "supervisor")
		? JsonGetJsonb(run->wf->definition, "supervisor") : NULL;
}

bool
SupervisorPresent(RunState *run)
{
	return supervisor_of(run) != NULL;
}

const char *
SupervisorActionName(SupervisorAction a)
{
	return action_names[a];
}

static SupervisorAction
action_from_name(const char *name)
{
	for (int i = 0; i < (int) lengthof(action_names); i++)
		if (name && strcmp(action_names[i], name) == 0)
			return (SupervisorAction) i;
	return SUPERVISE_CONTINUE;
}

/* How long the step has run: since its agent_started (0 before it is stored). */
static int64
step_elapsed_ms(RunState *run)
{
	static const Oid types[2] = {INT8OID, INT4OID};
	Datum		d;

	if (SecurityExecArgs("SELECT ts FROM tuvl.events WHERE run_id OPERATOR(pg_catalog.=) $1 "
						 "AND seq OPERATOR(pg_catalog.=) $2",
						 SPI_OK_SELECT, 2, types, Int64GetDatum(run->id),
						 Int32GetDatum(run->entry_seq)) == 1 && SpiValue(1, &d))
		return (GetCurrentTimestamp() - DatumGetTimestampTz(d)) / 1000;
	return 0;
}

/* Does rule hit now?  *reason says why. */
static bool
rule_hit(RunState *run, Jsonb *rule, SupervisorWatch *w, char **reason)
{
	char	   *name = JsonGetString(rule, "rule");
	int64		n = JsonGetInt(rule, JsonGetField(rule, "count") ? "count" : "max", 0);

	if (strcmp(name, "repeated_tool_call") == 0 && w->repeats >= n)
		*reason = psprintf("tool \"%s\" was called %d times with the same arguments",
						   w->repeated, w->repeats);
	else if (strcmp(name, "tool_errors") == 0 && w->tool_errors >= n)
		*reason = psprintf("%d tool calls failed", w->tool_errors);
	else if (strcmp(name, "tokens_per_turn") == 0 && w->turn_tokens > n)
		*reason = psprintf("the last turn used %d tokens, more than %lld", w->turn_tokens,
						   (long long) n);
	else if (strcmp(name, "iterations") == 0 && w->iteration - 1 >= n)
		*reason = psprintf("the agent has taken %d turns", w->iteration - 1);
	else if (strcmp(name, "wall_time") == 0)
	{
		int			max_ms = 0;
		int64		elapsed;

		(void) DurationFromJson(JsonGetField(rule, "max"), &max_ms);
		elapsed = step_elapsed_ms(run);
		if (elapsed <= max_ms)
			return false;
		*reason = psprintf("the agent has run for %lld ms, more than %d ms", (long long) elapsed, max_ms);
	}
	else
		return false;
	return true;
}

static void
journal_verdict(RunState *run, const StepDef *step, const char *source, const char *rule,
				int iteration, const char *verdict, SupervisorAction action, const char *reason)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "source", source);
	JsonObjAddString(&b, "rule", rule);
	JsonObjAddInt(&b, "iteration", iteration);
	JsonObjAddString(&b, "verdict", verdict);
	JsonObjAddString(&b, "action", action_names[action]);
	JsonObjAddString(&b, "reason", reason);
	JournalAdd(&run->step_events, "judge_verdict", step->id, step->kind_name, JsonObjEnd(&b));
	if (!run->replay)
	{
		MetricLabel labels[5] = {
			{"workflow", run->workflow}, {"step", step->id}, {"source", source}, {"rule", rule},
			{"action", action_names[action]}
		};

		MetricCount("tuvl.supervisor.verdicts", run->principal, labels, 5, 1);
	}
}

static SupervisorAct *
make_act(SupervisorAction action, int rule, const char *message, const char *reason)
{
	SupervisorAct *a = palloc0(sizeof(SupervisorAct));

	a->action = action;
	a->rule = rule;
	a->message = message ? pstrdup(message) : NULL;
	a->reason = reason ? pstrdup(reason) : NULL;
	return a;
}

/* The judge's id for the boundary before turn iteration. */
static char *
judge_id(int iteration)
{
	return psprintf("supervisor.%d", iteration);
}

/* Is the judge due at the top of turn iteration (every `every` turns)? */
static bool
judge_due(Jsonb *judge, int iteration)
{
	int64		every = judge ? JsonGetInt(judge, "every", 1) : 0;

	return judge && every > 0 && iteration > 1 && (iteration - 1) % every == 0;
}

/*
 * Ask the judge at this boundary; returns what it says to do, NULL to go
 * on, or NULL with result->pending set while its answer is awaited.
 */
static SupervisorAct *
ask_judge(RunState *run, const StepDef *step, Jsonb *judge, SupervisorWatch *w,
		  StepResult *result, int64 *tokens)
{
	char	   *model = JsonGetString(judge, "model");
	char	   *on_error = JsonGetString(judge, "on_error");
	char	   *prompt = ArtifactResolveText(run, JsonGetString(judge, "prompt"), SITE_PROMPT,
											 "supervisor.judge.prompt");
	JudgeAnswer a;
	EffectRequest *req;
	SupervisorAction action;
	char	   *message = NULL;
	UseReferrer by;

	WorkflowReferrer(run->wf, &by);
	if (!JudgeAsk(run, judge_id(w->iteration), model ? model : "default", &by, prompt, w->transcript,
				  judge_verdicts, &a, &req))
	{
		result->pending = true;
		result->effect = req;
		return NULL;
	}
	*tokens += a.tokens;
	if (a.error)
		action = on_error && strcmp(on_error, "abort") == 0 ? SUPERVISE_ABORT : SUPERVISE_CONTINUE;
	else
	{
		action = action_from_name(a.verdict);
		message = JsonGetString(a.answer, "message");
	}
	if (a.fresh)
		journal_verdict(run, step, "judge", "judge", w->iteration, a.error ? "error" : a.verdict,
						action, a.reason);
	if (action == SUPERVISE_CONTINUE)
		return NULL;
	return make_act(action, -1, action == SUPERVISE_STEER ? (message ? message : DEFAULT_STEER) : NULL,
					a.reason ? a.reason : (a.error ? "the judge could not answer" : "the judge said so"));
}

/*
 * At the top of turn w->iteration of step (an autonomous agent): what the
 * supervisor does, in order, as a list of SupervisorAct; a pause or an
 * abort is last.  Rules that acted before (w->fired) and a judge verdict
 * that acted before (w->judged) are not asked again.  When the judge's
 * answer is awaited, result->pending is set and the acts so far are
 * returned.  *tokens grows by what the judge cost.
 */
List *
SupervisorCheck(RunState *run, const StepDef *step, SupervisorWatch *w, StepResult *result,
				int64 *tokens)
{
	Jsonb	   *sup = supervisor_of(run);
	Jsonb	   *rules = sup ? JsonGetJsonb(sup, "rules") : NULL;
	Jsonb	   *judge = sup && JsonGetField(sup, "judge") ? JsonGetJsonb(sup, "judge") : NULL;
	List	   *acts = NIL;

	if (sup == NULL)
		return NIL;
	for (int i = 0; i < JsonArraySize(rules); i++)
	{
		Jsonb	   *rule = JsonArrayAt(rules, i);
		SupervisorAction action = action_from_name(JsonGetString(rule, "action"));
		char	   *reason = NULL;
		SupervisorAct *act;

		if (bms_is_member(i, w->fired) || !rule_hit(run, rule, w, &reason))
			continue;
		journal_verdict(run, step, "rule", JsonGetString(rule, "rule"), w->iteration,
						"hit", action, reason);
		act = make_act(action, i, action == SUPERVISE_STEER
					   ? (JsonGetString(rule, "message") ? JsonGetString(rule, "message") : DEFAULT_STEER)
					   : NULL,
					   psprintf("rule %s: %s", JsonGetString(rule, "rule"), reason));
		acts = lappend(acts, act);
		if (action != SUPERVISE_STEER)
			return acts;
	}
	if (judge_due(judge, w->iteration) && !bms_is_member(w->iteration, w->judged))
	{
		SupervisorAct *act = ask_judge(run, step, judge, w, result, tokens);

		if (act)
			acts = lappend(acts, act);
	}
	return acts;
}

/*
 * What the judge cost at the top of turn iteration, when its answer is
 * recorded: for a transition that walks past that boundary without asking.
 */
int
SupervisorJudgeTokens(RunState *run, int iteration)
{
	Jsonb	   *sup = supervisor_of(run);
	Jsonb	   *judge = sup && JsonGetField(sup, "judge") ? JsonGetJsonb(sup, "judge") : NULL;

	if (!judge_due(judge, iteration))
		return 0;
	return JudgeTokens(run, judge_id(iteration));
}
