/*-------------------------------------------------------------------------
 *
 * runtime.c
 *	  A run as a state machine: one transition per step.
 *
 * How a run flows
 * ---------------
 * 1. tuvl.start_run() (run_create.c, RunCreate) inserts the run as queued,
 *    journals run_queued and notes it in the shared queue (queue.c) at
 *    commit, waking a worker.
 * 2. A worker (worker.c) claims queued runs with FOR UPDATE SKIP LOCKED
 *    (lease.c): the claim raises the run's attempt, which fences every
 *    write of an older holder.  tuvl.run() creates the run already held
 *    by its own backend instead, and tuvl.replay() too.
 * 3. The holder makes transitions (RunAdvance, below), each inside a
 *    transaction it owns and in a subtransaction of its own:
 *    prepare_transition loads the workflow, journals run_started and
 *    agent_started on entering a step, applies operator directives that
 *    stand between steps (boundary_control), and journals the result of
 *    the effect the step was waiting for (take_fresh_effect).  Then the
 *    step executes through the executor table (executor.c): its own SQL
 *    runs in the transition, as the run's principal (security.c).
 * 4. A step that needs the outside world (an HTTP call, an MCP tool, a
 *    model) does not wait for it in the transaction: it returns an
 *    effect (effect.c), and the transition ends pending (finish_pending:
 *    tool_call is journaled, the request kept).  Once the transaction
 *    committed, the driver (driver.c) has the effect performed (the
 *    worker's curl multi handle, synchronously in tuvl.run(), from the
 *    fixture in tuvl.replay()), and the next transition executes the
 *    step again with the journaled result in front of it.
 * 5. A step that waits for a person or an operator parks the run
 *    (finish_park): paused, waiting_human or waiting_approval.  The
 *    holder lets go of it; tuvl.submit(), tuvl.decide() or
 *    tuvl.resume_run() (control.c) queue it again.
 * 6. Otherwise the step's signal is routed (finish_transition): to the
 *    next step, or to an end (run_completed, run_failed).  A rollback
 *    end, an unhandled failure or an abort runs the compensators of the
 *    completed steps first (compensation.c).
 * 7. Every transition ends with one write (checkpoint.c): the run's row,
 *    fenced by the lease, and the journal events that explain it, so a
 *    crash resumes from the last checkpoint and nothing is journaled
 *    that did not happen.  After commit RunApplyTransition makes the
 *    staged state current, and the driver decides what comes next
 *    (DriveNextAfter): another transition, an effect, or letting go.
 *
 * The step itself runs in a nested subtransaction so that its failure
 * becomes the "error" signal while the journal of that failure commits.
 * Must be called with SPI connected; allocates in CurrentMemoryContext
 * except for what the checkpoint stages, which lives in the run's
 * context.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/resowner.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "run_control.h"
#include "breakpoints.h"
#include "deadline.h"
#include "admission.h"
#include "effect.h"
#include "hook.h"
#include "journal.h"
#include "metrics.h"
#include "ratelimit.h"
#include "trace.h"
#include "jsonutil.h"
#include "llm.h"
#include "security.h"
#include "spiutil.h"
#include "template.h"
#include "transition.h"
#include "tuvl.h"

typedef struct RunErrorContext
{
	RunState   *run;
	const char *step;
	Transition *t;				/* the transition, whose step may be known */
} RunErrorContext;

/*
 * A run held in memory, in its own context under parent.
 */
RunState *
RunStateCreate(MemoryContext parent, int64 id, int attempt,
			   const char *workflow, int version, Oid principal,
			   const char *principal_name, Jsonb *context,
			   const char *current_step, int last_seq, Jsonb *step_state)
{
	MemoryContext cxt = AllocSetContextCreate(parent, "tuvl run",
											  ALLOCSET_SMALL_SIZES);
	MemoryContext old = MemoryContextSwitchTo(cxt);
	RunState   *run = palloc0(sizeof(RunState));
	WorkflowDef *wf;

	run->cxt = cxt;
	run->id = id;
	run->attempt = attempt;
	run->workflow = pstrdup(workflow);
	run->version = version;
	run->principal_name = pstrdup(principal_name);
	run->principal = principal;
	run->status = RUN_RUNNING;
	run->context = DatumGetJsonbPCopy(JsonbPGetDatum(context));
	run->last_seq = last_seq;
	run->step_state = step_state ? DatumGetJsonbPCopy(JsonbPGetDatum(step_state)) : NULL;
	run->notify_step = -1;
	run->started_at = GetCurrentTimestamp();
	MemoryContextSwitchTo(old);

	wf = WorkflowLoad(workflow, version);
	if (current_step == NULL)
		run->step = -1;
	else
	{
		run->step = WorkflowFindStep(wf, current_step);
		if (run->step < 0)
			elog(ERROR, "run " INT64_FORMAT " is at step \"%s\", which its workflow does not have",
				 id, current_step);
	}
	return run;
}

void
RunStateFree(RunState *run)
{
	/* a model call waiting for admission or in flight gives it back */
	if (run->send && run->send->admit)
		AdmissionDone(run->send->admit, -1, 0, 0);
	MemoryContextDelete(run->cxt);
}

/* The id of the transition's step, once it is known. */
static const char *
transition_step_id(Transition *t)
{
	return t->step ? t->step->id : NULL;
}

static void
run_error_callback(void *arg)
{
	RunErrorContext *ec = arg;

	if (ec->t && transition_step_id(ec->t))
		ec->step = transition_step_id(ec->t);
	if (ec->step)
		errcontext("tuvl run " INT64_FORMAT " of workflow \"%s\", step \"%s\"",
				   ec->run->id, ec->run->workflow, ec->step);
	else
		errcontext("tuvl run " INT64_FORMAT " of workflow \"%s\"",
				   ec->run->id, ec->run->workflow);
}

/* Payload helpers */
static Jsonb *
payload_step(const StepDef *step)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "kind", step->kind_name);
	return JsonObjEnd(&b);
}

/*
 * Where does signal lead from step?  Returns the target id, or NULL when
 * the signal has no route and no implicit one.  *implicit_end is set when
 * the default signal falls off the end of the main line.
 */
static const char *
route_signal(WorkflowDef *wf, const StepDef *step, const char *signal, bool *implicit_end)
{
	char	   *target;

	*implicit_end = false;
	if (step->routes && (target = JsonGetString(step->routes, signal)) != NULL)
		return target;
	/* a Router's default route catches every value it does not map */
	if (ExecutorFor(step->kind)->default_catches_all && strcmp(signal, "error") != 0 &&
		step->routes &&
		(target = JsonGetString(step->routes, "default")) != NULL)
		return target;
	if (strcmp(signal, "default") == 0)
	{
		if (step->next >= 0)
			return wf->steps[step->next].id;
		*implicit_end = true;
	}
	return NULL;
}

/*
 * Render an end's response; on failure return NULL and set *error.
 */
