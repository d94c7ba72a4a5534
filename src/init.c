/*-------------------------------------------------------------------------
 *
 * init.c
 *	  The library's entry point: what loading tuvl sets up.
 *
 * The library works in two modes.  Preloaded (shared_preload_libraries),
 * it owns a small shared memory segment and a static launcher that keeps
 * a pool of workers in every database with the extension.  Loaded on
 * demand, only the SQL functions that run in the calling backend work
 * (tuvl.run, tuvl.validate, ...); anything needing workers says so with
 * an error or a warning that carries a hint.
 *
 * This file is the only one that knows every module: it registers the
 * step kinds with the executor table, the GUCs, the transaction
 * callbacks and the hooks.  No other file calls into it.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "postmaster/bgworker.h"
#include "storage/ipc.h"

#include "admission.h"
#include "channel.h"
#include "executor.h"
#include "grant_hint.h"
#include "launcher.h"
#include "metrics.h"
#include "queue.h"
#include "replay.h"
#include "security.h"
#include "otlp.h"
#include "trace.h"
#include "tuvl.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/*
 * The step kinds: each kind's row (StepExecutor: how it executes, which
 * keys it takes and how they are checked, what the runtime and the agent
 * need to know of it) lives in the kind's own file.  A new kind is one
 * file and one line here (CONTRIBUTING.md).
 */
static const StepExecutor *const step_kinds[] = {
	&StepKindFunctional,
	&StepKindModelOp,
	&StepKindRouter,
	&StepKindAPICall,
	&StepKindMCP,
	&StepKindAgent,
	&StepKindHuman,
	&StepKindSleep,
	&StepKindWorkflow,
};

StaticAssertDecl(lengthof(step_kinds) == STEP_KIND_COUNT, "every step kind has an executor");

static void
shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	TuvlShmemRequest();
	AdmissionShmemRequest();
	MetricsShmemRequest();
	OtlpShmemRequest();
}

/*
 * Attach to (or create) the shared state.  Runs in the postmaster at every
 * start and after every crash restart.
 */
static void
shmem_startup(void)
{
	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();
	TuvlShmemStartup();
	AdmissionShmemStartup();
	MetricsShmemStartup();
	OtlpShmemStartup();
}

static void
register_launcher(void)
{
	BackgroundWorker worker;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = 1;
	strlcpy(worker.bgw_library_name, "tuvl", BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "TuvlLauncherMain", BGW_MAXLEN);
	strlcpy(worker.bgw_name, "tuvl launcher", BGW_MAXLEN);
	strlcpy(worker.bgw_type, "tuvl launcher", BGW_MAXLEN);
	RegisterBackgroundWorker(&worker);
}

void
_PG_init(void)
{
	for (int i = 0; i < (int) lengthof(step_kinds); i++)
		ExecutorRegister(step_kinds[i]);
	ExecutorReplayChildren = ReplayTakeChildren;
	ExecutorReplayControl = ReplayControl;

	if (IsBinaryUpgrade)
		return;

	GucsDefine();

	/*
	 * Called in the reverse order of registration: the runs a transaction
	 * queued enter the shared registry (queue.c) before the wake-ups and
	 * interrupts of tuvl.c are sent, and the launcher hears of a new
	 * extension last.
	 */
	RegisterXactCallback(LauncherXactCallback, NULL);
	RegisterXactCallback(TuvlXactCallback, NULL);
	RegisterXactCallback(QueueXactCallback, NULL);
	RegisterXactCallback(MetricsXactCallback, NULL);
	RegisterSubXactCallback(MetricsSubXactCallback, NULL);
	RegisterXactCallback(TraceXactCallback, NULL);
	RegisterSubXactCallback(TraceSubXactCallback, NULL);
	SecurityInit();
	ChannelInit();
	GrantHintInit();

	if (!process_shared_preload_libraries_in_progress)
		return;

	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = shmem_startup;
	register_launcher();
}
