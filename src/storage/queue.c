/*-------------------------------------------------------------------------
 *
 * queue.c
 *	  The registry of roles with queued runs, and the claim cursors.
 *
 * A claim must not cost more as the queue ages.  Claimed runs leave dead
 * entries at the front of runs_queued_fair_idx until VACUUM (or, while a
 * long transaction such as a slow step holds the xmin horizon back, until
 * it ends); a claim that started from the front of a role's runs every
 * time would walk all of them, and so would a skip scan looking for the
 * roles that have queued runs.  Instead, shared memory keeps, for each
 * database, the roles with queued runs and for each one a cursor:
 *
 *	 every queued run of the role at or before the cursor (in claim order:
 *	 higher priority, then older) is claimed or being claimed.
 *
 * A claim scans from the cursor on and moves it to the last run it took,
 * or to just before the first run it passed over: SKIP LOCKED passes over
 * a queued run whose row another transaction holds (an operator's
 * steer_run() or an abort that rolls back), and that run must be claimed
 * once it is free.
 * Whatever makes a run queued (start_run, a run handed back, a lease
 * reclaimed, a resume) registers the run's position when its transaction
 * commits: a position at or before the cursor moves the cursor back to
 * just before it.  A run that commits while a claim is in progress may be
 * invisible to that claim's snapshot although the claim moves the cursor
 * past it, so positions registered meanwhile are remembered (low) and
 * the cursor never ends up past them.
 *
 * What the registry cannot see (rows changed by hand, a restore, more
 * roles than it holds) is found by a skip scan of the index: at start,
 * after an overflow, and every QUEUE_RESCAN_MS; a role's cursor is also
 * reset to the start every QUEUE_RESCAN_MS.  A role whose claim finds
 * nothing is forgotten until a run of it is queued again.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "executor/spi.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"

#include "queue.h"
#include "tuvl.h"

#define QUEUE_RESCAN_MS 10000

/* Runs queued by this transaction, one entry per role (the first position). */
#define MAX_PENDING_ROLES 16

typedef struct PendingQueued
{
	Oid			role;
	QueuePos	pos;
} PendingQueued;

static PendingQueued pending[MAX_PENDING_ROLES];
static int	n_pending = 0;
static bool pending_overflow = false;

/*
 * The roles of this worker's claim until its transaction ends: when it
 * aborts, what it took is queued again (QueueClaimAbandon).
 */
static Oid	claiming[TUVL_QUEUE_ROLES];
static int	n_claiming = 0;
static bool claim_scanning = false; /* between QueueClaimBegin and End */
static bool exit_hook_set = false;

static const QueuePos queue_start = {PG_INT64_MIN, 0};
static const QueuePos no_pos = {PG_INT64_MAX, PG_INT64_MAX};

/* The position just before p. */
static QueuePos
pos_before(QueuePos p)
{
	QueuePos	r = p;

	r.id--;
	return r;
}

static QueueState *
my_queue(Oid dboid)
{
	if (TuvlShmem == NULL)
		return NULL;
	for (int i = 0; i < TUVL_MAX_DATABASES; i++)
		if (TuvlShmem->dbs[i].dboid == dboid)
			return &TuvlShmem->dbs[i].queue;
	return NULL;
}

void
QueueResetState(QueueState *q)
{
	memset(q, 0, sizeof(QueueState));
	q->complete = false;
}

/* The role's entry, made when create (reusing one without queued runs). */
static QueueRoleState *
role_entry(QueueState *q, Oid role, bool create)
{
	QueueRoleState *unused = NULL;
	QueueRoleState *idle = NULL;

	for (int i = 0; i < TUVL_QUEUE_ROLES; i++)
	{
		QueueRoleState *r = &q->roles[i];

		if (r->role == role)
			return r;
		if (r->role == InvalidOid && unused == NULL)
			unused = r;
		else if (r->role != InvalidOid && !r->queued && r->scanners == 0 && idle == NULL)
			idle = r;
	}
	if (unused == NULL)
		unused = idle;
	if (!create || unused == NULL)
		return NULL;
	memset(unused, 0, sizeof(QueueRoleState));
	unused->role = role;
	unused->cursor = queue_start;
	unused->low = no_pos;
	return unused;
}

/* ---------------------------------------------------------------- backends */

