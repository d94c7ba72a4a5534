/*-------------------------------------------------------------------------
 *
 * control.c
 *	  The operator's SQL functions: pause, resume, abort and steer a run;
 *	  submit, reject and decide for the people in the loop.
 *
 * Each is a thin front over run_control.c, which holds the rules (who may
 * control a run, in which status, what is journaled).  Every function
 * checks its API token scope first.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"

#include "journal.h"
#include "jsonutil.h"
#include "run_control.h"
#include "security.h"
#include "status.h"
#include "tokens.h"
#include "tuvl.h"

PG_FUNCTION_INFO_V1(tuvl_pause_run);
PG_FUNCTION_INFO_V1(tuvl_resume_run);
PG_FUNCTION_INFO_V1(tuvl_abort_run);
PG_FUNCTION_INFO_V1(tuvl_steer_run);
PG_FUNCTION_INFO_V1(tuvl_submit);
PG_FUNCTION_INFO_V1(tuvl_reject);
PG_FUNCTION_INFO_V1(tuvl_decide);
PG_FUNCTION_INFO_V1(tuvl_control_changed);

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
	ControlLockRun(PG_GETARG_INT64(0), &r, "pause");
	ControlRequireStatus(&r, "pause", allowed,
						 "Only a queued or running run can be paused; a run waiting for a person already holds no worker.");
	if (r.status == RUN_PAUSED)
		ereport(NOTICE, (errmsg("run " INT64_FORMAT " is already paused", r.id)));
	else if (r.status == RUN_QUEUED)
	{
		List	   *events = NIL;

		JournalAdd(&events, "paused", r.step, NULL, ControlByObject(&r));
		ControlUpdateIdleRun(&r, RUN_PAUSED, r.control, NULL, NULL, events);
	}
	else
		ControlAddDirective(&r, JsonSetKey(JsonEmptyObject(), "pause", ControlByObject(&r)));
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
	ControlLockRun(PG_GETARG_INT64(0), &r, "resume");
	ControlRequireStatus(&r, "resume", allowed, "Only a paused run can be resumed.");
	if (r.status == RUN_PAUSED)
	{
		List	   *events = NIL;
		Jsonb	   *control = r.control;

		if (control)
			control = JsonRemoveKey(JsonRemoveKey(JsonRemoveKey(control, "pause"), "paused_at"),
									"pause_max");
		JournalAdd(&events, "resumed", r.step, NULL, ControlByObject(&r));
		ControlUpdateIdleRun(&r, RUN_QUEUED, control, NULL, NULL, events);
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
 * abort_run(run_id, reason): the run, and its children.
 */
Datum
tuvl_abort_run(PG_FUNCTION_ARGS)
{
	int64		run_id = ControlBeginCall(fcinfo);

	ControlAbortRun(run_id, PG_ARGISNULL(1) ? NULL : text_to_cstring(PG_GETARG_TEXT_PP(1)),
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
	ControlLockRun(PG_GETARG_INT64(0), &r, "steer");
	ControlRequireStatus(&r, "steer", allowed, "The run has already ended.");
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
		ControlAddDirective(&r, JsonSetKey(JsonEmptyObject(), "steer", JsonSetKey(queue, id, steer)));
	}
	SPI_finish();
	PG_RETURN_VOID();
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
 * reject(run_id, action): decline or cancel the question an MCP server
 * asked the run's MCP step (mcp.elicitation: ask).
 */
Datum
tuvl_reject(PG_FUNCTION_ARGS)
{
	PersonAnswer answer;
	char	   *action = text_to_cstring(PG_GETARG_TEXT_PP(1));

	TokenRequireScope("people:answer");
	if (strcmp(action, "decline") != 0 && strcmp(action, "cancel") != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("action must be decline or cancel, not \"%s\"", action),
				 errdetail("decline refuses what the server asked; cancel dismisses the question without choosing."),
				 errhint("To accept, answer with tuvl.submit(run_id, content).")));
	memset(&answer, 0, sizeof(answer));
	answer.human = true;
	answer.action = action;
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
