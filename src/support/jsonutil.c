/*-------------------------------------------------------------------------
 *
 * jsonutil.c
 *	  Small jsonb helpers shared by the runtime.
 *
 * Pure computation on jsonb values: no SPI, no transaction needed beyond
 * what the jsonb input and output functions require.  Every result is
 * allocated in CurrentMemoryContext.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>
#include <limits.h>

#include "common/jsonapi.h"
#include "lib/stringinfo.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/numeric.h"

#include "jsonutil.h"

/* Look up a key of an object; NULL when absent or when obj is not an object. */
JsonbValue *
JsonGetField(Jsonb *obj, const char *key)
{
	if (obj == NULL || !JB_ROOT_IS_OBJECT(obj))
		return NULL;
	return getKeyJsonValueFromContainer(&obj->root, key, strlen(key), NULL);
}

/* A string field as a C string; NULL when absent or not a string. */
char *
JsonGetString(Jsonb *obj, const char *key)
{
	JsonbValue *v = JsonGetField(obj, key);

	if (v == NULL || v->type != jbvString)
		return NULL;
	return pnstrdup(v->val.string.val, v->val.string.len);
}

/* Any field as a standalone jsonb; NULL when absent. */
Jsonb *
JsonGetJsonb(Jsonb *obj, const char *key)
{
	JsonbValue *v = JsonGetField(obj, key);

	return v ? JsonValueToJsonb(v) : NULL;
}

bool
JsonGetBool(Jsonb *obj, const char *key, bool dflt)
{
	JsonbValue *v = JsonGetField(obj, key);

	if (v == NULL || v->type != jbvBool)
		return dflt;
	return v->val.boolean;
}

/* A numeric field of an object; NULL when absent or not a number. */
static JsonbValue *
numeric_field(Jsonb *obj, const char *key)
{
	JsonbValue *v = JsonGetField(obj, key);

	return v && v->type == jbvNumeric ? v : NULL;
}

/*
 * The integer getters: an integer field of an object, or dflt when absent
 * or not a number.  A fraction is rounded and a number out of range
 * raises, as the casts to bigint (JsonGetInt) and integer (JsonGetInt32)
 * do.
 */
int64
JsonGetInt(Jsonb *obj, const char *key, int64 dflt)
{
	JsonbValue *v = numeric_field(obj, key);

	return v ? DatumGetInt64(DirectFunctionCall1(numeric_int8, NumericGetDatum(v->val.numeric))) : dflt;
}

int32
JsonGetInt32(Jsonb *obj, const char *key, int32 dflt)
{
	JsonbValue *v = numeric_field(obj, key);

	return v ? DatumGetInt32(DirectFunctionCall1(numeric_int4, NumericGetDatum(v->val.numeric))) : dflt;
}

/*
 * A field as text, the way a template interpolates it (strings raw,
 * anything else as JSON); "" when absent or null.
 */
char *
JsonGetText(Jsonb *obj, const char *key)
{
	JsonbValue *v = JsonGetField(obj, key);

	if (v == NULL || v->type == jbvNull)
		return "";
	return JsonValueToText(v);
}

/*
 * Walk the keys of an object: with it from JsonbIteratorInit on the
 * object, each call sets *key (palloc'd) and *val (its value, a container
 * left packed) and returns true; false at the end.
 */
bool
JsonObjectNext(JsonbIterator **it, char **key, JsonbValue *val)
{
	JsonbIteratorToken tok;

	while ((tok = JsonbIteratorNext(it, val, true)) != WJB_DONE)
	{
		if (tok != WJB_KEY)
			continue;
		*key = pnstrdup(val->val.string.val, val->val.string.len);
		(void) JsonbIteratorNext(it, val, true);
		return true;
	}
	return false;
}

/* Wrap any JsonbValue (scalar, binary container) as a Jsonb datum. */
Jsonb *
JsonValueToJsonb(JsonbValue *v)
{
	return JsonbValueToJsonb(v);
}

/*
 * The text form of a value as a template would interpolate it: strings
 * raw, everything else as compact JSON.
 */
char *
JsonValueToText(JsonbValue *v)
{
	Jsonb	   *j;

	if (v->type == jbvString)
		return pnstrdup(v->val.string.val, v->val.string.len);
	j = JsonbValueToJsonb(v);
	return JsonbToCString(NULL, &j->root, VARSIZE(j));
}

Jsonb *
JsonFromCString(const char *text)
{
	return DatumGetJsonbP(DirectFunctionCall1(jsonb_in, CStringGetDatum(text)));
}

