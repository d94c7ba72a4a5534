/*-------------------------------------------------------------------------
 *
 * artifact.c
 *	  The artifact registry: versioned steering, prompt, skill, guardrail
 *	  and hook texts shared by workflows.
 *
 * register_artifact(source) stores a YAML document {name, type, body,
 * description} as version 1, 2, ... of its name; the type of a name never
 * changes.  Workflows refer to artifacts as artifact://name (floating:
 * the latest version) or artifact://name@N (pinned).  A run resolves its
 * workflow's floating references once, when it is created, and records
 * the versions in tuvl.runs.artifacts and its run_queued event; every
 * later transition, crash recovery and replay included, uses exactly
 * those versions, whatever was registered since.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "artifact.h"
#include "guardrail.h"
#include "jsonutil.h"
#include "metrics.h"
#include "security.h"
#include "spiutil.h"
#include "suggest.h"
#include "tuvl.h"
#include "uses.h"
#include "workflow.h"
#include "yamlparse.h"
#include "tokens.h"

PG_FUNCTION_INFO_V1(tuvl_register_artifact);

static const char *const artifact_types[] = {
	"steering", "prompt", "skill", "guardrail", "hook", NULL
};

static bool
valid_artifact_name(const char *name)
{
	if (name == NULL || !(islower((unsigned char) name[0]) || name[0] == '_'))
		return false;
	for (const char *p = name; *p; p++)
		if (!(islower((unsigned char) *p) || isdigit((unsigned char) *p) || *p == '_' || *p == '-'))
			return false;
	return strlen(name) <= 63;
}

/*
 * Is text an artifact reference?  Sets *name and *version (0: floating).
 * A malformed reference sets *name NULL and still returns true.
 */
bool
ArtifactParseRef(const char *text, char **name, int *version)
{
	const char *p;
	const char *at;

	*name = NULL;
	*version = 0;
	if (text == NULL || strncmp(text, ARTIFACT_PREFIX, strlen(ARTIFACT_PREFIX)) != 0)
		return false;
	p = text + strlen(ARTIFACT_PREFIX);
	at = strchr(p, '@');
	if (at)
	{
		char	   *end;
		long		v = strtol(at + 1, &end, 10);

		if (*end != '\0' || at[1] == '\0' || v < 1 || v > INT_MAX)
			return true;
		*version = (int) v;
		*name = pnstrdup(p, at - p);
	}
	else
		*name = pstrdup(p);
	if (!valid_artifact_name(*name))
		*name = NULL;
	return true;
}

bool
ArtifactSiteAccepts(ArtifactSite site, const char *type)
{
	switch (site)
	{
		case SITE_STEERING:
			return strcmp(type, "steering") == 0 || strcmp(type, "prompt") == 0;
		case SITE_PROMPT:
			return strcmp(type, "prompt") == 0;
		case SITE_SKILL:
			return strcmp(type, "skill") == 0;
		case SITE_GUARDRAIL:
			return strcmp(type, "guardrail") == 0;
		case SITE_HOOK:
			return strcmp(type, "hook") == 0;
	}
	return false;
}

const char *
ArtifactSiteTypes(ArtifactSite site)
{
	switch (site)
	{
		case SITE_STEERING:
			return "a steering or prompt artifact";
		case SITE_PROMPT:
			return "a prompt artifact";
		case SITE_SKILL:
			return "a skill artifact";
		case SITE_GUARDRAIL:
			return "a guardrail artifact";
		case SITE_HOOK:
			return "a hook artifact";
	}
	return "an artifact";
}

/*
 * Artifact versions, cached per process: a version never changes once
 * registered, and runs resolve the versions they pinned at every use (a
 * hook at every step, a guardrail at every gate).  An entry is read again
 * after PINNED_TTL_MS, so that a version deleted by hand goes away.
 */
#define PINNED_TTL_MS 60000

typedef struct PinnedKey
{
	char		name[NAMEDATALEN];
	int			version;
} PinnedKey;

typedef struct PinnedArtifact
{
	PinnedKey	key;
	TimestampTz loaded_at;
	char	   *type;			/* in pinned_cxt; NULL: being filled */
	char	   *body;
	Jsonb	   *definition;
	Oid			owner;			/* whose work the version is */
} PinnedArtifact;

static HTAB *pinned_cache = NULL;
static MemoryContext pinned_cxt = NULL;

