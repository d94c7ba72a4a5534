/*-------------------------------------------------------------------------
 *
 * lease.c
 *	  Claiming runs with SKIP LOCKED, renewing and reclaiming leases.
 *
 * A lease is (lease_owner, lease_epoch, lease_expires_at) plus the run's
 * attempt number, which every claim increments and every write of the
 * holder is fenced by.  A lease lasts as long as its holder heartbeats
 * (see TuvlLeaseHolderAlive): runs of dead holders and of older server
 * incarnations go back to the queue at once, runs of a holder stalled for
 * longer than tuvl.lease_timeout go back then.  lease_expires_at shows
 * the last renewal plus the timeout, for monitoring.
 * All functions run inside the caller's transaction with SPI connected,
 * as the extension owner (security.c);
 * the worker commits claims and renewals asynchronously, since losing
 * one in a crash only means the run is claimed again.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "lease.h"
#include "runtime.h"
#include "security.h"
#include "spiutil.h"

/*
 * Fairness.  Claims share the queue among the principals that have runs
 * in it: each claim finds them (a skip scan of runs_queued_fair_idx, at
 * most MAX_CLAIM_PRINCIPALS, starting after the one served first last
 * time) and takes an equal share of the room from each, highest
 * priority first and then oldest.  A role with a long backlog delays
 * another role's run by about one claim, not by its backlog.
 */
#define MAX_CLAIM_PRINCIPALS 64

static const char principals_sql[] =
"WITH RECURSIVE p(pid) AS ( "
"  SELECT (SELECT r.principal_id::pg_catalog.oid FROM tuvl.runs r "
"          WHERE r.status OPERATOR(pg_catalog.=) 'queued' "
"            AND r.principal_id::pg_catalog.oid OPERATOR(pg_catalog.>) $1 "
"          ORDER BY r.principal_id::pg_catalog.oid LIMIT 1) "
"  UNION ALL "
"  SELECT (SELECT r.principal_id::pg_catalog.oid FROM tuvl.runs r "
"          WHERE r.status OPERATOR(pg_catalog.=) 'queued' "
"            AND r.principal_id::pg_catalog.oid OPERATOR(pg_catalog.>) p.pid "
"          ORDER BY r.principal_id::pg_catalog.oid LIMIT 1) "
"  FROM p WHERE p.pid IS NOT NULL) "
"SELECT pid FROM p WHERE pid IS NOT NULL LIMIT $2";

static const char claim_sql[] =
"UPDATE tuvl.runs r SET status = 'running', attempt = r.attempt OPERATOR(pg_catalog.+) 1, "
"  lease_owner = $2, lease_epoch = $3, lease_expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) $4, "
"  started_at = COALESCE(r.started_at, pg_catalog.now()) "
"WHERE r.id OPERATOR(pg_catalog.=) ANY (ARRAY( "
"    SELECT c.id FROM ROWS FROM (pg_catalog.unnest($5::pg_catalog.oid[]), "
"                                pg_catalog.unnest($6::pg_catalog.int4[])) AS q(pid, k) "
"    CROSS JOIN LATERAL (SELECT x.id FROM tuvl.runs x "
"                        WHERE x.status OPERATOR(pg_catalog.=) 'queued' "
"                          AND x.principal_id::pg_catalog.oid OPERATOR(pg_catalog.=) q.pid "
"                        ORDER BY x.principal_id::pg_catalog.oid, x.priority DESC, x.id "
"                        LIMIT q.k FOR UPDATE SKIP LOCKED) c)) "
"  AND r.status OPERATOR(pg_catalog.=) 'queued' "
"RETURNING r.id, r.attempt, r.workflow, r.workflow_version, r.principal, "
"  r.context, r.current_step, r.last_seq, r.step_state, r.control, r.compensation, "
"  r.principal_id";

/* Where the next claim starts looking for principals. */
static Oid	claim_cursor = InvalidOid;

/* How many principals had queued runs at the last claim. */
int			LeaseQueuedPrincipals = 0;

/* Up to max principals with queued runs whose OID is above after. */
static int
principals_after(Oid after, int max, Oid *out)
{
	static const Oid types[2] = {OIDOID, INT4OID};
	Datum		values[2];
	uint64		n;

	values[0] = ObjectIdGetDatum(after);
	values[1] = Int32GetDatum(max);
	n = SpiExec(principals_sql, 2, types, values, NULL, SPI_OK_SELECT);
	for (uint64 i = 0; i < n; i++)
	{
		bool		isnull;

		out[i] = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1,
												&isnull));
	}
	return (int) n;
}

/*
 * Claim up to max_runs queued runs, shared fairly among their principals
 * (see above); returns a List (in runs_cxt) of RunState, each in its own
 * context under runs_cxt.  *more tells whether a principal had more
 * queued runs than its share.
 */