/*
 * JSON from outside (a server's response, a model's answer, a tool's
 * arguments) is parsed by JsonParseExternal, which never raises on what
 * the text holds.  PostgreSQL 15's jsonb_in raises on much that its
 * grammar accepts: a number beyond numeric's range (1e1000000, 200,000
 * digits), sizes beyond jsonb's limits, nesting deeper than the stack
 * (100,000 "[" overflow pg_parse_json's recursion).  Where the parse runs
 * (a worker collecting responses outside any transaction, a transition
 * journaling them), such an ERROR would have taken the worker, or the
 * run, down with it instead of failing one step.
 *
 * So the text is checked first (no NUL bytes, valid in the database
 * encoding, nested at most JSON_MAX_DEPTH deep, valid JSON), and only
 * then converted, with the data and limit errors jsonb_in may still raise
 * caught.  Catching them without a subtransaction is safe because the
 * conversion is pure computation on memory: it takes no lock, opens no
 * file and changes no shared state.  Other errors (a cancel, out of
 * memory) are thrown on.  The depth limit also bounds every later walk
 * over the value, by tuvl or by PostgreSQL.
 */
#define JSON_MAX_DEPTH 512

/* Does the text nest arrays and objects deeper than JSON_MAX_DEPTH? */
static bool
json_too_deep(const char *s, size_t len)
{
	int			depth = 0;
	bool		in_string = false;

	for (size_t i = 0; i < len; i++)
	{
		char		c = s[i];

		if (in_string)
		{
			if (c == '\\')
				i++;
			else if (c == '"')
				in_string = false;
		}
		else if (c == '"')
			in_string = true;
		else if (c == '[' || c == '{')
		{
			if (++depth > JSON_MAX_DEPTH)
				return true;
		}
		else if (c == ']' || c == '}')
			depth--;
	}
	return false;
}

/* Errors of jsonb_in that are about the text, not about the server. */
static bool
is_data_error(int sqlerrcode)
{
	return ERRCODE_TO_CATEGORY(sqlerrcode) == ERRCODE_DATA_EXCEPTION ||
		ERRCODE_TO_CATEGORY(sqlerrcode) == ERRCODE_PROGRAM_LIMIT_EXCEEDED;
}

/* jsonb_in on text known to be valid JSON; NULL with *why on a data error. */
static Jsonb *
jsonb_from_valid_text(const char *text, const char **why)
{
	MemoryContext oldcxt = CurrentMemoryContext;
	Jsonb	   *volatile result = NULL;

	PG_TRY();
	{
		result = JsonFromCString(text);
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		if (!is_data_error(geterrcode()))
			PG_RE_THROW();
		MemoryContextSwitchTo(oldcxt);
		edata = CopyErrorData();
		FlushErrorState();
		*why = psprintf("holds a value PostgreSQL cannot store (%s)", edata->message);
		FreeErrorData(edata);
	}
	PG_END_TRY();
	return result;
}

/*
 * Parse len bytes of text from outside as JSON; text[len] must be the
 * terminating NUL (it is not copied: a response may be megabytes).
 * Returns NULL, with *why set to the reason ("is not valid JSON", ...: it
 * completes a sentence whose subject is the text), when it cannot be
 * stored as jsonb; never raises for anything the text holds.  why may be
 * NULL.
 */
Jsonb *
JsonParseExternal(const char *text, size_t len, const char **why)
{
	const char *dummy;
	JsonLexContext *lex;

	if (why == NULL)
		why = &dummy;
	*why = NULL;
	if (text == NULL || memchr(text, '\0', len) != NULL)
	{
		*why = "contains NUL bytes";
		return NULL;
	}
	if (!pg_verifymbstr(text, len, true))
	{
		*why = "is not valid text in the database encoding";
		return NULL;
	}
	if (json_too_deep(text, len))
	{
		*why = psprintf("nests arrays or objects deeper than %d levels", JSON_MAX_DEPTH);
		return NULL;
	}
	lex = makeJsonLexContextCstringLen((char *) text, len, GetDatabaseEncoding(), true);
	if (pg_parse_json(lex, &nullSemAction) != JSON_SUCCESS)
	{
		*why = "is not valid JSON";
		return NULL;
	}
	Assert(text[len] == '\0');
	return jsonb_from_valid_text(text, why);
}

/*
 * Parse a NUL-terminated text from outside (a model, a server) as JSON;
 * NULL when it cannot be stored as jsonb.  Never raises on bad input.
 */