static PinnedArtifact *
pinned_entry(const char *name, int version, bool create)
{
	PinnedKey	key;
	PinnedArtifact *e;
	bool		found;

	if (version <= 0 || strlen(name) >= NAMEDATALEN)
		return NULL;
	if (pinned_cache == NULL)
	{
		HASHCTL		ctl;

		if (!create)
			return NULL;
		pinned_cxt = AllocSetContextCreate(CacheMemoryContext, "tuvl artifacts", ALLOCSET_DEFAULT_SIZES);
		ctl.keysize = sizeof(PinnedKey);
		ctl.entrysize = sizeof(PinnedArtifact);
		ctl.hcxt = pinned_cxt;
		pinned_cache = hash_create("tuvl artifacts", 64, &ctl, HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	memset(&key, 0, sizeof(key));
	strlcpy(key.name, name, NAMEDATALEN);
	key.version = version;
	e = hash_search(pinned_cache, &key, create ? HASH_ENTER : HASH_FIND, &found);
	if (e && !found)
		e->type = NULL;
	if (e && found && e->type &&
		TimestampDifferenceExceeds(e->loaded_at, GetCurrentTimestamp(), PINNED_TTL_MS))
	{
		/* stale: read it again */
		pfree(e->type);
		if (e->body)
			pfree(e->body);
		if (e->definition)
			pfree(e->definition);
		e->type = NULL;
		e->body = NULL;
		e->definition = NULL;
		if (!create)
			return NULL;
	}
	return e;
}

/* Copy a cached version out, as ArtifactLookup returns it. */
static void
pinned_copy(PinnedArtifact *e, char **type, char **body, Jsonb **definition, Oid *owner)
{
	if (owner)
		*owner = e->owner;
	if (type)
		*type = pstrdup(e->type);
	if (body)
		*body = e->body ? pstrdup(e->body) : NULL;
	if (definition)
		*definition = JsonCopyTo(e->definition, CurrentMemoryContext);
}

/*
 * Look up version `version` of artifact name (0: the latest).  Returns
 * false when there is none; else sets what is asked for (palloc'd in the
 * caller's context).  Connects to SPI itself; a given version (with
 * neither version_out nor latest asked for) comes from the process's
 * cache once read.
 */
bool
ArtifactLookup(const char *name, int version, char **type, char **body, int *version_out,
			   int *latest, Jsonb **definition, Oid *owner)
{
	static const Oid types[2] = {TEXTOID, INT4OID};
	Datum		values[2];
	MemoryContext cxt = CurrentMemoryContext;
	SecurityFrame frame;
	bool		found = false;
	PinnedArtifact *pinned = version_out || latest ? NULL : pinned_entry(name, version, true);

	if (pinned && pinned->type)
	{
		pinned_copy(pinned, type, body, definition, owner);
		return true;
	}

	values[0] = CStringGetTextDatum(name);
	values[1] = Int32GetDatum(version);
	SPI_connect();
	SecurityAsOwner(&frame);
	if (SpiExec("SELECT a.type, a.body, a.version, "
				"  (SELECT pg_catalog.max(x.version) FROM tuvl.artifacts x "
				"   WHERE x.name OPERATOR(pg_catalog.=) $1), a.definition, a.owner::pg_catalog.oid "
				"FROM tuvl.artifacts a WHERE a.name OPERATOR(pg_catalog.=) $1 "
				"  AND ($2 OPERATOR(pg_catalog.=) 0 OR a.version OPERATOR(pg_catalog.=) $2) "
				"ORDER BY a.version DESC LIMIT 1",
				2, types, values, NULL, SPI_OK_SELECT) == 1)
	{
		HeapTuple	tup = SPI_tuptable->vals[0];
		TupleDesc	td = SPI_tuptable->tupdesc;
		bool		isnull;
		char	   *t = SPI_getvalue(tup, td, 1);
		char	   *b = SPI_getvalue(tup, td, 2);
		int			v = DatumGetInt32(SPI_getbinval(tup, td, 3, &isnull));
		int			l = DatumGetInt32(SPI_getbinval(tup, td, 4, &isnull));
		Oid			o = DatumGetObjectId(SPI_getbinval(tup, td, 6, &isnull));

		if (type)
			*type = MemoryContextStrdup(cxt, t);
		if (body)
			*body = b ? MemoryContextStrdup(cxt, b) : NULL;
		if (version_out)
			*version_out = v;
		if (latest)
			*latest = l;
		if (owner)
			*owner = o;
		if (definition)
		{
			Datum		d = SPI_getbinval(tup, td, 5, &isnull);

			*definition = isnull ? NULL : JsonCopyTo(DatumGetJsonbP(d), cxt);
		}
		if (pinned)
		{
			Datum		d = SPI_getbinval(tup, td, 5, &isnull);

			pinned->definition = isnull ? NULL : JsonCopyTo(DatumGetJsonbP(d), pinned_cxt);
			pinned->body = b ? MemoryContextStrdup(pinned_cxt, b) : NULL;
			pinned->loaded_at = GetCurrentTimestamp();
			pinned->owner = o;
			pinned->type = MemoryContextStrdup(pinned_cxt, t);	/* last: complete */
		}
		found = true;
	}
	else if (latest)
	{
		/* the name may exist without that version */
		if (SpiExec("SELECT pg_catalog.max(version) FROM tuvl.artifacts "
					"WHERE name OPERATOR(pg_catalog.=) $1", 1, types, values,
					NULL, SPI_OK_SELECT) == 1)
		{
			bool		isnull;
			Datum		d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);

			*latest = isnull ? 0 : DatumGetInt32(d);
		}
	}
	SecurityRestore(&frame);
	SPI_finish();
	return found;
}

/* Add v to refs when it is a string (a reference or plain text). */
static void
collect_string(JsonbValue *v, List **refs)
{
	if (v && v->type == jbvString)
		*refs = lappend(*refs, pnstrdup(v->val.string.val, v->val.string.len));
}

/* Add the strings of a list value. */
static void
collect_list(JsonbValue *v, List **refs)
{
	if (v == NULL || v->type != jbvBinary || !JsonContainerIsArray(v->val.binary.data))
		return;
	for (int i = 0; i < (int) JsonContainerSize(v->val.binary.data); i++)
		collect_string(getIthJsonbValueFromContainer(v->val.binary.data, i), refs);
}

/* Add the strings of a guardrails mapping {gate: [refs]}. */
static void
collect_gates(JsonbValue *v, List **refs)
{
	static const char *const gates[] = {"input", "output", "tools", NULL};
	Jsonb	   *g;

	if (v == NULL || v->type != jbvBinary || !JsonContainerIsObject(v->val.binary.data))
		return;
	g = JsonValueToJsonb(v);
	for (int i = 0; gates[i]; i++)
		collect_list(JsonGetField(g, gates[i]), refs);
}

/*
 * The strings at the sites of a workflow definition that take artifact
 * references: agent.steering, system, prompt, skills[], guardrails, and
 * hooks (of steps and of the workflow).  Text elsewhere is just text.
 */
static List *
reference_sites(Jsonb *definition)
{
	List	   *refs = NIL;
	Jsonb	   *steps = JsonGetJsonb(definition, "steps");

	collect_list(JsonGetField(definition, "hooks"), &refs);
	{
		Jsonb	   *sup = JsonGetJsonb(definition, "supervisor");
		Jsonb	   *judge = sup && JsonIsObject(sup) ? JsonGetJsonb(sup, "judge") : NULL;

		if (judge && JsonIsObject(judge))
			collect_string(JsonGetField(judge, "prompt"), &refs);
	}
	if (steps == NULL || !JB_ROOT_IS_ARRAY(steps) || JB_ROOT_IS_SCALAR(steps))
		return refs;
	for (int i = 0; i < (int) JsonContainerSize(&steps->root); i++)
	{
		JsonbValue *sv = getIthJsonbValueFromContainer(&steps->root, i);
		Jsonb	   *step;
		Jsonb	   *agent;

		if (sv->type != jbvBinary || !JsonContainerIsObject(sv->val.binary.data))
			continue;
		step = JsonValueToJsonb(sv);
		collect_list(JsonGetField(step, "hooks"), &refs);
		collect_gates(JsonGetField(step, "guardrails"), &refs);
		agent = JsonGetJsonb(step, "agent");
		if (agent == NULL || !JsonIsObject(agent))
			continue;
		collect_string(JsonGetField(agent, "steering"), &refs);
		collect_string(JsonGetField(agent, "system"), &refs);
		collect_string(JsonGetField(agent, "prompt"), &refs);
		collect_list(JsonGetField(agent, "skills"), &refs);
		collect_gates(JsonGetField(agent, "guardrails"), &refs);
	}
	return refs;
}

/*
 * The versions of the floating artifact references of a workflow
 * definition, now: {name: version}.  Raises for a reference that cannot
 * be resolved.
 */
Jsonb *
ArtifactPinFloating(Jsonb *definition)
{
	List	   *refs = reference_sites(definition);
	ListCell   *lc;
	JsonObjBuilder b;

	JsonObjStart(&b);
	foreach(lc, refs)
	{
		char	   *name;
		int			version;
		int			resolved;

		if (!ArtifactParseRef(lfirst(lc), &name, &version) || name == NULL || version > 0)
			continue;
		if (!ArtifactLookup(name, 0, NULL, NULL, &resolved, NULL, NULL, NULL))
			ereport(ERROR,
					(errcode(ERRCODE_UNDEFINED_OBJECT),
					 errmsg("artifact \"%s\" does not exist", name),
					 errdetail("The workflow refers to %s.", (char *) lfirst(lc)),
					 errhint("Register it with tuvl.register_artifact().")));
		JsonObjAddInt(&b, name, resolved);
	}
	return JsonObjEnd(&b);
}

/* The versions a run pinned when it was created (tuvl.runs.artifacts). */
static Jsonb *
run_artifacts(RunState *run)
{
	static const Oid types[1] = {INT8OID};
	Jsonb	   *pins = NULL;
	Datum		d;

	if (run->artifacts)
		return run->artifacts;
	SPI_connect();
	if (SecurityExecArgs("SELECT artifacts FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1",
						 SPI_OK_SELECT, 1, types, Int64GetDatum(run->id)) == 1 &&
		SpiValue(1, &d))
		pins = JsonCopyTo(DatumGetJsonbP(d), run->cxt);
	SPI_finish();
	/* kept with the run (a row from before artifacts has none) */
	if (pins == NULL)
		pins = JsonCopyTo(JsonEmptyObject(), run->cxt);
	run->artifacts = pins;
	return pins;
}

/*
 * The text a field means: itself, or the body of the artifact it refers
 * to, at the version the run pinned.  what names the field in errors.
 */
static bool
resolve_ref(RunState *run, const char *text, ArtifactSite site, const char *what,
			ArtifactRef *ref, const UseReferrer *by)
{
	char	   *name;
	int			version;
	bool		floating;
	UseReferrer wf_by;

	memset(ref, 0, sizeof(ArtifactRef));
	if (!ArtifactParseRef(text, &name, &version))
		return false;
	if (name == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s is a malformed artifact reference: %s", what, text),
				 errhint("Write artifact://name or artifact://name@version.")));
	floating = version == 0;
	if (version == 0)
	{
		Jsonb	   *pins = run_artifacts(run);
		JsonbValue *pin = JsonGetField(pins, name);

		if (pin == NULL || pin->type != jbvNumeric)
			ereport(ERROR,
					(errcode(ERRCODE_UNDEFINED_OBJECT),
					 errmsg("run " INT64_FORMAT " has no pinned version of artifact \"%s\"", run->id, name),
					 errdetail("%s refers to %s, which was not resolved when the run was created.",
							   what, text)));
		version = JsonGetInt32(pins, name, 0);
	}
	if (!ArtifactLookup(name, version, &ref->type, &ref->body, NULL, NULL, &ref->definition,
						&ref->owner))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("artifact \"%s\" has no version %d", name, version),
				 errdetail("%s refers to %s.", what, text)));
	/* whose it is: the workflow's (or by's) own, pinned, or granted (uses.c) */
	if (by == NULL)
	{
		WorkflowReferrer(run->wf, &wf_by);
		by = &wf_by;
	}
	UseCheck(by, USE_ARTIFACT, name, floating ? 0 : version, ref->owner);
	if (!ArtifactSiteAccepts(site, ref->type))
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_OBJECT_TYPE),
				 errmsg("%s refers to %s, a %s artifact", what, text, ref->type),
				 errdetail("%s takes %s.", what, ArtifactSiteTypes(site))));
	ref->name = name;
	ref->version = version;
	return true;
}

