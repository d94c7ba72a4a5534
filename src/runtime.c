/*-------------------------------------------------------------------------
 *
 * runtime.c
 *	  A run as a state machine: one transition per step.
 *
 * RunAdvance executes the run's current step and everything that follows
 * from its signal, inside the caller's transaction: the step's own
 * database work, its journal events (agent_started, agent_completed,
 * signal, checkpoint, and run_started / run_completed / run_failed where
 * they apply) and the run's new checkpoint.  The checkpoint write is
 * fenced by the lease (id and attempt): a holder that lost its lease
 * touches no row and raises, so its whole transition rolls back.  The
 * caller owns the surrounding (sub)transaction and commits; only then
 * does RunApplyTransition make the staged state current.
 *
 * The step itself runs in a nested subtransaction so that its failure
 * becomes the "error" signal while the journal of that failure commits.
 * Must be called with SPI connected; allocates in CurrentMemoryContext
 * except for RunApplyTransition, which copies into the run's context.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "portability/instr_time.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/resowner.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "effect.h"
#include "deadline.h"
#include "executor.h"
#include "journal.h"
#include "llm.h"
#include "jsonutil.h"
#include "runtime.h"
#include "security.h"
#include "spiutil.h"
#include "template.h"
#include "tuvl.h"

typedef struct Transition Transition;

typedef struct RunErrorContext
{
	RunState   *run;
	const char *step;
	Transition *t;				/* the transition, whose step may be known */
} RunErrorContext;

bool
RunIsTerminalStatus(const char *status)
{
	return strcmp(status, "completed") == 0 || strcmp(status, "failed") == 0 ||
		strcmp(status, "aborted") == 0 || strcmp(status, "compensated") == 0;
}

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
	run->context = DatumGetJsonbPCopy(JsonbPGetDatum(context));
	run->last_seq = last_seq;
	run->step_state = step_state ? DatumGetJsonbPCopy(JsonbPGetDatum(step_state)) : NULL;
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
	MemoryContextDelete(run->cxt);
}

static const char *transition_step_id(Transition *t);

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

static const char fence_sql[] =
"UPDATE tuvl.runs SET status = $3, context = $4, current_step = $5, last_seq = $6, "
"  end_name = $7, response = $8, error = $9, step_state = $10, "
"  finished_at = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY ('{completed,failed,aborted,compensated}'::pg_catalog.text[]) "
"                     THEN pg_catalog.clock_timestamp() END, "
"  lease_expires_at = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY ('{running,compensating}'::pg_catalog.text[]) "
"                          THEN lease_expires_at END, "
"  lease_owner = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY ('{running,compensating}'::pg_catalog.text[]) "
"                     THEN lease_owner END, "
"  lease_epoch = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY ('{running,compensating}'::pg_catalog.text[]) "
"                     THEN lease_epoch END, "
"  compensation = CASE WHEN $14 THEN $15 ELSE compensation END, "
"  control = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY ('{completed,failed,aborted,compensated}'::pg_catalog.text[]) "
"                 THEN NULL "
"                 WHEN $11::pg_catalog.text[] IS NULL AND $12::pg_catalog.jsonb IS NULL "
"                      AND $13::pg_catalog.text[] IS NULL "
"                 THEN control ELSE tuvl._control_apply(control, $11, $12, $13) END "
"WHERE id OPERATOR(pg_catalog.=) $1 AND attempt OPERATOR(pg_catalog.=) $2 "
"  AND status OPERATOR(pg_catalog.=) ANY ($16::pg_catalog.text[]) "
"RETURNING control";

/*
 * Write the run's new checkpoint, fenced by the lease.  Raises when the
 * lease was lost, which rolls back the caller's (sub)transaction.
 */
static Datum
text_array(List *strings)
{
	Datum	   *items = palloc(sizeof(Datum) * list_length(strings));
	int			i = 0;
	ListCell   *lc;

	foreach(lc, strings)
		items[i++] = CStringGetTextDatum(lfirst(lc));
	return PointerGetDatum(construct_array(items, i, TEXTOID, -1, false, TYPALIGN_INT));
}