Jsonb *
JsonParseSafe(const char *text, size_t len)
{
	if (text == NULL || strlen(text) != len)
		return NULL;
	return JsonParseExternal(text, len, NULL);
}

/*
 * Text from outside made valid in the database encoding: every byte
 * sequence that is not a character of it, and every NUL, becomes U+FFFD
 * (in UTF-8) or "?" (in other encodings).  Header values, URLs and error
 * messages of servers go through this before they reach the journal,
 * where one invalid byte would make the whole block unreadable.  Returns
 * a palloc'd copy.
 */
char *
TextMakeValid(const char *s, size_t len)
{
	int			encoding = GetDatabaseEncoding();
	const char *replacement = encoding == PG_UTF8 ? "\xef\xbf\xbd" : "?";
	StringInfoData buf;
	size_t		i = 0;

	if (memchr(s, '\0', len) == NULL && pg_verifymbstr(s, len, true))
		return pnstrdup(s, len);
	initStringInfo(&buf);
	while (i < len)
	{
		int			l = s[i] == '\0' ? -1 :
		pg_encoding_verifymbchar(encoding, s + i, (int) Min(len - i, INT_MAX));

		if (l <= 0)
		{
			appendStringInfoString(&buf, replacement);
			i++;
		}
		else
		{
			appendBinaryStringInfo(&buf, s + i, l);
			i += l;
		}
	}
	return buf.data;
}

Jsonb *
JsonEmptyObject(void)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	return JsonObjEnd(&b);
}

bool
JsonIsObject(Jsonb *j)
{
	return j != NULL && JB_ROOT_IS_OBJECT(j) && !JB_ROOT_IS_SCALAR(j);
}

Jsonb *
JsonStringValue(const char *s)
{
	JsonbValue	v;

	v.type = jbvString;
	v.val.string.val = (char *) s;
	v.val.string.len = strlen(s);
	return JsonbValueToJsonb(&v);
}

/*
 * The context without its private keys (those starting with "_"): the
 * only part of a run's context a model may ever see.
 */
Jsonb *
JsonPublicContext(Jsonb *ctx)
{
	JsonbParseState *state = NULL;
	JsonbIterator *it;
	JsonbValue	v;
	JsonbIteratorToken tok;

	if (!JsonIsObject(ctx))
		return JsonEmptyObject();
	pushJsonbValue(&state, WJB_BEGIN_OBJECT, NULL);
	it = JsonbIteratorInit(&ctx->root);
	while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
	{
		bool		private;

		if (tok != WJB_KEY)
			continue;
		private = v.val.string.len > 0 && v.val.string.val[0] == '_';
		if (!private)
			pushJsonbValue(&state, WJB_KEY, &v);
		tok = JsonbIteratorNext(&it, &v, true);
		if (!private)
			pushJsonbValue(&state, WJB_VALUE, &v);
	}
	return JsonbValueToJsonb(pushJsonbValue(&state, WJB_END_OBJECT, NULL));
}

/* a || b for two objects: keys of b win. */
Jsonb *
JsonMerge(Jsonb *a, Jsonb *b)
{
	return DatumGetJsonbP(DirectFunctionCall2(jsonb_concat,
											  JsonbPGetDatum(a),
											  JsonbPGetDatum(b)));
}

/* Push a Jsonb as one value (a container stays packed; no copy of its data). */
static void
push_jsonb(JsonbParseState **state, JsonbIteratorToken tok, Jsonb *val)
{
	JsonbValue	v;

	if (JB_ROOT_IS_SCALAR(val))
	{
		/* a scalar is stored as a one-element raw array: unwrap it */
		v = *getIthJsonbValueFromContainer(&val->root, 0);
		pushJsonbValue(state, tok, &v);
		return;
	}
	v.type = jbvBinary;
	v.val.binary.data = &val->root;
	v.val.binary.len = VARSIZE(val) - VARHDRSZ;
	pushJsonbValue(state, tok, &v);
}

/*
 * obj with key set to value (any JSON value), in one pass: the other
 * fields are carried over without being unpacked, and the result is
 * serialized once (a large value is copied once, not three times).
 */
