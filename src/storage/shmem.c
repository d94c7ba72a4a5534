/*-------------------------------------------------------------------------
 *
 * shmem.c
 *	  The shared memory segment, commit-time wake-ups and abort
 *	  interrupts, and the preload and replay checks.  The library's entry
 *	  point, which sets all this up, is init.c; the GUCs are in gucs.c.
 *
 * The library works in two modes.  Preloaded (shared_preload_libraries),
 * it owns a small shared memory segment and a static launcher that keeps
 * a pool of workers in every database with the extension.  Loaded on
 * demand, only the SQL functions that run in the calling backend work
 * (tuvl.run, tuvl.validate, ...); anything needing workers says so with
 * an error or a warning that carries a hint.
 *
 * Wake-ups are never sent mid-transaction: callers set backend-local
 * flags and the transaction callback delivers them at commit, when the
 * rows they announce are visible to the woken processes.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <signal.h>

#include "access/xact.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "postmaster/bgworker.h"
#include "storage/ipc.h"
#include "storage/proc.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/varlena.h"

#include "deadline.h"
#include "tuvl.h"

TuvlSharedState *TuvlShmem = NULL;

int			TuvlReplayDepth = 0;
TuvlWorkerSlot *MyTuvlSlot = NULL;


/* Backend-local wake-ups to deliver at commit. */
static bool wake_workers_pending = false;
static Oid	wake_principal = InvalidOid;	/* whose runs the wake-up is for */

/* Running runs aborted by this transaction: interrupt their holders. */
#define MAX_PENDING_INTERRUPTS 16
typedef struct PendingInterrupt
{
	int			pid;
	int64		run_id;
} PendingInterrupt;
static PendingInterrupt pending_interrupts[MAX_PENDING_INTERRUPTS];
static int	n_pending_interrupts = 0;
static void deliver_interrupts(void);
static void wake_one(Oid dboid, Oid principal);
static bool run_changed_pending = false;
static bool control_changed_pending = false;

/*
 * Dev mode's gate: what this transaction added (counted already), and
 * what it removes (counted at its commit), by subtransaction nesting
 * level, so that a subtransaction's abort takes back its own.  Levels
 * from DEV_LEVELS - 1 down share the last entry, where an abort takes
 * nothing back but forgets the removals: the count stays high, which
 * only costs queries.
 */
#define DEV_LEVELS 16
static int	dev_added[DEV_LEVELS];
static int	dev_removed[DEV_LEVELS];
static bool dev_pending = false;
static bool dev_subxact_registered = false;
static void dev_gate_apply(int n);
static void dev_gate_end(bool commit);

Size
TuvlShmemSize(void)
{
	return add_size(offsetof(TuvlSharedState, slots),
					mul_size(sizeof(TuvlWorkerSlot), tuvl_max_workers));
}

/* The shared memory and the lock the library asks for while preloaded. */
void
TuvlShmemRequest(void)
{
	RequestAddinShmemSpace(TuvlShmemSize());
	RequestNamedLWLockTranche("tuvl", 1);
}

/*
 * Attach to (or create) the shared state.  Runs in the postmaster at every
 * start and after every crash restart, so a new epoch is drawn each time.
 */
void
TuvlShmemStartup(void)
{
	bool		found;

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	TuvlShmem = ShmemInitStruct("tuvl", TuvlShmemSize(), &found);
	if (!found)
	{
		memset(TuvlShmem, 0, TuvlShmemSize());
		TuvlShmem->lock = &(GetNamedLWLockTranche("tuvl"))->lock;
		TuvlShmem->epoch = (int64) GetCurrentTimestamp();
		TuvlShmem->nslots = tuvl_max_workers;
		ConditionVariableInit(&TuvlShmem->run_cv);
		pg_atomic_init_u64(&TuvlShmem->control_gen, 1); /* 0: never read */
		for (int i = 0; i < TUVL_MAX_DATABASES; i++)
			pg_atomic_init_u32(&TuvlShmem->dbs[i].dev_active, 0);
	}
	LWLockRelease(AddinShmemInitLock);
}

/*
 * Deliver pending wake-ups and interrupts when the transaction that
 * produced them commits; forget them when it aborts.
 */
