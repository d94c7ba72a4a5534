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
 * The exception is llm_judge, which asks a model (judge.c): a gate runs
 * its judges after all its other checks, on the content they let
 * through (masked by pii_mask), so the cheap checks fail first and a
 * judge model never sees what a mask hid.  GuardrailRun skips them;
 * AgentGateJudge (agent_outcome.c) asks them, one durable call each.
 *
 * Patterns are PostgreSQL regular expressions (the ~ operator, advanced
 * syntax, case-sensitive); schemas are the subset of JSON Schema that
 * jsonschema.c validates.  The registration of an artifact checks every
 * check (GuardrailCheckDefinition), so a gate meets only well-formed ones.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "catalog/pg_collation.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/memutils.h"

#include "guardrail.h"
#include "jsonschema.h"
#include "jsonutil.h"
#include "suggest.h"
#include "spiutil.h"

static const char *const gate_names[] = {"input", "tools", "output"};

/* The checks a guardrail may have; those not yet available say so. */
static const char *const check_names[] = {
	"regex_deny", "regex_allow", "max_length", "json_schema", "pii_mask", "llm_judge", NULL
};
static const char *const pii_patterns[] = {"email", "card", "phone", "iban", NULL};

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

static void
pg_attribute_noreturn()
bad_check(const char *name, int i, const char *message, const char *hint)
{
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("guardrail \"%s\": checks[%d]: %s", name, i, message),
			 hint ? errhint("%s", hint) : 0));
}

/* "Did you mean ...?" for a suggestion (suggest.c), or NULL. */
static const char *
did_you_mean(const char *suggestion)
{
	return suggestion ? psprintf("Did you mean \"%s\"?", suggestion) : NULL;
}

/* For a check without a check key: the hint naming a key close to it. */
static const char *
misspelt_check_key(Jsonb *check)
{
	static const char *const check_key[] = {"check", NULL};
	JsonbIterator *it = JsonbIteratorInit(&check->root);
	JsonbValue	v;
	char	   *key;

	while (JsonObjectNext(&it, &key, &v))
		if (SuggestName(key, check_key))
			return psprintf("Did you mean \"check\" instead of \"%s\"?", key);
	return "Name the check's kind with check:, such as { check: max_length, max: 4000 }.";
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
					  SuggestName(key, keys) ? did_you_mean(SuggestName(key, keys)) :
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
	if (strlen(pattern) > JSON_SCHEMA_MAX_PATTERN_LEN)
		bad_check(name, i, psprintf("pattern \"%.*s...\" is %zu bytes long; the limit is %d",
									pg_mbcliplen(pattern, strlen(pattern), 64), pattern,
									strlen(pattern), JSON_SCHEMA_MAX_PATTERN_LEN),
				  "A regex_deny alternation can be split into several regex_deny checks.");
	SpiSubxactBegin(&sub);
	PG_TRY();
	{
		(void) regex_matches("", pattern);
		SpiSubxactCommit(&sub);
	}
	PG_CATCH();
	{
		ErrorData  *edata = SpiSubxactAbortFinding(&sub);

		bad_check(name, i, psprintf("pattern %s: %s", pattern, edata->message),
				  "Patterns are PostgreSQL regular expressions, as with the ~ operator.");
	}
	PG_END_TRY();
}

/* A list of strings, each (when options is given) one of options. */
static void
check_string_list(const char *name, int i, Jsonb *check, const char *key,
				  const char *const *options)
{
	JsonbValue *list = JsonGetField(check, key);

	if (list == NULL)
		return;
	if (list->type != jbvBinary || !JsonContainerIsArray(list->val.binary.data) ||
		JsonContainerSize(list->val.binary.data) == 0)
		bad_check(name, i, psprintf("%s must be a non-empty list", key), NULL);
	for (int k = 0; k < (int) JsonContainerSize(list->val.binary.data); k++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(list->val.binary.data, k);

		if (e->type != jbvString ||
			(options && !name_in(pnstrdup(e->val.string.val, e->val.string.len), options)))
			bad_check(name, i, psprintf("%s[%d] must be %s", key, k,
										options ? "one of email, card, phone, iban" : "a key name"),
					  NULL);
	}
}