List *
LeaseClaim(MemoryContext runs_cxt, int max_runs, int64 epoch, int lease_ms, bool *more)
{
	static const Oid types[6] = {INT4OID, INT4OID, INT8OID, INTERVALOID, OIDARRAYOID, INT4ARRAYOID};
	Datum		values[6];
	Interval   *lease = palloc0(sizeof(Interval));
	List	   *runs = NIL;
	uint64		n;
	SPITupleTable *tt;
	MemoryContext old;
	SecurityFrame frame;
	Oid			pids[MAX_CLAIM_PRINCIPALS];
	Datum		pidd[MAX_CLAIM_PRINCIPALS];
	Datum		quota[MAX_CLAIM_PRINCIPALS];
	int			got[MAX_CLAIM_PRINCIPALS];
	int			np;

	*more = false;
	SecurityAsOwner(&frame);
	np = principals_after(claim_cursor, MAX_CLAIM_PRINCIPALS, pids);
	if (np < MAX_CLAIM_PRINCIPALS && OidIsValid(claim_cursor))
	{
		/* wrap around: the principals up to the cursor */
		Oid			rest[MAX_CLAIM_PRINCIPALS];
		int			nr = principals_after(InvalidOid, MAX_CLAIM_PRINCIPALS - np, rest);

		for (int i = 0; i < nr; i++)
			if (rest[i] <= claim_cursor)
				pids[np++] = rest[i];
	}
	LeaseQueuedPrincipals = np;
	if (np == 0)
	{
		SecurityRestore(&frame);
		claim_cursor = InvalidOid;
		return NIL;
	}
	for (int i = 0; i < np; i++)
	{
		int			k = max_runs / np + (i < max_runs % np ? 1 : 0);

		pidd[i] = ObjectIdGetDatum(pids[i]);
		quota[i] = Int32GetDatum(k);
		got[i] = 0;
	}
	/* the next claim starts after the last principal that got a share */
	claim_cursor = pids[Min(np, max_runs) - 1];

	lease->time = (int64) lease_ms * 1000;
	values[0] = Int32GetDatum(max_runs);
	values[1] = Int32GetDatum(MyProcPid);
	values[2] = Int64GetDatum(epoch);
	values[3] = IntervalPGetDatum(lease);
	values[4] = PointerGetDatum(construct_array(pidd, np, OIDOID, sizeof(Oid), true, TYPALIGN_INT));
	values[5] = PointerGetDatum(construct_array(quota, np, INT4OID, 4, true, TYPALIGN_INT));
	n = SpiExec(claim_sql, 6, types, values, NULL, SPI_OK_UPDATE_RETURNING);
	SecurityRestore(&frame);
	tt = SPI_tuptable;
	for (uint64 i = 0; i < n; i++)
	{
		HeapTuple	tup = tt->vals[i];
		TupleDesc	td = tt->tupdesc;
		bool		isnull;
		char	   *step = SPI_getvalue(tup, td, 7);
		RunState   *run;

		{
			Oid			pid = DatumGetObjectId(SPI_getbinval(tup, td, 12, &isnull));

			for (int j = 0; j < np; j++)
				if (pids[j] == pid && ++got[j] >= DatumGetInt32(quota[j]))
					*more = true;
		}
		run = RunStateCreate(runs_cxt,
							 DatumGetInt64(SPI_getbinval(tup, td, 1, &isnull)),
							 DatumGetInt32(SPI_getbinval(tup, td, 2, &isnull)),
							 SPI_getvalue(tup, td, 3),
							 DatumGetInt32(SPI_getbinval(tup, td, 4, &isnull)),
							 DatumGetObjectId(SPI_getbinval(tup, td, 12, &isnull)),
							 SPI_getvalue(tup, td, 5),
							 DatumGetJsonbP(SPI_getbinval(tup, td, 6, &isnull)),
							 step,
							 DatumGetInt32(SPI_getbinval(tup, td, 8, &isnull)),
							 NULL);
		{
			Datum		ss = SPI_getbinval(tup, td, 9, &isnull);

			if (!isnull)
			{
				old = MemoryContextSwitchTo(run->cxt);
				run->step_state = DatumGetJsonbPCopy(ss);
				MemoryContextSwitchTo(old);
			}
			ss = SPI_getbinval(tup, td, 10, &isnull);
			if (!isnull)
			{
				old = MemoryContextSwitchTo(run->cxt);
				run->control = DatumGetJsonbPCopy(ss);
				MemoryContextSwitchTo(old);
			}
			ss = SPI_getbinval(tup, td, 11, &isnull);
			if (!isnull)
			{
				old = MemoryContextSwitchTo(run->cxt);
				run->compensation = DatumGetJsonbPCopy(ss);
				MemoryContextSwitchTo(old);
			}
		}
		old = MemoryContextSwitchTo(runs_cxt);
		runs = lappend(runs, run);
		MemoryContextSwitchTo(old);
	}
	return runs;
}