static Jsonb *
render_response(EndDef *end, Jsonb *context, char **error)
{
	MemoryContext oldcxt = CurrentMemoryContext;
	Jsonb	   *volatile response = NULL;

	PG_TRY();
	{
		response = TemplateRenderJsonb(end->response, context, NULL);
	}
	PG_CATCH();
	{
		ErrorData  *e;

		/* a cancel or a deadline is not the template's fault */
		if (SpiErrorStopsStatement(geterrcode()))
			PG_RE_THROW();
		MemoryContextSwitchTo(oldcxt);
		e = CopyErrorData();
		FlushErrorState();
		*error = psprintf("could not render the response of end \"%s\": %s",
						  end->id, e->message);
	}
	PG_END_TRY();
	return response;
}

/* The status of a run that goes on: running, or compensating. */
static RunStatus
active_status(RunState *run)
{
	return CompensationActive(run) ? RUN_COMPENSATING : RUN_RUNNING;
}

static char *effect_span_id(RunState *run, const char *judge);

/* The step_state written while a step waits for an effect. */
static Jsonb *
pending_step_state(Transition *t, EffectRequest *effect)
{
	JsonObjBuilder b;
	JsonObjBuilder p;

	JsonObjStart(&p);
	JsonObjAddInt(&p, "position", EffectCount(t->run));
	if (effect->idempotency_key)
		JsonObjAddString(&p, "idempotency_key", effect->idempotency_key);
	JsonObjAddJsonb(&p, "request", effect->journal);

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", t->step->id);
	JsonObjAddInt(&b, "entry_seq", t->run->entry_seq);
	if (t->deadline != 0)
		JsonObjAddInt(&b, "deadline", t->deadline);
	JsonObjAddInt(&b, "entered", t->entered);
	JsonObjAddJsonb(&b, "effects", EffectRecords(t->run) ? EffectRecords(t->run)
					: JsonFromCString("[]"));
	if (t->run->working_judged)
		JsonObjAddJsonb(&b, "judged", t->run->working_judged);
	JsonObjAddJsonb(&b, "pending", JsonObjEnd(&p));
	return JsonObjEnd(&b);
}

/*
 * The step asked for an effect: journal tool_call, keep the step current
 * with its step_state, and stage the request for sending after commit.
 */
static void
finish_pending(Transition *t, StepResult *result)
{
	RunState   *run = t->run;
	List	   *events = list_concat(list_copy(t->events), run->step_events);
	EffectRequest *effect = result->effect;
	Jsonb	   *state = pending_step_state(t, effect);
	JsonObjBuilder b;
	Checkpoint	cp;

	/* the effect ends when the step's time is up, at the latest */
	if (t->deadline != 0)
	{
		long		left = (long) ((t->deadline - GetCurrentTimestamp()) / 1000) - effect->delay_ms;
		int			ms = (int) Max(Min(left, INT_MAX), 1);

		if (effect->http.timeout_ms <= 0 || effect->http.timeout_ms > ms)
		{
			JsonObjBuilder tb;

			effect->http.timeout_ms = ms;
			/* a timeout of this request is the step's */
			JsonObjStart(&tb);
			JsonObjAddBool(&tb, "step_deadline", true);
			effect->tag = effect->tag ? JsonMerge(effect->tag, JsonObjEnd(&tb)) : JsonObjEnd(&tb);
		}
	}

	/* an LLM call is journaled once, as llm_turn, when it answered */
	if (!(effect->tag && JsonGetString(effect->tag, "op") &&
		  strcmp(JsonGetString(effect->tag, "op"), "llm") == 0))
	{
		JsonObjStart(&b);
		JsonObjAddInt(&b, "position", EffectCount(run));
		JsonObjAddJsonb(&b, "request", effect->journal);
		if (effect->delay_ms > 0)
			JsonObjAddInt(&b, "delay_ms", effect->delay_ms);
		JournalAdd(&events, "tool_call", t->step->id, t->step->kind_name, JsonObjEnd(&b));
	}

	memset(&cp, 0, sizeof(cp));
	cp.status = active_status(run);
	cp.context = run->context;
	cp.step = t->step->id;		/* stays here */
	cp.step_state = state;
	cp.steer_done = result->steer_done;
	cp.events = events;
	CheckpointWrite(run, &cp);
	/* the request names the span that will record it (trace_effect) */
	if (TraceEnabled(run))
	{
		HttpHeader *h = palloc(sizeof(HttpHeader));

		h->name = "traceparent";
		h->value = TraceParent(run, effect_span_id(run, effect->tag ? JsonGetString(effect->tag, "judge")
												   : NULL));
		effect->http.headers = lappend(effect->http.headers, h);
	}
	RunForgetSend(run);
	run->send_cxt = AllocSetContextCreate(run->cxt, "tuvl effect", ALLOCSET_SMALL_SIZES);
	run->send = EffectRequestCopy(effect, run->send_cxt);
}

/*
 * The step waits for a person or an operator (result->park is the
 * status): keep it current with its step_state, journal what it asked
 * for, and release the lease.  Whoever answers re-queues the run.
 */
static void
finish_park(Transition *t, StepResult *result)
{
	RunState   *run = t->run;
	List	   *events = list_concat(list_copy(t->events), run->step_events);
	JsonObjBuilder b;
	Jsonb	   *state;
	Checkpoint	cp;

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", t->step->id);
	JsonObjAddInt(&b, "entry_seq", run->entry_seq);
	/* waiting does not count against the step's time */
	if (t->deadline != 0)
		JsonObjAddInt(&b, "time_left_ms",
					  Max((t->deadline - GetCurrentTimestamp()) / 1000, 0));
	JsonObjAddInt(&b, "entered", t->entered);
	JsonObjAddJsonb(&b, "effects", EffectRecords(run) ? EffectRecords(run)
					: JsonFromCString("[]"));
	if (run->working_judged)
		JsonObjAddJsonb(&b, "judged", run->working_judged);
	if (result->park_info)
		JsonObjAddJsonb(&b, "awaiting", result->park_info);
	state = JsonObjEnd(&b);

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", t->step->id);
	JsonObjAddString(&b, "status", StatusName(result->park));
	if (result->park_info)
		JsonObjAddJsonb(&b, "awaiting", result->park_info);
	JournalAdd(&events, "checkpoint", t->step->id, t->step->kind_name, JsonObjEnd(&b));

	memset(&cp, 0, sizeof(cp));
	cp.status = result->park;
	cp.context = run->context;
	cp.step = t->step->id;
	cp.step_state = state;
	cp.consume = result->consume;
	cp.control_add = result->control_add;
	cp.steer_done = result->steer_done;
	cp.events = events;
	CheckpointWrite(run, &cp);
}

/*
 * The run's error when a step failed with edata: the message, then its
 * detail and hint on lines of their own, as psql shows a direct call's.
 */
static char *
step_error_text(const StepDef *step, ErrorData *edata)
{
	StringInfoData buf;

	initStringInfo(&buf);
	appendStringInfo(&buf, "step \"%s\" failed: %s", step->id, edata->message);
	if (edata->detail)
		appendStringInfo(&buf, "\nDETAIL:  %s", edata->detail);
	if (edata->hint)
		appendStringInfo(&buf, "\nHINT:  %s", edata->hint);
	return buf.data;
}

/*
 * Where the step's signal leads: the next step (cp->step, running), or an
 * end (cp->status, end_name, response, error).  An aborted or failed run
 * that has completed steps to undo is compensating instead.
 */
