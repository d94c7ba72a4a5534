/*-------------------------------------------------------------------------
 *
 * jsonschema.c
 *	  Validate jsonb values against a small subset of JSON Schema.
 *
 * Keywords: type, enum, const, minimum, maximum, minLength, maxLength,
 * pattern (a PostgreSQL regular expression, as with ~), items, minItems,
 * maxItems, properties, required, additionalProperties, anyOf, and $ref to
 * a schema under $defs or definitions of the same document ("#/$defs/x").
 *
 * This module works on in-memory jsonb values: no SPI and no catalog
 * access; the one piece of state is the document being validated, for
 * $ref.  Results (error structs, their strings, lists of findings) and all
 * scratch memory are palloc'd in the caller's CurrentMemoryContext; run in
 * a short-lived context to reclaim scratch.
 *
 * The validator assumes its schema has passed JsonSchemaCheck: a keyword
 * whose value has the wrong shape is ignored rather than reported, and a
 * non-object (sub)schema constrains nothing.  Keywords that do not apply to
 * the instance's type are ignored, as in JSON Schema.  jsonb does not keep
 * object keys in input order, so "schema order" means jsonb's canonical
 * key order (shorter keys first, then bytewise).
 *
 * Both walks are bounded.  A $ref, like an anyOf entry, applies another
 * schema to the same value, while properties, items and
 * additionalProperties apply theirs to a part of it.  A recursive schema
 * (a tree whose children are nodes) therefore ends with the value it
 * validates, but a chain of $ref that comes back to where it started
 * never does: JsonSchemaCheck refuses such cycles (and chains longer
 * than JSON_SCHEMA_MAX_REF_CHAIN), and the validator, which may meet a
 * schema nobody checked (an MCP server's), stops after that many $ref in
 * a row on one value.  Nesting deeper than JSON_SCHEMA_MAX_DEPTH schemas
 * is an error of either walk, never a stack overflow.
 *
 * src/jsonschema.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_collation.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "utils/fmgrprotos.h"
#include "utils/json.h"
#include "utils/jsonb.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/numeric.h"

#include "jsonschema.h"
#include "spiutil.h"

/* The document being validated: where "$ref" looks up "#/$defs/name". */
static JsonbValue *validation_root = NULL;

/* longest rendering of a JSON value we put into a message, in bytes */
#define MAX_SHOWN_LEN 64

/* schemas nested in one another (a walk deeper than this is an error) */
#define JSON_SCHEMA_MAX_DEPTH 1000

/* $ref followed in a row on one value */
#define JSON_SCHEMA_MAX_REF_CHAIN 100

/* JSON Schema view of an instance's type; integers are a subset of numbers */
typedef enum JsKind
{
	JSK_NULL,
	JSK_BOOLEAN,
	JSK_INTEGER,
	JSK_NUMBER,
	JSK_STRING,
	JSK_ARRAY,
	JSK_OBJECT
} JsKind;

static const char *const kind_names[] = {
	"null", "boolean", "integer", "number", "string", "array", "object"
};

static JsonSchemaError *validate_node(JsonbValue *schema, JsonbValue *inst,
									  StringInfo path, int depth, int refs);

/* ---------- small helpers ---------- */

static int
num_cmp(Numeric a, Numeric b)
{
	return DatumGetInt32(DirectFunctionCall2(numeric_cmp, NumericGetDatum(a),
											 NumericGetDatum(b)));
}

static bool
num_is_integral(Numeric num)
{
	Datum		fl = DirectFunctionCall1(numeric_floor, NumericGetDatum(num));

	return num_cmp(DatumGetNumeric(fl), num) == 0;
}

static bool
str_eq(const char *s, int len, const char *lit)
{
	return len == (int) strlen(lit) && memcmp(s, lit, len) == 0;
}

static bool
is_object_value(JsonbValue *v)
{
	return v->type == jbvBinary && JsonContainerIsObject(v->val.binary.data);
}

static bool
is_array_value(JsonbValue *v)
{
	return v->type == jbvBinary && JsonContainerIsArray(v->val.binary.data) &&
		!JsonContainerIsScalar(v->val.binary.data);
}

static bool
get_keyword(JsonbContainer *schema, const char *kw, JsonbValue *out)
{
	return getKeyJsonValueFromContainer(schema, kw, strlen(kw), out) != NULL;
}

/* Next array element from a non-recursive iterator; false when done. */
static bool
next_elem(JsonbIterator **it, JsonbValue *elem)
{
	JsonbIteratorToken tok;

	while ((tok = JsonbIteratorNext(it, elem, true)) != WJB_DONE)
		if (tok == WJB_ELEM)
			return true;
	return false;
}

/* Next key/value pair from a non-recursive object iterator; false when done. */
static bool
next_pair(JsonbIterator **it, JsonbValue *key, JsonbValue *val)
{
	JsonbIteratorToken tok;

	while ((tok = JsonbIteratorNext(it, key, true)) != WJB_DONE)
		if (tok == WJB_KEY)
		{
			(void) JsonbIteratorNext(it, val, true);
			return true;
		}
	return false;
}

