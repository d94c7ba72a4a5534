/*-------------------------------------------------------------------------
 *
 * hook.c
 *	  Hooks: observe-only actions of hook artifacts, fired around the
 *	  steps of a run and around an agent's tool calls.
 *
 * A hook artifact names the events it fires on (before_step, after_step,
 * on_error, before_tool, after_tool) and its action.  Attached to the
 * whole workflow (top-level hooks) or to one step (hooks on the step),
 * it fires where every surface executes steps: in the transition
 * (runtime.c) and in the agent's tool dispatch (agent_loop.c), so workers,
 * tuvl.run() and tuvl.replay() behave alike.
 *
 * A hook never changes the context or the flow.  The metric action adds 1
 * to a counter in shared memory (metrics.c, read through tuvl.metrics)
 * when the transition's transaction commits: a transition that rolls
 * back, or runs again after a crash, counts once.  A replay counts nothing: it only
 * checks a recording.  A hook that fails is logged and swallowed; its
 * work is rolled back in a subtransaction of its own.  A cancel that
 * reaches a hook (a step's timeout, a batch's time budget, an abort) is
 * not the hook's failure: it goes on to the transition, which is made
 * again, hooks included.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "storage/backendid.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "artifact.h"
#include "hook.h"
#include "journal.h"
#include "jsonutil.h"
#include "metrics.h"
#include "queue.h"
#include "security.h"
#include "spiutil.h"

static const char *const event_names[] = {
	"before_step", "after_step", "on_error", "before_tool", "after_tool"
};

#define HOOK_DEFAULT_METRIC "tuvl.hook.events"

/* Does the hook's definition list event? */
static bool
fires_on(Jsonb *definition, HookEvent event)
{
	JsonbValue *events = definition ? JsonGetField(definition, "events") : NULL;
	const char *name = event_names[event];

	if (events == NULL || events->type != jbvBinary)
		return false;
	for (int i = 0; i < (int) JsonContainerSize(events->val.binary.data); i++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(events->val.binary.data, i);

		if (e->type == jbvString && e->val.string.len == (int) strlen(name) &&
			strncmp(e->val.string.val, name, e->val.string.len) == 0)
			return true;
	}
	return false;
}

/*
 * Add 1 to the counter metric (NULL: the default) of a metric hook,
 * labelled with where it fired, in shared memory (metrics.c): it is added
 * when the transaction commits.
 */
static void
count(RunState *run, const StepDef *step, const char *hook, const char *metric, HookEvent event,
	  const char *tool, const char *signal)
{
	MetricLabel labels[6] = {
		{"event", event_names[event]},
		{"hook", hook},
		{"workflow", run->workflow},
		{"step", step->id},
		{"tool", tool},
		{"signal", signal},
	};

	MetricCount(metric ? metric : HOOK_DEFAULT_METRIC, run->principal, labels, lengthof(labels), 1);
}

/*
 * Metric hooks this process has resolved, by the text of their reference
 * and the version it stands for.  A hook on a workflow fires at every
 * step, twice (before and after), and parsing its reference, finding the
 * version in the artifact cache and reading the definition's events every
 * time cost more than the counting.  A version never changes once
 * registered; an entry is trusted for as long as the artifact cache
 * trusts its own (HOOK_MEMO_MS), so that a version deleted by hand goes
 * away here too.
 */
#define HOOK_MEMO_SIZE 16
#define HOOK_MEMO_MS 60000

typedef struct MetricHook
{
	char	   *ref;			/* the reference's text; NULL: a free slot */
	bool		run_pinned;		/* it names no version: the run's pin decides */
	int			version;
	char	   *name;
	char	   *metric;			/* NULL: HOOK_DEFAULT_METRIC */
	uint32		events;			/* 1 << each HookEvent it fires on */
	TimestampTz until;
} MetricHook;

static MetricHook memo[HOOK_MEMO_SIZE];
static int	memo_next = 0;		/* the slot to take when none is free */

