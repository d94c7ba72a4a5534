/*-------------------------------------------------------------------------
 *
 * driver.c
 *	  Driving a run: what follows a committed transition, and the loop
 *	  of tuvl.run() and tuvl.replay().
 *
 * Whoever holds a run repeats: make a transition (RunAdvance), commit
 * it, and ask DriveNextAfter what the run needs next: another transition,
 * an effect performed first, or nothing, because it ended or waits for a
 * person.  The workers do that for many runs at once, in batches, and
 * perform effects on their curl multi handle (worker.c).  tuvl.run()
 * and tuvl.replay() do it for one run in the calling backend, here, with
 * a RunPerformer that performs effects synchronously or serves them from
 * a fixture.  Neither decides anything else, so the surfaces cannot
 * drift apart.
 *
 * DriveRun gives each transition and its effect a memory context and a
 * SPI connection of their own, both gone when the next transition
 * starts: what a run keeps between transitions is in its own context
 * (RunState.cxt), so a long run's memory stays flat.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/memutils.h"

#include "driver.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"

/*
 * Make the committed transition of run current and say what the run
 * needs next.
 */
RunNext
DriveNextAfter(RunState *run)
{
	RunApplyTransition(run);
	if (!RunStatusIsHeld(run->status))
		return RUN_NEXT_RELEASE;
	return run->send ? RUN_NEXT_EFFECT : RUN_NEXT_TRANSITION;
}

/*
 * Drive run in this backend, inside the caller's transaction, until it
 * ends, waits for someone performer does not answer, or performer stops
 * it.  Returns its status; *transitions counts the transitions made.
 */
RunStatus
DriveRun(RunState *run, const RunPerformer *performer, int *transitions)
{
	MemoryContext cxt = AllocSetContextCreate(CurrentMemoryContext, "tuvl transition",
											  ALLOCSET_DEFAULT_SIZES);
	MemoryContext old = CurrentMemoryContext;

	for (;;)
	{
		RunNext		next;

		CHECK_FOR_INTERRUPTS();
		MemoryContextSwitchTo(cxt);
		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "could not connect to SPI");
		RunAdvance(run);
		if (SPI_finish() != SPI_OK_FINISH)
			elog(ERROR, "could not disconnect from SPI");
		next = DriveNextAfter(run);
		(*transitions)++;
		if (next == RUN_NEXT_EFFECT)
		{
			performer->perform(run, performer->arg);
			RunForgetSend(run);
		}
		else if (next == RUN_NEXT_RELEASE && RunStatusIsParked(run->status) &&
				 performer->answer)
		{
			if (SPI_connect() != SPI_OK_CONNECT)
				elog(ERROR, "could not connect to SPI");
			if (performer->answer(run, performer->arg))
				next = RUN_NEXT_TRANSITION;
			SPI_finish();
		}
		MemoryContextSwitchTo(old);
		MemoryContextReset(cxt);
		if (next == RUN_NEXT_RELEASE)
			break;
		if (next == RUN_NEXT_TRANSITION && performer->go_on &&
			!performer->go_on(run, performer->arg))
			break;
	}
	MemoryContextDelete(cxt);
	return run->status;
}

/*
 * Take the lease of run, queued again (someone answered it), for this
 * backend: tuvl.replay() goes on with it at once.  SPI connected.
 */
void
DriveHoldHere(RunState *run)
{
	static const Oid types[3] = {INT8OID, INT4OID, INT8OID};
	Datum		values[3];
	bool		isnull;
	Datum		d;
	SecurityFrame frame;

	values[0] = Int64GetDatum(run->id);
	values[1] = Int32GetDatum(MyProcPid);
	values[2] = Int64GetDatum(TuvlShmem ? TuvlShmem->epoch : 0);
	SecurityAsOwner(&frame);
	if (SpiExec("UPDATE tuvl.runs SET status = 'running', attempt = attempt OPERATOR(pg_catalog.+) 1, "
				"  lease_owner = $2, lease_epoch = $3, "
				"  lease_expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) '1 hour'::pg_catalog.interval "
				"WHERE id OPERATOR(pg_catalog.=) $1 AND status OPERATOR(pg_catalog.=) 'queued' "
				"RETURNING attempt, last_seq, step_state",
				3, types, values, NULL, SPI_OK_UPDATE_RETURNING) != 1)
		elog(ERROR, "run " INT64_FORMAT " is not queued", run->id);
	SecurityRestore(&frame);
	run->attempt = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	run->last_seq = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
	d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 3, &isnull);
	RunKeepJsonb(run, &run->step_state, isnull ? NULL : DatumGetJsonbP(d));
	run->status = RUN_RUNNING;
}

/*
 * How run id ended (end, response, error); all NULL when it did not.
 * SPI connected.
 */
void
DriveReadEnd(int64 id, bool ended, RunEnd *end)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1];
	bool		isnull;
	Datum		d;
	SecurityFrame frame;

	memset(end, 0, sizeof(RunEnd));
	if (!ended)
		return;
	values[0] = Int64GetDatum(id);
	SecurityAsOwner(&frame);
	if (SpiExec("SELECT end_name, response, error FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1",
				1, types, values, NULL, SPI_OK_SELECT) == 1)
	{
		end->end_name = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
		d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull);
		end->response = isnull ? NULL : DatumGetJsonbPCopy(d);
		end->error = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 3);
	}
	SecurityRestore(&frame);
}
