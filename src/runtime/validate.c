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

typedef struct ValidateState
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
} ValidateState;

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

/* Keys of agent: removed in 0.1.0, each reported with what replaces it. */
static const char *const agent_keys_removed[] = {"output", "steering_files", NULL};

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
static pg_attribute_printf(4, 5)
void
add_finding(ValidateState *vs, const char *severity, const char *path,
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
		add_finding(vs, "error", path, "%s; did you mean \"%s\"?", head, suggestion);
	else
		add_finding(vs, "error", path, "%s%s", head, tail);
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
static const char *
json_type_name(JsonbValue *v)
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

static bool
is_mapping(JsonbValue *v)
{
	return v && v->type == jbvBinary && JsonContainerIsObject(v->val.binary.data);
}

static bool
is_list(JsonbValue *v)
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
 */
static void
check_unknown_keys(ValidateState *vs, Jsonb *obj, const char *path,
				   const char *const *allowed, const char *const *allowed2)
{
	JsonbIterator *it = JsonbIteratorInit(&obj->root);
	JsonbValue	v;
	char	   *key;

	while (next_key(&it, &key, &v))
	{
		const char *reserved = NULL;

		if (name_in(key, allowed) || name_in(key, allowed2))
			continue;
		for (int i = 0; reserved_keys[i].key; i++)
			if (strcmp(reserved_keys[i].key, key) == 0 &&
				(reserved_keys[i].where == NULL || strcmp(reserved_keys[i].where, path) == 0 ||
				 (strcmp(reserved_keys[i].where, "step") == 0 && is_step_path(path))))
				reserved = reserved_keys[i].message;
		if (reserved)
			add_finding(vs, "error", psprintf("%s%s%s", path, *path ? "." : "", key), "%s", reserved);
		else
		{
			NameSuggestion sg;

			SuggestInit(&sg, key);
			for (int i = 0; allowed && allowed[i]; i++)
				SuggestConsider(&sg, allowed[i]);
			for (int i = 0; allowed2 && allowed2 != agent_keys_removed && allowed2[i]; i++)
				SuggestConsider(&sg, allowed2[i]);
			add_unknown(vs, psprintf("%s%s%s", path, *path ? "." : "", key), sg.best,
						psprintf("unknown key \"%s\"", key),
						psprintf("; check its spelling (the keys here are %s)",
								 keys_text(allowed, allowed2 == agent_keys_removed ? NULL : allowed2)));
		}
	}
}

/* A required string field of a mapping. */
static char *
require_string(ValidateState *vs, Jsonb *obj, const char *key, const char *path,
			   const char *what)
{
	JsonbValue *v = JsonGetField(obj, key);
	char	   *p = psprintf("%s.%s", path, key);

	if (v == NULL)
	{
		add_finding(vs, "error", path, "%s is missing required key \"%s\"", what, key);
		return NULL;
	}
	if (v->type != jbvString || v->val.string.len == 0)
	{
		add_finding(vs, "error", p, "\"%s\" must be a non-empty string, not %s",
					key, json_type_name(v));
		return NULL;
	}
	return pnstrdup(v->val.string.val, v->val.string.len);
}

/* An optional duration field of a mapping. */
static void
check_duration(ValidateState *vs, Jsonb *obj, const char *key, const char *path)
{
	JsonbValue *v = JsonGetField(obj, key);
	int			ms;

	if (v && !DurationFromJson(v, &ms))
		add_finding(vs, "error", psprintf("%s.%s", path, key),
					"\"%s\" must be a duration such as 500ms, 10s, 5m or 2d (at most 24 days)", key);
}

/*
 * An object the workflow names (uses.c): it must exist, and be the
 * registering role's or granted to it; the role whose content it is gets
 * pinned under pin_key.  version 0: the newest.
 */
static void
check_use(ValidateState *vs, UseKind kind, const char *name, int version, const char *path)
{
	Oid			owner;
	char	   *user;
	char	   *pin_key = UsePinKey(kind, name, version);

	SPI_connect();
	owner = UseContentOwner(kind, name, version);
	if (!OidIsValid(owner))
	{
		const char *suggestion = UseSuggest(kind, name);

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
		add_finding(vs, "error", path,
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
static void
check_text(ValidateState *vs, Jsonb *obj, const char *key, const char *path)
{
	JsonbValue *v = JsonGetField(obj, key);

	if (v && v->type != jbvString)
		add_finding(vs, "error", psprintf("%s.%s", path, key), "%s must be text, not %s",
					key, json_type_name(v));
}

/*
 * A mapping of names to values sent as text (headers, a query): each
 * value is text (a template), a number or a boolean, or null (left out).
 */
static void
check_scalar_values(ValidateState *vs, JsonbValue *map, const char *path)
{
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (!is_mapping(map))
		return;
	it = JsonbIteratorInit(map->val.binary.data);
	while (next_key(&it, &key, &v))
		if (v.type == jbvBinary)
			add_finding(vs, "error", psprintf("%s.%s", path, key),
						"the value of \"%s\" is sent as text: write text (a template), a number, a boolean or null (left out), not %s",
						key, json_type_name(&v));
}

/* No other workflow's newest version serves this trigger.http path. */
static void
check_http_path_free(ValidateState *vs, const char *path)
{
	static const Oid types[2] = {TEXTOID, TEXTOID};
	char	   *name = JsonGetString(vs->definition, "name");
	Datum		d;
	char	   *other = NULL;

	SPI_connect();
	if (SecurityExecArgs("SELECT w.name FROM tuvl.workflows w "
						 "WHERE w.definition OPERATOR(pg_catalog.#>>) '{trigger,http,path}' OPERATOR(pg_catalog.=) $1 "
						 "  AND w.name OPERATOR(pg_catalog.<>) $2 "
						 "  AND w.version OPERATOR(pg_catalog.=) (SELECT pg_catalog.max(x.version) FROM tuvl.workflows x "
						 "                                        WHERE x.name OPERATOR(pg_catalog.=) w.name) "
						 "LIMIT 1", SPI_OK_SELECT, 2, types, CStringGetTextDatum(path),
						 CStringGetTextDatum(name ? name : "")) == 1 && SpiValue(1, &d))
		other = TextDatumGetCString(d);
	SPI_finish();
	if (other)
		add_finding(vs, "error", "trigger.http.path",
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

		for (int i = 0; is_list(list) && i < (int) JsonContainerSize(list->val.binary.data); i++)
		{
			JsonbValue *e = getIthJsonbValueFromContainer(list->val.binary.data, i);

			if (is_mapping(e))
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
	if (!is_mapping(routes))
	{
		add_finding(vs, "error", rpath,
					"routes must be a mapping of signal to step or end, such as { default: next_step }");
		return;
	}
	it = JsonbIteratorInit(routes->val.binary.data);
	while (next_key(&it, &signal, &v))
	{
		char	   *spath = psprintf("%s.%s", rpath, signal);

		if (v.type != jbvString)
		{
			add_finding(vs, "error", spath,
						"the route for signal \"%s\" must name a step or an end, not %s",
						signal, json_type_name(&v));
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
static bool
string_in(JsonbValue *v, const char *const *options)
{
	if (v == NULL || v->type != jbvString)
		return false;
	return name_in(pnstrdup(v->val.string.val, v->val.string.len), options);
}

/* Is v a whole number from 1 to INT_MAX? */
static bool
is_positive_int4(JsonbValue *v)
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
static void
check_retry(ValidateState *vs, Jsonb *parent, const char *path, const char *const *on_values,
			const char *example)
{
	JsonbValue *r = JsonGetField(parent, "retry");
	char	   *rpath = psprintf("%s.retry", path);
	Jsonb	   *retry;
	JsonbValue *v;

	if (r == NULL)
		return;
	if (!is_mapping(r))
	{
		add_finding(vs, "error", rpath, "retry must be a mapping such as { on: %s, attempts: 3 }", example);
		return;
	}
	retry = JsonValueToJsonb(r);
	{
		static const char *const retry_keys[] = {"on", "attempts", "backoff", NULL};

		check_unknown_keys(vs, retry, rpath, retry_keys, NULL);
	}
	v = JsonGetField(retry, "attempts");
	if (v && !is_positive_int4(v))
		add_finding(vs, "error", psprintf("%s.attempts", rpath), "attempts must be a positive integer");
	check_duration(vs, retry, "backoff", rpath);
	v = JsonGetField(retry, "on");
	if (v && !is_list(v))
		add_finding(vs, "error", psprintf("%s.on", rpath), "on must be a list such as %s", example);
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
				add_finding(vs, "error", psprintf("%s.on[%d]", rpath, i),
							"retry conditions are names such as timeout; use %s", example);
			else if (!ok)
				add_finding(vs, "error", psprintf("%s.on[%d]", rpath, i),
							"unknown retry condition \"%s\"; use %s", text, example);
		}
	}
}

/* The http mapping of an APICall step. */
static void
check_http_block(ValidateState *vs, Jsonb *http, const char *hpath)
{
	static const char *const methods[] = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS",
	"get", "post", "put", "patch", "delete", "head", "options", NULL};
	static const char *const http_on[] = {"timeout", "error", "429", "5xx", NULL};
	static const char *const idem[] = {"auto", "none", NULL};
	static const char *const bodiless[] = {"GET", "get", "HEAD", "head", NULL};
	static const char *const http_keys[] = {"method", "url", "headers", "query", "body", "timeout",
	"idempotency", "retry", NULL};
	JsonbValue *v;

	check_unknown_keys(vs, http, hpath, http_keys, NULL);
	require_string(vs, http, "url", hpath, "the http mapping");
	check_duration(vs, http, "timeout", hpath);
	v = JsonGetField(http, "method");
	if (v && !string_in(v, methods))
		add_finding(vs, "error", psprintf("%s.method", hpath),
					"method must be one of GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS");
	else if (v && JsonGetField(http, "body") &&
			 string_in(v, bodiless))
		add_finding(vs, "error", psprintf("%s.body", hpath),
					"a GET or HEAD request cannot carry a body; use POST, or move the values to query");
	v = JsonGetField(http, "headers");
	if (v && !is_mapping(v))
		add_finding(vs, "error", psprintf("%s.headers", hpath),
					"headers must be a mapping such as { Content-Type: application/json }");
	check_scalar_values(vs, v, psprintf("%s.headers", hpath));
	v = JsonGetField(http, "query");
	if (v && !is_mapping(v))
		add_finding(vs, "error", psprintf("%s.query", hpath),
					"query must be a mapping such as { q: \"{{ term }}\" }");
	check_scalar_values(vs, v, psprintf("%s.query", hpath));
	v = JsonGetField(http, "idempotency");
	if (v && !string_in(v, idem))
		add_finding(vs, "error", psprintf("%s.idempotency", hpath),
					"idempotency must be auto or none");
	check_retry(vs, http, hpath, http_on, "[timeout, error, 429, 5xx]");
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

		if (strcmp(JsonGetString(check, "check"), "llm_judge") != 0)
			continue;
		if (model == NULL)
			model = "default";
		SPI_connect();
		owner = UseContentOwner(USE_LLM, model, 0);
		if (!OidIsValid(owner))
			add_finding(vs, "error", path,
						"check %d (llm_judge) of guardrail %s asks model \"%s\", which does not exist; register it with tuvl.register_llm() first",
						i + 1, ref, model);
		else if (!UseAllowed(USE_LLM, model, owner, guardrail_owner))
			add_finding(vs, "error", path,
						"check %d (llm_judge) of guardrail %s asks model \"%s\" of role \"%s\", which has not granted its use to the guardrail's owner \"%s\"",
						i + 1, ref, model, GetUserNameFromId(owner, false),
						GetUserNameFromId(guardrail_owner, false));
		SPI_finish();
	}
}

/*
 * An artifact reference at a site: it must exist (at its pinned version)
 * and have a type the site takes; a floating one is a warning, or an
 * error when strict.  Returns false when v is not a reference.
 */
static bool
check_artifact_ref(ValidateState *vs, JsonbValue *v, const char *path, ArtifactSite site)
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
		add_finding(vs, "error", path,
					"\"%s\" is not a valid artifact reference; write artifact://name or artifact://name@version",
					text);
		return true;
	}
	if (!ArtifactLookup(name, version, &type, NULL, NULL, &latest, &definition, NULL))
	{
		if (version > 0 && latest > 0)
			add_finding(vs, "error", path,
						"artifact \"%s\" has no version %d; its latest version is %d", name, version, latest);
		else
			add_finding(vs, "error", path,
						"artifact \"%s\" does not exist; register it with tuvl.register_artifact()", name);
		return true;
	}
	if (!ArtifactSiteAccepts(site, type))
		add_finding(vs, "error", path, "%s is a %s artifact, but this field takes %s",
					text, type, ArtifactSiteTypes(site));
	if (version == 0)
		add_finding(vs, vs->strict ? "error" : "warning", path,
					"floating artifact reference %s (now version %d); pin it as %s@%d so that new versions cannot change this workflow",
					text, latest, text, latest);
	check_use(vs, USE_ARTIFACT, name, version, path);
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
static void
check_artifact_list(ValidateState *vs, JsonbValue *v, const char *path, ArtifactSite site,
					const char *what)
{
	if (v == NULL)
		return;
	if (!is_list(v))
	{
		add_finding(vs, "error", path, "%s must be a list of artifact:// references", what);
		return;
	}
	for (int i = 0; i < (int) JsonContainerSize(v->val.binary.data); i++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(v->val.binary.data, i);
		char	   *epath = psprintf("%s[%d]", path, i);

		if (!check_artifact_ref(vs, e, epath, site))
			add_finding(vs, "error", epath, "%s must list only artifact:// references to %s",
						what, ArtifactSiteTypes(site));
	}
}

/* agent.guardrails (or a step's guardrails): {input, output, tools}. */
static void
check_guardrails(ValidateState *vs, JsonbValue *g, const char *path, bool autonomous)
{
	static const char *const gates[] = {"input", "output", "tools", NULL};
	Jsonb	   *gj;
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (g == NULL)
		return;
	if (!is_mapping(g))
	{
		add_finding(vs, "error", path,
					"guardrails must be a mapping of gates such as { input: [artifact://no_pii] }");
		return;
	}
	gj = JsonValueToJsonb(g);
	it = JsonbIteratorInit(&gj->root);
	while (next_key(&it, &key, &v))
	{
		bool		known = name_in(key, gates);

		if (!known)
			add_finding(vs, "error", psprintf("%s.%s", path, key),
						"unknown guardrail gate \"%s\"; use input, output or tools", key);
		else if (strcmp(key, "tools") == 0 && !autonomous)
			add_finding(vs, "error", psprintf("%s.%s", path, key),
						"the tools gate checks tool results, which only mode: autonomous has");
		if (known)
			check_artifact_list(vs, &v, psprintf("%s.%s", path, key), SITE_GUARDRAIL, "a guardrail gate");
	}
}

/* The ids of the steps the notify hooks in list (hook references) run. */
static List *
notify_steps_of(JsonbValue *list, List *ids)
{
	for (int i = 0; is_list(list) && i < (int) JsonContainerSize(list->val.binary.data); i++)
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
			if (WorkflowFindStep(wf, lfirst(lc)) >= 0)
			seen[WorkflowFindStep(wf, lfirst(lc))] = true;
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
			add_finding(vs, "warning", psprintf("steps[%d]", i),
						"step \"%s\" is never reached: no route leads to it, no step falls through to it, no agent calls it as a tool and no step names it in compensate",
						wf->steps[i].id);
}

/* The step object with this id in the definition, or NULL. */
static Jsonb *
find_step_object(ValidateState *vs, const char *id)
{
	JsonbValue *steps = JsonGetField(vs->definition, "steps");
	int			i = NameIndexGet(vs->step_ids, id);
	JsonbValue *sv;

	if (!is_list(steps) || i < 0)
		return NULL;
	sv = getIthJsonbValueFromContainer(steps->val.binary.data, i);
	return is_mapping(sv) ? JsonValueToJsonb(sv) : NULL;
}

/* A positive integer field, when present. */
static void
check_positive_int(ValidateState *vs, Jsonb *obj, const char *key, const char *path)
{
	JsonbValue *v = JsonGetField(obj, key);

	if (v == NULL)
		return;
	if (!is_positive_int4(v))
		add_finding(vs, "error", psprintf("%s.%s", path, key),
					"%s must be a positive integer (at most 2147483647)", key);
}

/* key of obj, when present, is a number above 0 (a cost cap). */
static void
check_positive_number(ValidateState *vs, Jsonb *obj, const char *key, const char *path)
{
	JsonbValue *v = JsonGetField(obj, key);

	if (v == NULL)
		return;
	if (v->type != jbvNumeric ||
		DatumGetFloat8(DirectFunctionCall1(numeric_float8, NumericGetDatum(v->val.numeric))) <= 0)
		add_finding(vs, "error", path ? psprintf("%s.%s", path, key) : pstrdup(key),
					"%s must be a number above 0, in the currency of the model configs' price", key);
}

/* approval_timeout: a duration, on an entry with approval: true. */
static void
check_approval_timeout(ValidateState *vs, Jsonb *entry, const char *epath)
{
	JsonbValue *v = JsonGetField(entry, "approval_timeout");
	int			ms;

	if (v == NULL)
		return;
	if (!DurationFromJson(v, &ms) || ms <= 0)
		add_finding(vs, "error", psprintf("%s.approval_timeout", epath),
					"approval_timeout must be a duration such as 30m: how long a call waits for tuvl.decide() before it is rejected");
	else if (!JsonGetBool(entry, "approval", false))
		add_finding(vs, "error", psprintf("%s.approval_timeout", epath),
					"approval_timeout needs approval: true");
}

/*
 * A tool entry naming a whole MCP server: {mcp: url, allow: [...],
 * prefix, headers, approval}.  Its tools are those tuvl.mcp_list_tools()
 * listed for the URL, so the URL is written literally.
 */
static void
check_mcp_server_tools(ValidateState *vs, Jsonb *entry, const char *epath)
{
	static const char *const server_keys[] = {"mcp", "allow", "prefix", "headers", "approval",
	"approval_timeout", NULL};
	JsonbValue *v = JsonGetField(entry, "mcp");
	char	   *url;

	check_unknown_keys(vs, entry, epath, server_keys, NULL);
	url = v && v->type == jbvString ? pnstrdup(v->val.string.val, v->val.string.len) : NULL;
	if (url == NULL || (strncmp(url, "http://", 7) != 0 && strncmp(url, "https://", 8) != 0) ||
		strstr(url, "{{") != NULL)
		add_finding(vs, "error", psprintf("%s.mcp", epath),
					"mcp must be the server's URL, written literally, such as \"http://127.0.0.1:3001/mcp\": "
					"the agent is offered the tools tuvl.mcp_list_tools() listed for it");
	v = JsonGetField(entry, "allow");
	if (v)
	{
		bool		ok = is_list(v) && JsonContainerSize(v->val.binary.data) > 0;

		for (int i = 0; ok && i < (int) JsonContainerSize(v->val.binary.data); i++)
		{
			JsonbValue *n = getIthJsonbValueFromContainer(v->val.binary.data, i);

			ok = n->type == jbvString && n->val.string.len > 0;
		}
		if (!ok)
			add_finding(vs, "error", psprintf("%s.allow", epath),
						"allow must be a non-empty list of the server's tool names, such as [echo, get-sum]");
	}
	v = JsonGetField(entry, "prefix");
	if (v)
	{
		bool		ok = v->type == jbvString && v->val.string.len <= 32;

		for (int i = 0; ok && i < v->val.string.len; i++)
			ok = isalnum((unsigned char) v->val.string.val[i]) || v->val.string.val[i] == '_' ||
				v->val.string.val[i] == '-';
		if (!ok)
			add_finding(vs, "error", psprintf("%s.prefix", epath),
						"prefix must be at most 32 letters, digits, _ and -, such as \"docs_\": "
						"it is put before each tool's name");
	}
	v = JsonGetField(entry, "headers");
	if (v && !is_mapping(v))
		add_finding(vs, "error", psprintf("%s.headers", epath),
					"headers must be a mapping such as { Authorization: \"Bearer {{ secrets.mcp_token }}\" }");
	check_scalar_values(vs, v, psprintf("%s.headers", epath));
	v = JsonGetField(entry, "approval");
	if (v && v->type != jbvBool)
		add_finding(vs, "error", psprintf("%s.approval", epath),
					"approval must be true (ask a person before each call) or false");
	check_approval_timeout(vs, entry, epath);
}

/* agent.tools of an autonomous agent. */
static void
check_agent_tools(ValidateState *vs, Jsonb *agent, const char *apath, const char *self)
{
	static const char *const tool_keys[] = {"ref", "description", "parameters", "writes_context",
	"approval", "approval_timeout", NULL};
	JsonbValue *tv = JsonGetField(agent, "tools");
	char	   *tpath = psprintf("%s.tools", apath);

	if (tv == NULL || (is_list(tv) && JsonContainerSize(tv->val.binary.data) == 0))
	{
		add_finding(vs, "error", apath,
					"an autonomous agent needs agent.tools: the steps it may call, as [{ref: step_id}]");
		return;
	}
	if (!is_list(tv))
	{
		add_finding(vs, "error", tpath, "tools must be a list such as [{ref: lookup_order}]");
		return;
	}
	for (int i = 0; i < (int) JsonContainerSize(tv->val.binary.data); i++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(tv->val.binary.data, i);
		char	   *epath = psprintf("%s[%d]", tpath, i);
		Jsonb	   *entry;
		Jsonb	   *target;
		char	   *ref;
		char	   *kind;
		JsonbValue *v;

		if (!is_mapping(e))
		{
			add_finding(vs, "error", epath, "a tool must be a mapping such as {ref: lookup_order}");
			continue;
		}
		entry = JsonValueToJsonb(e);
		if (JsonGetField(entry, "mcp") && JsonGetField(entry, "ref") == NULL)
		{
			check_mcp_server_tools(vs, entry, epath);
			continue;
		}
		check_unknown_keys(vs, entry, epath, tool_keys, NULL);
		check_text(vs, entry, "description", epath);
		ref = JsonGetString(entry, "ref");
		if (ref == NULL)
		{
			add_finding(vs, "error", epath,
						"the tool is missing ref, the id of the step it calls (or mcp, the URL of a server whose tools it may call)");
			continue;
		}
		if (strcmp(ref, self) == 0)
		{
			add_finding(vs, "error", psprintf("%s.ref", epath), "an agent cannot call itself as a tool");
			continue;
		}
		target = find_step_object(vs, ref);
		if (target == NULL)
		{
			add_finding(vs, "error", psprintf("%s.ref", epath),
						"tool \"%s\" is not a step of this workflow", ref);
			continue;
		}
		kind = JsonGetString(target, "kind");
		if (kind && (strcmp(kind, "Agent") == 0 || strcmp(kind, "Human") == 0))
			add_finding(vs, "error", psprintf("%s.ref", epath),
						"step \"%s\" is a%s %s step, which cannot be called as a tool; "
						"tools are Functional, ModelOp, Router, APICall or MCP steps",
						ref, strcmp(kind, "Agent") == 0 ? "n" : "", kind);
		if (JsonGetField(target, "compensate"))
			add_finding(vs, "warning", psprintf("%s.ref", epath),
						"step \"%s\" declares compensate, but a tool call is never compensated; undo its work in another tool the agent can call",
						ref);
		if (JsonGetString(target, "description") == NULL && JsonGetString(entry, "description") == NULL)
			add_finding(vs, "error", epath,
						"tool \"%s\" has no description; give step \"%s\" a description, or the tool entry one, so the model knows what it does",
						ref, ref);
		v = JsonGetField(entry, "parameters");
		if (v && !is_mapping(v))
			add_finding(vs, "error", psprintf("%s.parameters", epath),
						"parameters must be a JSON Schema object such as {type: object, properties: {...}}");
		v = JsonGetField(entry, "writes_context");
		if (v && v->type != jbvBool)
			add_finding(vs, "error", psprintf("%s.writes_context", epath),
						"writes_context must be true or false");
		v = JsonGetField(entry, "approval");
		if (v && v->type != jbvBool)
			add_finding(vs, "error", psprintf("%s.approval", epath),
						"approval must be true (ask a person before each call) or false");
		check_approval_timeout(vs, entry, epath);
	}
}

/* context_injection: a list of public context keys. */
static void
check_context_injection(ValidateState *vs, Jsonb *step, const char *path)
{
	JsonbValue *v = JsonGetField(step, "context_injection");
	char	   *cpath = psprintf("%s.context_injection", path);

	if (v == NULL)
		return;
	if (!is_list(v))
	{
		add_finding(vs, "error", cpath, "context_injection must be a list of context keys");
		return;
	}
	for (int i = 0; i < (int) JsonContainerSize(v->val.binary.data); i++)
	{
		JsonbValue *k = getIthJsonbValueFromContainer(v->val.binary.data, i);

		if (k->type != jbvString || k->val.string.len == 0)
			add_finding(vs, "error", psprintf("%s[%d]", cpath, i), "a context key must be a non-empty string");
		else if (k->val.string.val[0] == '_')
			add_finding(vs, "error", psprintf("%s[%d]", cpath, i),
						"\"%s\" is a private key; private keys are never shown to a model",
						pnstrdup(k->val.string.val, k->val.string.len));
	}
}

/* Keys of the agent mapping: removed ones are errors, unknown ones warnings. */
static void
check_agent_keys(ValidateState *vs, Jsonb *agent, const char *apath)
{
	static const char *const agent_keys[] = {"model", "system", "prompt", "steering", "skills",
		"tools", "outcome", "max_iterations", "max_tool_calls", "token_budget", "guardrails", "retry",
	"max_cost", NULL};
	static const struct
	{
		const char *key;
		const char *instead;
	}			removed[] = {
		{"output", "agent.outcome.write"},
		{"steering_files", "agent.steering (inline text or an artifact:// reference)"},
	};
	Jsonb	   *oc = JsonGetJsonb(agent, "outcome");

	for (int i = 0; i < (int) lengthof(removed); i++)
		if (JsonGetField(agent, removed[i].key))
			add_finding(vs, "error", psprintf("%s.%s", apath, removed[i].key),
						"agent.%s was removed; use %s", removed[i].key, removed[i].instead);
	if (oc && JsonIsObject(oc) && JsonGetField(oc, "output_key"))
		add_finding(vs, "error", psprintf("%s.outcome.output_key", apath),
					"outcome.output_key was removed; use outcome.write");
	if (oc && JsonIsObject(oc) && JsonGetField(oc, "signal_from"))
		add_finding(vs, "error", psprintf("%s.outcome.signal_from", apath),
					"outcome.signal_from was removed; the outcome is the \"outcome\" field of the final answer, one of outcome.enum");
	check_unknown_keys(vs, agent, apath, agent_keys, agent_keys_removed);
}

/*
 * The fields of an autonomous agent: no completion-mode texts, steering,
 * tools, limits, and routes for its reserved exits.
 */
static void
check_autonomous_agent(ValidateState *vs, Jsonb *step, Jsonb *agent, const char *path,
					   const char *apath, Jsonb *routes)
{
	static const char *const exits[] = {"max_iterations", "budget_exceeded", "aborted", NULL};

	if (JsonGetField(agent, "system"))
		add_finding(vs, "error", psprintf("%s.system", apath),
					"system is a completion-mode field; an autonomous agent takes its instructions from agent.steering");
	if (JsonGetField(agent, "prompt"))
		add_finding(vs, "error", psprintf("%s.prompt", apath),
					"prompt is a completion-mode field; an autonomous agent reads the public context instead");
	if (JsonGetField(agent, "steering") == NULL)
		add_finding(vs, "warning", apath,
					"agent.steering is missing; without it the model knows only the context and the tools");
	check_agent_tools(vs, agent, apath, JsonGetString(step, "id") ? JsonGetString(step, "id") : "");
	check_positive_int(vs, agent, "max_iterations", apath);
	check_positive_int(vs, agent, "max_tool_calls", apath);
	check_positive_int(vs, agent, "token_budget", apath);
	check_positive_number(vs, agent, "max_cost", apath);
	for (int i = 0; exits[i]; i++)
		if ((strcmp(exits[i], "budget_exceeded") != 0 || JsonGetField(agent, "token_budget") ||
			 JsonGetField(agent, "max_cost")) &&
			(routes == NULL || JsonGetField(routes, exits[i]) == NULL))
			add_finding(vs, "warning", psprintf("%s.routes", path),
						strcmp(exits[i], "aborted") == 0
						? "the reserved exit \"%s\" has no route: an abort stops the run without a routed exit"
						: "the reserved exit \"%s\" has no route: the run fails if the agent takes it",
						exits[i]);
}

/* An agent text field (steering, system, prompt), when present, is a string. */
static void
check_agent_text(ValidateState *vs, Jsonb *agent, const char *key, const char *apath)
{
	JsonbValue *tv = JsonGetField(agent, key);

	if (tv && tv->type != jbvString)
		add_finding(vs, "error", psprintf("%s.%s", apath, key),
					"%s must be text or an artifact:// reference", key);
}

/* The agent's artifact references: steering, system, prompt and skills. */
static void
check_agent_artifacts(ValidateState *vs, Jsonb *agent, const char *apath)
{
	JsonbValue *sk = JsonGetField(agent, "skills");

	check_agent_text(vs, agent, "steering", apath);
	(void) check_artifact_ref(vs, JsonGetField(agent, "steering"), psprintf("%s.steering", apath),
							  SITE_STEERING);
	(void) check_artifact_ref(vs, JsonGetField(agent, "system"), psprintf("%s.system", apath),
							  SITE_STEERING);
	(void) check_artifact_ref(vs, JsonGetField(agent, "prompt"), psprintf("%s.prompt", apath),
							  SITE_PROMPT);
	if (sk && !is_list(sk))
		add_finding(vs, "error", psprintf("%s.skills", apath),
					"skills must be a list of texts or artifact:// references to skill artifacts");
	else if (sk)
		for (int i = 0; i < (int) JsonContainerSize(sk->val.binary.data); i++)
		{
			JsonbValue *e = getIthJsonbValueFromContainer(sk->val.binary.data, i);

			if (e->type != jbvString)
				add_finding(vs, "error", psprintf("%s.skills[%d]", apath, i),
							"a skill must be text or an artifact:// reference");
			else
				(void) check_artifact_ref(vs, e, psprintf("%s.skills[%d]", apath, i), SITE_SKILL);
		}
}

/* agent.model names a string; one not registered yet is a warning. */
static void
check_agent_model(ValidateState *vs, Jsonb *agent, const char *apath)
{
	JsonbValue *model = JsonGetField(agent, "model");

	if (model == NULL)
		add_finding(vs, "error", apath, "agent.model is missing; name a model given to tuvl.register_llm()");
	else if (model->type != jbvString)
		add_finding(vs, "error", psprintf("%s.model", apath),
					"model must name a model given to tuvl.register_llm()");
	else
		check_use(vs, USE_LLM, JsonGetString(agent, "model"), 0, psprintf("%s.model", apath));
}

/* outcome.enum: names that are not reserved exits, each with a route. */
static void
check_outcome_enum(ValidateState *vs, JsonbValue *e, const char *apath, Jsonb *routes)
{
	static const char *const reserved[] = {"max_iterations", "budget_exceeded", "error", "aborted",
	"guardrail_violation", "default", NULL};

	if (!is_list(e))
	{
		add_finding(vs, "error", psprintf("%s.outcome.enum", apath),
					"outcome.enum must be a list of outcome names");
		return;
	}
	for (int i = 0; i < (int) JsonContainerSize(e->val.binary.data); i++)
	{
		JsonbValue *x = getIthJsonbValueFromContainer(e->val.binary.data, i);
		char	   *epath = psprintf("%s.outcome.enum[%d]", apath, i);
		char	   *name;

		if (x->type != jbvString)
		{
			add_finding(vs, "error", epath, "outcome names must be strings");
			continue;
		}
		name = pnstrdup(x->val.string.val, x->val.string.len);
		if (string_in(x, reserved))
			add_finding(vs, "error", epath,
						"\"%s\" is a reserved exit and cannot be an outcome; choose another name", name);
		else if (routes == NULL || JsonGetField(routes, name) == NULL)
			add_finding(vs, "error", epath,
						"outcome \"%s\" has no route; add routes: { %s: <step or end> }", name, name);
	}
}

/* agent.outcome: a mapping of enum and write. */
static void
check_agent_outcome(ValidateState *vs, Jsonb *agent, const char *apath, Jsonb *routes)
{
	static const char *const outcome_keys[] = {"enum", "write", "output_key", "signal_from", NULL};
	JsonbValue *o = JsonGetField(agent, "outcome");
	Jsonb	   *outcome;
	JsonbValue *e;
	JsonbValue *w;

	if (o == NULL)
		return;
	if (!is_mapping(o))
	{
		add_finding(vs, "error", psprintf("%s.outcome", apath),
					"outcome must be a mapping such as { enum: [approve, reject], write: decision }");
		return;
	}
	outcome = JsonValueToJsonb(o);
	e = JsonGetField(outcome, "enum");
	w = JsonGetField(outcome, "write");
	check_unknown_keys(vs, outcome, psprintf("%s.outcome", apath), outcome_keys, NULL);
	if (w && (w->type != jbvString || w->val.string.len == 0))
		add_finding(vs, "error", psprintf("%s.outcome.write", apath),
					"outcome.write must name the context key the answer is written to");
	if (e)
		check_outcome_enum(vs, e, apath, routes);
}

/* The agent mapping of an Agent step, and the step fields it governs. */
static void
check_agent_block(ValidateState *vs, Jsonb *step, const char *path)
{
	static const char *const agent_on[] = {"timeout", "error", NULL};
	JsonbValue *a = JsonGetField(step, "agent");
	char	   *apath = psprintf("%s.agent", path);
	Jsonb	   *agent;
	char	   *mode = JsonGetString(step, "mode");
	bool		autonomous = mode && strcmp(mode, "autonomous") == 0;
	Jsonb	   *routes = JsonGetJsonb(step, "routes");

	if (!is_mapping(a))
		return;
	agent = JsonValueToJsonb(a);
	check_agent_keys(vs, agent, apath);
	if (autonomous)
		check_autonomous_agent(vs, step, agent, path, apath, routes);
	else
	{
		/* a key tuvl accepts does something: these do only in autonomous mode */
		static const char *const limits[] = {"max_iterations", "token_budget", "max_cost", NULL};

		if (JsonGetField(agent, "tools"))
			add_finding(vs, "error", psprintf("%s.tools", apath),
						"tools are used only by mode: autonomous; remove them from a completion agent");
		for (int i = 0; limits[i]; i++)
			if (JsonGetField(agent, limits[i]))
				add_finding(vs, "error", psprintf("%s.%s", apath, limits[i]),
							"%s bounds the turns of mode: autonomous; a completion agent makes one model call: remove it",
							limits[i]);
	}
	check_context_injection(vs, step, path);
	check_agent_artifacts(vs, agent, apath);
	check_guardrails(vs, JsonGetField(agent, "guardrails"), psprintf("%s.guardrails", apath), autonomous);
	check_guardrails(vs, JsonGetField(step, "guardrails"), psprintf("%s.guardrails", path), autonomous);
	if ((JsonGetField(agent, "guardrails") || JsonGetField(step, "guardrails")) &&
		(routes == NULL || JsonGetField(routes, "guardrail_violation") == NULL))
		add_finding(vs, "warning", psprintf("%s.routes", path),
					"guardrails are attached but \"guardrail_violation\" has no route: the run fails if a check fails");
	if (JsonGetField(step, "output"))
		add_finding(vs, "error", psprintf("%s.output", path),
					"an Agent step writes its answer to agent.outcome.write (default <step id>_result), not to output; move the key there");
	check_agent_model(vs, agent, apath);
	check_agent_text(vs, agent, "system", apath);
	check_agent_text(vs, agent, "prompt", apath);
	if (!autonomous && mode && strcmp(mode, "completion") == 0 && JsonGetField(agent, "prompt") == NULL)
		add_finding(vs, "error", apath, "a completion agent needs agent.prompt, the user message template");
	check_retry(vs, agent, apath, agent_on, "[timeout, error]");
	check_agent_outcome(vs, agent, apath, routes);
}

/* Report what JsonSchemaCheck finds wrong with a schema as errors. */
static void
check_schema(ValidateState *vs, Jsonb *schema, const char *path)
{
	ListCell   *lc;

	foreach(lc, JsonSchemaCheck(schema, path))
	{
		JsonSchemaError *e = lfirst(lc);

		add_finding(vs, "error", e->path, "%s", e->message);
	}
}

/*
 * mcp.auth: { oauth: { grant, client_id, client_secret_secret, scopes } }
 * (docs/mcp.md#oauth).
 */
static void
check_mcp_auth(ValidateState *vs, JsonbValue *auth, const char *path)
{
	static const char *const auth_keys[] = {"oauth", NULL};
	static const char *const oauth_keys[] = {"grant", "client_id", "client_secret_secret", "scopes",
	NULL};
	Jsonb	   *a;
	Jsonb	   *o;
	char	   *opath = psprintf("%s.oauth", path);
	char	   *grant;
	JsonbValue *v;

	if (auth == NULL)
		return;
	if (!is_mapping(auth))
	{
		add_finding(vs, "error", path,
					"auth must be a mapping such as { oauth: { grant: client_credentials, client_id: my-client, client_secret_secret: my_secret } }");
		return;
	}
	a = JsonValueToJsonb(auth);
	check_unknown_keys(vs, a, path, auth_keys, NULL);
	v = JsonGetField(a, "oauth");
	if (!is_mapping(v))
	{
		add_finding(vs, "error", opath,
					"oauth must be a mapping with grant (client_credentials or authorization_code)");
		return;
	}
	o = JsonValueToJsonb(v);
	check_unknown_keys(vs, o, opath, oauth_keys, NULL);
	grant = JsonGetString(o, "grant");
	if (grant == NULL || (strcmp(grant, "client_credentials") != 0 &&
						  strcmp(grant, "authorization_code") != 0))
		add_finding(vs, "error", psprintf("%s.grant", opath),
					"grant must be client_credentials (a server-to-server client with a secret) or "
					"authorization_code (a person connects with tuvl.mcp_connect())");
	else if (strcmp(grant, "client_credentials") == 0 &&
			 (JsonGetString(o, "client_id") == NULL || JsonGetString(o, "client_secret_secret") == NULL))
		add_finding(vs, "error", opath,
					"the client_credentials grant needs client_id and client_secret_secret (the name of a secret holding the client's secret)");
	v = JsonGetField(o, "client_id");
	if (v && (v->type != jbvString || v->val.string.len == 0))
		add_finding(vs, "error", psprintf("%s.client_id", opath), "client_id must be a non-empty string");
	v = JsonGetField(o, "client_secret_secret");
	if (v && (v->type != jbvString || v->val.string.len == 0))
		add_finding(vs, "error", psprintf("%s.client_secret_secret", opath),
					"client_secret_secret must be the name of a secret (tuvl.set_secret())");
	v = JsonGetField(o, "scopes");
	if (v)
	{
		Jsonb	   *sc = JsonValueToJsonb(v);
		bool		ok = JB_ROOT_IS_ARRAY(sc) && !JB_ROOT_IS_SCALAR(sc);

		for (int i = 0; ok && i < (int) JsonContainerSize(&sc->root); i++)
		{
			JsonbValue *e = getIthJsonbValueFromContainer(&sc->root, i);

			ok = e->type == jbvString && e->val.string.len > 0 &&
				memchr(e->val.string.val, ' ', e->val.string.len) == NULL;
		}
		if (!ok)
			add_finding(vs, "error", psprintf("%s.scopes", opath),
						"scopes must be a list of scope names such as [mcp:read, mcp:write]");
	}
}

/* The mcp mapping of an MCP step. */
static void
check_mcp_block(ValidateState *vs, Jsonb *mcp, const char *mpath)
{
	static const char *const mcp_keys[] = {"url", "tool", "arguments", "timeout", "headers",
	"elicitation", "elicitation_timeout", "auth", NULL};
	JsonbValue *args;
	JsonbValue *elicit;

	check_unknown_keys(vs, mcp, mpath, mcp_keys, NULL);
	elicit = JsonGetField(mcp, "elicitation");
	if (elicit && (elicit->type != jbvString ||
				   !((elicit->val.string.len == 3 &&
					  strncmp(elicit->val.string.val, "ask", 3) == 0) ||
					 (elicit->val.string.len == 15 &&
					  strncmp(elicit->val.string.val, "accept_defaults", 15) == 0) ||
					 (elicit->val.string.len == 7 &&
					  strncmp(elicit->val.string.val, "decline", 7) == 0))))
		add_finding(vs, "error", psprintf("%s.elicitation", mpath),
					"elicitation must be ask (the run waits for a person's answer, tuvl.submit() or "
					"tuvl.reject()), accept_defaults (answer the server's questions with the "
					"defaults of its schema) or decline");
	check_duration(vs, mcp, "elicitation_timeout", mpath);
	if (JsonGetField(mcp, "headers") && !is_mapping(JsonGetField(mcp, "headers")))
		add_finding(vs, "error", psprintf("%s.headers", mpath),
					"headers must be a mapping such as { Authorization: \"Bearer {{ secrets.mcp_token }}\" }");
	check_scalar_values(vs, JsonGetField(mcp, "headers"), psprintf("%s.headers", mpath));
	check_mcp_auth(vs, JsonGetField(mcp, "auth"), psprintf("%s.auth", mpath));
	require_string(vs, mcp, "url", mpath, "the mcp mapping");
	require_string(vs, mcp, "tool", mpath, "the mcp mapping");
	check_duration(vs, mcp, "timeout", mpath);
	args = JsonGetField(mcp, "arguments");
	if (args && !is_mapping(args) && args->type != jbvString)
		add_finding(vs, "error", psprintf("%s.arguments", mpath),
					"arguments must be a mapping of the tool's parameters, or one template such as \"{{ args }}\"");
}

/*
 * The mapping a step of some kinds must have under key (http, mcp, form):
 * missing says what to write when it is absent or not a mapping; else
 * check checks its contents.
 */
static void
check_step_mapping(ValidateState *vs, Jsonb *step, const char *path, const char *key,
				   void (*check) (ValidateState *vs, Jsonb *obj, const char *path),
				   const char *missing)
{
	JsonbValue *v = JsonGetField(step, key);

	if (!is_mapping(v))
		add_finding(vs, "error", path, "%s", missing);
	else
		check(vs, JsonValueToJsonb(v), psprintf("%s.%s", path, key));
}

/*
 * A Sleep step: for (a duration, also in days: 2d) or until (a timestamp
 * template), exactly one; it writes no output.
 */
static void
check_sleep(ValidateState *vs, Jsonb *step, const char *path)
{
	JsonbValue *f = JsonGetField(step, "for");
	JsonbValue *u = JsonGetField(step, "until");
	int64		ms;

	if ((f == NULL) == (u == NULL))
		add_finding(vs, "error", path,
					"a Sleep step needs for: a duration such as 10m, or until: a time such as \"{{ remind_at }}\" (one of the two)");
	if (f)
	{
		char	   *text = f->type == jbvString ? pnstrdup(f->val.string.val, f->val.string.len) :
		f->type == jbvNumeric ? JsonValueToText(f) : NULL;

		if (text == NULL || !DurationParseLong(text, &ms))
			add_finding(vs, "error", psprintf("%s.for", path),
						"for must be a duration such as 30s, 10m, 2h or 3d");
	}
	if (u && u->type != jbvString)
		add_finding(vs, "error", psprintf("%s.until", path),
					"until must be a time, such as \"2026-12-24 09:00+01\" or \"{{ remind_at }}\"");
	if (JsonGetField(step, "output"))
		add_finding(vs, "error", psprintf("%s.output", path), "a Sleep step writes no output");
}

/*
 * A Workflow step: workflow (a name), input (a mapping of templates),
 * for_each (a template naming a list) and max_parallel (with for_each).
 * Its wait for the children is no step time: timeout is refused.
 */
static void
check_workflow_step(ValidateState *vs, Jsonb *step, const char *path)
{
	JsonbValue *v;
	char	   *child;
	char	   *own;

	child = require_string(vs, step, "workflow", path, "a Workflow step");
	own = JsonGetString(vs->definition, "name");
	/* a workflow that starts itself names its own version to be */
	if (child && (own == NULL || strcmp(child, own) != 0))
		check_use(vs, USE_WORKFLOW, child, is_positive_int4(JsonGetField(step, "version")) ?
				  (int) JsonGetInt(step, "version", 0) : 0, psprintf("%s.workflow", path));
	v = JsonGetField(step, "input");
	if (v && !is_mapping(v))
		add_finding(vs, "error", psprintf("%s.input", path),
					"input must be a mapping: the child run's input, such as { order_id: \"{{ item.id }}\" }");
	v = JsonGetField(step, "for_each");
	if (v && (v->type != jbvString || !TemplateHasPlaceholders(pnstrdup(v->val.string.val, v->val.string.len))))
		add_finding(vs, "error", psprintf("%s.for_each", path),
					"for_each must be a template naming a list, such as \"{{ orders }}\"");
	check_positive_int(vs, step, "max_parallel", path);
	if (JsonGetField(step, "max_parallel") && v == NULL)
		add_finding(vs, "error", psprintf("%s.max_parallel", path),
					"max_parallel bounds a for_each fan-out; this step starts one child");
	check_positive_int(vs, step, "version", path);
	if (JsonGetField(step, "compensate"))
		add_finding(vs, "error", psprintf("%s.compensate", path),
					"a Workflow step takes no compensate: when the run compensates, its children compensate their own completed steps; give the child workflow's steps compensators");
	if (JsonGetField(step, "timeout"))
		add_finding(vs, "error", psprintf("%s.timeout", path),
					"a Workflow step takes no timeout: waiting for children is no step time; give the child workflow's steps timeouts, or abort the parent");
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
	if (!is_mapping(v))
	{
		add_finding(vs, "error", "concurrency",
					"concurrency must be a mapping, such as { key: \"{{ customer_id }}\", limit: 1 }");
		return;
	}
	c = JsonValueToJsonb(v);
	k = JsonGetField(c, "key");
	if (k == NULL || k->type != jbvString || k->val.string.len == 0)
		add_finding(vs, "error", "concurrency.key",
					"concurrency needs key: a template of the run's input, such as \"{{ customer_id }}\"");
	if (JsonGetField(c, "limit") == NULL)
		add_finding(vs, "error", "concurrency.limit",
					"concurrency needs limit: how many runs of one key may be in flight, such as 1");
	else
		check_positive_int(vs, c, "limit", "concurrency");
	check_unknown_keys(vs, c, "concurrency", keys, NULL);
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
	if (!is_mapping(v))
	{
		add_finding(vs, "error", path,
					"rate_limit must be a mapping, such as { key: \"{{ customer_id }}\", limit: 100, per: 1m }");
		return;
	}
	r = JsonValueToJsonb(v);
	k = JsonGetField(r, "key");
	if (k == NULL || k->type != jbvString || k->val.string.len == 0)
		add_finding(vs, "error", psprintf("%s.key", path),
					"rate_limit needs key: a template of %s, such as \"{{ customer_id }}\" (or a fixed text such as \"all\")",
					what);
	if (JsonGetField(r, "limit") == NULL)
		add_finding(vs, "error", psprintf("%s.limit", path),
					"rate_limit needs limit: how many may go in any window of length per, such as 100");
	else
		check_positive_int(vs, r, "limit", path);
	v = JsonGetField(r, "per");
	if (v == NULL)
		add_finding(vs, "error", psprintf("%s.per", path),
					"rate_limit needs per: the window's length, such as 1m");
	else if (!DurationFromJson(v, &ms) || ms <= 0)
		add_finding(vs, "error", psprintf("%s.per", path),
					"per must be a positive duration such as 1s, 1m or 1h (at most 24 days)");
	check_unknown_keys(vs, r, path, keys, NULL);
}

/* Kind-specific fields of a step. */
static void
check_step_kind(ValidateState *vs, Jsonb *step, StepKind kind, const char *path)
{
	static const char *const functional_keys[] = {"function", NULL};
	static const char *const agent_modes[] = {"completion", "autonomous", NULL};
	static const char *const modelop_keys[] = {"sql", "params", NULL};
	static const char *const router_keys[] = {"on", NULL};
	static const char *const apicall_keys[] = {"http", "rate_limit", NULL};
	static const char *const mcp_keys[] = {"mcp", "rate_limit", NULL};
	static const char *const agent_keys[] = {"mode", "agent", "guardrails", "rate_limit", NULL};
	static const char *const human_keys[] = {"form", NULL};
	static const char *const sleep_keys[] = {"for", "until", NULL};
	static const char *const workflow_keys[] = {"workflow", "input", "for_each", "max_parallel",
	"version", NULL};
	const char *const *extra = NULL;
	JsonbValue *v;

	switch (kind)
	{
		case STEP_FUNCTIONAL:
			extra = functional_keys;
			require_string(vs, step, "function", path, "a Functional step");
			break;
		case STEP_MODELOP:
			extra = modelop_keys;
			require_string(vs, step, "sql", path, "a ModelOp step");
			v = JsonGetField(step, "params");
			if (v && !is_list(v))
				add_finding(vs, "error", psprintf("%s.params", path),
							"params must be a list of values or templates, such as [\"{{ order_id }}\"]");
			break;
		case STEP_ROUTER:
			extra = router_keys;
			if (JsonGetField(step, "on") == NULL)
				add_finding(vs, "error", path,
							"a Router step is missing required key \"on\"; write on: \"{{ some.key }}\"");
			else if (JsonGetField(step, "on")->type != jbvString)
				add_finding(vs, "error", psprintf("%s.on", path),
							"on must be a template whose value is the signal, such as \"{{ order.status }}\"");
			if (JsonGetField(step, "routes") == NULL)
				add_finding(vs, "error", path,
							"a Router step needs routes mapping each value of \"on\" to a step or an end");
			break;
		case STEP_APICALL:
			extra = apicall_keys;
			check_step_mapping(vs, step, path, "http", check_http_block,
							   "an APICall step needs an http mapping with at least a url");
			break;
		case STEP_MCP:
			extra = mcp_keys;
			check_step_mapping(vs, step, path, "mcp", check_mcp_block,
							   "an MCP step needs an mcp mapping with url and tool");
			break;
		case STEP_AGENT:
			extra = agent_keys;
			v = JsonGetField(step, "mode");
			if (v == NULL)
				add_finding(vs, "error", path,
							"an Agent step needs mode: completion or mode: autonomous");
			else if (!string_in(v, agent_modes))
				add_finding(vs, "error", psprintf("%s.mode", path),
							"mode must be completion or autonomous");
			if (!is_mapping(JsonGetField(step, "agent")))
				add_finding(vs, "error", path,
							"an Agent step needs an agent mapping with at least a model");
			else
				check_agent_block(vs, step, path);
			break;
		case STEP_HUMAN:
			extra = human_keys;
			if (JsonGetField(step, "timeout") &&
				(JsonGetField(step, "routes") == NULL || !is_mapping(JsonGetField(step, "routes")) ||
				 JsonGetField(JsonGetJsonb(step, "routes"), "timeout") == NULL))
				add_finding(vs, "error", psprintf("%s.routes", path),
							"a Human step with a timeout needs routes.timeout: where the run goes when nobody answered in time");
			check_step_mapping(vs, step, path, "form", check_schema,
							   "a Human step needs a form: a JSON Schema of the data people submit");
			break;
		case STEP_SLEEP:
			extra = sleep_keys;
			check_sleep(vs, step, path);
			break;
		case STEP_WORKFLOW:
			extra = workflow_keys;
			check_workflow_step(vs, step, path);
			break;
		default:
			break;
	}
	check_duration(vs, step, "timeout", path);
	if (kind == STEP_APICALL || kind == STEP_MCP || kind == STEP_AGENT)
		check_rate_limit(vs, JsonGetField(step, "rate_limit"), psprintf("%s.rate_limit", path),
						 "the run's context");
	check_unknown_keys(vs, step, path, step_common_keys, extra);
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
	if (!is_mapping(hv))
	{
		add_finding(vs, "error", "trigger.http",
					"http must be a mapping such as { path: /refunds, sync_timeout: 30s }");
		return;
	}
	http = JsonValueToJsonb(hv);
	check_unknown_keys(vs, http, "trigger.http", http_keys, NULL);
	path = require_string(vs, http, "path", "trigger.http", "trigger.http");
	if (path)
	{
		bool		ok = path[0] == '/' && strlen(path) <= 200 && path[strlen(path) - 1] != '/';

		for (const char *c = path; ok && *c; c++)
			ok = (*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_' || *c == '-' ||
				(*c == '/' && c[1] != '/');
		if (!ok)
			add_finding(vs, "error", "trigger.http.path",
						"path must be a route such as /refunds or /shop/refunds: segments of a-z, 0-9, _ and -, served under /hooks");
		else
			check_http_path_free(vs, path);
	}
	v = JsonGetField(http, "method");
	if (v && !string_in(v, methods))
		add_finding(vs, "error", "trigger.http.method", "method must be POST (the default) or PUT");
	check_duration(vs, http, "sync_timeout", "trigger.http");
	v = JsonGetField(http, "signature");
	if (v && !is_mapping(v))
		add_finding(vs, "error", "trigger.http.signature",
					"signature must be a mapping such as { secret: payments_webhook, header: X-Signature }");
	else if (v)
	{
		Jsonb	   *sig = JsonValueToJsonb(v);
		char	   *header = JsonGetString(sig, "header");

		check_unknown_keys(vs, sig, "trigger.http.signature", signature_keys, NULL);
		(void) require_string(vs, sig, "secret", "trigger.http.signature", "trigger.http.signature");
		if (JsonGetField(sig, "header") && (header == NULL || !valid_identifier(header, true)))
			add_finding(vs, "error", "trigger.http.signature.header",
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

	if (!is_mapping(tv))
	{
		add_finding(vs, "error", "trigger", "trigger must be a mapping, such as { input: {...} }");
		return;
	}
	trigger = JsonValueToJsonb(tv);
	check_unknown_keys(vs, trigger, "trigger", trigger_keys, NULL);
	input = JsonGetField(trigger, "input");
	if (input)
		check_schema(vs, JsonValueToJsonb(input), "trigger.input");
	check_duration(vs, trigger, "sync_timeout", "trigger");
	schedule = JsonGetField(trigger, "schedule");
	if (JsonGetField(trigger, "catch_up"))
	{
		JsonbValue *c = JsonGetField(trigger, "catch_up");
		char	   *text = c->type == jbvNumeric ? JsonValueToText(c) : NULL;

		if (text == NULL || strspn(text, "0123456789") != strlen(text) || strlen(text) > 4 ||
			atoi(text) > 1000)
			add_finding(vs, "error", "trigger.catch_up",
						"catch_up must be how many missed slots to start late, from 0 (none, the default) to 1000");
		else if (schedule == NULL)
			add_finding(vs, "error", "trigger.catch_up", "catch_up needs a schedule");
	}
	check_trigger_http(vs, JsonGetField(trigger, "http"));
	if (schedule && schedule->type != jbvString)
		add_finding(vs, "error", "trigger.schedule",
					"schedule must be a cron expression of five fields (minute hour day-of-month month day-of-week) such as \"*/5 * * * *\", or @hourly, @daily, @weekly, @monthly, @yearly");
	else if (schedule &&
			 !CronParse(pnstrdup(schedule->val.string.val, schedule->val.string.len), &cron, &problem))
		add_finding(vs, "error", "trigger.schedule",
					"%s; schedule must be a cron expression of five fields (minute 0-59, hour 0-23, day of month 1-31, month 1-12, day of week 0-7) such as \"*/5 * * * *\", or @hourly, @daily, @weekly, @monthly, @yearly",
					problem);
	else if (schedule && input && is_mapping(input))
	{
		JsonbValue *req = JsonGetField(JsonValueToJsonb(input), "required");

		if (is_list(req) && JsonContainerSize(req->val.binary.data) > 0)
			add_finding(vs, "warning", "trigger.schedule",
						"scheduled runs start with the input {\"_scheduled_at\": <slot>}, which trigger.input refuses (it requires keys); each scheduled start will fail");
	}
}

/* The top-level name, description and trigger. */
static void
check_header(ValidateState *vs, Jsonb *def)
{
	JsonbValue *v = JsonGetField(def, "name");

	if (v == NULL)
		add_finding(vs, "error", "", "the workflow is missing required key \"name\"");
	else if (v->type != jbvString ||
			 !valid_workflow_name(pnstrdup(v->val.string.val, v->val.string.len)))
		add_finding(vs, "error", "name",
					"name must match [a-z_][a-z0-9_]*, such as refund_request");

	v = JsonGetField(def, "description");
	if (v && v->type != jbvString)
		add_finding(vs, "error", "description", "description must be a string");

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
		if (!is_mapping(s))
		{
			add_finding(vs, "error", path, "a step must be a mapping with id and kind, not %s",
						json_type_name(s));
			continue;
		}
		id = require_string(vs, JsonValueToJsonb(s), "id", path, "the step");
		if (id == NULL)
			continue;
		if (!valid_identifier(id, true))
			add_finding(vs, "error", psprintf("%s.id", path),
						"step id \"%s\" must start with a letter or underscore and contain only letters, digits, _ and -",
						id);
		if (!NameIndexAdd(vs->step_ids, id, i))
			add_finding(vs, "error", psprintf("%s.id", path),
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

		if (!is_mapping(e))
		{
			add_finding(vs, "error", path, "an end must be a mapping such as { id: done, status: completed }");
			continue;
		}
		end = JsonValueToJsonb(e);
		id = require_string(vs, end, "id", path, "the end");
		if (id && (NameIndexGet(vs->step_ids, id) >= 0 || !NameIndexAdd(vs->end_ids, id, i)))
			add_finding(vs, "error", psprintf("%s.id", path),
						"end id \"%s\" is already used by a step or another end", id);
		v = JsonGetField(end, "status");
		status = (v && v->type == jbvString) ? pnstrdup(v->val.string.val, v->val.string.len) : NULL;
		if (v && (status == NULL ||
				  (strcmp(status, "completed") != 0 && strcmp(status, "failed") != 0)))
			add_finding(vs, "error", psprintf("%s.status", path),
						"an end's status must be completed or failed");
		check_unknown_keys(vs, end, path, end_keys, NULL);
		check_text(vs, end, "description", path);
		v = JsonGetField(end, "rollback");
		if (v && v->type != jbvBool)
			add_finding(vs, "error", psprintf("%s.rollback", path), "rollback must be true or false");
	}
}

/*
 * Second pass over one step (a mapping): its kind and kind-specific
 * fields, output, routes and compensate.
 */
static void
check_step(ValidateState *vs, Jsonb *step, const char *path)
{
	char	   *kind = require_string(vs, step, "kind", path, "the step");
	StepKind	k;
	JsonbValue *v;

	if (kind && !StepKindFromName(kind, &k))
	{
		NameSuggestion sg;

		SuggestInit(&sg, kind);
		for (int i = 0; i < STEP_KIND_COUNT; i++)
			SuggestConsider(&sg, StepKindNames[i]);
		add_unknown(vs, psprintf("%s.kind", path), sg.best,
					psprintf("unknown step kind \"%s\"", kind),
					"; use one of Functional, ModelOp, Router, APICall, MCP, Agent, Human, Sleep, Workflow");
	}
	else if (kind)
		check_step_kind(vs, step, k, path);

	v = JsonGetField(step, "output");
	if (v && (v->type != jbvString || v->val.string.len == 0))
		add_finding(vs, "error", psprintf("%s.output", path),
					"output must name the context key the step writes");
	check_text(vs, step, "description", path);
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
	Jsonb	   *s = find_step_object(vs, id);

	return s ? JsonGetString(s, "kind") : NULL;
}

/* A hook list: references to hook artifacts; a notify hook's step is an APICall step here. */
static void
check_hook_list(ValidateState *vs, JsonbValue *v, const char *path, JsonbValue *steps, int nsteps)
{
	check_artifact_list(vs, v, path, SITE_HOOK, "hooks");
	for (int i = 0; is_list(v) && i < (int) JsonContainerSize(v->val.binary.data); i++)
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
				add_finding(vs, "error", psprintf("%s[%d]", path, i),
							"notify hook \"%s\" runs step \"%s\", which is not a step of this workflow; add an APICall step with that id",
							name, target ? target : "");
			else if (strcmp(kind, "APICall") != 0)
				add_finding(vs, "error", psprintf("%s[%d]", path, i),
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

	if (!is_mapping(rv))
	{
		add_finding(vs, "error", path, "a rule must be a mapping such as { rule: tool_errors, count: 3, action: abort }");
		return;
	}
	r = JsonValueToJsonb(rv);
	check_unknown_keys(vs, r, path, keys, NULL);
	rule = require_string(vs, r, "rule", path, "a supervisor rule");
	action = require_string(vs, r, "action", path, "a supervisor rule");
	if (rule && !name_in(rule, rules))
		add_finding(vs, "error", psprintf("%s.rule", path),
					"rule must be one of %s, not \"%s\"", keys_text(rules, NULL), rule);
	if (action && !name_in(action, actions))
		add_finding(vs, "error", psprintf("%s.action", path),
					"action must be steer, pause or abort, not \"%s\"", action);
	if (JsonGetField(r, "message") &&
		(JsonGetField(r, "message")->type != jbvString || (action && strcmp(action, "steer") != 0)))
		add_finding(vs, "error", psprintf("%s.message", path),
					"message is the text of a steer action: a string, with action: steer");
	if (rule == NULL || !name_in(rule, rules))
		return;
	/* repeated_tool_call and tool_errors count; the others have a maximum */
	counted = strcmp(rule, "repeated_tool_call") == 0 || strcmp(rule, "tool_errors") == 0;
	if (JsonGetField(r, counted ? "max" : "count"))
		add_finding(vs, "error", psprintf("%s.%s", path, counted ? "max" : "count"),
					"rule %s takes %s, not %s", rule, counted ? "count" : "max", counted ? "max" : "count");
	if (JsonGetField(r, counted ? "count" : "max") == NULL)
		add_finding(vs, "error", path, "rule %s needs %s", rule, counted ? "count" : "max");
	else if (strcmp(rule, "wall_time") == 0)
		check_duration(vs, r, "max", path);
	else
		check_positive_int(vs, r, counted ? "count" : "max", path);
}

/* supervisor.judge: the model, its prompt, its cadence and what an outage means. */
static void
check_supervisor_judge(ValidateState *vs, JsonbValue *jv, const char *path)
{
	static const char *const keys[] = {"model", "prompt", "every", "on_error", NULL};
	Jsonb	   *j;
	JsonbValue *v;
	char	   *model;

	if (!is_mapping(jv))
	{
		add_finding(vs, "error", path, "judge must be a mapping such as { model: judge, prompt: \"...\", every: 2 }");
		return;
	}
	j = JsonValueToJsonb(jv);
	check_unknown_keys(vs, j, path, keys, NULL);
	model = require_string(vs, j, "model", path, "the supervisor's judge");
	if (model)
		check_use(vs, USE_LLM, model, 0, psprintf("%s.model", path));
	v = JsonGetField(j, "prompt");
	if (require_string(vs, j, "prompt", path, "the supervisor's judge"))
		(void) check_artifact_ref(vs, v, psprintf("%s.prompt", path), SITE_PROMPT);
	check_positive_int(vs, j, "every", path);
	v = JsonGetField(j, "on_error");
	if (v && (v->type != jbvString ||
			  (strcmp(JsonGetString(j, "on_error"), "pass") != 0 &&
			   strcmp(JsonGetString(j, "on_error"), "abort") != 0)))
		add_finding(vs, "error", psprintf("%s.on_error", path),
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
	if (!is_mapping(sv))
	{
		add_finding(vs, "error", "supervisor", "supervisor must be a mapping with rules, a judge, or both");
		return;
	}
	s = JsonValueToJsonb(sv);
	check_unknown_keys(vs, s, "supervisor", keys, NULL);
	rules = JsonGetField(s, "rules");
	if (rules == NULL && JsonGetField(s, "judge") == NULL)
		add_finding(vs, "error", "supervisor", "supervisor needs rules, a judge, or both");
	if (rules && (!is_list(rules) || JsonContainerSize(rules->val.binary.data) == 0))
		add_finding(vs, "error", "supervisor.rules", "rules must be a non-empty list of rules");
	for (int i = 0; rules && is_list(rules) && i < (int) JsonContainerSize(rules->val.binary.data); i++)
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

		if (is_mapping(st))
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
	for (int i = 0; is_list(list) && i < (int) JsonContainerSize(list->val.binary.data); i++)
	{
		JsonbValue *t = getIthJsonbValueFromContainer(list->val.binary.data, i);

		if (is_mapping(t) && JsonGetString(JsonValueToJsonb(t), "ref"))
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
		add_finding(vs, "warning", path,
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

	if (!is_mapping(props))
		return;
	it = JsonbIteratorInit(props->val.binary.data);
	while (next_key(&it, &key, &v))
		(void) NameIndexAdd(known, key, 0);
	for (int i = 0; i < nsteps; i++)
	{
		JsonbValue *st = getIthJsonbValueFromContainer(steps->val.binary.data, i);

		if (is_mapping(st))
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
		(void) SpiSubxactAbort(&sub);
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
		add_finding(&vs, "error", "", "a workflow must be a YAML mapping with name and steps");
		return vs.findings;
	}
	check_unknown_keys(&vs, def, "", top_level_keys, NULL);
	check_header(&vs, def);

	steps = JsonGetField(def, "steps");
	if (steps == NULL)
		add_finding(&vs, "error", "", "the workflow is missing required key \"steps\"");
	else if (!is_list(steps) || JsonContainerSize(steps->val.binary.data) == 0)
		add_finding(&vs, "error", "steps", "steps must be a non-empty list of step mappings");
	else
		nsteps = JsonContainerSize(steps->val.binary.data);

	ends = JsonGetField(def, "ends");
	if (ends && !is_list(ends))
		add_finding(&vs, "error", "ends", "ends must be a list such as - { id: done, status: completed }");
	else if (ends)
		nends = JsonContainerSize(ends->val.binary.data);

	/* First the ids of steps and ends, so routes can name any of them. */
	collect_step_ids(&vs, steps, nsteps);
	check_ends(&vs, ends, nends);
	for (int i = 0; i < nsteps; i++)
	{
		JsonbValue *s = getIthJsonbValueFromContainer(steps->val.binary.data, i);

		CHECK_FOR_INTERRUPTS();
		if (is_mapping(s))
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
	check_positive_number(&vs, def, "max_cost", NULL);
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
		if (strcmp(((Finding *) lfirst(lc))->severity, "error") == 0)
		return true;
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