static MetricHook *
memo_find(RunState *run, const char *ref)
{
	for (int i = 0; i < HOOK_MEMO_SIZE; i++)
	{
		MetricHook *m = &memo[i];

		if (m->ref == NULL || strcmp(m->ref, ref) != 0 ||
			m->until < GetCurrentTransactionStartTimestamp())
			continue;
		if (m->run_pinned &&
			(run->artifacts == NULL || JsonGetInt32(run->artifacts, m->name, 0) != m->version))
			continue;
		return m;
	}
	return NULL;
}

/* Remember the metric hook ref resolved to (from the artifact cache). */
static MetricHook *
memo_store(const char *ref, const ArtifactRef *hook)
{
	MetricHook *m = NULL;
	char	   *metric = JsonGetString(hook->definition, "metric");
	char	   *name;
	int			version;

	for (int i = 0; i < HOOK_MEMO_SIZE && m == NULL; i++)
		if (memo[i].ref == NULL ||
			(strcmp(memo[i].ref, ref) == 0 && memo[i].version == hook->version))
			m = &memo[i];
	if (m == NULL)
	{
		m = &memo[memo_next];
		memo_next = (memo_next + 1) % HOOK_MEMO_SIZE;
	}
	if (m->ref)
	{
		pfree(m->ref);
		pfree(m->name);
		if (m->metric)
			pfree(m->metric);
	}
	m->ref = MemoryContextStrdup(TopMemoryContext, ref);
	m->run_pinned = ArtifactParseRef(ref, &name, &version) && version == 0;
	m->version = hook->version;
	m->name = MemoryContextStrdup(TopMemoryContext, hook->name);
	m->metric = metric ? MemoryContextStrdup(TopMemoryContext, metric) : NULL;
	m->events = 0;
	for (int e = 0; e < (int) lengthof(event_names); e++)
		if (fires_on(hook->definition, (HookEvent) e))
			m->events |= 1 << e;
	m->until = TimestampTzPlusMilliseconds(GetCurrentTransactionStartTimestamp(), HOOK_MEMO_MS);
	return m;
}

/*
 * A notify hook: start a run of the same workflow version, as the same
 * principal and with the same artifact versions, that executes the
 * hook's APICall step on the payload {event, run_id, step, tool, signal,
 * error} and ends.  It is created in this transaction: it exists exactly
 * when the transition that fired the hook commits, and a worker sends
 * the request after that, with the step's own retry policy and
 * idempotency key.  The run's context and flow never see it.
 */
static void
notify(RunState *run, const StepDef *step, ArtifactRef *hook, HookEvent event,
	   const char *tool, const char *signal, const char *error)
{
	static const Oid types[3] = {INT8OID, JSONBOID, JSONBOID};
	char	   *target = JsonGetString(hook->definition, "step");
	int			ti = run->wf ? WorkflowFindStep(run->wf, target) : -1;
	JsonObjBuilder b;
	Jsonb	   *payload;
	Jsonb	   *info;
	int64		id;
	bool		isnull;
	List	   *events = NIL;

	if (ti < 0 || run->wf->steps[ti].kind != STEP_APICALL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("notify hook \"%s\" names step \"%s\", which is not an APICall step of workflow \"%s\"",
						hook->name, target, run->workflow)));
	JsonObjStart(&b);
	JsonObjAddString(&b, "event", event_names[event]);
	JsonObjAddInt(&b, "run_id", run->id);
	JsonObjAddString(&b, "step", step->id);
	JsonObjAddString(&b, "tool", tool);
	JsonObjAddString(&b, "signal", signal);
	JsonObjAddString(&b, "error", error);
	payload = JsonObjEnd(&b);

	JsonObjStart(&b);
	JsonObjAddString(&b, "hook", hook->name);
	JsonObjAddInt(&b, "version", hook->version);
	JsonObjAddString(&b, "event", event_names[event]);
	JsonObjAddString(&b, "step", target);
	info = JsonObjEnd(&b);

	SecurityExecArgs("INSERT INTO tuvl.runs (workflow, workflow_version, status, input, context, "
					 "  principal, principal_id, artifacts, last_seq, parent_run_id, hook) "
					 "SELECT p.workflow, p.workflow_version, 'queued', $2, $2, p.principal, "
					 "  p.principal_id, p.artifacts, 1, p.id, $3 "
					 "FROM tuvl.runs p WHERE p.id OPERATOR(pg_catalog.=) $1 RETURNING id",
					 SPI_OK_INSERT_RETURNING, 3, types, Int64GetDatum(run->id),
					 JsonbPGetDatum(payload), JsonbPGetDatum(info));
	if (SPI_processed != 1)
		elog(ERROR, "run " INT64_FORMAT " is not in tuvl.runs", run->id);
	id = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));

	JsonObjStart(&b);
	JsonObjAddString(&b, "workflow", run->workflow);
	JsonObjAddInt(&b, "version", run->version);
	JsonObjAddString(&b, "principal", run->principal_name);
	JsonObjAddJsonb(&b, "input", payload);
	JsonObjAddInt(&b, "parent_run_id", run->id);
	JsonObjAddJsonb(&b, "hook", info);
	JournalAdd(&events, "run_queued", NULL, NULL, JsonObjEnd(&b));
	{
		SecurityFrame frame;

		SecurityAsOwner(&frame);
		(void) JournalWrite(id, run->principal, 0, events);
		SecurityRestore(&frame);
	}
	QueueNoteAtCommit(run->principal, 0, id);
}

