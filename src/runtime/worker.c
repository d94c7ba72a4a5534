/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  The tuvl worker: claims runs of one database and advances them.
 *
 * A worker holds up to tuvl.runs_per_worker runs under lease.  Each round
 * it claims queued runs (FOR UPDATE SKIP LOCKED), then advances every
 * held run by one transition, many transitions per transaction, each in
 * its own subtransaction: one commit covers the batch, and a failing
 * transition rolls back alone.  Nothing a transition produced is used
 * before its transaction commits.  Idle, the worker sleeps on its latch,
 * which start_run and friends set at commit; a timed wake-up remains for
 * lease renewal, lease expiry and noticing DROP EXTENSION.
 *
 * Signals: SIGTERM uses die(), so a long statement is cancelled and the
 * worker exits at once; runs it held are reclaimed by the next worker's
 * maintenance (their holder's pid is gone) or at lease expiry.  SIGHUP
 * reloads the configuration.  ERRORs outside a transition are caught by
 * the sigsetjmp block: the worker logs, aborts, forgets its runs (their
 * leases lapse) and carries on.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <setjmp.h>

#include "access/xact.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "portability/instr_time.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/proc.h"
#include "tcop/tcopprot.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timeout.h"
#include "utils/timestamp.h"

#include "admission.h"
#include "deadline.h"
#include "driver.h"
#include "effect.h"
#include "http.h"
#include "breakpoints.h"
#include "concurrency.h"
#include "run_control.h"
#include "timers.h"
#include "lease.h"
#include "runtime.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"
#include "worker.h"

/* Transitions per commit: stays under the 64 cached subxids of a PGPROC. */
#define MAX_STEPS_PER_COMMIT 60

/* Runs claimed at most per claim: a few batches, so the workers share. */
#define MAX_CLAIM (2 * MAX_STEPS_PER_COMMIT)

/* How often an idle worker checks that the extension still exists. */
#define MAINTENANCE_INTERVAL_MS 1000

static int	my_slot = -1;
static List *held = NIL;		/* RunState *, in runs_cxt */
static MemoryContext runs_cxt = NULL;
static MemoryContext round_cxt = NULL;
static MemoryContext step_cxt = NULL;	/* one transition's work, reset after
										 * it */
static int64 epoch = 0;
static TimeoutId heartbeat_id;
static bool trimmed = true;		/* memory given back since the last claim */
static uint32 start_gen = 0;	/* our database's created_gen at start */
static bool was_present = false;	/* the extension was here when we started */

/* How often the heartbeat timer fires. */
#define HEARTBEAT_TICK_MS 1000

/* SIGALRM-driven heartbeat: async-signal-safe, no allocation. */
static void
heartbeat_timeout(void)
{
	if (my_slot >= 0 && TuvlShmem)
		TuvlShmem->slots[my_slot].alive_at = GetCurrentTimestamp();
}

static void
release_slot(int code, Datum arg)
{
	if (my_slot < 0 || TuvlShmem == NULL)
		return;
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	TuvlShmem->slots[my_slot].in_use = false;
	TuvlShmem->slots[my_slot].pid = 0;
	TuvlShmem->slots[my_slot].latch = NULL;
	LWLockRelease(TuvlShmem->lock);
}

/* Begin a worker transaction in the worker_spi rhythm. */
static void
begin_tx(const char *activity)
{
	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	SPI_connect();
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, activity);
	MemoryContextSwitchTo(round_cxt);
}

static void
commit_tx(void)
{
	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	pgstat_report_stat(false);
	pgstat_report_activity(STATE_IDLE, NULL);
	MemoryContextSwitchTo(round_cxt);
}

/*
 * This transaction may commit without waiting for its WAL flush: it only
 * claims or renews leases, which a crash makes moot anyway.
 */
static void
async_commit(void)
{
	(void) set_config_option("synchronous_commit", "off", PGC_SUSET, PGC_S_SESSION,
							 GUC_ACTION_LOCAL, true, 0, false);
}

/*
 * Is the run ready for a transition (not waiting for an effect, nor for
 * the lock a session held when it last tried)?
 */
static bool
run_ready(RunState *run)
{
	return run->send == NULL && run->transfer == NULL &&
		(run->retry_at == 0 || run->retry_at <= GetCurrentTimestamp());
}

/* The list of held runs lives in runs_cxt, like the runs themselves. */
static void
hold_runs(List *runs)
{
	MemoryContext old = MemoryContextSwitchTo(runs_cxt);
	ListCell   *lc;

	foreach(lc, runs)
		((RunState *) lfirst(lc))->unstarted = true;
	held = list_concat(held, runs);
	MemoryContextSwitchTo(old);
	TuvlShmem->slots[my_slot].nheld = list_length(held);
}

/* Free a run no longer held; its transfer in flight, if any, is orphaned. */
static void
free_run(RunState *run)
{
	if (run->transfer)
		HttpDisown(run->transfer);
	RunStateFree(run);
}

static void
forget_run(RunState *run)
{
	held = list_delete_ptr(held, run);
	TuvlShmem->slots[my_slot].nheld = list_length(held);
	free_run(run);
}

static void
forget_all_runs(void)
{
	while (held != NIL)
		forget_run(linitial(held));
}

/* Is the extension still installed here?  Inside a transaction. */
static bool
extension_present(void)
{
	return OidIsValid(get_extension_oid("tuvl", true));
}

/*
 * Is the extension's SQL at the library's version?  A library newer (or
 * older) than the schema installed here would read tables that are not
 * there yet: the worker does nothing until ALTER EXTENSION tuvl UPDATE,
 * saying so once.  Inside a transaction, SPI connected.
 */
static bool schema_behind = false;

static bool
schema_matches_library(void)
{
	char	   *installed = NULL;
	bool		match;

	if (SPI_execute("SELECT extversion FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'tuvl'",
					true, 1) == SPI_OK_SELECT && SPI_processed == 1)
		installed = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
	match = installed != NULL && strcmp(installed, TUVL_VERSION) == 0;
	if (!match && !schema_behind)
		ereport(LOG,
				(errmsg("tuvl worker waiting: extension tuvl is at version %s in this database, the library at %s",
						installed ? installed : "?", TUVL_VERSION),
				 errdetail("The worker runs nothing until the two agree."),
				 errhint("Run ALTER EXTENSION tuvl UPDATE in this database.")));
	else if (match && schema_behind)
		ereport(LOG, (errmsg("tuvl worker resuming: extension tuvl is at version %s", installed)));
	schema_behind = !match;
	return match;
}

/* The extension is gone: tell the launcher and leave quietly. */
static void
exit_extension_dropped(void)
{
	if (TuvlShmem)
	{
		LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
		for (int i = 0; i < TUVL_MAX_DATABASES; i++)
			if (TuvlShmem->dbs[i].dboid == MyDatabaseId)
			{
				/* unless a CREATE EXTENSION committed since we looked */
				if (TuvlShmem->dbs[i].created_gen == start_gen)
				{
					TuvlShmem->dbs[i].state = TUVL_DB_ABSENT;
					TuvlShmem->dbs[i].probed_at = GetCurrentTimestamp();
				}
				else
					TuvlShmem->dbs[i].state = TUVL_DB_UNKNOWN;
			}
		LWLockRelease(TuvlShmem->lock);
	}
	/* a probe of a database without tuvl is routine; a drop is news */
	ereport(was_present ? LOG : DEBUG1,
			(errmsg("tuvl worker exiting: extension tuvl is not installed in this database")));
	proc_exit(0);
}