static void
write_checkpoint_control(RunState *run, const char *status, Jsonb *context,
						 const char *step, int last_seq, const char *end_name,
						 Jsonb *response, const char *error, Jsonb *step_state,
						 List *consume, Jsonb *control_add, List *steer_done)
{
	static const Oid types[16] = {INT8OID, INT4OID, TEXTOID, JSONBOID, TEXTOID,
		INT4OID, TEXTOID, JSONBOID, TEXTOID, JSONBOID, TEXTARRAYOID, JSONBOID, TEXTARRAYOID,
	BOOLOID, JSONBOID, TEXTARRAYOID};
	Datum		values[16];
	char		nulls[16] = {' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' '};
	static List *held_statuses = NIL;
	values[0] = Int64GetDatum(run->id);
	values[1] = Int32GetDatum(run->attempt);
	values[2] = CStringGetTextDatum(status);
	values[3] = JsonbPGetDatum(context);
	if (step)
		values[4] = CStringGetTextDatum(step);
	else
		nulls[4] = 'n';
	values[5] = Int32GetDatum(last_seq);
	if (end_name)
		values[6] = CStringGetTextDatum(end_name);
	else
		nulls[6] = 'n';
	if (response)
		values[7] = JsonbPGetDatum(response);
	else
		nulls[7] = 'n';
	if (error)
		values[8] = CStringGetTextDatum(error);
	else
		nulls[8] = 'n';
	if (step_state)
		values[9] = JsonbPGetDatum(step_state);
	else
		nulls[9] = 'n';
	if (consume)
		values[10] = text_array(consume);
	else
		nulls[10] = 'n';
	if (control_add)
		values[11] = JsonbPGetDatum(control_add);
	else
		nulls[11] = 'n';
	if (steer_done)
		values[12] = text_array(steer_done);
	else
		nulls[12] = 'n';

	/* a transition that changed the compensation record stages it first */
	values[13] = BoolGetDatum(run->compensation_changed);
	if (run->compensation_changed && run->next_compensation)
		values[14] = JsonbPGetDatum(run->next_compensation);
	else
		nulls[14] = 'n';

	/*
	 * The statuses a holder writes from, as a parameter: a constant would
	 * let a generic plan pick the partial index on them (runs_leased_idx)
	 * and filter every held run for this id.
	 */
	if (held_statuses == NIL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		held_statuses = list_make2(pstrdup("running"), pstrdup("compensating"));
		MemoryContextSwitchTo(old);
	}
	values[15] = text_array(held_statuses);

	if (SpiExec(fence_sql, 16, types, values, nulls, SPI_OK_UPDATE_RETURNING) != 1)
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("lease on run " INT64_FORMAT " was lost", run->id),
				 errdetail("Attempt %d no longer holds the run; another claimer took it over.",
						   run->attempt)));
	{
		bool		isnull;
		Datum		d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);

		run->next_control = NULL;
		if (!isnull)
		{
			Jsonb	   *j = DatumGetJsonbP(d);

			run->next_control = MemoryContextAlloc(run->cxt, VARSIZE(j));
			memcpy(run->next_control, j, VARSIZE(j));
		}
	}
}

static void
write_checkpoint(RunState *run, const char *status, Jsonb *context,
				 const char *step, int last_seq, const char *end_name,
				 Jsonb *response, const char *error, Jsonb *step_state)
{
	write_checkpoint_control(run, status, context, step, last_seq, end_name, response,
							 error, step_state, NIL, NULL, NIL);
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
	if (step->kind == STEP_ROUTER && strcmp(signal, "error") != 0 && step->routes &&
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

		MemoryContextSwitchTo(oldcxt);
		e = CopyErrorData();
		FlushErrorState();
		*error = psprintf("could not render the response of end \"%s\": %s",
						  end->id, e->message);
	}
	PG_END_TRY();
	return response;
}

/* ---------------------------------------------------------------- compensation
 *
 * tuvl.runs.compensation records every completed step that declares a
 * compensate step: {"stack": [{step, compensate, output_key, output,
 * input}], ...}, most recent last.  When the run would end with a
 * rollback end, an unhandled failure or an abort, and the stack is not
 * empty, it is compensating instead: "cause" records the end it would
 * have had, and each transition runs the compensator of the top entry
 * and pops it, so a crash never runs a finished compensator again.
 */


/* The compensation record as of this transition. */
static Jsonb *
comp_current(RunState *run)
{
	return run->compensation_changed ? run->next_compensation : run->compensation;
}

static bool
run_compensating(RunState *run)
{
	Jsonb	   *c = run->compensation;

	return c && JsonGetField(c, "cause") != NULL && !JsonGetBool(c, "done", false);
}

static Jsonb *
comp_stack(Jsonb *comp)
{
	return comp ? JsonGetJsonb(comp, "stack") : NULL;
}

static Jsonb *
comp_top(Jsonb *comp)
{
	Jsonb	   *stack = comp_stack(comp);
	int			n = JsonArraySize(stack);

	return n > 0 ? JsonValueToJsonb(getIthJsonbValueFromContainer(&stack->root, n - 1)) : NULL;
}


/* arr without its last element */
static Jsonb *
array_drop_last(Jsonb *arr)
{
	StringInfoData buf;
	int			n = JsonArraySize(arr);

	initStringInfo(&buf);
	appendStringInfoChar(&buf, '[');
	for (int i = 0; i < n - 1; i++)
	{
		Jsonb	   *e = JsonValueToJsonb(getIthJsonbValueFromContainer(&arr->root, i));

		if (i > 0)
			appendStringInfoString(&buf, ", ");
		appendStringInfoString(&buf, JsonbToCString(NULL, &e->root, VARSIZE(e)));
	}
	appendStringInfoChar(&buf, ']');
	return JsonFromCString(buf.data);
}

/* Stage comp for the checkpoint; it outlives the transaction, in run->cxt. */
static void
stage_compensation(RunState *run, Jsonb *comp)
{
	MemoryContext old = MemoryContextSwitchTo(run->cxt);

	if (run->next_compensation)
		pfree(run->next_compensation);
	run->next_compensation = comp ? DatumGetJsonbPCopy(JsonbPGetDatum(comp)) : NULL;
	run->compensation_changed = true;
	MemoryContextSwitchTo(old);
}

/*
 * Would ending now start compensation?  If so, record why (cause) and
 * return the first compensator's step id; else NULL.
 */
