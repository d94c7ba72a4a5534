/*-------------------------------------------------------------------------
 *
 * control.c
 *	  Operators and people in the loop: pause, resume, abort and steer a
 *	  run from any session; Human steps and tool approvals.
 *
 * A run held by a worker is never written by anyone else: a directive
 * for it is stored in tuvl.runs.control ({"abort": {reason, by},
 * "pause": {by}, "steer": [{message, by}]}) and applied by the holder,
 * cooperatively: between steps (runtime.c), at the top of every agent
 * turn and, for abort, between an agent's tool calls (agent.c); never in
 * the middle of a call.  A run nobody holds (queued, paused or waiting
 * for a person) is changed here directly, under its row lock, with its
 * journal events: a worker's claim skips a locked row.
 *
 * Waiting costs nothing: a paused or waiting run has no lease, no worker
 * slot and no open transaction.  Whoever answers (resume_run, submit,
 * decide) records the answer in the step's step_state and re-queues the
 * run; the step finds the answer there when it is executed again.
 *
 * Control is a privilege: the run's principal, members of tuvl_operator
 * and superusers may control a run, and to anyone else it does not exist;
 * every action is journaled with the role that took it.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_authid.h"
#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"

#include "effect.h"
#include "executor.h"
#include "journal.h"
#include "jsonschema.h"
#include "jsonutil.h"
#include "concurrency.h"
#include "control.h"
#include "queue.h"
#include "runtime.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"
#include "workflow.h"
#include "tokens.h"

PG_FUNCTION_INFO_V1(tuvl_pause_run);
PG_FUNCTION_INFO_V1(tuvl_resume_run);
PG_FUNCTION_INFO_V1(tuvl_abort_run);
PG_FUNCTION_INFO_V1(tuvl_steer_run);
PG_FUNCTION_INFO_V1(tuvl_submit);
PG_FUNCTION_INFO_V1(tuvl_decide);
PG_FUNCTION_INFO_V1(tuvl_control_changed);

/* A run row, locked. */
typedef struct LockedRun
{
	int64		id;
	RunStatus	status;
	char	   *principal;
	int			last_seq;
	char	   *step;			/* current_step, or NULL */
	Jsonb	   *step_state;
	Jsonb	   *control;
	Jsonb	   *compensation;
	char	   *workflow;
	int			version;
	char	   *by;				/* the role acting */
	int			lease_owner;	/* pid of the holder, or 0 */
	Oid			principal_id;
	int32		priority;
	bool		hold_here;		/* queued for this backend: wake nobody */
} LockedRun;

/*
 * Lock run id and check that the caller may control it: its principal,
 * members of tuvl_operator and superusers.  A run the caller may not
 * control is reported as not existing, like one it cannot see, so
 * nothing about other roles' runs leaks.  SPI must be connected.
 */
static void
lock_run(int64 id, LockedRun *r, const char *action)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1];
	HeapTuple	tup;
	TupleDesc	td;
	bool		isnull;
	Datum		d;
	Oid			me = GetUserId();
	Oid			principal;

	memset(r, 0, sizeof(LockedRun));
	r->id = id;
	r->by = GetUserNameFromId(me, false);
	values[0] = Int64GetDatum(id);
	/*
	 * A child run's parent is locked first, as everywhere (a child's last
	 * checkpoint, its parent's Workflow step): ancestors before
	 * descendants, so two of them never wait for each other.
	 */
	SecurityExec("SELECT pg_catalog.count(*) FROM (SELECT 1 FROM tuvl.runs p "
				  "  WHERE p.id OPERATOR(pg_catalog.=) (SELECT c.parent_run_id FROM tuvl.runs c "
				  "    WHERE c.id OPERATOR(pg_catalog.=) $1 AND c.parent_step IS NOT NULL) "
				  "  FOR UPDATE OF p) l",
				  1, types, values, NULL, SPI_OK_SELECT);
	SecurityExec("SELECT status, principal, last_seq, current_step, step_state, control, "
				  "  workflow, workflow_version, compensation, principal_id, lease_owner, priority "
				  "FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1 FOR UPDATE",
				  1, types, values, NULL, SPI_OK_SELECT);
	principal = SPI_processed == 1
		? DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 10, &isnull))
		: InvalidOid;
	if (SPI_processed != 1 || (me != principal && !SecurityIsOperator(me)))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("run " INT64_FORMAT " does not exist", id),
				 errhint("Runs are visible to the role that started them and to members of tuvl_operator.")));
	tup = SPI_tuptable->vals[0];
	td = SPI_tuptable->tupdesc;
	r->status = RunStatusFromName(SPI_getvalue(tup, td, 1));
	r->principal = SPI_getvalue(tup, td, 2);
	r->last_seq = DatumGetInt32(SPI_getbinval(tup, td, 3, &isnull));
	r->step = SPI_getvalue(tup, td, 4);
	d = SPI_getbinval(tup, td, 5, &isnull);
	r->step_state = isnull ? NULL : DatumGetJsonbPCopy(d);
	d = SPI_getbinval(tup, td, 6, &isnull);
	r->control = isnull ? NULL : DatumGetJsonbPCopy(d);
	r->workflow = SPI_getvalue(tup, td, 7);
	r->version = DatumGetInt32(SPI_getbinval(tup, td, 8, &isnull));
	d = SPI_getbinval(tup, td, 9, &isnull);
	r->compensation = isnull ? NULL : DatumGetJsonbPCopy(d);
	d = SPI_getbinval(tup, td, 11, &isnull);
	r->lease_owner = isnull ? 0 : DatumGetInt32(d);
	r->principal_id = principal;
	r->priority = DatumGetInt32(SPI_getbinval(tup, td, 12, &isnull));
}

