/*-------------------------------------------------------------------------
 *
 * tuvl.h
 *	  Shared declarations of the tuvl extension: GUCs, shared memory and
 *	  the wake-up protocol between backends, the launcher and the workers.
 *
 * Shared memory exists only when the library is in
 * shared_preload_libraries; TuvlShmem is NULL otherwise and every caller
 * must cope (the synchronous path works without it, the workers do not).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_H
#define TUVL_H

#include "access/xact.h"
#include "port/atomics.h"
#include "storage/condition_variable.h"
#include "storage/latch.h"
#include "storage/lwlock.h"

#include "queue.h"

#ifndef TUVL_VERSION
#define TUVL_VERSION "unknown"
#endif

/* Upper bound on databases the launcher tracks at once. */
#define TUVL_MAX_DATABASES 64

/* What the launcher knows about one database. */
typedef enum TuvlDbState
{
	TUVL_DB_UNKNOWN = 0,		/* not probed yet, or woken by CREATE
								 * EXTENSION */
	TUVL_DB_ABSENT,				/* probed: the extension is not installed */
	TUVL_DB_PRESENT				/* workers run here */
} TuvlDbState;

typedef struct TuvlDbEntry
{
	Oid			dboid;			/* InvalidOid: free entry */
	TuvlDbState state;
	TimestampTz probed_at;		/* when state became ABSENT */
	uint32		created_gen;	/* bumped when CREATE EXTENSION commits here */
	int			solo_workers;	/* workers executing a slow step alone */
	QueueState	queue;			/* roles with queued runs: see queue.c */
	pg_atomic_uint32 dev_active;	/* dev mode's gate (shmem.c, TuvlDevGate):
									 * breakpoints plus runs in step mode, as
									 * a signed count */
	bool		dev_counted;	/* dev_active was counted from the tables
								 * since this entry was made */
} TuvlDbEntry;

/* One background worker slot. */
/* Aborted runs a worker remembers until it applied their aborts. */
#define TUVL_ABORT_MARKS 8

typedef struct TuvlWorkerSlot
{
	bool		in_use;			/* reserved by the launcher */
	Oid			dboid;
	int			number;			/* 1-based number within its database */
	pid_t		pid;			/* 0 until the worker has started */
	Latch	   *latch;			/* the worker's process latch */
	bool		stop_requested; /* the launcher wants this worker gone */
	volatile TimestampTz alive_at;	/* heartbeat, written by a timer even
									 * while the worker executes a step */
	volatile int nheld;			/* runs the worker holds (a hint) */
	volatile int64 executing_run;	/* the run whose transition is executing,
									 * or 0 */
	volatile int64 aborted[TUVL_ABORT_MARKS];	/* runs an operator aborted
												 * (0: free): their
												 * transitions are cancelled */
	int			next_abort;		/* the mark the next abort takes */
	volatile bool alone;		/* running a slow step alone: claims nothing */
	volatile bool woken;		/* a wake-up for the worker's loop: user code
								 * waiting on the latch (pg_sleep) may have
								 * reset the latch itself */
	volatile Oid woken_by;		/* the role whose runs were queued, or 0 */
	volatile int in_flight;		/* HTTP transfers in flight */
	volatile int peak_in_flight;	/* the most at once since start */
} TuvlWorkerSlot;

typedef struct TuvlSharedState
{
	LWLock	   *lock;			/* protects everything below */
	int64		epoch;			/* changes at every (re)initialisation of
								 * shared memory, i.e. every server start and
								 * crash restart: leases of older epochs
								 * belong to dead processes */
	pid_t		launcher_pid;
	Latch	   *launcher_latch;
	ConditionVariable run_cv;	/* broadcast when a run becomes terminal or
								 * waiting; tuvl.wait() sleeps on it */
	pg_atomic_uint64 control_gen;	/* bumped when a transaction that changed
									 * some run's tuvl.runs.control commits */
	TuvlDbEntry dbs[TUVL_MAX_DATABASES];
	int			nslots;
	TuvlWorkerSlot slots[FLEXIBLE_ARRAY_MEMBER];
} TuvlSharedState;

