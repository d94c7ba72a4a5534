/*-------------------------------------------------------------------------
 *
 * step_sql.c
 *	  Executors of the SQL step kinds: Functional and ModelOp.
 *
 * Both run inside the transition's subtransaction, so their database
 * writes commit with the checkpoint and journal rows that record them, or
 * not at all.  Both execute as the run's principal in a principal frame
 * (security.c): never as the worker's superuser role, security restricted,
 * in a GUC nest level that is discarded afterwards, so a step cannot
 * change the session that runs the next step.  Workflow SQL is prepared
 * once per backend and principal (plans are kept in a small list keyed by
 * SQL text and role) and values are always bound as parameters, never
 * spliced into the SQL.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "nodes/parsenodes.h"
#include "parser/analyze.h"
#include "parser/parser.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/regproc.h"

#include "effect.h"
#include "executor.h"
#include "jsonutil.h"
#include "security.h"
#include "template.h"

/* Upper bound on cached workflow statements per backend. */
#define MAX_USER_PLANS 256

typedef struct UserPlan
{
	Oid			principal;
	char	   *sql;
	SPIPlanPtr	plan;
	int			nargs;
	Oid		   *argtypes;
} UserPlan;

static List *user_plans = NIL;

/*
 * Remember a prepared statement; the oldest is dropped past the bound.
 */
static UserPlan *
remember_plan(const char *sql, SPIPlanPtr plan, int nargs, Oid *argtypes)
{
	MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);
	UserPlan   *up = palloc(sizeof(UserPlan));

	SPI_keepplan(plan);
	up->principal = GetUserId();
	up->sql = pstrdup(sql);
	up->plan = plan;
	up->nargs = nargs;
	up->argtypes = palloc(sizeof(Oid) * Max(nargs, 1));
	if (nargs > 0)
		memcpy(up->argtypes, argtypes, sizeof(Oid) * nargs);
	if (list_length(user_plans) >= MAX_USER_PLANS)
	{
		UserPlan   *oldest = linitial(user_plans);

		SPI_freeplan(oldest->plan);
		pfree(oldest->sql);
		pfree(oldest->argtypes);
		pfree(oldest);
		user_plans = list_delete_first(user_plans);
	}
	user_plans = lappend(user_plans, up);
	MemoryContextSwitchTo(old);
	return up;
}

/* The plan of sql prepared for the current role, or NULL. */
static UserPlan *
find_plan(const char *sql)
{
	Oid			me = GetUserId();
	ListCell   *lc;

	foreach(lc, user_plans)
	{
		UserPlan   *up = lfirst(lc);

		if (up->principal == me && strcmp(up->sql, sql) == 0)
			return up;
	}
	return NULL;
}

/*
 * Prepare a workflow statement, inferring the types of $n parameters the
 * way PREPARE without types does.  Exactly one statement is allowed.
 */
static UserPlan *
prepare_user_sql(const char *sql, int nvalues)
{
	UserPlan   *up = find_plan(sql);
	List	   *raw;
	Oid		   *types = NULL;
	int			ntypes = 0;
	SPIPlanPtr	plan;

	if (up && up->nargs >= nvalues)
		return up;

	raw = raw_parser(sql, RAW_PARSE_DEFAULT);
	if (list_length(raw) != 1)
		ereport(ERROR,
				(errcode(ERRCODE_SYNTAX_ERROR),
				 errmsg("a ModelOp step must contain exactly one SQL statement"),
				 errdetail("The statement text contains %d statements.", list_length(raw)),
				 errhint("Split the work into several steps, or use a Functional step.")));
	(void) parse_analyze_varparams(linitial_node(RawStmt, raw), sql, &types, &ntypes, NULL);

	/* Unused or unresolved parameters are bound as text. */
	if (ntypes < nvalues)
	{
		types = types ? repalloc(types, sizeof(Oid) * nvalues) : palloc(sizeof(Oid) * nvalues);
		for (int i = ntypes; i < nvalues; i++)
			types[i] = TEXTOID;
		ntypes = nvalues;
	}
	for (int i = 0; i < ntypes; i++)
		if (types[i] == UNKNOWNOID || types[i] == InvalidOid)
			types[i] = TEXTOID;

	plan = SPI_prepare(sql, ntypes, types);
	if (plan == NULL)
		elog(ERROR, "SPI_prepare failed: %s", SPI_result_code_string(SPI_result));
	return remember_plan(sql, plan, ntypes, types);
}

/*
 * The rows of the last SPI result as a jsonb array of objects, one per
 * row, keyed by column name.
 */
