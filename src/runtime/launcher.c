/*-------------------------------------------------------------------------
 *
 * launcher.c
 *	  The tuvl launcher: keeps a pool of workers in every database that
 *	  has the extension.
 *
 * The launcher is a static background worker connected to no database;
 * it reads pg_database (a shared catalog) and starts dynamic workers.  It
 * cannot see whether a database has the extension, so the first worker
 * started in a database finds out: if the extension is missing it marks
 * the database ABSENT in shared memory and exits; if present, it marks it
 * PRESENT and wakes the launcher, which starts the rest of the pool.  CREATE EXTENSION wakes
 * the launcher (at commit) and marks its database UNKNOWN again; an
 * ABSENT database is also re-probed every few naptimes as a backstop.
 * Workers exit by themselves after DROP EXTENSION.  The launcher holds
 * the handles of the workers it started and frees a slot once its worker
 * has stopped.  Its state of the worker pool lives in shared memory, under
 * TuvlShmem->lock.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/pg_database.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/proc.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/varlena.h"

#include "http.h"
#include "launcher.h"
#include "otlp.h"
#include "tuvl.h"

/* Re-probe an ABSENT database after this many naptimes. */
#define ABSENT_RECHECK_NAPTIMES 6

static BackgroundWorkerHandle **handles = NULL;

/*
 * Is the database named name one tuvl.databases lets workers run in?
 * Empty: every database.  The list is split as search_path is (names
 * folded to lower case unless quoted).
 */
static bool
database_allowed(const char *name)
{
	char	   *raw;
	List	   *names;
	ListCell   *lc;
	bool		found = false;

	if (tuvl_databases == NULL || tuvl_databases[0] == '\0')
		return true;
	raw = pstrdup(tuvl_databases);
	if (!SplitIdentifierString(raw, ',', &names))
		return false;			/* the check hook refused such a value */
	foreach(lc, names)
	{
		if (strcmp(lfirst(lc), name) == 0)
			found = true;
	}
	list_free(names);
	pfree(raw);
	return found;
}

/*
 * Databases that accept connections, are not templates and are allowed by
 * tuvl.databases, as a List in the caller's memory context; *all gets
 * every database that exists.
 */
static List *
list_databases(List **all)
{
	List	   *dbs = NIL;
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tup;
	MemoryContext caller = CurrentMemoryContext;

	StartTransactionCommand();
	(void) GetTransactionSnapshot();
	rel = table_open(DatabaseRelationId, AccessShareLock);
	scan = table_beginscan_catalog(rel, 0, NULL);
	while (HeapTupleIsValid(tup = heap_getnext(scan, ForwardScanDirection)))
	{
		Form_pg_database db = (Form_pg_database) GETSTRUCT(tup);

		/* the lists must outlive the transaction */
		MemoryContext old = MemoryContextSwitchTo(caller);

		*all = lappend_oid(*all, db->oid);
		if (db->datallowconn && !db->datistemplate && database_allowed(NameStr(db->datname)))
			dbs = lappend_oid(dbs, db->oid);
		MemoryContextSwitchTo(old);
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);
	CommitTransactionCommand();
	return dbs;
}

/* Find or add the entry of a database.  Caller holds the lock. */
static TuvlDbEntry *
db_entry(Oid dboid, bool create)
{
	TuvlDbEntry *free_entry = NULL;

	for (int i = 0; i < TUVL_MAX_DATABASES; i++)
	{
		if (TuvlShmem->dbs[i].dboid == dboid)
			return &TuvlShmem->dbs[i];
		if (free_entry == NULL && TuvlShmem->dbs[i].dboid == InvalidOid)
			free_entry = &TuvlShmem->dbs[i];
	}
	if (!create || free_entry == NULL)
		return NULL;
	memset(free_entry, 0, sizeof(TuvlDbEntry));
	free_entry->dboid = dboid;
	free_entry->state = TUVL_DB_UNKNOWN;
	QueueResetState(&free_entry->queue);
	pg_atomic_init_u32(&free_entry->dev_active, 0);
	return free_entry;
}

