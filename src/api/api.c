/*-------------------------------------------------------------------------
 *
 * api.c
 *	  SQL-callable functions of schema tuvl.
 *
 * Each function checks its arguments and delegates.  They run as the
 * calling role, which becomes a run's principal; writes to tuvl's own
 * tables run as the extension's owner in an owner frame (security.c),
 * which transaction abort undoes if anything fails.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/condition_variable.h"
#include "storage/latch.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "commands/dbcommands.h"
#include "utils/lsyscache.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "pgstat.h"

#include "run_create.h"
#include "artifact.h"
#include "concurrency.h"
#include "driver.h"
#include "effect.h"
#include "journal.h"
#include "journal_block.h"
#include "jsonschema.h"
#include "jsonutil.h"
#include "launcher.h"
#include "queue.h"
#include "runtime.h"
#include "security.h"
#include "spiutil.h"
#include "template.h"
#include "tuvl.h"
#include "validate.h"
#include "workflow.h"
#include "yamlparse.h"
#include "tokens.h"

PG_FUNCTION_INFO_V1(tuvl_version);
PG_FUNCTION_INFO_V1(tuvl_register_workflow);
PG_FUNCTION_INFO_V1(tuvl_validate);
PG_FUNCTION_INFO_V1(tuvl_start_run);
PG_FUNCTION_INFO_V1(tuvl_run);
PG_FUNCTION_INFO_V1(tuvl_wait);
PG_FUNCTION_INFO_V1(tuvl_render);
PG_FUNCTION_INFO_V1(tuvl_extension_created);
PG_FUNCTION_INFO_V1(tuvl_lease_holder_alive);
PG_FUNCTION_INFO_V1(tuvl_worker_status);
PG_FUNCTION_INFO_V1(tuvl_transfer);
PG_FUNCTION_INFO_V1(tuvl_journal_events);
PG_FUNCTION_INFO_V1(tuvl_journal_block);

static bool warned_no_workers = false;

Datum
tuvl_version(PG_FUNCTION_ARGS)
{
	PG_RETURN_TEXT_P(cstring_to_text(TUVL_VERSION));
}

/*
 * Keep the workflow's pg_cron job in step with its newest version: a
 * trigger.schedule creates or updates job "tuvl_<workflow>", which calls
 * tuvl.start_scheduled('<workflow>') at every slot; a version without one
 * removes it.  The job belongs to the registering role, whose runs these
 * become.  pg_cron lives in one database (cron.database_name); elsewhere,
 * or without the privilege to schedule, a notice says what to do.  SPI
 * must be connected.
 */