static void
route_outcome(Transition *t, StepResult *result, ErrorData *edata, const char *signal,
			  Checkpoint *cp)
{
	const StepDef *step = t->step;
	const char *exit_error = result && result->exit_error ? result->exit_error : NULL;
	bool		implicit_end;
	const char *target = route_signal(t->wf, step, signal, &implicit_end);
	EndDef	   *end = NULL;
	char	   *error = NULL;

	/* a notify hook's run ends after its one step, whatever its routes */
	if (t->run->notify_step >= 0)
	{
		target = NULL;
		implicit_end = edata == NULL && strcmp(signal, "error") != 0 &&
			!ExecutorIsReservedExit(step, signal);
	}

	cp->status = RUN_RUNNING;
	if (target && WorkflowFindStep(t->wf, target) >= 0)
	{
		cp->step = target;
		return;
	}
	if (target || implicit_end)
	{
		end = target ? WorkflowFindEnd(t->wf, target) : NULL;
		cp->end_name = end ? end->id : NULL;
		cp->status = end ? StatusFromName(end->status) : RUN_COMPLETED;
		if (end && end->response)
			cp->response = render_response(end, cp->context, &error);
		if (error)
			cp->status = RUN_FAILED;
		else if (cp->status == RUN_FAILED)
			error = psprintf("the run reached end \"%s\", whose status is failed", cp->end_name);
	}
	else if (strcmp(signal, "aborted") == 0 && ExecutorFor(step->kind)->reserved_exits)
	{
		/* an abort is an out-of-band stop, not an authoring bug */
		cp->status = RUN_ABORTED;
		error = psprintf("warning: step \"%s\" was aborted and has no route for \"aborted\": %s",
						 step->id, exit_error ? exit_error : "aborted");
	}
	else
	{
		cp->status = RUN_FAILED;
		if (edata)
			error = step_error_text(step, edata);
		else if (strcmp(signal, "error") == 0 && exit_error)
			error = psprintf("warning: step \"%s\" ended on its \"error\" exit, which has no route: %s",
							 step->id, exit_error);
		else if (strcmp(signal, "error") != 0 && ExecutorIsReservedExit(step, signal))
			error = psprintf("step \"%s\" ended on the reserved exit \"%s\", which has no route: %s "
							 "(map %s in the step's routes to handle it)",
							 step->id, signal, exit_error ? exit_error : signal, signal);
		else
			error = psprintf("step \"%s\" produced signal \"%s\", which has no route",
							 step->id, signal);
	}
	cp->error = error;

	/*
	 * A rollback end, an unhandled failure or an abort undoes the completed
	 * steps that declare a compensator.
	 */
	if ((end && end->rollback) ||
		(end == NULL && (cp->status == RUN_FAILED || cp->status == RUN_ABORTED)))
	{
		const char *first = CompensationBegin(t->run, cp->status, cp->end_name, cp->response,
											  cp->error);

		if (first)
		{
			if (cp->status == RUN_ABORTED)
			{
				JsonObjBuilder b;

				JsonObjStart(&b);
				JsonObjAddString(&b, "status", StatusName(RUN_COMPENSATING));
				JsonObjAddString(&b, "error", cp->error);
				JournalAdd(&cp->events, "run_aborted", NULL, NULL, JsonObjEnd(&b));
			}
			cp->status = RUN_COMPENSATING;
			cp->step = first;
			cp->end_name = NULL;
			cp->response = NULL;
		}
	}
}

/* tuvl.llm.tokens of a model call's llm_turn payload, by model and type. */
static void count_cost(Transition *t, Jsonb *payload);

static void
count_tokens(Transition *t, Jsonb *payload)
{
	static const char *const types[] = {"prompt", "completion"};
	Jsonb	   *tokens = JsonGetJsonb(payload, "tokens");
	MetricLabel labels[4] = {
		{"workflow", t->run->workflow}, {"step", t->step->id},
		{"model", JsonGetString(payload, "model")}, {"type", NULL}
	};

	if (t->run->replay || tokens == NULL)
		return;
	for (int i = 0; i < 2; i++)
	{
		labels[3].value = types[i];
		MetricCount("tuvl.llm.tokens", t->run->principal, labels, 4,
					(double) JsonGetInt(tokens, types[i], 0));
	}
}

/*
 * A priced call's cost: tuvl.llm.cost by model and role, and the run's
 * tuvl.runs.cost (what a workflow's max_cost is checked against).
 */
static void
count_cost(Transition *t, Jsonb *payload)
{
	static const Oid cost_types[2] = {INT8OID, FLOAT8OID};
	JsonbValue *c = JsonGetField(payload, "cost");
	double		cost;
	MetricLabel labels[4] = {
		{"workflow", t->run->workflow}, {"model", JsonGetString(payload, "model")},
		{"config", JsonGetString(payload, "config")}, {"role", t->run->principal_name}
	};

	if (c == NULL || c->type != jbvNumeric)
		return;
	cost = DatumGetFloat8(DirectFunctionCall1(numeric_float8, NumericGetDatum(c->val.numeric)));
	if (!t->run->replay)
		MetricCount("tuvl.llm.cost", t->run->principal, labels, 4, cost);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "could not connect to SPI");
	SecurityExecArgs("UPDATE tuvl.runs SET cost = cost OPERATOR(pg_catalog.+) $2 "
					 "WHERE id OPERATOR(pg_catalog.=) $1",
					 SPI_OK_UPDATE, 2, cost_types,
					 Int64GetDatum(t->run->id), Float8GetDatum(cost));
	SPI_finish();
}

/* tuvl.steps and tuvl.step.duration_ms of a step that ended (metrics.c). */
static void
count_step(Transition *t, const char *signal)
{
	MetricLabel labels[4] = {
		{"workflow", t->run->workflow}, {"step", t->step->id},
		{"kind", t->step->kind_name}, {"signal", signal}
	};

	if (t->run->replay)
		return;
	MetricCount("tuvl.steps", t->run->principal, labels, 4, 1);
	MetricObserveMs("tuvl.step.duration_ms", t->run->principal, labels, 3,
					(double) (GetCurrentTimestamp() - t->entered) / 1000.0);
}

/* The span of a step that ended: from its entry, a child of the run's. */
static void
trace_step(Transition *t, const char *signal, const char *error)
{
	TraceSpan	s;

	TraceSpanStart(&s, t->run, psprintf("step %s", t->step->id), SPAN_KIND_INTERNAL,
				   TraceStepSpanId(t->run, t->run->entry_seq), TraceRunSpanId(t->run), t->entered);
	TraceAttrString(&s, "tuvl.step.id", t->step->id);
	TraceAttrString(&s, "tuvl.step.kind", t->step->kind_name);
	TraceAttrString(&s, "tuvl.step.signal", signal);
	if (t->step->kind == STEP_AGENT)
		TraceAttrString(&s, "tuvl.agent.step_id", t->step->id);
	TraceSpanEnd(&s, GetCurrentTimestamp(), error);
}

