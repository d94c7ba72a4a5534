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
 * A ModelOp's rows never pile up: a DestReceiver converts each row as the
 * executor sends it and appends it to the jsonb array being built (in the
 * jsonb format itself, so no tree of the whole result is ever made), with
 * an interrupt check per row.  The step stops with an error as soon as
 * the array would pass tuvl.max_output_size, or the process has grown by
 * more than tuvl.max_worker_memory while the rows were converted; an
 * abort, the step's timeout or pg_terminate_backend stop it at the next
 * row.
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
#include "nodes/params.h"
#include "nodes/parsenodes.h"
#include "parser/analyze.h"
#include "parser/parser.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/guc.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/regproc.h"

#include "effect.h"
#include "executor.h"
#include "jsonutil.h"
#include "security.h"
#include "template.h"
#include "tuvl.h"

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
 * The process's memory is checked after so many rows, or so many more
 * bytes of output, since the last check (the sum walks every memory
 * context: a result of a few rows never pays for it).
 */
#define ROWS_PER_MEMORY_CHECK 4096
#define BYTES_PER_MEMORY_CHECK (1024 * 1024)

/*
 * The receiver of a ModelOp's rows: the array is built in the step's
 * memory context (cxt); what converting one row takes lives in row_cxt,
 * reset after each row.
 */
typedef struct RowsReceiver
{
	DestReceiver pub;
	MemoryContext cxt;			/* where the array is built */
	MemoryContext row_cxt;		/* one row's conversion */
	TupleDesc	tupdesc;		/* a blessed copy of the rows' descriptor */
	JsonArrayBuilder array;
	int64		mem_base;		/* the process's memory before the step's
								 * rows, as of the first check; -1 before */
	int			checked_len;	/* bytes of output at the last check */
	uint64		nrows;
} RowsReceiver;

/*
 * Stop the step if the process grew by more than tuvl.max_worker_memory
 * while its rows were converted.  The first check takes the baseline: the
 * process's memory then, less what the array being built holds.
 */
static void
rows_check_memory(RowsReceiver *r)
{
	int64		now = (int64) MemoryContextMemAllocated(TopMemoryContext, true);
	int64		grown;

	r->checked_len = r->array.data.len;
	if (r->mem_base < 0)
	{
		r->mem_base = now - r->array.data.maxlen - (int64) sizeof(JEntry) * r->array.max;
		return;
	}
	grown = now - r->mem_base;
	if (grown > (int64) tuvl_max_worker_memory * 1024)
	{
		ExecutorErrorType = "too_large";
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("the step's rows took more than tuvl.max_worker_memory (%s) at row " UINT64_FORMAT,
						GucsSizeText((int64) tuvl_max_worker_memory * 1024), r->nrows),
				 errdetail("The process executing the step grew by %s while the rows were converted to JSON.",
						   GucsSizeText(grown)),
				 errhint("Return fewer or smaller rows (LIMIT, fewer columns), or raise tuvl.max_worker_memory.")));
	}
}

/* The rows' descriptor: bless a copy, so that row_to_json knows the type. */
static void
rows_startup(DestReceiver *self, int operation, TupleDesc typeinfo)
{
	RowsReceiver *r = (RowsReceiver *) self;
	MemoryContext old = MemoryContextSwitchTo(r->cxt);

	/* only the last statement's rows count (a rule may add statements) */
	r->tupdesc = BlessTupleDesc(CreateTupleDescCopy(typeinfo));
	if (r->array.n > 0)
		JsonArrayBuildStart(&r->array, NULL);
	MemoryContextSwitchTo(old);
}

/*
 * One row: to JSON text (row_to_json), to jsonb, onto the array, unless
 * the array would pass tuvl.max_output_size.
 */
static bool
rows_receive(TupleTableSlot *slot, DestReceiver *self)
{
	RowsReceiver *r = (RowsReceiver *) self;
	MemoryContext old;
	HeapTuple	tuple;
	Datum		json;
	Jsonb	   *row;

	CHECK_FOR_INTERRUPTS();
	r->nrows++;
	if (r->nrows % ROWS_PER_MEMORY_CHECK == 0 ||
		r->array.data.len - r->checked_len >= BYTES_PER_MEMORY_CHECK)
		rows_check_memory(r);
	old = MemoryContextSwitchTo(r->row_cxt);
	slot_getallattrs(slot);
	tuple = heap_form_tuple(r->tupdesc, slot->tts_values, slot->tts_isnull);
	json = DirectFunctionCall1(row_to_json, HeapTupleGetDatum(tuple));
	row = DatumGetJsonbP(DirectFunctionCall1(jsonb_in, CStringGetDatum(TextDatumGetCString(json))));
	/* a container, padded to 4 bytes: at most 3 bytes more than itself */
	if (JsonArrayBuildSize(&r->array, VARSIZE(row) - VARHDRSZ + ALIGNOF_INT - 1) > tuvl_max_output_size)
	{
		ExecutorErrorType = "too_large";
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("the step's rows pass tuvl.max_output_size (%s) at row " UINT64_FORMAT,
						GucsSizeText(tuvl_max_output_size), r->nrows),
				 errdetail("The output would be larger than the limit; the statement was stopped there."),
				 errhint("Return fewer or smaller rows (LIMIT, fewer columns), or have a superuser raise tuvl.max_output_size.")));
	}
	MemoryContextSwitchTo(r->cxt);
	JsonArrayBuildAdd(&r->array, row);
	MemoryContextSwitchTo(old);
	MemoryContextReset(r->row_cxt);
	return true;
}