static void
sync_schedule(const char *name, Jsonb *def)
{
	Jsonb	   *trigger = JsonGetJsonb(def, "trigger");
	char	   *schedule = trigger && JsonIsObject(trigger) ? JsonGetString(trigger, "schedule") : NULL;
	char	   *job = psprintf("tuvl_%s", name);
	char	   *command = psprintf("SELECT tuvl.start_scheduled(%s)", quote_literal_cstr(name));
	bool		has_cron;
	SpiSubxact	sub;

	SpiExec("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p "
			"               WHERE p.pronamespace OPERATOR(pg_catalog.=) n.oid "
			"                 AND p.proname OPERATOR(pg_catalog.=) 'schedule'), "
			"  pg_catalog.has_schema_privilege(n.oid, 'USAGE') "
			"FROM pg_catalog.pg_namespace n WHERE n.nspname OPERATOR(pg_catalog.=) 'cron'",
			0, NULL, NULL, NULL, SPI_OK_SELECT);
	has_cron = SPI_processed == 1 &&
		strcmp(SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1), "t") == 0;
	/* nothing to remove for a role that could never have scheduled */
	if (has_cron && schedule == NULL &&
		strcmp(SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2), "t") != 0)
		return;
	if (!has_cron)
	{
		if (schedule)
			ereport(NOTICE,
					(errmsg("workflow \"%s\" has a schedule, but pg_cron is not installed in this database", name),
					 errhint("In the database named by cron.database_name, run: SELECT cron.schedule_in_database('%s', '%s', $$%s$$, '%s');",
							 job, schedule, command, get_database_name(MyDatabaseId))));
		return;
	}

	/* a role without the right to schedule still registers its workflow */
	SpiSubxactBegin(&sub);
	PG_TRY();
	{
		static const Oid types[3] = {TEXTOID, TEXTOID, TEXTOID};
		Datum		values[3];

		values[0] = CStringGetTextDatum(job);
		if (schedule)
		{
			values[1] = CStringGetTextDatum(schedule);
			values[2] = CStringGetTextDatum(command);
			SpiExec("SELECT cron.schedule($1::pg_catalog.text, $2::pg_catalog.text, $3::pg_catalog.text)",
					3, types, values, NULL, SPI_OK_SELECT);
			ereport(NOTICE,
					(errmsg("workflow \"%s\" is scheduled as pg_cron job \"%s\" (%s)", name, job, schedule)));
		}
		else
			SpiExec("SELECT cron.unschedule(jobid) FROM cron.job "
					"WHERE jobname OPERATOR(pg_catalog.=) $1 "
					"  AND username OPERATOR(pg_catalog.=) CURRENT_USER::pg_catalog.text",
					1, types, values, NULL, SPI_OK_SELECT);
		SpiSubxactCommit(&sub);
	}
	PG_CATCH();
	{
		ErrorData  *edata = SpiSubxactAbortFinding(&sub);

		if (edata->sqlerrcode == ERRCODE_INSUFFICIENT_PRIVILEGE)
			ereport(WARNING,
					(errmsg("could not %s the pg_cron job of workflow \"%s\": %s",
							schedule ? "schedule" : "remove", name, edata->message),
					 errhint("A superuser can GRANT USAGE ON SCHEMA cron to the role, or schedule SELECT tuvl.start_scheduled('%s') itself.",
							 name)));
		else
			ereport(WARNING,
					(errmsg("could not %s the pg_cron job of workflow \"%s\": %s",
							schedule ? "schedule" : "remove", name, edata->message),
					 edata->detail ? errdetail("%s", edata->detail) : 0,
					 edata->hint ? errhint("%s", edata->hint) : 0));
	}
	PG_END_TRY();
}

/*
 * register_workflow(source): parse, validate, store as a new version.
 */
Datum
tuvl_register_workflow(PG_FUNCTION_ARGS)
{
	char	   *source = text_to_cstring(PG_GETARG_TEXT_PP(0));
	Jsonb	   *positions = NULL;
	Jsonb	   *def = YamlToJsonb(source, "workflow", &positions);
	Jsonb	   *refs = NULL;
	List	   *findings = ValidateWorkflow(def, positions, false, &refs);
	char	   *name = JsonGetString(def, "name");
	ListCell   *lc;
	int			version;

	TokenRequireScope("workflows:write");
	if (FindingsHaveErrors(findings))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_OBJECT_DEFINITION),
				 errmsg("workflow%s%s%s is not valid", name ? " \"" : "", name ? name : "",
						name ? "\"" : ""),
				 errdetail("%s", FindingsFormat(findings, "error")),
				 FindingsSuggestion(findings) ?
				 errhint("Did you mean \"%s\"?  Fix every problem listed; tuvl.validate(source) returns them as rows.",
						 FindingsSuggestion(findings)) :
				 errhint("Fix every problem listed; tuvl.validate(source) returns them as rows.")));
	foreach(lc, findings)
	{
		Finding    *f = lfirst(lc);

		ereport(NOTICE,
				(errmsg("workflow \"%s\": %s%s%s", name, f->path, *f->path ? ": " : "",
						f->message)));
	}

	SPI_connect();
	ArtifactLockName("workflow",
					 "SELECT owner FROM tuvl.workflows "
					 "WHERE name OPERATOR(pg_catalog.=) $1 "
					 "  AND version OPERATOR(pg_catalog.=) 1", name);
	version = WorkflowLatestVersion(name, true) + 1;
	{
		static const Oid types[6] = {TEXTOID, INT4OID, TEXTOID, JSONBOID, REGROLEOID, JSONBOID};

		/* refs: the owners of what it names, pinned (uses.c) */
		SecurityExecArgs("INSERT INTO tuvl.workflows (name, version, source, definition, owner, refs) "
						 "VALUES ($1, $2, $3, $4, $5, $6)", SPI_OK_INSERT, 6, types,
						 CStringGetTextDatum(name), Int32GetDatum(version),
						 CStringGetTextDatum(source), JsonbPGetDatum(def),
						 ObjectIdGetDatum(GetUserId()), JsonbPGetDatum(refs));
	}
	sync_schedule(name, def);
	SPI_finish();
	PG_RETURN_INT32(version);
}

