/*-------------------------------------------------------------------------
 *
 * validate.c
 *	  Static checks of a workflow definition.
 *
 * ValidateWorkflow walks the parsed YAML (jsonb) and returns every
 * finding at once, each with the path of the offending node and, where
 * the YAML position is known, its line and column in the message.  It
 * never raises for a bad workflow: callers decide (register_workflow
 * refuses any error, validate() returns the rows).  Most checks look only
 * at the definition, but what it names (artifacts, model configs, child
 * workflows) is looked up in tuvl's tables, and must be the registering
 * role's or granted to it (uses.c); the owners found are pinned (refs).
 * The lookups connect to SPI themselves.  Results are palloc'd in CurrentMemoryContext.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/numeric.h"
#include "utils/jsonb.h"

#include "artifact.h"
#include "cron.h"
#include "executor.h"
#include "jsonschema.h"
#include "jsonutil.h"
#include "llm.h"
#include "security.h"
#include "spiutil.h"
#include "suggest.h"
#include "template.h"
#include "uses.h"
#include "validate.h"
#include "workflow.h"
#include "yamlparse.h"

struct ValidateState
{
	List	   *findings;
	Jsonb	   *positions;
	bool		strict;
	Jsonb	   *definition;
	/* ids of steps (to their position) and ends, for route checks */
	NameIndex  *step_ids;
	NameIndex  *end_ids;
	/* what the workflow names, for uses.c: the registering role, the pins */
	Oid			user;
	JsonObjBuilder pins;
	NameIndex  *pinned;
};

static const char *const top_level_keys[] = {
	"name", "description", "trigger", "start", "steps", "ends", "hooks", "supervisor",
	"concurrency",
	"max_cost",					/* issue 41: model costs */
	"rate_limit", NULL
};

static const char *const step_common_keys[] = {
	"id", "kind", "description", "output", "routes", "compensate", "hooks",
	"context_injection", "timeout", NULL
};

/*
 * Keys the YAML format reserves for features this version does not have:
 * an error with what to do instead, never accepted and ignored.
 */
typedef struct ReservedKey
{
	const char *key;
	const char *where;			/* the path of its mapping; NULL: anywhere */
	const char *message;
} ReservedKey;

static const ReservedKey reserved_keys[] = {
	{"retry", "step", "a step-level retry is not available in this version of tuvl; "
	"an APICall retries per http.retry, an Agent's model calls per agent.retry"},
	{"rate_limit", "step", "rate_limit applies to APICall, MCP and Agent steps, and to a whole workflow at its top level"},
	{NULL, NULL, NULL}
};

/* Add a finding at path; the YAML position of path, when known, is appended. */
void
ValidateFinding(ValidateState *vs, const char *severity, const char *path,
				const char *fmt,...)
{
	Finding    *f = palloc(sizeof(Finding));
	StringInfoData buf;
	va_list		args;
	char	   *pos = NULL;

	initStringInfo(&buf);
	for (;;)
	{
		int			needed;

		va_start(args, fmt);
		needed = appendStringInfoVA(&buf, fmt, args);
		va_end(args);
		if (needed == 0)
			break;
		enlargeStringInfo(&buf, needed);
	}
	if (vs->positions && path && *path)
		pos = YamlPositionText(vs->positions, path);
	if (pos)
		appendStringInfo(&buf, " (%s)", pos);

	f->severity = severity;
	f->suggestion = NULL;
	f->path = pstrdup(path ? path : "");
	f->message = buf.data;
	vs->findings = lappend(vs->findings, f);
}

/*
 * Add an error finding about a name that is not one of the names known
 * there: head, then "did you mean" when a known name is close (suggest.c,
 * kept in the finding for register_workflow's hint), or else head and
 * tail (the names it could be, what to do).
 */
static void
add_unknown(ValidateState *vs, const char *path, const char *suggestion, const char *head,
			const char *tail)
{
	Finding    *f;

	if (suggestion)
		ValidateFinding(vs, "error", path, "%s; did you mean \"%s\"?", head, suggestion);
	else
		ValidateFinding(vs, "error", path, "%s%s", head, tail);
	f = llast(vs->findings);
	f->suggestion = suggestion;
}

/* Is s a letter or _ followed by letters, digits, _ (and - if allow_dash)? */
static bool
valid_identifier(const char *s, bool allow_dash)
{
	if (s == NULL || *s == '\0')
		return false;
	if (!(isalpha((unsigned char) *s) || *s == '_'))
		return false;
	for (s++; *s; s++)
		if (!(isalnum((unsigned char) *s) || *s == '_' || (allow_dash && *s == '-')))
			return false;
	return true;
}

/* Does s match [a-z_][a-z0-9_]*? */
static bool
valid_workflow_name(const char *s)
{
	if (s == NULL || *s == '\0' || !((*s >= 'a' && *s <= 'z') || *s == '_'))
		return false;
	for (s++; *s; s++)
		if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '_'))
			return false;
	return true;
}

/* Is name one of the NULL-terminated options (none when options is NULL)? */
static bool
name_in(const char *name, const char *const *options)
{
	for (int i = 0; options && options[i]; i++)
		if (strcmp(options[i], name) == 0)
			return true;
	return false;
}

/*
 * Step a non-recursive iterator over a mapping to its next key: sets *key
 * (palloc'd) and *value.  Returns false at the end of the mapping.
 */
static bool
next_key(JsonbIterator **it, char **key, JsonbValue *value)
{
	JsonbValue	k;

	for (;;)
	{
		JsonbIteratorToken tok = JsonbIteratorNext(it, &k, true);

		if (tok == WJB_DONE)
			return false;
		if (tok == WJB_KEY)
			break;
	}
	*key = pnstrdup(k.val.string.val, k.val.string.len);
	(void) JsonbIteratorNext(it, value, true);
	return true;
}

/* "a string", "a mapping" and so on, for messages about v's type. */
const char *
ValidateTypeName(JsonbValue *v)
{
	switch (v->type)
	{
		case jbvNull:
			return "null";
		case jbvString:
			return "a string";
		case jbvNumeric:
			return "a number";
		case jbvBool:
			return "a boolean";
		case jbvBinary:
			return JsonContainerIsObject(v->val.binary.data) ? "a mapping" : "a list";
		default:
			return "a value";
	}
}

bool
ValidateIsMapping(JsonbValue *v)
{
	return v && v->type == jbvBinary && JsonContainerIsObject(v->val.binary.data);
}

bool
ValidateIsList(JsonbValue *v)
{
	return v && v->type == jbvBinary && JsonContainerIsArray(v->val.binary.data);
}

/* Is path that of a step: steps[<n>]? */
static bool
is_step_path(const char *path)
{
	const char *p = path;

	if (strncmp(p, "steps[", 6) != 0)
		return false;
	p += 6;
	while (*p >= '0' && *p <= '9')
		p++;
	return p > path + 6 && strcmp(p, "]") == 0;
}

/* The keys of a list, for messages: "a, b, c". */
static char *
keys_text(const char *const *keys, const char *const *keys2)
{
	StringInfoData buf;

	initStringInfo(&buf);
	for (int i = 0; keys && keys[i]; i++)
		appendStringInfo(&buf, "%s%s", buf.len ? ", " : "", keys[i]);
	for (int i = 0; keys2 && keys2[i]; i++)
		appendStringInfo(&buf, "%s%s", buf.len ? ", " : "", keys2[i]);
	return buf.data;
}

/*
 * Report keys of obj not in the allowed list(s) as errors: a key tuvl
 * accepts does something, so a misspelt or reserved key is never ignored.
 * Keys in skip are the caller's to report (removed keys, with what
 * replaces them) and are never suggested.
 */
