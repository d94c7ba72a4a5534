/*-------------------------------------------------------------------------
 *
 * run_create.c
 *	  Creating a run: the one service behind tuvl.start_run(), tuvl.run(),
 *	  tuvl.replay() and a Workflow step's children.
 *
 * RunCreate validates the input, pins the artifact versions, inserts the
 * row and journals run_queued in the caller's transaction, as the
 * extension's owner; nothing is visible before that transaction commits,
 * and the workers hear of a queued run only then (QueueNoteAtCommit).
 * The caller is connected to SPI.  The principal is the current user:
 * call it outside any owner frame.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "artifact.h"
#include "concurrency.h"
#include "journal.h"
#include "jsonschema.h"
#include "jsonutil.h"
#include "queue.h"
#include "ratelimit.h"
#include "run_create.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"
#include "workflow.h"

/* Runs created by the current transaction: waiting for them would hang. */
static List *runs_created_here = NIL;
static TransactionId runs_created_xid = InvalidTransactionId;

/* Remember that the current transaction created run id (RunCreateInThisTransaction). */
static void
remember_created_run(int64 id)
{
	MemoryContext old;

	if (runs_created_xid != GetTopTransactionId())
	{
		list_free(runs_created_here);
		runs_created_here = NIL;
		runs_created_xid = GetTopTransactionId();
	}
	old = MemoryContextSwitchTo(TopMemoryContext);
	runs_created_here = lappend(runs_created_here, palloc(sizeof(int64)));
	*(int64 *) llast(runs_created_here) = id;
	MemoryContextSwitchTo(old);
}

/*
 * Was run id created by the current transaction?  Waiting for it there
 * would never end: no worker sees it before the commit.
 */
bool
RunCreateInThisTransaction(int64 id)
{
	ListCell   *lc;

	if (!TransactionIdIsValid(runs_created_xid) ||
		runs_created_xid != GetTopTransactionIdIfAny())
		return false;
	foreach(lc, runs_created_here)
	{
		if (*(int64 *) lfirst(lc) == id)
			return true;
	}
	return false;
}

/*
 * The id of principal's run of workflow started with key.  The principal
 * is passed, not read here: this runs in an owner frame, where
 * GetUserId() is the extension's owner (which made keys work for
 * superusers only).
 */
static int64
keyed_run(const char *workflow, const char *key, Oid principal)
{
	static const Oid types[3] = {OIDOID, TEXTOID, TEXTOID};
	Datum		d;

	if (SecurityExecArgs("SELECT id FROM tuvl.runs WHERE principal_id::pg_catalog.oid OPERATOR(pg_catalog.=) $1 "
						 "AND workflow OPERATOR(pg_catalog.=) $2 AND key OPERATOR(pg_catalog.=) $3",
						 SPI_OK_SELECT, 3, types, ObjectIdGetDatum(principal),
						 CStringGetTextDatum(workflow), CStringGetTextDatum(key)) != 1 ||
		!SpiValue(1, &d))
		elog(ERROR, "the run of workflow \"%s\" with key \"%s\" vanished", workflow, key);
	return DatumGetInt64(d);
}

/*
 * The run_queued event of run id: what start set, the version, the
 * principal (its name; principal_id is the role, whose channel is
 * notified), the artifact pins, not_before (0: none), the concurrency key
 * and why it is held (or NULLs).
 */
static void
journal_queued(int64 id, const RunStart *start, int version, const char *principal,
			   Oid principal_id, Jsonb *pins, TimestampTz not_before, const char *conc_key,
			   const char *held_by, Jsonb *waiting)
{
	JsonObjBuilder b;
	List	   *events = NIL;

	JsonObjStart(&b);
	JsonObjAddString(&b, "workflow", start->workflow);
	JsonObjAddInt(&b, "version", version);
	JsonObjAddString(&b, "principal", principal);
	JsonObjAddJsonb(&b, "input", start->input);
	if (JsonContainerSize(&pins->root) > 0)
		JsonObjAddJsonb(&b, "artifacts", pins);
	if (start->key)
		JsonObjAddString(&b, "key", start->key);
	if (start->priority != 0)
		JsonObjAddInt(&b, "priority", start->priority);
	if (start->traceparent)
		JsonObjAddString(&b, "traceparent", start->traceparent);
	if (not_before)
		JsonObjAddString(&b, "not_before", timestamptz_to_str(not_before));
	if (start->parent_id)
	{
		JsonObjAddInt(&b, "parent_run_id", start->parent_id);
		JsonObjAddString(&b, "parent_step", start->parent_step);
	}
	if (conc_key)
		JsonObjAddString(&b, "concurrency_key", conc_key);
	if (held_by)
		JsonObjAddString(&b, "held_by", held_by);
	if (waiting)
		JsonObjAddJsonb(&b, "waiting", waiting);
	JournalAdd(&events, "run_queued", NULL, NULL, JsonObjEnd(&b));
	(void) JournalWrite(id, principal_id, 0, events);
}

