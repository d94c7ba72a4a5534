/*-------------------------------------------------------------------------
 *
 * retention.c
 *	  How long finished runs are kept: tuvl.retention and tuvl.purge().
 *
 * tuvl.purge(older_than) deletes the runs that finished longer ago than
 * older_than (default tuvl.retention) with their journals, in batches of
 * PURGE_BATCH runs, oldest first.  It touches only finished runs, which no
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
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "security.h"
#include "spiutil.h"
#include "tuvl.h"

PG_FUNCTION_INFO_V1(tuvl_purge);

#define PURGE_BATCH 1000

/* The events of a batch of runs, then the runs: how many runs went. */
static const char purge_sql[] =
"WITH doomed AS ( "
"    SELECT r.id FROM tuvl.runs r "
"    WHERE r.finished_at OPERATOR(pg_catalog.<) (pg_catalog.now() OPERATOR(pg_catalog.-) $1) "
"      AND NOT EXISTS (SELECT 1 FROM tuvl.runs p "
"                      WHERE p.id OPERATOR(pg_catalog.=) r.parent_run_id AND r.parent_step IS NOT NULL "
"                        AND p.finished_at IS NULL) "
"    ORDER BY r.finished_at LIMIT $2 FOR UPDATE OF r SKIP LOCKED), "
"  gone_events AS (DELETE FROM tuvl.events e USING doomed d "
"                  WHERE e.run_id OPERATOR(pg_catalog.=) d.id RETURNING 1) "
"DELETE FROM tuvl.runs r USING doomed d WHERE r.id OPERATOR(pg_catalog.=) d.id "
"RETURNING (SELECT pg_catalog.count(*) FROM gone_events)";

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
	static const Oid types[2] = {INTERVALOID, INT4OID};
	Interval   *older = PG_ARGISNULL(0) ? retention_interval() : PG_GETARG_INTERVAL_P(0);
	Datum		values[2];
	int64		runs = 0;
	int64		events = 0;
	SecurityFrame frame;

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
	values[0] = IntervalPGetDatum(older);
	values[1] = Int32GetDatum(PURGE_BATCH);
	SPI_connect();
	SecurityAsOwner(&frame);
	for (;;)
	{
		uint64		n = SpiExec(purge_sql, 2, types, values, NULL, SPI_OK_DELETE_RETURNING);
		bool		isnull;

		CHECK_FOR_INTERRUPTS();
		if (n == 0)
			break;
		runs += (int64) n;
		events += DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
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