static JsKind
kind_of(JsonbValue *v)
{
	switch (v->type)
	{
		case jbvNull:
			return JSK_NULL;
		case jbvBool:
			return JSK_BOOLEAN;
		case jbvString:
			return JSK_STRING;
		case jbvNumeric:
			return num_is_integral(v->val.numeric) ? JSK_INTEGER : JSK_NUMBER;
		case jbvBinary:
			return JsonContainerIsObject(v->val.binary.data) ? JSK_OBJECT : JSK_ARRAY;
		default:
			elog(ERROR, "unexpected jsonb value type: %d", (int) v->type);
	}
	return JSK_NULL;			/* keep compiler quiet */
}

/* Is "name" one of the seven type names? */
static bool
known_type(const char *name, int len)
{
	for (int i = 0; i < (int) lengthof(kind_names); i++)
		if (str_eq(name, len, kind_names[i]))
			return true;
	return false;
}

/* Double-quoted, JSON-escaped copy of a length-counted string. */
static char *
quote_str(const char *s, int len)
{
	StringInfoData buf;

	initStringInfo(&buf);
	escape_json(&buf, pnstrdup(s, len));
	return buf.data;
}

/*
 * Render any JSON value as text for a message, clipped to MAX_SHOWN_LEN
 * bytes (at a character boundary) with "..." appended when clipped.
 */
static char *
value_to_text(JsonbValue *v)
{
	char	   *s;
	int			len;

	if (v->type == jbvBinary)
		s = JsonbToCString(NULL, v->val.binary.data, v->val.binary.len);
	else
	{
		Jsonb	   *jb = JsonbValueToJsonb(v);

		s = JsonbToCString(NULL, &jb->root, VARSIZE(jb));
	}
	len = strlen(s);
	if (len > MAX_SHOWN_LEN)
	{
		len = pg_mbcliplen(s, len, MAX_SHOWN_LEN);
		s = psprintf("%.*s...", len, s);
	}
	return s;
}

/*
 * Why a pattern longer than JSON_SCHEMA_MAX_PATTERN_LEN is refused, for
 * the check of a schema and for the validator (which meets schemas nobody
 * checked) alike: the pattern is shown clipped.
 */
static char *
pattern_too_long(JsonbValue *pattern)
{
	return psprintf("pattern %s is %d bytes long; the limit is %d",
					value_to_text(pattern), pattern->val.string.len,
					JSON_SCHEMA_MAX_PATTERN_LEN);
}

/* Append a key to a path: ".key" for identifiers, else ["key"] escaped. */
static void
append_key(StringInfo path, const char *key, int len)
{
	bool		ident = len > 0 && !isdigit((unsigned char) key[0]);

	for (int i = 0; i < len && ident; i++)
		ident = isalnum((unsigned char) key[i]) || key[i] == '_';
	if (ident)
		appendStringInfo(path, ".%.*s", len, key);
	else
		appendStringInfo(path, "[%s]", quote_str(key, len));
}

static void
truncate_path(StringInfo path, int len)
{
	path->len = len;
	path->data[len] = '\0';
}

static JsonSchemaError *
make_error(const char *path, const char *rule, char *message)
{
	JsonSchemaError *err = palloc(sizeof(JsonSchemaError));

	err->path = pstrdup(path);
	err->rule = pstrdup(rule);
	err->message = message;
	return err;
}

/* The jsonb's top-level value: a scalar, or a jbvBinary container. */
static void
root_value(Jsonb *jb, JsonbValue *out)
{
	if (JB_ROOT_IS_SCALAR(jb))
		(void) JsonbExtractScalar(&jb->root, out);
	else
	{
		out->type = jbvBinary;
		out->val.binary.data = &jb->root;
		out->val.binary.len = VARSIZE(jb) - VARHDRSZ;
	}
}

/*
 * JSON equality: same type and same value, numbers compared numerically
 * (so 1 equals 1.0, also inside containers), containers compared deeply.
 */
static bool
values_equal(JsonbValue *a, JsonbValue *b)
{
	if (a->type != b->type)
		return false;
	switch (a->type)
	{
		case jbvNull:
			return true;
		case jbvBool:
			return a->val.boolean == b->val.boolean;
		case jbvNumeric:
			return num_cmp(a->val.numeric, b->val.numeric) == 0;
		case jbvString:
			return a->val.string.len == b->val.string.len &&
				memcmp(a->val.string.val, b->val.string.val, a->val.string.len) == 0;
		case jbvBinary:
			return kind_of(a) == kind_of(b) &&
				compareJsonbContainers(a->val.binary.data, b->val.binary.data) == 0;
		default:
			return false;
	}
}

/* ---------- instance validation ---------- */

/*
 * Check the "type" keyword value against the instance kind ("number" also
 * accepts integers).  Returns an error, or NULL when the instance matches or
 * the keyword names no type at all.
 */