/* Free the slots of workers that have stopped. */
static void
reap_workers(void)
{
	for (int i = 0; i < TuvlShmem->nslots; i++)
	{
		pid_t		pid;

		if (handles[i] == NULL)
			continue;
		if (GetBackgroundWorkerPid(handles[i], &pid) == BGWH_STOPPED)
		{
			pfree(handles[i]);
			handles[i] = NULL;
			LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
			TuvlShmem->slots[i].in_use = false;
			TuvlShmem->slots[i].pid = 0;
			TuvlShmem->slots[i].latch = NULL;
			TuvlShmem->slots[i].stop_requested = false;
			LWLockRelease(TuvlShmem->lock);
		}
	}
}

/* Start worker number `number` for a database; false if no slot is free. */
static bool
start_worker(Oid dboid, int number)
{
	BackgroundWorker worker;
	int			slot = -1;

	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	for (int i = 0; i < TuvlShmem->nslots; i++)
		if (!TuvlShmem->slots[i].in_use && handles[i] == NULL)
		{
			slot = i;
			break;
		}
	if (slot >= 0)
	{
		TuvlShmem->slots[slot].in_use = true;
		TuvlShmem->slots[slot].dboid = dboid;
		TuvlShmem->slots[slot].number = number;
		TuvlShmem->slots[slot].pid = 0;
		TuvlShmem->slots[slot].latch = NULL;
		TuvlShmem->slots[slot].stop_requested = false;
	}
	LWLockRelease(TuvlShmem->lock);
	if (slot < 0)
		return false;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = BGW_NEVER_RESTART;
	strlcpy(worker.bgw_library_name, "tuvl", BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "TuvlWorkerMain", BGW_MAXLEN);
	snprintf(worker.bgw_name, BGW_MAXLEN, "tuvl worker %d", number);
	strlcpy(worker.bgw_type, "tuvl worker", BGW_MAXLEN);
	worker.bgw_main_arg = Int32GetDatum(slot);
	memcpy(worker.bgw_extra, &dboid, sizeof(Oid));
	worker.bgw_notify_pid = MyProcPid;

	if (!RegisterDynamicBackgroundWorker(&worker, &handles[slot]))
	{
		LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
		TuvlShmem->slots[slot].in_use = false;
		LWLockRelease(TuvlShmem->lock);
		handles[slot] = NULL;
		ereport(WARNING,
				(errmsg("could not start a tuvl worker"),
				 errhint("Raise max_worker_processes.")));
		return false;
	}
	return true;
}

/*
 * Entries of databases not in dbs (dropped, or left out of
 * tuvl.databases): their workers are asked to stop; the entry of a
 * database that no longer exists (not in all) is freed once none runs, so
 * that a server whose databases come and go never runs out of entries.
 * Caller holds the lock.
 */
static void
forget_unlisted(List *dbs, List *all)
{
	for (int e = 0; e < TUVL_MAX_DATABASES; e++)
	{
		TuvlDbEntry *entry = &TuvlShmem->dbs[e];
		bool		busy = false;

		if (entry->dboid == InvalidOid || list_member_oid(dbs, entry->dboid))
			continue;
		for (int i = 0; i < TuvlShmem->nslots; i++)
		{
			TuvlWorkerSlot *s = &TuvlShmem->slots[i];

			if (!s->in_use || s->dboid != entry->dboid)
				continue;
			busy = true;
			if (!s->stop_requested)
			{
				s->stop_requested = true;
				if (s->latch)
					SetLatch(s->latch);
			}
		}
		if (!busy && !list_member_oid(all, entry->dboid))
			memset(entry, 0, sizeof(TuvlDbEntry));
	}
}

/*
 * Bring every database's pool to the configured size: probe unknown
 * databases with one worker, fill or trim pools where tuvl is present.
 */