/*
 * Parse for validate(): a YAML error becomes a finding.  Parsing is pure
 * computation (libyaml's handles are freed by a reset callback), but a
 * subtransaction keeps this safe whatever the parser touches.
 */
static Jsonb *
parse_for_validate(const char *source, Jsonb **positions, List **findings)
{
	SpiSubxact	sub;
	Jsonb	   *volatile def = NULL;

	SpiSubxactBegin(&sub);
	PG_TRY();
	{
		def = YamlToJsonb(source, "workflow", positions);
		SpiSubxactCommit(&sub);
	}
	PG_CATCH();
	{
		ErrorData  *edata = SpiSubxactAbortFinding(&sub);
		Finding    *f = palloc(sizeof(Finding));

		f->severity = "error";
		f->suggestion = NULL;
		f->path = "";
		f->message = edata->detail ? psprintf("%s: %s", edata->message, edata->detail)
			: edata->message;
		*findings = lappend(*findings, f);
	}
	PG_END_TRY();
	return def;
}

/*
 * validate(source, strict): one row per finding.
 */
Datum
tuvl_validate(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	char	   *source = text_to_cstring(PG_GETARG_TEXT_PP(0));
	bool		strict = PG_GETARG_BOOL(1);
	List	   *findings = NIL;
	Jsonb	   *positions = NULL;
	Jsonb	   *def;
	ListCell   *lc;

	InitMaterializedSRF(fcinfo, 0);
	def = parse_for_validate(source, &positions, &findings);
	if (def)
		findings = ValidateWorkflow(def, positions, strict, NULL);
	foreach(lc, findings)
	{
		Finding    *f = lfirst(lc);
		Datum		values[3];
		bool		nulls[3] = {false, false, false};

		values[0] = CStringGetTextDatum(f->severity);
		values[1] = CStringGetTextDatum(f->path);
		values[2] = CStringGetTextDatum(f->message);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}

/*
 * start_run(workflow, input): queue a run; the workers wake at commit.
 */
/* The workflow name and input of start_run() and run(); a NULL input is {}. */
static void
run_arguments(FunctionCallInfo fcinfo, char **workflow, Jsonb **input)
{
	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("workflow name must not be null")));
	*workflow = text_to_cstring(PG_GETARG_TEXT_PP(0));
	*input = PG_ARGISNULL(1) ? JsonEmptyObject() : PG_GETARG_JSONB_P(1);
}

/* A W3C traceparent: version 00, a trace id and a parent id, not all zero. */
static bool
traceparent_ok(const char *t)
{
	if (strlen(t) != 55 || strncmp(t, "00-", 3) != 0 || t[35] != '-' || t[52] != '-')
		return false;
	for (int i = 3; i < 55; i++)
		if (i != 35 && i != 52 && !((t[i] >= '0' && t[i] <= '9') || (t[i] >= 'a' && t[i] <= 'f')))
			return false;
	return strspn(t + 3, "0") < 32 && strspn(t + 36, "0") < 16;
}