static JsonSchemaError *
validate_type(JsonbValue *type, JsKind kind, const char *path)
{
	StringInfoData expected;
	bool		matched = false;
	bool		any = false;
	bool		single = !is_array_value(type);
	JsonbIterator *it = single ? NULL : JsonbIteratorInit(type->val.binary.data);
	JsonbValue	elem = *type;

	initStringInfo(&expected);
	while (single || next_elem(&it, &elem))
	{
		if (elem.type == jbvString)
		{
			if (str_eq(elem.val.string.val, elem.val.string.len, kind_names[kind]) ||
				(kind == JSK_INTEGER &&
				 str_eq(elem.val.string.val, elem.val.string.len, "number")))
				matched = true;
			appendStringInfo(&expected, "%s%.*s", any ? " or " : "",
							 elem.val.string.len, elem.val.string.val);
			any = true;
		}
		if (single)
			break;
	}
	if (matched || !any)
		return NULL;
	return make_error(path, "type", psprintf("expected %s, got %s",
											 expected.data, kind_names[kind]));
}

/*
 * Inclusive bound check of "value" against numeric keyword "kw" of schema
 * "sc"; "what" prefixes the value in the message.  NULL when satisfied or
 * when the keyword is absent or not a number.
 */
static JsonSchemaError *
validate_bound(JsonbContainer *sc, const char *kw, bool is_min, Numeric value,
			   const char *what, const char *path)
{
	JsonbValue	bound;
	int			c;

	if (!get_keyword(sc, kw, &bound) || bound.type != jbvNumeric)
		return NULL;
	c = num_cmp(value, bound.val.numeric);
	if (is_min ? c >= 0 : c <= 0)
		return NULL;
	return make_error(path, kw,
					  psprintf("%s%s is %s %s %s", what,
							   DatumGetCString(DirectFunctionCall1(numeric_out,
																   NumericGetDatum(value))),
							   is_min ? "less than" : "greater than", kw,
							   value_to_text(&bound)));
}

/*
 * properties (in schema order, only for keys present), then required, then
 * additionalProperties (in instance key order).
 */
static JsonSchemaError *
validate_object(JsonbContainer *sc, JsonbValue *inst, StringInfo path, int depth)
{
	JsonbContainer *ic = inst->val.binary.data;
	int			saved = path->len;
	JsonbValue	props,
				addl,
				kw,
				key,
				val,
				found;
	JsonbIterator *it;
	JsonSchemaError *err;
	bool		have_props;

	have_props = get_keyword(sc, "properties", &props) && is_object_value(&props);
	it = have_props ? JsonbIteratorInit(props.val.binary.data) : NULL;
	while (it && next_pair(&it, &key, &val))
	{
		if (!getKeyJsonValueFromContainer(ic, key.val.string.val,
										  key.val.string.len, &found))
			continue;
		append_key(path, key.val.string.val, key.val.string.len);
		err = validate_node(&val, &found, path, depth + 1, 0);
		truncate_path(path, saved);
		if (err)
			return err;
	}

	it = NULL;
	if (get_keyword(sc, "required", &kw) && is_array_value(&kw))
		it = JsonbIteratorInit(kw.val.binary.data);
	while (it && next_elem(&it, &key))
	{
		if (key.type == jbvString &&
			!getKeyJsonValueFromContainer(ic, key.val.string.val,
										  key.val.string.len, &found))
			return make_error(path->data, "required",
							  psprintf("missing required property %s",
									   quote_str(key.val.string.val,
												 key.val.string.len)));
	}

	it = NULL;
	if (get_keyword(sc, "additionalProperties", &addl) &&
		((addl.type == jbvBool && !addl.val.boolean) || is_object_value(&addl)))
		it = JsonbIteratorInit(ic);
	while (it && next_pair(&it, &key, &val))
	{
		if (have_props &&
			getKeyJsonValueFromContainer(props.val.binary.data, key.val.string.val,
										 key.val.string.len, &found))
			continue;
		if (addl.type == jbvBool)
			return make_error(path->data, "additionalProperties",
							  psprintf("property %s is not allowed",
									   quote_str(key.val.string.val,
												 key.val.string.len)));
		append_key(path, key.val.string.val, key.val.string.len);
		err = validate_node(&addl, &val, path, depth + 1, 0);
		truncate_path(path, saved);
		if (err)
			return err;
	}
	return NULL;
}

/* Does the string inst match the regular expression pattern? */
static bool
pattern_matches(JsonbValue *inst, JsonbValue *pattern)
{
	return DatumGetBool(DirectFunctionCall2Coll(textregexeq, C_COLLATION_OID,
												PointerGetDatum(cstring_to_text_with_len(inst->val.string.val,
																						 inst->val.string.len)),
												PointerGetDatum(cstring_to_text_with_len(pattern->val.string.val,
																						 pattern->val.string.len))));
}

/*
 * The schema a "$ref" names: "#/$defs/name" or "#/definitions/name" of the
 * document being validated (or checked).  false when there is none.
 */
static bool
resolve_ref(JsonbValue *ref, JsonbValue *target)
{
	static const char *const prefixes[] = {"#/$defs/", "#/definitions/", NULL};
	const char *r = ref->val.string.val;
	int			len = ref->val.string.len;

	if (validation_root == NULL || !is_object_value(validation_root))
		return false;
	for (int i = 0; prefixes[i]; i++)
	{
		int			plen = strlen(prefixes[i]);
		JsonbValue	defs;
		JsonbValue	k;
		JsonbValue *v;

		if (len <= plen || strncmp(r, prefixes[i], plen) != 0)
			continue;
		if (!get_keyword(validation_root->val.binary.data, i == 0 ? "$defs" : "definitions", &defs) ||
			!is_object_value(&defs))
			return false;
		k.type = jbvString;
		k.val.string.val = (char *) r + plen;
		k.val.string.len = len - plen;
		v = findJsonbValueFromContainer(defs.val.binary.data, JB_FOBJECT, &k);
		if (v == NULL)
			return false;
		*target = *v;
		return true;
	}
	return false;
}