/* The span of a run that ended: the root of its trace. */
static void
trace_run(Transition *t, Checkpoint *cp)
{
	TraceSpan	s;

	TraceSpanStart(&s, t->run, psprintf("run %s", t->run->workflow), SPAN_KIND_INTERNAL,
				   TraceRunSpanId(t->run), TraceRunParentId(t->run), t->run->started_at);
	TraceAttrInt(&s, "tuvl.workflow.version", t->run->version);
	TraceAttrString(&s, "tuvl.run.status", StatusName(cp->status));
	TraceAttrString(&s, "tuvl.run.end", cp->end_name);
	TraceAttrString(&s, "tuvl.run.principal", t->run->principal_name);
	TraceSpanEnd(&s, GetCurrentTimestamp(), cp->status == RUN_COMPLETED ? NULL : cp->error ? cp->error
				 : StatusName(cp->status));
}

/* agent_completed: how the step ended, with its output or its error. */
static void
journal_step_end(Transition *t, StepResult *result, ErrorData *edata, const char *signal,
				 List **events)
{
	const StepDef *step = t->step;
	instr_time	duration;
	JournalEvent *ev;
	JsonObjBuilder b;

	INSTR_TIME_SET_CURRENT(duration);
	INSTR_TIME_SUBTRACT(duration, t->start);
	JsonObjStart(&b);
	JsonObjAddString(&b, "signal", signal);
	if (result && result->exit_error)
		JsonObjAddString(&b, "error", result->exit_error);
	if (edata)
	{
		char		sqlstate[6];

		memcpy(sqlstate, unpack_sql_state(edata->sqlerrcode), 6);
		JsonObjAddString(&b, "error", edata->message);
		JsonObjAddString(&b, "error_type", ExecutorErrorType);
		JsonObjAddString(&b, "sqlstate", sqlstate);
		if (edata->detail)
			JsonObjAddString(&b, "detail", edata->detail);
		if (edata->hint)
			JsonObjAddString(&b, "hint", edata->hint);
	}
	else if (result->has_output)
	{
		JsonObjAddString(&b, "output_key", step->output_key);
		JsonObjAddJsonb(&b, "output", result->output);
	}
	ev = JournalAdd(events, "agent_completed", step->id, step->kind_name, JsonObjEnd(&b));
	ev->latency_ms = INSTR_TIME_GET_MILLISEC(duration);
	if (TraceEnabled(t->run))
		trace_step(t, signal, edata ? edata->message : result ? result->exit_error : NULL);

	JsonObjStart(&b);
	JsonObjAddString(&b, "signal", signal);
	JournalAdd(events, "signal", step->id, step->kind_name, JsonObjEnd(&b));
}

/* checkpoint, and run_completed / run_failed / run_aborted at an end */
static void
journal_checkpoint(Transition *t, Checkpoint *cp)
{
	JsonObjBuilder b;
	bool		ended = !RunStatusIsHeld(cp->status);

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", cp->step);
	if (ended)
		JsonObjAddString(&b, "end", cp->end_name);
	JsonObjAddString(&b, "status", StatusName(cp->status));
	JournalAdd(&cp->events, "checkpoint", t->step->id, t->step->kind_name, JsonObjEnd(&b));
	if (!ended)
		return;
	JsonObjStart(&b);
	JsonObjAddString(&b, "end", cp->end_name);
	JsonObjAddString(&b, "status", StatusName(cp->status));
	JsonObjAddJsonb(&b, "response", cp->response);
	if (cp->error)
		JsonObjAddString(&b, "error", cp->error);
	JournalAdd(&cp->events, cp->status == RUN_COMPLETED ? "run_completed" :
			   cp->status == RUN_ABORTED ? "run_aborted" : "run_failed",
			   NULL, NULL, JsonObjEnd(&b));
	if (TraceEnabled(t->run))
		trace_run(t, cp);
}

static void step_deadline_end(Transition *t);

/*
 * Everything after the step: context update, journal, routing and the
 * checkpoint.  result is NULL when the step failed with edata.  Runs in
 * the transition's subtransaction.
 */
static void
finish_transition(Transition *t, StepResult *result, ErrorData *edata)
{
	RunState   *run = t->run;
	const StepDef *step = t->step;
	const char *signal;
	Checkpoint	cp;

	/*
	 * Hooks fire where the transition commits: before_step with the
	 * agent_started the transition journals (also when the step failed and
	 * its first attempt rolled back), the step's end below.
	 */
	if (t->first_entry)
		HookFire(run, step, HOOK_BEFORE_STEP, NULL, NULL, NULL);
	if (result && result->pending)
	{
		finish_pending(t, result);
		return;
	}
	if (result && result->park != RUN_NONE)
	{
		finish_park(t, result);
		return;
	}
	/* the step ended: its hooks hear of it, on_error when it failed */
	signal = result ? (result->signal ? result->signal : "default") : "error";
	count_step(t, signal);
	HookFire(run, step, edata || strcmp(signal, "error") == 0 ||
			 ExecutorIsReservedExit(step, signal) ? HOOK_ON_ERROR : HOOK_AFTER_STEP,
			 NULL, signal, edata ? edata->message : result ? result->exit_error : NULL);
	step_deadline_end(t);
	if (CompensationActive(run))
	{
		CompensationFinish(t, result, edata);
		return;
	}
	memset(&cp, 0, sizeof(cp));
	cp.events = list_copy(t->events);
	cp.context = run->context;
	if (result)
	{
		cp.events = list_concat(cp.events, run->step_events);
		CompensationRemember(run, step, result);
		signal = result->signal ? result->signal : "default";
		if (result->context_merge)
			cp.context = JsonMerge(cp.context, result->context_merge);
		if (result->has_output)
			cp.context = JsonSetKey(cp.context, step->output_key, result->output);
		cp.consume = result->consume;
		cp.steer_done = result->steer_done;
	}
	else
	{
		JsonObjBuilder b;

		JsonObjStart(&b);
		JsonObjAddString(&b, "_last_error", edata->message);
		JsonObjAddString(&b, "_last_error_type", ExecutorErrorType);
		cp.context = JsonMerge(cp.context, JsonObjEnd(&b));
		signal = "error";
	}
	journal_step_end(t, result, edata, signal, &cp.events);
	route_outcome(t, result, edata, signal, &cp);
	journal_checkpoint(t, &cp);
	CheckpointWrite(run, &cp);
}

static void take_fresh_effect(Transition *t);

/* "30 s", "1.5 s" or "250 ms", for messages. */
static char *
duration_text(int ms)
{
	if (ms % 1000 == 0)
		return psprintf("%d s", ms / 1000);
	if (ms > 1000)
		return psprintf("%.1f s", ms / 1000.0);
	return psprintf("%d ms", ms);
}

/*
 * The step's timeout in milliseconds: its own, or tuvl.step_timeout, cut
 * to tuvl.max_step_timeout, which 0 means (a role may SET
 * tuvl.step_timeout for tuvl.run() in its session, never past the
 * superuser's maximum).  0 (none) only for a Human step.
 */
static int
step_timeout_ms(const StepDef *step)
{
	int			ms;

	/* a Human step's timeout is how long it waits for a person (control.c) */
	if (step->kind == STEP_HUMAN)
		return 0;
	ms = step->timeout_ms >= 0 ? step->timeout_ms : tuvl_step_timeout;
	if (ms <= 0 || ms > tuvl_max_step_timeout)
		ms = tuvl_max_step_timeout;
	return ms;
}