Jsonb *
JsonSetKey(Jsonb *obj, const char *key, Jsonb *value)
{
	JsonbParseState *state = NULL;
	JsonbIterator *it;
	JsonbValue	v;
	JsonbValue	k;
	JsonbIteratorToken tok;
	size_t		klen = strlen(key);
	JsonbValue *res;

	pushJsonbValue(&state, WJB_BEGIN_OBJECT, NULL);
	if (obj && JsonIsObject(obj))
	{
		it = JsonbIteratorInit(&obj->root);
		while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
		{
			bool		same;

			if (tok != WJB_KEY)
				continue;
			same = (size_t) v.val.string.len == klen && memcmp(v.val.string.val, key, klen) == 0;
			k = v;
			tok = JsonbIteratorNext(&it, &v, true);
			if (same)
				continue;
			pushJsonbValue(&state, WJB_KEY, &k);
			pushJsonbValue(&state, WJB_VALUE, &v);
		}
	}
	k.type = jbvString;
	k.val.string.val = (char *) key;
	k.val.string.len = klen;
	pushJsonbValue(&state, WJB_KEY, &k);
	if (value == NULL)
	{
		v.type = jbvNull;
		pushJsonbValue(&state, WJB_VALUE, &v);
	}
	else
		push_jsonb(&state, WJB_VALUE, value);
	res = pushJsonbValue(&state, WJB_END_OBJECT, NULL);
	return JsonbValueToJsonb(res);
}

/* ---------------------------------------------------------------- arrays
 *
 * A JsonArrayBuilder writes an array in jsonb's own format, element by
 * element, without a tree of JsonbValues: the elements' bytes are copied
 * as they are.  An array's data is its header, a JEntry per element, then
 * the elements' data; a container or numeric element starts at a 4-byte
 * boundary, the padding before it counted in its length; every
 * JB_OFFSET_STRIDE'th JEntry holds the element's end offset instead of its
 * length (convertJsonbArray, jsonb_util.c).  Offsets are relative to the
 * start of the data, which is itself 4-byte aligned in any array, so the
 * elements of an existing array keep their bytes, JEntries and offsets.
 */

/* Room for one more JEntry. */
static void
array_grow(JsonArrayBuilder *ab)
{
	if (ab->n < ab->max)
		return;
	ab->max = Max(ab->max * 2, 16);
	ab->entries = ab->entries ? repalloc(ab->entries, sizeof(JEntry) * ab->max)
		: palloc(sizeof(JEntry) * ab->max);
}

/*
 * Start an array holding prefix's elements (prefix: an array, or NULL or
 * anything else for none); O(size of prefix), a copy of its bytes.
 */
void
JsonArrayBuildStart(JsonArrayBuilder *ab, Jsonb *prefix)
{
	memset(ab, 0, sizeof(JsonArrayBuilder));
	initStringInfo(&ab->data);
	if (prefix && JB_ROOT_IS_ARRAY(prefix) && !JB_ROOT_IS_SCALAR(prefix))
	{
		int			n = JB_ROOT_COUNT(prefix);
		char	   *base = (char *) &prefix->root.children[n];

		ab->max = Max(n, 8);
		ab->entries = palloc(sizeof(JEntry) * ab->max);
		memcpy(ab->entries, prefix->root.children, sizeof(JEntry) * n);
		ab->n = n;
		appendBinaryStringInfo(&ab->data, base, (char *) prefix + VARSIZE(prefix) - base);
	}
}

/* Append bytes of type (a JENTRY_IS* value) as the next element. */
static void
array_add_bytes(JsonArrayBuilder *ab, uint32 type, const char *bytes, int len, bool aligned)
{
	static const char zeros[ALIGNOF_INT] = {0};
	int			pad = aligned ? INTALIGN(ab->data.len) - ab->data.len : 0;
	JEntry		meta;

	if ((int64) ab->data.len + pad + len > JENTRY_OFFLENMASK)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("total size of jsonb array elements exceeds the maximum of %u bytes",
						JENTRY_OFFLENMASK)));
	array_grow(ab);
	appendBinaryStringInfo(&ab->data, zeros, pad);
	appendBinaryStringInfo(&ab->data, bytes, len);
	meta = type | (pad + len);
	if (ab->n % JB_OFFSET_STRIDE == 0)
		meta = type | JENTRY_HAS_OFF | ab->data.len;
	ab->entries[ab->n++] = meta;
}

/*
 * Append elem (any JSON value; NULL is JSON null): a container is copied
 * whole, a scalar as the one element of its raw-scalar array.
 */
void
JsonArrayBuildAdd(JsonArrayBuilder *ab, Jsonb *elem)
{
	JEntry		je;
	uint32		type;

	if (elem == NULL)
	{
		array_add_bytes(ab, JENTRY_ISNULL, NULL, 0, false);
		return;
	}
	if (!JB_ROOT_IS_SCALAR(elem))
	{
		array_add_bytes(ab, JENTRY_ISCONTAINER, (char *) &elem->root,
						VARSIZE(elem) - VARHDRSZ, true);
		return;
	}
	/* a raw scalar: [header, one JEntry, its data from an aligned start] */
	je = elem->root.children[0];
	type = je & JENTRY_TYPEMASK;
	array_add_bytes(ab, type, (char *) &elem->root.children[1], JBE_OFFLENFLD(je),
					type == JENTRY_ISNUMERIC);
}

