/*-------------------------------------------------------------------------
 *
 * breakpoints.c
 *	  Dev mode (issue 38): whether a breakpoint or step mode stops a run
 *	  before the step it enters, and the bookkeeping of tuvl.dev_runs.
 *
 * A breakpoint (tuvl.breakpoints: workflow, step, role) stops the runs of
 * its role (of a member of tuvl_operator: every run) before they enter the
 * step.  tuvl.dev_runs keeps per run whether it is in step mode (stop
 * before the next step it enters) and the step it may enter once without
 * stopping (the one it stopped before).  Only tuvl writes both tables,
 * through the owner switch: tuvl.set_breakpoint, clear_breakpoint and
 * step_run (api/devmode.c) and the workers, here.
 *
 * Asking costs a run a query at every step it enters, so it asks only
 * while the gate in shared memory (TuvlDevGate, shmem.c) says that this
 * database has a breakpoint or a run in step mode; the writers here and
 * in devmode.c keep the gate's count.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/builtins.h"

#include "breakpoints.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"

/*
 * Who stops run_id (of principal, a run of workflow) before it enters
 * step: "breakpoint", "step" (step mode), or NULL when it goes on.  In a
 * transaction with SPI connected; runs as the owner.
 */
const char *
BreakpointsStop(int64 run_id, Oid principal, const char *workflow, const char *step)
{
	static const Oid bp_types[3] = {TEXTOID, TEXTOID, OIDOID};
	static const Oid id_types[1] = {INT8OID};
	static const Oid upd_types[2] = {INT8OID, TEXTOID};
	Datum		values[3];
	Datum		d;
	SecurityFrame frame;
	bool		bp;
	bool		found;
	bool		step_mode = false;
	char	   *pass = NULL;
	const char *by = NULL;

	SecurityAsOwner(&frame);
	values[0] = CStringGetTextDatum(workflow);
	values[1] = CStringGetTextDatum(step);
	values[2] = ObjectIdGetDatum(principal);
	bp = SpiExec("SELECT 1 FROM tuvl.breakpoints b "
				 "WHERE b.workflow OPERATOR(pg_catalog.=) $1 AND b.step OPERATOR(pg_catalog.=) $2 "
				 "  AND (b.role::pg_catalog.oid OPERATOR(pg_catalog.=) $3 "
				 "       OR pg_catalog.pg_has_role(b.role::pg_catalog.oid, 'tuvl_operator', 'USAGE')) "
				 "LIMIT 1",
				 3, bp_types, values, NULL, SPI_OK_SELECT) == 1;
	values[0] = Int64GetDatum(run_id);
	found = SpiExec("SELECT step_mode, pass_step FROM tuvl.dev_runs "
					"WHERE run_id OPERATOR(pg_catalog.=) $1 FOR UPDATE",
					1, id_types, values, NULL, SPI_OK_SELECT) == 1;
	if (found)
	{
		step_mode = SpiValue(1, &d) && DatumGetBool(d);
		pass = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2);
	}
	if (found && pass && strcmp(pass, step) == 0)
	{
		/* entering the step it stopped before: once, without stopping */
		if (step_mode)
			SpiExec("UPDATE tuvl.dev_runs SET pass_step = NULL, updated_at = pg_catalog.now() "
					"WHERE run_id OPERATOR(pg_catalog.=) $1",
					1, id_types, values, NULL, SPI_OK_UPDATE);
		else
			SpiExec("DELETE FROM tuvl.dev_runs WHERE run_id OPERATOR(pg_catalog.=) $1",
					1, id_types, values, NULL, SPI_OK_DELETE);
	}
	else if (bp || step_mode)
	{
		values[1] = CStringGetTextDatum(step);
		SpiExec("INSERT INTO tuvl.dev_runs AS x (run_id, step_mode, pass_step) "
				"VALUES ($1, false, $2) "
				"ON CONFLICT ON CONSTRAINT dev_runs_pkey DO UPDATE "
				"SET step_mode = false, pass_step = excluded.pass_step, updated_at = pg_catalog.now()",
				2, upd_types, values, NULL, SPI_OK_INSERT);
		if (step_mode)
			TuvlDevGateSubAtCommit(1);
		by = bp ? "breakpoint" : "step";
	}
	SecurityRestore(&frame);
	return by;
}

/*
 * run_id ended: forget its dev mode, so that a run that ended in step
 * mode keeps the gate open no longer.  Runs as the owner.
 */
