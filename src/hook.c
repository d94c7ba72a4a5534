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
 * (runtime.c) and in the agent's tool dispatch (agent.c), so workers,
 * tuvl.run() and tuvl.replay() behave alike.
 *
 * A hook never changes the context or the flow.  The metric action adds 1
 * to a counter (tuvl.metric_counters, read through tuvl.metrics) in the
 * transition's own transaction: a transition that rolls back, or runs
 * again after a crash, counts once.  A replay counts nothing: it only
 * checks a recording.  A hook that fails is logged and swallowed; its
 * work is rolled back in a subtransaction of its own.  A cancel that
 * reaches a hook (a step's timeout, a batch's time budget, an abort) is
 * not the hook's failure: it goes on to the transition, which is made
 * again, hooks included.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "storage/backendid.h"
#include "utils/builtins.h"

#include "artifact.h"
#include "hook.h"
#include "jsonutil.h"
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

/* Add 1 to the counter of a metric hook, labelled with where it fired. */
static void
count(RunState *run, const StepDef *step, const char *hook, Jsonb *definition, HookEvent event,
	  const char *tool, const char *signal)
{
	static const Oid types[4] = {TEXTOID, JSONBOID, REGROLEOID, INT4OID};
	char	   *metric = JsonGetString(definition, "metric");
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "event", event_names[event]);
	JsonObjAddString(&b, "hook", hook);
	JsonObjAddString(&b, "workflow", run->workflow);
	JsonObjAddString(&b, "step", step->id);
	if (tool)
		JsonObjAddString(&b, "tool", tool);
	if (signal)
		JsonObjAddString(&b, "signal", signal);
	/* this backend's own row: concurrent workers never wait for each other */
	SecurityExecArgs("INSERT INTO tuvl.metric_counters AS c (name, labels, principal_id, shard, value) "
					 "VALUES ($1, $2, $3, $4, 1) ON CONFLICT (name, labels, principal_id, shard) "
					 "DO UPDATE SET value = c.value OPERATOR(pg_catalog.+) 1",
					 SPI_OK_INSERT, 4, types,
					 CStringGetTextDatum(metric ? metric : HOOK_DEFAULT_METRIC),
					 JsonbPGetDatum(JsonObjEnd(&b)), ObjectIdGetDatum(run->principal),
					 Int32GetDatum(MyBackendId));
}

/* The hook references attached to step: the workflow's, then the step's. */
static List *
hook_refs(RunState *run, const StepDef *step)
{
	Jsonb	   *sources[2];
	List	   *refs = NIL;

	sources[0] = run->wf ? JsonGetJsonb(run->wf->definition, "hooks") : NULL;
	sources[1] = JsonGetJsonb(step->spec, "hooks");
	for (int s = 0; s < 2; s++)
		for (int i = 0; i < JsonArraySize(sources[s]); i++)
		{
			Jsonb	   *r = JsonArrayAt(sources[s], i);
			char	   *text = JsonValueToText(getIthJsonbValueFromContainer(&r->root, 0));

			refs = lappend(refs, text);
		}
	return refs;
}

/* Fire one hook, in a subtransaction: a failure is logged and forgotten. */
static void
fire_one(RunState *run, const StepDef *step, const char *ref, HookEvent event,
		 const char *tool, const char *signal)
{
	SpiSubxact	sub;

	SpiSubxactBegin(&sub);
	PG_TRY();
	{
		ArtifactRef hook;

		ArtifactResolve(run, ref, SITE_HOOK, psprintf("the hooks of step \"%s\"", step->id), &hook);
		if (fires_on(hook.definition, event))
			count(run, step, hook.name, hook.definition, event, tool, signal);
		SpiSubxactCommit(&sub);
	}
	PG_CATCH();
	{
		ErrorData  *edata = SpiSubxactAbort(&sub);

		/* a cancel (a timeout, the batch's budget, an abort) is the transition's */
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
 * signal where there is one.  Never raises for a hook's failure.
 */
void
HookFire(RunState *run, const StepDef *step, HookEvent event, const char *tool,
		 const char *signal)
{
	ListCell   *lc;

	if (run->replay)
		return;
	foreach(lc, hook_refs(run, step))
		fire_one(run, step, lfirst(lc), event, tool, signal);
}