/* The extension is here: tell the launcher, which fills the pool. */
static void
note_extension_present(void)
{
	Latch	   *launcher = NULL;

	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	for (int i = 0; i < TUVL_MAX_DATABASES; i++)
		if (TuvlShmem->dbs[i].dboid == MyDatabaseId &&
			TuvlShmem->dbs[i].state != TUVL_DB_PRESENT)
		{
			TuvlShmem->dbs[i].state = TUVL_DB_PRESENT;
			launcher = TuvlShmem->launcher_latch;
		}
	LWLockRelease(TuvlShmem->lock);
	if (launcher)
		SetLatch(launcher);
}

#ifdef __GLIBC__
/*
 * Thousands of runs held at once (agents at scale) leave glibc's heap in
 * pieces once they are done: tens of thousands of free chunks of as many
 * sizes, which glibc walks, in its sorted bins, for every block a memory
 * context later asks for.  Measured after 10,000 agents: 23,000 free
 * chunks, _int_malloc 10 % of a worker's samples, a five-step run's steps
 * 1.5 times the CPU of a fresh worker's, and for good (a fresh worker has
 * about 150).  glibc cannot move what is in use, and trimming leaves the
 * chunks where they are; a new process has a new heap.  So a worker that
 * holds no run and finds its heap so fragmented exits, and the launcher,
 * told of the exit, starts another at once.  Nothing is lost: it holds no
 * run and no transaction.
 */
#define FRAGMENTED_FREE_CHUNKS 4096

static void
exit_when_fragmented(void)
{
#if __GLIBC_PREREQ(2, 33)
	struct mallinfo2 mi = mallinfo2();

	if (mi.ordblks < FRAGMENTED_FREE_CHUNKS)
		return;
	ereport(LOG,
			(errmsg("tuvl worker %d exits to start afresh: its heap is fragmented",
					TuvlShmem->slots[my_slot].number),
			 errdetail("%zu free chunks, %zu bytes free and %zu in use.",
					   mi.ordblks, mi.fordblks, mi.uordblks)));
	proc_exit(0);
#endif
}
#endif

static void release_unreleased(void);

/*
 * Housekeeping: the extension still exists, runs of holders that stopped
 * heartbeating go back to the queue, agents paused too long are queued to
 * take their aborted exit, our leases are renewed.
 */
static void
maintenance(bool renew)
{
	uint64		n;

	begin_tx("tuvl maintenance");
	if (!extension_present())
	{
		SPI_finish();
		PopActiveSnapshot();
		AbortCurrentTransaction();
		exit_extension_dropped();
	}
	async_commit();
	if (!schema_matches_library())
	{
		commit_tx();
		return;
	}
	release_unreleased();
	/* dev mode's gate, after a start or crash restart (breakpoints.c) */
	if (!TuvlDevGateCounted())
		BreakpointsCount();
	n = LeaseReclaim();
	n += TimersExpirePauses();
	n += TimersWakeSleepers();
	/* admissions a session's lock held up (concurrency.c) */
	ConcurrencyAdmitDeferred();
	if (renew && held != NIL)
	{
		List	   *lost = LeaseRenew(held, tuvl_lease_timeout);
		ListCell   *lc;

		foreach(lc, lost)
		{
			RunState   *run = lfirst(lc);

			ereport(LOG,
					(errmsg("tuvl worker lost the lease on run " INT64_FORMAT, run->id)));
			forget_run(run);
		}
	}
	commit_tx();
	if (n > 0)
		TuvlWakeWorkers(MyDatabaseId);

	/*
	 * Idle after a burst: a worker whose heap the burst left in pieces starts
	 * afresh; otherwise it gives the memory malloc and libcurl's buffers
	 * (http.c) keep cached back to the system, so a worker's footprint
	 * follows its load.
	 */
	if (held == NIL && !trimmed)
	{
#ifdef __GLIBC__
		exit_when_fragmented();
		malloc_trim(0);
#endif
		HttpReleaseMemory();
		trimmed = true;
	}
}

/* ---------------------------------------------------------------- memory
 *
 * What a worker holds is bounded by tuvl.max_worker_memory: the runs it
 * holds (their context, step state and results waiting to be journaled)
 * plus the response bodies in flight.  Past it, it claims no runs and
 * starts no request (but one, so that something always progresses), and
 * the transfers in flight pause (http.c).  A batch commits early once
 * its transaction holds a quarter of it.
 */
static int64
worker_memory_limit(void)
{
	return (int64) tuvl_max_worker_memory * 1024;
}

/*
 * Journaling a result takes several copies of it for a moment (the event,
 * the step's output, the context, their tuples): a result waiting to be
 * journaled counts this many times its size.
 */
#define RESULT_WORKING_COPIES 10

/*
 * Bytes the held runs take, and give the rest to the transfers.  Summing
 * them walks every held run's memory contexts, thousands of them, so the
 * sum is taken at most every HELD_BYTES_MS (the loop asks every time
 * round); the bodies in flight are counted live by http.c.
 */
#define HELD_BYTES_MS 20

static int64
held_bytes(void)
{
	static int64 total = 0;
	static TimestampTz at = 0;
	TimestampTz now = GetCurrentTimestamp();
	ListCell   *lc;

	if (!TimestampDifferenceExceeds(at, now, HELD_BYTES_MS))
		return total;
	at = now;
	total = 0;
	foreach(lc, held)
	{
		RunState   *run = lfirst(lc);

		total += MemoryContextMemAllocated(run->cxt, true);
		if (run->fresh_effect)
			total += (int64) (RESULT_WORKING_COPIES - 1) * VARSIZE(run->fresh_effect);
	}
	HttpSetMemoryBudget((size_t) Max(worker_memory_limit() - total, 0));
	return total;
}

static bool
memory_full(void)
{
	return held_bytes() + (int64) HttpBufferedBytes() >= worker_memory_limit();
}

/*
 * How many runs to claim: up to tuvl.runs_per_worker held, but no more
 * than MAX_READY ready to advance.  Runs waiting for a request do not
 * count: a worker holds many of those.  The rest of the queue stays in
 * the table, where the next claim shares it fairly among principals.
 */
#define MAX_READY (2 * MAX_STEPS_PER_COMMIT)

/*
 * A wake-up for new runs came (from the commit that queued them, naming
 * their role): the next claim takes some whatever this worker has ready.
 * Wake-ups from other workers (a claim that came back full) do not count.
 */
static bool woken = false;

static void
note_wakeup(void)
{
	woken = woken || (MyTuvlSlot->woken && OidIsValid(MyTuvlSlot->woken_by));
	MyTuvlSlot->woken = false;
}

/*
 * Principals compete (several have ready or queued runs): batches are
 * kept short then, so that a turn comes round soon.
 */
#define CONTENDED_STEPS 8
#define CONTENDED_BATCH_MS 5

