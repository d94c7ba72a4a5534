/*-------------------------------------------------------------------------
 *
 * step_workflow.c
 *	  The Workflow step: child runs, one or one per item (for_each), and
 *	  the parent waiting for them without a worker.
 *
 * The step's first execution starts the children in its own transition,
 * as the run's principal, with its priority: each is a run of the named
 * workflow whose input is the step's input rendered (with {{ item }} and
 * {{ index }} for an item of for_each).  Children past max_parallel are
 * held (held_by = 'max_parallel').  Their ids are recorded in the step's
 * effects and journaled (children_started), and the parent parks as
 * waiting_children, in the same commit as the children: a crash either
 * keeps both or neither.
 *
 * A child's end reaches the parent through the trigger tuvl._run_ended()
 * (below), in the transaction that ended the child: the next held
 * sibling is let go, and the parent is queued again when no child is
 * left, or at once when one did not complete.  The step, executed again,
 * reads its children: all completed gives their responses as the output
 * (a list in item order for for_each); a child that failed, was aborted
 * or compensated gives the error signal, and the children still open are
 * aborted.  Locks go from parent to child everywhere (the step locks its
 * own row before reading its children, a child's last checkpoint locks
 * its parent first), so a child ending while the parent looks is never
 * missed and nobody waits in a circle.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/rel.h"

#include "run_create.h"
#include "concurrency.h"
#include "run_control.h"
#include "timers.h"
#include "effect.h"
#include "executor.h"
#include "journal.h"
#include "jsonutil.h"
#include "queue.h"
#include "security.h"
#include "spiutil.h"
#include "template.h"
#include "transition.h"
#include "tuvl.h"
#include "uses.h"

PG_FUNCTION_INFO_V1(tuvl_run_ended);

/* At most this many children per step execution. */
#define MAX_CHILDREN 10000

/* Lock the run's own row; returns its priority. */
static int32
lock_self(RunState *run)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1];
	bool		isnull;

	values[0] = Int64GetDatum(run->id);
	if (SecurityExec("SELECT priority FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1 FOR UPDATE",
					 1, types, values, NULL, SPI_OK_SELECT) != 1)
		elog(ERROR, "run " INT64_FORMAT " vanished", run->id);
	return DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
}

/* The items of for_each, rendered: a JSON array. */
static Jsonb *
render_items(const StepDef *step, Jsonb *ctx)
{
	Jsonb	   *items;

	ExecutorErrorType = "template_error";
	items = TemplateRenderJsonb(JsonStringValue(JsonGetString(step->spec, "for_each")), ctx, NULL);
	ExecutorErrorType = "error";
	if (!JB_ROOT_IS_ARRAY(items) || JB_ROOT_IS_SCALAR(items))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("Workflow step \"%s\": for_each must render to a list, not %s",
						step->id, JsonClipText(JsonText(items), 200)),
				 errhint("Write for_each: \"{{ key }}\" naming a list in the context.")));
	if (JsonArraySize(items) > MAX_CHILDREN)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("Workflow step \"%s\": for_each has %d items, more than the %d children a step may start",
						step->id, JsonArraySize(items), MAX_CHILDREN),
				 errhint("Split the list, or start the runs with tuvl.start_run().")));
	return items;
}

/* The input of child i: the step's input rendered, with item and index. */
static Jsonb *
child_input(const StepDef *step, Jsonb *ctx, Jsonb *item, int i)
{
	Jsonb	   *tmpl = JsonGetJsonb(step->spec, "input");
	Jsonb	   *c = ctx;
	Jsonb	   *input;

	if (tmpl == NULL)
		return JsonEmptyObject();
	if (item)
	{
		c = JsonSetKey(c, "item", item);
		c = JsonSetKey(c, "index", JsonFromCString(psprintf("%d", i)));
	}
	ExecutorErrorType = "template_error";
	input = TemplateRenderJsonb(tmpl, c, NULL);
	ExecutorErrorType = "error";
	return input;
}

/*
 * May the run's workflow start the child workflow the step names: is the
 * version it would start the work of the role pinned at registration, and
 * its use allowed (uses.c)?  A workflow that starts itself needs no pin.
 */
