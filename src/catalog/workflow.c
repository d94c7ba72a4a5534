/*-------------------------------------------------------------------------
 *
 * workflow.c
 *	  The in-memory model of a registered workflow version, and its cache.
 *
 * A workflow version never changes once registered, so a compiled
 * WorkflowDef is cached for the life of the backend, in its own memory
 * context under CacheMemoryContext.  The cache is flushed when tuvl's
 * workflows table is invalidated (DROP EXTENSION, for instance), since
 * the same name and version may then come back with other contents.
 * Compilation assumes the definition passed validation.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"

#include "duration.h"
#include "jsonutil.h"
#include "nameindex.h"
#include "spiutil.h"
#include "security.h"
#include "uses.h"
#include "workflow.h"

const char *const WorkflowKindNames[STEP_KIND_COUNT] = {
	"Functional", "ModelOp", "Router", "APICall", "MCP", "Agent", "Human", "Sleep", "Workflow"
};

typedef struct WorkflowCacheKey
{
	char		name[NAMEDATALEN];
	int			version;
} WorkflowCacheKey;

typedef struct WorkflowCacheEntry
{
	WorkflowCacheKey key;
	WorkflowDef *def;
	MemoryContext cxt;
} WorkflowCacheEntry;

static HTAB *workflow_cache = NULL;
static bool callback_registered = false;
static bool cache_stale = false;	/* flush before the next lookup */
static Oid	workflows_relid = InvalidOid;	/* tuvl.workflows, when known */

bool
WorkflowKindFromName(const char *name, StepKind *kind)
{
	for (int i = 0; i < STEP_KIND_COUNT; i++)
	{
		if (strcmp(name, WorkflowKindNames[i]) == 0)
		{
			*kind = (StepKind) i;
			return true;
		}
	}
	return false;
}

/*
 * The steps used off the main line: some step's compensator, or a tool
 * of some agent.  Such steps run only when called.  One pass over the
 * steps (a pass per step made compiling 3,000 steps take gigabytes).
 */
static NameIndex *
side_line_steps(WorkflowDef *wf)
{
	NameIndex  *side = NameIndexCreate(16);

	for (int i = 0; i < wf->nsteps; i++)
	{
		Jsonb	   *spec = wf->steps[i].spec;
		char	   *comp = JsonGetString(spec, "compensate");
		Jsonb	   *agent = JsonGetJsonb(spec, "agent");
		Jsonb	   *tools = agent && JsonIsObject(agent) ? JsonGetJsonb(agent, "tools") : NULL;

		if (comp)
			(void) NameIndexAdd(side, comp, 1);
		if (tools && JB_ROOT_IS_ARRAY(tools) && !JB_ROOT_IS_SCALAR(tools))
		{
			int			ntools = JsonContainerSize(&tools->root);

			for (int t = 0; t < ntools; t++)
			{
				JsonbValue *tv = getIthJsonbValueFromContainer(&tools->root, t);
				char	   *ref;

				if (tv->type != jbvBinary)
					continue;
				ref = JsonGetString(JsonValueToJsonb(tv), "ref");
				if (ref)
					(void) NameIndexAdd(side, ref, 1);
			}
		}
	}
	return side;
}

/*
 * The hook references of a step, the workflow's first: read once here,
 * not at every event a step fires (hook.c).
 */
static List *
hook_refs(Jsonb *wf_hooks, Jsonb *step_hooks)
{
	Jsonb	   *sources[2] = {wf_hooks, step_hooks};
	List	   *refs = NIL;

	for (int s = 0; s < 2; s++)
		for (int i = 0; i < JsonArraySize(sources[s]); i++)
		{
			Jsonb	   *r = JsonArrayAt(sources[s], i);

			refs = lappend(refs, JsonValueToText(getIthJsonbValueFromContainer(&r->root, 0)));
		}
	return refs;
}

/*
 * Build a WorkflowDef from a validated definition, in CurrentMemoryContext.
 * Linear in the steps, and interruptible: a workflow of thousands of
 * steps compiles in milliseconds, and a cancel stops it at once.
 */
