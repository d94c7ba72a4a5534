/*-------------------------------------------------------------------------
 *
 * guardrail.c
 *	  Guardrails: the checks of guardrail artifacts, and the gates of an
 *	  Agent step that run them.
 *
 * A guardrail artifact is a list of checks:
 *
 *	  name: no_card_numbers
 *	  type: guardrail
 *	  checks:
 *		- { check: regex_deny, pattern: '\y[0-9]{16}\y' }
 *		- { check: max_length, max: 4000 }
 *
 * An Agent step attaches guardrails to its gates (agent.guardrails, or
 * guardrails on the step): input, the user text before anything is sent
 * to the model; tools, each tool observation before the model sees it
 * (autonomous mode); output, the final answer before anything is
 * written.  Every check of every guardrail of a gate runs, in order, on
 * the gate's content; the first that fails ends the step on its
 * guardrail_violation exit (the caller takes it).  Checks read their
 * content only: nothing here has side effects, so a gate gives the same
 * verdict when a transition executes the step again.
 *
 * Patterns are PostgreSQL regular expressions (the ~ operator, advanced
 * syntax, case-sensitive); schemas are the subset of JSON Schema that
 * jsonschema.c validates.  The registration of an artifact checks every
 * check (GuardrailCheckDefinition), so a gate meets only well-formed ones.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_collation.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/memutils.h"

#include "guardrail.h"
#include "jsonschema.h"
#include "jsonutil.h"
#include "spiutil.h"

static const char *const gate_names[] = {"input", "tools", "output"};

/* The checks a guardrail may have; those not yet available say so. */
static const char *const check_names[] = {
	"regex_deny", "regex_allow", "max_length", "json_schema", NULL
};
static const char *const later_checks[] = {"pii_mask", "llm_judge", NULL};

static bool
name_in(const char *name, const char *const *names)
{
	for (int i = 0; names[i]; i++)
		if (strcmp(names[i], name) == 0)
			return true;
	return false;
}

/* Does content match the PostgreSQL regular expression pattern? */
static bool
regex_matches(const char *content, const char *pattern)
{
	return DatumGetBool(DirectFunctionCall2Coll(textregexeq, C_COLLATION_OID,
												CStringGetTextDatum(content),
												CStringGetTextDatum(pattern)));
}

/* ---------------------------------------------------------------- registration */

static void pg_attribute_noreturn()
bad_check(const char *name, int i, const char *message, const char *hint)
{
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("guardrail \"%s\": checks[%d]: %s", name, i, message),
			 hint ? errhint("%s", hint) : 0));
}

/* The keys of check i besides "check" must be exactly those in keys. */
static void
check_keys(const char *name, int i, Jsonb *check, const char *const *keys)
{
	JsonbIterator *it = JsonbIteratorInit(&check->root);
	JsonbValue	v;
	char	   *key;

	while (JsonObjectNext(&it, &key, &v))
		if (strcmp(key, "check") != 0 && !name_in(key, keys))
			bad_check(name, i, psprintf("unknown key \"%s\" of check %s", key,
										JsonGetString(check, "check")),
					  psprintf("A %s check takes %s.", JsonGetString(check, "check"),
							   keys[0] ? keys[0] : "no other key"));
	for (int k = 0; keys[k]; k++)
		if (JsonGetField(check, keys[k]) == NULL)
			bad_check(name, i, psprintf("check %s needs %s", JsonGetString(check, "check"), keys[k]),
					  NULL);
}

/* A pattern the regex engine compiles. */
static void
check_pattern(const char *name, int i, Jsonb *check)
{
	char	   *pattern = JsonGetString(check, "pattern");
	SpiSubxact	sub;

	if (pattern == NULL)
		bad_check(name, i, "pattern must be a string", NULL);
	SpiSubxactBegin(&sub);
	PG_TRY();
	{
		(void) regex_matches("", pattern);
		SpiSubxactCommit(&sub);
	}
	PG_CATCH();
	{
		ErrorData  *edata = SpiSubxactAbort(&sub);

		bad_check(name, i, psprintf("pattern %s: %s", pattern, edata->message),
				  "Patterns are PostgreSQL regular expressions, as with the ~ operator.");
	}
	PG_END_TRY();
}