static void
check_child_use(RunState *run, const StepDef *step)
{
	char	   *child = JsonGetString(step->spec, "workflow");
	int			version = (int) JsonGetInt(step->spec, "version", 0);
	UseReferrer by;
	Oid			owner;

	if (strcmp(child, run->wf->name) == 0)
		return;
	owner = UseContentOwner(USE_WORKFLOW, child, version);
	if (!OidIsValid(owner))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("workflow \"%s\"%s does not exist", child,
						version > 0 ? psprintf(" version %d", version) : "")));
	WorkflowReferrer(run->wf, &by);
	UseCheck(&by, USE_WORKFLOW, child, 0, owner);
}

/*
 * The run's place in its tree of Workflow steps: how many Workflow steps
 * led to it (0 for a run nobody's step started), and the run at the top,
 * found by following parent_run_id up while parent_step is set (a notify
 * hook's run is a root).  The walk stops past tuvl.max_child_depth.
 */
static int
tree_position(RunState *run, int64 *root)
{
	static const Oid types[2] = {INT8OID, INT4OID};
	bool		isnull;

	if (SecurityExecArgs("WITH RECURSIVE up (id, parent, step, depth) AS ("
						 "  SELECT r.id, r.parent_run_id, r.parent_step, 0 FROM tuvl.runs r "
						 "  WHERE r.id OPERATOR(pg_catalog.=) $1 "
						 "  UNION ALL "
						 "  SELECT p.id, p.parent_run_id, p.parent_step, u.depth OPERATOR(pg_catalog.+) 1 "
						 "  FROM up u JOIN tuvl.runs p ON p.id OPERATOR(pg_catalog.=) u.parent "
						 "  WHERE u.step IS NOT NULL AND u.depth OPERATOR(pg_catalog.<=) $2) "
						 "SELECT u.depth, u.id FROM up u ORDER BY u.depth DESC LIMIT 1",
						 SPI_OK_SELECT, 2, types, Int64GetDatum(run->id), Int32GetDatum(tuvl_max_child_depth)) != 1)
		elog(ERROR, "run " INT64_FORMAT " vanished", run->id);
	*root = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
	return DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
}

/*
 * Refuse to start n children beyond tuvl.max_child_depth or
 * tuvl.max_run_tree, before any of them exists: the step fails with
 * _last_error_type child_limit (and takes its error route).  Returns the
 * root of the run's tree, which the children record.  The runs under a
 * root are counted as this transaction sees them: children other
 * transactions start at the same moment may pass the limit by what they
 * start.
 */
static int64
check_child_limits(RunState *run, const StepDef *step, int n)
{
	static const Oid types[2] = {INT8OID, INT4OID};
	int64		root;
	int			depth = tree_position(run, &root);
	int64		under = 0;
	Datum		d;

	ExecutorErrorType = "child_limit";
	if (depth + 1 > tuvl_max_child_depth)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("Workflow step \"%s\" would start a child run %d levels below run " INT64_FORMAT ", more than tuvl.max_child_depth (%d)",
						step->id, depth + 1, root, tuvl_max_child_depth),
				 errdetail("Run " INT64_FORMAT " was started by a chain of %d Workflow steps.", run->id, depth),
				 errhint("Stop the recursion with a Router before the Workflow step; a superuser can raise tuvl.max_child_depth.")));
	if (SecurityExecArgs("SELECT pg_catalog.count(*) FROM (SELECT 1 FROM tuvl.runs "
						 "  WHERE root_run_id OPERATOR(pg_catalog.=) $1 LIMIT $2) s",
						 SPI_OK_SELECT, 2, types, Int64GetDatum(root),
						 Int32GetDatum(tuvl_max_run_tree)) == 1 && SpiValue(1, &d))
		under = DatumGetInt64(d);
	if (under + n > tuvl_max_run_tree)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("Workflow step \"%s\" would start %d child runs under run " INT64_FORMAT ", which has " INT64_FORMAT " already, more than tuvl.max_run_tree (%d)",
						step->id, n, root, under, tuvl_max_run_tree),
				 errdetail("tuvl.max_run_tree bounds the runs that Workflow steps start under one run, at every depth."),
				 errhint("Split the work over runs started with tuvl.start_run(); a superuser can raise tuvl.max_run_tree.")));
	ExecutorErrorType = "error";
	return root;
}