static void
rows_shutdown(DestReceiver *self)
{
}

static void
rows_destroy(DestReceiver *self)
{
}

/* A receiver building the array in the current memory context. */
static void
rows_receiver_init(RowsReceiver *r)
{
	memset(r, 0, sizeof(RowsReceiver));
	r->pub.receiveSlot = rows_receive;
	r->pub.rStartup = rows_startup;
	r->pub.rShutdown = rows_shutdown;
	r->pub.rDestroy = rows_destroy;
	/* the rows go to the caller, as PL/pgSQL's RETURN QUERY sends them */
	r->pub.mydest = DestTuplestore;
	r->cxt = CurrentMemoryContext;
	r->row_cxt = AllocSetContextCreate(CurrentMemoryContext, "tuvl ModelOp row",
									   ALLOCSET_DEFAULT_SIZES);
	JsonArrayBuildStart(&r->array, NULL);
	r->mem_base = -1;
}

/* The values of a statement's parameters, as the executor takes them. */
static ParamListInfo
bind_params(UserPlan *up, Datum *values, const char *nulls)
{
	ParamListInfo params;

	if (up->nargs == 0)
		return NULL;
	params = makeParamList(up->nargs);
	for (int i = 0; i < up->nargs; i++)
	{
		ParamExternData *prm = &params->params[i];

		prm->value = values[i];
		prm->isnull = nulls[i] == 'n';
		prm->pflags = PARAM_FLAG_CONST;
		prm->ptype = up->argtypes[i];
	}
	return params;
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
	RowsReceiver rows;
	SPIExecuteOptions options;
	int			rc;

	/* Render every parameter before touching SQL. */
	ExecutorErrorType = "template_error";
	if (params && params->type == jbvBinary)
		nvalues = JsonContainerSize(params->val.binary.data);
	texts = palloc0(sizeof(char *) * Max(nvalues, 1));
	for (int i = 0; i < nvalues; i++)
	{
		JsonbValue *p = getIthJsonbValueFromContainer(params->val.binary.data, i);
		JsonbValue *v = TemplateRenderValue(p, ctx, NULL);

		texts[i] = v->type == jbvNull ? NULL : JsonValueToText(v);
	}

	ExecutorErrorType = "sql_error";
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
	rows_receiver_init(&rows);
	memset(&options, 0, sizeof(options));
	options.params = bind_params(up, values, nulls);
	options.dest = (DestReceiver *) &rows;
	rc = SPI_execute_plan_extended(up->plan, &options);
	if (rc < 0)
		elog(ERROR, "SPI_execute_plan_extended failed: %s", SPI_result_code_string(rc));
	MemoryContextDelete(rows.row_cxt);
	result->output = JsonArrayBuildEnd(&rows.array);
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

	/*
	 * the key an effect of this step would send: stable across retries,
	 * crashes and replay
	 */
	values[0] = JsonbPGetDatum(JsonSetKey(ctx, "idempotency_key",
										  JsonStringValue(EffectKey(run, 0))));
	ExecutorErrorType = "sql_error";
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


/* ---------------------------------------------------------------- validation */

static const char *const functional_keys[] = {"function", NULL};
static const char *const modelop_keys[] = {"sql", "params", NULL};

static void
validate_functional(ValidateState *vs, Jsonb *step, const char *path)
{
	ValidateRequireString(vs, step, "function", path, "a Functional step");
}

static void
validate_modelop(ValidateState *vs, Jsonb *step, const char *path)
{
	JsonbValue *params = JsonGetField(step, "params");

	ValidateRequireString(vs, step, "sql", path, "a ModelOp step");
	if (params && !ValidateIsList(params))
		ValidateFinding(vs, "error", psprintf("%s.params", path),
						"params must be a list of values or templates, such as [\"{{ order_id }}\"]");
}

/* The rows of the step table (init.c) of the two SQL kinds. */
const StepExecutor StepKindFunctional = {
	.kind = STEP_FUNCTIONAL,
	.execute = StepExecuteFunctional,
	.in_transaction = true,
	.tool_callable = true,
	.keys = functional_keys,
	.validate = validate_functional,
};

const StepExecutor StepKindModelOp = {
	.kind = STEP_MODELOP,
	.execute = StepExecuteModelOp,
	.in_transaction = true,
	.tool_callable = true,
	.keys = modelop_keys,
	.validate = validate_modelop,
};