static Jsonb *
rows_to_jsonb(void)
{
	StringInfoData buf;
	TupleDesc	tupdesc;

	initStringInfo(&buf);
	appendStringInfoChar(&buf, '[');
	if (SPI_tuptable != NULL)
	{
		tupdesc = BlessTupleDesc(SPI_tuptable->tupdesc);
		for (uint64 i = 0; i < SPI_processed; i++)
		{
			Datum		rec = heap_copy_tuple_as_datum(SPI_tuptable->vals[i], tupdesc);
			Datum		json = DirectFunctionCall1(row_to_json, rec);

			if (i > 0)
				appendStringInfoChar(&buf, ',');
			appendStringInfoString(&buf, TextDatumGetCString(json));
		}
	}
	appendStringInfoChar(&buf, ']');
	return JsonFromCString(buf.data);
}

/*
 * ModelOp: render params, bind them to the step's SQL, execute it as the
 * principal and write the rows (a jsonb array) to the output key.
 */
void
StepExecuteModelOp(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	char	   *sql = JsonGetString(step->spec, "sql");
	JsonbValue *params = JsonGetField(step->spec, "params");
	int			nvalues = 0;
	Datum	   *values;
	char	   *nulls;
	char	  **texts;
	UserPlan   *up;
	SecurityFrame frame;
	int			rc;

	/* Render every parameter before touching SQL. */
	StepErrorType = "template_error";
	if (params && params->type == jbvBinary)
		nvalues = JsonContainerSize(params->val.binary.data);
	texts = palloc0(sizeof(char *) * Max(nvalues, 1));
	for (int i = 0; i < nvalues; i++)
	{
		JsonbValue *p = getIthJsonbValueFromContainer(params->val.binary.data, i);
		JsonbValue *v = TemplateRenderValue(p, ctx, NULL);

		texts[i] = v->type == jbvNull ? NULL : JsonValueToText(v);
	}

	StepErrorType = "sql_error";
	SecurityAsPrincipal(&frame, run->principal);
	up = prepare_user_sql(sql, nvalues);
	values = palloc0(sizeof(Datum) * Max(up->nargs, 1));
	nulls = palloc(Max(up->nargs, 1));
	for (int i = 0; i < up->nargs; i++)
	{
		Oid			typinput;
		Oid			typioparam;

		if (i >= nvalues || texts[i] == NULL)
		{
			nulls[i] = 'n';
			continue;
		}
		nulls[i] = ' ';
		getTypeInputInfo(up->argtypes[i], &typinput, &typioparam);
		values[i] = OidInputFunctionCall(typinput, texts[i], typioparam, -1);
	}
	rc = SPI_execute_plan(up->plan, values, nulls, false, 0);
	if (rc < 0)
		elog(ERROR, "SPI_execute_plan failed: %s", SPI_result_code_string(rc));
	result->output = rows_to_jsonb();
	SPI_freetuptable(SPI_tuptable);
	SecurityRestore(&frame);
	result->has_output = true;
}

/*
 * Functional: call f(ctx jsonb) returns jsonb as the principal.  A
 * "signal" key in an object result sets the step's signal and is not
 * written to the context.
 */
void
StepExecuteFunctional(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	char	   *fname = JsonGetString(step->spec, "function");
	char	   *sql;
	UserPlan   *up;
	SecurityFrame frame;
	Datum		values[1];
	bool		isnull;
	Datum		d;
	int			rc;

	/* the key an effect of this step would send: stable across retries, crashes and replay */
	values[0] = JsonbPGetDatum(JsonSetKey(ctx, "idempotency_key",
										  JsonStringValue(EffectKey(run, 0))));
	StepErrorType = "sql_error";
	SecurityAsPrincipal(&frame, run->principal);
	sql = psprintf("SELECT %s($1::pg_catalog.jsonb)",
				   NameListToQuotedString(stringToQualifiedNameList(fname)));
	up = find_plan(sql);
	if (up == NULL)
	{
		Oid			types[1] = {JSONBOID};
		SPIPlanPtr	plan = SPI_prepare(sql, 1, types);

		if (plan == NULL)
			elog(ERROR, "SPI_prepare failed: %s", SPI_result_code_string(SPI_result));
		up = remember_plan(sql, plan, 1, types);
	}
	rc = SPI_execute_plan(up->plan, values, NULL, false, 1);
	if (rc != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "SPI_execute_plan failed: %s", SPI_result_code_string(rc));
	if (SPI_gettypeid(SPI_tuptable->tupdesc, 1) != JSONBOID)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("function %s must return jsonb", fname),
				 errhint("Declare it as %s(ctx jsonb) RETURNS jsonb.", fname)));
	d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	if (!isnull)
		d = PointerGetDatum(DatumGetJsonbPCopy(d));
	SPI_freetuptable(SPI_tuptable);
	SecurityRestore(&frame);

	result->has_output = true;
	if (isnull)
	{
		result->output = JsonFromCString("null");
		return;
	}
	result->output = DatumGetJsonbP(d);
	if (JsonIsObject(result->output))
	{
		JsonbValue *sig = JsonGetField(result->output, "signal");

		if (sig && sig->type == jbvString)
		{
			result->signal = pnstrdup(sig->val.string.val, sig->val.string.len);
			result->output = JsonRemoveKey(result->output, "signal");
		}
	}
}