static void
balance_pools(void)
{
	List	   *all = NIL;
	List	   *dbs = list_databases(&all);
	ListCell   *lc;
	TimestampTz now = GetCurrentTimestamp();

	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	forget_unlisted(dbs, all);
	LWLockRelease(TuvlShmem->lock);

	foreach(lc, dbs)
	{
		Oid			dboid = lfirst_oid(lc);
		TuvlDbEntry *entry;
		TuvlDbState state;
		int			running = 0;
		int			want;
		bool		used[1024] = {false};

		LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
		entry = db_entry(dboid, true);
		if (entry == NULL)
		{
			LWLockRelease(TuvlShmem->lock);
			continue;
		}
		if (entry->state == TUVL_DB_ABSENT &&
			TimestampDifferenceExceeds(entry->probed_at, now,
									   tuvl_launcher_naptime * ABSENT_RECHECK_NAPTIMES))
			entry->state = TUVL_DB_UNKNOWN;
		state = entry->state;
		for (int i = 0; i < TuvlShmem->nslots; i++)
		{
			TuvlWorkerSlot *s = &TuvlShmem->slots[i];

			if (!s->in_use || s->dboid != dboid)
				continue;
			if (running >= tuvl_workers_per_database && state == TUVL_DB_PRESENT)
			{
				s->stop_requested = true;
				if (s->latch)
					SetLatch(s->latch);
			}
			else if (!s->stop_requested)
			{
				running++;
				if (s->number > 0 && s->number < 1024)
					used[s->number] = true;
			}
		}
		LWLockRelease(TuvlShmem->lock);

		if (state == TUVL_DB_ABSENT)
			continue;
		/* an unknown database gets one worker, which probes it */
		want = state == TUVL_DB_UNKNOWN ? Min(1, tuvl_workers_per_database) : tuvl_workers_per_database;
		for (int number = 1; running < want && number < 1024; number++)
		{
			if (used[number])
				continue;
			if (!start_worker(dboid, number))
				break;
			running++;
		}
	}
	list_free(dbs);
	list_free(all);
}

static bool extension_created_pending = false;

/* This transaction created the extension: see LauncherXactCallback. */
void
LauncherNoteExtensionCreatedAtCommit(void)
{
	extension_created_pending = true;
}

/*
 * Called when a CREATE EXTENSION commits: the database gets workers at the
 * launcher's next round, which this wakes.
 */
static void
note_extension_created(Oid dboid)
{
	TuvlDbEntry *entry;
	Latch	   *latch;

	if (TuvlShmem == NULL)
		return;
	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	entry = db_entry(dboid, true);
	if (entry)
	{
		/* a probe that started before this commit must not mark it ABSENT */
		entry->created_gen++;
		/* a new tuvl.runs: positions in the old one mean nothing */
		QueueResetState(&entry->queue);
		if (entry->state == TUVL_DB_ABSENT)
			entry->state = TUVL_DB_UNKNOWN;
	}
	latch = TuvlShmem->launcher_latch;
	LWLockRelease(TuvlShmem->lock);
	if (latch)
		SetLatch(latch);
}

/*
 * Transaction callback (registered by init.c): once the extension is
 * visible, the launcher probes the database again.
 */
void
LauncherXactCallback(XactEvent event, void *arg)
{
	if ((event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT) &&
		extension_created_pending && TuvlShmem)
		note_extension_created(MyDatabaseId);
	if (event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT ||
		event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT)
		extension_created_pending = false;
}

void
TuvlLauncherMain(Datum main_arg)
{
	pqsignal(SIGTERM, die);
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	BackgroundWorkerUnblockSignals();

	BackgroundWorkerInitializeConnection(NULL, NULL, 0);
	pgstat_report_appname("tuvl launcher");

	handles = MemoryContextAllocZero(TopMemoryContext,
									 sizeof(BackgroundWorkerHandle *) * TuvlShmem->nslots);

	LWLockAcquire(TuvlShmem->lock, LW_EXCLUSIVE);
	TuvlShmem->launcher_pid = MyProcPid;
	TuvlShmem->launcher_latch = MyLatch;
	/* slots of a previous launcher's workers are stale after a restart */
	for (int i = 0; i < TuvlShmem->nslots; i++)
		if (TuvlShmem->slots[i].in_use && TuvlShmem->slots[i].pid == 0)
			TuvlShmem->slots[i].in_use = false;
	LWLockRelease(TuvlShmem->lock);

	ereport(LOG, (errmsg("tuvl launcher started")));

	for (;;)
	{
		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
		}
		ResetLatch(MyLatch);
		reap_workers();
		balance_pools();
		/* export spans (otlp.c): the collector's socket wakes us too */
		{
			long		wait_ms = OtlpExport();

			if (wait_ms < 0 || wait_ms > tuvl_launcher_naptime)
				wait_ms = tuvl_launcher_naptime;
			if (HttpInFlight() > 0)
				(void) HttpWait(wait_ms);
			else
				(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
								 wait_ms, PG_WAIT_EXTENSION);
		}
	}
}
