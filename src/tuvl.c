/*-------------------------------------------------------------------------
 *
 * tuvl.c
 *	  What every module shares: the GUCs, the shared memory segment,
 *	  commit-time wake-ups and abort interrupts, and small helpers (size
 *	  limits, preload and replay checks).  The library's entry point,
 *	  which sets all this up, is init.c.
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

int			tuvl_workers_per_database = 2;
int			tuvl_max_workers = 16;
int			tuvl_lease_timeout = 30000;
int			tuvl_heartbeat_interval = 5000;
int			tuvl_runs_per_worker = 512;
int			tuvl_launcher_naptime = 10000;
int			tuvl_sync_timeout = 30000;
int			tuvl_max_recoveries = 3;
char	   *tuvl_http_allowed_hosts = NULL;
int			tuvl_http_timeout = 30000;
int			tuvl_agent_tool_timeout = 300;
int			tuvl_agent_pause_max = 300;
int			TuvlReplayDepth = 0;
int			tuvl_step_timeout = 10 * 60 * 1000;
int			tuvl_max_step_timeout = 60 * 60 * 1000;
int			tuvl_max_child_depth = 8;
int			tuvl_max_run_tree = 10000;
int			tuvl_metric_series_per_role = 2048;
int			tuvl_max_batch_time = 50;
int			tuvl_max_input_size = 8 * 1024 * 1024;
int			tuvl_max_output_size = 16 * 1024 * 1024;
int			tuvl_max_source_size = 1024 * 1024;
int			tuvl_max_worker_memory = 256 * 1024;	/* kB */
TuvlWorkerSlot *MyTuvlSlot = NULL;
int			tuvl_http_max_response_size = 10 * 1024 * 1024;
int			tuvl_http_max_redirects = 5;
bool		tuvl_http_verify_tls = true;
char	   *tuvl_http_ca_file = NULL;
bool		tuvl_http2 = true;
bool		tuvl_log_agent_events = false;
char	   *tuvl_otlp_endpoint = NULL;
char	   *tuvl_retention = NULL;
char	   *tuvl_databases = NULL;


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
		pg_atomic_init_u64(&TuvlShmem->control_gen, 1);	/* 0: never read */
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
			/* FALLTHROUGH */
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			wake_workers_pending = false;
			wake_principal = InvalidOid;
			run_changed_pending = false;
			control_changed_pending = false;
			n_pending_interrupts = 0;
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

/* "50 MB", "512 kB" or "300 bytes", for messages about sizes. */
char *
TuvlSizeText(int64 bytes)
{
	if (bytes >= 1024 * 1024)
		return bytes % (1024 * 1024) == 0 ? psprintf(INT64_FORMAT " MB", bytes / (1024 * 1024))
			: psprintf("%.1f MB", bytes / (1024.0 * 1024.0));
	if (bytes >= 1024)
		return bytes % 1024 == 0 ? psprintf(INT64_FORMAT " kB", bytes / 1024)
			: psprintf("%.1f kB", bytes / 1024.0);
	return psprintf(INT64_FORMAT " bytes", bytes);
}

/*
 * Raise when what (e.g. "the run input") of size bytes passes the limit
 * set by the GUC named guc.
 */
void
TuvlCheckSize(const char *what, int64 bytes, int64 limit, const char *guc)
{
	if (bytes > limit)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("%s is %s, more than %s (%s)", what, TuvlSizeText(bytes), guc,
						TuvlSizeText(limit)),
				 errhint("A superuser can raise %s.", guc)));
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

/* An integer GUC of the library; see define_int_gucs. */
typedef struct IntGuc
{
	const char *name;
	const char *short_desc;
	const char *long_desc;		/* NULL: none */
	int		   *variable;
	int			boot;
	int			min;
	int			max;
	GucContext	context;
	int			flags;
	bool		preload_only;	/* postmaster-level: defined only while
								 * preloading */
} IntGuc;