static void
require_status(LockedRun *r, const char *action, const RunStatus *allowed, const char *hint)
{
	for (int i = 0; allowed[i] != RUN_NONE; i++)
		if (r->status == allowed[i])
			return;
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("cannot %s run " INT64_FORMAT ": its status is %s", action, r->id,
					RunStatusName(r->status)),
			 errhint("%s", hint)));
}

/*
 * Change a run nobody holds: its status, control, step_state (when
 * given), error, and journal events, under the row lock.
 */
static void
update_idle_run(LockedRun *r, RunStatus status, Jsonb *control, Jsonb *step_state,
				const char *error, List *events)
{
	static const Oid types[6] = {INT8OID, TEXTOID, JSONBOID, JSONBOID, TEXTOID, INT4OID};
	Datum		values[6];
	char		nulls[6] = {' ', ' ', ' ', ' ', ' ', ' '};
	int			n = JournalCount(events);
	SecurityFrame frame;

	values[0] = Int64GetDatum(r->id);
	values[1] = CStringGetTextDatum(RunStatusName(status));
	if (control && JsonContainerSize(&control->root) > 0)
		values[2] = JsonbPGetDatum(control);
	else
		nulls[2] = 'n';
	if (step_state)
		values[3] = JsonbPGetDatum(step_state);
	else
		nulls[3] = 'n';
	if (error)
		values[4] = CStringGetTextDatum(error);
	else
		nulls[4] = 'n';
	values[5] = Int32GetDatum(r->last_seq + n);
	SecurityAsOwner(&frame);
	SpiExec("UPDATE tuvl.runs SET status = $2, control = $3, "
			"  step_state = CASE WHEN $4::pg_catalog.jsonb IS NULL THEN step_state ELSE $4 END, "
			"  error = COALESCE($5, error), last_seq = $6, "
			"  finished_at = CASE WHEN $2 OPERATOR(pg_catalog.=) ANY (" RUN_TERMINAL_STATUSES_SQL ") "
			"                     THEN pg_catalog.clock_timestamp() END, "
			"  wake_at = CASE WHEN $2 OPERATOR(pg_catalog.=) ANY ('{sleeping,waiting_human,waiting_approval}'::pg_catalog.text[]) "
			"                 THEN wake_at END "
			"WHERE id OPERATOR(pg_catalog.=) $1", 6, types, values, nulls, SPI_OK_UPDATE);
	(void) JournalWrite(r->id, r->principal_id, r->last_seq, events);
	SecurityRestore(&frame);
	TuvlRunChangedAtCommit();
	if (status == RUN_QUEUED && !r->hold_here)
	{
		QueueNoteAtCommit(r->principal_id, r->priority, r->id);
		TuvlWakeWorkersAtCommit();
	}
}

/* Store a directive for the worker holding the run. */
static void
add_directive(LockedRun *r, Jsonb *directive)
{
	static const Oid types[2] = {INT8OID, JSONBOID};
	Datum		values[2];

	values[0] = Int64GetDatum(r->id);
	values[1] = JsonbPGetDatum(directive);
	SecurityExec("UPDATE tuvl.runs "
				  "SET control = COALESCE(control, '{}'::pg_catalog.jsonb) OPERATOR(pg_catalog.||) $2 "
				  "WHERE id OPERATOR(pg_catalog.=) $1",
				  2, types, values, NULL, SPI_OK_UPDATE);
	/* the holder reads it at its next turn boundary (runs_control tells it) */
}

static Jsonb *
by_object(LockedRun *r)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "by", r->by);
	return JsonObjEnd(&b);
}

/* Is the run's current step an autonomous agent in the middle of its loop? */
static bool
agent_in_loop(LockedRun *r)
{
	char	   *state_step = r->step_state ? JsonGetString(r->step_state, "step") : NULL;
	WorkflowDef *wf;
	int			idx;

	if (r->step == NULL || state_step == NULL || strcmp(state_step, r->step) != 0)
		return false;
	wf = WorkflowLoad(r->workflow, r->version);
	idx = WorkflowFindStep(wf, r->step);
	return idx >= 0 && wf->steps[idx].kind == STEP_AGENT;
}