/*
 * Fire one hook, in a subtransaction: a failure is logged and forgotten.
 * A metric hook this process has resolved needs none: it reads nothing
 * and only adds to a pending count.
 */
static void
fire_one(RunState *run, const StepDef *step, const char *ref, HookEvent event,
		 const char *tool, const char *signal, const char *error)
{
	SpiSubxact	sub;
	ArtifactRef cached;
	MetricHook *m = memo_find(run, ref);

	if (m == NULL && ArtifactResolveCached(run, ref, SITE_HOOK, &cached) &&
		strcmp(JsonGetString(cached.definition, "action"), "metric") == 0)
		m = memo_store(ref, &cached);
	if (m)
	{
		if (m->events & (1 << event))
			count(run, step, m->name, m->metric, event, tool, signal);
		return;
	}
	SpiSubxactBegin(&sub);
	PG_TRY();
	{
		ArtifactRef hook;

		ArtifactResolve(run, ref, SITE_HOOK, psprintf("the hooks of step \"%s\"", step->id), &hook);
		if (!fires_on(hook.definition, event))
			;
		else if (strcmp(JsonGetString(hook.definition, "action"), "notify") == 0)
			notify(run, step, &hook, event, tool, signal, error);
		else
			count(run, step, hook.name, JsonGetString(hook.definition, "metric"), event, tool,
				  signal);
		SpiSubxactCommit(&sub);
	}
	PG_CATCH();
	{
		ErrorData  *edata = SpiSubxactAbort(&sub);

		/*
		 * a cancel (a timeout, the batch's budget, an abort) is the
		 * transition's
		 */
		if (edata->sqlerrcode == ERRCODE_QUERY_CANCELED)
			ReThrowError(edata);
		ereport(LOG,
				(errmsg("tuvl run " INT64_FORMAT ": hook %s of step \"%s\" failed on %s: %s",
						run->id, ref, step->id, event_names[event], edata->message)));
	}
	PG_END_TRY();
}

/*
 * Fire the hooks of step (and of its workflow) that listen for event.
 * tool names the tool of a tool event; signal is the step's or tool's
 * signal, and error its error, where there is one.  Never raises for a
 * hook's failure.  A replay fires nothing (it sends nothing and counts
 * nothing), and neither does a run a notify hook started: its hooks would
 * start runs without end.
 */
void
HookFire(RunState *run, const StepDef *step, HookEvent event, const char *tool,
		 const char *signal, const char *error)
{
	ListCell   *lc;

	if (run->replay || run->notify_step >= 0)
		return;
	foreach(lc, step->hooks)
		fire_one(run, step, lfirst(lc), event, tool, signal, error);
}