/* Workers, leases and tuvl.run(), in the order they are defined. */
static const IntGuc worker_gucs[] = {
	{"tuvl.workers_per_database",
		"Background workers executing runs in each database with the extension.",
		"Changes take effect on reload: the launcher starts or stops workers.",
	&tuvl_workers_per_database, 2, 0, 64, PGC_SIGHUP, 0, false},
	{"tuvl.max_workers",
		"Maximum number of tuvl workers across all databases.",
		"Each also needs a slot of max_worker_processes.",
	&tuvl_max_workers, 16, 1, 1024, PGC_POSTMASTER, 0, true},
	{"tuvl.lease_timeout",
		"How long a worker's claim on a run lasts without renewal.",
		"A run whose lease expired is returned to the queue.",
	&tuvl_lease_timeout, 30000, 1000, INT_MAX, PGC_SIGHUP, GUC_UNIT_MS, false},
	{"tuvl.heartbeat_interval",
		"How often workers renew the leases of the runs they hold.",
		"Keep it well below tuvl.lease_timeout.",
	&tuvl_heartbeat_interval, 5000, 100, INT_MAX, PGC_SIGHUP, GUC_UNIT_MS, false},
	{"tuvl.runs_per_worker",
		"Maximum number of runs one worker holds at once.",
		"Held runs waiting for HTTP effects count too: this bounds the transfers in flight per worker.",
	&tuvl_runs_per_worker, 512, 1, 100000, PGC_SIGHUP, 0, false},
	{"tuvl.launcher_naptime",
		"How often the launcher rescans databases without being woken.",
		NULL,
	&tuvl_launcher_naptime, 10000, 100, INT_MAX, PGC_SIGHUP, GUC_UNIT_MS, false},
	{"tuvl.sync_timeout",
		"Default time tuvl.run() executes a run before handing it to the workers.",
		"A workflow's trigger.sync_timeout and the sync_timeout argument override it.",
	&tuvl_sync_timeout, 30000, 0, INT_MAX, PGC_USERSET, GUC_UNIT_MS, false},
	{"tuvl.max_recoveries",
		"Times a run is taken up again after its worker died while holding it, before it fails.",
		"Counted since the run last got further (a result journaled, another step); the run then fails with _last_error_type recovery_limit, so that a response or a step that kills its worker is not sent or run again and again.",
	&tuvl_max_recoveries, 3, 0, 1000, PGC_SIGHUP, 0, false},
};

/* Timeouts and size limits, in the order they are defined. */
static const IntGuc limit_gucs[] = {
	{"tuvl.http_timeout",
		"Default timeout of one HTTP request.",
		"A step's own timeout overrides it.",
	&tuvl_http_timeout, 30000, 100, INT_MAX, PGC_USERSET, GUC_UNIT_MS, false},
	{"tuvl.agent_tool_timeout",
		"Wall-clock limit of one tool call of an autonomous agent.",
		"A tool that runs longer ends the agent on its error exit.",
	&tuvl_agent_tool_timeout, 300, 1, INT_MAX / 1000, PGC_SUSET, GUC_UNIT_S, false},
	{"tuvl.step_timeout",
		"Wall-clock limit of a step that sets no timeout of its own.",
		"SQL is cancelled at the deadline; the step takes its error route with _last_error_type timeout. Time spent paused or waiting for a person does not count. 0 means tuvl.max_step_timeout, and more is cut to it.",
	&tuvl_step_timeout, 10 * 60 * 1000, 0, INT_MAX, PGC_USERSET, GUC_UNIT_MS, false},
	{"tuvl.max_batch_time",
		"How long a worker's batch of transitions may run before it commits.",
		"A transition still running at the limit is cancelled and executed again on its own, so a slow step never holds up other runs' commits.",
	&tuvl_max_batch_time, 50, 1, 60000, PGC_SIGHUP, GUC_UNIT_MS, false},
	{"tuvl.max_input_size",
		"Largest run input tuvl.start_run() and tuvl.run() accept.",
		NULL,
	&tuvl_max_input_size, 8 * 1024 * 1024, 1024, MaxAllocSize, PGC_SUSET, GUC_UNIT_BYTE, false},
	{"tuvl.max_output_size",
		"Largest output a step may write to the run's context.",
		"A step whose output is larger fails with _last_error_type too_large.",
	&tuvl_max_output_size, 16 * 1024 * 1024, 1024, MaxAllocSize, PGC_SUSET, GUC_UNIT_BYTE, false},
	{"tuvl.max_source_size",
		"Largest YAML document register_workflow(), register_artifact() and register_llm() accept.",
		NULL,
	&tuvl_max_source_size, 1024 * 1024, 1024, MaxAllocSize, PGC_SUSET, GUC_UNIT_BYTE, false},
	{"tuvl.max_worker_memory",
		"Memory a worker may hold for its runs and the responses in flight.",
		"Past it the worker claims no runs and starts no requests until memory is freed, except one request at a time.",
	&tuvl_max_worker_memory, 256 * 1024, 1024, MAX_KILOBYTES, PGC_SIGHUP, GUC_UNIT_KB, false},
	{"tuvl.agent_pause_max",
		"How long an autonomous agent may stay paused.",
		"An agent paused longer is aborted: it takes its aborted exit.",
	&tuvl_agent_pause_max, 300, 1, INT_MAX / 1000, PGC_SIGHUP, GUC_UNIT_S, false},
	{"tuvl.http_max_response_size",
		"Largest HTTP response body accepted; larger ones fail the request.",
		NULL,
	&tuvl_http_max_response_size, 10 * 1024 * 1024, 1024, 1024 * 1024 * 1024, PGC_SUSET, GUC_UNIT_BYTE, false},
	{"tuvl.http_max_redirects",
		"Redirects an HTTP request follows at most (each target must be allowed).",
		NULL,
	&tuvl_http_max_redirects, 5, 0, 50, PGC_SUSET, 0, false},
};