static void
unknown_keys(ValidateState *vs, Jsonb *obj, const char *path,
			 const char *const *allowed, const char *const *allowed2,
			 const char *const *skip)
{
	JsonbIterator *it = JsonbIteratorInit(&obj->root);
	JsonbValue	v;
	char	   *key;

	while (next_key(&it, &key, &v))
	{
		const char *reserved = NULL;

		if (name_in(key, allowed) || name_in(key, allowed2) || name_in(key, skip))
			continue;
		for (int i = 0; reserved_keys[i].key; i++)
			if (strcmp(reserved_keys[i].key, key) == 0 &&
				(reserved_keys[i].where == NULL || strcmp(reserved_keys[i].where, path) == 0 ||
				 (strcmp(reserved_keys[i].where, "step") == 0 && is_step_path(path))))
				reserved = reserved_keys[i].message;
		if (reserved)
			ValidateFinding(vs, "error", psprintf("%s%s%s", path, *path ? "." : "", key), "%s", reserved);
		else
		{
			NameSuggestion sg;

			SuggestInit(&sg, key);
			for (int i = 0; allowed && allowed[i]; i++)
				SuggestConsider(&sg, allowed[i]);
			for (int i = 0; allowed2 && allowed2[i]; i++)
				SuggestConsider(&sg, allowed2[i]);
			add_unknown(vs, psprintf("%s%s%s", path, *path ? "." : "", key), sg.best,
						psprintf("unknown key \"%s\"", key),
						psprintf("; check its spelling (the keys here are %s)",
								 keys_text(allowed, allowed2)));
		}
	}
}

void
ValidateUnknownKeys(ValidateState *vs, Jsonb *obj, const char *path,
					const char *const *allowed, const char *const *allowed2)
{
	unknown_keys(vs, obj, path, allowed, allowed2, NULL);
}

void
ValidateUnknownKeysExcept(ValidateState *vs, Jsonb *obj, const char *path,
						  const char *const *allowed, const char *const *skip)
{
	unknown_keys(vs, obj, path, allowed, NULL, skip);
}

/* A required string field of a mapping. */
char *
ValidateRequireString(ValidateState *vs, Jsonb *obj, const char *key, const char *path,
					  const char *what)
{
	JsonbValue *v = JsonGetField(obj, key);
	char	   *p = psprintf("%s.%s", path, key);

	if (v == NULL)
	{
		ValidateFinding(vs, "error", path, "%s is missing required key \"%s\"", what, key);
		return NULL;
	}
	if (v->type != jbvString || v->val.string.len == 0)
	{
		ValidateFinding(vs, "error", p, "\"%s\" must be a non-empty string, not %s",
						key, ValidateTypeName(v));
		return NULL;
	}
	return pnstrdup(v->val.string.val, v->val.string.len);
}

/* An optional duration field of a mapping. */
void
ValidateDuration(ValidateState *vs, Jsonb *obj, const char *key, const char *path)
{
	JsonbValue *v = JsonGetField(obj, key);
	int			ms;

	if (v && !DurationFromJson(v, &ms))
		ValidateFinding(vs, "error", psprintf("%s.%s", path, key),
						"\"%s\" must be a duration such as 500ms, 10s, 5m or 2d (at most 24 days)", key);
}

/*
 * An object the workflow names (uses.c): it must exist, and be the
 * registering role's or granted to it; the role whose content it is gets
 * pinned under pin_key.  version 0: the newest.
 */
void
ValidateUse(ValidateState *vs, UseKind kind, const char *name, int version, const char *path)
{
	Oid			owner;
	char	   *user;
	char	   *pin_key = UsePinKey(kind, name, version);
	MemoryContext cxt = CurrentMemoryContext;

	SPI_connect();
	owner = UseContentOwner(kind, name, version);
	if (!OidIsValid(owner))
	{
		/*
		 * The suggestion is made in SPI's memory, gone at SPI_finish: the
		 * finding (and register_workflow's hint) keeps a copy.
		 */
		const char *suggestion = UseSuggest(kind, name);

		if (suggestion)
			suggestion = MemoryContextStrdup(cxt, suggestion);
		SPI_finish();
		add_unknown(vs, path, suggestion,
					psprintf("%s \"%s\" does not exist", UseKindWhat(kind), name),
					"; register it before a workflow that names it (another role could register the name and receive what the workflow sends it)");
		return;
	}
	if (!UseAllowed(kind, name, owner, vs->user))
	{
		SPI_finish();
		user = GetUserNameFromId(vs->user, false);
		ValidateFinding(vs, "error", path,
						"%s \"%s\" belongs to role \"%s\", which has not granted its use to role \"%s\"; its owner can run SELECT tuvl.grant_use('%s', '%s', '%s')",
						UseKindWhat(kind), name, GetUserNameFromId(owner, false), user,
						UseKindName(kind), name, user);
		return;
	}
	SPI_finish();
	if (NameIndexAdd(vs->pinned, pin_key, 0))
	{
		JsonObjAddInt(&vs->pins, pin_key, owner);
	}
}

/* An optional text field of a mapping (description, ...). */
void
ValidateText(ValidateState *vs, Jsonb *obj, const char *key, const char *path)
{
	JsonbValue *v = JsonGetField(obj, key);

	if (v && v->type != jbvString)
		ValidateFinding(vs, "error", psprintf("%s.%s", path, key), "%s must be text, not %s",
						key, ValidateTypeName(v));
}

/*
 * obj's name, when present: a mapping (example shows one) of names to
 * values sent as text (headers, a query), each text (a template), a
 * number or a boolean, or null (left out).
 */
void
ValidateScalarMapping(ValidateState *vs, Jsonb *obj, const char *name, const char *path,
					  const char *example)
{
	JsonbValue *map = JsonGetField(obj, name);
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (map == NULL)
		return;
	path = psprintf("%s.%s", path, name);
	if (!ValidateIsMapping(map))
	{
		ValidateFinding(vs, "error", path, "%s must be a mapping such as %s", name, example);
		return;
	}
	it = JsonbIteratorInit(map->val.binary.data);
	while (next_key(&it, &key, &v))
		if (v.type == jbvBinary)
			ValidateFinding(vs, "error", psprintf("%s.%s", path, key),
							"the value of \"%s\" is sent as text: write text (a template), a number, a boolean or null (left out), not %s",
							key, ValidateTypeName(&v));
}

/* No other workflow's newest version serves this trigger.http path. */
static void
check_http_path_free(ValidateState *vs, const char *path)
{
	static const Oid types[2] = {TEXTOID, TEXTOID};
	char	   *name = JsonGetString(vs->definition, "name");
	Datum		d;
	char	   *other = NULL;
	MemoryContext cxt = CurrentMemoryContext;

	SPI_connect();
	if (SecurityExecArgs("SELECT w.name FROM tuvl.workflows w "
						 "WHERE w.definition OPERATOR(pg_catalog.#>>) '{trigger,http,path}' OPERATOR(pg_catalog.=) $1 "
						 "  AND w.name OPERATOR(pg_catalog.<>) $2 "
						 "  AND w.version OPERATOR(pg_catalog.=) (SELECT pg_catalog.max(x.version) FROM tuvl.workflows x "
						 "                                        WHERE x.name OPERATOR(pg_catalog.=) w.name) "
						 "LIMIT 1", SPI_OK_SELECT, 2, types, CStringGetTextDatum(path),
						 CStringGetTextDatum(name ? name : "")) == 1 && SpiValue(1, &d))
		other = MemoryContextStrdup(cxt, TextDatumGetCString(d));	/* past SPI_finish */
	SPI_finish();
	if (other)
		ValidateFinding(vs, "error", "trigger.http.path",
						"path %s is served by workflow \"%s\" already; choose another", path, other);
}

/* Is target the id of a step or an end? */
static bool
is_target(ValidateState *vs, const char *target)
{
	return NameIndexGet(vs->step_ids, target) >= 0 || NameIndexGet(vs->end_ids, target) >= 0;
}

/* The id of a step or an end closest to target, or NULL (suggest.c). */
static const char *
suggest_target(ValidateState *vs, const char *target)
{
	static const char *const lists[] = {"steps", "ends"};
	NameSuggestion sg;

	SuggestInit(&sg, target);
	for (int l = 0; l < (int) lengthof(lists); l++)
	{
		JsonbValue *list = JsonGetField(vs->definition, lists[l]);

		for (int i = 0; ValidateIsList(list) && i < (int) JsonContainerSize(list->val.binary.data); i++)
		{
			JsonbValue *e = getIthJsonbValueFromContainer(list->val.binary.data, i);

			if (ValidateIsMapping(e))
				SuggestConsider(&sg, JsonGetString(JsonValueToJsonb(e), "id"));
		}
	}
	return sg.best;
}