/*
 * A new run's row.  Only a start with a key goes through ON CONFLICT: a
 * speculative insertion costs two more WAL records.
 */
#define INSERT_RUN_SQL \
	"INSERT INTO tuvl.runs (workflow, workflow_version, status, input, context, " \
	"  principal, attempt, lease_owner, lease_epoch, lease_expires_at, started_at, last_seq, " \
	"  artifacts, principal_id, key, priority, traceparent, wake_at, parent_run_id, parent_step, " \
	"  held_by, concurrency_key, concurrency_limit, root_run_id, waiting) " \
	"VALUES ($1, $2, $3, $4, $4, $5, $6, $7, $8, pg_catalog.now() OPERATOR(pg_catalog.+) $9, " \
	"  CASE WHEN $6 OPERATOR(pg_catalog.>) 0 THEN pg_catalog.now() END, 1, $10, $11, $12, $13, $14, $15, " \
	"  $16, $17, $18, $19, $20, $21, $22) "

/* tuvl.run() of a concurrency key cannot wait in the queue: is there room? */
static void
check_room(const char *workflow, const ConcurrencyKey *conc)
{
	if (!ConcurrencyHasRoom(workflow, conc, GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("workflow \"%s\" already has %d runs in flight with concurrency key \"%s\"",
						workflow, conc->limit, conc->key),
				 errdetail("Its concurrency.limit is %d.", conc->limit),
				 errhint("Start it with tuvl.start_run(): it waits queued until one of them ends.")));
}

/*
 * When a run may start, and what it waits for until then (*waiting, NULL
 * when nothing but not_before): not_before, the end of its debounce, and
 * the time its workflow's rate_limit reserves for it (at or after both).
 * running: tuvl.run(), which cannot wait.
 */
static TimestampTz
start_time(const RunStart *start, WorkflowDef *wf, bool running, Jsonb **waiting,
		   char **bucket, TimestampTz *reserved_out)
{
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz wake = start->not_before;
	TimestampTz reserved = 0;
	bool		held = false;
	RateLimit	rl;
	JsonObjBuilder b;

	*waiting = NULL;
	*bucket = NULL;
	*reserved_out = 0;
	if (start->debounce > 0)
		wake = Max(wake, now + start->debounce);
	RateLimitOf(wf->definition, start->input, &rl);
	if (rl.key)
	{
		TimestampTz base = Max(now, wake);

		*bucket = RateLimitBucket("run", start->workflow, GetUserId(), &rl);
		reserved = RateLimitReserve(*bucket, &rl, base);
		*reserved_out = reserved;
		if (running && reserved > now)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("workflow \"%s\" is over its rate limit for key \"%s\"",
							start->workflow, rl.key),
					 errdetail("Its rate_limit allows %d runs per %d ms; the next may start at %s.",
							   rl.limit, rl.per_ms, timestamptz_to_str(reserved)),
					 errhint("Start it with tuvl.start_run(): it waits until the limit allows it.")));
		held = reserved > base;
		if (held)
			wake = reserved;
	}
	if (running || wake <= GetCurrentTransactionStartTimestamp() || (start->debounce == 0 && !held))
		return wake;

	/* a debounced run, or one its rate limit holds back */
	JsonObjStart(&b);
	JsonObjAddString(&b, "for", held ? "rate_limit" : "debounce");
	JsonObjAddString(&b, "until", timestamptz_to_str(wake));
	if (start->debounce > 0)
		JsonObjAddString(&b, "debounce", start->debounce % USECS_PER_SEC == 0
						 ? psprintf("%d s", (int) (start->debounce / USECS_PER_SEC))
						 : psprintf("%d ms", (int) (start->debounce / 1000)));
	if (rl.key)
	{
		JsonObjBuilder r;

		JsonObjStart(&r);
		JsonObjAddString(&r, "key", rl.key);
		JsonObjAddInt(&r, "limit", rl.limit);
		JsonObjAddInt(&r, "per_ms", rl.per_ms);
		JsonObjAddString(&r, "per", RateLimitPerText(rl.per_ms));
		JsonObjAddInt(&r, "at_us", reserved);
		JsonObjAddJsonb(&b, "rate_limit", JsonObjEnd(&r));
	}
	*waiting = JsonObjEnd(&b);
	return wake;
}