/* start_run()'s key, not_before, priority, version, traceparent and debounce. */
static void
start_options(FunctionCallInfo fcinfo, RunStart *start)
{
	if (PG_NARGS() < 7)
		return;
	if (PG_NARGS() >= 8 && !PG_ARGISNULL(7))
	{
		Interval   *iv = PG_GETARG_INTERVAL_P(7);

		if (iv->month != 0 || iv->day < 0 || iv->time < 0 ||
			(iv->day == 0 && iv->time == 0) || iv->day > 31)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("debounce must be a positive interval of at most 31 days"),
					 errhint("Pass an interval such as '5 s': the run starts once its key has been quiet that long.")));
		start->debounce = iv->time + (int64) iv->day * USECS_PER_DAY;
	}
	if (!PG_ARGISNULL(2))
	{
		start->key = text_to_cstring(PG_GETARG_TEXT_PP(2));
		if (start->key[0] == '\0')
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("key must not be empty"),
					 errhint("Pass NULL to start a run without a key.")));
	}
	if (!PG_ARGISNULL(3))
	{
		start->not_before = PG_GETARG_TIMESTAMPTZ(3);
		if (TIMESTAMP_NOT_FINITE(start->not_before))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("not_before must be a finite time"),
					 errhint("Pass NULL to start the run at once.")));
	}
	start->priority = PG_ARGISNULL(4) ? 0 : PG_GETARG_INT32(4);
	if (!PG_ARGISNULL(5))
	{
		start->version = PG_GETARG_INT32(5);
		if (start->version < 1)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("version must be 1 or more, not %d", start->version)));
	}
	if (!PG_ARGISNULL(6))
	{
		start->traceparent = text_to_cstring(PG_GETARG_TEXT_PP(6));
		if (!traceparent_ok(start->traceparent))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("traceparent \"%s\" is not a W3C trace context", start->traceparent),
					 errdetail("It must be 00-<32 hex digits>-<16 hex digits>-<2 hex digits>, lowercase, the ids not all zero."),
					 errhint("Pass the traceparent header of the request that starts the run, as it came.")));
	}
}

Datum
tuvl_start_run(PG_FUNCTION_ARGS)
{
	RunStart	start;
	char	   *workflow;
	Jsonb	   *input;
	int64		id;

	TokenRequireScope("runs:start");
	run_arguments(fcinfo, &workflow, &input);
	memset(&start, 0, sizeof(start));
	start.workflow = workflow;
	start.input = input;
	start_options(fcinfo, &start);

	SPI_connect();
	id = RunCreate(&start, false, NULL);
	SPI_finish();

	if (TuvlPreloaded())
		TuvlWakeWorkersAtCommit();
	else if (!warned_no_workers)
	{
		warned_no_workers = true;
		ereport(WARNING,
				(errmsg("tuvl background workers are not running"),
				 errdetail("Run " INT64_FORMAT " is queued but nothing will execute it.", id),
				 errhint("Add tuvl to shared_preload_libraries and restart the server, or use tuvl.run().")));
	}
	PG_RETURN_INT64(id);
}

static const char handover_sql[] =
"UPDATE tuvl.runs SET status = 'queued', lease_owner = NULL, lease_epoch = NULL, "
"  lease_expires_at = NULL "
"WHERE id OPERATOR(pg_catalog.=) $1 AND attempt OPERATOR(pg_catalog.=) $2";

/* An interval in milliseconds, months as 30 days, clamped to [0, INT_MAX]. */
static int
interval_ms(Interval *iv)
{
	int64		us = iv->time + (int64) iv->day * USECS_PER_DAY +
	(int64) iv->month * 30 * USECS_PER_DAY;

	return (int) Min(Max(us / 1000, 0), INT_MAX);
}

/* tuvl.run()'s effects are performed right here, synchronously. */
static void
perform_here(RunState *run, void *arg)
{
	RunKeepJsonb(run, &run->fresh_effect, EffectPerform(run->send));
}

typedef struct SyncRun
{
	TimestampTz deadline;		/* past it, the workers take over */
	bool		handed_over;
} SyncRun;

/* Past the sync_timeout, hand the run to the workers (they see it at commit). */
static bool
before_sync_timeout(RunState *run, void *arg)
{
	SyncRun    *sync = arg;
	static const Oid types[2] = {INT8OID, INT4OID};
	Datum		values[2];
	SecurityFrame frame;

	if (GetCurrentTimestamp() < sync->deadline)
		return true;
	values[0] = Int64GetDatum(run->id);
	values[1] = Int32GetDatum(run->attempt);
	SecurityAsOwner(&frame);
	SpiExec(handover_sql, 2, types, values, NULL, SPI_OK_UPDATE);
	SecurityRestore(&frame);
	QueueNoteAtCommit(GetUserId(), 0, run->id);
	TuvlWakeWorkersAtCommit();
	if (!TuvlPreloaded())
		ereport(WARNING,
				(errmsg("run " INT64_FORMAT " passed its sync_timeout and was queued, but tuvl background workers are not running",
						run->id),
				 errhint("Add tuvl to shared_preload_libraries and restart the server.")));
	sync->handed_over = true;
	return false;
}