/*
 * A run of role became queued at (priority, id).  Every path that makes
 * a run queued calls this; the registry learns it at commit, when the
 * run is visible to claims.
 */
void
QueueNoteAtCommit(Oid role, int32 priority, int64 id)
{
	QueuePos	pos;

	pos.key = -(int64) priority;
	pos.id = id;
	for (int i = 0; i < n_pending; i++)
		if (pending[i].role == role)
		{
			if (QueuePosCmp(pos, pending[i].pos) < 0)
				pending[i].pos = pos;
			return;
		}
	if (n_pending >= MAX_PENDING_ROLES)
	{
		pending_overflow = true;
		return;
	}
	pending[n_pending].role = role;
	pending[n_pending].pos = pos;
	n_pending++;
}

/*
 * The runs the last SPI statement made queued, each a row it returned
 * with (principal, priority, id) as its first three columns.
 */
void
QueueNoteReturnedAtCommit(void)
{
	for (uint64 i = 0; i < SPI_processed; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	td = SPI_tuptable->tupdesc;
		bool		isnull;

		QueueNoteAtCommit(DatumGetObjectId(SPI_getbinval(tup, td, 1, &isnull)),
						  DatumGetInt32(SPI_getbinval(tup, td, 2, &isnull)),
						  DatumGetInt64(SPI_getbinval(tup, td, 3, &isnull)));
	}
}

static void
queue_at_commit(void)
{
	QueueState *q;

	QueueClaimCommitted();
	if (n_pending == 0 && !pending_overflow)
		return;
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	q = my_queue(MyDatabaseId);
	if (q)
	{
		for (int i = 0; i < n_pending; i++)
		{
			QueueRoleState *r = role_entry(q, pending[i].role, true);

			if (r == NULL)
			{
				q->complete = false;
				q->overflow_gen++;
				continue;
			}
			r->queued = true;
			r->gen++;
			if (QueuePosCmp(pending[i].pos, r->cursor) <= 0)
				r->cursor = pos_before(pending[i].pos);
			if (r->scanners > 0 && QueuePosCmp(pending[i].pos, r->low) < 0)
				r->low = pending[i].pos;
		}
		if (pending_overflow)
		{
			q->complete = false;
			q->overflow_gen++;
		}
	}
	LWLockRelease(TuvlShmem->lock);
	n_pending = 0;
	pending_overflow = false;
}

/* At commit (queue_at_commit first): the claim, if any, holds. */
void
QueueClaimCommitted(void)
{
	n_claiming = 0;
	claim_scanning = false;
}

static void
queue_at_abort(void)
{
	n_pending = 0;
	pending_overflow = false;
	QueueClaimAbandon();
}

/*
 * Transaction callback (registered by init.c): the runs queued by a
 * transaction enter the registry when it commits, before any worker is
 * woken for them; an abort forgets them and the claim it made.
 */
void
QueueXactCallback(XactEvent event, void *arg)
{
	if ((event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT) && TuvlShmem)
		queue_at_commit();
	else if (event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT)
		queue_at_abort();
}

/* ---------------------------------------------------------------- workers */

/* Worker-local: when this worker last found the roles by a skip scan. */
static TimestampTz next_discovery = 0;

/*
 * Must the next claim find the roles by a skip scan of the index?  At
 * start, after an overflow, and every QUEUE_RESCAN_MS.  *overflow_gen
 * goes to QueueLearn.
 */
bool
QueueNeedsDiscovery(uint32 *overflow_gen)
{
	QueueState *q;
	bool		need;
	TimestampTz now = GetCurrentTimestamp();

	LWLockAcquire(TuvlShmem->lock, LW_SHARED);
	q = my_queue(MyDatabaseId);
	need = q == NULL || !q->complete || now >= next_discovery;
	*overflow_gen = q ? q->overflow_gen : 0;
	LWLockRelease(TuvlShmem->lock);
	if (need)
		next_discovery = TimestampTzPlusMilliseconds(now, QUEUE_RESCAN_MS);
	return need;
}

/*
 * A skip scan found these roles with queued runs (all of them, when
 * complete).  A role the registry thought had none gets its cursor reset:
 * its runs were queued by a path the registry did not see.
 */