/*
 * anyOf (a non-empty array of schemas): the first violation of none of
 * them.  A walk that went too deep or round a cycle is reported as such,
 * not as a mismatch.
 */
static JsonSchemaError *
validate_any_of(JsonbValue *schemas, JsonbValue *inst, StringInfo path, int depth, int refs)
{
	JsonbIterator *it = JsonbIteratorInit(schemas->val.binary.data);
	JsonbValue	elem;
	int			saved = path->len;

	while (next_elem(&it, &elem))
	{
		JsonSchemaError *err = validate_node(&elem, inst, path, depth + 1, refs);

		truncate_path(path, saved);
		if (err == NULL)
			return NULL;
		if (strcmp(err->rule, "depth") == 0 || strcmp(err->rule, "$ref") == 0)
			return err;
	}
	return make_error(path->data, "anyOf",
					  psprintf("value %s matches none of the schemas of anyOf",
							   value_to_text(inst)));
}

/*
 * Validate one instance value against one (sub)schema.  "path" holds the
 * instance path and is restored before returning; depth counts the
 * schemas applied above this one, refs the $ref followed in a row on this
 * value.  Returns the first violation (palloc'd) or NULL; a walk past
 * JSON_SCHEMA_MAX_DEPTH or JSON_SCHEMA_MAX_REF_CHAIN is a violation too.
 * Raises only on stack overflow (with a max_stack_depth too small for
 * JSON_SCHEMA_MAX_DEPTH).
 */
static JsonSchemaError *
validate_node(JsonbValue *schema, JsonbValue *inst, StringInfo path, int depth, int refs)
{
	JsonbContainer *sc;
	JsonbValue	kw,
				elem;
	JsonbIterator *it;
	JsKind		kind;
	JsonSchemaError *err = NULL;
	int			saved = path->len;
	int			i = 0;

	check_stack_depth();
	if (!is_object_value(schema))
		return NULL;
	if (depth >= JSON_SCHEMA_MAX_DEPTH)
		return make_error(path->data, "depth",
						  psprintf("more than %d nested schemas apply here; the schema or the value is nested too deeply",
								   JSON_SCHEMA_MAX_DEPTH));
	sc = schema->val.binary.data;
	kind = kind_of(inst);

	if (get_keyword(sc, "$ref", &kw) && kw.type == jbvString)
	{
		JsonbValue	target;

		if (refs >= JSON_SCHEMA_MAX_REF_CHAIN)
			return make_error(path->data, "$ref",
							  psprintf("more than %d $ref in a row apply to this value; the schema's $ref form a cycle",
									   JSON_SCHEMA_MAX_REF_CHAIN));
		if (resolve_ref(&kw, &target) &&
			(err = validate_node(&target, inst, path, depth + 1, refs + 1)) != NULL)
			return err;
	}
	if (get_keyword(sc, "const", &kw) && !values_equal(&kw, inst))
		return make_error(path->data, "const",
						  psprintf("value %s is not %s", value_to_text(inst), value_to_text(&kw)));
	if (get_keyword(sc, "anyOf", &kw) && is_array_value(&kw) &&
		(err = validate_any_of(&kw, inst, path, depth, refs)) != NULL)
		return err;
	if (get_keyword(sc, "type", &kw) &&
		(err = validate_type(&kw, kind, path->data)) != NULL)
		return err;
	if (get_keyword(sc, "enum", &kw) && is_array_value(&kw))
	{
		bool		found = false;

		it = JsonbIteratorInit(kw.val.binary.data);
		while (!found && next_elem(&it, &elem))
			found = values_equal(&elem, inst);
		if (!found)
			return make_error(path->data, "enum",
							  psprintf("value %s is not one of %s",
									   value_to_text(inst), value_to_text(&kw)));
	}

	switch (kind)
	{
		case JSK_INTEGER:
		case JSK_NUMBER:
			if (!(err = validate_bound(sc, "minimum", true, inst->val.numeric,
									   "", path->data)))
				err = validate_bound(sc, "maximum", false, inst->val.numeric,
									 "", path->data);
			break;
		case JSK_STRING:
			{
				Numeric		nchars;

				nchars = int64_to_numeric(pg_mbstrlen_with_len(inst->val.string.val,
															   inst->val.string.len));
				if (!(err = validate_bound(sc, "minLength", true, nchars,
										   "string length ", path->data)))
					err = validate_bound(sc, "maxLength", false, nchars,
										 "string length ", path->data);
				if (err == NULL && get_keyword(sc, "pattern", &kw) && kw.type == jbvString)
				{
					/*
					 * JsonSchemaCheck refuses a pattern this long, but nobody
					 * checked an MCP server's schema.
					 */
					if (kw.val.string.len > JSON_SCHEMA_MAX_PATTERN_LEN)
						err = make_error(path->data, "pattern", pattern_too_long(&kw));
					else if (!pattern_matches(inst, &kw))
						err = make_error(path->data, "pattern",
										 psprintf("string %s does not match pattern %s",
												  value_to_text(inst), value_to_text(&kw)));
				}
				break;
			}
		case JSK_OBJECT:
			err = validate_object(sc, inst, path, depth);
			break;
		case JSK_ARRAY:
			{
				Numeric		n = int64_to_numeric(JsonContainerSize(inst->val.binary.data));

				if ((err = validate_bound(sc, "minItems", true, n, "array length ", path->data)) ||
					(err = validate_bound(sc, "maxItems", false, n, "array length ", path->data)))
					break;
			}
			if (!get_keyword(sc, "items", &kw) || !is_object_value(&kw))
				break;
			it = JsonbIteratorInit(inst->val.binary.data);
			while (err == NULL && next_elem(&it, &elem))
			{
				appendStringInfo(path, "[%d]", i++);
				err = validate_node(&kw, &elem, path, depth + 1, 0);
				truncate_path(path, saved);
			}
			break;
		default:
			break;
	}
	return err;
}