/*
 * run(workflow, input, sync_timeout): execute in this backend, one
 * transition at a time, inside the caller's transaction; past the
 * timeout hand the run to the workers (they see it once this commits).
 */
Datum
tuvl_run(PG_FUNCTION_ARGS)
{
	char	   *workflow;
	Jsonb	   *input;
	int			version;
	int64		id;
	RunState   *run;
	WorkflowDef *wf;
	int			timeout_ms;
	RunStatus	status;
	int			transitions = 0;
	SyncRun		sync;
	RunPerformer performer = {perform_here, NULL, before_sync_timeout, &sync};
	RunEnd		end;
	JsonObjBuilder b;
	RunStart	start;

	TokenRequireScope("runs:start");
	run_arguments(fcinfo, &workflow, &input);
	TuvlRefuseWhileReplaying("tuvl.run()");

	SPI_connect();
	memset(&start, 0, sizeof(start));
	start.workflow = workflow;
	start.input = input;
	id = RunCreate(&start, true, &version);
	wf = WorkflowLoad(workflow, version);
	if (!PG_ARGISNULL(2))
		timeout_ms = interval_ms(PG_GETARG_INTERVAL_P(2));
	else if (wf->sync_timeout_ms >= 0)
		timeout_ms = wf->sync_timeout_ms;
	else
		timeout_ms = tuvl_sync_timeout;
	sync.deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), timeout_ms);
	sync.handed_over = false;

	run = RunStateCreate(CurrentMemoryContext, id, 1, workflow, version, GetUserId(),
						 GetUserNameFromId(GetUserId(), false), input, NULL, 1, NULL);
	status = DriveRun(run, &performer, &transitions);
	if (sync.handed_over)
		status = RUN_QUEUED;
	DriveReadEnd(id, RunStatusIsTerminal(status), &end);

	JsonObjStart(&b);
	JsonObjAddInt(&b, "run_id", id);
	JsonObjAddString(&b, "status", StatusName(status));
	JsonObjAddString(&b, "end", end.end_name);
	JsonObjAddJsonb(&b, "response", end.response);
	if (end.error)
		JsonObjAddString(&b, "error", end.error);
	RunStateFree(run);
	PG_RETURN_JSONB_P(SpiReturnJsonb(JsonObjEnd(&b)));
}

/* Has the run ended, or does it wait for someone? */
static bool
status_is_settled(const char *status)
{
	RunStatus	s = StatusFromName(status);

	return RunStatusIsTerminal(s) || RunStatusIsParked(s);
}

/* The run's status as the caller may see it; errors when invisible. */
static char *
fetch_status(int64 id)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1];
	char	   *status;

	values[0] = Int64GetDatum(id);
	SPI_connect();
	/* as the caller: row security decides what it may see */
	SpiExec("SELECT status FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1",
			1, types, values, NULL, SPI_OK_SELECT);
	if (SPI_processed != 1)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("run " INT64_FORMAT " does not exist", id),
				 errhint("Runs are visible to the role that started them and to members of tuvl_operator.")));
	status = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
	status = MemoryContextStrdup(TopTransactionContext, status);
	SPI_finish();
	return status;
}

/*
 * wait(run_id, timeout): sleep until the run is terminal or waiting for
 * someone, or the timeout passes; returns its status.  Workers broadcast
 * a condition variable whenever a run settles, so no polling happens
 * while the library is preloaded.
 */