/* A step's routes: a mapping of signals to steps or ends. */
static void
check_routes(ValidateState *vs, Jsonb *step, const char *path)
{
	JsonbValue *routes = JsonGetField(step, "routes");
	JsonbIterator *it;
	JsonbValue	v;
	char	   *signal;
	char	   *rpath = psprintf("%s.routes", path);

	if (routes == NULL)
		return;
	if (!ValidateIsMapping(routes))
	{
		ValidateFinding(vs, "error", rpath,
						"routes must be a mapping of signal to step or end, such as { default: next_step }");
		return;
	}
	it = JsonbIteratorInit(routes->val.binary.data);
	while (next_key(&it, &signal, &v))
	{
		char	   *spath = psprintf("%s.%s", rpath, signal);

		if (v.type != jbvString)
		{
			ValidateFinding(vs, "error", spath,
							"the route for signal \"%s\" must name a step or an end, not %s",
							signal, ValidateTypeName(&v));
			continue;
		}
		else
		{
			char	   *target = pnstrdup(v.val.string.val, v.val.string.len);

			if (!is_target(vs, target))
				add_unknown(vs, spath, suggest_target(vs, target),
							psprintf("route target \"%s\" is neither a step nor an end of this workflow",
									 target), "");
		}
	}
}

/* Is v a string that is one of the options? */
bool
ValidateStringIn(JsonbValue *v, const char *const *options)
{
	if (v == NULL || v->type != jbvString)
		return false;
	return name_in(pnstrdup(v->val.string.val, v->val.string.len), options);
}

/*
 * The number of items of list v; -1, with the finding message at path,
 * when v is not a list.
 */
int
ValidateListLength(ValidateState *vs, JsonbValue *v, const char *path, const char *message)
{
	if (!ValidateIsList(v))
	{
		ValidateFinding(vs, "error", path, "%s", message);
		return -1;
	}
	return (int) JsonContainerSize(v->val.binary.data);
}

/* Is v a whole number from 1 to INT_MAX? */
bool
ValidateIsPositiveInt4(JsonbValue *v)
{
	bool		err = false;
	int32		n;

	if (v == NULL || v->type != jbvNumeric)
		return false;
	if (!DatumGetBool(DirectFunctionCall2(numeric_eq, NumericGetDatum(v->val.numeric),
										  DirectFunctionCall2(numeric_round, NumericGetDatum(v->val.numeric),
															  Int32GetDatum(0)))))
		return false;
	n = numeric_int4_opt_error(v->val.numeric, &err);
	return !err && n >= 1;
}

/* retry: {on: [...], attempts: n, backoff: duration}. */
void
ValidateRetry(ValidateState *vs, Jsonb *parent, const char *path, const char *const *on_values,
			  const char *example)
{
	JsonbValue *r = JsonGetField(parent, "retry");
	char	   *rpath = psprintf("%s.retry", path);
	Jsonb	   *retry;
	JsonbValue *v;

	if (r == NULL)
		return;
	if (!ValidateIsMapping(r))
	{
		ValidateFinding(vs, "error", rpath, "retry must be a mapping such as { on: %s, attempts: 3 }", example);
		return;
	}
	retry = JsonValueToJsonb(r);
	{
		static const char *const retry_keys[] = {"on", "attempts", "backoff", NULL};

		ValidateUnknownKeys(vs, retry, rpath, retry_keys, NULL);
	}
	v = JsonGetField(retry, "attempts");
	if (v && !ValidateIsPositiveInt4(v))
		ValidateFinding(vs, "error", psprintf("%s.attempts", rpath), "attempts must be a positive integer");
	ValidateDuration(vs, retry, "backoff", rpath);
	v = JsonGetField(retry, "on");
	if (v && !ValidateIsList(v))
		ValidateFinding(vs, "error", psprintf("%s.on", rpath), "on must be a list such as %s", example);
	else if (v)
	{
		for (int i = 0; i < (int) JsonContainerSize(v->val.binary.data); i++)
		{
			JsonbValue *e = getIthJsonbValueFromContainer(v->val.binary.data, i);
			char	   *text = e->type == jbvString ? pnstrdup(e->val.string.val, e->val.string.len)
			: e->type == jbvNumeric ? DatumGetCString(DirectFunctionCall1(numeric_out, NumericGetDatum(e->val.numeric)))
			: "";
			bool		ok = name_in(text, on_values);

			if (e->type != jbvString && e->type != jbvNumeric)
				ValidateFinding(vs, "error", psprintf("%s.on[%d]", rpath, i),
								"retry conditions are names such as timeout; use %s", example);
			else if (!ok)
				ValidateFinding(vs, "error", psprintf("%s.on[%d]", rpath, i),
								"unknown retry condition \"%s\"; use %s", text, example);
		}
	}
}

/*
 * The model configs a guardrail's llm_judge checks name must exist, and be
 * the guardrail's owner's or granted to it (uses.c): the guardrail names
 * them, so its owner is who uses them.
 */
static void
check_judge_models(ValidateState *vs, Jsonb *definition, const char *ref, const char *path,
				   Oid guardrail_owner)
{
	Jsonb	   *checks = definition ? JsonGetJsonb(definition, "checks") : NULL;

	for (int i = 0; i < JsonArraySize(checks); i++)
	{
		Jsonb	   *check = JsonArrayAt(checks, i);
		char	   *model = JsonGetString(check, "model");
		Oid			owner;
		bool		allowed = false;

		if (strcmp(JsonGetString(check, "check"), "llm_judge") != 0)
			continue;
		if (model == NULL)
			model = "default";
		/* findings are made outside SPI, whose memory SPI_finish frees */
		SPI_connect();
		owner = UseContentOwner(USE_LLM, model, 0);
		if (OidIsValid(owner))
			allowed = UseAllowed(USE_LLM, model, owner, guardrail_owner);
		SPI_finish();
		if (!OidIsValid(owner))
			ValidateFinding(vs, "error", path,
							"check %d (llm_judge) of guardrail %s asks model \"%s\", which does not exist; register it with tuvl.register_llm() first",
							i + 1, ref, model);
		else if (!allowed)
			ValidateFinding(vs, "error", path,
							"check %d (llm_judge) of guardrail %s asks model \"%s\" of role \"%s\", which has not granted its use to the guardrail's owner \"%s\"",
							i + 1, ref, model, GetUserNameFromId(owner, false),
							GetUserNameFromId(guardrail_owner, false));
	}
}

/*
 * An artifact reference at a site: it must exist (at its pinned version)
 * and have a type the site takes; a floating one is a warning, or an
 * error when strict.  Returns false when v is not a reference.
 */
bool
ValidateArtifactRef(ValidateState *vs, JsonbValue *v, const char *path, ArtifactSite site)
{
	char	   *text;
	char	   *name;
	int			version;
	char	   *type;
	int			latest = 0;
	Jsonb	   *definition = NULL;

	if (v == NULL || v->type != jbvString)
		return false;
	text = pnstrdup(v->val.string.val, v->val.string.len);
	if (!ArtifactParseRef(text, &name, &version))
		return false;
	if (name == NULL)
	{
		ValidateFinding(vs, "error", path,
						"\"%s\" is not a valid artifact reference; write artifact://name or artifact://name@version",
						text);
		return true;
	}
	if (!ArtifactLookup(name, version, &type, NULL, NULL, &latest, &definition, NULL))
	{
		if (version > 0 && latest > 0)
			ValidateFinding(vs, "error", path,
							"artifact \"%s\" has no version %d; its latest version is %d", name, version, latest);
		else
			ValidateFinding(vs, "error", path,
							"artifact \"%s\" does not exist; register it with tuvl.register_artifact()", name);
		return true;
	}
	if (!ArtifactSiteAccepts(site, type))
		ValidateFinding(vs, "error", path, "%s is a %s artifact, but this field takes %s",
						text, type, ArtifactSiteTypes(site));
	if (version == 0)
		ValidateFinding(vs, vs->strict ? "error" : "warning", path,
						"floating artifact reference %s (now version %d); pin it as %s@%d so that new versions cannot change this workflow",
						text, latest, text, latest);
	ValidateUse(vs, USE_ARTIFACT, name, version, path);
	if (site == SITE_GUARDRAIL && strcmp(type, "guardrail") == 0)
	{
		Oid			owner;

		SPI_connect();
		owner = UseContentOwner(USE_ARTIFACT, name, version);
		SPI_finish();
		check_judge_models(vs, definition, text, path, owner);
	}
	return true;
}