/* Raise the timeout failure of the step (ERRCODE_QUERY_CANCELED). */
static void
step_timed_out(Transition *t)
{
	ExecutorErrorType = "timeout";
	ereport(ERROR,
			(errcode(ERRCODE_QUERY_CANCELED),
			 errmsg("the step's timeout of %s passed", duration_text(step_timeout_ms(t->step)))));
}

/*
 * The step's work is done: executed, and its end hooks fired.  Its
 * deadline is lifted before the transition is recorded, so that a step
 * that produced a large output in time is not cancelled while tuvl
 * writes it.  A step found past its deadline fails with type timeout.
 */
static void
step_deadline_end(Transition *t)
{
	int			level = t->deadline_level;

	if (level < 0)
		return;
	t->deadline_level = -1;
	if (DeadlinePop(level) == DEADLINE_STEP || GetCurrentTimestamp() >= t->deadline)
	{
		t->timed_out = true;
		step_timed_out(t);
	}
}

/* step_state of a step paused now: its clock stops, keeping the time left */
static Jsonb *
paused_step_state(Jsonb *state)
{
	TimestampTz deadline;

	if (state == NULL || JsonGetField(state, "deadline") == NULL)
		return state;
	deadline = (TimestampTz) JsonGetInt(state, "deadline", 0);
	return JsonSetKey(JsonRemoveKey(state, "deadline"), "time_left_ms",
					  JsonFromCString(psprintf(INT64_FORMAT,
											   Max((deadline - GetCurrentTimestamp()) / 1000, 0))));
}

/*
 * Does the step apply operator directives itself, at boundaries of its
 * own?  An autonomous agent does, between its turns and tool calls.  A
 * completion-mode agent is one model call: like an APICall, it is paused
 * and aborted between its attempts (a Retry-After being waited out
 * included), here.
 */
static bool
step_controls_itself(const StepDef *step)
{
	char	   *mode;

	if (!ExecutorFor(step->kind)->controls_itself)
		return false;
	mode = JsonGetString(step->spec, "mode");
	return mode == NULL || strcmp(mode, "completion") != 0;
}

/*
 * The checkpoint of a transition that stops before its step executes
 * (boundary_control, dev_mode_stop): the events so far, the context and
 * the step; b is started as its event's payload, naming the step.
 */
static void
stop_before_step(Transition *t, Checkpoint *cp, JsonObjBuilder *b)
{
	memset(cp, 0, sizeof(*cp));
	cp->events = list_copy(t->events);
	cp->context = t->run->context;
	cp->step = t->step->id;
	JsonObjStart(b);
	JsonObjAddString(b, "step", t->step->id);
}

/* The stop pauses the run: "paused" journaled, the step's clock stopped. */
static void
stop_paused(Transition *t, Checkpoint *cp, JsonObjBuilder *b)
{
	JournalAdd(&cp->events, "paused", t->step->id, t->step->kind_name, JsonObjEnd(b));
	cp->status = RUN_PAUSED;
	cp->step_state = paused_step_state(t->run->step_state);
}

/*
 * Operator directives that apply between steps (tuvl.runs.control, as
 * seen at the last checkpoint): abort ends the run, pause parks it and
 * releases the lease.  A step that controls itself (an agent in the
 * middle of its loop) applies them at its next turn, where its aborted
 * exit may be routed.  Returns true when the transition was such a stop.
 */
static bool
boundary_control(Transition *t)
{
	RunState   *run = t->run;
	AbortDirective abort;
	bool		aborted = ControlAbortRequested(run->control, &abort);
	Jsonb	   *pause = JsonGetJsonb(run->control, "pause");
	char	   *state_step = run->step_state ? JsonGetString(run->step_state, "step") : NULL;
	Checkpoint	cp;
	JsonObjBuilder b;

	if (!aborted && pause == NULL)
		return false;
	if (step_controls_itself(t->step) && state_step &&
		strcmp(state_step, t->step->id) == 0)
		return false;
	stop_before_step(t, &cp, &b);
	if (aborted)
	{
		const char *first = CompensationBegin(run, RUN_ABORTED, NULL, NULL, abort.error);

		cp.status = first ? RUN_COMPENSATING : RUN_ABORTED;
		cp.error = abort.error;
		JsonObjAddString(&b, "reason", abort.reason);
		JsonObjAddString(&b, "by", abort.by);
		JsonObjAddString(&b, "status", StatusName(cp.status));
		JournalAdd(&cp.events, "run_aborted", NULL, NULL, JsonObjEnd(&b));
		cp.consume = list_make2("abort", "pause");
		if (first)
		{
			cp.step = first;
			JsonObjStart(&b);
			JsonObjAddString(&b, "step", first);
			JsonObjAddString(&b, "status", StatusName(cp.status));
			JournalAdd(&cp.events, "checkpoint", t->step->id, t->step->kind_name, JsonObjEnd(&b));
		}
		else
			cp.step_state = paused_step_state(run->step_state);
	}
	else
	{
		JsonObjAddString(&b, "by", JsonIsObject(pause) ? JsonGetString(pause, "by") : NULL);
		stop_paused(t, &cp, &b);
		cp.consume = list_make1("pause");
	}
	CheckpointWrite(run, &cp);
	return true;
}

/*
 * Dev mode (issue 38): does a breakpoint or step mode stop the run before
 * the step it enters?  Asked only while this database has a breakpoint or
 * a run in step mode (the gate in shared memory: a run without dev mode
 * pays one atomic read); then BreakpointsStop decides, from
 * tuvl.breakpoints and tuvl.dev_runs, who stops it ("breakpoint" or
 * "step"), and the run parks paused before the step, as a pause does,
 * until tuvl.resume_run() or tuvl.step_run() lets it enter.  Not asked
 * when the step goes on after an effect.  Returns true when the run
 * stopped.
 */
static bool
dev_mode_stop(Transition *t)
{
	RunState   *run = t->run;
	char	   *state_step;
	const char *by;
	Checkpoint	cp;
	JsonObjBuilder b;

	if (!TuvlDevGate())
		return false;
	state_step = run->step_state ? JsonGetString(run->step_state, "step") : NULL;
	if (state_step && strcmp(state_step, t->step->id) == 0)
		return false;
	by = BreakpointsStop(run->id, run->principal, run->workflow, t->step->id);
	if (by == NULL)
		return false;
	stop_before_step(t, &cp, &b);
	JsonObjAddString(&b, "by", by);
	stop_paused(t, &cp, &b);
	CheckpointWrite(run, &cp);
	return true;
}

/*
 * Everything a transition needs before its step executes: the workflow,
 * the step, the journal events of entering it, the effect just
 * performed, its deadline.  Returns false when operator control ended
 * the transition here (boundary_control).  Runs in the transition's
 * subtransaction: whatever it raises leaves nothing behind.
 */