/*
 * JsonSchemaValidate: see jsonschema.h.  The result and its strings are
 * palloc'd in CurrentMemoryContext.  Raises only on stack overflow.
 */
JsonSchemaError *
JsonSchemaValidate(Jsonb *schema, Jsonb *instance)
{
	JsonbValue	sv,
				iv;
	StringInfoData path;

	JsonSchemaError *err;
	JsonbValue *saved = validation_root;

	root_value(schema, &sv);
	root_value(instance, &iv);
	initStringInfo(&path);
	appendStringInfoChar(&path, '$');
	validation_root = &sv;
	PG_TRY();
	{
		err = validate_node(&sv, &iv, &path, 0, 0);
	}
	PG_FINALLY();
	{
		validation_root = saved;
	}
	PG_END_TRY();
	return err;
}

/*
 * JsonSchemaValidateOrError: validate and raise ERROR (invalid parameter
 * value) describing the first violation; "what" names the validated value.
 */
void
JsonSchemaValidateOrError(Jsonb *schema, Jsonb *instance, const char *what)
{
	JsonSchemaError *err = JsonSchemaValidate(schema, instance);

	if (err == NULL)
		return;
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("%s does not match its schema", what),
			 errdetail("At %s: %s (rule \"%s\").", err->path, err->message,
					   err->rule),
			 errhint("Correct the %s so that it satisfies the schema.", what)));
}

/* ---------- schema well-formedness ---------- */


static void
add_finding(List **out, StringInfo path, const char *rule, char *message)
{
	*out = lappend(*out, make_error(path->data, rule, message));
}

/* A pattern must be a string PostgreSQL's regex engine compiles. */
static void
check_pattern(JsonbValue *val, StringInfo path, List **out)
{
	SpiSubxact	sub;

	if (val->type != jbvString)
	{
		add_finding(out, path, "pattern", psprintf("pattern must be a string, got %s",
												   JsonbTypeName(val)));
		return;
	}
	if (val->val.string.len > JSON_SCHEMA_MAX_PATTERN_LEN)
	{
		add_finding(out, path, "pattern", pattern_too_long(val));
		return;
	}
	SpiSubxactBegin(&sub);
	PG_TRY();
	{
		JsonbValue	empty;

		empty.type = jbvString;
		empty.val.string.val = "";
		empty.val.string.len = 0;
		(void) pattern_matches(&empty, val);
		SpiSubxactCommit(&sub);
	}
	PG_CATCH();
	{
		ErrorData  *edata = SpiSubxactAbortFinding(&sub);

		add_finding(out, path, "pattern", psprintf("pattern %s: %s", value_to_text(val),
												   edata->message));
	}
	PG_END_TRY();
}

/*
 * "type" (a known type name or a non-empty array of them) and "required"
 * (an array of strings): report shape problems under "path".
 */
static void
check_string_list(JsonbValue *val, const char *kw, StringInfo path, List **out)
{
	bool		is_type = (strcmp(kw, "type") == 0);
	int			saved = path->len;
	int			i = 0;
	JsonbIterator *it;
	JsonbValue	elem;

	if (is_type && val->type == jbvString)
	{
		if (!known_type(val->val.string.val, val->val.string.len))
			add_finding(out, path, kw, psprintf("unknown type %s",
												quote_str(val->val.string.val,
														  val->val.string.len)));
		return;
	}
	if (!is_array_value(val))
	{
		add_finding(out, path, kw,
					psprintf("%s must be %san array of strings, got %s", kw,
							 is_type ? "a string or " : "", JsonbTypeName(val)));
		return;
	}
	if (is_type && JsonContainerSize(val->val.binary.data) == 0)
		add_finding(out, path, kw, pstrdup("type array must not be empty"));
	it = JsonbIteratorInit(val->val.binary.data);
	while (next_elem(&it, &elem))
	{
		appendStringInfo(path, "[%d]", i++);
		if (elem.type != jbvString)
			add_finding(out, path, kw,
						psprintf("%s entries must be strings, got %s", kw,
								 JsonbTypeName(&elem)));
		else if (is_type && !known_type(elem.val.string.val, elem.val.string.len))
			add_finding(out, path, kw,
						psprintf("unknown type %s",
								 quote_str(elem.val.string.val, elem.val.string.len)));
		truncate_path(path, saved);
	}
}