static const char *
begin_compensation(RunState *run, const char *status, const char *end_name,
				   Jsonb *response, const char *error)
{
	Jsonb	   *comp = comp_current(run);
	Jsonb	   *top = comp_top(comp);
	JsonObjBuilder b;

	if (top == NULL || run_compensating(run))
		return NULL;
	JsonObjStart(&b);
	JsonObjAddString(&b, "status", status);
	JsonObjAddString(&b, "end", end_name);
	JsonObjAddJsonb(&b, "response", response);
	JsonObjAddString(&b, "error", error);
	comp = JsonSetKey(comp, "cause", JsonObjEnd(&b));
	comp = JsonSetKey(comp, "failed", JsonFromCString("[]"));
	stage_compensation(run, comp);
	return JsonGetString(top, "compensate");
}

/* What a compensator sees under "compensation" in its context. */
static Jsonb *
compensation_context(RunState *run, Jsonb *context)
{
	Jsonb	   *top = comp_top(run->compensation);

	if (top == NULL)
		return context;
	return JsonSetKey(context, "compensation", JsonRemoveKey(top, "compensate"));
}

/* The status of a run that goes on: running, or compensating. */
static const char *
active_status(RunState *run)
{
	return run_compensating(run) ? "compensating" : "running";
}

/* What a transition knows before and after its step executed. */
struct Transition
{
	RunState   *run;
	WorkflowDef *wf;
	const StepDef *step;
	List	   *events;			/* journaled whatever the step does */
	instr_time	start;
	bool		first_entry;	/* agent_started is among events */
	Jsonb	   *ctx;			/* the context the step executes against */
	TimestampTz deadline;		/* when the step's time is up; 0: never */
	Jsonb	   *effects;		/* working_effects once the fresh effect is in */
	bool		stopped;		/* boundary control ended the transition */
};

/* The id of the transition's step, once it is known. */
static const char *
transition_step_id(Transition *t)
{
	return t->step ? t->step->id : NULL;
}

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
	JsonObjAddJsonb(&b, "effects", t->run->working_effects ? t->run->working_effects
					: JsonFromCString("[]"));
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
	SecurityFrame frame;

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

	SecurityAsOwner(&frame);
	run->next_seq = run->last_seq + JournalCount(events);
	write_checkpoint_control(run, active_status(run), run->context, t->step->id, run->next_seq,
							 NULL, NULL, NULL, state, NIL, NULL, result->steer_done);
	(void) JournalWrite(run->id, run->last_seq, events);
	SecurityRestore(&frame);

	{
		MemoryContext old = MemoryContextSwitchTo(run->cxt);

		run->next_context = DatumGetJsonbPCopy(JsonbPGetDatum(run->context));
		run->next_step_state = DatumGetJsonbPCopy(JsonbPGetDatum(state));
		MemoryContextSwitchTo(old);
	}
	run->send = EffectRequestCopy(effect, run->cxt);
	run->next_step = WorkflowFindStep(t->wf, t->step->id);	/* stays here */
	run->next_status = active_status(run);
	run->next_error = NULL;
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
	SecurityFrame frame;

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", t->step->id);
	JsonObjAddInt(&b, "entry_seq", run->entry_seq);
	/* waiting does not count against the step's time */
	if (t->deadline != 0)
		JsonObjAddInt(&b, "time_left_ms",
					  Max((t->deadline - GetCurrentTimestamp()) / 1000, 0));
	JsonObjAddJsonb(&b, "effects", run->working_effects ? run->working_effects
					: JsonFromCString("[]"));
	if (result->park_info)
		JsonObjAddJsonb(&b, "awaiting", result->park_info);
	state = JsonObjEnd(&b);

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", t->step->id);
	JsonObjAddString(&b, "status", result->park);
	if (result->park_info)
		JsonObjAddJsonb(&b, "awaiting", result->park_info);
	JournalAdd(&events, "checkpoint", t->step->id, t->step->kind_name, JsonObjEnd(&b));

	SecurityAsOwner(&frame);
	run->next_seq = run->last_seq + JournalCount(events);
	write_checkpoint_control(run, result->park, run->context, t->step->id, run->next_seq,
							 NULL, NULL, NULL, state, result->consume, result->control_add,
							 result->steer_done);
	(void) JournalWrite(run->id, run->last_seq, events);
	SecurityRestore(&frame);
	TuvlRunChangedAtCommit();

	{
		MemoryContext old = MemoryContextSwitchTo(run->cxt);

		run->next_context = DatumGetJsonbPCopy(JsonbPGetDatum(run->context));
		run->next_step_state = DatumGetJsonbPCopy(JsonbPGetDatum(state));
		MemoryContextSwitchTo(old);
	}
	run->next_step = WorkflowFindStep(t->wf, t->step->id);
	run->next_status = result->park;
	run->next_error = NULL;
}

/*
 * The transition of a compensator: journal how it went, pop its entry,
 * and go on with the next compensator or end the run: compensated, or
 * failed (compensation_failed) when any compensator failed.  Routes are
 * not followed.
 */