/* Does the run have completed steps to compensate? */
static bool
has_compensations(LockedRun *r)
{
	Jsonb	   *stack = r->compensation ? JsonGetJsonb(r->compensation, "stack") : NULL;

	return stack && JB_ROOT_IS_ARRAY(stack) && !JB_ROOT_IS_SCALAR(stack) &&
		JsonContainerSize(&stack->root) > 0;
}

/* The error of a run aborted by role by (NULL: an operator), for reason. */
char *
ControlAbortError(const char *by, const char *reason)
{
	if (reason && *reason == '\0')
		reason = NULL;
	return psprintf("aborted by %s%s%s", by ? by : "an operator", reason ? ": " : "",
					reason ? reason : "");
}

/*
 * Does control (tuvl.runs.control, or NULL) hold an abort directive?  If
 * so, fill *abort.  {"abort": "reason"} written by hand counts too.
 */
bool
ControlAbortRequested(Jsonb *control, AbortDirective *abort)
{
	Jsonb	   *directive = control ? JsonGetJsonb(control, "abort") : NULL;

	memset(abort, 0, sizeof(AbortDirective));
	if (directive == NULL)
		return false;
	if (JsonIsObject(directive))
	{
		abort->reason = JsonGetString(directive, "reason");
		abort->by = JsonGetString(directive, "by");
	}
	else if (JB_ROOT_IS_SCALAR(directive))
	{
		JsonbValue *v = getIthJsonbValueFromContainer(&directive->root, 0);

		if (v->type == jbvString)
			abort->reason = pnstrdup(v->val.string.val, v->val.string.len);
	}
	if (abort->reason && *abort->reason == '\0')
		abort->reason = NULL;
	abort->error = ControlAbortError(abort->by, abort->reason);
	return true;
}

/*
 * pause_run(run_id)
 */
Datum
tuvl_pause_run(PG_FUNCTION_ARGS)
{
	static const RunStatus allowed[] = {RUN_QUEUED, RUN_RUNNING, RUN_PAUSED, RUN_NONE};
	LockedRun	r;

	TokenRequireScope("runs:control");
	SPI_connect();
	lock_run(PG_GETARG_INT64(0), &r, "pause");
	require_status(&r, "pause", allowed,
				   "Only a queued or running run can be paused; a run waiting for a person already holds no worker.");
	if (r.status == RUN_PAUSED)
		ereport(NOTICE, (errmsg("run " INT64_FORMAT " is already paused", r.id)));
	else if (r.status == RUN_QUEUED)
	{
		List	   *events = NIL;

		JournalAdd(&events, "paused", r.step, NULL, by_object(&r));
		update_idle_run(&r, RUN_PAUSED, r.control, NULL, NULL, events);
	}
	else
		add_directive(&r, JsonSetKey(JsonEmptyObject(), "pause", by_object(&r)));
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * resume_run(run_id)
 */
Datum
tuvl_resume_run(PG_FUNCTION_ARGS)
{
	static const RunStatus allowed[] = {RUN_PAUSED, RUN_RUNNING, RUN_QUEUED, RUN_WAITING_HUMAN,
	RUN_WAITING_APPROVAL, RUN_NONE};
	LockedRun	r;

	TokenRequireScope("runs:control");
	SPI_connect();
	lock_run(PG_GETARG_INT64(0), &r, "resume");
	require_status(&r, "resume", allowed, "Only a paused run can be resumed.");
	if (r.status == RUN_PAUSED)
	{
		List	   *events = NIL;
		Jsonb	   *control = r.control;

		if (control)
			control = JsonRemoveKey(JsonRemoveKey(JsonRemoveKey(control, "pause"), "paused_at"),
									"pause_max");
		JournalAdd(&events, "resumed", r.step, NULL, by_object(&r));
		update_idle_run(&r, RUN_QUEUED, control, NULL, NULL, events);
	}
	else if (r.control && JsonGetField(r.control, "pause"))
	{
		/* the pause has not taken effect yet: withdraw it */
		static const Oid types[1] = {INT8OID};
		Datum		values[1];

		values[0] = Int64GetDatum(r.id);
		SecurityExec("UPDATE tuvl.runs "
					  "SET control = NULLIF(control OPERATOR(pg_catalog.-) 'pause'::pg_catalog.text, "
					  "                     '{}'::pg_catalog.jsonb) "
					  "WHERE id OPERATOR(pg_catalog.=) $1",
					  1, types, values, NULL, SPI_OK_UPDATE);
		ereport(NOTICE,
				(errmsg("run " INT64_FORMAT " had not paused yet; its pause request was withdrawn", r.id)));
	}
	else
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot resume run " INT64_FORMAT ": it is not paused", r.id)));
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * Abort run id for reason (NULL: none), as role by (NULL: the caller,
 * whose right to is checked then), and its open children with it.
 */
void
ControlAbortRun(int64 id, const char *reason, const char *by)
{
	static const RunStatus allowed[] = {RUN_QUEUED, RUN_RUNNING, RUN_PAUSED, RUN_WAITING_HUMAN,
	RUN_WAITING_APPROVAL, RUN_SLEEPING, RUN_WAITING_CHILDREN, RUN_NONE};
	LockedRun	r;
	JsonObjBuilder b;
	Jsonb	   *directive;

	if (reason && *reason == '\0')
		reason = NULL;
	if (by)
	{
		SecurityFrame frame;

		SecurityAsOwner(&frame);
		lock_run(id, &r, "abort");
		SecurityRestore(&frame);
		r.by = pstrdup(by);
	}
	else
		lock_run(id, &r, "abort");
	if (r.status == RUN_COMPENSATING ||
		(r.compensation && JsonGetField(r.compensation, "cause") &&
		 !JsonGetBool(r.compensation, "done", false) && !RunStatusIsTerminal(r.status)))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot abort run " INT64_FORMAT ": its status is compensating", r.id),
				 errdetail("Compensation undoes the run's completed steps and runs to its end."),
				 errhint("Wait for it with tuvl.wait(); a compensator waiting for a person still needs an answer.")));
	require_status(&r, "abort", allowed, "The run has already ended.");
	JsonObjStart(&b);
	JsonObjAddString(&b, "reason", reason);
	JsonObjAddString(&b, "by", r.by);
	directive = JsonObjEnd(&b);

	if (r.status == RUN_RUNNING)
	{
		add_directive(&r, JsonSetKey(JsonEmptyObject(), "abort", directive));
		/* a step executing now is cancelled once this commits */
		if (r.lease_owner != 0)
			TuvlInterruptRunAtCommit(r.lease_owner, r.id);
	}
	else if (agent_in_loop(&r) || has_compensations(&r))
	{
		/*
		 * A worker applies it: an agent takes its aborted exit, which may
		 * be routed; completed steps are compensated.
		 */
		Jsonb	   *control = r.control ? r.control : JsonEmptyObject();

		control = JsonRemoveKey(JsonRemoveKey(control, "paused_at"), "pause_max");
		update_idle_run(&r, RUN_QUEUED, JsonSetKey(control, "abort", directive), NULL, NULL, NIL);
	}
	else
	{
		List	   *events = NIL;

		JsonObjStart(&b);
		JsonObjAddString(&b, "step", r.step);
		JsonObjAddString(&b, "reason", reason);
		JsonObjAddString(&b, "by", r.by);
		JsonObjAddString(&b, "status", RunStatusName(RUN_ABORTED));
		JournalAdd(&events, "run_aborted", NULL, NULL, JsonObjEnd(&b));
		update_idle_run(&r, RUN_ABORTED, NULL, NULL,
						ControlAbortError(r.by, reason),
						events);
	}
	ControlAbortChildren(r.id, psprintf("its parent run " INT64_FORMAT " was aborted%s%s", r.id,
										reason ? ": " : "", reason ? reason : ""), r.by);
}