static int
claim_room(void)
{
	int			ready = 0;
	int			unstarted = 0;
	ListCell   *lc;

	foreach(lc, held)
	{
		RunState   *run = lfirst(lc);

		if (run_ready(run))
		{
			ready++;
			if (run->unstarted)
				unstarted++;
		}
	}

	/*
	 * Claim a batch's worth at a time, when less than a batch is ready: a
	 * claim is a transaction too, and many small ones cost throughput. New
	 * runs were queued: claim a few whatever this worker has ready, so that
	 * another role's new run waits for no more than this batch.
	 *
	 * Most held runs wait for the network (a model, an API): their answers
	 * alone can keep a batch ready, and the queue would wait for them to
	 * drain while the runs it holds could already be waiting too.  Then a
	 * worker claims as long as less than a batch of the runs it claimed has
	 * yet to start, and every other batch starts those first; but only while
	 * it holds less than three quarters of tuvl.max_worker_memory. Nearer the
	 * limit, the held runs would be more of those ready and fewer of those
	 * waiting: there, the answers go first.
	 */
	return Min(Min(tuvl_runs_per_worker - list_length(held), MAX_CLAIM),
			   Max(Max(ready < MAX_STEPS_PER_COMMIT ? MAX_READY - ready : 0,
					   list_length(held) - ready > ready && unstarted < MAX_STEPS_PER_COMMIT &&
					   held_bytes() + (int64) HttpBufferedBytes() < worker_memory_limit() / 4 * 3
					   ? MAX_READY - unstarted : 0),
				   (woken || (MyTuvlSlot->woken && OidIsValid(MyTuvlSlot->woken_by)))
				   ? CONTENDED_STEPS : 0));
}

static bool fail_one_run(RunState *run, const char *error, const char *error_type);

/*
 * Fail the runs just claimed that came back from dead workers more than
 * tuvl.max_recoveries times without getting further (LeaseReclaim): the
 * worker that held them died each time, most likely because of what the
 * run does or receives, and taking it up again would only do that again.
 */
static void
fail_crash_loops(List *runs)
{
	ListCell   *lc;

	foreach(lc, runs)
	{
		RunState   *run = lfirst(lc);

		if (run->recoveries <= tuvl_max_recoveries)
			continue;
		ereport(LOG,
				(errmsg("tuvl worker failing run " INT64_FORMAT ": its worker died %d times while it held it",
						run->id, run->recoveries)));
		if (fail_one_run(run, psprintf("its worker died %d times while holding it without the run getting further, "
									   "more than tuvl.max_recoveries (%d)", run->recoveries, tuvl_max_recoveries),
						 "recovery_limit"))
			forget_run(run);
	}
}

/*
 * Claim queued runs, at most a batch at a time so that the workers share
 * the queue; returns how many were claimed.
 */
static int
claim(void)
{
	int			room = claim_room();
	List	   *runs;
	bool		more;

	if (room <= 0 || memory_full() || schema_behind)
		return 0;
	begin_tx("tuvl claiming runs");
	/* a lost claim only means the run is claimed again */
	async_commit();
	woken = false;
	runs = LeaseClaim(runs_cxt, room, epoch, tuvl_lease_timeout, &more);
	if (runs != NIL)
		trimmed = false;
	commit_tx();
	hold_runs(runs);
	fail_crash_loops(runs);
	/* a full share means more are queued: share them with the others */
	if (more)
		TuvlWakeWorkers(MyDatabaseId);
	return more ? room : list_length(runs);
}

/* What became of one attempted transition. */
typedef enum Advanced
{
	ADV_DONE,					/* made; apply it after commit */
	ADV_LOST,					/* the lease was lost: drop the run */
	ADV_BROKEN,					/* the run cannot go on: fail it */
	ADV_SOLO,					/* outlived the batch's budget: run it alone */
	ADV_LOCKED					/* a session holds a lock it needs: later */
} Advanced;

/* ---------------------------------------------------------------- slow steps
 *
 * A step whose transition outlived a batch's budget (tuvl.max_batch_time)
 * is remembered as slow: its next transitions run alone, in transactions
 * of their own, so that they never hold up the commit of other runs.  A
 * slow step that turns out fast when run alone is forgotten again.
 */
typedef struct SlowStepKey
{
	char		workflow[NAMEDATALEN];
	int			version;
	int			step;
} SlowStepKey;

static HTAB *slow_steps = NULL;

static void
slow_step_key(RunState *run, SlowStepKey *key)
{
	memset(key, 0, sizeof(*key));
	strlcpy(key->workflow, run->workflow, NAMEDATALEN);
	key->version = run->version;
	key->step = run->step;
}

static bool
step_is_slow(RunState *run)
{
	SlowStepKey key;

	if (slow_steps == NULL)
		return false;
	slow_step_key(run, &key);
	return hash_search(slow_steps, &key, HASH_FIND, NULL) != NULL;
}

static void
mark_step_slow(RunState *run, bool slow)
{
	SlowStepKey key;

	if (slow_steps == NULL)
	{
		HASHCTL		ctl = {.keysize = sizeof(SlowStepKey),.entrysize = sizeof(SlowStepKey)};

		slow_steps = hash_create("tuvl slow steps", 64, &ctl, HASH_ELEM | HASH_BLOBS);
	}
	slow_step_key(run, &key);
	(void) hash_search(slow_steps, &key, slow ? HASH_ENTER : HASH_REMOVE, NULL);
}

/*
 * One transition, within budget_end (0: no budget).  RunAdvance leaves
 * nothing behind in the transaction when it raises.  An operator's abort
 * that cancelled the transition is applied at once: the directive is
 * read again and the transition made anew.  *fatal gets the message of
 * a broken run.
 */
static Advanced
try_advance(RunState *run, TimestampTz budget, char **fatal)
{
	MemoryContext oldcxt = CurrentMemoryContext;
	volatile Advanced result = ADV_DONE;
	volatile TimestampTz budget_end = budget;

	*fatal = NULL;
	TuvlSetExecuting(run->id);
	for (int tries = 0;; tries++)
	{
		volatile int level = -1;
		volatile bool aborted = false;

		/* an abort that arrived before (or while) the transition ran */
		if (TuvlAbortRequested(run->id))
		{
			TuvlAbortApplied(run->id);
			RunRefreshControl(run);
		}
		PG_TRY();
		{
			if (budget_end != 0)
				level = DeadlinePush(DEADLINE_BATCH, budget_end);
			RunAdvance(run);
			if (level >= 0)
				(void) DeadlinePop(level);
			result = ADV_DONE;
		}
		PG_CATCH();
		{
			ErrorData  *edata;

			if (level >= 0)
				(void) DeadlinePop(level);
			MemoryContextSwitchTo(oldcxt);
			edata = CopyErrorData();
			FlushErrorState();
			if (run->cancelled == RUN_CANCEL_ABORT)
				aborted = true;
			else if (run->cancelled == RUN_CANCEL_BATCH)
				result = ADV_SOLO;
			else if (edata->sqlerrcode == ERRCODE_LOCK_NOT_AVAILABLE)
				result = ADV_LOCKED;
			else if (edata->sqlerrcode == ERRCODE_T_R_SERIALIZATION_FAILURE)
			{
				ereport(LOG,
						(errmsg("tuvl worker dropped run " INT64_FORMAT ": %s", run->id, edata->message)));
				result = ADV_LOST;
			}
			else
			{
				ereport(LOG,
						(errmsg("tuvl worker failing run " INT64_FORMAT ": %s", run->id, edata->message)));
				*fatal = MemoryContextStrdup(round_cxt, edata->message);
				result = ADV_BROKEN;
			}
		}
		PG_END_TRY();
		if (!aborted)
			break;
		/* aborted while it ran: make the abort the transition, now */
		if (tries >= 1)
		{
			result = ADV_SOLO;	/* the directive is read; next time */
			break;
		}
		budget_end = 0;
	}
	TuvlSetExecuting(0);
	return result;
}

