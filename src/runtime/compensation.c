/*-------------------------------------------------------------------------
 *
 * compensation.c
 *	  Undoing a run: the compensation record and the compensators'
 *	  transitions.
 *
 * tuvl.runs.compensation records every completed step that declares a
 * compensate step: {"stack": [{step, compensate, output_key, output,
 * input}], ...}, most recent last.  When the run would end with a
 * rollback end, an unhandled failure or an abort, and the stack is not
 * empty, it is compensating instead: "cause" records the end it would
 * have had, and each transition runs the compensator of the top entry
 * and pops it, so a crash never runs a finished compensator again.
 *
 * A Workflow step is remembered too, with the child runs it started
 * ("runs"), as its own compensator: compensating it reopens each child
 * that completed with steps to compensate (step_workflow.c), and waits
 * until they are compensated.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/memutils.h"

#include "effect.h"
#include "executor.h"
#include "journal.h"
#include "jsonutil.h"
#include "transition.h"

/* The compensation record as of this transition. */
static Jsonb *
comp_current(RunState *run)
{
	return run->compensation_changed ? run->next_compensation : run->compensation;
}

/* Is the run compensating (as of its last checkpoint)? */
bool
CompensationActive(RunState *run)
{
	Jsonb	   *c = run->compensation;

	return c && JsonGetField(c, "cause") != NULL && !JsonGetBool(c, "done", false);
}

static Jsonb *
comp_stack(Jsonb *comp)
{
	return comp ? JsonGetJsonb(comp, "stack") : NULL;
}

