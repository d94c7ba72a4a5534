/*-------------------------------------------------------------------------
 *
 * spiutil.c
 *	  Cached SPI plans and small execution helpers.
 *
 * Plans are prepared once per backend, kept with SPI_keepplan and found
 * again by their SQL text.  The plan cache revalidates them when the
 * tables they read change (including DROP and CREATE EXTENSION in one
 * session).  Callers must be connected to SPI.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_extension.h"
#include "commands/extension.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/syscache.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/genam.h"
#include "catalog/indexing.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/rel.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "catalog/pg_type.h"
#include "miscadmin.h"

#include "security.h"
#include "spiutil.h"

typedef struct PlanEntry
{
	const char *sql;			/* hash key: the pointer to a string literal */
	SPIPlanPtr	plan;
} PlanEntry;

static HTAB *plan_cache = NULL;

/*
 * Return a kept plan for sql.  The cache is keyed by the address of the
 * SQL string, so callers pass string literals (or other strings that live
 * as long as the backend).  Errors from SPI_prepare propagate.
 */
static SPIPlanPtr
plan_for(const char *sql, int nargs, const Oid *argtypes, int cursor_options)
{
	PlanEntry  *entry;
	bool		found;

	if (plan_cache == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(const char *);
		ctl.entrysize = sizeof(PlanEntry);
		plan_cache = hash_create("tuvl plans", 64, &ctl, HASH_ELEM | HASH_BLOBS);
	}
	entry = hash_search(plan_cache, &sql, HASH_FIND, NULL);
	if (entry)
		return entry->plan;

	{
		SPIPlanPtr	plan = SPI_prepare_cursor(sql, nargs, (Oid *) argtypes, cursor_options);

		if (plan == NULL)
			elog(ERROR, "could not prepare internal query: %s",
				 SPI_result_code_string(SPI_result));
		SPI_keepplan(plan);
		entry = hash_search(plan_cache, &sql, HASH_ENTER, &found);
		entry->plan = plan;
		return plan;
	}
}

SPIPlanPtr
SpiPlan(const char *sql, int nargs, const Oid *argtypes)
{
	return plan_for(sql, nargs, argtypes, 0);
}

/* Execute plan; expected is the SPI result code it must return. */
static uint64
exec_plan(SPIPlanPtr plan, Datum *values, const char *nulls, int expected)
{
	int			rc = SPI_execute_plan(plan, values, nulls, false, 0);

	if (rc != expected)
		elog(ERROR, "internal query returned %s, expected %s",
			 SPI_result_code_string(rc), SPI_result_code_string(expected));
	return SPI_processed;
}

/*
 * Execute a cached internal statement.  expected is the SPI result code
 * the statement must return (SPI_OK_SELECT, SPI_OK_UPDATE_RETURNING...).
 * Returns SPI_processed.
 */
uint64
SpiExec(const char *sql, int nargs, const Oid *argtypes,
		Datum *values, const char *nulls, int expected)
{
	return exec_plan(SpiPlan(sql, nargs, argtypes), values, nulls, expected);
}

/*
 * Set the planner settings in off to off, at a new GUC nest level, which
 * the caller ends with AtEOXact_GUC(true, level) (an error ends it too).
 */
static int
planner_without(const char *const *off, int noff)
{
	int			nestlevel = NewGUCNestLevel();

	for (int i = 0; i < noff; i++)
		(void) set_config_option(off[i], "off", PGC_USERSET, PGC_S_SESSION,
								 GUC_ACTION_SAVE, true, 0, false);
	return nestlevel;
}

/* Execute sql's generic plan, planned with the planner settings in off set to off. */
static uint64
exec_generic_with(const char *sql, int nargs, const Oid *argtypes, Datum *values,
				  const char *nulls, int expected, const char *const *off, int noff)
{
	int			nestlevel = planner_without(off, noff);
	uint64		n;

	n = exec_plan(plan_for(sql, nargs, argtypes, CURSOR_OPT_GENERIC_PLAN),
				  values, nulls, expected);
	AtEOXact_GUC(true, nestlevel);
	return n;
}

/*
 * SpiExec for a statement whose generic plan must reach its rows through
 * an index whatever the statistics say: planned (and planned again, after
 * an invalidation) with enable_seqscan off.  Made while the table is empty
 * or small, a generic plan would otherwise scan it sequentially, and go on
 * doing so after it grew, until an ANALYZE.
 */
uint64
SpiExecIndexed(const char *sql, int nargs, const Oid *argtypes,
			   Datum *values, const char *nulls, int expected)
{
	static const char *const off[] = {"enable_seqscan"};

	return exec_generic_with(sql, nargs, argtypes, values, nulls, expected, off, lengthof(off));
}