/*
 * A transition waited longer than a worker waits for a lock (security.c:
 * a session holds one on the run's row, say, in a transaction it keeps
 * open): the run is left alone for a while, 1 s, then 2, 4... up to 30 s,
 * so that such a session costs the worker about a second now and then,
 * never its other runs' progress.
 */
#define MAX_LOCK_BACKOFF_MS 30000

static void
wait_for_lock(RunState *run)
{
	int			backoff = 1000 << Min(run->lock_waits, 5);

	run->lock_waits++;
	run->retry_at = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
												Min(backoff, MAX_LOCK_BACKOFF_MS));
	if (run->lock_waits == 1 || run->lock_waits % 10 == 0)
		ereport(LOG,
				(errmsg("tuvl worker postponed run " INT64_FORMAT ": a lock it needs is held by another session",
						run->id),
				 errdetail("Tried %d times; the next try is in %d s.", run->lock_waits,
						   Min(backoff, MAX_LOCK_BACKOFF_MS) / 1000)));
}

static bool
fail_one_run(RunState *run, const char *error, const char *error_type)
{
	MemoryContext oldcxt;
	volatile bool ok = true;
	volatile bool locked = false;

	begin_tx("tuvl failing a run");
	oldcxt = CurrentMemoryContext;
	PG_TRY();
	{
		RunFailAs(run, error, error_type);
	}
	PG_CATCH();
	{
		MemoryContextSwitchTo(oldcxt);
		locked = geterrcode() == ERRCODE_LOCK_NOT_AVAILABLE;
		if (!locked)
			EmitErrorReport();
		FlushErrorState();
		ok = false;
	}
	PG_END_TRY();
	if (ok)
		commit_tx();
	else
	{
		SPI_finish();
		PopActiveSnapshot();
		AbortCurrentTransaction();
		MemoryContextSwitchTo(round_cxt);
	}
	if (locked)
		wait_for_lock(run);
	return !locked;
}

/*
 * Fail runs that could make no transition, each in its own transaction,
 * and let go of them; a lost lease just drops the run.  A run whose row a
 * session keeps locked is kept, to be tried again (wait_for_lock).
 */
static void
fail_runs(List *runs, List *errors)
{
	ListCell   *lc1;
	ListCell   *lc2;

	forboth(lc1, runs, lc2, errors)
	{
		if (fail_one_run(lfirst(lc1), lfirst(lc2), NULL))
			forget_run(lfirst(lc1));
	}
}

/* The principal served by the last batch. */
static Oid	last_principal = InvalidOid;

static bool contended = false;

/*
 * The principal whose ready runs the next batch advances: another one
 * than the last batch's when there is one, so that principals take turns
 * (one role's many ready runs do not keep another's waiting).  A step
 * found slow before is marked to run alone here.  InvalidOid: nothing is
 * ready.
 */
static Oid
next_principal(void)
{
	Oid			first = InvalidOid;
	ListCell   *lc;

	foreach(lc, held)
	{
		RunState   *run = lfirst(lc);

		if (!run_ready(run) || run->solo)
			continue;
		if (step_is_slow(run))
		{
			run->solo = true;
			continue;
		}
		if (!OidIsValid(first))
			first = run->principal;
		else if (run->principal != first)
			contended = true;
		if (run->principal != last_principal)
		{
			/* is anyone else waiting? */
			for (ListCell *lc2 = lnext(held, lc); lc2 && !contended; lc2 = lnext(held, lc2))
			{
				RunState   *other = lfirst(lc2);

				if (run_ready(other) && !other->solo && other->principal != run->principal)
					contended = true;
			}
			return run->principal;
		}
	}
	return first;
}

/* Make the committed transitions of advanced current; keep or drop each run. */
static void
apply_advanced(List *advanced)
{
	ListCell   *lc;
	List	   *kept = NIL;
	List	   *moved = NIL;
	MemoryContext old;

	foreach(lc, advanced)
	{
		RunState   *run = lfirst(lc);

		run->advanced = true;
		run->unstarted = false;
		run->lock_waits = 0;
		run->retry_at = 0;
		switch (DriveNextAfter(run))
		{
			case RUN_NEXT_RELEASE:
				run->released = true;
				continue;
			case RUN_NEXT_EFFECT:
				/* started by start_due_sends on the curl multi handle */
				run->send_at = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
														   run->send->delay_ms);
				break;
			case RUN_NEXT_TRANSITION:
				break;
		}
	}

	/*
	 * The advanced runs go to the back, so every held run gets its turn, and
	 * the released ones go: one pass over the held runs, not one per run
	 * advanced (a worker may hold thousands).
	 */
	old = MemoryContextSwitchTo(runs_cxt);
	foreach(lc, held)
	{
		RunState   *run = lfirst(lc);

		if (!run->advanced)
			kept = lappend(kept, run);
	}
	foreach(lc, advanced)
	{
		RunState   *run = lfirst(lc);

		run->advanced = false;
		if (run->released)
			free_run(run);
		else
			moved = lappend(moved, run);
	}
	list_free(held);
	held = list_concat(kept, moved);
	list_free(moved);
	MemoryContextSwitchTo(old);
	TuvlShmem->slots[my_slot].nheld = list_length(held);
}

/* whether this batch takes the runs not yet started first */
static bool unstarted_first = false;

/*
 * Advance up to MAX_STEPS_PER_COMMIT ready runs of one principal by one
 * transition each, in one transaction of about tuvl.max_batch_time: a
 * transition still running when the budget is spent, and that ran for
 * half of it at least, is cancelled (its step is slow: it runs alone
 * next, see run_solo), and no transition starts after it.  Runs whose transition failed (lost lease, broken
 * workflow) are dropped; runs that ended are released; runs that asked
 * for an effect get it started once the transaction committed.
 * Returns the number of transitions made or attempted.
 */
