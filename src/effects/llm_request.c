/*-------------------------------------------------------------------------
 *
 * llm_request.c
 *	  The request of an llm_turn, journaled as what changed since the
 *	  previous turn of the same step.
 *
 * An agent sends the model the whole conversation on every turn, so
 * journaling each request whole would make an agent's journal grow with
 * the square of its turns.  An agent's first llm_turn carries its request
 * whole ("request"); each later one of the same step in the same run
 * carries "request_delta" against the request before it:
 *
 *	  {"set": {key: value},			keys new or changed
 *	   "append": {key: [elements]},	arrays that grew at the end only
 *	   "drop": [key, ...]}			keys no longer sent
 *
 * (each part only when not empty).  The conversation ("messages", or the
 * Responses API's "input") grows at its end, so a turn's delta is the new
 * messages only, and the tools and settings, unchanged, cost nothing.
 *
 * "The request before it" is that of the previous llm_turn of the same
 * step (agent_id), judges' calls left out: they always carry their
 * request whole.  The writer reads it back from the journal in its own
 * transaction, never from memory, so a rolled-back transition or a run
 * taken over by another worker cannot make writer and reader disagree.
 * A full request starts each chain again; readers (tuvl.llm_request(),
 * tuvl.pin_run()) rebuild a turn from the last full request at or before
 * it and the deltas after that, in one pass.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"

#include "jsonutil.h"
#include "llm.h"
#include "security.h"
#include "spiutil.h"
#include "tokens.h"

PG_FUNCTION_INFO_V1(tuvl_llm_request);

/*
 * The payloads of agent_id's llm_turns in run $1 from the last one at or
 * before seq $3 that carries its request whole, to seq $3, oldest first.
 */
static const char chain_sql[] =
"SELECT payload FROM tuvl.events "
"WHERE run_id OPERATOR(pg_catalog.=) $1 AND type OPERATOR(pg_catalog.=) 'llm_turn' "
"  AND agent_id OPERATOR(pg_catalog.=) $2 AND NOT payload OPERATOR(pg_catalog.?) 'judge' "
"  AND seq OPERATOR(pg_catalog.<=) $3 "
"  AND seq OPERATOR(pg_catalog.>=) (SELECT pg_catalog.max(seq) FROM tuvl.events "
"      WHERE run_id OPERATOR(pg_catalog.=) $1 AND type OPERATOR(pg_catalog.=) 'llm_turn' "
"        AND agent_id OPERATOR(pg_catalog.=) $2 AND seq OPERATOR(pg_catalog.<=) $3 "
"        AND payload OPERATOR(pg_catalog.?) 'request' "
"        AND NOT payload OPERATOR(pg_catalog.?) 'judge') "
"ORDER BY seq";

static bool
json_equal(Jsonb *a, Jsonb *b)
{
	return compareJsonbContainers(&a->root, &b->root) == 0;
}

/*
 * Whether two values (as a container's iterator or lookup gives them:
 * containers left packed, in place) are equal, without copying them: the
 * same bytes are the same value, and only values that differ in their
 * bytes are compared as JSON (a request's messages are the same bytes
 * from one turn to the next).
 */
static bool
value_equal(JsonbValue *a, JsonbValue *b)
{
	if (a->type == jbvBinary && b->type == jbvBinary)
	{
		if (a->val.binary.len == b->val.binary.len &&
			memcmp(a->val.binary.data, b->val.binary.data, a->val.binary.len) == 0)
			return true;
		return compareJsonbContainers(a->val.binary.data, b->val.binary.data) == 0;
	}
	return json_equal(JsonValueToJsonb(a), JsonValueToJsonb(b));
}

/* Whether v is an array (a container, not a scalar), and its size. */
static bool
value_is_array(JsonbValue *v, int *n)
{
	if (v->type != jbvBinary || !JsonContainerIsArray(v->val.binary.data) ||
		JsonContainerIsScalar(v->val.binary.data))
		return false;
	*n = JsonContainerSize(v->val.binary.data);
	return true;
}

/* The elements of array arr from index from on, as an array. */
static Jsonb *
array_tail(JsonbValue *arr, int from)
{
	JsonbParseState *state = NULL;
	int			n = JsonContainerSize(arr->val.binary.data);

	pushJsonbValue(&state, WJB_BEGIN_ARRAY, NULL);
	for (int i = from; i < n; i++)
		pushJsonbValue(&state, WJB_ELEM, getIthJsonbValueFromContainer(arr->val.binary.data, i));
	return JsonbValueToJsonb(pushJsonbValue(&state, WJB_END_ARRAY, NULL));
}

/* Whether array prev is a proper beginning of array next; *n: prev's size. */
static bool
array_grew(JsonbValue *prev, JsonbValue *next, int *n)
{
	int			m;

	if (!value_is_array(prev, n) || !value_is_array(next, &m) || m <= *n)
		return false;
	for (int i = 0; i < *n; i++)
	{
		JsonbValue *a = getIthJsonbValueFromContainer(prev->val.binary.data, i);
		JsonbValue *b = getIthJsonbValueFromContainer(next->val.binary.data, i);
		bool		same = value_equal(a, b);

		pfree(a);
		pfree(b);
		if (!same)
			return false;
	}
	return true;
}