void
BreakpointsRunEnded(int64 run_id)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1];
	Datum		d;

	values[0] = Int64GetDatum(run_id);
	if (SecurityExec("DELETE FROM tuvl.dev_runs WHERE run_id OPERATOR(pg_catalog.=) $1 "
					 "RETURNING step_mode",
					 1, types, values, NULL, SPI_OK_DELETE_RETURNING) == 1 &&
		SpiValue(1, &d) && DatumGetBool(d))
		TuvlDevGateSubAtCommit(1);
}

/*
 * Run run_id in step mode: it may enter pass_step (NULL: any) once and
 * stops before the next step it enters.  The caller holds the run's row
 * lock and checked that the role may control it.  Runs as the owner.
 */
void
BreakpointsStepMode(int64 run_id, const char *pass_step)
{
	static const Oid types[2] = {INT8OID, TEXTOID};
	Datum		values[2];
	char		nulls[2] = {' ', ' '};
	Datum		d;
	bool		was = false;

	values[0] = Int64GetDatum(run_id);
	values[1] = pass_step ? CStringGetTextDatum(pass_step) : (Datum) 0;
	if (pass_step == NULL)
		nulls[1] = 'n';
	if (SecurityExec("SELECT step_mode FROM tuvl.dev_runs "
					 "WHERE run_id OPERATOR(pg_catalog.=) $1 FOR UPDATE",
					 1, types, values, NULL, SPI_OK_SELECT) == 1)
		was = SpiValue(1, &d) && DatumGetBool(d);
	SecurityExec("INSERT INTO tuvl.dev_runs AS x (run_id, step_mode, pass_step) "
				 "VALUES ($1, true, $2) "
				 "ON CONFLICT ON CONSTRAINT dev_runs_pkey DO UPDATE "
				 "SET step_mode = true, pass_step = excluded.pass_step, updated_at = pg_catalog.now()",
				 2, types, values, nulls, SPI_OK_INSERT);
	if (!was)
		TuvlDevGateAdd(1);
}

static void count_locked(void);

/*
 * Count the gate from the tables, once per database after every start or
 * crash restart (the workers' maintenance, the first thing a worker
 * does).  The tables are locked against writers meanwhile, so that no
 * change in flight escapes the count (a writer counts its change before
 * it commits); when a transaction holds them (tuvl.set_breakpoint() in a
 * transaction left open), the count waits for the next maintenance and
 * runs ask meanwhile: nobody's lock makes a worker wait.  An extension
 * not yet updated to 0.3.0 has neither table: nothing can stop a run.
 * In a transaction with SPI connected.
 */
void
BreakpointsCount(void)
{
	MemoryContext cxt = CurrentMemoryContext;
	SpiSubxact	sub;

	if (TuvlDevGateCounted())
		return;
	if (SecurityExec("SELECT 1 WHERE pg_catalog.to_regclass('tuvl.dev_runs') IS NOT NULL "
					 "AND pg_catalog.to_regclass('tuvl.breakpoints') IS NOT NULL",
					 0, NULL, NULL, NULL, SPI_OK_SELECT) == 0)
	{
		TuvlDevGateSet(0);
		return;
	}
	SpiSubxactBegin(&sub);
	PG_TRY();
	{
		SecurityExec("LOCK TABLE tuvl.breakpoints, tuvl.dev_runs IN SHARE MODE NOWAIT",
					 0, NULL, NULL, NULL, SPI_OK_UTILITY);
		SpiSubxactCommit(&sub);
	}
	PG_CATCH();
	{
		ErrorData  *edata = SpiSubxactAbort(&sub);

		if (edata->sqlerrcode != ERRCODE_LOCK_NOT_AVAILABLE)
			ReThrowError(edata);
		FreeErrorData(edata);
		MemoryContextSwitchTo(cxt);
		return;
	}
	PG_END_TRY();
	count_locked();
}

/* BreakpointsCount, the tables locked. */
static void
count_locked(void)
{
	Datum		d;
	int			n = 0;

	if (SecurityExec("SELECT ((SELECT pg_catalog.count(*) FROM tuvl.breakpoints) "
					 "  OPERATOR(pg_catalog.+) "
					 "  (SELECT pg_catalog.count(*) FROM tuvl.dev_runs WHERE step_mode))::pg_catalog.int4",
					 0, NULL, NULL, NULL, SPI_OK_SELECT) == 1 && SpiValue(1, &d))
		n = DatumGetInt32(d);
	TuvlDevGateSet(n);
}