/*
 * Report "lo" > "hi" when both keywords of schema "sc" hold numbers; the
 * finding is placed at the "lo" keyword.
 */
static void
check_order(JsonbContainer *sc, const char *lo, const char *hi,
			StringInfo path, List **out)
{
	JsonbValue	a,
				b;
	int			saved = path->len;

	if (!get_keyword(sc, lo, &a) || !get_keyword(sc, hi, &b) ||
		a.type != jbvNumeric || b.type != jbvNumeric ||
		num_cmp(a.val.numeric, b.val.numeric) <= 0)
		return;
	appendStringInfo(path, ".%s", lo);
	add_finding(out, path, lo, psprintf("%s %s is greater than %s %s", lo,
										value_to_text(&a), hi, value_to_text(&b)));
	truncate_path(path, saved);
}

/*
 * Check the keywords that hold values or schemas of their own: minItems,
 * maxItems, pattern, anyOf, $defs, definitions, $ref and const.  Returns
 * false for any other keyword.
 */
static void check_node(JsonbValue *node, StringInfo path, const char *ctxrule, List **out,
					   int depth);

static bool
check_composite(const char *kw, JsonbValue *v, StringInfo path, List **out, int depth)
{
	JsonbIterator *pit;
	JsonbValue	pkey,
				sub,
				val = *v;

	if (strcmp(kw, "minItems") == 0 || strcmp(kw, "maxItems") == 0)
	{
		if (val.type != jbvNumeric || !num_is_integral(val.val.numeric) ||
			num_cmp(val.val.numeric, int64_to_numeric(0)) < 0)
			add_finding(out, path, kw,
						psprintf("%s must be a non-negative integer, got %s",
								 kw, value_to_text(&val)));
	}
	else if (strcmp(kw, "pattern") == 0)
		check_pattern(&val, path, out);
	else if (strcmp(kw, "anyOf") == 0)
	{
		JsonbIterator *ait;
		int			i = 0;
		int			asaved = path->len;

		if (!is_array_value(&val) || JsonContainerSize(val.val.binary.data) == 0)
			add_finding(out, path, kw, pstrdup("anyOf must be a non-empty array of schemas"));
		else
		{
			ait = JsonbIteratorInit(val.val.binary.data);
			while (next_elem(&ait, &sub))
			{
				appendStringInfo(path, "[%d]", i++);
				check_node(&sub, path, kw, out, depth + 1);
				truncate_path(path, asaved);
			}
		}
	}
	else if (strcmp(kw, "$defs") == 0 || strcmp(kw, "definitions") == 0)
	{
		int			dsaved = path->len;

		if (!is_object_value(&val))
			add_finding(out, path, kw, psprintf("%s must be an object of schemas", kw));
		else
		{
			pit = JsonbIteratorInit(val.val.binary.data);
			while (next_pair(&pit, &pkey, &sub))
			{
				append_key(path, pkey.val.string.val, pkey.val.string.len);
				check_node(&sub, path, kw, out, depth + 1);
				truncate_path(path, dsaved);
			}
		}
	}
	else if (strcmp(kw, "$ref") == 0)
	{
		JsonbValue	target;

		if (val.type != jbvString || !resolve_ref(&val, &target))
			add_finding(out, path, kw,
						psprintf("$ref must name a schema of this document, such as \"#/$defs/item\"; %s is not one",
								 value_to_text(&val)));
	}
	else if (strcmp(kw, "const") != 0)
		return false;			/* const takes any value */
	return true;
}

/*
 * Check one (sub)schema, appending findings to *out in schema order.
 * "path" is the schema location and is restored before returning;
 * "ctxrule" is the rule reported if the node is not an object; depth
 * counts the schemas it is nested in.  Raises only on stack overflow.
 */