void
TuvlXactCallback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
			if (wake_workers_pending)
				wake_one(MyDatabaseId, wake_principal);
			if (run_changed_pending)
				TuvlRunChangedNow();
			if (control_changed_pending && TuvlShmem)
				pg_atomic_fetch_add_u64(&TuvlShmem->control_gen, 1);
			deliver_interrupts();
			dev_gate_end(true);
			/* FALLTHROUGH */
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			dev_gate_end(false);
			wake_workers_pending = false;
			wake_principal = InvalidOid;
			run_changed_pending = false;
			control_changed_pending = false;
			n_pending_interrupts = 0;
			break;
		case XACT_EVENT_PREPARE:
			/* its changes count when COMMIT PREPARED or not at all: stay high */
			memset(dev_added, 0, sizeof(dev_added));
			memset(dev_removed, 0, sizeof(dev_removed));
			dev_pending = false;
			break;
		default:
			break;
	}
}

void
TuvlWakeWorkersAtCommit(void)
{
	wake_workers_pending = true;
	/* the runs queued now are the current role's */
	wake_principal = GetUserId();
}

void
TuvlRunChangedAtCommit(void)
{
	run_changed_pending = true;
}

/*
 * This transaction changes the operator directives of a run
 * (tuvl.runs.control): at commit, the workers learn that their copies
 * may be stale (TuvlControlGen).  Called by the runs_control trigger
 * (control.c), so every change counts, whoever makes it.
 */
void
TuvlControlChangedAtCommit(void)
{
	control_changed_pending = true;
}

/*
 * A number that changes whenever a change of some run's directives has
 * committed.  Read it before reading a run's control: while it stays the
 * same, what was read is current.
 */
uint64
TuvlControlGen(void)
{
	return TuvlShmem ? pg_atomic_read_u64(&TuvlShmem->control_gen) : 0;
}

/*
 * The worker with pid holds run_id, which this transaction aborted: at
 * commit, ask it to cancel the transition it may be executing for the
 * run, so a long step stops now instead of at its end.
 */
void
TuvlInterruptRunAtCommit(int pid, int64 run_id)
{
	if (n_pending_interrupts < MAX_PENDING_INTERRUPTS)
	{
		pending_interrupts[n_pending_interrupts].pid = pid;
		pending_interrupts[n_pending_interrupts].run_id = run_id;
		n_pending_interrupts++;
	}
}

/*
 * Mark each aborted run in its holder's slot and cancel the holder's
 * statement when it is executing that run's transition (SIGINT, as
 * pg_cancel_backend does).  A holder that starts the run's transition
 * just after sees the mark first.  The lock orders the signal against
 * TuvlSetExecuting: a holder that finished the transition gets no signal,
 * or gets it before it went on to another run's.
 */
static void
deliver_interrupts(void)
{
	if (TuvlShmem == NULL || n_pending_interrupts == 0)
		return;
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	for (int i = 0; i < n_pending_interrupts; i++)
		for (int j = 0; j < TuvlShmem->nslots; j++)
		{
			TuvlWorkerSlot *slot = &TuvlShmem->slots[j];
			int64		run_id = pending_interrupts[i].run_id;
			bool		marked = false;

			if (!slot->in_use || slot->pid != pending_interrupts[i].pid)
				continue;
			for (int k = 0; k < TUVL_ABORT_MARKS; k++)
				marked = marked || slot->aborted[k] == run_id;
			if (!marked)
			{
				/* the oldest mark gives way: its abort waits for a boundary */
				slot->aborted[slot->next_abort] = run_id;
				slot->next_abort = (slot->next_abort + 1) % TUVL_ABORT_MARKS;
			}
			if (slot->executing_run == run_id)
				kill(slot->pid, SIGINT);
			else if (slot->latch)
			{
				/* it may be waiting for the run's request */
				slot->woken = true;
				SetLatch(slot->latch);
			}
		}
	LWLockRelease(TuvlShmem->lock);
	n_pending_interrupts = 0;
}

/* Did an operator abort run_id, which this worker holds? */
bool
TuvlAbortRequested(int64 run_id)
{
	if (MyTuvlSlot == NULL || run_id == 0)
		return false;
	for (int k = 0; k < TUVL_ABORT_MARKS; k++)
		if (MyTuvlSlot->aborted[k] == run_id)
			return true;
	return false;
}

/* The worker read run_id's directive again: forget its mark. */
void
TuvlAbortApplied(int64 run_id)
{
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	for (int k = 0; k < TUVL_ABORT_MARKS; k++)
		if (MyTuvlSlot->aborted[k] == run_id)
			MyTuvlSlot->aborted[k] = 0;
	LWLockRelease(TuvlShmem->lock);
}

/*
 * The worker starts executing run_id's transition (0: it ended).  A
 * cancel an abort sent before is dropped: it was meant for a transition
 * that ended, not for whatever runs next (deliver_interrupts signals
 * under the lock only the holder executing the aborted run).
 */