/* pii_mask: fields to mask in JSON content, and patterns to mask in text. */
static void
check_pii_mask(const char *name, int i, Jsonb *check)
{
	JsonbIterator *it = JsonbIteratorInit(&check->root);
	JsonbValue	v;
	char	   *key;

	while (JsonObjectNext(&it, &key, &v))
		if (strcmp(key, "check") != 0 && strcmp(key, "fields") != 0 && strcmp(key, "patterns") != 0)
			bad_check(name, i, psprintf("unknown key \"%s\" of check pii_mask", key),
					  "A pii_mask check takes fields and patterns.");
	if (JsonGetField(check, "fields") == NULL && JsonGetField(check, "patterns") == NULL)
		bad_check(name, i, "check pii_mask needs fields, patterns or both",
				  "For example { check: pii_mask, fields: [email], patterns: [email, card] }.");
	check_string_list(name, i, check, "fields", NULL);
	check_string_list(name, i, check, "patterns", pii_patterns);
}

/*
 * llm_judge: the prompt (text or an artifact:// reference), the model
 * config (default "default") and what a judge outage means.
 */
static void
check_llm_judge(const char *name, int i, Jsonb *check)
{
	JsonbIterator *it = JsonbIteratorInit(&check->root);
	JsonbValue	v;
	char	   *key;
	char	   *prompt = JsonGetString(check, "prompt");
	char	   *on_error = JsonGetString(check, "on_judge_error");

	while (JsonObjectNext(&it, &key, &v))
	{
		if (strcmp(key, "check") == 0)
			continue;
		if (strcmp(key, "prompt") != 0 && strcmp(key, "model") != 0 &&
			strcmp(key, "on_judge_error") != 0)
			bad_check(name, i, psprintf("unknown key \"%s\" of check llm_judge", key),
					  "An llm_judge check takes prompt, model and on_judge_error.");
		if (v.type != jbvString)
			bad_check(name, i, psprintf("%s of check llm_judge must be a string", key), NULL);
	}
	if (prompt == NULL || prompt[0] == '\0')
		bad_check(name, i, "check llm_judge needs prompt, what the judge model is asked",
				  "For example { check: llm_judge, model: judge, prompt: \"Is this answer polite?\" }.");
	/* a guardrail's own references are not pinned with the run: pin them here */
	if (strncmp(prompt, "artifact://", 11) == 0 && strchr(prompt, '@') == NULL)
		bad_check(name, i, psprintf("prompt %s of check llm_judge must name a version", prompt),
				  psprintf("Write %s@1 (or the version you mean): a guardrail's references are not pinned when a run starts.",
						   prompt));
	if (JsonGetField(check, "model") && JsonGetString(check, "model")[0] == '\0')
		bad_check(name, i, "model of check llm_judge must name a model config", NULL);
	if (on_error && strcmp(on_error, "pass") != 0 && strcmp(on_error, "violation") != 0)
		bad_check(name, i, psprintf("on_judge_error must be pass or violation, not \"%s\"", on_error),
				  "pass (the default) lets content through when the judge cannot answer; violation stops it.");
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
	if (kind == NULL || !name_in(kind, check_names))
		bad_check(name, i, psprintf("check must be one of regex_deny, regex_allow, max_length, json_schema, pii_mask, llm_judge%s",
									kind ? psprintf(", not \"%s\"", kind) : ""),
				  kind ? did_you_mean(SuggestName(kind, check_names)) : misspelt_check_key(check));
	if (strcmp(kind, "pii_mask") == 0)
	{
		check_pii_mask(name, i, check);
		return;
	}
	if (strcmp(kind, "llm_judge") == 0)
	{
		check_llm_judge(name, i, check);
		return;
	}
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

/* ---------------------------------------------------------------- pii_mask */

/* Does the list value hold the string s? */
static bool
list_has(JsonbValue *list, const char *s, int len)
{
	if (list == NULL || list->type != jbvBinary)
		return false;
	for (int k = 0; k < (int) JsonContainerSize(list->val.binary.data); k++)
	{
		JsonbValue *e = getIthJsonbValueFromContainer(list->val.binary.data, k);

		if (e->type == jbvString && e->val.string.len == len &&
			memcmp(e->val.string.val, s, len) == 0)
			return true;
	}
	return false;
}

/* The Luhn check of a card number's n digits. */
static bool
luhn_ok(const char *digits, int n)
{
	int			sum = 0;

	for (int k = 0; k < n; k++)
	{
		int			d = digits[n - 1 - k] - '0';

		if (k % 2 == 1)
			d = d * 2 > 9 ? d * 2 - 9 : d * 2;
		sum += d;
	}
	return sum % 10 == 0;
}

/* The ISO 13616 check of an IBAN's n characters: mod 97 of the rearranged number is 1. */
static bool
iban_ok(const char *c, int n)
{
	int			rest = 0;

	for (int k = 0; k < n; k++)
	{
		char		ch = c[(k + 4) % n];

		if (isdigit((unsigned char) ch))
			rest = (rest * 10 + (ch - '0')) % 97;
		else
			rest = (rest * 100 + (ch - 'A' + 10)) % 97;
	}
	return rest == 1;
}

/*
 * text with every number that looks like a card (13 to 19 digits, single
 * spaces or hyphens between them, passing the Luhn check) replaced.
 */
static char *
mask_cards(const char *text)
{
	StringInfoData out;
	const char *p = text;

	initStringInfo(&out);
	while (*p)
	{
		if (isdigit((unsigned char) *p) && (p == text || !isalnum((unsigned char) p[-1])))
		{
			char		digits[20];
			int			n = 0;
			const char *q = p;
			const char *end = p;

			while (*q)
			{
				if (isdigit((unsigned char) *q))
				{
					if (n < 20)
						digits[n] = *q;
					n++;
					end = ++q;
				}
				else if ((*q == ' ' || *q == '-') && isdigit((unsigned char) q[1]))
					q++;
				else
					break;
			}
			if (n >= 13 && n <= 19 && !isalnum((unsigned char) *end) && luhn_ok(digits, n))
				appendStringInfoString(&out, "[card]");
			else
				appendBinaryStringInfo(&out, p, end - p);
			p = end;
			continue;
		}
		appendStringInfoChar(&out, *p++);
	}
	return out.data;
}

/* text with every IBAN (two letters, two check digits, up to 30 more, valid) replaced. */
static char *
mask_ibans(const char *text)
{
	StringInfoData out;
	const char *p = text;

	initStringInfo(&out);
	while (*p)
	{
		if (isupper((unsigned char) p[0]) && isupper((unsigned char) p[1]) &&
			isdigit((unsigned char) p[2]) && isdigit((unsigned char) p[3]) &&
			(p == text || !isalnum((unsigned char) p[-1])))
		{
			char		c[34];
			int			n = 0;
			const char *q = p;
			const char *end = p;

			while (*q && n < 34)
			{
				if (isupper((unsigned char) *q) || isdigit((unsigned char) *q))
				{
					c[n++] = *q;
					end = ++q;
				}
				else if (*q == ' ' && (isupper((unsigned char) q[1]) || isdigit((unsigned char) q[1])))
					q++;
				else
					break;
			}
			if (n >= 15 && !isalnum((unsigned char) *end) && iban_ok(c, n))
			{
				appendStringInfoString(&out, "[iban]");
				p = end;
				continue;
			}
		}
		appendStringInfoChar(&out, *p++);
	}
	return out.data;
}

/* in with every match of the regular expression replaced by with. */
static char *
regex_replace_all(const char *in, const char *pattern, const char *with)
{
	return TextDatumGetCString(DirectFunctionCall4Coll(textregexreplace, C_COLLATION_OID,
													   CStringGetTextDatum(in),
													   CStringGetTextDatum(pattern),
													   CStringGetTextDatum(with),
													   CStringGetTextDatum("g")));
}

/* text with the built-in patterns of the list masked. */
static char *
mask_text(JsonbValue *patterns, const char *text)
{
	char	   *out = (char *) text;

	if (list_has(patterns, "email", 5))
		out = regex_replace_all(out, "[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\\.[A-Za-z]{2,}", "[email]");
	if (list_has(patterns, "card", 4))
		out = mask_cards(out);
	if (list_has(patterns, "iban", 4))
		out = mask_ibans(out);
	if (list_has(patterns, "phone", 5))
	{
		out = regex_replace_all(out, "\\+[0-9][0-9 ().-]{5,18}[0-9]", "[phone]");
		out = regex_replace_all(out, "\\(?\\m[0-9]{3}\\)?[ .-][0-9]{3}[ .-][0-9]{4}\\M", "[phone]");
	}
	return out;
}

/* A scalar masked by patterns: a string, or a number written as one. */
static void
mask_scalar(JsonbValue *patterns, JsonbValue *v)
{
	char	   *text;
	char	   *masked;

	if (patterns == NULL)
		return;
	if (v->type == jbvString)
		text = pnstrdup(v->val.string.val, v->val.string.len);
	else if (v->type == jbvNumeric)
		text = DatumGetCString(DirectFunctionCall1(numeric_out, NumericGetDatum(v->val.numeric)));
	else
		return;
	masked = mask_text(patterns, text);
	if (strcmp(masked, text) == 0)
		return;					/* nothing masked: a number stays a number */
	v->type = jbvString;
	v->val.string.val = masked;
	v->val.string.len = strlen(masked);
}

/*
 * j with the values of the keys named in fields replaced by "[masked]"
 * (at any depth), and the patterns masked in every other string or number.
 */
static Jsonb *
mask_jsonb(JsonbValue *fields, JsonbValue *patterns, Jsonb *j)
{
	JsonbIterator *it = JsonbIteratorInit(&j->root);
	JsonbParseState *state = NULL;
	JsonbValue	v;
	JsonbValue *res = NULL;
	JsonbIteratorToken tok;
	bool		mask_next = false;
	int			skipping = 0;
	JsonbValue	masked;

	masked.type = jbvString;
	masked.val.string.val = "[masked]";
	masked.val.string.len = 8;
	while ((tok = JsonbIteratorNext(&it, &v, false)) != WJB_DONE)
	{
		bool		begin = tok == WJB_BEGIN_ARRAY || tok == WJB_BEGIN_OBJECT;
		bool		end = tok == WJB_END_ARRAY || tok == WJB_END_OBJECT;

		if (skipping > 0)
		{
			skipping += begin ? 1 : end ? -1 : 0;
			if (skipping == 0)
				res = pushJsonbValue(&state, WJB_VALUE, &masked);
			continue;
		}
		if (mask_next && begin)
		{
			skipping = 1;
			mask_next = false;
			continue;
		}
		if (mask_next && tok == WJB_VALUE)
		{
			res = pushJsonbValue(&state, WJB_VALUE, &masked);
			mask_next = false;
			continue;
		}
		if (tok == WJB_KEY)
			mask_next = list_has(fields, v.val.string.val, v.val.string.len);
		else if (tok == WJB_VALUE || tok == WJB_ELEM)
			mask_scalar(patterns, &v);
		/* a scalar, or a raw scalar's array; containers' bounds take none */
		res = pushJsonbValue(&state, tok,
							 tok < WJB_BEGIN_ARRAY ||
							 (tok == WJB_BEGIN_ARRAY && v.val.array.rawScalar) ? &v : NULL);
	}
	return JsonbValueToJsonb(res);
}

/* content through one pii_mask check: JSON is masked by fields and patterns, text by patterns. */
static char *
run_pii_mask(Jsonb *check, const char *content)
{
	JsonbValue *fields = JsonGetField(check, "fields");
	JsonbValue *patterns = JsonGetField(check, "patterns");
	Jsonb	   *parsed = JsonParseSafe(content, strlen(content));

	if (parsed)
		return JsonText(mask_jsonb(fields, patterns, parsed));
	return mask_text(patterns, content);
}

/*
 * value with the pii_mask checks of a guardrail applied, for what is
 * journaled of content a gate masked.
 */
Jsonb *
GuardrailMaskJsonb(Jsonb *definition, Jsonb *value)
{
	Jsonb	   *checks = definition ? JsonGetJsonb(definition, "checks") : NULL;

	for (int i = 0; value && i < JsonArraySize(checks); i++)
	{
		Jsonb	   *check = JsonArrayAt(checks, i);

		if (strcmp(JsonGetString(check, "check"), "pii_mask") == 0)
			value = mask_jsonb(JsonGetField(check, "fields"), JsonGetField(check, "patterns"), value);
	}
	return value;
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
 * Run the checks of a guardrail's definition on *content, in order; a
 * pii_mask check replaces *content with its masked form.  Returns NULL
 * when they all pass, else why the first failing one failed; *check_no is
 * its number (1, 2, ...) and *check_name its kind.
 */
char *
GuardrailRun(Jsonb *definition, char **content, int *check_no, char **check_name)
{
	Jsonb	   *checks = definition ? JsonGetJsonb(definition, "checks") : NULL;

	if (*content == NULL)
		*content = "";
	for (int i = 0; i < JsonArraySize(checks); i++)
	{
		Jsonb	   *check = JsonArrayAt(checks, i);
		char	   *why;

		/* a transform: it never fails, and the checks after it see its result */
		if (strcmp(JsonGetString(check, "check"), "pii_mask") == 0)
		{
			*content = run_pii_mask(check, *content);
			continue;
		}
		/* a judge runs after every other check of the gate (agent_outcome.c) */
		if (strcmp(JsonGetString(check, "check"), "llm_judge") == 0)
			continue;
		why = run_check(check, *content);

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