static void
check_node(JsonbValue *node, StringInfo path, const char *ctxrule, List **out, int depth)
{
	JsonbIterator *it,
			   *pit;
	JsonbValue	key,
				val,
				pkey,
				sub;
	int			saved = path->len;

	check_stack_depth();
	if (!is_object_value(node))
	{
		add_finding(out, path, ctxrule,
					psprintf("schema must be an object, got %s", JsonbTypeName(node)));
		return;
	}
	if (depth >= JSON_SCHEMA_MAX_DEPTH)
	{
		add_finding(out, path, "depth",
					psprintf("the schema is nested more than %d levels deep", JSON_SCHEMA_MAX_DEPTH));
		return;
	}

	it = JsonbIteratorInit(node->val.binary.data);
	while (next_pair(&it, &key, &val))
	{
		char	   *kw = pnstrdup(key.val.string.val, key.val.string.len);

		append_key(path, key.val.string.val, key.val.string.len);
		if (strcmp(kw, "type") == 0 || strcmp(kw, "required") == 0)
			check_string_list(&val, kw, path, out);
		else if (strcmp(kw, "properties") == 0 && !is_object_value(&val))
			add_finding(out, path, kw, psprintf("properties must be an object, got %s",
												JsonbTypeName(&val)));
		else if (strcmp(kw, "properties") == 0)
		{
			int			psaved = path->len;

			pit = JsonbIteratorInit(val.val.binary.data);
			while (next_pair(&pit, &pkey, &sub))
			{
				append_key(path, pkey.val.string.val, pkey.val.string.len);
				check_node(&sub, path, kw, out, depth + 1);
				truncate_path(path, psaved);
			}
		}
		else if (strcmp(kw, "items") == 0 ||
				 (strcmp(kw, "additionalProperties") == 0 && is_object_value(&val)))
			check_node(&val, path, kw, out, depth + 1);
		else if (strcmp(kw, "additionalProperties") == 0)
		{
			if (val.type != jbvBool)
				add_finding(out, path, kw,
							psprintf("additionalProperties must be a boolean or a schema object, got %s",
									 JsonbTypeName(&val)));
		}
		else if (strcmp(kw, "enum") == 0)
		{
			if (!is_array_value(&val) || JsonContainerSize(val.val.binary.data) == 0)
				add_finding(out, path, kw, pstrdup("enum must be a non-empty array"));
		}
		else if (strcmp(kw, "minimum") == 0 || strcmp(kw, "maximum") == 0)
		{
			if (val.type != jbvNumeric)
				add_finding(out, path, kw, psprintf("%s must be a number, got %s",
													kw, JsonbTypeName(&val)));
		}
		else if (strcmp(kw, "minLength") == 0 || strcmp(kw, "maxLength") == 0)
		{
			if (val.type != jbvNumeric || !num_is_integral(val.val.numeric) ||
				num_cmp(val.val.numeric, int64_to_numeric(0)) < 0)
				add_finding(out, path, kw,
							psprintf("%s must be a non-negative integer, got %s",
									 kw, value_to_text(&val)));
		}
		else if (check_composite(kw, &val, path, out, depth))
			;					/* handled */
		else if (strcmp(kw, "description") != 0 && strcmp(kw, "title") != 0 &&
				 strcmp(kw, "default") != 0 && strcmp(kw, "$schema") != 0)
			add_finding(out, path, "unknown keyword",
						psprintf("unknown keyword %s",
								 quote_str(key.val.string.val, key.val.string.len)));
		truncate_path(path, saved);
	}
	check_order(node->val.binary.data, "minimum", "maximum", path, out);
	check_order(node->val.binary.data, "minLength", "maxLength", path, out);
	check_order(node->val.binary.data, "minItems", "maxItems", path, out);
}

/* ---------- $ref cycles ---------- */

/* Where a walk of the $ref graph stands with a definition. */
typedef struct RefVisit
{
	JsonbContainer *schema;		/* the definition (the hash key) */
	bool		on_chain;		/* being followed now */
	int			height;			/* the most $ref in a row from it, once walked */
} RefVisit;

typedef struct RefWalk
{
	HTAB	   *visits;			/* definitions reached: RefVisit */
	List	   *chain;			/* the $ref strings followed, in order */
	List	   *targets;		/* ... and the definition each reached */
	bool		too_long;		/* a chain past the limit was reported */
	const char *base;			/* the schema's own location */
	List	  **out;
} RefWalk;

static int	walk_same_value(RefWalk *w, JsonbValue *node, StringInfo path, int depth);

/* "#/$defs/a -> #/$defs/b -> ..." from chain entry from, then last. */
static char *
chain_text(RefWalk *w, int from, const char *last)
{
	StringInfoData buf;

	initStringInfo(&buf);
	for (int i = from; i < list_length(w->chain); i++)
		appendStringInfo(&buf, "%s -> ", (char *) list_nth(w->chain, i));
	appendStringInfoString(&buf, last);
	return buf.data;
}

/* Walk the definition a $ref named reached: its height. */
static int
walk_target(RefWalk *w, char *name, JsonbValue *target, int depth)
{
	const char *section = strncmp(name, "#/$defs/", 8) == 0 ? "$defs" : "definitions";
	const char *key = name + 3 + strlen(section);
	StringInfoData tpath;
	int			height;

	w->chain = lappend(w->chain, name);
	w->targets = lappend(w->targets, target->val.binary.data);
	initStringInfo(&tpath);
	appendStringInfoString(&tpath, w->base);
	append_key(&tpath, section, strlen(section));
	append_key(&tpath, key, strlen(key));
	height = walk_same_value(w, target, &tpath, depth + 1);
	w->chain = list_delete_last(w->chain);
	w->targets = list_delete_last(w->targets);
	return height;
}

/*
 * Follow the $ref at path (unresolved ones are check_composite's to
 * report): a target on the chain already closes a cycle, reported; one
 * not reached before is walked (the chain never grows past the limit).
 * Returns how many $ref in a row it starts, at most.
 */
