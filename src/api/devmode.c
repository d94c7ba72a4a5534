/*-------------------------------------------------------------------------
 *
 * devmode.c
 *	  Dev mode's SQL functions (issue 38): set_breakpoint,
 *	  clear_breakpoint, step_run.
 *
 * Only these functions and the workers write tuvl.breakpoints and
 * tuvl.dev_runs, through the owner switch: ordinary roles may only read
 * them (row security shows a role its own), so no role can lock them
 * and stall the workers.  Each function checks its API token scope
 * first; step_run checks, as resume_run does, that the caller may
 * control the run (run_control.c).  Each keeps dev mode's gate in shared
 * memory (shmem.c), which spares runs the question while a database has
 * no breakpoint and no run in step mode (runtime/breakpoints.c).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "utils/builtins.h"

#include "breakpoints.h"
#include "journal.h"
#include "jsonutil.h"
#include "run_control.h"
#include "security.h"
#include "spiutil.h"
#include "status.h"
#include "tokens.h"
#include "tuvl.h"

PG_FUNCTION_INFO_V1(tuvl_set_breakpoint);
PG_FUNCTION_INFO_V1(tuvl_clear_breakpoint);
PG_FUNCTION_INFO_V1(tuvl_step_run);

/*
 * The start of set_breakpoint() and clear_breakpoint(): the token's
 * runs:control scope, the (workflow, step) arguments, which must not be
 * null, and SPI connected with values[0..2] = workflow, step, the caller.
 */
static void
breakpoint_args(FunctionCallInfo fcinfo, char **workflow, char **step, Datum *values)
{
	TokenRequireScope("runs:control");
	if (PG_ARGISNULL(0) || PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("workflow and step must not be null"),
				 errhint("A breakpoint names a workflow and the id of one of its steps.")));
	*workflow = text_to_cstring(PG_GETARG_TEXT_PP(0));
	*step = text_to_cstring(PG_GETARG_TEXT_PP(1));
	SPI_connect();
	values[0] = CStringGetTextDatum(*workflow);
	values[1] = CStringGetTextDatum(*step);
	values[2] = ObjectIdGetDatum(GetUserId());
}

/*
 * set_breakpoint(workflow, step): the caller's runs of workflow (an
 * operator's: all of them) stop before they enter step.
 */
Datum
tuvl_set_breakpoint(PG_FUNCTION_ARGS)
{
	static const Oid wf_types[1] = {TEXTOID};
	static const Oid step_types[2] = {TEXTOID, TEXTOID};
	static const Oid ins_types[3] = {TEXTOID, TEXTOID, OIDOID};
	char	   *workflow;
	char	   *step;
	Datum		values[3];

	breakpoint_args(fcinfo, &workflow, &step, values);
	if (SecurityExec("SELECT 1 FROM tuvl.workflows w WHERE w.name OPERATOR(pg_catalog.=) $1 LIMIT 1",
					 1, wf_types, values, NULL, SPI_OK_SELECT) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("workflow \"%s\" does not exist", workflow),
				 errhint("Register it with tuvl.register_workflow().")));
	if (SecurityExec("SELECT 1 FROM tuvl.workflows w, "
					 "  pg_catalog.jsonb_array_elements(w.definition OPERATOR(pg_catalog.->) 'steps') s "
					 "WHERE w.name OPERATOR(pg_catalog.=) $1 "
					 "  AND s OPERATOR(pg_catalog.->>) 'id' OPERATOR(pg_catalog.=) $2 LIMIT 1",
					 2, step_types, values, NULL, SPI_OK_SELECT) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("workflow \"%s\" has no step \"%s\"", workflow, step),
				 errdetail("No registered version of the workflow has a step of that id."),
				 errhint("tuvl.graph(workflow) shows its steps.")));
	if (SecurityExec("INSERT INTO tuvl.breakpoints (workflow, step, role) "
					 "VALUES ($1, $2, $3::pg_catalog.regrole) ON CONFLICT DO NOTHING",
					 3, ins_types, values, NULL, SPI_OK_INSERT) == 1)
		TuvlDevGateAdd(1);
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * clear_breakpoint(workflow, step): remove the caller's breakpoint.
 */
Datum
tuvl_clear_breakpoint(PG_FUNCTION_ARGS)
{
	static const Oid types[3] = {TEXTOID, TEXTOID, OIDOID};
	char	   *workflow;
	char	   *step;
	Datum		values[3];
	uint64		n;

	breakpoint_args(fcinfo, &workflow, &step, values);
	n = SecurityExec("DELETE FROM tuvl.breakpoints b "
					 "WHERE b.workflow OPERATOR(pg_catalog.=) $1 AND b.step OPERATOR(pg_catalog.=) $2 "
					 "  AND b.role::pg_catalog.oid OPERATOR(pg_catalog.=) $3",
					 3, types, values, NULL, SPI_OK_DELETE);
	if (n > 0)
		TuvlDevGateSubAtCommit((int) n);
	else
		ereport(NOTICE,
				(errmsg("no breakpoint of yours before step \"%s\" of workflow \"%s\"", step, workflow)));
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * step_run(run_id): a paused run executes the step it stopped before and
 * stops again before the next one.
 */
Datum
tuvl_step_run(PG_FUNCTION_ARGS)
{
	static const RunStatus allowed[] = {RUN_PAUSED, RUN_NONE};
	LockedRun	r;
	List	   *events = NIL;
	Jsonb	   *control;
	int64		run_id = ControlBeginCall(fcinfo);

	/* reports a run the caller may not control as missing */
	ControlLockRun(run_id, &r, "step");
	ControlRequireStatus(&r, "step", allowed,
						 "Only a paused run can be stepped: pause it, or set a breakpoint with tuvl.set_breakpoint().");
	/* resumed, as tuvl.resume_run() does, and in step mode */
	control = r.control;
	if (control)
		control = JsonRemoveKey(JsonRemoveKey(JsonRemoveKey(control, "pause"), "paused_at"),
								"pause_max");
	JournalAdd(&events, "resumed", r.step, NULL, ControlByObject(&r));
	ControlUpdateIdleRun(&r, RUN_QUEUED, control, NULL, NULL, events);
	BreakpointsStepMode(r.id, r.step);
	SPI_finish();
	PG_RETURN_VOID();
}