static int
advance_batch(void)
{
	Oid			principal;
	int			max_steps;
	List	   *batch = NIL;
	List	   *advanced = NIL;
	List	   *failed = NIL;
	List	   *broken = NIL;
	List	   *broken_errors = NIL;
	ListCell   *lc;
	char		activity[64];
	TimestampTz budget_end;
	int			attempted = 0;

	/*
	 * One principal's runs per transaction: what a step leaves for the rest
	 * of its transaction (a cursor, a transaction-level lock) never reaches
	 * another role's step.  The others come in the next batch.
	 */
	contended = LeaseQueuedPrincipals > 1;
	principal = next_principal();
	if (!OidIsValid(principal))
		return 0;
	max_steps = contended ? CONTENDED_STEPS : MAX_STEPS_PER_COMMIT;

	/*
	 * Every other batch takes the runs claimed and not yet started first (see
	 * claim_room), then the others in the order they were last advanced.
	 */
	unstarted_first = !unstarted_first;
	for (int pass = unstarted_first ? 0 : 1; pass < 2 && list_length(batch) < max_steps; pass++)
	{
		foreach(lc, held)
		{
			RunState   *run = lfirst(lc);

			if (!run_ready(run) || run->solo || run->principal != principal ||
				(unstarted_first && (pass == 0) != run->unstarted))
				continue;
			batch = lappend(batch, run);
			if (list_length(batch) >= max_steps)
				break;
		}
	}
	last_principal = principal;
	if (batch == NIL)
		return 0;
	snprintf(activity, sizeof(activity), "tuvl advancing %d runs", list_length(batch));
	begin_tx(activity);
	budget_end = TimestampTzPlusMilliseconds(GetCurrentStatementStartTimestamp(),
											 tuvl_max_batch_time);
	foreach(lc, batch)
	{
		RunState   *run = lfirst(lc);
		char	   *fatal;
		Advanced	adv;

		/*
		 * The budget is spent, or the memory, or another role's runs were
		 * queued: the rest wait for the next batch.
		 */
		if (attempted > 0 &&
			((MyTuvlSlot->woken && OidIsValid(MyTuvlSlot->woken_by) &&
			  MyTuvlSlot->woken_by != principal) ||
			 GetCurrentTimestamp() >= budget_end ||
			 (contended && TimestampDifferenceExceeds(GetCurrentStatementStartTimestamp(),
													  GetCurrentTimestamp(), CONTENDED_BATCH_MS)) ||
			 (int64) MemoryContextMemAllocated(TopTransactionContext, true) > worker_memory_limit() / 4))
			break;
		attempted++;
		MemoryContextSwitchTo(step_cxt);

		/*
		 * A transition started late in the budget still gets half of it: a
		 * step is slow when one of its transitions takes that long, not
		 * because it happened to straddle the end of a full batch.
		 */
		adv = try_advance(run,
						  Max(budget_end,
							  TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
														  tuvl_max_batch_time / 2)),
						  &fatal);
		/* SPI calls leave CurrentMemoryContext at SPI's, gone at commit */
		MemoryContextSwitchTo(round_cxt);
		MemoryContextReset(step_cxt);
		switch (adv)
		{
			case ADV_DONE:
				advanced = lappend(advanced, run);
				break;
			case ADV_SOLO:
				run->solo = true;
				mark_step_slow(run, true);
				break;
			case ADV_LOCKED:
				wait_for_lock(run);
				break;
			case ADV_BROKEN:
				broken = lappend(broken, run);
				broken_errors = lappend(broken_errors, fatal);
				break;
			case ADV_LOST:
				failed = lappend(failed, run);
				break;
		}
	}
	commit_tx();

	apply_advanced(advanced);
	foreach(lc, failed)
		forget_run(lfirst(lc));
	if (broken != NIL)
		fail_runs(broken, broken_errors);
	return attempted;
}

/* ---------------------------------------------------------------- solo runs
 *
 * A slow step runs alone: in a transaction of its own, with no budget but
 * its own timeout, in a worker that holds nothing else.  Before it starts,
 * the worker hands its other runs back to the queue (where the other
 * workers take them at once), finishing first those that have an effect
 * in flight or a result to journal.  At most all but one of a database's
 * workers run slow steps at a time, so one is always free for the rest.
 */
static bool solo_slot_held = false;

static bool
have_solo_run(void)
{
	ListCell   *lc;

	foreach(lc, held)
	{
		if (((RunState *) lfirst(lc))->solo)
			return true;
	}
	return false;
}

static TuvlDbEntry *
my_db_entry(void)
{
	for (int i = 0; i < TUVL_MAX_DATABASES; i++)
		if (TuvlShmem->dbs[i].dboid == MyDatabaseId)
			return &TuvlShmem->dbs[i];
	return NULL;
}

static bool
acquire_solo_slot(void)
{
	TuvlDbEntry *db;
	bool		ok = false;

	if (solo_slot_held)
		return true;
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	db = my_db_entry();
	if (db && db->solo_workers < Max(1, tuvl_workers_per_database - 1))
	{
		db->solo_workers++;
		MyTuvlSlot->alone = true;
		ok = true;
	}
	LWLockRelease(TuvlShmem->lock);
	solo_slot_held = ok;
	return ok;
}

static void
release_solo_slot(void)
{
	TuvlDbEntry *db;

	if (!solo_slot_held || TuvlShmem == NULL)
		return;
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	db = my_db_entry();
	if (db && db->solo_workers > 0)
		db->solo_workers--;
	MyTuvlSlot->alone = false;
	LWLockRelease(TuvlShmem->lock);
	solo_slot_held = false;
}

static void
release_solo_slot_at_exit(int code, Datum arg)
{
	release_solo_slot();
}

/* Give every held run that is not solo and has nothing pending back. */
static void
hand_back_idle_runs(void)
{
	List	   *give = NIL;
	int64	   *ids;
	int32	   *attempts;
	bool	   *released;
	int			n = 0;
	ListCell   *lc;

	foreach(lc, held)
	{
		RunState   *run = lfirst(lc);

		/* a request not sent yet is sent by the next holder */
		if (!run->solo && run->transfer == NULL && run->fresh_effect == NULL)
			give = lappend(give, run);
	}
	if (give == NIL)
		return;
	ids = palloc(sizeof(int64) * list_length(give));
	attempts = palloc(sizeof(int32) * list_length(give));
	foreach(lc, give)
	{
		ids[n] = ((RunState *) lfirst(lc))->id;
		attempts[n++] = ((RunState *) lfirst(lc))->attempt;
	}
	released = palloc(sizeof(bool) * n);
	begin_tx("tuvl handing runs back");
	(void) LeaseRelease(n, ids, attempts, released);
	commit_tx();
	n = 0;
	/* a run a session keeps locked stays held, and goes on here */
	foreach(lc, give)
	{
		if (released[n++])
			forget_run(lfirst(lc));
	}
	TuvlWakeWorkers(MyDatabaseId);
}

/*
 * A step found fast again: the runs marked to run it alone (next_principal
 * marks every ready run at a slow step) go back into batches.  Left solo,
 * they would each wait for the one before to finish its effects: when a
 * step that sends a model request was marked slow once (one transition
 * held up among thousands), the agents at it went through it one request
 * round trip at a time.  One whose own transition is slow is found again
 * by its batch's budget.
 */
static void
unsolo_step(RunState *fast)
{
	SlowStepKey key;
	SlowStepKey other;
	ListCell   *lc;

	slow_step_key(fast, &key);
	foreach(lc, held)
	{
		RunState   *run = lfirst(lc);

		if (!run->solo)
			continue;
		slow_step_key(run, &other);
		if (memcmp(&key, &other, sizeof(key)) == 0)
			run->solo = false;
	}
}

/*
 * Run one solo transition when this worker holds nothing else; returns
 * true when it did (or made progress towards it).
 */