/* Give back the rate limit time a debounced run had reserved (waiting). */
static void
release_reservation(const char *workflow, Oid principal, Jsonb *waiting)
{
	Jsonb	   *r = waiting ? JsonGetJsonb(waiting, "rate_limit") : NULL;
	RateLimit	rl;

	if (r == NULL)
		return;
	rl.key = JsonGetString(r, "key");
	rl.limit = JsonGetInt32(r, "limit", 1);
	rl.per_ms = JsonGetInt32(r, "per_ms", 1000);
	RateLimitRelease(RateLimitBucket("run", workflow, principal, &rl),
					 (TimestampTz) JsonGetInt(r, "at_us", 0));
}

/*
 * A debounced start of a key whose run exists: the run has not started
 * yet, so it takes this start's input (and version, priority...) and
 * waits until the key is quiet again (the latest start wins); or it has,
 * and this start finds it as any start with its key does.  Returns its
 * id, or 0 when the key has no run yet.  The caller holds the key's lock.
 */
static int64
debounce_existing(const RunStart *start, WorkflowDef *wf, int version, Jsonb *pins,
				  const ConcurrencyKey *conc)
{
	static const Oid types[3] = {OIDOID, TEXTOID, TEXTOID};
	static const Oid utypes[11] = {INT8OID, JSONBOID, INT4OID, JSONBOID, INT4OID, TEXTOID,
	TIMESTAMPTZOID, TEXTOID, TEXTOID, INT4OID, JSONBOID};
	Datum		values[11];
	char		nulls[11];
	Oid			principal = GetUserId();
	SecurityFrame frame;
	int64		id;
	Jsonb	   *old_waiting;
	Jsonb	   *waiting;
	TimestampTz wake;
	char	   *bucket;
	TimestampTz reserved;
	bool		isnull;
	int			last_seq;
	JsonObjBuilder b;
	List	   *events = NIL;

	SecurityAsOwner(&frame);
	if (SecurityExecArgs("SELECT id, status OPERATOR(pg_catalog.=) 'sleeping' AND current_step IS NULL "
						 "  AND waiting OPERATOR(pg_catalog.?) 'debounce', waiting "
						 "FROM tuvl.runs WHERE principal_id::pg_catalog.oid OPERATOR(pg_catalog.=) $1 "
						 "AND workflow OPERATOR(pg_catalog.=) $2 AND key OPERATOR(pg_catalog.=) $3",
						 SPI_OK_SELECT, 3, types, ObjectIdGetDatum(principal),
						 CStringGetTextDatum(start->workflow), CStringGetTextDatum(start->key)) != 1)
	{
		SecurityRestore(&frame);
		return 0;
	}
	id = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	if (!DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull)))
	{
		SecurityRestore(&frame);
		return id;
	}
	old_waiting = DatumGetJsonbPCopy(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 3, &isnull));
	SecurityRestore(&frame);

	release_reservation(start->workflow, principal, old_waiting);
	wake = start_time(start, wf, false, &waiting, &bucket, &reserved);

	memset(nulls, ' ', sizeof(nulls));
	values[0] = Int64GetDatum(id);
	values[1] = JsonbPGetDatum(start->input);
	values[2] = Int32GetDatum(version);
	values[3] = JsonbPGetDatum(pins);
	nulls[3] = JsonContainerSize(&pins->root) > 0 ? ' ' : 'n';
	values[4] = Int32GetDatum(start->priority);
	values[5] = start->traceparent ? CStringGetTextDatum(start->traceparent) : (Datum) 0;
	nulls[5] = start->traceparent ? ' ' : 'n';
	values[6] = TimestampTzGetDatum(wake);
	values[7] = conc->key ? CStringGetTextDatum("concurrency") : (Datum) 0;
	nulls[7] = conc->key ? ' ' : 'n';
	values[8] = conc->key ? CStringGetTextDatum(conc->key) : (Datum) 0;
	nulls[8] = conc->key ? ' ' : 'n';
	values[9] = Int32GetDatum(conc->limit);
	nulls[9] = conc->key ? ' ' : 'n';
	values[10] = JsonbPGetDatum(waiting);
	nulls[10] = waiting ? ' ' : 'n';
	SecurityAsOwner(&frame);
	/* the maintenance may have woken it meanwhile: then it has started */
	if (SpiExec("UPDATE tuvl.runs SET input = $2, context = $2, workflow_version = $3, artifacts = $4, "
				"  priority = $5, traceparent = $6, wake_at = $7, held_by = $8, concurrency_key = $9, "
				"  concurrency_limit = $10, waiting = $11, last_seq = last_seq OPERATOR(pg_catalog.+) 1 "
				"WHERE id OPERATOR(pg_catalog.=) $1 AND status OPERATOR(pg_catalog.=) 'sleeping' "
				"  AND current_step IS NULL "
				"RETURNING last_seq OPERATOR(pg_catalog.-) 1",
				11, utypes, values, nulls, SPI_OK_UPDATE_RETURNING) != 1)
	{
		SecurityRestore(&frame);
		if (bucket)
			RateLimitRelease(bucket, reserved);
		return id;
	}
	last_seq = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));

	/* journaled as queued again, with the input it now has */
	JsonObjStart(&b);
	JsonObjAddString(&b, "workflow", start->workflow);
	JsonObjAddInt(&b, "version", version);
	JsonObjAddString(&b, "principal", GetUserNameFromId(principal, false));
	JsonObjAddJsonb(&b, "input", start->input);
	JsonObjAddString(&b, "key", start->key);
	JsonObjAddBool(&b, "debounced", true);
	JsonObjAddString(&b, "not_before", timestamptz_to_str(wake));
	if (waiting)
		JsonObjAddJsonb(&b, "waiting", waiting);
	JournalAdd(&events, "run_queued", NULL, NULL, JsonObjEnd(&b));
	(void) JournalWrite(id, principal, last_seq, events);
	SecurityRestore(&frame);
	TuvlRunChangedAtCommit();
	return id;
}

