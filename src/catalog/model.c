/*-------------------------------------------------------------------------
 *
 * model.c
 *	  Model configurations: tuvl.register_llm(), the checks of a config,
 *	  and the versions a run sees.
 *
 * A config is versioned: a run reads the version that was current when
 * it was created (LlmConfigLoad's as_of), so a config changed while a run
 * waits does not change the run.  Its API key is named, never stored
 * here: llm.c puts the secret into a header only when it builds a
 * request.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <math.h>

#include "common/hashfn.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/json.h"
#include "utils/jsonb.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/numeric.h"
#include "utils/timestamp.h"

#include "jsonutil.h"
#include "llm.h"
#include "template.h"
#include "retry.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"
#include "suggest.h"
#include "uses.h"
#include "workflow.h"
#include "yamlparse.h"
#include "tokens.h"

PG_FUNCTION_INFO_V1(tuvl_register_llm);

static void check_headers(const char *name, Jsonb *def);
static void check_limits(const char *name, Jsonb *def);
static void check_price(const char *name, Jsonb *def);

/*
 * Check an LLM config's definition (raises for a bad one); returns its
 * name.
 */
static char *
check_config(Jsonb *def)
{
	char	   *name;
	char	   *provider;
	char	   *base_url;
	JsonbValue *v;
	int			ms;

	if (!JsonIsObject(def))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("an LLM config must be a YAML mapping"),
				 errhint("Write name, provider, base_url and model keys.")));
	name = JsonGetString(def, "name");
	provider = JsonGetString(def, "provider");
	base_url = JsonGetString(def, "base_url");
	if (name == NULL || strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.") != strlen(name) || *name == '\0')
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("an LLM config needs a name made of letters, digits, _, - and ."),
				 errhint("Write for example name: default.")));
	if (provider == NULL || (strcmp(provider, "openai") != 0 && strcmp(provider, "anthropic") != 0 &&
							 strcmp(provider, "openai_responses") != 0))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\": provider must be openai, openai_responses or anthropic", name),
				 errhint("Use openai for any OpenAI-compatible /chat/completions server (Ollama, vLLM, LiteLLM), "
						 "openai_responses for OpenAI's /responses API.")));
	if (base_url == NULL || (strncmp(base_url, "http://", 7) != 0 && strncmp(base_url, "https://", 8) != 0))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\": base_url must be an http or https URL", name),
				 errhint("For example base_url: https://api.openai.com/v1.")));
	if (JsonGetString(def, "model") == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\" is missing required key \"model\"", name)));
	v = JsonGetField(def, "timeout");
	if (v && !DurationFromJson(v, &ms))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\": timeout must be a duration such as 60s", name)));
	v = JsonGetField(def, "params");
	if (v && !(v->type == jbvBinary && JsonContainerIsObject(v->val.binary.data)))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\": params must be a mapping such as { temperature: 0 }", name)));
	check_headers(name, def);
	check_limits(name, def);
	check_price(name, def);
	if (JsonGetField(def, "params") && JsonGetField(JsonGetJsonb(def, "params"), "stream"))
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("LLM config \"%s\": params.stream is not available in this version of tuvl", name),
				 errdetail("tuvl reads each model answer whole, as one durable effect."),
				 errhint("Remove stream from params.")));
	v = JsonGetField(def, "structured_outputs");
	if (v && v->type != jbvBool)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\": structured_outputs must be true or false", name)));
	if (v && v->val.boolean && strcmp(provider, "anthropic") == 0)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("LLM config \"%s\": structured_outputs is not available for provider anthropic", name),
				 errdetail("The Messages API has no response format; the answer's format is in the system prompt."),
				 errhint("Remove structured_outputs.")));
	v = JsonGetField(def, "api_key_secret");
	if (v && v->type != jbvString)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\": api_key_secret must name a secret given to tuvl.set_secret", name)));
	{
		static const char *const keys[] = {"name", "provider", "base_url", "model", "timeout",
		"params", "api_key_secret", "headers", "description", "structured_outputs", "limits", "price", NULL};
		JsonbIterator *it = JsonbIteratorInit(&def->root);
		char	   *key;
		bool		known;

		/* a key a model config takes does something; any other is refused */
		while (JsonObjectNext(&it, &key, v = palloc(sizeof(JsonbValue))))
		{
			known = false;
			for (int i = 0; keys[i]; i++)
				known |= strcmp(keys[i], key) == 0;
			if (!known && SuggestName(key, keys))
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("LLM config \"%s\": unknown key \"%s\"", name, key),
						 errhint("Did you mean \"%s\"?", SuggestName(key, keys))));
			if (!known)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("LLM config \"%s\": unknown key \"%s\"", name, key),
						 errhint("A model config takes name, provider, base_url, model, timeout, params, "
								 "api_key_secret, headers, structured_outputs, limits, price and description; request parameters such as "
								 "temperature go under params.")));
		}
	}
	return name;
}