/* A list of artifact references (guardrails of a gate, hooks). */
void
ValidateArtifactList(ValidateState *vs, JsonbValue *v, const char *path, ArtifactSite site,
					 const char *what)
{
	int			n;

	if (v == NULL)
		return;
	n = ValidateListLength(vs, v, path, psprintf("%s must be a list of artifact:// references", what));
	for (int i = 0; i < n; i++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(v->val.binary.data, i);
		char	   *epath = psprintf("%s[%d]", path, i);

		if (!ValidateArtifactRef(vs, e, epath, site))
			ValidateFinding(vs, "error", epath, "%s must list only artifact:// references to %s",
							what, ArtifactSiteTypes(site));
	}
}

/* agent.guardrails (or a step's guardrails): {input, output, tools}. */
void
ValidateGuardrails(ValidateState *vs, JsonbValue *g, const char *path, bool autonomous)
{
	static const char *const gates[] = {"input", "output", "tools", NULL};
	Jsonb	   *gj;
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (g == NULL)
		return;
	if (!ValidateIsMapping(g))
	{
		ValidateFinding(vs, "error", path,
						"guardrails must be a mapping of gates such as { input: [artifact://no_pii] }");
		return;
	}
	gj = JsonValueToJsonb(g);
	it = JsonbIteratorInit(&gj->root);
	while (next_key(&it, &key, &v))
	{
		bool		known = name_in(key, gates);

		if (!known)
			ValidateFinding(vs, "error", psprintf("%s.%s", path, key),
							"unknown guardrail gate \"%s\"; use input, output or tools", key);
		else if (strcmp(key, "tools") == 0 && !autonomous)
			ValidateFinding(vs, "error", psprintf("%s.%s", path, key),
							"the tools gate checks tool results, which only mode: autonomous has");
		if (known)
			ValidateArtifactList(vs, &v, psprintf("%s.%s", path, key), SITE_GUARDRAIL, "a guardrail gate");
	}
}

/* The ids of the steps the notify hooks in list (hook references) run. */
static List *
notify_steps_of(JsonbValue *list, List *ids)
{
	for (int i = 0; ValidateIsList(list) && i < (int) JsonContainerSize(list->val.binary.data); i++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(list->val.binary.data, i);
		char	   *name;
		int			version;
		char	   *type;
		Jsonb	   *def = NULL;

		if (e->type == jbvString &&
			ArtifactParseRef(pnstrdup(e->val.string.val, e->val.string.len), &name, &version) &&
			name && ArtifactLookup(name, version, &type, NULL, NULL, NULL, &def, NULL) &&
			strcmp(type, "hook") == 0 && def && JsonGetString(def, "step") &&
			JsonGetString(def, "action") && strcmp(JsonGetString(def, "action"), "notify") == 0)
			ids = lappend(ids, JsonGetString(def, "step"));
	}
	return ids;
}

/*
 * Warn about steps nothing leads to: no route, no implicit next step, not
 * an agent's tool, not a compensator, not a notify hook's step.  Runs on
 * a workflow without errors.
 */
static void
check_reachable(ValidateState *vs, Jsonb *def)
{
	WorkflowDef *wf = WorkflowCompile("validate", 1, def);
	bool	   *seen = palloc0(sizeof(bool) * Max(wf->nsteps, 1));
	int		   *queue = palloc(sizeof(int) * Max(wf->nsteps, 1));
	int			head = 0;
	int			tail = 0;

#define REACH(idx) do { int r_ = (idx); if (r_ >= 0 && !seen[r_]) { seen[r_] = true; queue[tail++] = r_; } } while (0)

	REACH(wf->start);
	/* a notify hook's step runs in a run of its own, and goes nowhere */
	{
		List	   *ids = notify_steps_of(JsonGetField(def, "hooks"), NIL);
		ListCell   *lc;

		for (int i = 0; i < wf->nsteps; i++)
			ids = notify_steps_of(JsonGetField(wf->steps[i].spec, "hooks"), ids);
		foreach(lc, ids)
		{
			if (WorkflowFindStep(wf, lfirst(lc)) >= 0)
				seen[WorkflowFindStep(wf, lfirst(lc))] = true;
		}
	}
	while (head < tail)
	{
		StepDef    *st = &wf->steps[queue[head++]];
		Jsonb	   *agent = JsonGetJsonb(st->spec, "agent");
		char	   *mode = JsonGetString(st->spec, "mode");
		Jsonb	   *tools = agent && JsonIsObject(agent) && mode && strcmp(mode, "autonomous") == 0
		? JsonGetJsonb(agent, "tools") : NULL;
		char	   *comp = JsonGetString(st->spec, "compensate");

		if (st->routes && JsonIsObject(st->routes))
		{
			JsonbIterator *it = JsonbIteratorInit(&st->routes->root);
			JsonbValue	v;
			JsonbIteratorToken tok;

			while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
				if (tok == WJB_VALUE && v.type == jbvString)
					REACH(WorkflowFindStep(wf, pnstrdup(v.val.string.val, v.val.string.len)));
		}
		if (st->routes == NULL || JsonGetField(st->routes, "default") == NULL)
			REACH(st->next);
		if (comp)
			REACH(WorkflowFindStep(wf, comp));
		if (tools && JB_ROOT_IS_ARRAY(tools) && !JB_ROOT_IS_SCALAR(tools))
			for (int t = 0; t < (int) JsonContainerSize(&tools->root); t++)
			{
				JsonbValue *tv = getIthJsonbValueFromContainer(&tools->root, t);
				char	   *ref = tv->type == jbvBinary ? JsonGetString(JsonValueToJsonb(tv), "ref") : NULL;

				if (ref)
					REACH(WorkflowFindStep(wf, ref));
			}
	}
#undef REACH
	for (int i = 0; i < wf->nsteps; i++)
		if (!seen[i])
			ValidateFinding(vs, "warning", psprintf("steps[%d]", i),
							"step \"%s\" is never reached: no route leads to it, no step falls through to it, no agent calls it as a tool and no step names it in compensate",
							wf->steps[i].id);
}

/* The workflow definition being checked. */
Jsonb *
ValidateDefinition(ValidateState *vs)
{
	return vs->definition;
}

/* The step object with this id in the definition, or NULL. */
Jsonb *
ValidateFindStep(ValidateState *vs, const char *id)
{
	JsonbValue *steps = JsonGetField(vs->definition, "steps");
	int			i = NameIndexGet(vs->step_ids, id);
	JsonbValue *sv;

	if (!ValidateIsList(steps) || i < 0)
		return NULL;
	sv = getIthJsonbValueFromContainer(steps->val.binary.data, i);
	return ValidateIsMapping(sv) ? JsonValueToJsonb(sv) : NULL;
}

/* A positive integer field, when present. */
void
ValidatePositiveInt(ValidateState *vs, Jsonb *obj, const char *key, const char *path)
{
	JsonbValue *v = JsonGetField(obj, key);

	if (v == NULL)
		return;
	if (!ValidateIsPositiveInt4(v))
		ValidateFinding(vs, "error", psprintf("%s.%s", path, key),
						"%s must be a positive integer (at most 2147483647)", key);
}

/* key of obj, when present, is a number above 0 (a cost cap). */
void
ValidatePositiveNumber(ValidateState *vs, Jsonb *obj, const char *key, const char *path)
{
	JsonbValue *v = JsonGetField(obj, key);

	if (v == NULL)
		return;
	if (v->type != jbvNumeric ||
		DatumGetFloat8(DirectFunctionCall1(numeric_float8, NumericGetDatum(v->val.numeric))) <= 0)
		ValidateFinding(vs, "error", path ? psprintf("%s.%s", path, key) : pstrdup(key),
						"%s must be a number above 0, in the currency of the model configs' price", key);
}

/* Report what JsonSchemaCheck finds wrong with a schema as errors. */
void
ValidateSchema(ValidateState *vs, Jsonb *schema, const char *path)
{
	ListCell   *lc;

	foreach(lc, JsonSchemaCheck(schema, path))
	{
		JsonSchemaError *e = lfirst(lc);

		ValidateFinding(vs, "error", e->path, "%s", e->message);
	}
}