/*
 * Abort the children of run parent_id that have not ended (the held ones
 * too), as role by, for reason.  SPI connected.
 */
void
ControlAbortChildren(int64 parent_id, const char *reason, const char *by)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1];
	uint64		n;
	int64	   *ids;

	values[0] = Int64GetDatum(parent_id);
	n = SecurityExec("SELECT id FROM tuvl.runs WHERE parent_run_id OPERATOR(pg_catalog.=) $1 "
					 "  AND parent_step IS NOT NULL AND finished_at IS NULL "
					 "  AND status OPERATOR(pg_catalog.<>) 'compensating' "
					 "  AND NOT (COALESCE(compensation OPERATOR(pg_catalog.?) 'cause', false) "
					 "           AND NOT COALESCE((compensation OPERATOR(pg_catalog.->>) 'done')::pg_catalog.bool, false)) "
					 "ORDER BY id",
					 1, types, values, NULL, SPI_OK_SELECT);
	ids = palloc(sizeof(int64) * Max(n, 1));
	for (uint64 i = 0; i < n; i++)
	{
		bool		isnull;

		ids[i] = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1, &isnull));
	}
	for (uint64 i = 0; i < n; i++)
		ControlAbortRun(ids[i], reason, by);
}

/*
 * abort_run(run_id, reason): the run, and its children.
 */
Datum
tuvl_abort_run(PG_FUNCTION_ARGS)
{
	TokenRequireScope("runs:control");

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("run_id must not be null")));
	SPI_connect();
	ControlAbortRun(PG_GETARG_INT64(0), PG_ARGISNULL(1) ? NULL : text_to_cstring(PG_GETARG_TEXT_PP(1)),
					NULL);
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * steer_run(run_id, message): guidance for the run's agents, appended at
 * the next turn boundary.
 */