/*
 * The delta that turns request prev into request next (both JSON
 * objects).  Linear in the requests' size, and copies only what changed.
 */
Jsonb *
LlmRequestDelta(Jsonb *prev, Jsonb *next)
{
	JsonObjBuilder set;
	JsonObjBuilder append;
	JsonObjBuilder delta;
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;
	bool		any_set = false;
	bool		any_append = false;
	Jsonb	   *drop = NULL;

	JsonObjStart(&set);
	JsonObjStart(&append);
	it = JsonbIteratorInit(&next->root);
	while (JsonObjectNext(&it, &key, &v))
	{
		JsonbValue *was = JsonGetField(prev, key);
		int			n;

		if (was && value_equal(was, &v))
			continue;
		if (was && array_grew(was, &v, &n))
		{
			JsonObjAddJsonb(&append, key, array_tail(&v, n));
			any_append = true;
		}
		else
		{
			JsonObjAddJsonb(&set, key, JsonValueToJsonb(&v));
			any_set = true;
		}
	}
	it = JsonbIteratorInit(&prev->root);
	while (JsonObjectNext(&it, &key, &v))
		if (JsonGetField(next, key) == NULL)
			drop = JsonArrayAppend(drop, JsonStringValue(key));

	JsonObjStart(&delta);
	if (any_set)
		JsonObjAddJsonb(&delta, "set", JsonObjEnd(&set));
	if (any_append)
		JsonObjAddJsonb(&delta, "append", JsonObjEnd(&append));
	if (drop)
		JsonObjAddJsonb(&delta, "drop", drop);
	return JsonObjEnd(&delta);
}

/*
 * A request being rebuilt: each key's value as a list of parts, the first
 * its value and any further ones arrays appended to it, joined once at the
 * end, so that a chain of n deltas costs the size of the result, not n
 * copies of it.
 */
typedef struct RequestKey
{
	char	   *key;
	List	   *parts;
} RequestKey;

static RequestKey *
find_key(List *keys, const char *key)
{
	ListCell   *lc;

	foreach(lc, keys)
	{
		RequestKey *k = lfirst(lc);

		if (k->parts != NIL && strcmp(k->key, key) == 0)
			return k;
	}
	return NULL;
}

static List *
set_key(List *keys, char *key, Jsonb *value)
{
	RequestKey *k = find_key(keys, key);

	if (k == NULL)
	{
		k = palloc(sizeof(RequestKey));
		k->key = key;
		keys = lappend(keys, k);
	}
	k->parts = list_make1(value);
	return keys;
}

/* Apply one payload ("request" or "request_delta") to the keys. */
static List *
apply_payload(List *keys, Jsonb *payload)
{
	Jsonb	   *full = JsonGetField(payload, "request") ? JsonGetJsonb(payload, "request") : NULL;
	Jsonb	   *delta = JsonGetField(payload, "request_delta") ? JsonGetJsonb(payload, "request_delta") : NULL;
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (full)
	{
		keys = NIL;
		if (!JsonIsObject(full))
			return keys;
		it = JsonbIteratorInit(&full->root);
		while (JsonObjectNext(&it, &key, &v))
			keys = set_key(keys, key, JsonValueToJsonb(&v));
		return keys;
	}
	if (delta == NULL || !JsonIsObject(delta))
		return keys;
	for (int i = 0; i < JsonArraySize(JsonGetJsonb(delta, "drop")); i++)
	{
		JsonbValue *d = getIthJsonbValueFromContainer(&JsonGetJsonb(delta, "drop")->root, i);
		RequestKey *k;

		if (d->type != jbvString)
			continue;
		k = find_key(keys, pnstrdup(d->val.string.val, d->val.string.len));
		if (k)
			k->parts = NIL;
	}
	if (JsonGetField(delta, "set"))
	{
		it = JsonbIteratorInit(&JsonGetJsonb(delta, "set")->root);
		while (JsonObjectNext(&it, &key, &v))
			keys = set_key(keys, key, JsonValueToJsonb(&v));
	}
	if (JsonGetField(delta, "append"))
	{
		it = JsonbIteratorInit(&JsonGetJsonb(delta, "append")->root);
		while (JsonObjectNext(&it, &key, &v))
		{
			RequestKey *k = find_key(keys, key);

			if (k)
				k->parts = lappend(k->parts, JsonValueToJsonb(&v));
			else
				keys = set_key(keys, key, JsonValueToJsonb(&v));
		}
	}
	return keys;
}