/* Define the integer GUCs of a table, in its order. */
static void
define_int_gucs(const IntGuc *gucs, int n)
{
	for (int i = 0; i < n; i++)
	{
		const IntGuc *g = &gucs[i];

		/* a postmaster-level setting can only be defined while preloading */
		if (g->preload_only && !process_shared_preload_libraries_in_progress)
			continue;
		DefineCustomIntVariable(g->name, g->short_desc, g->long_desc,
								g->variable, g->boot, g->min, g->max,
								g->context, g->flags, NULL, NULL, NULL);
	}
}

/*
 * Bounds on what one role's runs may take from the others, in the order
 * they are defined: no step runs for ever, child runs nest and multiply
 * only so far, and metric series have a share per role.
 */
static const IntGuc bound_gucs[] = {
	{"tuvl.max_step_timeout",
		"Longest wall-clock limit of any step.",
		"A step's timeout and tuvl.step_timeout are cut to it, and timeout: 0 means it: no step occupies a worker longer.",
	&tuvl_max_step_timeout, 60 * 60 * 1000, 1000, INT_MAX, PGC_SUSET, GUC_UNIT_MS, false},
	{"tuvl.max_child_depth",
		"How many Workflow steps deep child runs may nest below a run.",
		"A Workflow step that would start a child deeper fails with _last_error_type child_limit.",
	&tuvl_max_child_depth, 8, 0, 1000, PGC_SUSET, 0, false},
	{"tuvl.max_run_tree",
		"How many child runs Workflow steps may start under one run, at every depth.",
		"A Workflow step that would start more fails with _last_error_type child_limit, before starting any.",
	&tuvl_max_run_tree, 10000, 1, 100000000, PGC_SUSET, 0, false},
	{"tuvl.metric_series_per_role",
		"How many metric series the runs of one role may create, of the 8,192 the server holds.",
		"Additions to a new series past it are dropped and counted in tuvl.metrics.dropped.",
	&tuvl_metric_series_per_role, 2048, 0, 8192, PGC_SIGHUP, 0, false},
};

/* tuvl.retention: empty, or an interval that is not negative. */
static bool
check_retention(char **newval, void **extra, GucSource source)
{
	Interval   *volatile iv = NULL;
	Interval	zero;
	MemoryContext cxt = CurrentMemoryContext;

	if (*newval == NULL || (*newval)[0] == '\0')
		return true;
	PG_TRY();
	{
		iv = DatumGetIntervalP(DirectFunctionCall3(interval_in, CStringGetDatum(*newval),
												   ObjectIdGetDatum(InvalidOid), Int32GetDatum(-1)));
	}
	PG_CATCH();
	{
		MemoryContextSwitchTo(cxt);
		FlushErrorState();
	}
	PG_END_TRY();
	if (iv == NULL)
	{
		GUC_check_errdetail("tuvl.retention must be an interval, such as 30 days.");
		return false;
	}
	memset(&zero, 0, sizeof(zero));
	if (DatumGetBool(DirectFunctionCall2(interval_lt, IntervalPGetDatum(iv), IntervalPGetDatum(&zero))))
	{
		GUC_check_errdetail("tuvl.retention must not be negative.");
		return false;
	}
	return true;
}