Datum
tuvl_steer_run(PG_FUNCTION_ARGS)
{
	static const RunStatus allowed[] = {RUN_QUEUED, RUN_RUNNING, RUN_PAUSED, RUN_WAITING_HUMAN,
	RUN_WAITING_APPROVAL, RUN_NONE};
	char	   *message = text_to_cstring(PG_GETARG_TEXT_PP(1));
	LockedRun	r;
	JsonObjBuilder b;
	Jsonb	   *steer;

	TokenRequireScope("runs:control");
	if (*message == '\0')
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a steer message cannot be empty")));
	SPI_connect();
	lock_run(PG_GETARG_INT64(0), &r, "steer");
	require_status(&r, "steer", allowed, "The run has already ended.");
	JsonObjStart(&b);
	JsonObjAddString(&b, "message", message);
	JsonObjAddString(&b, "by", r.by);
	steer = JsonObjEnd(&b);
	{
		/* keyed by a fixed-width id, so key order is arrival order */
		Jsonb	   *queue = r.control ? JsonGetJsonb(r.control, "steer") : NULL;
		char	   *id = psprintf("%020" INT64_MODIFIER "d", (int64) GetCurrentTimestamp());

		if (queue == NULL || !JsonIsObject(queue))
			queue = JsonEmptyObject();
		while (JsonGetField(queue, id))
			id = psprintf("%020" INT64_MODIFIER "d", (int64) strtoll(id, NULL, 10) + 1);
		add_directive(&r, JsonSetKey(JsonEmptyObject(), "steer", JsonSetKey(queue, id, steer)));
	}
	SPI_finish();
	PG_RETURN_VOID();
}

/* step_state with one more record appended to its effects. */
static Jsonb *
append_record(Jsonb *state, Jsonb *record)
{
	Jsonb	   *effects = JsonArrayAppend(JsonGetJsonb(state, "effects"), record);

	return JsonRemoveKey(JsonSetKey(state, "effects", effects), "awaiting");
}

/* The data for the waiting Human step of r, validated against its form. */
static void
answer_human(LockedRun *r, const PersonAnswer *answer, List **events)
{
	WorkflowDef *wf = WorkflowLoad(r->workflow, r->version);
	int			idx = r->step ? WorkflowFindStep(wf, r->step) : -1;
	Jsonb	   *form;
	JsonObjBuilder b;

	if (idx < 0 || wf->steps[idx].kind != STEP_HUMAN || r->step_state == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("run " INT64_FORMAT " is waiting_human but not at a Human step", r->id)));
	form = JsonGetJsonb(wf->steps[idx].spec, "form");
	if (form)
		JsonSchemaValidateOrError(form, answer->data,
								  psprintf("data submitted to step \"%s\"", r->step));

	JsonObjStart(&b);
	JsonObjAddString(&b, "op", "human");
	JsonObjAddJsonb(&b, "data", answer->data);
	JsonObjAddString(&b, "by", r->by);
	r->step_state = append_record(r->step_state, JsonObjEnd(&b));

	JsonObjStart(&b);
	JsonObjAddString(&b, "action", "submit");
	JsonObjAddJsonb(&b, "data", answer->data);
	JsonObjAddString(&b, "by", r->by);
	if (answer->replayed)
		JsonObjAddBool(&b, "replayed", true);
	JournalAdd(events, "decision", r->step, "Human", JsonObjEnd(&b));
}

/* The decision on the tool call r waits for. */
static void
answer_approval(LockedRun *r, const PersonAnswer *answer, List **events)
{
	Jsonb	   *awaiting = r->step_state ? JsonGetJsonb(r->step_state, "awaiting") : NULL;
	JsonbValue *call = awaiting ? JsonGetField(awaiting, "call") : NULL;
	JsonObjBuilder b;

	if (call == NULL || call->type != jbvNumeric)
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("run " INT64_FORMAT " is waiting_approval but records no tool call", r->id)));

	JsonObjStart(&b);
	JsonObjAddString(&b, "op", "approval");
	JsonObjAddJsonb(&b, "call", JsonGetJsonb(awaiting, "call"));
	JsonObjAddBool(&b, "approved", answer->approved);
	JsonObjAddString(&b, "note", answer->note);
	JsonObjAddString(&b, "by", r->by);
	JsonObjAddInt(&b, "decided_at", GetCurrentTimestamp());
	r->step_state = append_record(r->step_state, JsonObjEnd(&b));

	JsonObjStart(&b);
	JsonObjAddJsonb(&b, "call", JsonGetJsonb(awaiting, "call"));
	JsonObjAddJsonb(&b, "call_id", JsonGetJsonb(awaiting, "call_id"));
	JsonObjAddJsonb(&b, "tool", JsonGetJsonb(awaiting, "tool"));
	JsonObjAddBool(&b, "approved", answer->approved);
	JsonObjAddString(&b, "note", answer->note);
	JsonObjAddString(&b, "by", r->by);
	if (answer->replayed)
		JsonObjAddBool(&b, "replayed", true);
	JournalAdd(events, "approval_decided", r->step, "Agent", JsonObjEnd(&b));
}