/*
 * headers: a mapping of header names to text, which may name secrets
 * ("{{ secrets.azure_key }}"); the headers tuvl sets itself for the body
 * cannot be replaced.
 */
static void
check_headers(const char *name, Jsonb *def)
{
	JsonbValue *v = JsonGetField(def, "headers");
	JsonbIterator *it;
	JsonbValue	hv;
	char	   *key;

	if (v == NULL)
		return;
	if (!(v->type == jbvBinary && JsonContainerIsObject(v->val.binary.data)))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\": headers must be a mapping such as { api-key: \"{{ secrets.azure_key }}\" }", name)));
	it = JsonbIteratorInit(&JsonGetJsonb(def, "headers")->root);
	while (JsonObjectNext(&it, &key, &hv))
	{
		if (*key == '\0' || strspn(key, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_") != strlen(key))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("LLM config \"%s\": \"%s\" is not a header name", name, key)));
		if (pg_strcasecmp(key, "content-type") == 0 || pg_strcasecmp(key, "content-length") == 0 ||
			pg_strcasecmp(key, "host") == 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("LLM config \"%s\": header \"%s\" is set by tuvl", name, key)));
		if (hv.type != jbvString)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("LLM config \"%s\": header \"%s\" must be text", name, key)));
	}
}

/*
 * The mapping under key of a config (raises when it is something else), or
 * NULL when absent; every key in it must be one of keys, else an error
 * naming its path (limits.rpn).
 */
static Jsonb *
check_mapping(const char *name, Jsonb *def, const char *key, const char *const *keys,
			  const char *example)
{
	JsonbValue *v = JsonGetField(def, key);
	Jsonb	   *m;
	JsonbIterator *it;
	JsonbValue	item;
	char	   *k;

	if (v == NULL)
		return NULL;
	if (!(v->type == jbvBinary && JsonContainerIsObject(v->val.binary.data)))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\": %s must be a mapping", name, key),
				 errhint("For example %s: %s.", key, example)));
	m = JsonGetJsonb(def, key);
	it = JsonbIteratorInit(&m->root);
	while (JsonObjectNext(&it, &k, &item))
	{
		bool		known = false;
		StringInfoData all;

		for (int i = 0; keys[i]; i++)
			known |= strcmp(keys[i], k) == 0;
		if (known)
			continue;
		initStringInfo(&all);
		for (int i = 0; keys[i]; i++)
			appendStringInfo(&all, "%s%s", i == 0 ? "" : keys[i + 1] ? ", " : " and ", keys[i]);
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\": unknown key \"%s.%s\"", name, key, k),
				 errhint("%s takes %s, for example %s: %s.", key, all.data, key, example)));
	}
	return m;
}

/* A number of a mapping as a double (false: not a number). */
static bool
number_of(Jsonb *m, const char *key, double *out)
{
	JsonbValue *v = JsonGetField(m, key);

	if (v == NULL || v->type != jbvNumeric)
		return false;
	*out = DatumGetFloat8(DirectFunctionCall1(numeric_float8, NumericGetDatum(v->val.numeric)));
	return true;
}

/*
 * limits: {rpm, tpm, concurrency}, each a whole number of at least 1
 * (admission.c enforces them).
 */
