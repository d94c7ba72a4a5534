/*-------------------------------------------------------------------------
 *
 * retention.c
 *	  How long finished runs are kept: tuvl.retention and tuvl.purge().
 *
 * tuvl.purge(older_than) deletes the runs that finished longer ago than
 * older_than (default tuvl.retention, counted from the start of the
 * transaction) with their journals, in batches of PURGE_BATCH runs,
 * oldest first.  It touches only finished runs, which no
 * worker holds or waits for; a batch takes their row locks with SKIP
 * LOCKED, so a purge never waits for a session reading one FOR UPDATE
 * either.  A child run stays while its parent has not finished (the
 * parent reads its children, and may compensate them).  Called from
 * pg_cron every few minutes, each call has little to do.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "security.h"
#include "spiutil.h"
#include "tuvl.h"
#include "tokens.h"

PG_FUNCTION_INFO_V1(tuvl_purge);

#define PURGE_BATCH 1000

/*
 * A batch: the ids of the oldest runs finished before $1 (none whose
 * parent still runs), locked; then their events and the runs themselves,
 * by id.  The batch size is a constant and the cutoff a timestamp, so that
 * even a generic plan walks runs_finished_idx and the journal's primary
 * key rather than scanning either table.  $2 is where the previous batch
 * ended: the runs this transaction deleted stay in the index until vacuum,
 * and a scan from the start would step over all of them again in every
 * batch (a purge of n runs would cost n squared).  The parent is looked
 * up by a subquery per candidate, not an anti-join: the planner, told by
 * the statistics that hardly any run is unfinished, would otherwise read
 * the whole table for the unfinished parents in every batch.
 */
static const char batch_sql[] =
"SELECT pg_catalog.array_agg(id), pg_catalog.max(finished_at) FROM ( "
"    SELECT r.id, r.finished_at FROM tuvl.runs r "
"    WHERE r.finished_at OPERATOR(pg_catalog.<) $1 "
"      AND r.finished_at OPERATOR(pg_catalog.>=) $2 "
"      AND (r.parent_step IS NULL "
"           OR (SELECT p.finished_at IS NULL FROM tuvl.runs p "
"               WHERE p.id OPERATOR(pg_catalog.=) r.parent_run_id) IS NOT TRUE) "
"    ORDER BY r.finished_at LIMIT " CppAsString2(PURGE_BATCH) " FOR UPDATE OF r SKIP LOCKED) b";

static const char delete_events_sql[] =
"DELETE FROM tuvl.journal WHERE run_id OPERATOR(pg_catalog.=) ANY ($1)";

static const char delete_runs_sql[] =
"DELETE FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) ANY ($1)";

/* tuvl.retention as an interval, or NULL when it is empty. */
static Interval *
retention_interval(void)
{
	if (tuvl_retention == NULL || tuvl_retention[0] == '\0')
		return NULL;
	return DatumGetIntervalP(DirectFunctionCall3(interval_in, CStringGetDatum(tuvl_retention),
												 ObjectIdGetDatum(InvalidOid), Int32GetDatum(-1)));
}

/*
 * purge(older_than interval DEFAULT NULL) returns bigint: the number of
 * runs deleted.
 */
Datum
tuvl_purge(PG_FUNCTION_ARGS)
{
	Interval   *older = PG_ARGISNULL(0) ? retention_interval() : PG_GETARG_INTERVAL_P(0);
	TimestampTz cutoff;
	TimestampTz from = DT_NOBEGIN;
	int64		runs = 0;
	int64		events = 0;
	SecurityFrame frame;

	TokenRequireScope("admin");
	TuvlRefuseWhileReplaying("tuvl.purge()");
	if (!SecurityIsAdmin(GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied to purge runs"),
				 errdetail("tuvl.purge() deletes the runs of every role."),
				 errhint("Ask a member of tuvl_admin, or schedule it with pg_cron as one.")));
	if (older == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("tuvl.purge() needs older_than, or tuvl.retention set"),
				 errhint("Call tuvl.purge('30 days'), or set tuvl.retention = '30 days'.")));
	if (DatumGetBool(DirectFunctionCall2(interval_lt, IntervalPGetDatum(older),
										 IntervalPGetDatum(palloc0(sizeof(Interval))))))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("older_than must not be negative")));
	cutoff = DatumGetTimestampTz(DirectFunctionCall2(timestamptz_mi_interval,
													 TimestampTzGetDatum(GetCurrentTransactionStartTimestamp()),
													 IntervalPGetDatum(older)));
	SPI_connect();
	SecurityAsOwner(&frame);
	for (;;)
	{
		static const Oid ts_types[2] = {TIMESTAMPTZOID, TIMESTAMPTZOID};
		static const Oid ids_type[1] = {INT8ARRAYOID};
		Datum		values[2] = {TimestampTzGetDatum(cutoff), TimestampTzGetDatum(from)};
		Datum		ids;
		bool		isnull;
		int			n;

		CHECK_FOR_INTERRUPTS();
		SpiExec(batch_sql, 2, ts_types, values, NULL, SPI_OK_SELECT);
		ids = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
		if (isnull)
			break;
		from = DatumGetTimestampTz(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
		n = ArrayGetNItems(ARR_NDIM(DatumGetArrayTypeP(ids)), ARR_DIMS(DatumGetArrayTypeP(ids)));
		events += (int64) SpiExec(delete_events_sql, 1, ids_type, &ids, NULL, SPI_OK_DELETE);
		runs += (int64) SpiExec(delete_runs_sql, 1, ids_type, &ids, NULL, SPI_OK_DELETE);
		if (n < PURGE_BATCH)
			break;
	}
	SecurityRestore(&frame);
	SPI_finish();
	if (runs > 0)
		ereport(DEBUG1, (errmsg("tuvl.purge() deleted " INT64_FORMAT " runs and " INT64_FORMAT " events",
								runs, events)));
	PG_RETURN_INT64(runs);
}