/*
 * Answer run_id, which waits for a person: data for its Human step, or a
 * decision on an agent's tool call.  The answer is recorded in its
 * step_state and journaled, and the run is queued again: for the workers,
 * or, when the answer is replayed, for the replay that goes on with it.
 * SPI connected.
 */
void
ControlAnswer(int64 run_id, const PersonAnswer *answer)
{
	static const RunStatus waiting_human[] = {RUN_WAITING_HUMAN, RUN_NONE};
	static const RunStatus waiting_approval[] = {RUN_WAITING_APPROVAL, RUN_NONE};
	LockedRun	r;
	List	   *events = NIL;

	lock_run(run_id, &r, answer->human ? "submit to" : "decide on");
	if (answer->by)
		r.by = pstrdup(answer->by);
	r.hold_here = answer->replayed;
	if (answer->human)
	{
		require_status(&r, "submit to", waiting_human,
					   "tuvl.submit() answers a run whose status is waiting_human.");
		answer_human(&r, answer, &events);
	}
	else
	{
		require_status(&r, "decide on", waiting_approval,
					   "tuvl.decide() answers a run whose status is waiting_approval.");
		answer_approval(&r, answer, &events);
	}
	update_idle_run(&r, RUN_QUEUED, r.control, r.step_state, NULL, events);
}

/*
 * submit(run_id, data): answer a waiting Human step.
 */
Datum
tuvl_submit(PG_FUNCTION_ARGS)
{
	PersonAnswer answer;

	TokenRequireScope("people:answer");
	memset(&answer, 0, sizeof(answer));
	answer.human = true;
	answer.data = PG_GETARG_JSONB_P(1);
	SPI_connect();
	ControlAnswer(PG_GETARG_INT64(0), &answer);
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * decide(run_id, approved, note): answer a waiting tool approval.
 */
Datum
tuvl_decide(PG_FUNCTION_ARGS)
{
	PersonAnswer answer;

	TokenRequireScope("people:answer");
	if (PG_ARGISNULL(0) || PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", PG_ARGISNULL(0) ? "run_id" : "approved"),
				 errhint("Call tuvl.decide(run_id, true) to approve, tuvl.decide(run_id, false, 'why') to reject.")));
	memset(&answer, 0, sizeof(answer));
	answer.approved = PG_GETARG_BOOL(1);
	answer.note = PG_ARGISNULL(2) ? NULL : text_to_cstring(PG_GETARG_TEXT_PP(2));
	SPI_connect();
	ControlAnswer(PG_GETARG_INT64(0), &answer);
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * The Human step: wait for tuvl.submit(); its data is the output.  With
 * timeout:, the wait ends then (the run's wake_at, as a Sleep step's) and
 * the step takes the timeout signal.
 */
void
StepExecuteHuman(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	TimestampTz until = 0;
	JsonObjBuilder b;

	for (int i = EffectCount(run) - 1; i >= 0; i--)
	{
		Jsonb	   *rec = EffectAt(run, i);
		char	   *op = JsonGetString(rec, "op");

		if (op && strcmp(op, "human") == 0)
		{
			result->has_output = true;
			result->output = JsonGetJsonb(rec, "data");
			return;
		}
		if (op && strcmp(op, "human_wait") == 0 && until == 0)
			until = (TimestampTz) JsonGetInt(rec, "until_us", 0);
	}
	if (step->timeout_ms > 0 && until == 0)
	{
		until = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), step->timeout_ms);
		JsonObjStart(&b);
		JsonObjAddString(&b, "op", "human_wait");
		JsonObjAddInt(&b, "until_us", until);
		EffectRecord(run, JsonObjEnd(&b));
	}
	if (until != 0 && GetCurrentTimestamp() >= until)
	{
		result->signal = "timeout";
		result->has_output = false;
		return;
	}
	JsonObjStart(&b);
	JsonObjAddString(&b, "kind", "human");
	JsonObjAddJsonb(&b, "form", JsonGetJsonb(step->spec, "form"));
	if (until != 0)
		SleepAddWake(&b, until);
	result->park = RUN_WAITING_HUMAN;
	result->park_info = JsonObjEnd(&b);
}

/*
 * The due runs of one status: each status has a partial index on wake_at
 * of its own, whose predicate this query repeats, so that even the plan
 * made while the table was small probes the index rather than scanning the
 * runs; and the plan is made without sequential scans (SpiExecIndexed),
 * or the UPDATE would find the ids it got by scanning the table.
 */
static const char wake_sleeping_sql[] =
"UPDATE tuvl.runs r SET status = 'queued', wake_at = NULL, last_seq = r.last_seq OPERATOR(pg_catalog.+) 1 "
"WHERE r.id OPERATOR(pg_catalog.=) ANY (ARRAY( "
"    SELECT w.id FROM tuvl.runs w "
"    WHERE w.status OPERATOR(pg_catalog.=) 'sleeping' AND w.wake_at OPERATOR(pg_catalog.<=) pg_catalog.now() "
"    ORDER BY w.wake_at LIMIT 1000 FOR UPDATE SKIP LOCKED)) "
"RETURNING r.id, r.last_seq OPERATOR(pg_catalog.-) 1, r.current_step, r.principal_id, r.priority, "
"  r.workflow, r.concurrency_key, r.concurrency_limit, r.held_by";