static bool
run_solo(void)
{
	RunState   *run = NULL;
	char	   *fatal;
	Advanced	adv;
	instr_time	start;
	instr_time	took;
	ListCell   *lc;

	if (!have_solo_run() || !acquire_solo_slot())
		return false;
	hand_back_idle_runs();
	foreach(lc, held)
	{
		RunState   *r = lfirst(lc);

		/*
		 * Others still finish their effects, unless memory is short: then
		 * their requests may be paused for it, and their results wait.
		 */
		if (!r->solo && !memory_full())
			return false;
		if (r->solo && run == NULL && run_ready(r))
			run = r;
	}
	if (run == NULL)
		return false;

	begin_tx("tuvl running a slow step alone");
	INSTR_TIME_SET_CURRENT(start);
	MemoryContextSwitchTo(step_cxt);
	adv = try_advance(run, 0, &fatal);
	MemoryContextSwitchTo(round_cxt);
	commit_tx();
	MemoryContextReset(step_cxt);
	INSTR_TIME_SET_CURRENT(took);
	INSTR_TIME_SUBTRACT(took, start);
	run->solo = false;
	/* fast this time: it may go back into batches, with the runs at it */
	if (adv == ADV_DONE && INSTR_TIME_GET_MILLISEC(took) < tuvl_max_batch_time / 2.0)
	{
		mark_step_slow(run, false);
		unsolo_step(run);
	}
	switch (adv)
	{
		case ADV_DONE:
			apply_advanced(list_make1(run));
			break;
		case ADV_SOLO:
			run->solo = true;
			break;
		case ADV_LOCKED:
			wait_for_lock(run);
			break;
		case ADV_BROKEN:
			fail_runs(list_make1(run), list_make1(fatal));
			break;
		case ADV_LOST:
			forget_run(run);
			break;
	}
	if (!have_solo_run())
		release_solo_slot();
	return true;
}

/* The result of an effect, or of a failure to even start it. */
static void
effect_done(RunState *run, Jsonb *result)
{
	/* a model call with limits gives its admission back, with its usage */
	EffectAdmissionDone(run->send, result);
	RunKeepJsonb(run, &run->fresh_effect, result);
	run->transfer = NULL;
	RunForgetSend(run);
}

/*
 * An operator aborted a run this worker holds while it waits for a
 * request: drop the request (its result would not be used), so the next
 * transition applies the abort now rather than when the request ends.
 */
static void
abandon_aborted_effects(void)
{
	ListCell   *lc;
	bool		any = false;

	for (int k = 0; k < TUVL_ABORT_MARKS; k++)
		any = any || MyTuvlSlot->aborted[k] != 0;
	if (!any)
		return;
	foreach(lc, held)
	{
		RunState   *run = lfirst(lc);

		if ((run->transfer == NULL && run->send == NULL) ||
			run->fresh_effect != NULL || !TuvlAbortRequested(run->id))
			continue;
		if (run->transfer)
			HttpCancel(run->transfer);
		run->transfer = NULL;
		RunForgetSend(run);
	}
}

/* Publish the transfers in flight for tuvl.worker_status(). */
static void
note_in_flight(void)
{
	TuvlWorkerSlot *slot = &TuvlShmem->slots[my_slot];
	int			n = HttpInFlight();

	slot->in_flight = n;
	if (n > slot->peak_in_flight)
		slot->peak_in_flight = n;
}

/* Start the transfers whose time has come; no transaction is open. */
static void
start_due_sends(TimestampTz *next_send)
{
	TimestampTz now = GetCurrentTimestamp();
	bool		full = memory_full();
	ListCell   *lc;

	*next_send = 0;
	foreach(lc, held)
	{
		RunState   *run = lfirst(lc);
		MemoryContext oldcxt = CurrentMemoryContext;

		if (run->send == NULL || run->transfer != NULL)
			continue;
		/* no memory for another response: wait, unless nothing is in flight */
		if (full && HttpInFlight() > 0)
			continue;
		if (run->send_at > now)
		{
			if (*next_send == 0 || run->send_at < *next_send)
				*next_send = run->send_at;
			continue;
		}

		/*
		 * A model call with limits waits here for admission, holding no
		 * transaction: until its config's window has room (retry_at) or
		 * whoever frees room grants it and sets our latch.
		 */
		if (run->send->admit)
		{
			TimestampTz retry_at;

			if (AdmissionAsk(run->send->admit, &retry_at) == ADMIT_WAIT ||
				!AdmissionSent(run->send->admit, &retry_at))
			{
				if (retry_at != 0 && (*next_send == 0 || retry_at < *next_send))
					*next_send = retry_at;
				continue;
			}
		}
		PG_TRY();
		{
			run->transfer = HttpStart(&run->send->http, run->send->secrets, run);

			/*
			 * The transfer sends its own copy of the body: the run's goes,
			 * rather than be held through the server's answer time (a request
			 * is started once; its length stays, for the cost estimates).
			 */
			if (run->transfer && run->send->http.body && !run->send->http.body_borrowed)
			{
				pfree((char *) run->send->http.body);
				run->send->http.body = NULL;
			}
		}
		PG_CATCH();
		{
			ErrorData  *edata;
			HttpResult	res;

			MemoryContextSwitchTo(oldcxt);
			edata = CopyErrorData();
			FlushErrorState();
			memset(&res, 0, sizeof(res));
			res.error_kind = "error";
			res.error = edata->message;
			res.body = "";
			effect_done(run, EffectFinish(run->send, &res));
		}
		PG_END_TRY();
	}
	note_in_flight();
}

/*
 * The journal form of a finished request's result.  Reading a response
 * raises on nothing the server sent (JsonParseExternal), but should any
 * other error come up while it is read, it becomes the request's error:
 * the run's step fails, not the worker with every run it holds.  A cancel
 * or a shutdown is thrown on.
 */
static Jsonb *
finish_effect(RunState *run, HttpResult *res)
{
	MemoryContext oldcxt = CurrentMemoryContext;
	Jsonb	   *volatile result = NULL;

	PG_TRY();
	{
		result = EffectFinish(run->send, res);
	}
	PG_CATCH();
	{
		ErrorData  *edata;
		HttpResult	failed;

		if (ERRCODE_TO_CATEGORY(geterrcode()) == ERRCODE_OPERATOR_INTERVENTION)
			PG_RE_THROW();
		MemoryContextSwitchTo(oldcxt);
		edata = CopyErrorData();
		FlushErrorState();
		memset(&failed, 0, sizeof(failed));
		failed.error_kind = "error";
		failed.error = psprintf("the response could not be read: %s", edata->message);
		failed.body = "";
		failed.latency_ms = res->latency_ms;
		result = EffectFinish(run->send, &failed);
	}
	PG_END_TRY();
	return result;
}

/*
 * Hand finished transfers to their runs.  HttpTakeResult frees a
 * transfer: the run stops pointing to it first, so that nothing (an error
 * while its result is read, the run being forgotten afterwards) can touch
 * it once it is gone.
 */