/* Start the children (as the run's principal); returns their ids as a JSON array. */
static Jsonb *
start_children(RunState *run, const StepDef *step, Jsonb *ctx, int32 priority)
{
	bool		fan_out = JsonGetField(step->spec, "for_each") != NULL;
	Jsonb	   *items = fan_out ? render_items(step, ctx) : NULL;
	int			n = fan_out ? JsonArraySize(items) : 1;
	int			max_parallel = (int) JsonGetInt(step->spec, "max_parallel", 0);
	int64		root = check_child_limits(run, step, n);
	StringInfoData ids;
	SecurityFrame frame;

	check_child_use(run, step);
	initStringInfo(&ids);
	appendStringInfoChar(&ids, '[');
	SecurityAsPrincipal(&frame, run->principal);
	for (int i = 0; i < n; i++)
	{
		RunStart	start;

		memset(&start, 0, sizeof(start));
		start.workflow = JsonGetString(step->spec, "workflow");
		start.input = child_input(step, ctx, fan_out ? JsonArrayAt(items, i) : NULL, i);
		start.version = (int) JsonGetInt(step->spec, "version", 0);
		start.priority = priority;
		start.parent_id = run->id;
		start.parent_step = step->id;
		start.root_id = root;
		start.held = max_parallel > 0 && i >= max_parallel;
		appendStringInfo(&ids, "%s" INT64_FORMAT, i ? "," : "", RunCreate(&start, false, NULL));
	}
	SecurityRestore(&frame);
	appendStringInfoChar(&ids, ']');
	TuvlWakeWorkersAtCommit();
	return JsonFromCString(ids.data);
}

/* ids (a JSON array of run ids) as an int8[] Datum. */
static Datum
id_array(Jsonb *ids)
{
	int			n = JsonArraySize(ids);
	Datum	   *d = palloc(sizeof(Datum) * Max(n, 1));

	for (int i = 0; i < n; i++)
		d[i] = Int64GetDatum(pg_strtoint64(JsonText(JsonArrayAt(ids, i))));
	return PointerGetDatum(construct_array(d, n, INT8OID, 8, FLOAT8PASSBYVAL, TYPALIGN_DOUBLE));
}

/* What the children came to. */
typedef struct ChildrenState
{
	int			open;			/* not ended yet */
	int			failed;			/* index of the first that did not complete,
								 * or -1 */
	char	   *failure;		/* ... what became of it */
	Jsonb	   *responses;		/* their responses, in order */
} ChildrenState;

static void
read_children(Jsonb *ids, ChildrenState *cs)
{
	static const Oid types[1] = {INT8ARRAYOID};
	Datum		values[1];
	uint64		n;
	StringInfoData resp;

	values[0] = id_array(ids);
	n = SecurityExec("SELECT c.id, c.status, c.response, c.error, c.workflow, c.finished_at IS NULL "
					 "FROM pg_catalog.unnest($1::pg_catalog.int8[]) WITH ORDINALITY AS i(id, n) "
					 "JOIN tuvl.runs c ON c.id OPERATOR(pg_catalog.=) i.id ORDER BY i.n",
					 1, types, values, NULL, SPI_OK_SELECT);
	if ((int) n != JsonArraySize(ids))
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("%d of the step's %d child runs are gone", JsonArraySize(ids) - (int) n,
						JsonArraySize(ids)),
				 errhint("Child runs must not be deleted while their parent waits for them.")));
	memset(cs, 0, sizeof(*cs));
	cs->failed = -1;
	initStringInfo(&resp);
	appendStringInfoChar(&resp, '[');
	for (uint64 i = 0; i < n; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	td = SPI_tuptable->tupdesc;
		char	   *status = SPI_getvalue(tup, td, 2);
		char	   *response = SPI_getvalue(tup, td, 3);

		if (strcmp(SPI_getvalue(tup, td, 6), "t") == 0)
			cs->open++;
		else if (strcmp(status, "completed") != 0 && cs->failed < 0)
		{
			char	   *error = SPI_getvalue(tup, td, 4);

			cs->failed = (int) i;
			cs->failure = psprintf("child run %s (workflow %s) ended %s%s%s", SPI_getvalue(tup, td, 1),
								   SPI_getvalue(tup, td, 5), status, error ? ": " : "",
								   error ? error : "");
		}
		appendStringInfo(&resp, "%s%s", i ? ", " : "", response ? response : "null");
	}
	appendStringInfoChar(&resp, ']');
	cs->responses = JsonFromCString(resp.data);
}