/* The bytes the array would take as a jsonb datum, with extra bytes more data. */
int64
JsonArrayBuildSize(JsonArrayBuilder *ab, int64 extra)
{
	return (int64) VARHDRSZ + sizeof(uint32) + (int64) sizeof(JEntry) * (ab->n + 1) +
		ab->data.len + extra;
}

/*
 * The size of the array's header and JEntries (checked against jsonb's
 * limit), which go in front of its data.
 */
static int
array_head(JsonArrayBuilder *ab)
{
	int			head = VARHDRSZ + sizeof(uint32) + sizeof(JEntry) * ab->n;

	if ((int64) head - VARHDRSZ + ab->data.len > JENTRY_OFFLENMASK)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("total size of jsonb array elements exceeds the maximum of %u bytes",
						JENTRY_OFFLENMASK)));
	return head;
}

/* Write the array's varlena header, its header and its JEntries at res. */
static void
array_write_head(JsonArrayBuilder *ab, Jsonb *res, int head)
{
	SET_VARSIZE(res, head + ab->data.len);
	res->root.header = (uint32) ab->n | JB_FARRAY;
	if (ab->n > 0)
		memcpy(res->root.children, ab->entries, sizeof(JEntry) * ab->n);
}

/*
 * The array: the header and the JEntries go in front of the data, in the
 * data's own buffer (no second copy).  The builder is used up.
 */
Jsonb *
JsonArrayBuildEnd(JsonArrayBuilder *ab)
{
	int			head = array_head(ab);
	Jsonb	   *res;

	enlargeStringInfo(&ab->data, head);
	memmove(ab->data.data + head, ab->data.data, ab->data.len);
	res = (Jsonb *) ab->data.data;
	array_write_head(ab, res, head);
	if (ab->entries)
		pfree(ab->entries);
	ab->entries = NULL;
	ab->data.data = NULL;
	return res;
}

/*
 * The array built so far, as a new jsonb in the current memory context;
 * the builder goes on (one copy of its bytes).
 */
Jsonb *
JsonArrayBuildCopy(JsonArrayBuilder *ab)
{
	int			head = array_head(ab);
	Jsonb	   *res = palloc(head + ab->data.len);

	array_write_head(ab, res, head);
	memcpy((char *) res + head, ab->data.data, ab->data.len);
	return res;
}

/*
 * arr (a JSON array, or NULL for an empty one) with elem appended: a copy
 * of arr's bytes and elem's, the elements are not unpacked.
 */
Jsonb *
JsonArrayAppend(Jsonb *arr, Jsonb *elem)
{
	JsonArrayBuilder ab;

	JsonArrayBuildStart(&ab, arr);
	JsonArrayBuildAdd(&ab, elem);
	return JsonArrayBuildEnd(&ab);
}

Jsonb *
JsonRemoveKey(Jsonb *obj, const char *key)
{
	return DatumGetJsonbP(DirectFunctionCall2(jsonb_delete,
											  JsonbPGetDatum(obj),
											  CStringGetTextDatum(key)));
}

/* --------------------------------------------------------------- objects
 *
 * A JsonObjBuilder writes an object in jsonb's own format, as a
 * JsonArrayBuilder writes an array: no value is unpacked into JsonbValues
 * (PostgreSQL 15's pushJsonbValue unpacks a container value scalar by
 * scalar, and JsonbValueToJsonb converts the tree back).  Each entry is a
 * key's bytes and its value's jsonb encoding: a string's bytes, a
 * numeric's varlena, nothing for a bool or null, a container's bytes as
 * they are.  JsonObjEnd orders the entries as jsonb orders keys (by
 * length, then bytewise), keeps the last value added for a key added more
 * than once (as pushJsonbValue does), and writes the header (count |
 * JB_FOBJECT), the keys' JEntries, the values' JEntries, the keys' bytes
 * and the values' bytes, a numeric or container after padding to a 4-byte
 * boundary counted in its length; of the 2n JEntries, in that order, every
 * JB_OFFSET_STRIDE'th holds its end offset instead of its length
 * (convertJsonbObject, jsonb_util.c).  The result is byte for byte what
 * pushJsonbValue and JsonbValueToJsonb make of the same calls.
 */