static void
collect_done(void)
{
	ListCell   *lc;

	MemoryContext old = CurrentMemoryContext;
	List	   *done = HttpCollectDone();

	foreach(lc, done)
	{
		HttpTransfer *t = lfirst(lc);
		RunState   *run = HttpTransferOwner(t);
		HttpResult *res;

		/* a run dropped meanwhile (lost lease) disowned its transfer */
		if (run != NULL && run->transfer != t)
			run = NULL;
		if (run != NULL)
			run->transfer = NULL;
		/* one result at a time: its copies are freed before the next */
		MemoryContextSwitchTo(step_cxt);
		res = HttpTakeResult(t);
		if (run != NULL)
			effect_done(run, finish_effect(run, res));
		MemoryContextSwitchTo(old);
		MemoryContextReset(step_cxt);
	}
	/* the results now held leave less room for the bodies in flight */
	if (done != NIL)
		(void) held_bytes();
	note_in_flight();
}

static void
set_my_name(int number)
{
	char		name[64];

	snprintf(name, sizeof(name), "tuvl worker %d", number);
	SetConfigOption("application_name", name, PGC_USERSET, PGC_S_SESSION);
	pgstat_report_appname(name);
}

/*
 * Take our slot in shared memory, and note the epoch and our database's
 * created_gen.
 */
static void
take_slot(Oid dboid)
{
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	MyTuvlSlot = &TuvlShmem->slots[my_slot];
	TuvlShmem->slots[my_slot].pid = MyProcPid;
	TuvlShmem->slots[my_slot].latch = MyLatch;
	TuvlShmem->slots[my_slot].nheld = 0;
	TuvlShmem->slots[my_slot].executing_run = 0;
	memset((void *) TuvlShmem->slots[my_slot].aborted, 0, sizeof(TuvlShmem->slots[my_slot].aborted));
	TuvlShmem->slots[my_slot].next_abort = 0;
	TuvlShmem->slots[my_slot].alone = false;
	TuvlShmem->slots[my_slot].in_flight = 0;
	TuvlShmem->slots[my_slot].peak_in_flight = 0;
	epoch = TuvlShmem->epoch;
	for (int i = 0; i < TUVL_MAX_DATABASES; i++)
		if (TuvlShmem->dbs[i].dboid == dboid)
			start_gen = TuvlShmem->dbs[i].created_gen;
	LWLockRelease(TuvlShmem->lock);
}

/* Connect to the database, in a shared session, and start the heartbeat. */
static void
connect_worker(Oid dboid)
{
	BackgroundWorkerInitializeConnectionByOid(dboid, InvalidOid, 0);
	set_my_name(TuvlShmem->slots[my_slot].number);
	/* one session for every principal's steps: see security.c */
	SecurityBeginSharedSession();

	/* heartbeat even while a long step executes */
	heartbeat_timeout();
	heartbeat_id = RegisterTimeout(USER_TIMEOUT, heartbeat_timeout);
	enable_timeout_every(heartbeat_id,
						 TimestampTzPlusMilliseconds(GetCurrentTimestamp(), HEARTBEAT_TICK_MS),
						 HEARTBEAT_TICK_MS);
}

/* Tune malloc and create the worker's memory contexts. */
static void
create_worker_memory(void)
{
#ifdef __GLIBC__

	/*
	 * Blocks larger than a memory context's largest block (8 MB: large
	 * responses) in mappings of their own: freed, they go back to the system
	 * at once, instead of raising glibc's threshold and staying in the heap.
	 * Contexts' blocks stay in the heap, which is not trimmed after every
	 * batch: a batch's transaction contexts, mapped and unmapped in every
	 * transaction, made a third of an agent turn's CPU page faults.  An idle
	 * worker trims the heap (maintenance).
	 */
	mallopt(M_MMAP_THRESHOLD, 8 * 1024 * 1024);
	mallopt(M_TRIM_THRESHOLD, 32 * 1024 * 1024);
#endif
	runs_cxt = AllocSetContextCreate(TopMemoryContext, "tuvl runs", ALLOCSET_DEFAULT_SIZES);
	round_cxt = AllocSetContextCreate(TopMemoryContext, "tuvl round", ALLOCSET_DEFAULT_SIZES);
	step_cxt = AllocSetContextCreate(TopMemoryContext, "tuvl step", ALLOCSET_DEFAULT_SIZES);
	MemoryContextSwitchTo(round_cxt);
}

/* Leave when the extension is not installed; else tell the launcher it is. */
static void
check_extension_at_start(void)
{
	StartTransactionCommand();
	if (!extension_present())
	{
		AbortCurrentTransaction();
		exit_extension_dropped();
	}
	CommitTransactionCommand();
	MemoryContextSwitchTo(round_cxt);
	note_extension_present();
	was_present = true;
}

/*
 * Runs this worker let go of but could not give back yet, because a
 * session held their rows locked (LeaseRelease): still ours in the table,
 * given back by the next maintenance (or when this worker exits: then
 * they are reclaimed).  In TopMemoryContext.
 */
static int	n_unreleased = 0;
static int64 *unreleased_ids = NULL;
static int32 *unreleased_attempts = NULL;

/* Give runs back, remembering those a session keeps locked.  In a transaction. */
static void
release_or_remember(int n, const int64 *ids, const int32 *attempts)
{
	bool	   *released = palloc(sizeof(bool) * n);
	int			keep = 0;

	(void) LeaseRelease(n, ids, attempts, released);
	for (int i = 0; i < n; i++)
		keep += released[i] ? 0 : 1;
	if (keep == 0)
		return;
	unreleased_ids = MemoryContextAlloc(TopMemoryContext, sizeof(int64) * (n_unreleased + keep));
	unreleased_attempts = MemoryContextAlloc(TopMemoryContext, sizeof(int32) * (n_unreleased + keep));
	for (int i = 0; i < n; i++)
		if (!released[i])
		{
			unreleased_ids[n_unreleased] = ids[i];
			unreleased_attempts[n_unreleased++] = attempts[i];
		}
}

/* Try again to give back the runs release_or_remember kept.  In a transaction. */
static void
release_unreleased(void)
{
	int			n = n_unreleased;
	int64	   *ids = unreleased_ids;
	int32	   *attempts = unreleased_attempts;

	if (n == 0)
		return;
	n_unreleased = 0;
	unreleased_ids = NULL;
	unreleased_attempts = NULL;
	release_or_remember(n, ids, attempts);
	pfree(ids);
	pfree(attempts);
}

/*
 * Recover from an ERROR caught by the worker's sigsetjmp block: abort, let
 * go of every run held (they go back to the queue) and pause a moment.
 */
static void
recover_from_error(void)
{
	int			nheld;
	int64	   *ids;
	int32	   *attempts;
	int			i = 0;
	ListCell   *lc;

	error_context_stack = NULL;
	HOLD_INTERRUPTS();
	DeadlineReset();
	MyTuvlSlot->executing_run = 0;
	EmitErrorReport();
	AbortOutOfAnyTransaction();
	SPI_finish();
	MemoryContextSwitchTo(TopMemoryContext);
	FlushErrorState();

	/* let go of every run we held: they go back to the queue below */
	nheld = list_length(held);
	ids = palloc(sizeof(int64) * Max(nheld, 1));
	attempts = palloc(sizeof(int32) * Max(nheld, 1));
	foreach(lc, held)
	{
		ids[i] = ((RunState *) lfirst(lc))->id;
		attempts[i++] = ((RunState *) lfirst(lc))->attempt;
	}
	forget_all_runs();
	release_solo_slot();
	HttpAbortAll();
	MemoryContextReset(round_cxt);
	RESUME_INTERRUPTS();

	/* a dropped extension shows up as errors first */
	begin_tx("tuvl recovering from an error");
	if (!extension_present())
	{
		SPI_finish();
		PopActiveSnapshot();
		AbortCurrentTransaction();
		exit_extension_dropped();
	}
	if (nheld > 0)
		release_or_remember(nheld, ids, attempts);
	commit_tx();
	pfree(ids);
	pfree(attempts);
	TuvlWakeWorkers(MyDatabaseId);
	/* do not spin on a persistent error */
	pg_usleep(1000000L);
}