Datum
tuvl_wait(PG_FUNCTION_ARGS)
{
	int64		id = PG_GETARG_INT64(0);
	TimestampTz deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
													   interval_ms(PG_GETARG_INTERVAL_P(1)));
	char	   *status;

	TokenRequireScope("runs:read");
	if (IsolationUsesXactSnapshot())
		ereport(ERROR,
				(errcode(ERRCODE_ACTIVE_SQL_TRANSACTION),
				 errmsg("tuvl.wait() cannot be used in a REPEATABLE READ or SERIALIZABLE transaction"),
				 errdetail("The transaction's snapshot would never show the run's progress."),
				 errhint("Call it in a READ COMMITTED transaction.")));

	if (TuvlShmem)
		ConditionVariablePrepareToSleep(&TuvlShmem->run_cv);
	for (;;)
	{
		long		remaining_ms;

		status = fetch_status(id);
		if (status_is_settled(status))
			break;
		if (RunCreateInThisTransaction(id))
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("run " INT64_FORMAT " was started in this transaction", id),
					 errdetail("The workers cannot see the run until this transaction commits."),
					 errhint("Commit after tuvl.start_run(), then call tuvl.wait().")));
		remaining_ms = (long) ((deadline - GetCurrentTimestamp()) / 1000);
		if (remaining_ms <= 0)
			break;
		if (TuvlShmem)
			(void) ConditionVariableTimedSleep(&TuvlShmem->run_cv, Min(remaining_ms, 1000),
											   PG_WAIT_EXTENSION);
		else
		{
			(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
							 Min(remaining_ms, 50), PG_WAIT_EXTENSION);
			ResetLatch(MyLatch);
			CHECK_FOR_INTERRUPTS();
		}
	}
	if (TuvlShmem)
		ConditionVariableCancelSleep();
	PG_RETURN_TEXT_P(cstring_to_text(status));
}

/*
 * render(template, context): what a step would see.
 */
Datum
tuvl_render(PG_FUNCTION_ARGS)
{
	Jsonb	   *tmpl = PG_GETARG_JSONB_P(0);
	Jsonb	   *ctx = PG_GETARG_JSONB_P(1);

	PG_RETURN_JSONB_P(TemplateRenderJsonb(tmpl, ctx, NULL));
}

/*
 * Called by the install script: the launcher starts workers here once
 * CREATE EXTENSION commits.
 */
Datum
tuvl_extension_created(PG_FUNCTION_ARGS)
{
	if (!TuvlPreloaded())
	{
		ereport(WARNING,
				(errmsg("tuvl is not loaded via shared_preload_libraries"),
				 errdetail("tuvl.run() and the other functions work, but no background worker will execute queued runs."),
				 errhint("Add tuvl to shared_preload_libraries in postgresql.conf and restart the server.")));
		PG_RETURN_VOID();
	}
	LauncherNoteExtensionCreatedAtCommit();
	PG_RETURN_VOID();
}

/*
 * _lease_holder_alive(pid, epoch): used by the workers' reclaim query.
 */
Datum
tuvl_lease_holder_alive(PG_FUNCTION_ARGS)
{
	if (PG_ARGISNULL(0) || PG_ARGISNULL(1))
		PG_RETURN_BOOL(false);
	PG_RETURN_BOOL(TuvlLeaseHolderAlive(PG_GETARG_INT32(0), PG_GETARG_INT64(1)));
}

/*
 * worker_status(): what every tuvl worker is doing, from shared memory.
 */