static const char renew_sql[] =
"UPDATE tuvl.runs r SET lease_expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) $3 "
"FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.int4[])) AS h(id, attempt) "
"WHERE r.id OPERATOR(pg_catalog.=) h.id AND r.attempt OPERATOR(pg_catalog.=) h.attempt "
"  AND r.status OPERATOR(pg_catalog.=) ANY ('{running,compensating}'::pg_catalog.text[]) "
"RETURNING r.id";

/*
 * Renew the leases of runs; returns the runs whose lease was lost (the
 * caller drops them).
 */
List *
LeaseRenew(List *runs, int lease_ms)
{
	static const Oid types[3] = {INT8ARRAYOID, INT4ARRAYOID, INTERVALOID};
	int			n = list_length(runs);
	Datum	   *ids;
	Datum	   *attempts;
	Datum		values[3];
	Interval   *lease = palloc0(sizeof(Interval));
	uint64		kept;
	List	   *lost = NIL;
	ListCell   *lc;
	int			i = 0;
	SecurityFrame frame;

	if (n == 0)
		return NIL;
	ids = palloc(sizeof(Datum) * n);
	attempts = palloc(sizeof(Datum) * n);
	foreach(lc, runs)
	{
		RunState   *run = lfirst(lc);

		ids[i] = Int64GetDatum(run->id);
		attempts[i] = Int32GetDatum(run->attempt);
		i++;
	}
	lease->time = (int64) lease_ms * 1000;
	values[0] = PointerGetDatum(construct_array(ids, n, INT8OID, 8, true, TYPALIGN_DOUBLE));
	values[1] = PointerGetDatum(construct_array(attempts, n, INT4OID, 4, true, TYPALIGN_INT));
	values[2] = IntervalPGetDatum(lease);
	SecurityAsOwner(&frame);
	kept = SpiExec(renew_sql, 3, types, values, NULL, SPI_OK_UPDATE_RETURNING);
	SecurityRestore(&frame);
	if (kept == (uint64) n)
		return NIL;
	foreach(lc, runs)
	{
		RunState   *run = lfirst(lc);
		bool		found = false;

		for (uint64 j = 0; j < kept && !found; j++)
		{
			bool		isnull;

			found = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[j],
												SPI_tuptable->tupdesc, 1, &isnull)) == run->id;
		}
		if (!found)
			lost = lappend(lost, run);
	}
	return lost;
}

static const char release_sql[] =
"UPDATE tuvl.runs r SET status = 'queued', lease_owner = NULL, lease_epoch = NULL, "
"  lease_expires_at = NULL "
"FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.int4[])) AS h(id, attempt) "
"WHERE r.id OPERATOR(pg_catalog.=) h.id AND r.attempt OPERATOR(pg_catalog.=) h.attempt "
"  AND r.status OPERATOR(pg_catalog.=) ANY ('{running,compensating}'::pg_catalog.text[])";

/*
 * Give runs back to the queue (the worker cannot go on with them); only
 * runs still held by these attempts are touched.  Returns how many.
 */
uint64
LeaseRelease(int n, const int64 *ids, const int32 *attempts)
{
	static const Oid types[2] = {INT8ARRAYOID, INT4ARRAYOID};
	Datum	   *idd = palloc(sizeof(Datum) * Max(n, 1));
	Datum	   *atd = palloc(sizeof(Datum) * Max(n, 1));
	Datum		values[2];
	SecurityFrame frame;
	uint64		done;

	for (int i = 0; i < n; i++)
	{
		idd[i] = Int64GetDatum(ids[i]);
		atd[i] = Int32GetDatum(attempts[i]);
	}
	values[0] = PointerGetDatum(construct_array(idd, n, INT8OID, 8, true, TYPALIGN_DOUBLE));
	values[1] = PointerGetDatum(construct_array(atd, n, INT4OID, 4, true, TYPALIGN_INT));
	SecurityAsOwner(&frame);
	done = SpiExec(release_sql, 2, types, values, NULL, SPI_OK_UPDATE);
	SecurityRestore(&frame);
	return done;
}

static const char reclaim_sql[] =
"UPDATE tuvl.runs SET status = 'queued', lease_owner = NULL, lease_epoch = NULL, "
"  lease_expires_at = NULL "
"WHERE id OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT id FROM tuvl.runs "
"    WHERE status OPERATOR(pg_catalog.=) ANY ('{running,compensating}'::pg_catalog.text[]) "
"      AND NOT tuvl._lease_holder_alive(lease_owner, lease_epoch) "
"    FOR UPDATE SKIP LOCKED))";

/*
 * Return to the queue every run whose lease holder no longer heartbeats:
 * it died, exited, belongs to an older server incarnation (crash or
 * restart), or has been stalled for longer than tuvl.lease_timeout.
 * Runs of dead holders come back at once, not after the lease timeout.
 * Returns how many runs were requeued.
 */
uint64
LeaseReclaim(void)
{
	SecurityFrame frame;
	uint64		n;

	SecurityAsOwner(&frame);
	n = SpiExec(reclaim_sql, 0, NULL, NULL, NULL, SPI_OK_UPDATE);
	SecurityRestore(&frame);
	return n;
}