static const char wake_human_sql[] =
"UPDATE tuvl.runs r SET status = 'queued', wake_at = NULL, last_seq = r.last_seq OPERATOR(pg_catalog.+) 1 "
"WHERE r.id OPERATOR(pg_catalog.=) ANY (ARRAY( "
"    SELECT w.id FROM tuvl.runs w "
"    WHERE w.status OPERATOR(pg_catalog.=) 'waiting_human' AND w.wake_at IS NOT NULL "
"      AND w.wake_at OPERATOR(pg_catalog.<=) pg_catalog.now() "
"    ORDER BY w.wake_at LIMIT 1000 FOR UPDATE SKIP LOCKED)) "
"RETURNING r.id, r.last_seq OPERATOR(pg_catalog.-) 1, r.current_step, r.principal_id, r.priority";

/*
 * Tool calls whose approval_timeout passed without a decision: each is
 * rejected as tuvl.decide(run, false, ...) would, by "tuvl", and the model
 * is told so.
 */
static int
reject_late_approvals(void)
{
	uint64		n = SpiExec("SELECT w.id, (w.step_state OPERATOR(pg_catalog.->) 'awaiting' "
							"    OPERATOR(pg_catalog.->>) 'timeout_ms')::pg_catalog.int4 "
							"FROM tuvl.runs w "
							"WHERE w.status OPERATOR(pg_catalog.=) 'waiting_approval' AND w.wake_at IS NOT NULL "
							"  AND w.wake_at OPERATOR(pg_catalog.<=) pg_catalog.now() "
							"ORDER BY w.wake_at LIMIT 100 FOR UPDATE SKIP LOCKED",
							0, NULL, NULL, NULL, SPI_OK_SELECT);
	SPITupleTable *tt = SPI_tuptable;
	int64	   *ids = palloc(sizeof(int64) * Max(n, 1));
	int		   *ms = palloc(sizeof(int) * Max(n, 1));

	for (uint64 i = 0; i < n; i++)
	{
		bool		isnull;

		ids[i] = DatumGetInt64(SPI_getbinval(tt->vals[i], tt->tupdesc, 1, &isnull));
		ms[i] = DatumGetInt32(SPI_getbinval(tt->vals[i], tt->tupdesc, 2, &isnull));
		if (isnull)
			ms[i] = 0;
	}
	for (uint64 i = 0; i < n; i++)
	{
		PersonAnswer answer;

		memset(&answer, 0, sizeof(answer));
		answer.approved = false;
		answer.by = "tuvl";
		answer.note = psprintf("no decision within the approval_timeout of %s",
							   ms[i] % 1000 == 0 ? psprintf("%d s", ms[i] / 1000) : psprintf("%d ms", ms[i]));
		ControlAnswer(ids[i], &answer);
	}
	return (int) n;
}

/*
 * Row i of a re-queue's RETURNING (id, last_seq before it, current_step,
 * principal_id, priority): tell the queue at commit, and journal payload
 * as its resumed event (engine kind, NULL: none).
 */
void
ControlJournalRequeued(SPITupleTable *tt, uint64 i, const char *kind, Jsonb *payload)
{
	bool		isnull;
	int64		id = DatumGetInt64(SPI_getbinval(tt->vals[i], tt->tupdesc, 1, &isnull));
	int			last_seq = DatumGetInt32(SPI_getbinval(tt->vals[i], tt->tupdesc, 2, &isnull));
	Oid			principal = DatumGetObjectId(SPI_getbinval(tt->vals[i], tt->tupdesc, 4, &isnull));
	List	   *events = NIL;

	QueueNoteAtCommit(principal, DatumGetInt32(SPI_getbinval(tt->vals[i], tt->tupdesc, 5, &isnull)),
					  id);
	JournalAdd(&events, "resumed", SPI_getvalue(tt->vals[i], tt->tupdesc, 3), kind, payload);
	(void) JournalWrite(id, principal, last_seq, events);
}