/* pushJsonbValue's limit on an object's pairs (JSONB_MAX_PAIRS) */
#define OBJ_MAX_PAIRS (Min(MaxAllocSize / sizeof(JsonbPair), JB_CMASK))
#define OBJ_INITIAL_BYTES 256

void
JsonObjStart(JsonObjBuilder *b)
{
	b->bytes.data = palloc(OBJ_INITIAL_BYTES);
	b->bytes.maxlen = OBJ_INITIAL_BYTES;
	b->bytes.len = 0;
	b->bytes.cursor = 0;
	b->bytes.data[0] = '\0';
	b->entries = NULL;
	b->n = 0;
	b->max = 0;
}

/*
 * Add key with a value of type (a JENTRY_IS* value) whose len bytes are at
 * ext (not copied: they must live until JsonObjEnd) or, with ext NULL, at
 * copy (copied now).
 */
static void
obj_add(JsonObjBuilder *b, const char *key, uint32 type, const char *ext,
		const char *copy, int len, bool aligned)
{
	JsonObjEntry *e;
	int			klen = strlen(key);

	if (b->n >= b->max)
	{
		if ((size_t) b->n >= OBJ_MAX_PAIRS)
			ereport(ERROR,
					(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
					 errmsg("number of jsonb object pairs exceeds the maximum allowed (%zu)",
							OBJ_MAX_PAIRS)));
		b->max = Max(b->max * 2, 8);
		b->entries = b->entries ? repalloc(b->entries, sizeof(JsonObjEntry) * b->max)
			: palloc(sizeof(JsonObjEntry) * b->max);
	}
	e = &b->entries[b->n];
	e->key_off = b->bytes.len;
	e->key_len = klen;
	appendBinaryStringInfo(&b->bytes, key, klen);
	e->order = b->n++;
	e->type = type;
	e->ext = ext;
	e->val_len = len;
	e->aligned = aligned;
	e->val_off = b->bytes.len;
	if (ext == NULL && len > 0)
		appendBinaryStringInfo(&b->bytes, copy, len);
}

/*
 * Add a container (len bytes at c) as the value; a raw scalar's container
 * adds its scalar, as pushJsonbValue does.  Not copied.
 */
static void
obj_add_container(JsonObjBuilder *b, const char *key, JsonbContainer *c, int len)
{
	if (JsonContainerIsScalar(c))
	{
		/* [header, one JEntry, its data from an aligned start] */
		JEntry		je = c->children[0];
		uint32		type = je & JENTRY_TYPEMASK;

		obj_add(b, key, type, (char *) &c->children[1], NULL, JBE_OFFLENFLD(je),
				type == JENTRY_ISNUMERIC);
		return;
	}
	obj_add(b, key, JENTRY_ISCONTAINER, (char *) c, NULL, len, true);
}

static void
obj_add_jsonb(JsonObjBuilder *b, const char *key, Jsonb *val)
{
	if (val == NULL)
		obj_add(b, key, JENTRY_ISNULL, NULL, NULL, 0, false);
	else
		obj_add_container(b, key, &val->root, VARSIZE(val) - VARHDRSZ);
}

static void
obj_add_value(JsonObjBuilder *b, const char *key, JsonbValue *val)
{
	JsonbParseState *state = NULL;

	if (val == NULL)
	{
		obj_add(b, key, JENTRY_ISNULL, NULL, NULL, 0, false);
		return;
	}
	switch (val->type)
	{
		case jbvNull:
			obj_add(b, key, JENTRY_ISNULL, NULL, NULL, 0, false);
			break;
		case jbvBool:
			obj_add(b, key, val->val.boolean ? JENTRY_ISBOOL_TRUE : JENTRY_ISBOOL_FALSE,
					NULL, NULL, 0, false);
			break;
		case jbvString:
			obj_add(b, key, JENTRY_ISSTRING, val->val.string.len > 0 ? val->val.string.val : NULL,
					NULL, val->val.string.len, false);
			break;
		case jbvNumeric:
			obj_add(b, key, JENTRY_ISNUMERIC, (char *) val->val.numeric, NULL,
					VARSIZE_ANY(val->val.numeric), true);
			break;
		case jbvBinary:
			obj_add_container(b, key, val->val.binary.data, val->val.binary.len);
			break;
		case jbvArray:
		case jbvObject:
			/* a tree in memory: pushed as the old builder pushed it */
			obj_add_jsonb(b, key, JsonbValueToJsonb(pushJsonbValue(&state, WJB_ELEM, val)));
			break;
		default:
			/* any other scalar (a datetime): through its raw-scalar jsonb */
			obj_add_jsonb(b, key, JsonbValueToJsonb(val));
			break;
	}
}

