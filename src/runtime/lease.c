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

#include "jsonutil.h"
#include "lease.h"
#include "queue.h"
#include "runtime.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"

/*
 * Fairness.  Claims share the queue among the roles that have runs in
 * it: each claim takes the roles from the registry (queue.c), starting
 * after the one served last time, and an equal share of the room from
 * each, highest priority first and then oldest, from the role's cursor
 * on.  A role with a long backlog delays another role's run by about one
 * claim, not by its backlog.
 */
#define MAX_CLAIM_PRINCIPALS TUVL_QUEUE_ROLES

/* A skip scan of runs_queued_fair_idx: the roles with queued runs. */
static const char principals_sql[] =
"WITH RECURSIVE p(pid) AS ( "
"  SELECT (SELECT r.principal_id::pg_catalog.oid FROM tuvl.runs r "
"          WHERE r.status OPERATOR(pg_catalog.=) 'queued' AND r.held_by IS NULL "
"          ORDER BY r.principal_id::pg_catalog.oid LIMIT 1) "
"  UNION ALL "
"  SELECT (SELECT r.principal_id::pg_catalog.oid FROM tuvl.runs r "
"          WHERE r.status OPERATOR(pg_catalog.=) 'queued' AND r.held_by IS NULL "
"            AND r.principal_id::pg_catalog.oid OPERATOR(pg_catalog.>) p.pid "
"          ORDER BY r.principal_id::pg_catalog.oid LIMIT 1) "
"  FROM p WHERE p.pid IS NOT NULL) "
"SELECT pid FROM p WHERE pid IS NOT NULL LIMIT $1";

/*
 * Each role's share, from its cursor on: (key, id) is the run's place in
 * the index, key being -priority.  The runs are locked while still queued
 * (FOR UPDATE rechecks status), so the UPDATE needs no status condition:
 * with one, the planner may scan the whole partial index for the ids.
 */
static const char claim_sql[] =
"UPDATE tuvl.runs r SET status = 'running', attempt = r.attempt OPERATOR(pg_catalog.+) 1, "
"  lease_owner = $2, lease_epoch = $3, lease_expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) $4, "
"  started_at = COALESCE(r.started_at, pg_catalog.now()) "
"WHERE r.id OPERATOR(pg_catalog.=) ANY (ARRAY( "
"    SELECT c.id FROM ROWS FROM (pg_catalog.unnest($5::pg_catalog.oid[]), "
"                                pg_catalog.unnest($6::pg_catalog.int4[]), "
"                                pg_catalog.unnest($7::pg_catalog.int8[]), "
"                                pg_catalog.unnest($8::pg_catalog.int8[])) AS q(pid, k, after_key, after_id) "
"    CROSS JOIN LATERAL (SELECT x.id FROM tuvl.runs x "
"                        WHERE x.status OPERATOR(pg_catalog.=) 'queued' AND x.held_by IS NULL "
"                          AND x.principal_id::pg_catalog.oid OPERATOR(pg_catalog.=) q.pid "
"                          AND ROW(OPERATOR(pg_catalog.-) x.priority::pg_catalog.int8, x.id) "
"                              OPERATOR(pg_catalog.>) ROW(q.after_key, q.after_id) "
"                        ORDER BY x.principal_id::pg_catalog.oid, "
"                                 OPERATOR(pg_catalog.-) x.priority::pg_catalog.int8, x.id "
"                        LIMIT q.k FOR UPDATE SKIP LOCKED) c)) "
"RETURNING r.id, r.attempt, r.workflow, r.workflow_version, r.principal, "
"  r.context, r.current_step, r.last_seq, r.step_state, r.control, r.compensation, "
"  r.principal_id, r.priority, r.hook OPERATOR(pg_catalog.->>) 'step', r.started_at, r.traceparent, "
"  CASE WHEN r.parent_step IS NOT NULL THEN r.parent_run_id END, r.created_at, r.artifacts, "
"  r.recoveries";

/*
 * The first queued run in each of some ranges of a role's queue, bounds
 * excluded: a run the claim's SKIP LOCKED passed over, because another
 * transaction held the row.  The claim's own runs are 'running' by now,
 * so they do not count.
 */