/*
 * A debounced start: the key's run if it has one (joined, when it has not
 * started), or 0.  One start of a role's key at a time decides.
 */
static int64
debounce_start(const RunStart *start, WorkflowDef *wf, int version, Jsonb *pins,
			   const ConcurrencyKey *conc)
{
	char	   *k = psprintf("%s/%u/%s", start->workflow, GetUserId(), start->key ? start->key : "");

	if (start->key == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("debounce needs a key"),
				 errdetail("Starts are coalesced per key: those with one key become one run."),
				 errhint("Pass key => '...' with debounce, such as the id of what changed.")));
	if (MyTuvlSlot == NULL)
		SecurityLockKey("debounce", k);
	else if (!SecurityTryLockKey("debounce", k))
		ereport(ERROR,
				(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
				 errmsg("key \"%s\" of workflow \"%s\" is being started by another session",
						start->key, start->workflow)));
	return debounce_existing(start, wf, version, pins, conc);
}

/* A run's input: an object within tuvl.max_input_size, valid for wf. */
static void
check_run_input(WorkflowDef *wf, Jsonb *input)
{
	if (!JsonIsObject(input))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("run input must be a JSON object"),
				 errhint("Pass input as '{\"key\": ...}'::jsonb.")));
	GucsCheckSize("the run input", VARSIZE(input), tuvl_max_input_size, "tuvl.max_input_size");
	if (wf->input_schema)
		JsonSchemaValidateOrError(wf->input_schema, input, "run input");
}

/*
 * Validate input and insert a run of the latest version of workflow with
 * its run_queued event.  running = true creates it already leased by
 * this backend (the synchronous path).  SPI must be connected.
 */