WorkflowDef *
WorkflowCompile(const char *name, int version, Jsonb *definition)
{
	WorkflowDef *wf = palloc0(sizeof(WorkflowDef));
	Jsonb	   *steps = JsonGetJsonb(definition, "steps");
	Jsonb	   *ends = JsonGetJsonb(definition, "ends");
	Jsonb	   *trigger = JsonGetJsonb(definition, "trigger");
	Jsonb	   *wf_hooks = JsonGetJsonb(definition, "hooks");
	char	   *start;
	NameIndex  *side;
	int			next = -1;

	wf->name = pstrdup(name);
	wf->version = version;
	wf->definition = definition;
	wf->sync_timeout_ms = -1;
	if (trigger && JsonIsObject(trigger))
	{
		wf->input_schema = JsonGetJsonb(trigger, "input");
		if (!DurationFromJson(JsonGetField(trigger, "sync_timeout"), &wf->sync_timeout_ms))
			wf->sync_timeout_ms = -1;
	}

	wf->nsteps = steps ? JsonContainerSize(&steps->root) : 0;
	wf->steps = palloc0(sizeof(StepDef) * Max(wf->nsteps, 1));
	wf->step_index = NameIndexCreate(wf->nsteps);
	for (int i = 0; i < wf->nsteps; i++)
	{
		StepDef    *s = &wf->steps[i];
		JsonbValue *v = getIthJsonbValueFromContainer(&steps->root, i);
		char	   *kind;

		CHECK_FOR_INTERRUPTS();

		s->spec = JsonValueToJsonb(v);
		s->id = JsonGetString(s->spec, "id");
		s->hooks = hook_refs(wf_hooks, JsonGetJsonb(s->spec, "hooks"));
		kind = JsonGetString(s->spec, "kind");
		if (kind == NULL || !WorkflowKindFromName(kind, &s->kind))
			elog(ERROR, "workflow \"%s\" version %d has an invalid step kind", name, version);
		s->kind_name = WorkflowKindNames[s->kind];
		s->output_key = JsonGetString(s->spec, "output");
		/* the step's own time limit; -1: tuvl.step_timeout */
		if (!DurationFromJson(JsonGetField(s->spec, "timeout"), &s->timeout_ms))
			s->timeout_ms = -1;
		if (s->kind == STEP_AGENT)
		{
			/* an agent writes its answer to outcome.write */
			Jsonb	   *agent = JsonGetJsonb(s->spec, "agent");
			Jsonb	   *outcome = agent && JsonIsObject(agent) ? JsonGetJsonb(agent, "outcome") : NULL;

			s->output_key = outcome && JsonIsObject(outcome) ? JsonGetString(outcome, "write") : NULL;
		}
		if (s->output_key == NULL)
			s->output_key = psprintf("%s_result", s->id);
		s->routes = JsonGetJsonb(s->spec, "routes");
		if (s->id == NULL || !NameIndexAdd(wf->step_index, s->id, i))
			elog(ERROR, "workflow \"%s\" version %d has a step without a unique id", name, version);
	}
	/* each step's implicit next: the next step on the main line, from the end */
	side = side_line_steps(wf);
	for (int i = wf->nsteps - 1; i >= 0; i--)
	{
		wf->steps[i].next = next;
		if (NameIndexGet(side, wf->steps[i].id) < 0)
			next = i;
	}
	hash_destroy((HTAB *) side);

	wf->nends = ends ? JsonContainerSize(&ends->root) : 0;
	wf->ends = palloc0(sizeof(EndDef) * Max(wf->nends, 1));
	for (int i = 0; i < wf->nends; i++)
	{
		EndDef	   *e = &wf->ends[i];
		Jsonb	   *obj = JsonValueToJsonb(getIthJsonbValueFromContainer(&ends->root, i));

		e->id = JsonGetString(obj, "id");
		e->status = JsonGetString(obj, "status");
		if (e->status == NULL)
			e->status = "completed";
		e->response = JsonGetJsonb(obj, "response");
		e->rollback = JsonGetBool(obj, "rollback", false);
	}

	start = JsonGetString(definition, "start");
	wf->start = start ? WorkflowFindStep(wf, start) : 0;
	if (wf->start < 0 || wf->nsteps == 0)
		elog(ERROR, "workflow \"%s\" version %d has no start step", name, version);
	return wf;
}

int
WorkflowFindStep(WorkflowDef *wf, const char *id)
{
	return NameIndexGet(wf->step_index, id);
}

EndDef *
WorkflowFindEnd(WorkflowDef *wf, const char *id)
{
	for (int i = 0; i < wf->nends; i++)
		if (strcmp(wf->ends[i].id, id) == 0)
			return &wf->ends[i];
	return NULL;
}

/*
 * An invalidation of tuvl.workflows (DROP EXTENSION, say) or of everything
 * marks the cache stale.  Nothing is freed here: invalidations arrive at
 * any lock acquisition, in the middle of a transition that still uses a
 * WorkflowDef; the next WorkflowLoad empties the cache instead.  No catalog
 * access either, as callbacks must not.
 */
static void
workflow_cache_inval(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == workflows_relid)
		cache_stale = true;
}

/* Empty a stale cache; called where no WorkflowDef is in use. */
static void
flush_if_stale(void)
{
	HASH_SEQ_STATUS status;
	WorkflowCacheEntry *entry;
	Oid			nsp;

	if (!cache_stale)
		return;
	hash_seq_init(&status, workflow_cache);
	while ((entry = hash_seq_search(&status)) != NULL)
	{
		MemoryContextDelete(entry->cxt);
		hash_search(workflow_cache, &entry->key, HASH_REMOVE, NULL);
	}
	cache_stale = false;
	nsp = get_namespace_oid("tuvl", true);
	workflows_relid = OidIsValid(nsp) ? get_relname_relid("workflows", nsp) : InvalidOid;
}