static const char skipped_sql[] =
"SELECT q.pid, s.key, s.id "
"FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.oid[]), "
"                pg_catalog.unnest($2::pg_catalog.int8[]), pg_catalog.unnest($3::pg_catalog.int8[]), "
"                pg_catalog.unnest($4::pg_catalog.int8[]), pg_catalog.unnest($5::pg_catalog.int8[])) "
"     AS q(pid, after_key, after_id, last_key, last_id) "
"CROSS JOIN LATERAL (SELECT OPERATOR(pg_catalog.-) x.priority::pg_catalog.int8 AS key, x.id "
"                    FROM tuvl.runs x "
"                    WHERE x.status OPERATOR(pg_catalog.=) 'queued' AND x.held_by IS NULL "
"                      AND x.principal_id::pg_catalog.oid OPERATOR(pg_catalog.=) q.pid "
"                      AND ROW(OPERATOR(pg_catalog.-) x.priority::pg_catalog.int8, x.id) "
"                          OPERATOR(pg_catalog.>) ROW(q.after_key, q.after_id) "
"                      AND ROW(OPERATOR(pg_catalog.-) x.priority::pg_catalog.int8, x.id) "
"                          OPERATOR(pg_catalog.<) ROW(q.last_key, q.last_id) "
"                    ORDER BY x.principal_id::pg_catalog.oid, "
"                             OPERATOR(pg_catalog.-) x.priority::pg_catalog.int8, x.id "
"                    LIMIT 1) s";

/* A run a claim took: the index of its role in the claim, and its place. */
typedef struct ClaimedPos
{
	int			role;
	QueuePos	pos;
} ClaimedPos;

static int
claimed_pos_cmp(const void *a, const void *b)
{
	const ClaimedPos *x = a;
	const ClaimedPos *y = b;

	if (x->role != y->role)
		return x->role < y->role ? -1 : 1;
	return QueuePosCmp(x->pos, y->pos);
}

/* No position lies strictly between a and b (a before b). */
static inline bool
adjacent(QueuePos a, QueuePos b)
{
	return a.key == b.key && a.id != PG_INT64_MAX && b.id == a.id + 1;
}

/*
 * Find, for each role claimed for, the first queued run the claim passed
 * over (see queue.c: the cursor must not move past it).  Such a run lies
 * between where the claim started and the last run it took (anywhere
 * after the start when it took none), and not where two runs it took
 * are neighbours in the queue: only the gaps between them are looked at,
 * each by one probe of the index.  Runs queued together have consecutive
 * ids, so a claim of them usually has no gap and runs no query at all;
 * a scan over the whole range would visit the heap for each run taken
 * (and for each dead entry between them while a long transaction keeps
 * them), which made every claim cost milliseconds while a slow step ran.
 * As the owner.
 */
static void
find_skipped(QueueClaim *claims, int nq, ClaimedPos *taken, int ntaken)
{
	static const Oid types[5] = {OIDARRAYOID, INT8ARRAYOID, INT8ARRAYOID, INT8ARRAYOID, INT8ARRAYOID};
	Datum		values[5];
	Datum	   *cols[5];
	int			ngaps = 0;
	int			t = 0;
	uint64		n;

	for (int c = 0; c < 5; c++)
		cols[c] = palloc(sizeof(Datum) * (ntaken + nq));
	qsort(taken, ntaken, sizeof(ClaimedPos), claimed_pos_cmp);
	for (int j = 0; j < nq; j++)
	{
		QueuePos	prev = claims[j].after;
		bool		any = false;

		for (; t < ntaken && taken[t].role == j; t++)
		{
			QueuePos	next = taken[t].pos;

			if (!adjacent(prev, next))
			{
				cols[0][ngaps] = ObjectIdGetDatum(claims[j].role);
				cols[1][ngaps] = Int64GetDatum(prev.key);
				cols[2][ngaps] = Int64GetDatum(prev.id);
				cols[3][ngaps] = Int64GetDatum(next.key);
				cols[4][ngaps] = Int64GetDatum(next.id);
				ngaps++;
			}
			prev = next;
			any = true;
		}
		/* it took nothing: a run it passed over may be anywhere after */
		if (!any)
		{
			cols[0][ngaps] = ObjectIdGetDatum(claims[j].role);
			cols[1][ngaps] = Int64GetDatum(prev.key);
			cols[2][ngaps] = Int64GetDatum(prev.id);
			cols[3][ngaps] = Int64GetDatum(PG_INT64_MAX);
			cols[4][ngaps] = Int64GetDatum(PG_INT64_MAX);
			ngaps++;
		}
	}
	if (ngaps == 0)
		return;
	values[0] = PointerGetDatum(construct_array(cols[0], ngaps, OIDOID, sizeof(Oid), true, TYPALIGN_INT));
	for (int c = 1; c < 5; c++)
		values[c] = PointerGetDatum(construct_array(cols[c], ngaps, INT8OID, 8, true, TYPALIGN_DOUBLE));

	/*
	 * one plan for any arrays: an index scan of runs_queued_fair_idx, at any
	 * size
	 */
	n = SpiExecOrdered(skipped_sql, 5, types, values, NULL, SPI_OK_SELECT);
	for (uint64 i = 0; i < n; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	td = SPI_tuptable->tupdesc;
		bool		isnull;
		Oid			pid = DatumGetObjectId(SPI_getbinval(tup, td, 1, &isnull));
		QueuePos	found;

		found.key = DatumGetInt64(SPI_getbinval(tup, td, 2, &isnull));
		found.id = DatumGetInt64(SPI_getbinval(tup, td, 3, &isnull));
		for (int j = 0; j < nq; j++)
			if (claims[j].role == pid &&
				(!claims[j].skipped || QueuePosCmp(found, claims[j].first_skipped) < 0))
			{
				claims[j].skipped = true;
				claims[j].first_skipped = found;
			}
	}
}