int64
RunCreate(const RunStart *start, bool running, int *version_out)
{
	static const Oid types[22] = {TEXTOID, INT4OID, TEXTOID, JSONBOID, TEXTOID,
		INT4OID, INT4OID, INT8OID, INTERVALOID, JSONBOID, REGROLEOID, TEXTOID, INT4OID,
	TEXTOID, TIMESTAMPTZOID, INT8OID, TEXTOID, TEXTOID, TEXTOID, INT4OID, INT8OID, JSONBOID};
	const char *workflow = start->workflow;
	Jsonb	   *input = start->input;
	int			version = start->version > 0 ? start->version : WorkflowLatestVersion(workflow, false);
	WorkflowDef *wf = WorkflowLoad(workflow, version);
	char	   *principal = GetUserNameFromId(GetUserId(), false);
	Datum		values[22];
	char		nulls[22];
	ConcurrencyKey conc;
	const char *held_by;
	TimestampTz wake,
				reserved;
	Jsonb	   *waiting;
	char	   *bucket;
	bool		sleeping;
	Jsonb	   *pins = ArtifactPinFloating(wf->definition);
	Interval   *lease = palloc0(sizeof(Interval));
	SecurityFrame frame;
	bool		isnull;
	int64		id;

	if (version_out)
		*version_out = version;
	check_run_input(wf, input);

	/* beyond its concurrency limit or its step's max_parallel: queued */
	ConcurrencyKeyOf(wf, input, &conc);
	held_by = start->held ? "max_parallel" : conc.key ? "concurrency" : NULL;
	if (running && conc.key)
		check_room(workflow, &conc);
	if (running)
		held_by = NULL;

	/* a debounced start of a key whose run has not started joins it */
	if (start->debounce > 0 && (id = debounce_start(start, wf, version, pins, &conc)) != 0)
		return id;

	/* a run not to be claimed yet sleeps until then, out of the queue */
	wake = start_time(start, wf, running, &waiting, &bucket, &reserved);
	sleeping = !running && wake > GetCurrentTransactionStartTimestamp();

	memset(nulls, ' ', sizeof(nulls));
	lease->time = (int64) tuvl_lease_timeout * 1000;
	values[0] = CStringGetTextDatum(workflow);
	values[1] = Int32GetDatum(version);
	values[2] = CStringGetTextDatum(running ? "running" : sleeping ? "sleeping" : "queued");
	values[3] = JsonbPGetDatum(input);
	values[4] = CStringGetTextDatum(principal);
	values[5] = Int32GetDatum(running ? 1 : 0);
	values[6] = Int32GetDatum(MyProcPid);
	values[7] = Int64GetDatum(TuvlShmem ? TuvlShmem->epoch : 0);
	values[8] = IntervalPGetDatum(lease);
	if (!running)
		nulls[6] = nulls[7] = nulls[8] = 'n';

	if (JsonContainerSize(&pins->root) > 0)
		values[9] = JsonbPGetDatum(pins);
	else
		nulls[9] = 'n';
	values[10] = ObjectIdGetDatum(GetUserId());
	values[11] = start->key ? CStringGetTextDatum(start->key) : (Datum) 0;
	nulls[11] = start->key ? ' ' : 'n';
	values[12] = Int32GetDatum(start->priority);
	values[13] = start->traceparent ? CStringGetTextDatum(start->traceparent) : (Datum) 0;
	nulls[13] = start->traceparent ? ' ' : 'n';
	values[14] = TimestampTzGetDatum(wake);
	nulls[14] = sleeping ? ' ' : 'n';
	values[15] = Int64GetDatum(start->parent_id);
	nulls[15] = start->parent_id ? ' ' : 'n';
	values[16] = start->parent_step ? CStringGetTextDatum(start->parent_step) : (Datum) 0;
	nulls[16] = start->parent_step ? ' ' : 'n';
	values[17] = held_by ? CStringGetTextDatum(held_by) : (Datum) 0;
	nulls[17] = held_by ? ' ' : 'n';
	values[18] = conc.key ? CStringGetTextDatum(conc.key) : (Datum) 0;
	nulls[18] = conc.key ? ' ' : 'n';
	values[19] = Int32GetDatum(conc.limit);
	nulls[19] = conc.key ? ' ' : 'n';
	values[20] = Int64GetDatum(start->root_id);
	nulls[20] = start->root_id ? ' ' : 'n';
	values[21] = waiting ? JsonbPGetDatum(waiting) : (Datum) 0;
	nulls[21] = waiting && sleeping ? ' ' : 'n';
	SecurityAsOwner(&frame);
	/* a key this role's other start holds: that run (the index decides) */
	if (SpiExec(start->key ? INSERT_RUN_SQL "ON CONFLICT (principal_id, workflow, key) WHERE key IS NOT NULL DO NOTHING RETURNING id"
				: INSERT_RUN_SQL "RETURNING id",
				22, types, values, nulls, SPI_OK_INSERT_RETURNING) == 0)
	{
		id = keyed_run(workflow, start->key, DatumGetObjectId(values[10]));
		SecurityRestore(&frame);
		/* that run took its place: this start's is free again */
		if (bucket)
			RateLimitRelease(bucket, reserved);
		return id;
	}
	id = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));

	journal_queued(id, start, version, principal, DatumGetObjectId(values[10]), pins,
				   sleeping ? wake : 0, conc.key, running ? NULL : held_by,
				   sleeping ? waiting : NULL);
	SecurityRestore(&frame);
	if (!running && !sleeping && held_by == NULL)
		QueueNoteAtCommit(GetUserId(), start->priority, id);
	/* a run of a concurrency key starts at once when there is room */
	if (!running && !sleeping && !start->held && conc.key)
		ConcurrencyAdmit(workflow, conc.key, conc.limit, GetUserId());

	remember_created_run(id);
	return id;
}