/*
 * The mapping a step of some kinds must have under key (http, mcp, form):
 * missing says what to write when it is absent or not a mapping; else
 * check checks its contents.
 */
void
ValidateStepMapping(ValidateState *vs, Jsonb *step, const char *path, const char *key,
					void (*check) (ValidateState *vs, Jsonb *obj, const char *path),
					const char *missing)
{
	JsonbValue *v = JsonGetField(step, key);

	if (!ValidateIsMapping(v))
		ValidateFinding(vs, "error", path, "%s", missing);
	else
		check(vs, JsonValueToJsonb(v), psprintf("%s.%s", path, key));
}

/* Top-level concurrency: {key: a template of the input, limit: n}. */
static void
check_concurrency(ValidateState *vs, JsonbValue *v)
{
	static const char *const keys[] = {"key", "limit", NULL};
	Jsonb	   *c;
	JsonbValue *k;

	if (v == NULL)
		return;
	if (!ValidateIsMapping(v))
	{
		ValidateFinding(vs, "error", "concurrency",
						"concurrency must be a mapping, such as { key: \"{{ customer_id }}\", limit: 1 }");
		return;
	}
	c = JsonValueToJsonb(v);
	k = JsonGetField(c, "key");
	if (k == NULL || k->type != jbvString || k->val.string.len == 0)
		ValidateFinding(vs, "error", "concurrency.key",
						"concurrency needs key: a template of the run's input, such as \"{{ customer_id }}\"");
	if (JsonGetField(c, "limit") == NULL)
		ValidateFinding(vs, "error", "concurrency.limit",
						"concurrency needs limit: how many runs of one key may be in flight, such as 1");
	else
		ValidatePositiveInt(vs, c, "limit", "concurrency");
	ValidateUnknownKeys(vs, c, "concurrency", keys, NULL);
}

/*
 * rate_limit (top level, or on an APICall, MCP or Agent step): {key: a
 * template, limit: n, per: a duration}, all three required.  path is
 * where it is ("rate_limit", "steps[2].rate_limit"); what is the key's
 * context, for the messages.
 */
static void
check_rate_limit(ValidateState *vs, JsonbValue *v, const char *path, const char *what)
{
	static const char *const keys[] = {"key", "limit", "per", NULL};
	Jsonb	   *r;
	JsonbValue *k;
	int			ms;

	if (v == NULL)
		return;
	if (!ValidateIsMapping(v))
	{
		ValidateFinding(vs, "error", path,
						"rate_limit must be a mapping, such as { key: \"{{ customer_id }}\", limit: 100, per: 1m }");
		return;
	}
	r = JsonValueToJsonb(v);
	k = JsonGetField(r, "key");
	if (k == NULL || k->type != jbvString || k->val.string.len == 0)
		ValidateFinding(vs, "error", psprintf("%s.key", path),
						"rate_limit needs key: a template of %s, such as \"{{ customer_id }}\" (or a fixed text such as \"all\")",
						what);
	if (JsonGetField(r, "limit") == NULL)
		ValidateFinding(vs, "error", psprintf("%s.limit", path),
						"rate_limit needs limit: how many may go in any window of length per, such as 100");
	else
		ValidatePositiveInt(vs, r, "limit", path);
	v = JsonGetField(r, "per");
	if (v == NULL)
		ValidateFinding(vs, "error", psprintf("%s.per", path),
						"rate_limit needs per: the window's length, such as 1m");
	else if (!DurationFromJson(v, &ms) || ms <= 0)
		ValidateFinding(vs, "error", psprintf("%s.per", path),
						"per must be a positive duration such as 1s, 1m or 1h (at most 24 days)");
	ValidateUnknownKeys(vs, r, path, keys, NULL);
}

/*
 * Kind-specific fields of a step: the kind's own check (its entry of the
 * step table, in the kind's file), then what every kind shares.
 */
static void
check_step_kind(ValidateState *vs, Jsonb *step, StepKind kind, const char *path)
{
	const StepExecutor *ex = ExecutorFor(kind);

	if (ex->validate)
		ex->validate(vs, step, path);
	ValidateDuration(vs, step, "timeout", path);
	if (ex->rate_limited)
		check_rate_limit(vs, JsonGetField(step, "rate_limit"), psprintf("%s.rate_limit", path),
						 "the run's context");
	ValidateUnknownKeys(vs, step, path, step_common_keys, ex->keys);
}

/*
 * trigger.http: the workflow's own route of the HTTP front door (insight/),
 * {path, method, sync_timeout, signature: {secret, header}}.  The path is
 * /[a-z0-9_-]+ segments, and no other workflow's (the newest versions)
 * may serve it.
 */