static void
check_limits(const char *name, Jsonb *def)
{
	static const char *const keys[] = {"rpm", "tpm", "concurrency", NULL};
	Jsonb	   *m = check_mapping(name, def, "limits", keys, "{ rpm: 600, tpm: 150000, concurrency: 50 }");

	for (int i = 0; m && keys[i]; i++)
	{
		double		d;

		if (JsonGetField(m, keys[i]) == NULL)
			continue;
		if (!number_of(m, keys[i], &d) || d != floor(d) || d < 1 || d > PG_INT32_MAX)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("LLM config \"%s\": limits.%s must be a whole number of at least 1", name, keys[i]),
					 errhint("For example limits: { rpm: 600, tpm: 150000, concurrency: 50 }; leave a limit out for none.")));
	}
}

/* price: {input, output, cached_input}, per million tokens, each >= 0. */
static void
check_price(const char *name, Jsonb *def)
{
	static const char *const keys[] = {"input", "output", "cached_input", NULL};
	Jsonb	   *m = check_mapping(name, def, "price", keys, "{ input: 0.15, output: 0.60, cached_input: 0.075 }");

	for (int i = 0; m && keys[i]; i++)
	{
		double		d;

		if (JsonGetField(m, keys[i]) == NULL)
			continue;
		if (!number_of(m, keys[i], &d) || d < 0 || isinf(d) || isnan(d))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("LLM config \"%s\": price.%s must be a number of at least 0", name, keys[i]),
					 errdetail("Prices are per million tokens, in the currency max_cost is written in."),
					 errhint("For example price: { input: 0.15, output: 0.60, cached_input: 0.075 }.")));
	}
	if (m && JsonGetField(m, "input") == NULL && JsonGetField(m, "output") == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("LLM config \"%s\": price needs input or output", name),
				 errhint("For example price: { input: 0.15, output: 0.60 }.")));
}

/*
 * register_llm(source): validate and store (or replace) a model config.
 */
Datum
tuvl_register_llm(PG_FUNCTION_ARGS)
{
	char	   *source = text_to_cstring(PG_GETARG_TEXT_PP(0));
	Jsonb	   *def = YamlToJsonb(source, "LLM config", NULL);
	char	   *name = check_config(def);
	char	   *provider = JsonGetString(def, "provider");

	TokenRequireScope("workflows:write");
	SPI_connect();
	SecurityCheckNameOwner("LLM config", name,
						   SecurityNameOwner("SELECT owner FROM tuvl.llms WHERE name OPERATOR(pg_catalog.=) $1",
											 name));
	{
		static const Oid types[5] = {TEXTOID, TEXTOID, TEXTOID, JSONBOID, REGROLEOID};
		static const Oid version_types[2] = {TEXTOID, REGROLEOID};

		/*
		 * a new version: the row of the name (locked by the upsert) numbers
		 * it
		 */
		SecurityExecArgs("INSERT INTO tuvl.llms (name, provider, source, definition, owner, version) "
						 "VALUES ($1, $2, $3, $4, $5, 1) ON CONFLICT (name) DO UPDATE SET "
						 "provider = excluded.provider, source = excluded.source, "
						 "definition = excluded.definition, updated_at = pg_catalog.now(), "
						 "version = tuvl.llms.version OPERATOR(pg_catalog.+) 1",
						 SPI_OK_INSERT, 5, types, CStringGetTextDatum(name),
						 CStringGetTextDatum(provider), CStringGetTextDatum(source),
						 JsonbPGetDatum(def), ObjectIdGetDatum(GetUserId()));
		SecurityExecArgs("INSERT INTO tuvl.llm_versions (name, version, provider, source, definition, registered_by) "
						 "SELECT l.name, l.version, l.provider, l.source, l.definition, $2 "
						 "FROM tuvl.llms l WHERE l.name OPERATOR(pg_catalog.=) $1",
						 SPI_OK_INSERT, 2, version_types, CStringGetTextDatum(name),
						 ObjectIdGetDatum(GetUserId()));
	}
	SPI_finish();
	PG_RETURN_VOID();
}

