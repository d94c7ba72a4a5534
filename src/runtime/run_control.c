/*-------------------------------------------------------------------------
 *
 * run_control.c
 *	  Controlling a run from outside its holder: directives (pause, abort,
 *	  steer), aborts with their children, and the answers of people.
 *
 * A run held by a worker is never written by anyone else: a directive
 * for it is stored in tuvl.runs.control ({"abort": {reason, by},
 * "pause": {by}, "steer": [{message, by}]}) and applied by the holder,
 * cooperatively: between steps (runtime.c), at the top of every agent
 * turn and, for abort, between an agent's tool calls (agent_loop.c); never in
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

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"

#include "executor.h"
#include "journal.h"
#include "jsonschema.h"
#include "jsonutil.h"
#include "queue.h"
#include "run_control.h"
#include "runtime.h"
#include "security.h"
#include "spiutil.h"
#include "tokens.h"
#include "tuvl.h"
#include "workflow.h"

/*
 * The start of an SQL function that controls the run given as its first
 * argument: the token's runs:control scope, the argument not null, SPI
 * connected.  Returns the run's id.
 */
int64
ControlBeginCall(FunctionCallInfo fcinfo)
{
	TokenRequireScope("runs:control");
	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("run_id must not be null")));
	SPI_connect();
	return PG_GETARG_INT64(0);
}

/*
 * Lock run id and check that the caller may control it: its principal,
 * members of tuvl_operator and superusers.  A run the caller may not
 * control is reported as not existing, like one it cannot see, so
 * nothing about other roles' runs leaks.  SPI must be connected.
 */
void
ControlLockRun(int64 id, LockedRun *r, const char *action)
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
	 * checkpoint, its parent's Workflow step): ancestors before descendants,
	 * so two of them never wait for each other.
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
	r->status = StatusFromName(SPI_getvalue(tup, td, 1));
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

void
ControlRequireStatus(LockedRun *r, const char *action, const RunStatus *allowed, const char *hint)
{
	for (int i = 0; allowed[i] != RUN_NONE; i++)
		if (r->status == allowed[i])
			return;
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("cannot %s run " INT64_FORMAT ": its status is %s", action, r->id,
					StatusName(r->status)),
			 errhint("%s", hint)));
}

/*
 * Change a run nobody holds: its status, control, step_state (when
 * given), error, and journal events, under the row lock.
 */