/*
 * Before leaving on purpose (the launcher shrinks the pool): give every
 * held run back to the queue, where the other workers take it at once.
 * Left to lapse, their leases would count as recoveries (LeaseReclaim),
 * as if this worker had died.  Between batches: no transaction is open.
 */
static void
hand_back_all_runs(void)
{
	int			n = list_length(held);
	int64	   *ids;
	int32	   *attempts;
	int			i = 0;
	ListCell   *lc;

	if (n == 0)
		return;
	ids = palloc(sizeof(int64) * n);
	attempts = palloc(sizeof(int32) * n);
	foreach(lc, held)
	{
		ids[i] = ((RunState *) lfirst(lc))->id;
		attempts[i++] = ((RunState *) lfirst(lc))->attempt;
	}
	begin_tx("tuvl handing runs back");
	(void) LeaseRelease(n, ids, attempts, NULL);
	commit_tx();
	forget_all_runs();
	HttpAbortAll();
	TuvlWakeWorkers(MyDatabaseId);
}

/* Handle interrupts, a configuration reload and the launcher's stop. */
static void
handle_interrupts(void)
{
	CHECK_FOR_INTERRUPTS();
	if (ConfigReloadPending)
	{
		ConfigReloadPending = false;
		ProcessConfigFile(PGC_SIGHUP);
	}
	if (TuvlShmem->slots[my_slot].stop_requested)
	{
		ereport(LOG, (errmsg("tuvl worker stopping at the launcher's request")));
		hand_back_all_runs();
		proc_exit(0);
	}
}

/*
 * While default_transaction_read_only is on, no claim, renewal or
 * transition can write: pg_auto_failover sets it on a standby it is
 * promoting until the old primary is surely down.  Wait for the reload
 * that turns it off instead of failing every second, and say so once each
 * way.  Returns true when the server is read-only (after a wait).
 */
static bool
wait_while_read_only(void)
{
	static bool waiting = false;

	if (!DefaultXactReadOnly)
	{
		if (waiting)
			ereport(LOG,
					(errmsg("tuvl worker resumes: default_transaction_read_only is off")));
		waiting = false;
		return false;
	}
	if (!waiting)
		ereport(LOG,
				(errmsg("tuvl worker waits: default_transaction_read_only is on"),
				 errdetail("No run can be claimed or advanced while transactions are read-only; the worker resumes when the setting is turned off.")));
	waiting = true;
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 MAINTENANCE_INTERVAL_MS, PG_WAIT_EXTENSION);
	ResetLatch(MyLatch);
	return true;
}

/*
 * Run the maintenance when it is due, renewing our leases when that is
 * due too; returns true when it ran.
 */
static bool
maintain_when_due(volatile TimestampTz *next_maintenance, volatile TimestampTz *next_renewal)
{
	TimestampTz now = GetCurrentTimestamp();
	bool		renew;

	if (now < *next_maintenance)
		return false;
	renew = now >= *next_renewal;
	maintenance(renew);
	*next_maintenance = TimestampTzPlusMilliseconds(now, MAINTENANCE_INTERVAL_MS);
	if (renew)
		*next_renewal = TimestampTzPlusMilliseconds(now, tuvl_heartbeat_interval);
	return true;
}

/*
 * After a batch: take a wake-up that came while it ran, and collect the
 * transfers that finished meanwhile, without sleeping.
 */
static void
after_batch(volatile bool *want_claim)
{
	/* a start_run() committed while we were busy? */
	if (MyLatch->is_set || MyTuvlSlot->woken)
	{
		ResetLatch(MyLatch);
		note_wakeup();
		*want_claim = true;
	}
	/* collect whatever finished meanwhile, without sleeping */
	if (HttpInFlight() > 0)
	{
		(void) HttpWait(0);
		collect_done();
	}
}

/*
 * Nothing is ready: sleep until the latch, a transfer or a timer (the
 * next maintenance, the next send), then collect the finished transfers.
 */
static void
wait_for_work(TimestampTz next_maintenance, TimestampTz next_send, volatile bool *want_claim)
{
	TimestampTz now;
	TimestampTz wake;
	long		timeout;

	now = GetCurrentTimestamp();
	wake = next_maintenance;
	if (next_send != 0 && next_send < wake)
		wake = next_send;
	timeout = Max(0, (long) ((wake - now) / 1000));
	if (MyTuvlSlot->woken)
		timeout = 0;
	if (HttpWait(timeout) || MyTuvlSlot->woken)
		*want_claim = true;
	note_wakeup();
	collect_done();
}

void
TuvlWorkerMain(Datum main_arg)
{
	sigjmp_buf	local_sigjmp_buf;
	Oid			dboid;
	volatile TimestampTz next_maintenance = 0;
	volatile TimestampTz next_renewal = 0;
	volatile bool want_claim = true;

	my_slot = DatumGetInt32(main_arg);
	memcpy(&dboid, MyBgworkerEntry->bgw_extra, sizeof(Oid));

	pqsignal(SIGTERM, die);
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	BackgroundWorkerUnblockSignals();

	if (TuvlShmem == NULL)
		proc_exit(1);
	before_shmem_exit(release_slot, (Datum) 0);
	before_shmem_exit(release_solo_slot_at_exit, (Datum) 0);

	take_slot(dboid);
	connect_worker(dboid);
	create_worker_memory();
	check_extension_at_start();

	ereport(LOG, (errmsg("tuvl worker %d started", TuvlShmem->slots[my_slot].number)));

	/* A long-lived worker survives its own errors, like the bgwriter. */
	if (sigsetjmp(local_sigjmp_buf, 1) != 0)
		recover_from_error();
	PG_exception_stack = &local_sigjmp_buf;

	for (;;)
	{
		TimestampTz next_send;
		int			room;

		handle_interrupts();
		MemoryContextReset(round_cxt);
		heartbeat_timeout();
		if (wait_while_read_only())
			continue;

		if (maintain_when_due(&next_maintenance, &next_renewal))
			want_claim = true;

		/* keep claiming while the queue may hold more than we took */
		room = claim_room();
		if (want_claim && room > 0 && !solo_slot_held)
			want_claim = claim() >= room;

		abandon_aborted_effects();
		start_due_sends(&next_send);
		if (run_solo())
		{
			want_claim = true;
			continue;
		}
		if (advance_batch() > 0)
		{
			after_batch(&want_claim);
			continue;
		}

		/* nothing ready: sleep until the latch, a transfer or a timer */
		wait_for_work(next_maintenance, next_send, &want_claim);
	}
}