static bool
prepare_transition(Transition *t)
{
	RunState   *run = t->run;
	JsonObjBuilder b;
	int			cur;
	char	   *state_step;
	int			timeout_ms;

	t->wf = WorkflowLoad(run->workflow, run->version);
	run->wf = t->wf;
	cur = run->step;
	if (cur < 0)
	{
		JsonObjStart(&b);
		JsonObjAddString(&b, "workflow", run->workflow);
		JsonObjAddInt(&b, "version", run->version);
		JsonObjAddString(&b, "principal", run->principal_name);
		JsonObjAddInt(&b, "attempt", run->attempt);
		JournalAdd(&t->events, "run_started", NULL, NULL, JsonObjEnd(&b));
		cur = run->notify_step >= 0 ? run->notify_step : t->wf->start;
	}
	t->step = &t->wf->steps[cur];

	if (!SearchSysCacheExists1(AUTHOID, ObjectIdGetDatum(run->principal)))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("role \"%s\" that started the run does not exist", run->principal_name),
				 errdetail("Runs belong to the role, not to its name: a role created again under the name does not take them over.")));

	if (run->control && run->fresh_effect == NULL && !CompensationActive(run) &&
		boundary_control(t))
		return false;
	if (!run->replay && run->fresh_effect == NULL && !CompensationActive(run) &&
		dev_mode_stop(t))
		return false;

	/* entering the step, or continuing it after an effect? */
	timeout_ms = step_timeout_ms(t->step);
	state_step = run->step_state ? JsonGetString(run->step_state, "step") : NULL;
	if (state_step && strcmp(state_step, t->step->id) == 0)
	{
		run->entry_seq = (int) JsonGetInt(run->step_state, "entry_seq", 0);
		run->working_effects = JsonGetJsonb(run->step_state, "effects");
		run->effects_added = NIL;
		run->working_judged = JsonGetField(run->step_state, "judged")
			? JsonGetJsonb(run->step_state, "judged") : NULL;
		t->entered = (TimestampTz) JsonGetInt(run->step_state, "entered", GetCurrentTimestamp());
		/* the deadline set at entry, or what was left when it parked */
		if (JsonGetField(run->step_state, "time_left_ms"))
			t->deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
													  JsonGetInt(run->step_state, "time_left_ms", 0));
		else
			t->deadline = (TimestampTz) JsonGetInt(run->step_state, "deadline", 0);

		/*
		 * entered without a limit (before tuvl.max_step_timeout): one from
		 * now
		 */
		if (t->deadline == 0 && timeout_ms > 0)
			t->deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), timeout_ms);
	}
	else
	{
		JournalAdd(&t->events, "agent_started", t->step->id, t->step->kind_name, payload_step(t->step));
		run->entry_seq = run->last_seq + list_length(t->events);
		run->working_effects = NULL;
		run->effects_added = NIL;
		run->working_judged = NULL;
		t->first_entry = true;
		t->entered = GetCurrentTimestamp();
		if (timeout_ms > 0)
			t->deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), timeout_ms);
		if (CompensationActive(run))
		{
			Jsonb	   *top = CompensationTop(run->compensation);

			JsonObjStart(&b);
			JsonObjAddString(&b, "step", top ? JsonGetString(top, "step") : NULL);
			JsonObjAddString(&b, "compensator", t->step->id);
			JournalAdd(&t->events, "compensation_started", top ? JsonGetString(top, "step") : NULL,
					   t->step->kind_name, JsonObjEnd(&b));
		}
	}
	t->ctx = CompensationActive(run) ? CompensationContext(run, run->context) : run->context;
	take_fresh_effect(t);
	t->effects = run->working_effects;
	t->judged = run->working_judged;
	INSTR_TIME_SET_CURRENT(t->start);
	return true;
}

/*
 * One attempt at the transition, in a subtransaction: prepare it and
 * execute the step (step_error NULL), or journal the failure the step
 * raised in the first attempt.  Returns NULL on success; on error the
 * subtransaction is rolled back and the error returned (flushed), with
 * *step_failed telling whether the step itself failed (its timeout
 * included) rather than the transition.  A cancel that came from outside
 * the step (the batch's time budget, an operator's abort) is not a step
 * failure: run->cancelled says which, and the caller decides.
 */
static ErrorData *
in_subtransaction(Transition *t, ErrorData *step_error, bool *step_failed)
{
	RunState   *run = t->run;
	SpiSubxact	sub;
	volatile bool in_step = false;
	ErrorData  *volatile edata = NULL;

	run->step_events = NIL;
	run->effect_call = 0;
	t->deadline_level = -1;
	t->timed_out = false;
	RateLimitBusy = false;
	SpiSubxactBegin(&sub);
	PG_TRY();
	{
		if (step_error == NULL)
		{
			if (!prepare_transition(t))
				t->stopped = true;
			else
			{
				StepResult	result;
				bool		parked;

				memset(&result, 0, sizeof(result));
				ExecutorErrorType = "error";
				in_step = true;
				/* a step over its rate_limit sleeps until its time comes */
				parked = RateLimitStep(run, t->step, t->ctx, t->first_entry, &result);
				if (!parked && t->deadline != 0)
				{
					Jsonb	   *fresh = run->fresh_effect;
					char	   *kind = fresh ? JsonGetString(fresh, "error_kind") : NULL;

					/*
					 * past the deadline, or the request it cut short came
					 * back
					 */
					if (GetCurrentTimestamp() >= t->deadline ||
						(kind && strcmp(kind, "timeout") == 0 &&
						 JsonGetBool(fresh, "step_deadline", false)))
						step_timed_out(t);
					t->deadline_level = DeadlinePush(DEADLINE_STEP, t->deadline);
				}
				if (!parked)
					ExecutorFor(t->step->kind)->execute(run, t->step, t->ctx, &result);
				if (result.has_output && result.output &&
					(int64) VARSIZE(result.output) > tuvl_max_output_size)
				{
					ExecutorErrorType = "too_large";
					GucsCheckSize("the step's output", VARSIZE(result.output),
								  tuvl_max_output_size, "tuvl.max_output_size");
				}
				in_step = false;
				finish_transition(t, &result, NULL);

				/*
				 * a step that parked or sent an effect: its deadline ends
				 * here
				 */
				step_deadline_end(t);
			}
		}
		else
			finish_transition(t, NULL, step_error);
		SpiSubxactCommit(&sub);
	}
	PG_CATCH();
	{
		DeadlineKind fired = DEADLINE_NONE;

		if (t->deadline_level >= 0)
			fired = DeadlinePop(t->deadline_level);
		t->deadline_level = -1;
		if (t->timed_out)
			fired = DEADLINE_STEP;

		edata = SpiSubxactAbort(&sub);
		/* what the step recorded is gone with its subtransaction */
		run->working_effects = t->effects;
		run->effects_added = NIL;
		run->working_judged = t->judged;
		run->step_events = NIL;
		run->effect_call = 0;
		run->tool_args = NULL;
		/* a rate limit's lock another session holds: postponed, not failed */
		if (RateLimitBusy)
		{
			RateLimitBusy = false;
			in_step = false;
		}
		if (edata->sqlerrcode == ERRCODE_QUERY_CANCELED)
		{
			if (fired == DEADLINE_STEP)
			{
				/* past its timeout: the step fails with type timeout */
				ExecutorErrorType = "timeout";
				edata->message = psprintf("the step's timeout of %s passed",
										  duration_text(step_timeout_ms(t->step)));
				edata->detail = NULL;
				in_step = true;
			}
			else if (DeadlineFiredOuter() == DEADLINE_BATCH)
			{
				run->cancelled = RUN_CANCEL_BATCH;
				in_step = false;
			}
			else if (TuvlAbortRequested(run->id))
			{
				run->cancelled = RUN_CANCEL_ABORT;
				in_step = false;
			}
		}
	}
	PG_END_TRY();
	*step_failed = edata != NULL && in_step;
	return edata;
}