static void
finish_compensation(Transition *t, StepResult *result, ErrorData *edata)
{
	RunState   *run = t->run;
	const StepDef *step = t->step;
	List	   *events = list_copy(t->events);
	Jsonb	   *comp = run->compensation;
	Jsonb	   *top = comp_top(comp);
	Jsonb	   *context = run->context;
	Jsonb	   *cause = JsonGetJsonb(comp, "cause");
	Jsonb	   *failed = JsonGetJsonb(comp, "failed");
	const char *original = top ? JsonGetString(top, "step") : NULL;
	const char *signal = edata ? "error" : (result->signal ? result->signal : "default");
	/* a compensator fails by raising, or by ending on error (or another reserved exit) */
	char	   *failure = edata ? edata->message :
		(strcmp(signal, "error") == 0 || (step->kind == STEP_AGENT && AgentIsReservedExit(signal)))
		? (result->exit_error ? result->exit_error : psprintf("it ended with signal \"%s\"", signal))
		: NULL;
	const char *status;
	const char *next_step_id = NULL;
	const char *end_name = NULL;
	Jsonb	   *response = NULL;
	char	   *run_error = NULL;
	JsonObjBuilder b;
	SecurityFrame frame;

	if (result)
		events = list_concat(events, run->step_events);
	if (result && result->has_output)
		context = JsonSetKey(context, step->output_key, result->output);

	JsonObjStart(&b);
	JsonObjAddString(&b, "signal", signal);
	if (failure)
		JsonObjAddString(&b, "error", failure);
	else if (result->has_output)
	{
		JsonObjAddString(&b, "output_key", step->output_key);
		JsonObjAddJsonb(&b, "output", result->output);
	}
	JournalAdd(&events, "agent_completed", step->id, step->kind_name, JsonObjEnd(&b));

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", original);
	JsonObjAddString(&b, "compensator", step->id);
	JsonObjAddBool(&b, "ok", failure == NULL);
	if (failure)
		JsonObjAddString(&b, "error", failure);
	JournalAdd(&events, "compensation_completed", original, step->kind_name, JsonObjEnd(&b));

	if (failure)
	{
		JsonObjStart(&b);
		JsonObjAddString(&b, "step", original);
		JsonObjAddString(&b, "compensator", step->id);
		JsonObjAddString(&b, "error", failure);
		failed = JsonArrayAppend(failed, JsonObjEnd(&b));
	}
	comp = JsonSetKey(comp, "stack", array_drop_last(comp_stack(comp)));
	comp = JsonSetKey(comp, "failed", failed ? failed : JsonFromCString("[]"));
	top = comp_top(comp);
	if (top)
	{
		status = "compensating";
		next_step_id = JsonGetString(top, "compensate");
	}
	else
	{
		int			nfailed = JsonArraySize(failed);

		end_name = cause ? JsonGetString(cause, "end") : NULL;
		response = cause ? JsonGetJsonb(cause, "response") : NULL;
		if (response && JB_ROOT_IS_SCALAR(response) &&
			getIthJsonbValueFromContainer(&response->root, 0)->type == jbvNull)
			response = NULL;
		if (nfailed > 0)
		{
			StringInfoData why;

			initStringInfo(&why);
			for (int i = 0; i < nfailed; i++)
			{
				Jsonb	   *f = JsonValueToJsonb(getIthJsonbValueFromContainer(&failed->root, i));

				appendStringInfo(&why, "%scompensator \"%s\" of step \"%s\" failed: %s",
								 i > 0 ? "; " : "", JsonGetString(f, "compensator"),
								 JsonGetString(f, "step"), JsonGetString(f, "error"));
			}
			status = "failed";
			run_error = psprintf("compensation_failed: %s", why.data);
		}
		else
		{
			status = "compensated";
			run_error = cause ? JsonGetString(cause, "error") : NULL;
		}
		comp = JsonSetKey(comp, "done", JsonFromCString("true"));
	}
	stage_compensation(run, comp);

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", next_step_id);
	JsonObjAddString(&b, "status", status);
	JournalAdd(&events, "checkpoint", step->id, step->kind_name, JsonObjEnd(&b));
	if (strcmp(status, "compensating") != 0)
	{
		JsonObjStart(&b);
		JsonObjAddString(&b, "end", end_name);
		JsonObjAddString(&b, "status", status);
		JsonObjAddJsonb(&b, "response", response);
		if (run_error)
			JsonObjAddString(&b, "error", run_error);
		JournalAdd(&events, strcmp(status, "compensated") == 0 ? "run_completed" : "run_failed",
				   NULL, NULL, JsonObjEnd(&b));
	}

	SecurityAsOwner(&frame);
	run->next_seq = run->last_seq + JournalCount(events);
	write_checkpoint_control(run, status, context, next_step_id, run->next_seq,
							 end_name, response, run_error, NULL, NIL, NULL, NIL);
	(void) JournalWrite(run->id, run->last_seq, events);
	SecurityRestore(&frame);
	if (strcmp(status, "compensating") != 0)
		TuvlRunChangedAtCommit();

	{
		MemoryContext old = MemoryContextSwitchTo(run->cxt);

		run->next_context = DatumGetJsonbPCopy(JsonbPGetDatum(context));
		MemoryContextSwitchTo(old);
	}
	run->next_step_state = NULL;
	run->next_step = next_step_id ? WorkflowFindStep(t->wf, next_step_id) : -1;
	run->next_status = status;
	run->next_error = run_error ? MemoryContextStrdup(run->cxt, run_error) : NULL;
}