/* tuvl.http_ca_file: empty, or an absolute path (read when a request is made). */
static bool
check_ca_file(char **newval, void **extra, GucSource source)
{
	if (*newval == NULL || (*newval)[0] == '\0' || is_absolute_path(*newval))
		return true;
	GUC_check_errdetail("tuvl.http_ca_file must be an absolute path, such as /etc/tuvl/ca.pem.");
	return false;
}

/* tuvl.databases: a list of database names, as search_path is written. */
static bool
check_databases(char **newval, void **extra, GucSource source)
{
	char	   *raw;
	List	   *names;
	bool		ok;

	if (*newval == NULL)
		return true;
	raw = pstrdup(*newval);
	ok = SplitIdentifierString(raw, ',', &names);
	list_free(names);
	pfree(raw);
	if (!ok)
		GUC_check_errdetail("tuvl.databases must be a comma-separated list of database names.");
	return ok;
}

void
TuvlDefineGucs(void)
{
	define_int_gucs(worker_gucs, lengthof(worker_gucs));
	DefineCustomStringVariable("tuvl.http_allowed_hosts",
							   "Hosts that HTTP effects (APICall, MCP, LLM calls) may reach.",
							   "A comma-separated list of host, host:port, *.domain or host:* patterns; "
							   "empty (the default) allows none, * allows any.",
							   &tuvl_http_allowed_hosts, "",
							   PGC_SUSET, 0, NULL, NULL, NULL);
	define_int_gucs(limit_gucs, lengthof(limit_gucs));
	define_int_gucs(bound_gucs, lengthof(bound_gucs));
	DefineCustomBoolVariable("tuvl.http_verify_tls",
							 "Verify TLS certificates and host names of HTTPS requests.",
							 "Turn off only for testing.",
							 &tuvl_http_verify_tls, true,
							 PGC_SUSET, 0, NULL, NULL, NULL);
	DefineCustomStringVariable("tuvl.http_ca_file",
							   "A PEM file of certificate authorities HTTPS requests trust besides the system's.",
							   "An absolute path readable by the server, for a private CA; empty (the default): the system's only.",
							   &tuvl_http_ca_file, "",
							   PGC_SUSET, 0, check_ca_file, NULL, NULL);
	DefineCustomBoolVariable("tuvl.http2",
							 "Use HTTP/2 with multiplexing where an HTTPS server offers it.",
							 "Off: every request uses HTTP/1.1, one connection per request in flight.",
							 &tuvl_http2, true,
							 PGC_SUSET, 0, NULL, NULL, NULL);
	DefineCustomStringVariable("tuvl.databases",
							   "The databases tuvl workers run in.",
							   "A comma-separated list of database names (folded to lower case unless double-quoted); empty (the default): every database that has the extension.",
							   &tuvl_databases, "",
							   PGC_SIGHUP, GUC_LIST_INPUT, check_databases, NULL, NULL);
	DefineCustomStringVariable("tuvl.retention",
							   "How long tuvl.purge() keeps finished runs, by default.",
							   "An interval such as 30 days; empty (the default): tuvl.purge() needs its argument. Nothing is deleted unless tuvl.purge() is called (from pg_cron, say).",
							   &tuvl_retention, "",
							   PGC_SUSET, 0, check_retention, NULL, NULL);
	DefineCustomStringVariable("tuvl.otlp_endpoint",
							   "Where to export spans of runs, over OTLP/HTTP (JSON).",
							   "For example http://127.0.0.1:4318/v1/traces; empty: no traces. The host must be in tuvl.http_allowed_hosts.",
							   &tuvl_otlp_endpoint, "",
							   PGC_SIGHUP, 0, NULL, NULL, NULL);
	DefineCustomBoolVariable("tuvl.log_agent_events",
							 "Write a server log line for each agent turn, tool call and exit.",
							 "Each line is \"tuvl agent event\" and a JSON object with the event, run, step, iteration and trace id.",
							 &tuvl_log_agent_events, false,
							 PGC_SUSET, 0, NULL, NULL, NULL);
	MarkGUCPrefixReserved("tuvl");
}