Datum
tuvl_worker_status(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	TokenRequireScope("runs:read");
	InitMaterializedSRF(fcinfo, 0);
	if (TuvlShmem == NULL)
		return (Datum) 0;
	LWLockAcquire(TuvlShmem->lock, LW_SHARED);
	for (int i = 0; i < TuvlShmem->nslots; i++)
	{
		TuvlWorkerSlot *s = &TuvlShmem->slots[i];
		Datum		values[7];
		bool		nulls[7] = {false, false, false, false, false, false, false};

		if (!s->in_use || s->pid == 0)
			continue;
		values[0] = Int32GetDatum(s->pid);
		values[1] = ObjectIdGetDatum(s->dboid);
		values[2] = Int32GetDatum(s->number);
		values[3] = Int32GetDatum(s->nheld);
		values[4] = Int32GetDatum(s->in_flight);
		values[5] = Int32GetDatum(s->peak_in_flight);
		values[6] = TimestampTzGetDatum(s->alive_at);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	LWLockRelease(TuvlShmem->lock);
	return (Datum) 0;
}

/*
 * transfer(kind, name, new_owner): hand a name to another role.
 */
Datum
tuvl_transfer(PG_FUNCTION_ARGS)
{
	TokenRequireScope("workflows:write");

	if (PG_ARGISNULL(0) || PG_ARGISNULL(1) || PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("kind, name and new_owner must not be null")));
	SPI_connect();
	SecurityTransferName(text_to_cstring(PG_GETARG_TEXT_PP(0)),
						 text_to_cstring(PG_GETARG_TEXT_PP(1)), PG_GETARG_OID(2));
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * _journal_events(seq, events): the events of a block of tuvl.journal,
 * one row each (seq, ts, type, agent_id, engine, tokens, latency_ms,
 * payload): the view tuvl.events.  Any bytea is safe to pass (see
 * journal_block.c); one that is not a block raises data_corrupted.
 */
Datum
tuvl_journal_events(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	int32		seq = PG_GETARG_INT32(0);
	List	   *events;
	ListCell   *lc;

	InitMaterializedSRF(fcinfo, 0);
	events = JournalBlockUnpack(PG_GETARG_BYTEA_PP(1));
	foreach(lc, events)
	{
		JournalEvent *ev = lfirst(lc);
		Datum		values[8];
		bool		nulls[8] = {false, false, false, false, false, false, false, false};

		values[0] = Int32GetDatum(seq++);
		values[1] = TimestampTzGetDatum(ev->ts);
		values[2] = CStringGetTextDatum(ev->type);
		nulls[3] = ev->agent_id == NULL;
		values[3] = ev->agent_id ? CStringGetTextDatum(ev->agent_id) : (Datum) 0;
		nulls[4] = ev->engine == NULL;
		values[4] = ev->engine ? CStringGetTextDatum(ev->engine) : (Datum) 0;
		nulls[5] = ev->tokens < 0;
		values[5] = Int32GetDatum(ev->tokens);
		nulls[6] = ev->latency_ms < 0;
		values[6] = Float8GetDatum(ev->latency_ms);
		values[7] = JsonbPGetDatum(ev->payload);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}

/* Element i of a one-dimensional array's deconstructed values, or NULL. */
static Datum *
array_values(ArrayType *a, Oid type, bool **nulls, int *n)
{
	Datum	   *values;
	int16		len;
	bool		byval;
	char		align;

	get_typlenbyvalalign(type, &len, &byval, &align);
	deconstruct_array(a, type, len, byval, align, &values, nulls, n);
	return values;
}

/*
 * _journal_block(ts[], type[], agent_id[], engine[], tokens[],
 * latency_ms[], payload[]): events given as parallel arrays (of one
 * length; NULL elements where a field is NULL), packed as one block of
 * tuvl.journal.  The update from 0.1.0 moves the journal with it.
 */
Datum
tuvl_journal_block(PG_FUNCTION_ARGS)
{
	static const Oid types[7] = {TIMESTAMPTZOID, TEXTOID, TEXTOID, TEXTOID, INT4OID,
	FLOAT8OID, JSONBOID};
	Datum	   *cols[7];
	bool	   *nulls[7];
	int			n[7];
	List	   *events = NIL;

	for (int c = 0; c < 7; c++)
	{
		if (PG_ARGISNULL(c))
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("the arrays of a journal block must not be null")));
		cols[c] = array_values(PG_GETARG_ARRAYTYPE_P(c), types[c], &nulls[c], &n[c]);
		if (n[c] != n[0])
			ereport(ERROR,
					(errcode(ERRCODE_ARRAY_SUBSCRIPT_ERROR),
					 errmsg("the arrays of a journal block must have one length")));
	}
	for (int i = 0; i < n[0]; i++)
	{
		JournalEvent *ev = palloc0(sizeof(JournalEvent));

		if (nulls[0][i] || nulls[1][i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("an event of a journal block has no time or no type")));
		ev->ts = DatumGetTimestampTz(cols[0][i]);
		ev->type = TextDatumGetCString(cols[1][i]);
		ev->agent_id = nulls[2][i] ? NULL : TextDatumGetCString(cols[2][i]);
		ev->engine = nulls[3][i] ? NULL : TextDatumGetCString(cols[3][i]);
		ev->tokens = nulls[4][i] ? -1 : DatumGetInt32(cols[4][i]);
		ev->latency_ms = nulls[5][i] ? -1 : DatumGetFloat8(cols[5][i]);
		ev->payload = nulls[6][i] ? NULL : DatumGetJsonbP(cols[6][i]);
		events = lappend(events, ev);
	}
	PG_RETURN_BYTEA_P(JournalBlockPack(events));
}