/*
 * Model config versions, cached per process.  A run uses the versions
 * current when it was created, and a version never changes once
 * registered, so a process reads a name's versions once and resolves its
 * runs' from memory, not with a statement per model call.  The versions
 * are read again for a run created after they were read (one registered
 * in between would be missing), and every VERSIONS_TTL_MS.
 */
#define VERSIONS_TTL_MS 10000

typedef struct LlmVersions
{
	char		name[NAMEDATALEN];	/* hash key (longer names are not cached) */
	TimestampTz loaded_at;
	int			n;
	int		   *versions;		/* ascending */
	TimestampTz *created;
	Jsonb	  **defs;
	Oid		   *registered_by;	/* whose work each version is */
	MemoryContext cxt;			/* owns the arrays */
} LlmVersions;

static HTAB *versions_cache = NULL;

/* name's versions, read now, into entry e (its old arrays freed). */
static void
versions_load(LlmVersions *e, const char *name)
{
	static const Oid types[1] = {TEXTOID};
	Datum		values[1] = {CStringGetTextDatum(name)};
	uint64		n;
	MemoryContext old;
	SecurityFrame frame;

	/* empty until read whole: an error leaves it to be read next time */
	e->n = 0;
	e->loaded_at = 0;
	if (e->cxt)
		MemoryContextReset(e->cxt);
	else
		e->cxt = AllocSetContextCreate(CacheMemoryContext, "tuvl model configs", ALLOCSET_SMALL_SIZES);
	SecurityAsOwner(&frame);
	n = SpiExec("SELECT version, created_at, definition, registered_by::pg_catalog.oid FROM tuvl.llm_versions "
				"WHERE name OPERATOR(pg_catalog.=) $1 ORDER BY version", 1, types, values, NULL,
				SPI_OK_SELECT);
	SecurityRestore(&frame);
	old = MemoryContextSwitchTo(e->cxt);
	e->n = (int) n;
	e->versions = palloc(sizeof(int) * (n + 1));
	e->created = palloc(sizeof(TimestampTz) * (n + 1));
	e->defs = palloc(sizeof(Jsonb *) * (n + 1));
	e->registered_by = palloc(sizeof(Oid) * (n + 1));
	for (uint64 i = 0; i < n; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	td = SPI_tuptable->tupdesc;
		bool		isnull;

		e->versions[i] = DatumGetInt32(SPI_getbinval(tup, td, 1, &isnull));
		e->created[i] = DatumGetTimestampTz(SPI_getbinval(tup, td, 2, &isnull));
		e->defs[i] = DatumGetJsonbPCopy(SPI_getbinval(tup, td, 3, &isnull));
		e->registered_by[i] = DatumGetObjectId(SPI_getbinval(tup, td, 4, &isnull));
	}
	MemoryContextSwitchTo(old);
	e->loaded_at = GetCurrentTimestamp();
}

/*
 * The version of e a run created at as_of uses: the newest registered by
 * then; for a config first registered later, its first version.  -1 when
 * e has none.
 */
static int
version_as_of(LlmVersions *e, TimestampTz as_of)
{
	for (int i = e->n - 1; i >= 0; i--)
		if (e->created[i] <= as_of)
			return i;
	return e->n > 0 ? 0 : -1;
}

/* The definition and version of name that a run created at as_of uses. */
static Jsonb *
versions_lookup(const char *name, TimestampTz as_of, int *version, Oid *owner)
{
	LlmVersions *e;
	bool		found;
	int			i;

	if (versions_cache == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = NAMEDATALEN;
		ctl.entrysize = sizeof(LlmVersions);
		ctl.hcxt = CacheMemoryContext;
		versions_cache = hash_create("tuvl model configs", 16, &ctl,
									 HASH_ELEM | HASH_STRINGS | HASH_CONTEXT);
	}
	e = hash_search(versions_cache, name, HASH_ENTER, &found);
	if (!found)
	{
		e->cxt = NULL;
		e->n = 0;
		e->loaded_at = 0;
	}
	/* read before the run was created: a version may have come since */
	if (!found || as_of > e->loaded_at ||
		TimestampDifferenceExceeds(e->loaded_at, GetCurrentTimestamp(), VERSIONS_TTL_MS))
		versions_load(e, name);
	i = version_as_of(e, as_of);
	if (i < 0)
		return NULL;
	*version = e->versions[i];
	*owner = e->registered_by[i];
	return e->defs[i];
}