void
ControlUpdateIdleRun(LockedRun *r, RunStatus status, Jsonb *control, Jsonb *step_state,
					 const char *error, List *events)
{
	static const Oid types[6] = {INT8OID, TEXTOID, JSONBOID, JSONBOID, TEXTOID, INT4OID};
	Datum		values[6];
	char		nulls[6] = {' ', ' ', ' ', ' ', ' ', ' '};
	int			n = JournalCount(events);
	SecurityFrame frame;

	values[0] = Int64GetDatum(r->id);
	values[1] = CStringGetTextDatum(StatusName(status));
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
void
ControlAddDirective(LockedRun *r, Jsonb *directive)
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

Jsonb *
ControlByObject(LockedRun *r)
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
		ControlLockRun(id, &r, "abort");
		SecurityRestore(&frame);
		r.by = pstrdup(by);
	}
	else
		ControlLockRun(id, &r, "abort");
	if (r.status == RUN_COMPENSATING ||
		(r.compensation && JsonGetField(r.compensation, "cause") &&
		 !JsonGetBool(r.compensation, "done", false) && !RunStatusIsTerminal(r.status)))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot abort run " INT64_FORMAT ": its status is compensating", r.id),
				 errdetail("Compensation undoes the run's completed steps and runs to its end."),
				 errhint("Wait for it with tuvl.wait(); a compensator waiting for a person still needs an answer.")));
	ControlRequireStatus(&r, "abort", allowed, "The run has already ended.");
	JsonObjStart(&b);
	JsonObjAddString(&b, "reason", reason);
	JsonObjAddString(&b, "by", r.by);
	directive = JsonObjEnd(&b);

	if (r.status == RUN_RUNNING)
	{
		ControlAddDirective(&r, JsonSetKey(JsonEmptyObject(), "abort", directive));
		/* a step executing now is cancelled once this commits */
		if (r.lease_owner != 0)
			TuvlInterruptRunAtCommit(r.lease_owner, r.id);
	}
	else if (agent_in_loop(&r) || has_compensations(&r))
	{
		/*
		 * A worker applies it: an agent takes its aborted exit, which may be
		 * routed; completed steps are compensated.
		 */
		Jsonb	   *control = r.control ? r.control : JsonEmptyObject();

		control = JsonRemoveKey(JsonRemoveKey(control, "paused_at"), "pause_max");
		ControlUpdateIdleRun(&r, RUN_QUEUED, JsonSetKey(control, "abort", directive), NULL, NULL, NIL);
	}
	else
	{
		List	   *events = NIL;

		JsonObjStart(&b);
		JsonObjAddString(&b, "step", r.step);
		JsonObjAddString(&b, "reason", reason);
		JsonObjAddString(&b, "by", r.by);
		JsonObjAddString(&b, "status", StatusName(RUN_ABORTED));
		JournalAdd(&events, "run_aborted", NULL, NULL, JsonObjEnd(&b));
		ControlUpdateIdleRun(&r, RUN_ABORTED, NULL, NULL,
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

/* step_state with one more record appended to its effects. */
static Jsonb *
append_record(Jsonb *state, Jsonb *record)
{
	Jsonb	   *effects = JsonArrayAppend(JsonGetJsonb(state, "effects"), record);

	return JsonRemoveKey(JsonSetKey(state, "effects", effects), "awaiting");
}

/*
 * The answer to the question an MCP server asked the waiting MCP step of r
 * (step_state.awaiting, step_mcp.c): accept with answer->data, checked against
 * the server's requestedSchema, or decline or cancel (answer->action).
 */
static void
answer_elicitation(LockedRun *r, const PersonAnswer *answer, Jsonb *awaiting, List **events)
{
	char	   *key = JsonGetString(awaiting, "request");
	char	   *mode = JsonGetString(awaiting, "mode");
	const char *action = answer->action ? answer->action : "accept";
	JsonObjBuilder b;

	if (key == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("run " INT64_FORMAT " waits for an answer to an MCP server but records no question",
						r->id)));
	if (answer->action == NULL && mode && strcmp(mode, "url") == 0)
	{
		/* the person went to the URL: nothing to send but the consent */
		if (!JsonIsObject(answer->data) || JsonContainerSize(&answer->data->root) != 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("the MCP server's question at step \"%s\" sends the person to a URL: submit {} once it is done",
							r->step),
					 errdetail("The URL: %s", JsonGetString(awaiting, "url") ? JsonGetString(awaiting, "url") : "none given"),
					 errhint("Call tuvl.submit(run_id, '{}') to accept, tuvl.reject(run_id) to decline.")));
	}
	else if (answer->action == NULL)
	{
		Jsonb	   *form = JsonGetJsonb(awaiting, "form");

		if (!JsonIsObject(answer->data))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("the answer to the MCP server's question at step \"%s\" must be a JSON object", r->step),
					 errdetail("The server's question: %s", JsonGetString(awaiting, "message") ?
							   JsonGetString(awaiting, "message") : "none given"),
					 errhint("Submit an object that satisfies the question's schema (people_queue.awaiting -> 'form'), or call tuvl.reject(run_id).")));
		if (form && JsonIsObject(form))
			JsonSchemaValidateOrError(form, answer->data,
									  psprintf("answer to the MCP server's question at step \"%s\"",
											   r->step));
	}

	JsonObjStart(&b);
	JsonObjAddString(&b, "op", "elicitation");
	JsonObjAddString(&b, "request", key);
	JsonObjAddString(&b, "action", action);
	if (answer->action == NULL && (mode == NULL || strcmp(mode, "url") != 0))
		JsonObjAddJsonb(&b, "content", answer->data);
	JsonObjAddString(&b, "by", r->by);
	r->step_state = append_record(r->step_state, JsonObjEnd(&b));

	JsonObjStart(&b);
	/* "submit" as a Human step's, so that a pinned run serves it again */
	JsonObjAddString(&b, "action", answer->action ? answer->action : "submit");
	if (answer->action == NULL)
		JsonObjAddJsonb(&b, "data", answer->data);
	JsonObjAddString(&b, "by", r->by);
	JsonObjAddString(&b, "request", key);
	JsonObjAddJsonb(&b, "tool", JsonGetJsonb(awaiting, "tool"));
	if (answer->replayed)
		JsonObjAddBool(&b, "replayed", true);
	JournalAdd(events, "decision", r->step, "MCP", JsonObjEnd(&b));
}

/*
 * The answer for the waiting Human step of r, validated against its form,
 * or for the MCP step of r waiting on its server's question.
 */
static void
answer_human(LockedRun *r, const PersonAnswer *answer, List **events)
{
	WorkflowDef *wf = WorkflowLoad(r->workflow, r->version);
	int			idx = r->step ? WorkflowFindStep(wf, r->step) : -1;
	Jsonb	   *awaiting = r->step_state ? JsonGetJsonb(r->step_state, "awaiting") : NULL;
	char	   *kind = awaiting && JsonIsObject(awaiting) ? JsonGetString(awaiting, "kind") : NULL;
	Jsonb	   *form;
	JsonObjBuilder b;

	if (idx >= 0 && wf->steps[idx].kind == STEP_MCP && kind && strcmp(kind, "mcp_elicitation") == 0)
	{
		answer_elicitation(r, answer, awaiting, events);
		return;
	}
	if (idx < 0 || wf->steps[idx].kind != STEP_HUMAN || r->step_state == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_DATA_CORRUPTED),
				 errmsg("run " INT64_FORMAT " is waiting_human but not at a Human step", r->id)));
	if (answer->action)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("cannot reject run " INT64_FORMAT ": its Human step \"%s\" waits for data", r->id,
						r->step),
				 errdetail("tuvl.reject() declines or cancels a question an MCP server asked."),
				 errhint("Answer it with tuvl.submit(), or end the run with tuvl.abort_run().")));
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

	ControlLockRun(run_id, &r, answer->human ? (answer->action ? "reject" : "submit to") : "decide on");
	if (answer->by)
		r.by = pstrdup(answer->by);
	r.hold_here = answer->replayed;
	if (answer->human)
	{
		ControlRequireStatus(&r, answer->action ? "reject" : "submit to", waiting_human,
							 answer->action ? "tuvl.reject() answers a run waiting_human for its MCP server's question."
							 : "tuvl.submit() answers a run whose status is waiting_human.");
		answer_human(&r, answer, &events);
	}
	else
	{
		ControlRequireStatus(&r, "decide on", waiting_approval,
							 "tuvl.decide() answers a run whose status is waiting_approval.");
		answer_approval(&r, answer, &events);
	}
	ControlUpdateIdleRun(&r, RUN_QUEUED, r.control, r.step_state, NULL, events);
}