extern TuvlSharedState *TuvlShmem;
extern Size TuvlShmemSize(void);
extern void TuvlShmemRequest(void);
extern void TuvlShmemStartup(void);
extern void GucsDefine(void);

/* GUCs */
extern int	tuvl_workers_per_database;
extern int	tuvl_max_workers;
extern int	tuvl_max_model_limits;
extern int	tuvl_model_admission_slots;
extern int	tuvl_model_limits_window;
extern int	tuvl_lease_timeout;
extern int	tuvl_heartbeat_interval;
extern int	tuvl_runs_per_worker;
extern int	tuvl_launcher_naptime;
extern int	tuvl_sync_timeout;
extern char *tuvl_http_allowed_hosts;
extern int	tuvl_http_timeout;
extern int	tuvl_agent_tool_timeout;
extern int	tuvl_agent_pause_max;
extern int	tuvl_step_timeout;
extern int	tuvl_max_step_timeout;
extern int	tuvl_max_child_depth;
extern int	tuvl_max_run_tree;
extern int	tuvl_metric_series_per_role;
extern int	tuvl_max_batch_time;
extern int	tuvl_max_input_size;
extern int	tuvl_max_recoveries;
extern int	tuvl_max_output_size;
extern int	tuvl_max_source_size;
extern int	tuvl_max_worker_memory;

extern char *GucsSizeText(int64 bytes);
extern void GucsCheckSize(const char *what, int64 bytes, int64 limit, const char *guc);
extern int	tuvl_http_max_response_size;
extern int	tuvl_http_max_redirects;
extern bool tuvl_http_verify_tls;
extern char *tuvl_http_ca_file;
extern char *tuvl_oauth_redirect_uri;
extern bool tuvl_http2;
extern bool tuvl_log_agent_events;
extern char *tuvl_otlp_endpoint;
extern char *tuvl_retention;
extern char *tuvl_databases;

/*
 * How many tuvl.replay() calls this backend is inside.  A replay serves
 * every outside result from its fixture, so while one runs nothing may
 * leave the database: requests, tuvl.run(), nested replays and
 * mcp_list_tools() are refused (TuvlRefuseWhileReplaying).  It never
 * widens anything: the allow-list and secret grants apply as always.
 */
extern int	TuvlReplayDepth;
extern void TuvlRefuseWhileReplaying(const char *what);

/* Wake-ups: recorded now, delivered when the transaction commits. */
extern void TuvlWakeWorkersAtCommit(void);
extern void TuvlXactCallback(XactEvent event, void *arg);
extern void TuvlRunChangedAtCommit(void);
extern void TuvlControlChangedAtCommit(void);
extern uint64 TuvlControlGen(void);
extern void TuvlWakeWorkers(Oid dboid);
extern void TuvlWakeOneWorker(Oid dboid);
extern void TuvlRunChangedNow(void);
extern void TuvlInterruptRunAtCommit(int pid, int64 run_id);
extern bool TuvlAbortRequested(int64 run_id);
extern void TuvlAbortApplied(int64 run_id);
extern void TuvlSetExecuting(int64 run_id);
extern bool TuvlDevGate(void);
extern bool TuvlDevGateCounted(void);
extern void TuvlDevGateAdd(int n);
extern void TuvlDevGateSubAtCommit(int n);
extern void TuvlDevGateSet(int n);

/* The shared memory slot of this process, when it is a tuvl worker. */
extern TuvlWorkerSlot *MyTuvlSlot;

/* Raise a clear error when a feature needs shared_preload_libraries. */
extern void TuvlRequirePreload(const char *feature);
extern bool TuvlPreloaded(void);
extern bool TuvlLeaseHolderAlive(int pid, int64 epoch);

#endif							/* TUVL_H */