/* One key's value: its parts joined. */
static Jsonb *
key_value(RequestKey *k)
{
	JsonbParseState *state = NULL;
	ListCell   *lc;

	if (list_length(k->parts) == 1)
		return linitial(k->parts);
	pushJsonbValue(&state, WJB_BEGIN_ARRAY, NULL);
	foreach(lc, k->parts)
	{
		Jsonb	   *part = lfirst(lc);
		int			n = JsonArraySize(part);

		for (int i = 0; i < n; i++)
			pushJsonbValue(&state, WJB_ELEM, getIthJsonbValueFromContainer(&part->root, i));
	}
	return JsonbValueToJsonb(pushJsonbValue(&state, WJB_END_ARRAY, NULL));
}

static Jsonb *
keys_request(List *keys)
{
	JsonObjBuilder b;
	ListCell   *lc;

	JsonObjStart(&b);
	foreach(lc, keys)
	{
		RequestKey *k = lfirst(lc);

		if (k->parts != NIL)
			JsonObjAddJsonb(&b, k->key, key_value(k));
	}
	return JsonObjEnd(&b);
}

/*
 * The whole request of the last of payloads (llm_turn payloads of one
 * step, oldest first, the first carrying its request whole), or NULL when
 * none carries a request.
 */
Jsonb *
LlmRequestRebuild(List *payloads)
{
	List	   *keys = NIL;
	bool		any = false;
	ListCell   *lc;

	foreach(lc, payloads)
	{
		Jsonb	   *p = lfirst(lc);

		if (JsonGetField(p, "request"))
			any = true;
		if (any)
			keys = apply_payload(keys, p);
	}
	return any ? keys_request(keys) : NULL;
}

/*
 * The whole request of a turn given the whole request of the turn before
 * it (NULL for none) and the turn's payload.
 */
Jsonb *
LlmRequestNext(Jsonb *prev, Jsonb *payload)
{
	JsonObjBuilder b;

	if (JsonGetField(payload, "request") || prev == NULL)
		return JsonGetField(payload, "request") ? JsonGetJsonb(payload, "request") : NULL;
	JsonObjStart(&b);
	JsonObjAddJsonb(&b, "request", prev);
	return LlmRequestRebuild(list_make2(JsonObjEnd(&b), payload));
}

/* The chain of agent_id's turns in run_id up to seq, rebuilt.  SPI connected. */
static Jsonb *
chain_request(int64 run_id, const char *agent_id, int32 seq)
{
	static const Oid types[3] = {INT8OID, TEXTOID, INT4OID};
	Datum		values[3] = {Int64GetDatum(run_id), CStringGetTextDatum(agent_id), Int32GetDatum(seq)};
	List	   *payloads = NIL;
	uint64		n;

	n = SpiExec(chain_sql, 3, types, values, NULL, SPI_OK_SELECT);
	for (uint64 i = 0; i < n; i++)
	{
		bool		isnull;
		Datum		d = SPI_getbinval(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1, &isnull);

		if (!isnull)
			payloads = lappend(payloads, DatumGetJsonbPCopy(d));
	}
	return LlmRequestRebuild(payloads);
}

/*
 * The last request agent_id's model calls in run_id journaled, rebuilt
 * from the journal; NULL when it made none.  For a run whose worker does
 * not know it (see RunState.llm_prev_request).  SPI connected.
 */
Jsonb *
LlmRequestPrev(int64 run_id, const char *agent_id)
{
	SecurityFrame frame;
	Jsonb	   *prev;

	SecurityAsOwner(&frame);
	prev = chain_request(run_id, agent_id, PG_INT32_MAX);
	SecurityRestore(&frame);
	return prev;
}

/*
 * llm_request(run_id bigint, seq integer) returns jsonb: the whole request
 * of that llm_turn event, rebuilt from the journal the caller can read;
 * NULL when there is no such llm_turn.
 */
Datum
tuvl_llm_request(PG_FUNCTION_ARGS)
{
	static const Oid types[2] = {INT8OID, INT4OID};
	int64		run_id = PG_GETARG_INT64(0);
	int32		seq = PG_GETARG_INT32(1);
	Datum		values[2] = {Int64GetDatum(run_id), Int32GetDatum(seq)};
	Jsonb	   *result = NULL;
	MemoryContext outer = CurrentMemoryContext;

	TokenRequireScope("runs:read");
	SPI_connect();
	if (SpiExec("SELECT agent_id, payload FROM tuvl.events WHERE run_id OPERATOR(pg_catalog.=) $1 "
				"AND seq OPERATOR(pg_catalog.=) $2 AND type OPERATOR(pg_catalog.=) 'llm_turn'",
				2, types, values, NULL, SPI_OK_SELECT) == 1)
	{
		bool		isnull;
		char	   *agent_id = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
		Jsonb	   *p = DatumGetJsonbPCopy(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));

		if (JsonGetField(p, "request"))
			result = JsonGetJsonb(p, "request");
		else if (agent_id && JsonGetField(p, "request_delta"))
			result = chain_request(run_id, agent_id, seq);
	}
	if (result)
		result = JsonCopyTo(result, outer);
	SPI_finish();
	if (result == NULL)
		PG_RETURN_NULL();
	PG_RETURN_JSONB_P(result);
}