/*
 * Everything after the step: context update, journal, routing and the
 * fenced checkpoint.  result is NULL when the step failed with edata.
 * Runs in the transition's subtransaction.
 */
static void
finish_transition(Transition *t, StepResult *result, ErrorData *edata)
{
	RunState   *run = t->run;
	WorkflowDef *wf = t->wf;
	const StepDef *step = t->step;
	List	   *events;
	Jsonb	   *context = run->context;
	const char *signal;
	const char *target;
	bool		implicit_end;
	instr_time	duration;
	JournalEvent *ev;
	JsonObjBuilder b;
	const char *status = "running";
	const char *next_step_id = NULL;
	const char *end_name = NULL;
	Jsonb	   *response = NULL;
	char	   *run_error = NULL;
	SecurityFrame frame;

	if (result && result->pending)
	{
		finish_pending(t, result);
		return;
	}
	if (result && result->park)
	{
		finish_park(t, result);
		return;
	}
	if (run_compensating(run))
	{
		finish_compensation(t, result, edata);
		return;
	}
	events = list_copy(t->events);
	if (result)
		events = list_concat(events, run->step_events);

	/* a completed step that declares a compensator is remembered */
	if (result && JsonGetString(step->spec, "compensate"))
	{
		Jsonb	   *comp = comp_current(run);

		JsonObjStart(&b);
		JsonObjAddString(&b, "step", step->id);
		JsonObjAddString(&b, "compensate", JsonGetString(step->spec, "compensate"));
		JsonObjAddString(&b, "output_key", step->output_key);
		JsonObjAddJsonb(&b, "output", result->has_output ? result->output : NULL);
		JsonObjAddJsonb(&b, "input", run->context);
		comp = JsonSetKey(comp ? comp : JsonEmptyObject(), "stack",
						  JsonArrayAppend(comp_stack(comp), JsonObjEnd(&b)));
		stage_compensation(run, comp);
	}

	INSTR_TIME_SET_CURRENT(duration);
	INSTR_TIME_SUBTRACT(duration, t->start);
	if (result)
	{
		signal = result->signal ? result->signal : "default";
		if (result->context_merge)
			context = JsonMerge(context, result->context_merge);
		if (result->has_output)
			context = JsonSetKey(context, step->output_key, result->output);
	}
	else
	{
		JsonObjStart(&b);
		JsonObjAddString(&b, "_last_error", edata->message);
		JsonObjAddString(&b, "_last_error_type", StepErrorType);
		context = JsonMerge(context, JsonObjEnd(&b));
		signal = "error";
	}

	JsonObjStart(&b);
	JsonObjAddString(&b, "signal", signal);
	if (result && result->exit_error)
		JsonObjAddString(&b, "error", result->exit_error);
	if (edata)
	{
		char		sqlstate[6];

		memcpy(sqlstate, unpack_sql_state(edata->sqlerrcode), 6);
		JsonObjAddString(&b, "error", edata->message);
		JsonObjAddString(&b, "error_type", StepErrorType);
		JsonObjAddString(&b, "sqlstate", sqlstate);
		if (edata->detail)
			JsonObjAddString(&b, "detail", edata->detail);
	}
	else if (result->has_output)
	{
		JsonObjAddString(&b, "output_key", step->output_key);
		JsonObjAddJsonb(&b, "output", result->output);
	}
	ev = JournalAdd(&events, "agent_completed", step->id, step->kind_name, JsonObjEnd(&b));
	ev->latency_ms = INSTR_TIME_GET_MILLISEC(duration);

	JsonObjStart(&b);
	JsonObjAddString(&b, "signal", signal);
	JournalAdd(&events, "signal", step->id, step->kind_name, JsonObjEnd(&b));

	target = route_signal(wf, step, signal, &implicit_end);
	if (target && WorkflowFindStep(wf, target) >= 0)
		next_step_id = target;
	else if (target || implicit_end)
	{
		EndDef	   *end = target ? WorkflowFindEnd(wf, target) : NULL;

		end_name = end ? end->id : NULL;
		status = end ? end->status : "completed";
		if (end && end->response)
			response = render_response(end, context, &run_error);
		if (run_error)
			status = "failed";
		else if (strcmp(status, "failed") == 0)
			run_error = psprintf("the run reached end \"%s\", whose status is failed", end_name);
	}
	else if (strcmp(signal, "aborted") == 0 && step->kind == STEP_AGENT)
	{
		/* an abort is an out-of-band stop, not an authoring bug */
		status = "aborted";
		run_error = psprintf("warning: step \"%s\" was aborted and has no route for \"aborted\": %s",
							 step->id, result->exit_error ? result->exit_error : "aborted");
	}
	else if (strcmp(signal, "error") == 0)
	{
		status = "failed";
		if (edata)
			run_error = psprintf("step \"%s\" failed: %s", step->id, edata->message);
		else if (result->exit_error)
			run_error = psprintf("warning: step \"%s\" ended on its \"error\" exit, which has no route: %s",
								 step->id, result->exit_error);
		else
			run_error = psprintf("step \"%s\" produced signal \"error\", which has no route", step->id);
	}
	else if (step->kind == STEP_AGENT && AgentIsReservedExit(signal))
	{
		status = "failed";
		run_error = psprintf("step \"%s\" ended on the reserved exit \"%s\", which has no route: %s "
							 "(map %s in the step's routes to handle it)",
							 step->id, signal, result->exit_error ? result->exit_error : signal, signal);
	}
	else
	{
		status = "failed";
		run_error = psprintf("step \"%s\" produced signal \"%s\", which has no route",
							 step->id, signal);
	}

	/*
	 * A rollback end, an unhandled failure or an abort undoes the
	 * completed steps that declare a compensator.
	 */
	if (strcmp(status, "running") != 0 &&
		((end_name && WorkflowFindEnd(wf, end_name) && WorkflowFindEnd(wf, end_name)->rollback) ||
		 (end_name == NULL && (strcmp(status, "failed") == 0 || strcmp(status, "aborted") == 0))))
	{
		const char *first = begin_compensation(run, status, end_name, response, run_error);

		if (first)
		{
			if (strcmp(status, "aborted") == 0)
			{
				JsonObjStart(&b);
				JsonObjAddString(&b, "status", "compensating");
				JsonObjAddString(&b, "error", run_error);
				JournalAdd(&events, "run_aborted", NULL, NULL, JsonObjEnd(&b));
			}
			status = "compensating";
			next_step_id = first;
			end_name = NULL;
			response = NULL;
		}
	}

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", next_step_id);
	if (strcmp(status, "running") != 0 && strcmp(status, "compensating") != 0)
		JsonObjAddString(&b, "end", end_name);
	JsonObjAddString(&b, "status", status);
	JournalAdd(&events, "checkpoint", step->id, step->kind_name, JsonObjEnd(&b));

	if (strcmp(status, "running") != 0 && strcmp(status, "compensating") != 0)
	{
		JsonObjStart(&b);
		JsonObjAddString(&b, "end", end_name);
		JsonObjAddString(&b, "status", status);
		JsonObjAddJsonb(&b, "response", response);
		if (run_error)
			JsonObjAddString(&b, "error", run_error);
		JournalAdd(&events, strcmp(status, "completed") == 0 ? "run_completed" :
				   strcmp(status, "aborted") == 0 ? "run_aborted" : "run_failed",
				   NULL, NULL, JsonObjEnd(&b));
	}

	/* Internal writes run as the extension's owner. */
	SecurityAsOwner(&frame);

	/* the fenced update first: a holder that lost its lease stops here */
	run->next_seq = run->last_seq + JournalCount(events);
	write_checkpoint_control(run, status, context, next_step_id, run->next_seq,
							 end_name, response, run_error, NULL,
							 result ? result->consume : NIL, NULL,
							 result ? result->steer_done : NIL);
	(void) JournalWrite(run->id, run->last_seq, events);
	SecurityRestore(&frame);

	if (strcmp(status, "running") != 0 && strcmp(status, "compensating") != 0)
		TuvlRunChangedAtCommit();

	/* SPI's memory is gone at commit: keep the new context with the run */
	{
		MemoryContext old = MemoryContextSwitchTo(run->cxt);

		run->next_context = DatumGetJsonbPCopy(JsonbPGetDatum(context));
		MemoryContextSwitchTo(old);
	}
	run->next_step_state = NULL;
	run->next_step = next_step_id ? WorkflowFindStep(wf, next_step_id) : -1;
	run->next_status = status;
	run->next_error = run_error ? MemoryContextStrdup(run->cxt, run_error) : NULL;
}