/*
 * The text an artifact reference stands for (text itself when it is not
 * a reference), as the run pinned it.
 */
char *
ArtifactResolveText(RunState *run, const char *text, ArtifactSite site, const char *what)
{
	return ArtifactResolveTextBy(run, text, site, what, NULL);
}

/*
 * ArtifactResolveText for a reference that by makes (a guardrail's check
 * naming a prompt artifact), not the run's workflow.
 */
char *
ArtifactResolveTextBy(RunState *run, const char *text, ArtifactSite site, const char *what,
					  const UseReferrer *by)
{
	ArtifactRef ref;

	if (!resolve_ref(run, text, site, what, &ref, by))
		return (char *) text;
	if (ref.body == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("artifact %s has no body", text)));
	return ref.body;
}

/*
 * ArtifactResolve from memory only: true when text is a reference whose
 * pinned version the run and the process's cache already hold (ref set,
 * nothing read, nothing raised), false otherwise (call ArtifactResolve).
 * ref's type, body and definition point into the cache: read them before
 * the next lookup, and never change them.
 */
bool
ArtifactResolveCached(RunState *run, const char *text, ArtifactSite site, ArtifactRef *ref)
{
	char	   *name;
	int			version;
	bool		floating;
	PinnedArtifact *e;

	memset(ref, 0, sizeof(ArtifactRef));
	if (!ArtifactParseRef(text, &name, &version) || name == NULL)
		return false;
	floating = version == 0;
	if (version == 0)
	{
		JsonbValue *pin;

		if (run->artifacts == NULL)
			return false;
		pin = JsonGetField(run->artifacts, name);
		if (pin == NULL || pin->type != jbvNumeric)
			return false;
		version = JsonGetInt32(run->artifacts, name, 0);
	}
	e = pinned_entry(name, version, false);
	if (e == NULL || e->type == NULL || !ArtifactSiteAccepts(site, e->type))
		return false;
	/* another role's (or not as pinned): the whole check (ArtifactResolve) */
	if (run->wf == NULL || e->owner != run->wf->owner ||
		(run->wf->refs &&
		 (Oid) JsonGetInt(run->wf->refs, UsePinKey(USE_ARTIFACT, name, floating ? 0 : version), 0) != e->owner))
		return false;
	ref->type = e->type;
	ref->body = e->body;
	ref->definition = e->definition;
	ref->owner = e->owner;
	ref->name = name;
	ref->version = version;
	return true;
}