/* The entry to compensate next, or NULL. */
Jsonb *
CompensationTop(Jsonb *comp)
{
	Jsonb	   *stack = comp_stack(comp);
	int			n = JsonArraySize(stack);

	return n > 0 ? JsonArrayAt(stack, n - 1) : NULL;
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
 * A completed step that declares a compensator is remembered; so is a
 * Workflow step, whose children compensate.
 */
void
CompensationRemember(RunState *run, const StepDef *step, StepResult *result)
{
	Jsonb	   *comp = comp_current(run);
	JsonObjBuilder b;
	Jsonb	   *rec = step->kind == STEP_WORKFLOW ? EffectFindOp(run, "children") : NULL;
	Jsonb	   *children = rec ? JsonGetJsonb(rec, "runs") : NULL;

	if (JsonGetString(step->spec, "compensate") == NULL && children == NULL)
		return;
	JsonObjStart(&b);
	JsonObjAddString(&b, "step", step->id);
	/* a Workflow step's compensator is itself: its children compensate */
	JsonObjAddString(&b, "compensate", children ? step->id : JsonGetString(step->spec, "compensate"));
	if (children)
		JsonObjAddJsonb(&b, "runs", children);
	JsonObjAddString(&b, "output_key", step->output_key);
	JsonObjAddJsonb(&b, "output", result->has_output ? result->output : NULL);
	JsonObjAddJsonb(&b, "input", run->context);
	comp = JsonSetKey(comp ? comp : JsonEmptyObject(), "stack",
					  JsonArrayAppend(comp_stack(comp), JsonObjEnd(&b)));
	stage_compensation(run, comp);
}

/*
 * Would ending now with status start compensation?  If so, record why
 * (cause) and return the first compensator's step id; else NULL.
 */
const char *
CompensationBegin(RunState *run, RunStatus status, const char *end_name,
				  Jsonb *response, const char *error)
{
	Jsonb	   *comp = comp_current(run);
	Jsonb	   *top = CompensationTop(comp);
	JsonObjBuilder b;

	if (top == NULL || CompensationActive(run))
		return NULL;
	JsonObjStart(&b);
	JsonObjAddString(&b, "status", StatusName(status));
	JsonObjAddString(&b, "end", end_name);
	JsonObjAddJsonb(&b, "response", response);
	JsonObjAddString(&b, "error", error);
	comp = JsonSetKey(comp, "cause", JsonObjEnd(&b));
	comp = JsonSetKey(comp, "failed", JsonFromCString("[]"));
	stage_compensation(run, comp);
	return JsonGetString(top, "compensate");
}

/* What a compensator sees under "compensation" in its context. */
Jsonb *
CompensationContext(RunState *run, Jsonb *context)
{
	Jsonb	   *top = CompensationTop(run->compensation);

	if (top == NULL)
		return context;
	return JsonSetKey(context, "compensation", JsonRemoveKey(top, "compensate"));
}

/*
 * Why the compensator failed, or NULL: it raised, or ended on error (or
 * another reserved exit of its kind).
 */
static char *
compensator_failure(const StepDef *step, StepResult *result, ErrorData *edata,
					const char *signal)
{
	if (edata)
		return edata->message;
	if (strcmp(signal, "error") != 0 && !ExecutorIsReservedExit(step, signal))
		return NULL;
	return result->exit_error ? result->exit_error
		: psprintf("it ended with signal \"%s\"", signal);
}

/* "compensator "x" of step "y" failed: ...; ..." for every failure. */
static char *
failures_text(Jsonb *failed)
{
	StringInfoData why;
	int			n = JsonArraySize(failed);

	initStringInfo(&why);
	for (int i = 0; i < n; i++)
	{
		Jsonb	   *f = JsonArrayAt(failed, i);

		appendStringInfo(&why, "%scompensator \"%s\" of step \"%s\" failed: %s",
						 i > 0 ? "; " : "", JsonGetString(f, "compensator"),
						 JsonGetString(f, "step"), JsonGetString(f, "error"));
	}
	return why.data;
}

/*
 * The compensation is done: the run ends with the cause's end and
 * response, compensated, or failed when any compensator failed.
 */
static void
compensation_end(Checkpoint *cp, Jsonb *comp)
{
	Jsonb	   *cause = JsonGetJsonb(comp, "cause");
	Jsonb	   *failed = JsonGetJsonb(comp, "failed");
	Jsonb	   *response = cause ? JsonGetJsonb(cause, "response") : NULL;

	cp->end_name = cause ? JsonGetString(cause, "end") : NULL;
	if (response && JB_ROOT_IS_SCALAR(response) &&
		getIthJsonbValueFromContainer(&response->root, 0)->type == jbvNull)
		response = NULL;
	cp->response = response;
	if (JsonArraySize(failed) > 0)
	{
		cp->status = RUN_FAILED;
		cp->error = psprintf("compensation_failed: %s", failures_text(failed));
	}
	else
	{
		cp->status = RUN_COMPENSATED;
		cp->error = cause ? JsonGetString(cause, "error") : NULL;
	}
}

/*
 * The transition of a compensator: journal how it went, pop its entry,
 * and go on with the next compensator or end the run.  Routes are not
 * followed.  result is NULL when the compensator raised edata.
 */
void
CompensationFinish(Transition *t, StepResult *result, ErrorData *edata)
{
	RunState   *run = t->run;
	const StepDef *step = t->step;
	Jsonb	   *comp = run->compensation;
	Jsonb	   *top = CompensationTop(comp);
	Jsonb	   *failed = JsonGetJsonb(comp, "failed");
	const char *original = top ? JsonGetString(top, "step") : NULL;
	const char *signal = edata ? "error" : (result->signal ? result->signal : "default");
	char	   *failure = compensator_failure(step, result, edata, signal);
	Checkpoint	cp;
	JsonObjBuilder b;

	memset(&cp, 0, sizeof(cp));
	cp.events = list_copy(t->events);
	cp.context = run->context;
	if (result)
		cp.events = list_concat(cp.events, run->step_events);
	if (result && result->has_output)
		cp.context = JsonSetKey(cp.context, step->output_key, result->output);

	JsonObjStart(&b);
	JsonObjAddString(&b, "signal", signal);
	if (failure)
		JsonObjAddString(&b, "error", failure);
	else if (result->has_output)
	{
		JsonObjAddString(&b, "output_key", step->output_key);
		JsonObjAddJsonb(&b, "output", result->output);
	}
	JournalAdd(&cp.events, "agent_completed", step->id, step->kind_name, JsonObjEnd(&b));

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", original);
	JsonObjAddString(&b, "compensator", step->id);
	JsonObjAddBool(&b, "ok", failure == NULL);
	if (failure)
		JsonObjAddString(&b, "error", failure);
	JournalAdd(&cp.events, "compensation_completed", original, step->kind_name, JsonObjEnd(&b));

	if (failure)
	{
		JsonObjStart(&b);
		JsonObjAddString(&b, "step", original);
		JsonObjAddString(&b, "compensator", step->id);
		JsonObjAddString(&b, "error", failure);
		failed = JsonArrayAppend(failed, JsonObjEnd(&b));
	}
	/* pop the entry just compensated */
	if (comp_stack(comp))
		comp = JsonSetKey(comp, "stack",
						  DatumGetJsonbP(DirectFunctionCall2(jsonb_delete_idx,
															 JsonbPGetDatum(comp_stack(comp)),
															 Int32GetDatum(-1))));
	comp = JsonSetKey(comp, "failed", failed ? failed : JsonFromCString("[]"));
	top = CompensationTop(comp);
	if (top)
	{
		cp.status = RUN_COMPENSATING;
		cp.step = JsonGetString(top, "compensate");
	}
	else
	{
		compensation_end(&cp, comp);
		comp = JsonSetKey(comp, "done", JsonFromCString("true"));
	}
	stage_compensation(run, comp);

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", cp.step);
	JsonObjAddString(&b, "status", StatusName(cp.status));
	JournalAdd(&cp.events, "checkpoint", step->id, step->kind_name, JsonObjEnd(&b));
	if (cp.status != RUN_COMPENSATING)
	{
		JsonObjStart(&b);
		JsonObjAddString(&b, "end", cp.end_name);
		JsonObjAddString(&b, "status", StatusName(cp.status));
		JsonObjAddJsonb(&b, "response", cp.response);
		if (cp.error)
			JsonObjAddString(&b, "error", cp.error);
		JournalAdd(&cp.events, cp.status == RUN_COMPENSATED ? "run_completed" : "run_failed",
				   NULL, NULL, JsonObjEnd(&b));
	}
	CheckpointWrite(run, &cp);
}