void
TuvlSetExecuting(int64 run_id)
{
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	if (QueryCancelPending && DeadlineFiredOuter() == DEADLINE_NONE)
		QueryCancelPending = false;
	MyTuvlSlot->executing_run = run_id;
	LWLockRelease(TuvlShmem->lock);
}

/*
 * Dev mode's gate (issue 38).  Every run entering a step would ask the
 * tables whether a breakpoint or step mode stops it (breakpoints.c); this
 * database's entry counts what could (rows of tuvl.breakpoints, runs of
 * tuvl.dev_runs in step mode), so a run asks only while the count is not
 * zero.  The count errs on the side of asking: what a transaction adds
 * counts at once (and is taken back if it aborts), what it removes
 * counts from its commit.  After a start or crash restart the entry is
 * new and uncounted, which also asks, until a worker counts the tables
 * (BreakpointsCount at its start).  Without the entry (the library not
 * preloaded, a database the launcher has not seen yet) the gate is open.
 */
static TuvlDbEntry *
dev_entry(void)
{
	if (TuvlShmem == NULL || !OidIsValid(MyDatabaseId))
		return NULL;
	for (int i = 0; i < TUVL_MAX_DATABASES; i++)
		if (TuvlShmem->dbs[i].dboid == MyDatabaseId)
			return &TuvlShmem->dbs[i];
	return NULL;
}

static void
dev_gate_apply(int n)
{
	TuvlDbEntry *e = dev_entry();

	if (e && n != 0)
		pg_atomic_fetch_add_u32(&e->dev_active, (uint32) n);
}

/* The transaction ends: count its removals (commit) or take back its additions. */
static void
dev_gate_end(bool commit)
{
	if (!dev_pending)
		return;
	for (int i = 0; i < DEV_LEVELS; i++)
	{
		dev_gate_apply(commit ? -dev_removed[i] : -dev_added[i]);
		dev_added[i] = 0;
		dev_removed[i] = 0;
	}
	dev_pending = false;
}

static void
dev_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
					 SubTransactionId parentSubid, void *arg)
{
	/* the entry of the subtransaction ending (the top level's is 0) */
	int			idx = GetCurrentTransactionNestLevel() - 1;

	if (!dev_pending || idx <= 0)
		return;
	if (event == SUBXACT_EVENT_ABORT_SUB)
	{
		if (idx < DEV_LEVELS - 1)
			for (int i = idx; i < DEV_LEVELS; i++)
			{
				dev_gate_apply(-dev_added[i]);
				dev_added[i] = 0;
				dev_removed[i] = 0;
			}
		else
			dev_removed[DEV_LEVELS - 1] = 0;
	}
	else if (event == SUBXACT_EVENT_COMMIT_SUB && idx <= DEV_LEVELS - 1)
	{
		/* the parent's now (no deeper subtransaction is open) */
		for (int i = idx; i < DEV_LEVELS; i++)
		{
			dev_added[idx - 1] += dev_added[i];
			dev_removed[idx - 1] += dev_removed[i];
			dev_added[i] = 0;
			dev_removed[i] = 0;
		}
	}
}

static int
dev_level(void)
{
	int			level = GetCurrentTransactionNestLevel() - 1;

	if (!dev_subxact_registered)
	{
		RegisterSubXactCallback(dev_subxact_callback, NULL);
		dev_subxact_registered = true;
	}
	dev_pending = true;
	return Min(Max(level, 0), DEV_LEVELS - 1);
}

/* Must a run entering a step ask whether dev mode stops it? */
bool
TuvlDevGate(void)
{
	TuvlDbEntry *e = dev_entry();

	if (e == NULL || !e->dev_counted)
		return true;
	pg_read_barrier();
	return (int32) pg_atomic_read_u32(&e->dev_active) != 0;
}

/* Has the gate of this database been counted from the tables? */
bool
TuvlDevGateCounted(void)
{
	TuvlDbEntry *e = dev_entry();

	return e == NULL || e->dev_counted;
}

/* This transaction adds n breakpoints or runs in step mode. */
void
TuvlDevGateAdd(int n)
{
	dev_added[dev_level()] += n;
	dev_gate_apply(n);
}

/* This transaction removes n of them: they stop counting at its commit. */
void
TuvlDevGateSubAtCommit(int n)
{
	dev_removed[dev_level()] += n;
}

/*
 * The count, from the tables, by a transaction that holds them locked
 * against writers (BreakpointsCount): nothing in flight is missed.
 */