void
QueueLearn(const Oid *roles, int n, bool complete, uint32 overflow_gen)
{
	QueueState *q;
	bool		room = true;

	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	q = my_queue(MyDatabaseId);
	if (q)
	{
		for (int i = 0; i < n; i++)
		{
			QueueRoleState *r = role_entry(q, roles[i], true);

			if (r == NULL)
			{
				room = false;
				continue;
			}
			if (!r->queued)
			{
				r->queued = true;
				r->cursor = queue_start;
			}
		}
		if (complete && room && q->overflow_gen == overflow_gen)
			q->complete = true;
	}
	LWLockRelease(TuvlShmem->lock);
}

static void
abandon_at_exit(int code, Datum arg)
{
	QueueClaimAbandon();
}

/*
 * Start a claim: fill claims (at most max) with the roles that may have
 * queued runs and where to claim from.  Each is marked as being claimed
 * until QueueClaimEnd or QueueClaimAbandon.  Returns how many.
 */
int
QueueClaimBegin(QueueClaim *claims, int max)
{
	QueueState *q;
	int			n = 0;
	TimestampTz now = GetCurrentTimestamp();

	if (!exit_hook_set)
	{
		before_shmem_exit(abandon_at_exit, (Datum) 0);
		exit_hook_set = true;
	}
	Assert(n_claiming == 0);
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	q = my_queue(MyDatabaseId);
	claim_scanning = true;
	for (int i = 0; q && i < TUVL_QUEUE_ROLES && n < max; i++)
	{
		QueueRoleState *r = &q->roles[i];
		QueueClaim *c = &claims[n];

		if (r->role == InvalidOid || !r->queued)
			continue;
		if (TimestampDifferenceExceeds(r->full_at, now, QUEUE_RESCAN_MS))
		{
			r->cursor = queue_start;
			r->full_at = now;
		}
		r->scanners++;
		memset(c, 0, sizeof(QueueClaim));
		c->role = r->role;
		c->gen = r->gen;
		c->after = r->cursor;
		c->from_start = QueuePosCmp(r->cursor, queue_start) == 0;
		claiming[n_claiming++] = r->role;
		n++;
	}
	LWLockRelease(TuvlShmem->lock);
	return n;
}

/*
 * The claim's statement is done: move each role's cursor past what it
 * took.  A role of which nothing was left to take is forgotten, unless
 * a run of it was queued meanwhile.
 */
void
QueueClaimEnd(QueueClaim *claims, int n)
{
	QueueState *q;

	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	q = my_queue(MyDatabaseId);
	for (int i = 0; q && i < n; i++)
	{
		QueueClaim *c = &claims[i];
		QueueRoleState *r = role_entry(q, c->role, false);

		if (r == NULL)
			continue;
		if (r->scanners > 0)
			r->scanners--;
		if (c->quota > 0)
		{
			if (c->got > 0 && QueuePosCmp(c->last, r->cursor) > 0)
				r->cursor = c->last;
			if (c->got == 0 && !c->skipped && r->gen == c->gen)
				r->queued = false;
		}
		/* a run it passed over, locked by someone else: not past it */
		if (c->skipped && QueuePosCmp(c->first_skipped, r->cursor) <= 0)
			r->cursor = pos_before(c->first_skipped);
		/* queued while we scanned, maybe invisible to us: not past it */
		if (QueuePosCmp(r->low, no_pos) != 0 && QueuePosCmp(r->low, r->cursor) <= 0)
			r->cursor = pos_before(r->low);
		if (r->scanners == 0)
			r->low = no_pos;
	}
	LWLockRelease(TuvlShmem->lock);
	claim_scanning = false;
}

/*
 * The claim failed (its transaction aborted, or the worker exits): what
 * it took is queued again, so its roles start over from the front.
 */
void
QueueClaimAbandon(void)
{
	QueueState *q;

	if (n_claiming == 0 || TuvlShmem == NULL)
		return;
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	q = my_queue(MyDatabaseId);
	for (int i = 0; q && i < n_claiming; i++)
	{
		QueueRoleState *r = role_entry(q, claiming[i], false);

		if (r == NULL)
			continue;
		if (claim_scanning && r->scanners > 0)
			r->scanners--;
		r->cursor = queue_start;
		r->queued = true;
		if (r->scanners == 0)
			r->low = no_pos;
	}
	LWLockRelease(TuvlShmem->lock);
	n_claiming = 0;
	claim_scanning = false;
}