/*
 * The stored config of a model, as a run created at as_of uses it (0:
 * the current one); raises when there is none.  SPI must be connected.
 * The result is in the caller's memory context.
 */
LlmConfig *
LlmConfigLoad(const char *name, TimestampTz as_of)
{
	static const Oid types[1] = {TEXTOID};
	Datum		values[1];
	bool		isnull;
	Jsonb	   *def = NULL;
	LlmConfig  *cfg = palloc0(sizeof(LlmConfig));
	JsonbValue *p;
	SecurityFrame frame;

	if (as_of != 0 && strlen(name) < NAMEDATALEN)
		def = versions_lookup(name, as_of, &cfg->version, &cfg->owner);
	else
	{
		values[0] = CStringGetTextDatum(name);
		SecurityAsOwner(&frame);
		if (SpiExec("SELECT l.definition, l.version, v.registered_by::pg_catalog.oid "
					"FROM tuvl.llms l JOIN tuvl.llm_versions v "
					"  ON v.name OPERATOR(pg_catalog.=) l.name AND v.version OPERATOR(pg_catalog.=) l.version "
					"WHERE l.name OPERATOR(pg_catalog.=) $1",
					1, types, values, NULL, SPI_OK_SELECT) == 1)
		{
			def = DatumGetJsonbPCopy(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
			cfg->version = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
			cfg->owner = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 3, &isnull));
		}
		SecurityRestore(&frame);
	}
	if (def == NULL)
	{
		const char *suggestion = UseSuggest(USE_LLM, name);

		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("LLM config \"%s\" does not exist", name),
				 suggestion ? errhint("Did you mean \"%s\"?", suggestion) :
				 errhint("Register it with tuvl.register_llm().")));
	}
	cfg->name = pstrdup(name);
	cfg->provider = JsonGetString(def, "provider");
	cfg->base_url = JsonGetString(def, "base_url");
	cfg->model = JsonGetString(def, "model");
	cfg->api_key_secret = JsonGetString(def, "api_key_secret");
	cfg->timeout_ms = 60000;
	(void) DurationFromJson(JsonGetField(def, "timeout"), &cfg->timeout_ms);
	p = JsonGetField(def, "params");
	cfg->params = p ? JsonValueToJsonb(p) : NULL;
	p = JsonGetField(def, "headers");
	cfg->headers = p ? JsonValueToJsonb(p) : NULL;
	cfg->structured_outputs = JsonGetBool(def, "structured_outputs", false);
	p = JsonGetField(def, "limits");
	if (p)
	{
		Jsonb	   *m = JsonValueToJsonb(p);

		cfg->has_limits = true;
		cfg->rpm = JsonGetInt32(m, "rpm", 0);
		cfg->tpm = JsonGetInt32(m, "tpm", 0);
		cfg->concurrency = JsonGetInt32(m, "concurrency", 0);
	}
	p = JsonGetField(def, "price");
	if (p)
	{
		Jsonb	   *m = JsonValueToJsonb(p);

		cfg->has_price = true;
		(void) number_of(m, "input", &cfg->price_input);
		(void) number_of(m, "output", &cfg->price_output);
		cfg->price_cached = cfg->price_input;
		(void) number_of(m, "cached_input", &cfg->price_cached);
	}
	return cfg;
}

/*
 * The model config name, as run uses it, when by may use it (uses.c):
 * the version's author must be the one by pinned, and the use allowed.
 * Raises otherwise, and when there is none.  SPI must be connected.
 */
LlmConfig *
LlmConfigFor(RunState *run, const char *name, const UseReferrer *by)
{
	LlmConfig  *cfg = LlmConfigLoad(name, run->created_at);

	UseCheck(by, USE_LLM, name, 0, cfg->owner);
	return cfg;
}