static bool boundary_control(Transition *t);
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

/* The step's timeout in milliseconds; 0: none. */
static int
step_timeout_ms(const StepDef *step)
{
	return step->timeout_ms >= 0 ? step->timeout_ms : tuvl_step_timeout;
}

/* Raise the timeout failure of the step (ERRCODE_QUERY_CANCELED). */
static void
step_timed_out(Transition *t)
{
	StepErrorType = "timeout";
	ereport(ERROR,
			(errcode(ERRCODE_QUERY_CANCELED),
			 errmsg("the step's timeout of %s passed", duration_text(step_timeout_ms(t->step)))));
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
		cur = t->wf->start;
	}
	t->step = &t->wf->steps[cur];

	if (!SearchSysCacheExists1(AUTHOID, ObjectIdGetDatum(run->principal)))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("role \"%s\" that started the run does not exist", run->principal_name),
				 errdetail("Runs belong to the role, not to its name: a role created again under the name does not take them over.")));

	if (run->control && run->fresh_effect == NULL && !run_compensating(run) &&
		boundary_control(t))
		return false;

	/* entering the step, or continuing it after an effect? */
	timeout_ms = step_timeout_ms(t->step);
	state_step = run->step_state ? JsonGetString(run->step_state, "step") : NULL;
	if (state_step && strcmp(state_step, t->step->id) == 0)
	{
		run->entry_seq = (int) JsonGetInt(run->step_state, "entry_seq", 0);
		run->working_effects = JsonGetJsonb(run->step_state, "effects");
		/* the deadline set at entry, or what was left when it parked */
		if (JsonGetField(run->step_state, "time_left_ms"))
			t->deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
													  JsonGetInt(run->step_state, "time_left_ms", 0));
		else
			t->deadline = (TimestampTz) JsonGetInt(run->step_state, "deadline", 0);
	}
	else
	{
		JournalAdd(&t->events, "agent_started", t->step->id, t->step->kind_name, payload_step(t->step));
		run->entry_seq = run->last_seq + list_length(t->events);
		run->working_effects = NULL;
		t->first_entry = true;
		if (timeout_ms > 0)
			t->deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), timeout_ms);
		if (run_compensating(run))
		{
			Jsonb	   *top = comp_top(run->compensation);

			JsonObjStart(&b);
			JsonObjAddString(&b, "step", top ? JsonGetString(top, "step") : NULL);
			JsonObjAddString(&b, "compensator", t->step->id);
			JournalAdd(&t->events, "compensation_started", top ? JsonGetString(top, "step") : NULL,
					   t->step->kind_name, JsonObjEnd(&b));
		}
	}
	t->ctx = run_compensating(run) ? compensation_context(run, run->context) : run->context;
	take_fresh_effect(t);
	t->effects = run->working_effects;
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
	MemoryContext oldcxt = CurrentMemoryContext;
	ResourceOwner oldowner = CurrentResourceOwner;
	volatile bool in_step = false;
	volatile int level = -1;
	ErrorData  *volatile edata = NULL;

	run->step_events = NIL;
	run->effect_call = 0;
	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(oldcxt);
	PG_TRY();
	{
		if (step_error == NULL)
		{
			if (!prepare_transition(t))
				t->stopped = true;
			else
			{
				StepResult	result;

				memset(&result, 0, sizeof(result));
				StepErrorType = "error";
				in_step = true;
				if (t->deadline != 0)
				{
					Jsonb	   *fresh = run->fresh_effect;
					char	   *kind = fresh ? JsonGetString(fresh, "error_kind") : NULL;

					/* past the deadline, or the request it cut short came back */
					if (GetCurrentTimestamp() >= t->deadline ||
						(kind && strcmp(kind, "timeout") == 0 &&
						 JsonGetBool(fresh, "step_deadline", false)))
						step_timed_out(t);
					level = DeadlinePush(DEADLINE_STEP, t->deadline);
				}
				ExecutorFor(t->step->kind)->execute(run, t->step, t->ctx, &result);
				if (result.has_output && result.output &&
					(int64) VARSIZE(result.output) > tuvl_max_output_size)
				{
					StepErrorType = "too_large";
					TuvlCheckSize("the step's output", VARSIZE(result.output),
								  tuvl_max_output_size, "tuvl.max_output_size");
				}
				in_step = false;
				finish_transition(t, &result, NULL);
				if (level >= 0 && DeadlinePop(level) == DEADLINE_STEP)
					step_timed_out(t);
				level = -1;
			}
		}
		else
			finish_transition(t, NULL, step_error);
		ReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(oldcxt);
		CurrentResourceOwner = oldowner;
	}
	PG_CATCH();
	{
		DeadlineKind fired = level >= 0 ? DeadlinePop(level) : DEADLINE_NONE;

		MemoryContextSwitchTo(oldcxt);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(oldcxt);
		CurrentResourceOwner = oldowner;
		/* what the step recorded is gone with its subtransaction */
		run->working_effects = t->effects;
		run->step_events = NIL;
		run->effect_call = 0;
		run->tool_args = NULL;
		if (edata->sqlerrcode == ERRCODE_QUERY_CANCELED)
		{
			if (fired == DEADLINE_STEP)
			{
				/* past its timeout: the step fails with type timeout */
				StepErrorType = "timeout";
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

	run->fresh_position = -1;
	if (run->fresh_effect == NULL)
		return;
	run->fresh_position = EffectCount(run);
	op = JsonGetString(run->fresh_effect, "op");
	if (op && strcmp(op, "llm") == 0)
	{
		int			tokens = 0;
		Jsonb	   *payload = LlmTurnPayload(run->fresh_effect, &tokens);

		payload = JsonSetKey(payload, "position", JsonFromCString(psprintf("%d", EffectCount(run))));
		ev = JournalAdd(&t->events, "llm_turn", t->step->id, t->step->kind_name, payload);
		ev->tokens = tokens;
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

	run->working_effects = JsonArrayAppend(run->working_effects, kept);
}

/*
 * Operator directives that apply between steps (tuvl.runs.control, as
 * seen at the last checkpoint): abort ends the run, pause parks it and
 * releases the lease.  An agent in the middle of its loop applies them
 * itself at its next turn, where its aborted exit may be routed.
 * Returns true when the transition was such a stop.
 */
static bool
boundary_control(Transition *t)
{
	RunState   *run = t->run;
	Jsonb	   *abort = JsonGetJsonb(run->control, "abort");
	Jsonb	   *pause = JsonGetJsonb(run->control, "pause");
	char	   *state_step = run->step_state ? JsonGetString(run->step_state, "step") : NULL;
	List	   *events = list_copy(t->events);
	List	   *consume = NIL;
	const char *status;
	const char *next_step = NULL;
	char	   *error = NULL;
	Jsonb	   *kept_state;
	JsonObjBuilder b;
	SecurityFrame frame;

	if (abort == NULL && pause == NULL)
		return false;
	if (t->step->kind == STEP_AGENT && state_step && strcmp(state_step, t->step->id) == 0)
		return false;
	JsonObjStart(&b);
	JsonObjAddString(&b, "step", t->step->id);
	if (abort)
	{
		char	   *reason = JsonIsObject(abort) ? JsonGetString(abort, "reason") : NULL;
		char	   *by = JsonIsObject(abort) ? JsonGetString(abort, "by") : NULL;

		if (reason && *reason == '\0')
			reason = NULL;
		error = psprintf("aborted by %s%s%s", by ? by : "an operator", reason ? ": " : "",
						 reason ? reason : "");
		next_step = begin_compensation(run, "aborted", NULL, NULL, error);
		status = next_step ? "compensating" : "aborted";
		JsonObjAddString(&b, "reason", reason);
		JsonObjAddString(&b, "by", by);
		JsonObjAddString(&b, "status", status);
		JournalAdd(&events, "run_aborted", NULL, NULL, JsonObjEnd(&b));
		consume = list_make2("abort", "pause");
	}
	else
	{
		JsonObjAddString(&b, "by", JsonIsObject(pause) ? JsonGetString(pause, "by") : NULL);
		JournalAdd(&events, "paused", t->step->id, t->step->kind_name, JsonObjEnd(&b));
		status = "paused";
		consume = list_make1("pause");
	}

	SecurityAsOwner(&frame);
	if (next_step)
	{
		JsonObjStart(&b);
		JsonObjAddString(&b, "step", next_step);
		JsonObjAddString(&b, "status", status);
		JournalAdd(&events, "checkpoint", t->step->id, t->step->kind_name, JsonObjEnd(&b));
	}
	run->next_seq = run->last_seq + JournalCount(events);
	/* a paused step's clock stops: keep the time it had left */
	if (next_step == NULL && run->step_state && JsonGetField(run->step_state, "deadline"))
	{
		TimestampTz deadline = (TimestampTz) JsonGetInt(run->step_state, "deadline", 0);
		Jsonb	   *state = JsonRemoveKey(run->step_state, "deadline");

		state = JsonSetKey(state, "time_left_ms",
						   JsonFromCString(psprintf(INT64_FORMAT,
													Max((deadline - GetCurrentTimestamp()) / 1000, 0))));
		kept_state = state;
	}
	else
		kept_state = next_step ? NULL : run->step_state;
	write_checkpoint_control(run, status, run->context, next_step ? next_step : t->step->id,
							 run->next_seq, NULL, NULL, error, kept_state, consume, NULL, NIL);
	(void) JournalWrite(run->id, run->last_seq, events);
	SecurityRestore(&frame);
	TuvlRunChangedAtCommit();

	{
		MemoryContext old = MemoryContextSwitchTo(run->cxt);

		run->next_context = DatumGetJsonbPCopy(JsonbPGetDatum(run->context));
		run->next_step_state = kept_state ? DatumGetJsonbPCopy(JsonbPGetDatum(kept_state)) : NULL;
		MemoryContextSwitchTo(old);
	}
	run->next_step = WorkflowFindStep(t->wf, next_step ? next_step : t->step->id);
	run->next_status = status;
	run->next_error = error ? MemoryContextStrdup(run->cxt, error) : NULL;
	return true;
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
	run->working_effects = NULL;
	run->send = NULL;
	run->cancelled = RUN_CANCEL_NONE;
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
		run->send = NULL;
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
	List	   *events = NIL;
	JsonObjBuilder b;
	SecurityFrame frame;

	JsonObjStart(&b);
	JsonObjAddNull(&b, "end");
	JsonObjAddString(&b, "status", "failed");
	JsonObjAddString(&b, "error", error);
	JournalAdd(&events, "run_failed", NULL, NULL, JsonObjEnd(&b));

	SecurityAsOwner(&frame);
	write_checkpoint(run, "failed", run->context,
					 run->step >= 0 ? WorkflowLoad(run->workflow, run->version)->steps[run->step].id : NULL,
					 run->last_seq + 1, NULL, NULL, error, run->step_state);
	(void) JournalWrite(run->id, run->last_seq, events);
	SecurityRestore(&frame);
	TuvlRunChangedAtCommit();
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
	MemoryContext old;
	bool		isnull;
	Datum		d;

	values[0] = Int64GetDatum(run->id);
	values[1] = Int32GetDatum(run->attempt);
	SecurityAsOwner(&frame);
	if (SpiExec("SELECT control FROM tuvl.runs "
				"WHERE id OPERATOR(pg_catalog.=) $1 AND attempt OPERATOR(pg_catalog.=) $2",
				2, types, values, NULL, SPI_OK_SELECT) == 1)
	{
		d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
		old = MemoryContextSwitchTo(run->cxt);
		if (run->control)
			pfree(run->control);
		run->control = isnull ? NULL : DatumGetJsonbPCopy(d);
		MemoryContextSwitchTo(old);
	}
	SecurityRestore(&frame);
}

/*
 * Make the staged transition current, once its transaction committed.
 */
void
RunApplyTransition(RunState *run)
{
	pfree(run->context);
	run->context = run->next_context;
	run->next_context = NULL;
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
	run->next_control = NULL;
	if (run->compensation_changed)
	{
		if (run->compensation)
			pfree(run->compensation);
		run->compensation = run->next_compensation;	/* in run->cxt */
		run->compensation_changed = false;
		run->next_compensation = NULL;
	}
}