/* The rest of a claimed run's row (claim_sql's columns 9 and on). */
static void
load_claimed(RunState *run, HeapTuple tup, TupleDesc td)
{
	MemoryContext old = MemoryContextSwitchTo(run->cxt);
	bool		isnull;
	Datum		d;

	d = SPI_getbinval(tup, td, 9, &isnull);
	if (!isnull)
		run->step_state = DatumGetJsonbPCopy(d);
	d = SPI_getbinval(tup, td, 10, &isnull);
	if (!isnull)
		run->control = DatumGetJsonbPCopy(d);
	d = SPI_getbinval(tup, td, 11, &isnull);
	if (!isnull)
		run->compensation = DatumGetJsonbPCopy(d);
	d = SPI_getbinval(tup, td, 15, &isnull);
	if (!isnull)
		run->started_at = DatumGetTimestampTz(d);
	if (SPI_getvalue(tup, td, 16) != NULL)
		run->traceparent = pstrdup(SPI_getvalue(tup, td, 16));
	d = SPI_getbinval(tup, td, 17, &isnull);
	run->parent_id = isnull ? 0 : DatumGetInt64(d);
	d = SPI_getbinval(tup, td, 18, &isnull);
	run->created_at = isnull ? 0 : DatumGetTimestampTz(d);
	/* the artifact versions it pinned (artifact.c reads them otherwise) */
	d = SPI_getbinval(tup, td, 19, &isnull);
	run->artifacts = isnull ? JsonEmptyObject() : DatumGetJsonbPCopy(d);
	MemoryContextSwitchTo(old);
	run->recoveries = DatumGetInt32(SPI_getbinval(tup, td, 20, &isnull));
	d = SPI_getbinval(tup, td, 13, &isnull);
	run->priority = isnull ? 0 : DatumGetInt32(d);
	/* a notify hook's run executes one step */
	if (SPI_getvalue(tup, td, 14) != NULL)
		run->notify_step = WorkflowFindStep(WorkflowLoad(run->workflow, run->version),
											SPI_getvalue(tup, td, 14));
}

/* The role after which the next claim starts. */
static Oid	claim_cursor = InvalidOid;

/* How many roles had queued runs at the last claim. */
int			LeaseQueuedPrincipals = 0;

/*
 * Find the roles with queued runs by a skip scan and tell the registry
 * (when it may have missed some: see queue.c).
 */
static void
discover_principals(void)
{
	static const Oid types[1] = {INT4OID};
	Datum		values[1];
	Oid			pids[MAX_CLAIM_PRINCIPALS];
	uint32		overflow_gen;
	uint64		n;

	if (!QueueNeedsDiscovery(&overflow_gen))
		return;
	values[0] = Int32GetDatum(MAX_CLAIM_PRINCIPALS);
	n = SpiExecOrdered(principals_sql, 1, types, values, NULL, SPI_OK_SELECT);
	for (uint64 i = 0; i < n; i++)
	{
		bool		isnull;

		pids[i] = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1,
												 &isnull));
	}
	QueueLearn(pids, (int) n, n < MAX_CLAIM_PRINCIPALS, overflow_gen);
}