/* The span id of the step's effect at position (or judge call judge). */
static char *
effect_span_id(RunState *run, const char *judge)
{
	return TraceSpanId(run, judge ? psprintf("effect:%d:%s", run->entry_seq, judge)
					   : psprintf("effect:%d:%d", run->entry_seq, EffectCount(run)));
}

/*
 * The span of a request whose result just came back: HTTP, MCP or a
 * model call, from its measured latency, a child of the step's span.  The
 * request carried its id in traceparent (finish_pending).
 */
static void
trace_effect(Transition *t, JournalEvent *ev, bool llm, const char *judge)
{
	RunState   *run = t->run;
	Jsonb	   *fresh = run->fresh_effect;
	Jsonb	   *pending = run->step_state ? JsonGetJsonb(run->step_state, "pending") : NULL;
	Jsonb	   *request = pending ? JsonGetJsonb(pending, "request") : NULL;
	char	   *method = request ? JsonGetString(request, "method") : NULL;
	int64		status = JsonGetInt(fresh, "status", 0);
	TimestampTz now = GetCurrentTimestamp();
	char	   *error = JsonGetString(fresh, "error");
	TraceSpan	s;

	TraceSpanStart(&s, run, llm ? psprintf("chat %s", JsonGetString(fresh, "model"))
				   : (method ? method : "HTTP"), SPAN_KIND_CLIENT,
				   effect_span_id(run, judge), TraceStepSpanId(run, run->entry_seq),
				   now - (TimestampTz) (Max(ev->latency_ms, 0) * 1000));
	TraceAttrString(&s, "tuvl.step.id", t->step->id);
	if (llm)
	{
		TraceAttrString(&s, "gen_ai.operation.name", "chat");
		TraceAttrString(&s, "gen_ai.system", JsonGetString(fresh, "provider"));
		TraceAttrString(&s, "gen_ai.request.model", JsonGetString(fresh, "model"));
		if (ev->payload && JsonGetJsonb(ev->payload, "tokens"))
		{
			TraceAttrInt(&s, "gen_ai.usage.input_tokens",
						 JsonGetInt(JsonGetJsonb(ev->payload, "tokens"), "prompt", 0));
			TraceAttrInt(&s, "gen_ai.usage.output_tokens",
						 JsonGetInt(JsonGetJsonb(ev->payload, "tokens"), "completion", 0));
		}
		if (judge)
			TraceAttrString(&s, "tuvl.judge", judge);
	}
	else
	{
		TraceAttrString(&s, "http.request.method", method);
		TraceAttrString(&s, "url.full", request ? JsonGetString(request, "url") : NULL);
		if (request && JsonGetString(request, "tool"))
			TraceAttrString(&s, "tuvl.mcp.tool", JsonGetString(request, "tool"));
	}
	if (status > 0)
		TraceAttrInt(&s, "http.response.status_code", status);
	if (error == NULL && status >= 400)
		error = psprintf("HTTP status %lld", (long long) status);
	if (error)
		TraceAttrString(&s, "error.type", JsonGetString(fresh, "error_kind")
						? JsonGetString(fresh, "error_kind") : psprintf("%lld", (long long) status));
	TraceSpanEnd(&s, now, error);
}

/*
 * What an llm_turn journals of request: what changed since the step's
 * previous request, or NULL to journal it whole.  The
 * first model call of a step's visit (position 0: the step has recorded
 * no effect yet) journals its request whole; later ones the change since
 * the one before, which the worker keeps in memory (after a claim in the
 * middle of a step, it reads it from the journal once).  The whole
 * request is staged as the next one's previous.
 */
static Jsonb *
llm_turn_delta(RunState *run, const char *step_id, int position, Jsonb *request)
{
	Jsonb	   *prev;

	if (request == NULL || !JsonIsObject(request))
		return NULL;
	if (position == 0)
		prev = NULL;
	else if (run->llm_prev_step && strcmp(run->llm_prev_step, step_id) == 0)
		prev = run->llm_prev_request;
	else
		prev = LlmRequestPrev(run->id, step_id);
	if (run->next_llm_prev_step)
		pfree(run->next_llm_prev_step);
	run->next_llm_prev_step = MemoryContextStrdup(run->cxt, step_id);
	RunKeepJsonb(run, &run->next_llm_prev_request, request);
	if (prev == NULL || !JsonIsObject(prev))
		return NULL;
	return LlmRequestDelta(prev, request);
}

/*
 * Journal the result of the effect the step was waiting for and make it
 * visible to the step (run->working_effects).
 */
static void
take_fresh_effect(Transition *t)
{
	RunState   *run = t->run;
	JsonObjBuilder b;
	JournalEvent *ev;
	JsonbValue *lat;

	Jsonb	   *kept = run->fresh_effect;
	char	   *op;
	char	   *judge;

	run->fresh_position = -1;
	run->fresh_event = NULL;
	run->fresh_judge = NULL;
	if (run->fresh_effect == NULL)
		return;
	run->took_effect = true;
	op = JsonGetString(run->fresh_effect, "op");
	judge = JsonGetString(run->fresh_effect, "judge");
	if (op && strcmp(op, "llm") == 0)
	{
		int			tokens = 0;
		Jsonb	   *request = JsonGetJsonb(run->fresh_effect, "request");
		Jsonb	   *payload;

		if (judge == NULL)
		{
			int			position = EffectCount(run);

			/* what is new since the step's previous turn */
			Jsonb	   *delta = llm_turn_delta(run, t->step->id, position, request);

			payload = LlmTurnPayloadAs(run->fresh_effect, &tokens, position,
									   delta ? "request_delta" : "request", delta ? delta : request);
		}
		else
			payload = LlmTurnPayloadAs(run->fresh_effect, &tokens, -1, "request", request);
		ev = JournalAdd(&t->events, "llm_turn", t->step->id, t->step->kind_name, payload);
		ev->tokens = tokens;
		count_tokens(t, payload);
		count_cost(t, payload);
		/* the request is in the journal; step_state keeps the answer */
		kept = LlmStripRequest(run->fresh_effect);
	}
	else
	{
		JsonObjStart(&b);
		JsonObjAddInt(&b, "position", EffectCount(run));
		JsonObjAddJsonb(&b, "result", run->fresh_effect);
		ev = JournalAdd(&t->events, "tool_result", t->step->id, t->step->kind_name, JsonObjEnd(&b));
	}
	lat = JsonGetField(run->fresh_effect, "latency_ms");
	if (lat && lat->type == jbvNumeric)
		ev->latency_ms = DatumGetFloat8(DirectFunctionCall1(numeric_float8,
															NumericGetDatum(lat->val.numeric)));
	if (TraceEnabled(run))
		trace_effect(t, ev, op && strcmp(op, "llm") == 0, judge);
	if (op && judge && strcmp(op, "llm") == 0)
	{
		/* a judge's answer is found by its id (judge.c), not its position */
		run->fresh_judge = pstrdup(judge);
		run->working_judged = JsonSetKey(run->working_judged ? run->working_judged
										 : JsonEmptyObject(), judge, kept);
		return;
	}
	run->fresh_position = EffectCount(run);
	run->fresh_event = ev;
	run->working_effects = JsonArrayAppend(EffectRecords(run), kept);
}