void
JsonObjAddString(JsonObjBuilder *b, const char *key, const char *val)
{
	/*
	 * Copied: the builder keeps its entries until JsonObjEnd, and a caller's
	 * string may be gone by then (a buffer on its stack).
	 */
	if (val == NULL)
		obj_add(b, key, JENTRY_ISNULL, NULL, NULL, 0, false);
	else
		obj_add(b, key, JENTRY_ISSTRING, NULL, val, strlen(val), false);
}

void
JsonObjAddInt(JsonObjBuilder *b, const char *key, int64 val)
{
	Numeric		num = int64_to_numeric(val);

	obj_add(b, key, JENTRY_ISNUMERIC, (char *) num, NULL, VARSIZE_ANY(num), true);
}

void
JsonObjAddBool(JsonObjBuilder *b, const char *key, bool val)
{
	obj_add(b, key, val ? JENTRY_ISBOOL_TRUE : JENTRY_ISBOOL_FALSE, NULL, NULL, 0, false);
}

void
JsonObjAddNull(JsonObjBuilder *b, const char *key)
{
	obj_add(b, key, JENTRY_ISNULL, NULL, NULL, 0, false);
}

/*
 * Add a value found in another Jsonb (JsonGetField), or a scalar; NULL
 * adds a JSON null.  The key is copied, the value's data is not: it must
 * live until JsonObjEnd.
 */
void
JsonObjAddValue(JsonObjBuilder *b, const char *key, JsonbValue *val)
{
	obj_add_value(b, key, val);
}

/*
 * Embed an already built jsonb (scalar, object or array) as a value; NULL
 * adds a JSON null.  Not copied until JsonObjEnd.
 */
void
JsonObjAddJsonb(JsonObjBuilder *b, const char *key, Jsonb *val)
{
	obj_add_jsonb(b, key, val);
}

/*
 * jsonb's order of keys (lengthCompareJsonbPair): shorter first, then
 * bytewise; of equal keys the one added last first.  arg: the builder's
 * bytes.
 */
static int
obj_entry_cmp(const void *a, const void *b, void *arg)
{
	const JsonObjEntry *ea = (const JsonObjEntry *) a;
	const JsonObjEntry *eb = (const JsonObjEntry *) b;
	const char *bytes = (const char *) arg;
	int			res;

	if (ea->key_len != eb->key_len)
		return ea->key_len > eb->key_len ? 1 : -1;
	res = memcmp(bytes + ea->key_off, bytes + eb->key_off, ea->key_len);
	if (res != 0)
		return res;
	return ea->order > eb->order ? -1 : 1;
}

static bool
obj_same_key(const JsonObjEntry *a, const JsonObjEntry *b, const char *bytes)
{
	return a->key_len == b->key_len &&
		memcmp(bytes + a->key_off, bytes + b->key_off, a->key_len) == 0;
}

/*
 * The object, allocated in CurrentMemoryContext.  The builder is used up.
 * Raises when the object exceeds jsonb's limits (the total size of its
 * keys and values).
 */