static int
claim_role_cmp(const void *a, const void *b)
{
	Oid			x = ((const QueueClaim *) a)->role;
	Oid			y = ((const QueueClaim *) b)->role;

	return x < y ? -1 : x > y ? 1 : 0;
}

/*
 * The roles to claim for, in turn: the ones after the last claim's last
 * role first.  Sets each one's quota of max_runs.
 */
static void
share_room(QueueClaim *claims, int n, int max_runs)
{
	QueueClaim	sorted[MAX_CLAIM_PRINCIPALS];
	int			first = 0;

	qsort(claims, n, sizeof(QueueClaim), claim_role_cmp);
	while (first < n && claims[first].role <= claim_cursor)
		first++;
	for (int i = 0; i < n; i++)
	{
		sorted[i] = claims[(first + i) % n];
		sorted[i].quota = max_runs / n + (i < max_runs % n ? 1 : 0);
	}
	for (int i = 0; i < n; i++)
		claims[i] = sorted[i];
	claim_cursor = claims[Min(n, max_runs) - 1].role;
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
	static const Oid types[8] = {INT4OID, INT4OID, INT8OID, INTERVALOID,
	OIDARRAYOID, INT4ARRAYOID, INT8ARRAYOID, INT8ARRAYOID};
	Datum		values[8];
	Interval   *lease = palloc0(sizeof(Interval));
	List	   *runs = NIL;
	uint64		n;
	SPITupleTable *tt;
	MemoryContext old;
	SecurityFrame frame;
	QueueClaim	claims[MAX_CLAIM_PRINCIPALS];
	Datum		pidd[MAX_CLAIM_PRINCIPALS];
	Datum		quota[MAX_CLAIM_PRINCIPALS];
	Datum		after_key[MAX_CLAIM_PRINCIPALS];
	Datum		after_id[MAX_CLAIM_PRINCIPALS];
	int			np;
	int			nq;
	uint64		control_gen;
	ClaimedPos *taken;
	int			ntaken = 0;

	*more = false;
	SecurityAsOwner(&frame);
	discover_principals();
	np = QueueClaimBegin(claims, MAX_CLAIM_PRINCIPALS);
	LeaseQueuedPrincipals = np;
	if (np == 0)
	{
		SecurityRestore(&frame);
		return NIL;
	}
	share_room(claims, np, max_runs);
	nq = Min(np, max_runs);
	for (int i = 0; i < nq; i++)
	{
		pidd[i] = ObjectIdGetDatum(claims[i].role);
		quota[i] = Int32GetDatum(claims[i].quota);
		after_key[i] = Int64GetDatum(claims[i].after.key);
		after_id[i] = Int64GetDatum(claims[i].after.id);
	}

	lease->time = (int64) lease_ms * 1000;
	values[0] = Int32GetDatum(max_runs);
	values[1] = Int32GetDatum(MyProcPid);
	values[2] = Int64GetDatum(epoch);
	values[3] = IntervalPGetDatum(lease);
	values[4] = PointerGetDatum(construct_array(pidd, nq, OIDOID, sizeof(Oid), true, TYPALIGN_INT));
	values[5] = PointerGetDatum(construct_array(quota, nq, INT4OID, 4, true, TYPALIGN_INT));
	values[6] = PointerGetDatum(construct_array(after_key, nq, INT8OID, 8, true, TYPALIGN_DOUBLE));
	values[7] = PointerGetDatum(construct_array(after_id, nq, INT8OID, 8, true, TYPALIGN_DOUBLE));
	control_gen = TuvlControlGen();

	/*
	 * Generic, like the two lookups around it, but planned without sequential
	 * scans: a generic plan made while tuvl.runs is nearly empty would find
	 * the claimed ids by one, and keep doing so over a table grown since,
	 * until the next ANALYZE.  (Planning it at every claim cost 3 % of a
	 * worker's time at 5,000 one-step runs a second.)
	 */
	n = SpiExecOrdered(claim_sql, 8, types, values, NULL, SPI_OK_UPDATE_RETURNING);
	SecurityRestore(&frame);
	tt = SPI_tuptable;
	taken = palloc(sizeof(ClaimedPos) * Max(n, 1));
	for (uint64 i = 0; i < n; i++)
	{
		HeapTuple	tup = tt->vals[i];
		TupleDesc	td = tt->tupdesc;
		bool		isnull;
		char	   *step = SPI_getvalue(tup, td, 7);
		RunState   *run;

		{
			Oid			pid = DatumGetObjectId(SPI_getbinval(tup, td, 12, &isnull));
			QueuePos	pos;

			pos.key = -(int64) DatumGetInt32(SPI_getbinval(tup, td, 13, &isnull));
			pos.id = DatumGetInt64(SPI_getbinval(tup, td, 1, &isnull));
			for (int j = 0; j < nq; j++)
				if (claims[j].role == pid)
				{
					if (claims[j].got == 0 || QueuePosCmp(claims[j].last, pos) < 0)
						claims[j].last = pos;
					if (++claims[j].got >= claims[j].quota)
						*more = true;
					taken[ntaken].role = j;
					taken[ntaken++].pos = pos;
				}
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
		load_claimed(run, tup, td);
		run->control_gen = control_gen;
		old = MemoryContextSwitchTo(runs_cxt);
		runs = lappend(runs, run);
		MemoryContextSwitchTo(old);
	}
	SecurityAsOwner(&frame);
	find_skipped(claims, nq, taken, ntaken);
	SecurityRestore(&frame);
	QueueClaimEnd(claims, np);
	return runs;
}

/*
 * Renewals skip rows a session holds locked (its tuvl.pause_run() on the
 * run, not committed yet): a renewal is for monitoring only, and waiting
 * for such a session would stall the worker.
 */
static const char renew_sql[] =
"UPDATE tuvl.runs r SET lease_expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) $3 "
"WHERE r.id OPERATOR(pg_catalog.=) ANY (ARRAY( "
"    SELECT x.id FROM tuvl.runs x, "
"      ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.int4[])) AS h(id, attempt) "
"    WHERE x.id OPERATOR(pg_catalog.=) h.id AND x.attempt OPERATOR(pg_catalog.=) h.attempt "
"      AND x.status OPERATOR(pg_catalog.=) ANY ($4::pg_catalog.text[]) "
"    FOR UPDATE OF x SKIP LOCKED)) "
"RETURNING r.id";

/* Of runs not renewed, those still held by the attempt: locked, not lost. */
static const char still_held_sql[] =
"SELECT x.id FROM tuvl.runs x, "
"  ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.int4[])) AS h(id, attempt) "
"WHERE x.id OPERATOR(pg_catalog.=) h.id AND x.attempt OPERATOR(pg_catalog.=) h.attempt "
"  AND x.status OPERATOR(pg_catalog.=) ANY ($3::pg_catalog.text[])";

/* Is id among the first column of the n rows of SPI_tuptable? */
static bool
returned(int64 id, uint64 n)
{
	for (uint64 j = 0; j < n; j++)
	{
		bool		isnull;

		if (DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[j], SPI_tuptable->tupdesc, 1, &isnull)) == id)
			return true;
	}
	return false;
}