/*
 * SpiExecIndexed for a statement that takes a queue's rows in the order of
 * the queue's index up to a LIMIT: planned with enable_sort off as well.
 * Otherwise a plan made from statistics that show few rows queued may take
 * them from any index whose leading column the statement names and sort
 * them all for the LIMIT: the claim, through runs_status_idx rather than
 * runs_queued_fair_idx, read every queued run of the role for every claim.
 */
uint64
SpiExecOrdered(const char *sql, int nargs, const Oid *argtypes,
			   Datum *values, const char *nulls, int expected)
{
	static const char *const off[] = {"enable_seqscan", "enable_sort"};

	return exec_generic_with(sql, nargs, argtypes, values, nulls, expected, off, lengthof(off));
}

/*
 * SpiExec for a statement a worker runs on a clock (its maintenance, each
 * second, and the renewal of its leases), not once per run: planned again
 * at every execution, so that its plan follows the size tuvl.runs has
 * now.  A kept plan made while the table was empty (a fresh database, or
 * one whose runs were purged and vacuumed) stays until the next ANALYZE,
 * and read the whole table each time: a sequential scan, or, with
 * sequential scans off, the whole primary key as a nested loop's outer
 * side.  Planned afresh, the planner scales the statistics it has to the
 * pages the table has at that moment.  Sequential and bitmap scans stay
 * off: these statements read a partial index, and only a plain index
 * scan marks the entries of dead row versions it meets as dead, so that
 * the next second's scan skips them (a bitmap scan of runs_leased_idx
 * read every run that was ever held since the last vacuum, each second).
 * The planning, a fraction of a millisecond, is paid once a second, not
 * per run.
 */
uint64
SpiExecReplanned(const char *sql, int nargs, const Oid *argtypes,
				 Datum *values, const char *nulls, int expected)
{
	static const char *const off[] = {"enable_seqscan", "enable_bitmapscan"};
	int			nestlevel = planner_without(off, lengthof(off));
	int			rc;

	rc = SPI_execute_with_args(sql, nargs, (Oid *) argtypes, values, nulls, false, 0);
	AtEOXact_GUC(true, nestlevel);
	if (rc != expected)
		elog(ERROR, "internal query returned %s, expected %s",
			 SPI_result_code_string(rc), SPI_result_code_string(expected));
	return SPI_processed;
}

/*
 * The value of column (1-based) in the first row the last statement
 * returned: false when there was no row or the value is NULL.
 */
bool
SpiValue(int column, Datum *value)
{
	bool		isnull = true;

	if (SPI_processed > 0)
		*value = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, column, &isnull);
	return !isnull;
}

/*
 * A function's jsonb result, copied out of SPI's memory; disconnects
 * from SPI.
 */
Jsonb *
SpiReturnJsonb(Jsonb *result)
{
	Jsonb	   *copy = SPI_palloc(VARSIZE(result));

	memcpy(copy, result, VARSIZE(result));
	SPI_finish();
	return copy;
}

void
SpiSubxactBegin(SpiSubxact *sub)
{
	sub->cxt = CurrentMemoryContext;
	sub->owner = CurrentResourceOwner;
	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(sub->cxt);
}

void
SpiSubxactCommit(SpiSubxact *sub)
{
	ReleaseCurrentSubTransaction();
	MemoryContextSwitchTo(sub->cxt);
	CurrentResourceOwner = sub->owner;
}

/*
 * In PG_CATCH: the error raised, copied where the caller is, and the
 * subtransaction rolled back.
 */
ErrorData *
SpiSubxactAbort(SpiSubxact *sub)
{
	ErrorData  *edata;

	MemoryContextSwitchTo(sub->cxt);
	edata = CopyErrorData();
	FlushErrorState();
	RollbackAndReleaseCurrentSubTransaction();
	MemoryContextSwitchTo(sub->cxt);
	CurrentResourceOwner = sub->owner;
	return edata;
}

/*
 * An error that is not about what was being checked or rendered but stops
 * the statement: a cancel (statement_timeout, pg_cancel_backend, a step's
 * deadline), a shutdown, or memory or disk running out.  Reported as a
 * finding or a failure instead, it would let the statement run on.
 */
bool
SpiErrorStopsStatement(int sqlerrcode)
{
	int			category = ERRCODE_TO_CATEGORY(sqlerrcode);

	return category == ERRCODE_OPERATOR_INTERVENTION ||
		category == ERRCODE_INSUFFICIENT_RESOURCES;
}

/*
 * SpiSubxactAbort for a caller that reports the error as a finding or a
 * warning and goes on: an error that stops the statement is raised again
 * once the subtransaction is rolled back.
 */
ErrorData *
SpiSubxactAbortFinding(SpiSubxact *sub)
{
	ErrorData  *edata = SpiSubxactAbort(sub);

	if (SpiErrorStopsStatement(edata->sqlerrcode))
		ReThrowError(edata);
	return edata;
}