/* children_started or children_ended, for the journal. */
static void
journal_children(RunState *run, const StepDef *step, const char *type, Jsonb *ids,
				 Jsonb *output, const char *error)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "workflow", JsonGetString(step->spec, "workflow"));
	JsonObjAddInt(&b, "count", JsonArraySize(ids));
	JsonObjAddJsonb(&b, "runs", ids);
	if (output)
		JsonObjAddJsonb(&b, "output", output);
	if (error)
		JsonObjAddString(&b, "error", error);
	JournalAdd(&run->step_events, type, step->id, step->kind_name, JsonObjEnd(&b));
}

/* Park until the children have ended. */
static void
park(const StepDef *step, Jsonb *ids, StepResult *result)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "kind", "children");
	JsonObjAddString(&b, "workflow", JsonGetString(step->spec, "workflow"));
	JsonObjAddInt(&b, "count", JsonArraySize(ids));
	result->park = RUN_WAITING_CHILDREN;
	result->park_info = JsonObjEnd(&b);
	result->has_output = false;
}

/* The error signal, with what became of the child. */
static void
child_failed(StepResult *result, const char *failure)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "_last_error", failure);
	JsonObjAddString(&b, "_last_error_type", "child_failed");
	result->context_merge = JsonObjEnd(&b);
	result->signal = "error";
	result->exit_error = pstrdup(failure);
	result->has_output = false;
}

/* A replay serves what the children came to from the recording. */
static void
replay_children(RunState *run, const StepDef *step, StepResult *result)
{
	Jsonb	   *rec = ExecutorReplayChildren(run, step->id);
	char	   *error = JsonGetString(rec, "error");

	if (error)
		child_failed(result, error);
	else
	{
		result->has_output = true;
		result->output = JsonGetJsonb(rec, "output");
	}
}

/* The runs of the step's effect op (the ids it recorded), or NULL. */
static Jsonb *
recorded_runs(RunState *run, const char *op)
{
	Jsonb	   *rec = EffectFindOp(run, op);

	return rec ? JsonGetJsonb(rec, "runs") : NULL;
}

/*
 * Reopen for compensation the children of ids that completed and have
 * completed steps to compensate: each is queued compensating, with the end
 * it had as the cause, and ends compensated (or failed) in its turn.
 * Returns their ids.
 */
static Jsonb *
reopen_children(RunState *run, Jsonb *ids)
{
	static const Oid types[2] = {INT8ARRAYOID, TEXTOID};
	Datum		values[2];
	StringInfoData out;
	uint64		n;
	SPITupleTable *tt;
	SecurityFrame frame;

	values[0] = id_array(ids);
	values[1] = CStringGetTextDatum(psprintf("compensated: its parent run " INT64_FORMAT " compensates", run->id));
	SecurityAsOwner(&frame);
	n = SpiExec("UPDATE tuvl.runs c SET status = 'queued', finished_at = NULL, step_state = NULL, "
				"  current_step = c.compensation OPERATOR(pg_catalog.->) 'stack' OPERATOR(pg_catalog.->) -1 "
				"                 OPERATOR(pg_catalog.->>) 'compensate', "
				"  compensation = c.compensation OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object("
				"    'cause', pg_catalog.jsonb_build_object('status', 'completed', 'end', c.end_name, "
				"                                           'response', c.response, 'error', $2), "
				"    'failed', '[]'::pg_catalog.jsonb), "
				"  last_seq = c.last_seq OPERATOR(pg_catalog.+) 1 "
				"WHERE c.id OPERATOR(pg_catalog.=) ANY ($1) AND c.status OPERATOR(pg_catalog.=) 'completed' "
				"  AND pg_catalog.jsonb_array_length(COALESCE(c.compensation OPERATOR(pg_catalog.->) 'stack', "
				"                                              '[]'::pg_catalog.jsonb)) OPERATOR(pg_catalog.>) 0 "
				"RETURNING c.id, c.last_seq OPERATOR(pg_catalog.-) 1, c.current_step, c.principal_id, c.priority",
				2, types, values, NULL, SPI_OK_UPDATE_RETURNING);
	tt = SPI_tuptable;
	initStringInfo(&out);
	appendStringInfoChar(&out, '[');
	for (uint64 i = 0; i < n; i++)
	{
		JsonObjBuilder b;

		JsonObjStart(&b);
		JsonObjAddString(&b, "by", "tuvl");
		JsonObjAddString(&b, "reason", TextDatumGetCString(values[1]));
		appendStringInfo(&out, "%s%s", i ? "," : "", SPI_getvalue(tt->vals[i], tt->tupdesc, 1));
		/* journals, with SPI: tt stays, SPI_tuptable does not */
		TimersJournalRequeued(tt, i, "Workflow", JsonObjEnd(&b));
	}
	SecurityRestore(&frame);
	appendStringInfoChar(&out, ']');
	if (n > 0)
		TuvlWakeWorkersAtCommit();
	return JsonFromCString(out.data);
}