static int
follow_ref(RefWalk *w, JsonbValue *ref, StringInfo path, int depth)
{
	JsonbValue	target;
	RefVisit   *visit;
	bool		found;
	char	   *name;

	if (!resolve_ref(ref, &target) || !is_object_value(&target))
		return 1;
	name = pnstrdup(ref->val.string.val, ref->val.string.len);
	visit = hash_search(w->visits, &target.val.binary.data, HASH_ENTER, &found);
	if (found && visit->on_chain)
	{
		int			from = 0;

		while (list_nth(w->targets, from) != target.val.binary.data)
			from++;
		add_finding(w->out, path, "$ref",
					psprintf("$ref cycle: %s applies the same schemas to one value forever; recurse through properties or items instead",
							 chain_text(w, from, name)));
		return 1;
	}
	if (!found)
	{
		visit->on_chain = true;
		visit->height = 0;
		if (list_length(w->chain) < JSON_SCHEMA_MAX_REF_CHAIN)
			visit->height = walk_target(w, name, &target, depth);
		visit->on_chain = false;
	}
	if (list_length(w->chain) + 1 + visit->height > JSON_SCHEMA_MAX_REF_CHAIN && !w->too_long)
	{
		add_finding(w->out, path, "$ref",
					psprintf("more than %d $ref in a row apply to one value, from %s",
							 JSON_SCHEMA_MAX_REF_CHAIN,
							 w->chain ? (char *) linitial(w->chain) : name));
		w->too_long = true;
	}
	return 1 + visit->height;
}

/*
 * Walk the schemas node applies to its own value, depth-first: its $ref
 * and its anyOf entries.  Returns the most $ref in a row they start.
 */
static int
walk_same_value(RefWalk *w, JsonbValue *node, StringInfo path, int depth)
{
	JsonbValue	kw,
				elem;
	int			saved = path->len;
	int			height = 0;

	check_stack_depth();
	if (!is_object_value(node) || depth >= JSON_SCHEMA_MAX_DEPTH)
		return 0;
	if (get_keyword(node->val.binary.data, "$ref", &kw) && kw.type == jbvString)
	{
		append_key(path, "$ref", 4);
		height = follow_ref(w, &kw, path, depth);
		truncate_path(path, saved);
	}
	if (get_keyword(node->val.binary.data, "anyOf", &kw) && is_array_value(&kw))
	{
		JsonbIterator *it = JsonbIteratorInit(kw.val.binary.data);
		int			i = 0;

		while (next_elem(&it, &elem))
		{
			int			h;

			append_key(path, "anyOf", 5);
			appendStringInfo(path, "[%d]", i++);
			h = walk_same_value(w, &elem, path, depth + 1);
			height = Max(height, h);
			truncate_path(path, saved);
		}
	}
	return height;
}

/*
 * Report the $ref cycles of the document (validation_root): every cycle
 * goes through a definition, so walking from the root and from each
 * definition finds each one once.
 */
static void
check_ref_cycles(StringInfo path, List **out)
{
	static const char *const sections[] = {"$defs", "definitions"};
	HASHCTL		ctl;
	RefWalk		w;

	memset(&w, 0, sizeof(w));
	ctl.keysize = sizeof(JsonbContainer *);
	ctl.entrysize = sizeof(RefVisit);
	ctl.hcxt = CurrentMemoryContext;
	w.visits = hash_create("tuvl schema $ref walk", 64, &ctl,
						   HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	w.out = out;
	w.base = pstrdup(path->data);
	(void) walk_same_value(&w, validation_root, path, 0);
	for (int i = 0; i < (int) lengthof(sections); i++)
	{
		JsonbValue	defs,
					key,
					sub;
		JsonbIterator *it;
		int			saved = path->len;

		if (!is_object_value(validation_root) ||
			!get_keyword(validation_root->val.binary.data, sections[i], &defs) ||
			!is_object_value(&defs))
			continue;
		it = JsonbIteratorInit(defs.val.binary.data);
		while (next_pair(&it, &key, &sub))
		{
			JsonbValue	ref;

			/* as if the root referred to it */
			ref.type = jbvString;
			ref.val.string.val = psprintf("#/%s/%.*s", sections[i], key.val.string.len,
										  key.val.string.val);
			ref.val.string.len = strlen(ref.val.string.val);
			append_key(path, sections[i], strlen(sections[i]));
			append_key(path, key.val.string.val, key.val.string.len);
			(void) follow_ref(&w, &ref, path, 0);
			truncate_path(path, saved);
		}
	}
	hash_destroy(w.visits);
}

/*
 * JsonSchemaCheck: see jsonschema.h.  Findings come depth-first in schema
 * (jsonb key) order, then the $ref cycles; the list and its members are
 * palloc'd in CurrentMemoryContext.  Raises only on stack overflow.
 */
List *
JsonSchemaCheck(Jsonb *schema, const char *basepath)
{
	JsonbValue	root;
	StringInfoData path;
	List	   *out = NIL;

	JsonbValue *saved = validation_root;

	root_value(schema, &root);
	initStringInfo(&path);
	appendStringInfoString(&path, (basepath && *basepath) ? basepath : "$");
	validation_root = &root;
	PG_TRY();
	{
		check_node(&root, &path, "schema", &out, 0);
		check_ref_cycles(&path, &out);
	}
	PG_FINALLY();
	{
		validation_root = saved;
	}
	PG_END_TRY();
	return out;
}