static const char load_sql[] =
"SELECT definition, owner::pg_catalog.oid, refs FROM tuvl.workflows "
"WHERE name OPERATOR(pg_catalog.=) $1 AND version OPERATOR(pg_catalog.=) $2";

/*
 * The compiled definition of a workflow version, from the cache or the
 * table.  SPI must be connected.  The result lives in the cache: do not
 * modify or free it, and do not keep it past the next WorkflowLoad (which
 * may empty a cache that an invalidation made stale).
 */
WorkflowDef *
WorkflowLoad(const char *name, int version)
{
	static const Oid types[2] = {TEXTOID, INT4OID};
	WorkflowCacheKey key;
	WorkflowCacheEntry *entry;
	bool		found;
	Datum		values[2];
	bool		isnull;
	Jsonb	   *definition;
	MemoryContext cxt;
	MemoryContext old;
	SecurityFrame frame;
	uint64		n;

	if (workflow_cache == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(WorkflowCacheKey);
		ctl.entrysize = sizeof(WorkflowCacheEntry);
		ctl.hcxt = CacheMemoryContext;
		workflow_cache = hash_create("tuvl workflows", 32, &ctl,
									 HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	if (!callback_registered)
	{
		CacheRegisterRelcacheCallback(workflow_cache_inval, (Datum) 0);
		callback_registered = true;
		cache_stale = true;		/* learns workflows_relid */
	}
	flush_if_stale();

	memset(&key, 0, sizeof(key));
	strlcpy(key.name, name, NAMEDATALEN);
	key.version = version;
	entry = hash_search(workflow_cache, &key, HASH_FIND, NULL);
	if (entry)
		return entry->def;

	values[0] = CStringGetTextDatum(name);
	values[1] = Int32GetDatum(version);
	SecurityAsOwner(&frame);
	n = SpiExec(load_sql, 2, types, values, NULL, SPI_OK_SELECT);
	SecurityRestore(&frame);
	if (n != 1)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("workflow \"%s\" version %d does not exist", name, version)));

	cxt = AllocSetContextCreate(CacheMemoryContext, "tuvl workflow",
								ALLOCSET_SMALL_SIZES);
	old = MemoryContextSwitchTo(cxt);
	definition = DatumGetJsonbPCopy(SPI_getbinval(SPI_tuptable->vals[0],
												  SPI_tuptable->tupdesc, 1, &isnull));
	PG_TRY();
	{
		WorkflowDef *def = WorkflowCompile(name, version, definition);
		Datum		refs = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 3, &isnull);

		def->refs = isnull ? NULL : DatumGetJsonbPCopy(refs);
		def->owner = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2,
													&isnull));

		MemoryContextSwitchTo(old);
		entry = hash_search(workflow_cache, &key, HASH_ENTER, &found);
		entry->def = def;
		entry->cxt = cxt;
	}
	PG_CATCH();
	{
		MemoryContextSwitchTo(old);
		MemoryContextDelete(cxt);
		PG_RE_THROW();
	}
	PG_END_TRY();
	return entry->def;
}

/* Who names objects in wf, for UseCheck (uses.c). */
void
WorkflowReferrer(WorkflowDef *wf, UseReferrer *by)
{
	by->owner = wf->owner;
	by->pins = wf->refs;
	by->unpinned = wf->refs == NULL;
	by->what = psprintf("workflow \"%s\" version %d", wf->name, wf->version);
}

static const char latest_sql[] =
"SELECT pg_catalog.max(version) FROM tuvl.workflows WHERE name OPERATOR(pg_catalog.=) $1";

/*
 * The newest version of a workflow; 0 or an error when there is none.
 * SPI must be connected.
 */
int
WorkflowLatestVersion(const char *name, bool missing_ok)
{
	static const Oid types[1] = {TEXTOID};
	Datum		values[1];
	bool		isnull;
	Datum		d;
	SecurityFrame frame;

	values[0] = CStringGetTextDatum(name);
	SecurityAsOwner(&frame);
	SpiExec(latest_sql, 1, types, values, NULL, SPI_OK_SELECT);
	SecurityRestore(&frame);
	d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	if (isnull)
	{
		const char *suggestion;

		if (missing_ok)
			return 0;
		suggestion = UseSuggest(USE_WORKFLOW, name);
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("workflow \"%s\" does not exist", name),
				 suggestion ? errhint("Did you mean \"%s\"?", suggestion) :
				 errhint("Register it first with tuvl.register_workflow().")));
	}
	return DatumGetInt32(d);
}