/*
 * The step as the compensator of its own entry: its children that
 * completed compensate their completed steps, and it waits for them.
 */
static void
compensate_children(RunState *run, const StepDef *step, Jsonb *entry, StepResult *result)
{
	Jsonb	   *ids = recorded_runs(run, "compensating");
	ChildrenState cs;
	JsonObjBuilder b;

	result->has_output = false;
	if (run->replay)
		return;
	(void) lock_self(run);
	if (ids == NULL)
	{
		ids = reopen_children(run, JsonGetJsonb(entry, "runs"));
		JsonObjStart(&b);
		JsonObjAddString(&b, "op", "compensating");
		JsonObjAddJsonb(&b, "runs", ids);
		EffectRecord(run, JsonObjEnd(&b));
		journal_children(run, step, "children_compensating", ids, NULL, NULL);
	}
	read_children(ids, &cs);
	if (cs.open > 0)
	{
		park(step, ids, result);
		return;
	}
	/* a child whose compensation failed ended failed */
	{
		static const Oid types[1] = {INT8ARRAYOID};
		Datum		values[1];

		values[0] = id_array(ids);
		if (SecurityExec("SELECT pg_catalog.format('the compensation of child run %s failed: %s', id, error) "
						 "FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) ANY ($1) "
						 "  AND status OPERATOR(pg_catalog.=) 'failed' ORDER BY id LIMIT 1",
						 1, types, values, NULL, SPI_OK_SELECT) == 1)
			child_failed(result, SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1));
	}
}

void
StepExecuteWorkflow(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	Jsonb	   *ids;
	int32		priority;
	ChildrenState cs;
	JsonObjBuilder b;
	Jsonb	   *top = CompensationActive(run) ? CompensationTop(run->compensation) : NULL;

	if (top && JsonGetField(top, "runs") && strcmp(JsonGetString(top, "step"), step->id) == 0)
	{
		compensate_children(run, step, top, result);
		return;
	}
	if (run->replay)
	{
		replay_children(run, step, result);
		return;
	}
	ids = recorded_runs(run, "children");
	priority = lock_self(run);
	if (ids == NULL)
	{
		ids = start_children(run, step, ctx, priority);
		JsonObjStart(&b);
		JsonObjAddString(&b, "op", "children");
		JsonObjAddJsonb(&b, "runs", ids);
		EffectRecord(run, JsonObjEnd(&b));
		journal_children(run, step, "children_started", ids, NULL, NULL);
		park(step, ids, result);
		return;
	}
	read_children(ids, &cs);
	if (cs.failed >= 0)
	{
		ControlAbortChildren(run->id, psprintf("a sibling failed: %s", cs.failure), "tuvl");
		journal_children(run, step, "children_ended", ids, NULL, cs.failure);
		child_failed(result, cs.failure);
		return;
	}
	if (cs.open > 0)
	{
		park(step, ids, result);
		return;
	}
	result->has_output = true;
	result->output = JsonGetField(step->spec, "for_each") ? cs.responses : JsonArrayAt(cs.responses, 0);
	journal_children(run, step, "children_ended", ids, result->output, NULL);
}

/*
 * A child of parent_id ended (tuvl._run_ended(), in the transaction that
 * ended it; completed tells how).  If the parent waits for its children:
 * queue it when the child did not complete or none is left open; let go
 * of the next held sibling otherwise.  SPI connected.
 */