/*
 * The artifact a reference names (for guardrails and hooks, whose
 * definitions matter), as the run pinned it.  Raises for text that is not
 * a reference.
 */
void
ArtifactResolve(RunState *run, const char *text, ArtifactSite site, const char *what,
				ArtifactRef *ref)
{
	if (!resolve_ref(run, text, site, what, ref, NULL))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be an artifact reference: %s", what, text),
				 errhint("Write artifact://name or artifact://name@version.")));
}

/*
 * Serialize the registrations of one name in a versioned registry and
 * check that the caller may add a version: tuvl's own lock on the name
 * in the kind's space (security.c: no session can take it otherwise),
 * then SecurityCheckNameOwner(kind, name) with the owner owner_sql finds.
 * owner_sql must be a string literal (SpiExec caches plans by address).
 * SPI must be connected.
 */
void
ArtifactLockName(const char *kind, const char *owner_sql, const char *name)
{
	SecurityLockKey(kind, name);
	SecurityCheckNameOwner(kind, name, SecurityNameOwner(owner_sql, name));
}

/* The keys of an artifact of type, besides name, type and description. */
static const char *const *
artifact_keys(const char *type)
{
	static const char *const text_keys[] = {"body", NULL};
	static const char *const guardrail_keys[] = {"checks", NULL};
	static const char *const hook_keys[] = {"events", "action", "metric", "step", NULL};

	if (strcmp(type, "guardrail") == 0)
		return guardrail_keys;
	if (strcmp(type, "hook") == 0)
		return hook_keys;
	return text_keys;
}