void
TuvlDevGateSet(int n)
{
	TuvlDbEntry *e = dev_entry();

	if (e == NULL)
		return;
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	pg_atomic_write_u32(&e->dev_active, (uint32) n);
	e->dev_counted = true;
	LWLockRelease(TuvlShmem->lock);
}

/* Set the latch of every worker serving the given database. */
void
TuvlWakeWorkers(Oid dboid)
{
	if (TuvlShmem == NULL)
		return;
	LWLockAcquire(TuvlShmem->lock, LW_SHARED);
	for (int i = 0; i < TuvlShmem->nslots; i++)
	{
		TuvlWorkerSlot *slot = &TuvlShmem->slots[i];

		if (slot->in_use && slot->dboid == dboid && slot->latch)
		{
			/* a wake-up for new runs not taken yet keeps its role */
			if (!slot->woken)
				slot->woken_by = InvalidOid;
			slot->woken = true;
			SetLatch(slot->latch);
		}
	}
	LWLockRelease(TuvlShmem->lock);
}

/*
 * Set the latch of the least busy worker of a database: new runs need one
 * claimer, and a worker whose claim comes back full wakes the others.  A
 * worker running a slow step alone is woken only when all are.  principal
 * is the role whose runs were queued (InvalidOid: unknown): a worker busy
 * with another role's batch cuts it short to claim them.
 */
static void
wake_one(Oid dboid, Oid principal)
{
	TuvlWorkerSlot *best = NULL;

	if (TuvlShmem == NULL)
		return;
	LWLockAcquire(TuvlShmem->lock, LW_SHARED);
	for (int i = 0; i < TuvlShmem->nslots; i++)
	{
		TuvlWorkerSlot *slot = &TuvlShmem->slots[i];

		if (slot->in_use && slot->dboid == dboid && slot->latch &&
			(best == NULL || (best->alone && !slot->alone) ||
			 (best->alone == slot->alone && slot->nheld < best->nheld)))
			best = slot;
	}
	if (best)
	{
		best->woken_by = principal;
		best->woken = true;
		SetLatch(best->latch);
	}
	LWLockRelease(TuvlShmem->lock);
}

void
TuvlWakeOneWorker(Oid dboid)
{
	wake_one(dboid, InvalidOid);
}

/* Wake every backend sleeping in tuvl.wait(). */
void
TuvlRunChangedNow(void)
{
	if (TuvlShmem)
		ConditionVariableBroadcast(&TuvlShmem->run_cv);
}

/*
 * Does the process that holds a lease still heartbeat?  The holder is
 * alive when it is a tuvl worker of the current server incarnation whose
 * heartbeat timer fired within tuvl.lease_timeout.  A worker executing a
 * long step keeps heartbeating (the timer is a signal handler); one that
 * died, exited or was stopped (SIGSTOP) does not.
 */
bool
TuvlLeaseHolderAlive(int pid, int64 epoch)
{
	TimestampTz now = GetCurrentTimestamp();
	bool		alive = false;

	if (TuvlShmem == NULL || epoch != TuvlShmem->epoch)
		return false;
	LWLockAcquire(TuvlShmem->lock, LW_SHARED);
	for (int i = 0; i < TuvlShmem->nslots; i++)
	{
		TuvlWorkerSlot *slot = &TuvlShmem->slots[i];

		if (slot->in_use && slot->pid == pid)
		{
			alive = !TimestampDifferenceExceeds(slot->alive_at, now, tuvl_lease_timeout);
			break;
		}
	}
	LWLockRelease(TuvlShmem->lock);
	return alive;
}

/*
 * Raise when a replay is executing in this backend: what (a request,
 * tuvl.run(), ...) would leave the database, which a replay never does.
 */
void
TuvlRefuseWhileReplaying(const char *what)
{
	if (TuvlReplayDepth > 0)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s is not allowed while tuvl.replay() executes", what),
				 errdetail("A replay serves every result from outside the database from its fixture and sends nothing."),
				 errhint("Replay the outer workflow only, or run the inner work outside the replay.")));
}

bool
TuvlPreloaded(void)
{
	return TuvlShmem != NULL;
}

/*
 * Raise an error explaining that a feature needs the library preloaded.
 */
void
TuvlRequirePreload(const char *feature)
{
	if (TuvlShmem == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s requires tuvl to be loaded via shared_preload_libraries", feature),
				 errhint("Add tuvl to shared_preload_libraries in postgresql.conf and restart the server.")));
}