/*
 * Execute one transition of run: see the file header.  Uses one
 * subtransaction when the step succeeds, two when it fails (the step's
 * work is rolled back, then the failure is journaled).  Any error raised
 * from here left nothing behind in the caller's transaction.  The staged
 * result is in run->next_*; call RunApplyTransition after commit.
 */
void
RunAdvance(RunState *run)
{
	Transition	t;
	RunErrorContext ectx;
	ErrorContextCallback errcallback;
	ErrorData  *edata;
	bool		step_failed;

	memset(&t, 0, sizeof(t));
	t.run = run;
	/* what the last transition left there may be gone with its memory */
	if (run->next_llm_prev_step)
	{
		pfree(run->next_llm_prev_step);
		run->next_llm_prev_step = NULL;
	}
	RunKeepJsonb(run, &run->next_llm_prev_request, NULL);
	if (run->next_agent_resume)
		pfree(run->next_agent_resume);
	run->next_agent_resume = NULL;
	run->working_effects = NULL;
	run->effects_added = NIL;
	run->working_judged = NULL;
	run->fresh_judge = NULL;
	RunForgetSend(run);
	run->cancelled = RUN_CANCEL_NONE;
	run->took_effect = false;
	run->compensation_changed = false;
	if (run->next_compensation)
		pfree(run->next_compensation);
	run->next_compensation = NULL;

	ectx.run = run;
	ectx.step = NULL;
	ectx.t = &t;
	errcallback.callback = run_error_callback;
	errcallback.arg = &ectx;
	errcallback.previous = error_context_stack;
	error_context_stack = &errcallback;

	edata = in_subtransaction(&t, NULL, &step_failed);
	if (edata && step_failed)
		edata = in_subtransaction(&t, edata, &step_failed);
	error_context_stack = errcallback.previous;
	if (edata)
	{
		RunForgetSend(run);
		ReThrowError(edata);
	}
}

/*
 * Fail a run that cannot make a transition at all (its principal was
 * dropped, its workflow cannot be loaded...): journal run_failed and
 * release the lease, fenced like any transition.  Raises when the lease
 * was lost.  SPI must be connected.
 */
void
RunFail(RunState *run, const char *error)
{
	RunFailAs(run, error, NULL);
}

/*
 * RunFail, with the context's _last_error and _last_error_type set as a
 * failed step sets them (error_type NULL: the context as it is).
 */
void
RunFailAs(RunState *run, const char *error, const char *error_type)
{
	Checkpoint	cp;
	JsonObjBuilder b;

	memset(&cp, 0, sizeof(cp));
	JsonObjStart(&b);
	JsonObjAddNull(&b, "end");
	JsonObjAddString(&b, "status", StatusName(RUN_FAILED));
	JsonObjAddString(&b, "error", error);
	JournalAdd(&cp.events, "run_failed", NULL, NULL, JsonObjEnd(&b));
	if (run->step >= 0)
	{
		run->wf = WorkflowLoad(run->workflow, run->version);
		cp.step = run->wf->steps[run->step].id;
	}
	cp.status = RUN_FAILED;
	cp.context = run->context;
	if (error_type)
	{
		JsonObjStart(&b);
		JsonObjAddString(&b, "_last_error", error);
		JsonObjAddString(&b, "_last_error_type", error_type);
		cp.context = JsonMerge(cp.context, JsonObjEnd(&b));
	}
	cp.error = error;
	cp.step_state = run->step_state;
	CheckpointWrite(run, &cp);
}

/*
 * Read the run's operator directives again (an abort arrived while a
 * transition executed, which it rolled back).  SPI must be connected.
 */
void
RunRefreshControl(RunState *run)
{
	static const Oid types[2] = {INT8OID, INT4OID};
	Datum		values[2];
	SecurityFrame frame;
	bool		isnull;
	Datum		d;

	values[0] = Int64GetDatum(run->id);
	values[1] = Int32GetDatum(run->attempt);
	run->control_gen = TuvlControlGen();
	SecurityAsOwner(&frame);
	if (SpiExec("SELECT control FROM tuvl.runs "
				"WHERE id OPERATOR(pg_catalog.=) $1 AND attempt OPERATOR(pg_catalog.=) $2",
				2, types, values, NULL, SPI_OK_SELECT) == 1)
	{
		d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
		RunKeepJsonb(run, &run->control, isnull ? NULL : DatumGetJsonbP(d));
	}
	SecurityRestore(&frame);
}

/*
 * Replace *field, one of the run's own, with a copy of value (or NULL) in
 * the run's memory.
 */
void
RunKeepJsonb(RunState *run, Jsonb **field, Jsonb *value)
{
	Jsonb	   *copy = JsonCopyTo(value, run->cxt);

	if (*field)
		pfree(*field);
	*field = copy;
}

/*
 * The run's effect request was performed (or will never be): free it.
 */
void
RunForgetSend(RunState *run)
{
	if (run->send && run->send->admit)
		AdmissionDone(run->send->admit, -1, 0, 0);
	if (run->send_cxt)
		MemoryContextDelete(run->send_cxt);
	run->send_cxt = NULL;
	run->send = NULL;
}

/*
 * Make the staged transition current, once its transaction committed.
 */
void
RunApplyTransition(RunState *run)
{
	if (run->next_llm_prev_step)
	{
		if (run->llm_prev_step)
			pfree(run->llm_prev_step);
		if (run->llm_prev_request)
			pfree(run->llm_prev_request);
		run->llm_prev_step = run->next_llm_prev_step;
		run->llm_prev_request = run->next_llm_prev_request;
		run->next_llm_prev_step = NULL;
		run->next_llm_prev_request = NULL;
	}
	/* a transition that kept no agent_resume leaves the older one, still true */
	if (run->next_agent_resume || run->next_step_state == NULL)
	{
		if (run->agent_resume)
			pfree(run->agent_resume);
		run->agent_resume = run->next_agent_resume;
		run->next_agent_resume = NULL;
	}
	pfree(run->context);
	run->context = run->next_context;
	run->next_context = NULL;
	run->status = run->next_status;
	run->step = run->next_step;
	run->last_seq = run->next_seq;
	if (run->step_state)
		pfree(run->step_state);
	run->step_state = run->next_step_state;
	run->next_step_state = NULL;
	if (run->fresh_effect)
		pfree(run->fresh_effect);
	run->fresh_effect = NULL;
	if (run->control)
		pfree(run->control);
	run->control = run->next_control;
	run->control_gen = run->next_control_gen;
	run->next_control = NULL;
	if (run->compensation_changed)
	{
		if (run->compensation)
			pfree(run->compensation);
		run->compensation = run->next_compensation; /* in run->cxt */
		run->compensation_changed = false;
		run->next_compensation = NULL;
	}
}