/* Queue the runs wake_sql finds, each with a resumed event; returns how many. */
static int
wake(const char *wake_sql, bool human)
{
	uint64		n = SpiExecIndexed(wake_sql, 0, NULL, NULL, NULL, SPI_OK_UPDATE_RETURNING);
	SPITupleTable *tt = SPI_tuptable;

	for (uint64 i = 0; i < n; i++)
	{
		char	   *step = SPI_getvalue(tt->vals[i], tt->tupdesc, 3);
		JsonObjBuilder b;
		bool		null;

		JsonObjStart(&b);
		JsonObjAddString(&b, "by", "tuvl");
		/* a run started with not_before has no step yet */
		JsonObjAddString(&b, "reason", human ? "the Human step's timeout passed" :
						 step ? "the Sleep step's time has come" : "its not_before has come");
		ControlJournalRequeued(tt, i, human ? "Human" : step ? "Sleep" : NULL, JsonObjEnd(&b));
		/* a run of a concurrency key that waited for not_before now asks for a place */
		if (!human && SPI_getvalue(tt->vals[i], tt->tupdesc, 9) != NULL)
			(void) ConcurrencyAdmit(SPI_getvalue(tt->vals[i], tt->tupdesc, 6),
									SPI_getvalue(tt->vals[i], tt->tupdesc, 7),
									pg_strtoint32(SPI_getvalue(tt->vals[i], tt->tupdesc, 8)),
									DatumGetObjectId(SPI_getbinval(tt->vals[i], tt->tupdesc, 4, &null)));
	}
	return (int) n;
}

/*
 * Queue the sleeping runs whose time has come and the runs whose Human
 * step waited past its timeout (at most 1,000 of each at a time, those due
 * first); their step then ends.  Called by the workers' maintenance each
 * second; SPI connected, in a transaction.  While nothing is due, each is
 * a probe of its index's first entry.
 */
int
ControlWakeSleepers(void)
{
	SecurityFrame frame;
	int			n;

	SecurityAsOwner(&frame);
	n = wake(wake_sleeping_sql, false);
	n += wake(wake_human_sql, true);
	n += reject_late_approvals();
	SecurityRestore(&frame);
	if (n > 0)
		TuvlRunChangedAtCommit();
	return n;
}

/*
 * Abort agents paused longer than tuvl.agent_pause_max: re-queue them
 * with an abort directive, so each takes its aborted exit.  Called by the
 * workers' maintenance; SPI connected, in a transaction.
 */
int
ControlExpirePauses(void)
{
	static const Oid types[1] = {INT4OID};
	Datum		values[1];
	uint64		n;
	char	   *reason = psprintf("paused longer than tuvl.agent_pause_max (%d s)", tuvl_agent_pause_max);
	SecurityFrame frame;

	values[0] = Int32GetDatum(tuvl_agent_pause_max);
	SecurityAsOwner(&frame);
	n = SpiExec("UPDATE tuvl.runs SET status = 'queued', last_seq = last_seq OPERATOR(pg_catalog.+) 1, "
				"  control = (control OPERATOR(pg_catalog.-) '{paused_at,pause_max,pause}'::pg_catalog.text[]) "
				"    OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object('abort', "
				"      pg_catalog.jsonb_build_object('reason', "
				"        pg_catalog.format('paused longer than tuvl.agent_pause_max (%s s)', $1), "
				"        'by', 'tuvl')) "
				"WHERE status OPERATOR(pg_catalog.=) 'paused' "
				"  AND (control OPERATOR(pg_catalog.->>) 'pause_max')::pg_catalog.bool "
				"  AND (control OPERATOR(pg_catalog.->>) 'paused_at')::pg_catalog.timestamptz "
				"      OPERATOR(pg_catalog.<) (pg_catalog.now() OPERATOR(pg_catalog.-) "
				"      pg_catalog.make_interval(secs => $1::pg_catalog.float8)) "
				"RETURNING id, last_seq OPERATOR(pg_catalog.-) 1, current_step, principal_id, priority",
				1, types, values, NULL, SPI_OK_UPDATE_RETURNING);
	if (n > 0)
	{
		SPITupleTable *tt = SPI_tuptable;

		/* each is journaled: the run goes on to take its aborted exit */
		for (uint64 i = 0; i < n; i++)
		{
			JsonObjBuilder b;

			JsonObjStart(&b);
			JsonObjAddString(&b, "by", "tuvl");
			JsonObjAddString(&b, "reason", reason);
			JsonObjAddBool(&b, "abort", true);
			ControlJournalRequeued(tt, i, NULL, JsonObjEnd(&b));
		}
		TuvlRunChangedAtCommit();
	}
	SecurityRestore(&frame);
	return (int) n;
}

/*
 * tuvl._control_changed(): an AFTER UPDATE OF control row trigger on
 * tuvl.runs, for rows whose directives changed.  Whoever changed them (a
 * control function, a worker consuming or clearing them, a superuser
 * writing them by hand) tells the workers at commit that their copies
 * may be stale (TuvlControlGen): an agent reads its run's directives again
 * at its next turn.  tuvl's checkpoints assign control only when they
 * change it (checkpoint.c).
 */
Datum
tuvl_control_changed(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;

	if (!CALLED_AS_TRIGGER(fcinfo) || !TRIGGER_FIRED_AFTER(trigdata->tg_event) ||
		!TRIGGER_FIRED_FOR_ROW(trigdata->tg_event) || !TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("tuvl._control_changed() must be an AFTER UPDATE row trigger on tuvl.runs")));
	TuvlControlChangedAtCommit();
	return PointerGetDatum(NULL);
}