/* Every key of the definition means something for its type. */
static void
check_artifact_keys(Jsonb *def, const char *name, const char *type)
{
	const char *const *keys = artifact_keys(type);
	JsonbIterator *it = JsonbIteratorInit(&def->root);
	JsonbValue	v;
	char	   *key;

	while (JsonObjectNext(&it, &key, &v))
	{
		bool		known = strcmp(key, "name") == 0 || strcmp(key, "type") == 0 ||
		strcmp(key, "description") == 0;
		StringInfoData list;

		for (int i = 0; keys[i]; i++)
			known |= strcmp(key, keys[i]) == 0;
		if (known)
			continue;
		initStringInfo(&list);
		for (int i = 0; keys[i]; i++)
			appendStringInfo(&list, ", %s", keys[i]);
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("artifact \"%s\": unknown key \"%s\"", name, key),
				 SuggestName(key, keys) ? errhint("Did you mean \"%s\"?", SuggestName(key, keys)) :
				 errhint("A %s artifact takes name, type, description%s.", type, list.data)));
	}
}

/* A hook artifact: when it fires (events) and what it does (action). */
static void
check_hook(Jsonb *def, const char *name)
{
	static const char *const events[] = {"before_step", "after_step", "on_error", "before_tool",
	"after_tool", NULL};
	JsonbValue *ev = JsonGetField(def, "events");
	char	   *action = JsonGetString(def, "action");

	if (ev == NULL || ev->type != jbvBinary || !JsonContainerIsArray(ev->val.binary.data) ||
		JsonContainerSize(ev->val.binary.data) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("hook \"%s\" needs events, a list of events", name),
				 errhint("The events are before_step, after_step, on_error, before_tool and after_tool.")));
	for (int i = 0; i < (int) JsonContainerSize(ev->val.binary.data); i++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(ev->val.binary.data, i);
		bool		known = false;

		for (int k = 0; e->type == jbvString && events[k]; k++)
			known |= strlen(events[k]) == (size_t) e->val.string.len &&
				strncmp(events[k], e->val.string.val, e->val.string.len) == 0;
		if (!known)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("hook \"%s\": events[%d] is not an event", name, i),
					 errhint("The events are before_step, after_step, on_error, before_tool and after_tool.")));
	}
	if (action == NULL || (strcmp(action, "metric") != 0 && strcmp(action, "notify") != 0))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("hook \"%s\": action must be metric or notify", name)));
	if (strcmp(action, "notify") == 0 && JsonGetString(def, "step") == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("hook \"%s\": a notify hook needs step, the APICall step it runs", name)));
	if (JsonGetField(def, "metric") &&
		(strcmp(action, "metric") != 0 || JsonGetString(def, "metric") == NULL))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("hook \"%s\": metric names the counter of a metric hook, such as tuvl.hook.events", name)));
	if (JsonGetString(def, "metric") && strlen(JsonGetString(def, "metric")) >= METRIC_NAME_LEN)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("hook \"%s\": metric is longer than %d bytes", name, METRIC_NAME_LEN - 1)));
	if (strcmp(action, "metric") == 0 && JsonGetField(def, "step"))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("hook \"%s\": step is for notify hooks; a metric hook counts", name)));
}