void
StepWorkflowChildEnded(int64 parent_id, bool completed)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1];
	SecurityFrame frame;
	bool		wake = !completed;

	values[0] = Int64GetDatum(parent_id);
	SecurityAsOwner(&frame);
	if (SpiExec("SELECT 1 FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1 "
				"  AND status OPERATOR(pg_catalog.=) 'waiting_children' FOR UPDATE",
				1, types, values, NULL, SPI_OK_SELECT) != 1)
	{
		SecurityRestore(&frame);
		return;
	}
	if (!wake)
	{
		uint64		n = SpiExec("UPDATE tuvl.runs r SET held_by = "
								"  CASE WHEN r.concurrency_key IS NOT NULL THEN 'concurrency' END "
								"WHERE r.id OPERATOR(pg_catalog.=) (SELECT h.id FROM tuvl.runs h "
								"  WHERE h.parent_run_id OPERATOR(pg_catalog.=) $1 "
								"    AND h.held_by OPERATOR(pg_catalog.=) 'max_parallel' "
								"  ORDER BY h.parent_run_id, h.id LIMIT 1) "
								"RETURNING r.id, r.principal_id, r.priority, r.workflow, r.concurrency_key, "
								"  r.concurrency_limit",
								1, types, values, NULL, SPI_OK_UPDATE_RETURNING);

		if (n == 1)
		{
			HeapTuple	tup = SPI_tuptable->vals[0];
			TupleDesc	td = SPI_tuptable->tupdesc;
			bool		isnull;

			if (SPI_getvalue(tup, td, 5) != NULL)
				(void) ConcurrencyAdmit(SPI_getvalue(tup, td, 4), SPI_getvalue(tup, td, 5),
										DatumGetInt32(SPI_getbinval(tup, td, 6, &isnull)),
										DatumGetObjectId(SPI_getbinval(tup, td, 2, &isnull)));
			else
			{
				QueueNoteAtCommit(DatumGetObjectId(SPI_getbinval(tup, td, 2, &isnull)),
								  DatumGetInt32(SPI_getbinval(tup, td, 3, &isnull)),
								  DatumGetInt64(SPI_getbinval(tup, td, 1, &isnull)));
				TuvlWakeWorkersAtCommit();
			}
		}
		else
			wake = SpiExec("SELECT 1 FROM tuvl.runs c WHERE c.parent_run_id OPERATOR(pg_catalog.=) $1 "
						   "  AND c.parent_step IS NOT NULL AND c.finished_at IS NULL LIMIT 1",
						   1, types, values, NULL, SPI_OK_SELECT) == 0;
	}
	if (wake)
	{
		JsonObjBuilder b;

		SpiExec("UPDATE tuvl.runs SET status = 'queued', last_seq = last_seq OPERATOR(pg_catalog.+) 1 "
				"WHERE id OPERATOR(pg_catalog.=) $1 "
				"RETURNING id, last_seq OPERATOR(pg_catalog.-) 1, current_step, principal_id, priority",
				1, types, values, NULL, SPI_OK_UPDATE_RETURNING);
		JsonObjStart(&b);
		JsonObjAddString(&b, "by", "tuvl");
		JsonObjAddString(&b, "reason", completed ? "its child runs have ended" : "a child run did not complete");
		TimersJournalRequeued(SPI_tuptable, 0, "Workflow", JsonObjEnd(&b));
		TuvlWakeWorkersAtCommit();
		TuvlRunChangedAtCommit();
	}
	SecurityRestore(&frame);
}

/* Column name of tuvl.runs's row tup, as text, or NULL. */
static char *
column_text(HeapTuple tup, TupleDesc td, const char *name)
{
	int			attno = SPI_fnumber(td, name);

	if (attno <= 0)
		elog(ERROR, "tuvl.runs has no column \"%s\"", name);
	return SPI_getvalue(tup, td, attno);
}

/*
 * tuvl._run_ended(): an AFTER UPDATE trigger on tuvl.runs for rows that
 * get finished_at and carry a parent step or a concurrency key.  It runs
 * in the transaction that ended the run, whatever ended it (a worker's
 * checkpoint, an operator's abort): the next run of the key is admitted
 * (concurrency.c), and a child's parent hears of it.
 */