Jsonb *
JsonObjEnd(JsonObjBuilder *b)
{
	JsonObjEntry *e = b->entries;
	const char *bytes = b->bytes.data;
	int			n = b->n;
	int			m = 0;
	int64		datalen = 0;
	int64		head;
	uint32		off;
	JEntry	   *je;
	char	   *data;
	Jsonb	   *res;

	/* sort (unless already in order, the common case) and keep the last */
	if (n > 1)
	{
		int			i;

		for (i = 1; i < n; i++)
			if (obj_entry_cmp(&e[i - 1], &e[i], (void *) bytes) > 0)
				break;
		if (i < n)
			qsort_arg(e, n, sizeof(JsonObjEntry), obj_entry_cmp, (void *) bytes);
	}
	for (int i = 0; i < n; i++)
	{
		if (m > 0 && obj_same_key(&e[m - 1], &e[i], bytes))
			continue;
		if (m != i)
			e[m] = e[i];
		m++;
	}

	/* the data's size: keys, then values after their padding */
	for (int i = 0; i < m; i++)
		datalen += e[i].key_len;
	for (int i = 0; i < m; i++)
	{
		if (e[i].aligned)
			datalen = INTALIGN(datalen);
		datalen += e[i].val_len;
	}
	head = sizeof(uint32) + (int64) sizeof(JEntry) * 2 * m;
	if (head + datalen > JENTRY_OFFLENMASK)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("total size of jsonb object elements exceeds the maximum of %u bytes",
						JENTRY_OFFLENMASK)));

	res = palloc(VARHDRSZ + head + datalen);
	SET_VARSIZE(res, VARHDRSZ + head + datalen);
	res->root.header = (uint32) m | JB_FOBJECT;
	je = res->root.children;
	data = (char *) &je[2 * m];
	off = 0;
	for (int i = 0; i < m; i++)
	{
		memcpy(data + off, bytes + e[i].key_off, e[i].key_len);
		off += e[i].key_len;
		je[i] = JENTRY_ISSTRING |
			(i % JB_OFFSET_STRIDE == 0 ? JENTRY_HAS_OFF | off : (uint32) e[i].key_len);
	}
	for (int i = 0; i < m; i++)
	{
		int			idx = m + i;
		uint32		pad = e[i].aligned ? INTALIGN(off) - off : 0;
		const char *src = e[i].ext ? e[i].ext : bytes + e[i].val_off;

		if (pad > 0)
			memset(data + off, 0, pad);
		if (e[i].val_len > 0)
			memcpy(data + off + pad, src, e[i].val_len);
		off += pad + e[i].val_len;
		je[idx] = e[i].type |
			(idx % JB_OFFSET_STRIDE == 0 ? JENTRY_HAS_OFF | off : pad + e[i].val_len);
	}
	Assert(off == datalen);

	pfree(b->bytes.data);
	if (b->entries)
		pfree(b->entries);
	b->bytes.data = NULL;
	b->entries = NULL;
	return res;
}

/*
 * At most maxbytes bytes of text, cut at a character boundary, with
 * "..." when something was cut: safe to quote in a message.
 */
char *
JsonClipText(const char *text, int maxbytes)
{
	int			len = strlen(text);

	if (len <= maxbytes)
		return (char *) text;
	return psprintf("%s...", pnstrdup(text, pg_mbcliplen(text, len, maxbytes)));
}

/* The number of elements of a JSON array; 0 for anything else or NULL. */
int
JsonArraySize(Jsonb *j)
{
	if (j == NULL || !JB_ROOT_IS_ARRAY(j) || JB_ROOT_IS_SCALAR(j))
		return 0;
	return JsonContainerSize(&j->root);
}

/* Element i of a JSON array (0 <= i < JsonArraySize). */
Jsonb *
JsonArrayAt(Jsonb *j, int i)
{
	return JsonValueToJsonb(getIthJsonbValueFromContainer(&j->root, i));
}

/* The JSON text of j, or "null" for NULL. */
char *
JsonText(Jsonb *j)
{
	return j ? JsonbToCString(NULL, &j->root, VARSIZE(j)) : "null";
}

/* A copy of j (or NULL) in cxt. */
Jsonb *
JsonCopyTo(Jsonb *j, MemoryContext cxt)
{
	Jsonb	   *copy;

	if (j == NULL)
		return NULL;
	copy = MemoryContextAlloc(cxt, VARSIZE(j));
	memcpy(copy, j, VARSIZE(j));
	return copy;
}

/* text with every occurrence of needle replaced by with (text itself when none). */
char *
TextReplaceAll(const char *text, const char *needle, const char *with)
{
	StringInfoData buf;
	const char *p = text;
	const char *hit;
	size_t		nl = strlen(needle);

	if (nl == 0 || strstr(text, needle) == NULL)
		return (char *) text;
	initStringInfo(&buf);
	while ((hit = strstr(p, needle)) != NULL)
	{
		appendBinaryStringInfo(&buf, p, hit - p);
		appendStringInfoString(&buf, with);
		p = hit + nl;
	}
	appendStringInfoString(&buf, p);
	return buf.data;
}

/* Text without surrounding whitespace and ``` fences. */
char *
TextStripFences(const char *text)
{
	const char *s = text;
	const char *e;
	char	   *out;

	while (*s && isspace((unsigned char) *s))
		s++;
	e = s + strlen(s);
	while (e > s && isspace((unsigned char) e[-1]))
		e--;
	if (e - s >= 6 && strncmp(s, "```", 3) == 0 && strncmp(e - 3, "```", 3) == 0)
	{
		const char *nl = memchr(s, '\n', e - s);

		s = nl ? nl + 1 : s + 3;
		e -= 3;
		while (e > s && isspace((unsigned char) e[-1]))
			e--;
	}
	out = pnstrdup(s, e - s);
	return out;
}