/*
 * Check an artifact's definition (raises for a bad one, an unknown key
 * included); sets its name, type and body.
 */
static void
check_artifact(Jsonb *def, char **name_out, char **type_out, JsonbValue **body_out)
{
	char	   *name;
	char	   *type;
	JsonbValue *body;
	bool		known = false;

	if (!JsonIsObject(def))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("an artifact must be a YAML mapping with name, type and body")));
	name = JsonGetString(def, "name");
	type = JsonGetString(def, "type");
	body = JsonGetField(def, "body");
	if (!valid_artifact_name(name))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("artifact name %s%s%s is not valid", name ? "\"" : "", name ? name : "(missing)",
						name ? "\"" : ""),
				 errhint("A name matches [a-z_][a-z0-9_-]*, such as support_tone.")));
	for (int i = 0; type && artifact_types[i]; i++)
		known |= strcmp(type, artifact_types[i]) == 0;
	if (!known)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("artifact \"%s\": type %s%s%s is not valid", name, type ? "\"" : "",
						type ? type : "(missing)", type ? "\"" : ""),
				 errhint("Use one of steering, prompt, skill, guardrail, hook.")));
	if ((strcmp(type, "steering") == 0 || strcmp(type, "prompt") == 0 || strcmp(type, "skill") == 0) &&
		(body == NULL || body->type != jbvString || body->val.string.len == 0))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("artifact \"%s\": a %s artifact needs body, its text", name, type)));
	check_artifact_keys(def, name, type);
	if (strcmp(type, "guardrail") == 0)
		GuardrailCheckDefinition(name, def);
	else if (strcmp(type, "hook") == 0)
		check_hook(def, name);
	*name_out = name;
	*type_out = type;
	*body_out = body;
}