Datum
tuvl_run_ended(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	HeapTuple	tup;
	TupleDesc	td;
	char	   *key;
	char	   *parent;
	char	   *status;
	char	   *workflow;
	char	   *limit;
	Oid			principal;

	if (!CALLED_AS_TRIGGER(fcinfo) || !TRIGGER_FIRED_AFTER(trigdata->tg_event) ||
		!TRIGGER_FIRED_FOR_ROW(trigdata->tg_event) || !TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("tuvl._run_ended() must be an AFTER UPDATE row trigger on tuvl.runs")));
	tup = trigdata->tg_newtuple;
	td = RelationGetDescr(trigdata->tg_relation);
	key = column_text(tup, td, "concurrency_key");
	parent = column_text(tup, td, "parent_step") ? column_text(tup, td, "parent_run_id") : NULL;
	status = column_text(tup, td, "status");
	workflow = column_text(tup, td, "workflow");
	limit = column_text(tup, td, "concurrency_limit");
	{
		bool		isnull;

		principal = DatumGetObjectId(SPI_getbinval(tup, td, SPI_fnumber(td, "principal_id"), &isnull));
	}

	SPI_connect();
	if (key)
		(void) ConcurrencyAdmit(workflow, key, limit ? pg_strtoint32(limit) : 1,
								principal);
	if (parent)
		StepWorkflowChildEnded(pg_strtoint64(parent), strcmp(status, "completed") == 0);
	SPI_finish();
	return PointerGetDatum(NULL);
}


/* ---------------------------------------------------------------- validation */

static const char *const workflow_keys[] = {"workflow", "input", "for_each", "max_parallel",
"version", NULL};

/*
 * A Workflow step: workflow (a name), input (a mapping of templates),
 * for_each (a template naming a list) and max_parallel (with for_each).
 * Its wait for the children is no step time: timeout is refused.
 */
static void
validate_workflow(ValidateState *vs, Jsonb *step, const char *path)
{
	JsonbValue *v;
	char	   *child;
	char	   *own;

	child = ValidateRequireString(vs, step, "workflow", path, "a Workflow step");
	own = JsonGetString(ValidateDefinition(vs), "name");
	/* a workflow that starts itself names its own version to be */
	if (child && (own == NULL || strcmp(child, own) != 0))
		ValidateUse(vs, USE_WORKFLOW, child, ValidateIsPositiveInt4(JsonGetField(step, "version")) ?
					(int) JsonGetInt(step, "version", 0) : 0, psprintf("%s.workflow", path));
	v = JsonGetField(step, "input");
	if (v && !ValidateIsMapping(v))
		ValidateFinding(vs, "error", psprintf("%s.input", path),
						"input must be a mapping: the child run's input, such as { order_id: \"{{ item.id }}\" }");
	v = JsonGetField(step, "for_each");
	if (v && (v->type != jbvString || !TemplateHasPlaceholders(pnstrdup(v->val.string.val, v->val.string.len))))
		ValidateFinding(vs, "error", psprintf("%s.for_each", path),
						"for_each must be a template naming a list, such as \"{{ orders }}\"");
	ValidatePositiveInt(vs, step, "max_parallel", path);
	if (JsonGetField(step, "max_parallel") && v == NULL)
		ValidateFinding(vs, "error", psprintf("%s.max_parallel", path),
						"max_parallel bounds a for_each fan-out; this step starts one child");
	ValidatePositiveInt(vs, step, "version", path);
	if (JsonGetField(step, "compensate"))
		ValidateFinding(vs, "error", psprintf("%s.compensate", path),
						"a Workflow step takes no compensate: when the run compensates, its children compensate their own completed steps; give the child workflow's steps compensators");
	if (JsonGetField(step, "timeout"))
		ValidateFinding(vs, "error", psprintf("%s.timeout", path),
						"a Workflow step takes no timeout: waiting for children is no step time; give the child workflow's steps timeouts, or abort the parent");
}

/* The Workflow step's row of the step table (init.c). */
const StepExecutor StepKindWorkflow = {
	.kind = STEP_WORKFLOW,
	.execute = StepExecuteWorkflow,
	.keys = workflow_keys,
	.validate = validate_workflow,
};