/*
 * Renew the leases of runs; returns the runs whose lease was lost (the
 * caller drops them).  Planned at each renewal (SpiExecReplanned), for the
 * runs renewed and the table as they are then: a generic plan made on an
 * empty table scanned the whole of it at every renewal, and one whose
 * held statuses were a constant joined every held run of every worker
 * with every run renewed, quadratic in the runs held.
 */
List *
LeaseRenew(List *runs, int lease_ms)
{
	static const Oid types[4] = {INT8ARRAYOID, INT4ARRAYOID, INTERVALOID, TEXTARRAYOID};
	int			n = list_length(runs);
	Datum	   *ids;
	Datum	   *attempts;
	Datum		values[4];
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
	values[3] = StatusHeldParam();
	SecurityAsOwner(&frame);
	kept = SpiExecReplanned(renew_sql, 4, types, values, NULL, SPI_OK_UPDATE_RETURNING);
	SecurityRestore(&frame);
	if (kept == (uint64) n)
		return NIL;
	/* not renewed: lost, or only locked by a session (read without waiting) */
	{
		static const Oid check_types[3] = {INT8ARRAYOID, INT4ARRAYOID, TEXTARRAYOID};
		Datum		check_values[3] = {values[0], values[1], values[3]};
		uint64		held;

		SecurityAsOwner(&frame);
		held = SpiExecReplanned(still_held_sql, 3, check_types, check_values, NULL, SPI_OK_SELECT);
		SecurityRestore(&frame);
		foreach(lc, runs)
		{
			RunState   *run = lfirst(lc);

			if (!returned(run->id, held))
				lost = lappend(lost, run);
		}
	}
	return lost;
}