/* Check one check of guardrail name's list (index i). */
static void
check_one(const char *name, int i, JsonbValue *cv)
{
	Jsonb	   *check;
	char	   *kind;

	if (cv->type != jbvBinary || !JsonContainerIsObject(cv->val.binary.data))
		bad_check(name, i, "a check must be a mapping such as { check: max_length, max: 4000 }",
				  NULL);
	check = JsonValueToJsonb(cv);
	kind = JsonGetString(check, "check");
	if (kind && name_in(kind, later_checks))
		bad_check(name, i, psprintf("the %s check is not available in this version of tuvl", kind),
				  "Use regex_deny, regex_allow, max_length or json_schema.");
	if (kind == NULL || !name_in(kind, check_names))
		bad_check(name, i, psprintf("check must be one of regex_deny, regex_allow, max_length, json_schema%s",
									kind ? psprintf(", not \"%s\"", kind) : ""),
				  NULL);
	if (strcmp(kind, "regex_deny") == 0 || strcmp(kind, "regex_allow") == 0)
	{
		static const char *const keys[] = {"pattern", NULL};

		check_keys(name, i, check, keys);
		check_pattern(name, i, check);
	}
	else if (strcmp(kind, "max_length") == 0)
	{
		static const char *const keys[] = {"max", NULL};
		JsonbValue *max;

		check_keys(name, i, check, keys);
		max = JsonGetField(check, "max");
		if (max->type != jbvNumeric || JsonGetInt(check, "max", 0) < 1 ||
			JsonGetInt(check, "max", 0) > (int64) MaxAllocSize)
			bad_check(name, i, "max must be a positive integer, the most characters allowed", NULL);
	}
	else
	{
		static const char *const keys[] = {"schema", NULL};
		List	   *problems;

		check_keys(name, i, check, keys);
		if (!JsonIsObject(JsonGetJsonb(check, "schema")))
			bad_check(name, i, "schema must be a mapping, a JSON Schema", NULL);
		problems = JsonSchemaCheck(JsonGetJsonb(check, "schema"), "schema");
		if (problems != NIL)
		{
			JsonSchemaError *e = linitial(problems);

			bad_check(name, i, psprintf("%s: %s", e->path, e->message), NULL);
		}
	}
}

/*
 * At registration: is the definition of guardrail artifact name a
 * well-formed list of checks?  Raises naming the first problem.
 */
void
GuardrailCheckDefinition(const char *name, Jsonb *definition)
{
	JsonbValue *checks = JsonGetField(definition, "checks");
	int			n;

	if (checks == NULL || checks->type != jbvBinary ||
		!JsonContainerIsArray(checks->val.binary.data) ||
		(n = JsonContainerSize(checks->val.binary.data)) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("guardrail \"%s\" needs checks, a list of checks", name),
				 errhint("For example: checks: [{ check: regex_deny, pattern: '\\y[0-9]{16}\\y' }]")));
	for (int i = 0; i < n; i++)
		check_one(name, i, getIthJsonbValueFromContainer(checks->val.binary.data, i));
}

/* ---------------------------------------------------------------- gates */

/* Why content fails check, or NULL when it passes. */
static char *
run_check(Jsonb *check, const char *content)
{
	char	   *kind = JsonGetString(check, "check");

	if (strcmp(kind, "regex_deny") == 0)
		return regex_matches(content, JsonGetString(check, "pattern"))
			? psprintf("the content matches %s", JsonGetString(check, "pattern")) : NULL;
	if (strcmp(kind, "regex_allow") == 0)
		return regex_matches(content, JsonGetString(check, "pattern")) ? NULL
			: psprintf("the content does not match %s", JsonGetString(check, "pattern"));
	if (strcmp(kind, "max_length") == 0)
	{
		int64		max = JsonGetInt(check, "max", 0);
		int			len = pg_mbstrlen(content);

		return len > max ? psprintf("the content has %d characters, more than %lld", len,
									(long long) max) : NULL;
	}
	/* json_schema */
	{
		Jsonb	   *parsed = JsonParseSafe(content, strlen(content));
		JsonSchemaError *e;

		if (parsed == NULL)
			return pstrdup("the content is not JSON");
		e = JsonSchemaValidate(JsonGetJsonb(check, "schema"), parsed);
		return e ? psprintf("the content does not match the schema: %s: %s", e->path, e->message)
			: NULL;
	}
}

/*
 * Run the checks of a guardrail's definition on content, in order.
 * Returns NULL when they all pass, else why the first failing one failed;
 * *check_no is its number (1, 2, ...) and *check_name its kind.
 */
char *
GuardrailRun(Jsonb *definition, const char *content, int *check_no, char **check_name)
{
	Jsonb	   *checks = definition ? JsonGetJsonb(definition, "checks") : NULL;

	for (int i = 0; i < JsonArraySize(checks); i++)
	{
		Jsonb	   *check = JsonArrayAt(checks, i);
		char	   *why = run_check(check, content ? content : "");

		if (why)
		{
			*check_no = i + 1;
			*check_name = JsonGetString(check, "check");
			return why;
		}
	}
	return NULL;
}

/* "input", "tools" or "output". */
const char *
GuardrailGateName(GuardrailGate gate)
{
	return gate_names[gate];
}