/* The role whose work what names is must be the caller, or have granted its use. */
static void
check_named_use(const char *artifact, int check, UseKind kind, const char *name, int version)
{
	Oid			owner = UseContentOwner(kind, name, version);

	if (!OidIsValid(owner))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("artifact \"%s\": check %d names %s \"%s\", which does not exist",
						artifact, check, UseKindWhat(kind), name),
				 errhint("Register it first: another role could register the name later and receive what the check sends it.")));
	if (!UseAllowed(kind, name, owner, GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("artifact \"%s\": check %d names %s \"%s\" of role \"%s\", which has not granted its use to you",
						artifact, check, UseKindWhat(kind), name, GetUserNameFromId(owner, false)),
				 errhint("Its owner can: SELECT tuvl.grant_use('%s', '%s', '%s');", UseKindName(kind), name,
						 GetUserNameFromId(GetUserId(), false))));
}

/*
 * What a guardrail's llm_judge checks name (a model config, a prompt
 * artifact) must exist and be the registering role's or granted to it
 * (uses.c).  SPI connected.
 */
static void
check_guardrail_uses(Jsonb *def, const char *name)
{
	Jsonb	   *checks = JsonGetJsonb(def, "checks");

	for (int i = 0; i < JsonArraySize(checks); i++)
	{
		Jsonb	   *check = JsonArrayAt(checks, i);
		char	   *model = JsonGetString(check, "model");
		char	   *prompt = JsonGetString(check, "prompt");
		char	   *pname;
		int			pversion;

		if (!JsonIsObject(check) || JsonGetString(check, "check") == NULL ||
			strcmp(JsonGetString(check, "check"), "llm_judge") != 0)
			continue;
		check_named_use(name, i + 1, USE_LLM, model ? model : "default", 0);
		if (prompt && ArtifactParseRef(prompt, &pname, &pversion) && pname)
			check_named_use(name, i + 1, USE_ARTIFACT, pname, pversion);
	}
}

/*
 * register_artifact(source): store a new version of an artifact.
 */
Datum
tuvl_register_artifact(PG_FUNCTION_ARGS)
{
	char	   *source = text_to_cstring(PG_GETARG_TEXT_PP(0));
	Jsonb	   *def = YamlToJsonb(source, "artifact", NULL);
	char	   *name;
	char	   *type;
	JsonbValue *body;
	char	   *old_type = NULL;
	int			latest = 0;
	int			version;
	SecurityFrame frame;

	TokenRequireScope("workflows:write");
	check_artifact(def, &name, &type, &body);
	SPI_connect();
	ArtifactLockName("artifact",
					 "SELECT owner FROM tuvl.artifacts "
					 "WHERE name OPERATOR(pg_catalog.=) $1 "
					 "  AND version OPERATOR(pg_catalog.=) 1", name);
	if (strcmp(type, "guardrail") == 0)
		check_guardrail_uses(def, name);
	SPI_finish();
	if (ArtifactLookup(name, 0, &old_type, NULL, &latest, NULL, NULL, NULL) && strcmp(old_type, type) != 0)
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_OBJECT_TYPE),
				 errmsg("artifact \"%s\" is a %s artifact; a new version cannot change its type to %s",
						name, old_type, type),
				 errhint("Register the %s under another name.", type)));
	version = latest + 1;
	SPI_connect();
	{
		static const Oid types[7] = {TEXTOID, INT4OID, TEXTOID, TEXTOID, JSONBOID, TEXTOID, REGROLEOID};
		Datum		values[7];
		char		nulls[7] = {' ', ' ', ' ', ' ', ' ', ' ', ' '};

		values[0] = CStringGetTextDatum(name);
		values[1] = Int32GetDatum(version);
		values[2] = CStringGetTextDatum(type);
		if (body && body->type == jbvString)
			values[3] = CStringGetTextDatum(pnstrdup(body->val.string.val, body->val.string.len));
		else if (body)
			values[3] = CStringGetTextDatum(JsonValueToText(body));
		else
			nulls[3] = 'n';
		values[4] = JsonbPGetDatum(def);
		values[5] = CStringGetTextDatum(source);
		values[6] = ObjectIdGetDatum(GetUserId());
		SecurityAsOwner(&frame);
		SpiExec("INSERT INTO tuvl.artifacts (name, version, type, body, definition, source, owner) "
				"VALUES ($1, $2, $3, $4, $5, $6, $7)", 7, types, values, nulls, SPI_OK_INSERT);
		SecurityRestore(&frame);
	}
	SPI_finish();
	PG_RETURN_INT32(version);
}