static void
check_trigger_http(ValidateState *vs, JsonbValue *hv)
{
	static const char *const http_keys[] = {"path", "method", "sync_timeout", "signature", NULL};
	static const char *const signature_keys[] = {"secret", "header", NULL};
	static const char *const methods[] = {"POST", "PUT", "post", "put", NULL};
	Jsonb	   *http;
	char	   *path;
	JsonbValue *v;

	if (hv == NULL)
		return;
	if (!ValidateIsMapping(hv))
	{
		ValidateFinding(vs, "error", "trigger.http",
						"http must be a mapping such as { path: /refunds, sync_timeout: 30s }");
		return;
	}
	http = JsonValueToJsonb(hv);
	ValidateUnknownKeys(vs, http, "trigger.http", http_keys, NULL);
	path = ValidateRequireString(vs, http, "path", "trigger.http", "trigger.http");
	if (path)
	{
		bool		ok = path[0] == '/' && strlen(path) <= 200 && path[strlen(path) - 1] != '/';

		for (const char *c = path; ok && *c; c++)
			ok = (*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_' || *c == '-' ||
				(*c == '/' && c[1] != '/');
		if (!ok)
			ValidateFinding(vs, "error", "trigger.http.path",
							"path must be a route such as /refunds or /shop/refunds: segments of a-z, 0-9, _ and -, served under /hooks");
		else
			check_http_path_free(vs, path);
	}
	v = JsonGetField(http, "method");
	if (v && !ValidateStringIn(v, methods))
		ValidateFinding(vs, "error", "trigger.http.method", "method must be POST (the default) or PUT");
	ValidateDuration(vs, http, "sync_timeout", "trigger.http");
	v = JsonGetField(http, "signature");
	if (v && !ValidateIsMapping(v))
		ValidateFinding(vs, "error", "trigger.http.signature",
						"signature must be a mapping such as { secret: payments_webhook, header: X-Signature }");
	else if (v)
	{
		Jsonb	   *sig = JsonValueToJsonb(v);
		char	   *header = JsonGetString(sig, "header");

		ValidateUnknownKeys(vs, sig, "trigger.http.signature", signature_keys, NULL);
		(void) ValidateRequireString(vs, sig, "secret", "trigger.http.signature", "trigger.http.signature");
		if (JsonGetField(sig, "header") && (header == NULL || !valid_identifier(header, true)))
			ValidateFinding(vs, "error", "trigger.http.signature.header",
							"header must name the request header that carries the signature, such as X-Signature");
	}
}

/* The trigger mapping: input schema, schedule and sync_timeout. */
static void
check_trigger(ValidateState *vs, JsonbValue *tv)
{
	static const char *const trigger_keys[] = {"input", "schedule", "sync_timeout", "catch_up", "http", NULL};
	Jsonb	   *trigger;
	JsonbValue *input;
	JsonbValue *schedule;
	CronSpec	cron;
	char	   *problem = NULL;

	if (!ValidateIsMapping(tv))
	{
		ValidateFinding(vs, "error", "trigger", "trigger must be a mapping, such as { input: {...} }");
		return;
	}
	trigger = JsonValueToJsonb(tv);
	ValidateUnknownKeys(vs, trigger, "trigger", trigger_keys, NULL);
	input = JsonGetField(trigger, "input");
	if (input)
		ValidateSchema(vs, JsonValueToJsonb(input), "trigger.input");
	ValidateDuration(vs, trigger, "sync_timeout", "trigger");
	schedule = JsonGetField(trigger, "schedule");
	if (JsonGetField(trigger, "catch_up"))
	{
		JsonbValue *c = JsonGetField(trigger, "catch_up");
		char	   *text = c->type == jbvNumeric ? JsonValueToText(c) : NULL;

		if (text == NULL || strspn(text, "0123456789") != strlen(text) || strlen(text) > 4 ||
			atoi(text) > 1000)
			ValidateFinding(vs, "error", "trigger.catch_up",
							"catch_up must be how many missed slots to start late, from 0 (none, the default) to 1000");
		else if (schedule == NULL)
			ValidateFinding(vs, "error", "trigger.catch_up", "catch_up needs a schedule");
	}
	check_trigger_http(vs, JsonGetField(trigger, "http"));
	if (schedule && schedule->type != jbvString)
		ValidateFinding(vs, "error", "trigger.schedule",
						"schedule must be a cron expression of five fields (minute hour day-of-month month day-of-week) such as \"*/5 * * * *\", or @hourly, @daily, @weekly, @monthly, @yearly");
	else if (schedule &&
			 !CronParse(pnstrdup(schedule->val.string.val, schedule->val.string.len), &cron, &problem))
		ValidateFinding(vs, "error", "trigger.schedule",
						"%s; schedule must be a cron expression of five fields (minute 0-59, hour 0-23, day of month 1-31, month 1-12, day of week 0-7) such as \"*/5 * * * *\", or @hourly, @daily, @weekly, @monthly, @yearly",
						problem);
	else if (schedule && input && ValidateIsMapping(input))
	{
		JsonbValue *req = JsonGetField(JsonValueToJsonb(input), "required");

		if (ValidateIsList(req) && JsonContainerSize(req->val.binary.data) > 0)
			ValidateFinding(vs, "warning", "trigger.schedule",
							"scheduled runs start with the input {\"_scheduled_at\": <slot>}, which trigger.input refuses (it requires keys); each scheduled start will fail");
	}
}

/* The top-level name, description and trigger. */
static void
check_header(ValidateState *vs, Jsonb *def)
{
	JsonbValue *v = JsonGetField(def, "name");

	if (v == NULL)
		ValidateFinding(vs, "error", "", "the workflow is missing required key \"name\"");
	else if (v->type != jbvString ||
			 !valid_workflow_name(pnstrdup(v->val.string.val, v->val.string.len)))
		ValidateFinding(vs, "error", "name",
						"name must match [a-z_][a-z0-9_]*, such as refund_request");

	v = JsonGetField(def, "description");
	if (v && v->type != jbvString)
		ValidateFinding(vs, "error", "description", "description must be a string");

	v = JsonGetField(def, "trigger");
	if (v)
		check_trigger(vs, v);
}

/*
 * First pass over the steps: each is a mapping with a valid, unique id.
 * The ids are collected so that routes can be checked in any order.
 */
static void
collect_step_ids(ValidateState *vs, JsonbValue *steps, int nsteps)
{
	for (int i = 0; i < nsteps; i++)
	{
		JsonbValue *s = getIthJsonbValueFromContainer(steps->val.binary.data, i);
		char	   *path = psprintf("steps[%d]", i);
		char	   *id;

		CHECK_FOR_INTERRUPTS();
		if (!ValidateIsMapping(s))
		{
			ValidateFinding(vs, "error", path, "a step must be a mapping with id and kind, not %s",
							ValidateTypeName(s));
			continue;
		}
		id = ValidateRequireString(vs, JsonValueToJsonb(s), "id", path, "the step");
		if (id == NULL)
			continue;
		if (!valid_identifier(id, true))
			ValidateFinding(vs, "error", psprintf("%s.id", path),
							"step id \"%s\" must start with a letter or underscore and contain only letters, digits, _ and -",
							id);
		if (!NameIndexAdd(vs->step_ids, id, i))
			ValidateFinding(vs, "error", psprintf("%s.id", path),
							"step id \"%s\" is used twice; step ids must be unique", id);
	}
}

/*
 * The ends: mappings whose ids no step or other end uses, with a status
 * and a rollback flag.  Their ids are collected for route checks.
 */
static void
check_ends(ValidateState *vs, JsonbValue *ends, int nends)
{
	static const char *const end_keys[] = {"id", "status", "response", "rollback", "description", NULL};
	JsonbValue *v;

	for (int i = 0; i < nends; i++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(ends->val.binary.data, i);
		char	   *path = psprintf("ends[%d]", i);
		Jsonb	   *end;
		char	   *id;
		char	   *status;

		if (!ValidateIsMapping(e))
		{
			ValidateFinding(vs, "error", path, "an end must be a mapping such as { id: done, status: completed }");
			continue;
		}
		end = JsonValueToJsonb(e);
		id = ValidateRequireString(vs, end, "id", path, "the end");
		if (id && (NameIndexGet(vs->step_ids, id) >= 0 || !NameIndexAdd(vs->end_ids, id, i)))
			ValidateFinding(vs, "error", psprintf("%s.id", path),
							"end id \"%s\" is already used by a step or another end", id);
		v = JsonGetField(end, "status");
		status = (v && v->type == jbvString) ? pnstrdup(v->val.string.val, v->val.string.len) : NULL;
		if (v && (status == NULL ||
				  (strcmp(status, "completed") != 0 && strcmp(status, "failed") != 0)))
			ValidateFinding(vs, "error", psprintf("%s.status", path),
							"an end's status must be completed or failed");
		ValidateUnknownKeys(vs, end, path, end_keys, NULL);
		ValidateText(vs, end, "description", path);
		v = JsonGetField(end, "rollback");
		if (v && v->type != jbvBool)
			ValidateFinding(vs, "error", psprintf("%s.rollback", path), "rollback must be true or false");
	}
}

/*
 * Second pass over one step (a mapping): its kind and kind-specific
 * fields, output, routes and compensate.
 */
static void
check_step(ValidateState *vs, Jsonb *step, const char *path)
{
	char	   *kind = ValidateRequireString(vs, step, "kind", path, "the step");
	StepKind	k;
	JsonbValue *v;

	if (kind && !WorkflowKindFromName(kind, &k))
	{
		NameSuggestion sg;
		StringInfoData kinds;

		SuggestInit(&sg, kind);
		initStringInfo(&kinds);
		for (int i = 0; i < STEP_KIND_COUNT; i++)
		{
			SuggestConsider(&sg, WorkflowKindNames[i]);
			appendStringInfo(&kinds, "%s%s", i == 0 ? "; use one of " : ", ", WorkflowKindNames[i]);
		}
		add_unknown(vs, psprintf("%s.kind", path), sg.best,
					psprintf("unknown step kind \"%s\"", kind), kinds.data);
	}
	else if (kind)
		check_step_kind(vs, step, k, path);

	v = JsonGetField(step, "output");
	if (v && (v->type != jbvString || v->val.string.len == 0))
		ValidateFinding(vs, "error", psprintf("%s.output", path),
						"output must name the context key the step writes");
	ValidateText(vs, step, "description", path);
	check_routes(vs, step, path);
	v = JsonGetField(step, "compensate");
	if (v && (v->type != jbvString ||
			  NameIndexGet(vs->step_ids, pnstrdup(v->val.string.val, v->val.string.len)) < 0))
		add_unknown(vs, psprintf("%s.compensate", path),
					v->type == jbvString ? suggest_target(vs, pnstrdup(v->val.string.val, v->val.string.len)) : NULL,
					"compensate must name a step of this workflow", "");
}

/* The kind of the step with id, or NULL. */
static char *
kind_of_step(ValidateState *vs, const char *id)
{
	Jsonb	   *s = ValidateFindStep(vs, id);

	return s ? JsonGetString(s, "kind") : NULL;
}

/* A hook list: references to hook artifacts; a notify hook's step is an APICall step here. */
static void
check_hook_list(ValidateState *vs, JsonbValue *v, const char *path, JsonbValue *steps, int nsteps)
{
	ValidateArtifactList(vs, v, path, SITE_HOOK, "hooks");
	for (int i = 0; ValidateIsList(v) && i < (int) JsonContainerSize(v->val.binary.data); i++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(v->val.binary.data, i);
		char	   *name;
		int			version;
		Jsonb	   *def = NULL;
		char	   *type;

		if (e->type != jbvString ||
			!ArtifactParseRef(pnstrdup(e->val.string.val, e->val.string.len), &name, &version) ||
			name == NULL || !ArtifactLookup(name, version, &type, NULL, NULL, NULL, &def, NULL) ||
			strcmp(type, "hook") != 0 || def == NULL)
			continue;
		if (JsonGetString(def, "action") && strcmp(JsonGetString(def, "action"), "notify") == 0)
		{
			char	   *target = JsonGetString(def, "step");
			char	   *kind = target ? kind_of_step(vs, target) : NULL;

			if (kind == NULL)
				ValidateFinding(vs, "error", psprintf("%s[%d]", path, i),
								"notify hook \"%s\" runs step \"%s\", which is not a step of this workflow; add an APICall step with that id",
								name, target ? target : "");
			else if (strcmp(kind, "APICall") != 0)
				ValidateFinding(vs, "error", psprintf("%s[%d]", path, i),
								"notify hook \"%s\" runs step \"%s\", a %s step; a notify hook runs an APICall step",
								name, target, kind);
		}
	}
}

/* One rule of supervisor.rules. */
static void
check_supervisor_rule(ValidateState *vs, JsonbValue *rv, const char *path)
{
	static const char *const rules[] = {"repeated_tool_call", "tool_errors", "tokens_per_turn",
	"wall_time", "iterations", NULL};
	static const char *const actions[] = {"steer", "pause", "abort", NULL};
	static const char *const keys[] = {"rule", "count", "max", "action", "message", NULL};
	Jsonb	   *r;
	char	   *rule;
	char	   *action;
	bool		counted;

	if (!ValidateIsMapping(rv))
	{
		ValidateFinding(vs, "error", path, "a rule must be a mapping such as { rule: tool_errors, count: 3, action: abort }");
		return;
	}
	r = JsonValueToJsonb(rv);
	ValidateUnknownKeys(vs, r, path, keys, NULL);
	rule = ValidateRequireString(vs, r, "rule", path, "a supervisor rule");
	action = ValidateRequireString(vs, r, "action", path, "a supervisor rule");
	if (rule && !name_in(rule, rules))
		ValidateFinding(vs, "error", psprintf("%s.rule", path),
						"rule must be one of %s, not \"%s\"", keys_text(rules, NULL), rule);
	if (action && !name_in(action, actions))
		ValidateFinding(vs, "error", psprintf("%s.action", path),
						"action must be steer, pause or abort, not \"%s\"", action);
	if (JsonGetField(r, "message") &&
		(JsonGetField(r, "message")->type != jbvString || (action && strcmp(action, "steer") != 0)))
		ValidateFinding(vs, "error", psprintf("%s.message", path),
						"message is the text of a steer action: a string, with action: steer");
	if (rule == NULL || !name_in(rule, rules))
		return;
	/* repeated_tool_call and tool_errors count; the others have a maximum */
	counted = strcmp(rule, "repeated_tool_call") == 0 || strcmp(rule, "tool_errors") == 0;
	if (JsonGetField(r, counted ? "max" : "count"))
		ValidateFinding(vs, "error", psprintf("%s.%s", path, counted ? "max" : "count"),
						"rule %s takes %s, not %s", rule, counted ? "count" : "max", counted ? "max" : "count");
	if (JsonGetField(r, counted ? "count" : "max") == NULL)
		ValidateFinding(vs, "error", path, "rule %s needs %s", rule, counted ? "count" : "max");
	else if (strcmp(rule, "wall_time") == 0)
		ValidateDuration(vs, r, "max", path);
	else
		ValidatePositiveInt(vs, r, counted ? "count" : "max", path);
}

/* supervisor.judge: the model, its prompt, its cadence and what an outage means. */
static void
check_supervisor_judge(ValidateState *vs, JsonbValue *jv, const char *path)
{
	static const char *const keys[] = {"model", "prompt", "every", "on_error", NULL};
	Jsonb	   *j;
	JsonbValue *v;
	char	   *model;

	if (!ValidateIsMapping(jv))
	{
		ValidateFinding(vs, "error", path, "judge must be a mapping such as { model: judge, prompt: \"...\", every: 2 }");
		return;
	}
	j = JsonValueToJsonb(jv);
	ValidateUnknownKeys(vs, j, path, keys, NULL);
	model = ValidateRequireString(vs, j, "model", path, "the supervisor's judge");
	if (model)
		ValidateUse(vs, USE_LLM, model, 0, psprintf("%s.model", path));
	v = JsonGetField(j, "prompt");
	if (ValidateRequireString(vs, j, "prompt", path, "the supervisor's judge"))
		(void) ValidateArtifactRef(vs, v, psprintf("%s.prompt", path), SITE_PROMPT);
	ValidatePositiveInt(vs, j, "every", path);
	v = JsonGetField(j, "on_error");
	if (v && (v->type != jbvString ||
			  (strcmp(JsonGetString(j, "on_error"), "pass") != 0 &&
			   strcmp(JsonGetString(j, "on_error"), "abort") != 0)))
		ValidateFinding(vs, "error", psprintf("%s.on_error", path),
						"on_error must be pass (go on when the judge cannot answer) or abort");
}

/* The workflow's supervisor: rules, a judge, or both. */
static void
check_supervisor(ValidateState *vs, JsonbValue *sv)
{
	static const char *const keys[] = {"rules", "judge", NULL};
	Jsonb	   *s;
	JsonbValue *rules;

	if (sv == NULL)
		return;
	if (!ValidateIsMapping(sv))
	{
		ValidateFinding(vs, "error", "supervisor", "supervisor must be a mapping with rules, a judge, or both");
		return;
	}
	s = JsonValueToJsonb(sv);
	ValidateUnknownKeys(vs, s, "supervisor", keys, NULL);
	rules = JsonGetField(s, "rules");
	if (rules == NULL && JsonGetField(s, "judge") == NULL)
		ValidateFinding(vs, "error", "supervisor", "supervisor needs rules, a judge, or both");
	if (rules && (!ValidateIsList(rules) || JsonContainerSize(rules->val.binary.data) == 0))
		ValidateFinding(vs, "error", "supervisor.rules", "rules must be a non-empty list of rules");
	for (int i = 0; rules && ValidateIsList(rules) && i < (int) JsonContainerSize(rules->val.binary.data); i++)
		check_supervisor_rule(vs, getIthJsonbValueFromContainer(rules->val.binary.data, i),
							  psprintf("supervisor.rules[%d]", i));
	if (JsonGetField(s, "judge"))
		check_supervisor_judge(vs, JsonGetField(s, "judge"), "supervisor.judge");
}

/* The hooks of the workflow, then those of each step. */
static void
check_hooks(ValidateState *vs, Jsonb *def, JsonbValue *steps, int nsteps)
{
	check_hook_list(vs, JsonGetField(def, "hooks"), "hooks", steps, nsteps);
	for (int i = 0; i < nsteps; i++)
	{
		JsonbValue *st = getIthJsonbValueFromContainer(steps->val.binary.data, i);

		if (ValidateIsMapping(st))
			check_hook_list(vs, JsonGetField(JsonValueToJsonb(st), "hooks"),
							psprintf("steps[%d].hooks", i), steps, nsteps);
	}
}

/* Add the keys a step may write to the context to known (and tool refs to tools). */
static void
collect_step_writes(Jsonb *step, NameIndex *known, NameIndex *tools)
{
	char	   *id = JsonGetString(step, "id");
	char	   *output = JsonGetString(step, "output");
	Jsonb	   *agent = JsonGetJsonb(step, "agent");
	JsonbValue *list;

	if (id)
		(void) NameIndexAdd(known, psprintf("%s_result", id), 0);
	if (output)
		(void) NameIndexAdd(known, output, 0);
	if (agent == NULL || !JsonIsObject(agent))
		return;
	if (JsonIsObject(JsonGetJsonb(agent, "outcome")))
	{
		Jsonb	   *outcome = JsonGetJsonb(agent, "outcome");

		if (JsonGetString(outcome, "write"))
			(void) NameIndexAdd(known, JsonGetString(outcome, "write"), 0);
		if (JsonGetString(outcome, "output_key"))
			(void) NameIndexAdd(known, JsonGetString(outcome, "output_key"), 0);
	}
	list = JsonGetField(agent, "tools");
	for (int i = 0; ValidateIsList(list) && i < (int) JsonContainerSize(list->val.binary.data); i++)
	{
		JsonbValue *t = getIthJsonbValueFromContainer(list->val.binary.data, i);

		if (ValidateIsMapping(t) && JsonGetString(JsonValueToJsonb(t), "ref"))
			(void) NameIndexAdd(tools, JsonGetString(JsonValueToJsonb(t), "ref"), 0);
	}
}

/* Warn about the placeholders of obj (at path) whose first key nothing provides. */
static void
check_template_keys(ValidateState *vs, Jsonb *obj, const char *path, NameIndex *known,
					JsonbValue *props)
{
	ListCell   *lc;

	foreach(lc, TemplatePlaceholders(obj))
	{
		char	   *tpath = lfirst(lc);
		char	   *first = pnstrdup(tpath, strcspn(tpath, ".["));
		NameSuggestion sg;
		JsonbIterator *it;
		JsonbValue	v;
		char	   *key;

		if (*first == '\0' || *first == '_' || strcmp(first, "secrets") == 0 ||
			strcmp(first, "item") == 0 || NameIndexGet(known, first) >= 0)
			continue;
		SuggestInit(&sg, first);
		it = JsonbIteratorInit(props->val.binary.data);
		while (next_key(&it, &key, &v))
			SuggestConsider(&sg, key);
		ValidateFinding(vs, "warning", path,
						"template \"{{ %s }}\" reads key \"%s\", which is not a property of trigger.input and no step writes, so the step would fail with template_error%s%s%s",
						tpath, first, sg.best ? "; did you mean \"" : "", sg.best ? sg.best : "",
						sg.best ? "\"?" : "");
	}
}

/*
 * Templates that read a key the run's input cannot have: when trigger.input
 * declares properties, each placeholder's first key must be one of them,
 * a key some step writes (its output), private (_x), secrets or item.
 * Warnings only (tuvl.validate): a context can hold more than the schema
 * says.  Steps an agent calls as tools are rendered with the tool call's
 * arguments, and are skipped.  Template syntax is checked at run time; a
 * placeholder that does not parse is left to it.
 */
static void
check_template_inputs(ValidateState *vs, Jsonb *def, JsonbValue *steps, int nsteps,
					  JsonbValue *ends, int nends)
{
	Jsonb	   *trigger = JsonGetJsonb(def, "trigger");
	Jsonb	   *input = trigger && JsonIsObject(trigger) ? JsonGetJsonb(trigger, "input") : NULL;
	JsonbValue *props = input && JsonIsObject(input) ? JsonGetField(input, "properties") : NULL;
	NameIndex  *known = NameIndexCreate(32);
	NameIndex  *tools = NameIndexCreate(8);
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;
	SpiSubxact	sub;

	if (!ValidateIsMapping(props))
		return;
	it = JsonbIteratorInit(props->val.binary.data);
	while (next_key(&it, &key, &v))
		(void) NameIndexAdd(known, key, 0);
	for (int i = 0; i < nsteps; i++)
	{
		JsonbValue *st = getIthJsonbValueFromContainer(steps->val.binary.data, i);

		if (ValidateIsMapping(st))
			collect_step_writes(JsonValueToJsonb(st), known, tools);
	}
	SpiSubxactBegin(&sub);
	PG_TRY();
	{
		for (int i = 0; i < nsteps; i++)
		{
			Jsonb	   *st = JsonValueToJsonb(getIthJsonbValueFromContainer(steps->val.binary.data, i));

			if (JsonGetString(st, "id") == NULL || NameIndexGet(tools, JsonGetString(st, "id")) < 0)
				check_template_keys(vs, st, psprintf("steps[%d]", i), known, props);
		}
		for (int i = 0; i < nends; i++)
			check_template_keys(vs, JsonValueToJsonb(getIthJsonbValueFromContainer(ends->val.binary.data, i)),
								psprintf("ends[%d]", i), known, props);
		SpiSubxactCommit(&sub);
	}
	PG_CATCH();
	{
		(void) SpiSubxactAbortFinding(&sub);
	}
	PG_END_TRY();
}

/*
 * Check a parsed workflow; returns a List of Finding (NIL when clean).
 */
List *
ValidateWorkflow(Jsonb *def, Jsonb *positions, bool strict, Jsonb **refs)
{
	ValidateState vs;
	JsonbValue *v;
	JsonbValue *steps;
	JsonbValue *ends;
	int			nsteps = 0;
	int			nends = 0;

	memset(&vs, 0, sizeof(vs));
	vs.step_ids = NameIndexCreate(64);
	vs.end_ids = NameIndexCreate(8);
	vs.user = GetUserId();
	vs.pinned = NameIndexCreate(8);
	JsonObjStart(&vs.pins);
	vs.positions = positions;
	vs.strict = strict;
	vs.definition = def;

	if (!JsonIsObject(def))
	{
		ValidateFinding(&vs, "error", "", "a workflow must be a YAML mapping with name and steps");
		return vs.findings;
	}
	ValidateUnknownKeys(&vs, def, "", top_level_keys, NULL);
	check_header(&vs, def);

	steps = JsonGetField(def, "steps");
	if (steps == NULL)
		ValidateFinding(&vs, "error", "", "the workflow is missing required key \"steps\"");
	else if (!ValidateIsList(steps) || JsonContainerSize(steps->val.binary.data) == 0)
		ValidateFinding(&vs, "error", "steps", "steps must be a non-empty list of step mappings");
	else
		nsteps = JsonContainerSize(steps->val.binary.data);

	ends = JsonGetField(def, "ends");
	if (ends && !ValidateIsList(ends))
		ValidateFinding(&vs, "error", "ends", "ends must be a list such as - { id: done, status: completed }");
	else if (ends)
		nends = JsonContainerSize(ends->val.binary.data);

	/* First the ids of steps and ends, so routes can name any of them. */
	collect_step_ids(&vs, steps, nsteps);
	check_ends(&vs, ends, nends);
	for (int i = 0; i < nsteps; i++)
	{
		JsonbValue *s = getIthJsonbValueFromContainer(steps->val.binary.data, i);

		CHECK_FOR_INTERRUPTS();
		if (ValidateIsMapping(s))
			check_step(&vs, JsonValueToJsonb(s), psprintf("steps[%d]", i));
	}

	v = JsonGetField(def, "start");
	if (v && (v->type != jbvString ||
			  NameIndexGet(vs.step_ids, pnstrdup(v->val.string.val, v->val.string.len)) < 0))
		add_unknown(&vs, "start",
					v->type == jbvString ? suggest_target(&vs, pnstrdup(v->val.string.val, v->val.string.len)) : NULL,
					"start must name a step of this workflow", "");
	check_hooks(&vs, def, steps, nsteps);
	check_supervisor(&vs, JsonGetField(def, "supervisor"));
	check_concurrency(&vs, JsonGetField(def, "concurrency"));
	ValidatePositiveNumber(&vs, def, "max_cost", NULL);
	check_rate_limit(&vs, JsonGetField(def, "rate_limit"), "rate_limit", "the run's input");
	if (!FindingsHaveErrors(vs.findings) && nsteps > 0)
	{
		check_reachable(&vs, def);
		check_template_inputs(&vs, def, steps, nsteps, ends, nends);
	}
	if (refs)
		*refs = JsonObjEnd(&vs.pins);
	return vs.findings;
}

bool
FindingsHaveErrors(List *findings)
{
	ListCell   *lc;

	foreach(lc, findings)
	{
		if (strcmp(((Finding *) lfirst(lc))->severity, "error") == 0)
			return true;
	}
	return false;
}

/* The name an error finding suggests (the first that does), or NULL. */
const char *
FindingsSuggestion(List *findings)
{
	ListCell   *lc;

	foreach(lc, findings)
	{
		Finding    *f = lfirst(lc);

		if (strcmp(f->severity, "error") == 0 && f->suggestion)
			return f->suggestion;
	}
	return NULL;
}

/* One line per finding of the given severity: "path: message". */
char *
FindingsFormat(List *findings, const char *severity)
{
	StringInfoData buf;
	ListCell   *lc;

	initStringInfo(&buf);
	foreach(lc, findings)
	{
		Finding    *f = lfirst(lc);

		if (strcmp(f->severity, severity) != 0)
			continue;
		if (buf.len > 0)
			appendStringInfoChar(&buf, '\n');
		if (*f->path)
			appendStringInfo(&buf, "%s: %s", f->path, f->message);
		else
			appendStringInfoString(&buf, f->message);
	}
	return buf.data;
}