/* Rows a session holds locked are skipped: see LeaseRelease. */
static const char release_sql[] =
"UPDATE tuvl.runs r SET status = 'queued', lease_owner = NULL, lease_epoch = NULL, "
"  lease_expires_at = NULL "
"WHERE r.id OPERATOR(pg_catalog.=) ANY (ARRAY( "
"    SELECT x.id FROM tuvl.runs x, "
"      ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), pg_catalog.unnest($2::pg_catalog.int4[])) AS h(id, attempt) "
"    WHERE x.id OPERATOR(pg_catalog.=) h.id AND x.attempt OPERATOR(pg_catalog.=) h.attempt "
"      AND x.status OPERATOR(pg_catalog.=) ANY ($3::pg_catalog.text[]) "
"    FOR UPDATE OF x SKIP LOCKED)) "
"RETURNING r.principal_id, r.priority, r.id";

/*
 * Give runs back to the queue (the worker cannot go on with them); only
 * runs still held by these attempts are touched.  A run whose row a
 * session holds locked is not waited for: released[i] (when not NULL)
 * tells which were given back, or are no longer held by the attempt
 * anyway; the caller keeps the others, to give them back later.
 * Returns how many were given back.
 */
uint64
LeaseRelease(int n, const int64 *ids, const int32 *attempts, bool *released)
{
	static const Oid types[3] = {INT8ARRAYOID, INT4ARRAYOID, TEXTARRAYOID};
	Datum	   *idd = palloc(sizeof(Datum) * Max(n, 1));
	Datum	   *atd = palloc(sizeof(Datum) * Max(n, 1));
	Datum		values[3];
	SecurityFrame frame;
	uint64		done;

	for (int i = 0; i < n; i++)
	{
		idd[i] = Int64GetDatum(ids[i]);
		atd[i] = Int32GetDatum(attempts[i]);
	}
	values[0] = PointerGetDatum(construct_array(idd, n, INT8OID, 8, true, TYPALIGN_DOUBLE));
	values[1] = PointerGetDatum(construct_array(atd, n, INT4OID, 4, true, TYPALIGN_INT));
	values[2] = StatusHeldParam();
	SecurityAsOwner(&frame);
	done = SpiExecReplanned(release_sql, 3, types, values, NULL, SPI_OK_UPDATE_RETURNING);
	QueueNoteReturnedAtCommit();
	SecurityRestore(&frame);
	if (released)
	{
		uint64		held = 0;

		for (int i = 0; i < n; i++)
			released[i] = true;
		if (done < (uint64) n)
		{
			/* the rest: still ours (locked by a session), or no longer ours */
			SecurityAsOwner(&frame);
			held = SpiExecReplanned(still_held_sql, 3, types, values, NULL, SPI_OK_SELECT);
			SecurityRestore(&frame);
			for (int i = 0; i < n; i++)
				released[i] = !returned(ids[i], held);
		}
	}
	return done;
}

static const char reclaim_sql[] =
"UPDATE tuvl.runs SET status = 'queued', lease_owner = NULL, lease_epoch = NULL, "
"  lease_expires_at = NULL, recoveries = recoveries OPERATOR(pg_catalog.+) 1 "
"WHERE id OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT id FROM tuvl.runs "
"    WHERE status OPERATOR(pg_catalog.=) ANY ('{running,compensating}'::pg_catalog.text[]) "
"      AND NOT tuvl._lease_holder_alive(lease_owner, lease_epoch) "
"    FOR UPDATE SKIP LOCKED)) "
"RETURNING principal_id, priority, id";

/*
 * Return to the queue every run whose lease holder no longer heartbeats:
 * it died, exited, belongs to an older server incarnation (crash or
 * restart), or has been stalled for longer than tuvl.lease_timeout.
 * Runs of dead holders come back at once, not after the lease timeout.
 * Each counts a recovery: a run that comes back this way more than
 * tuvl.max_recoveries times without progress in between (checkpoint.c)
 * is failed when next claimed, so that a response or a step that kills
 * its worker is not sent or run again and again (worker.c).  A worker
 * that lets go of runs on purpose (LeaseRelease) counts nothing.
 * Returns how many runs were requeued.
 */
uint64
LeaseReclaim(void)
{
	SecurityFrame frame;
	uint64		n;

	SecurityAsOwner(&frame);
	n = SpiExecReplanned(reclaim_sql, 0, NULL, NULL, NULL, SPI_OK_UPDATE_RETURNING);
	QueueNoteReturnedAtCommit();
	SecurityRestore(&frame);
	return n;
}
