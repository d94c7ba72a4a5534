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
SPIPlanPtr
SpiPlan(const char *sql, int nargs, const Oid *argtypes)
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
		SPIPlanPtr	plan = SPI_prepare(sql, nargs, (Oid *) argtypes);

		if (plan == NULL)
			elog(ERROR, "could not prepare internal query: %s",
				 SPI_result_code_string(SPI_result));
		SPI_keepplan(plan);
		entry = hash_search(plan_cache, &sql, HASH_ENTER, &found);
		entry->plan = plan;
		return plan;
	}
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
	SPIPlanPtr	plan = SpiPlan(sql, nargs, argtypes);
	int			rc;

	rc = SPI_execute_plan(plan, values, nulls, false, 0);
	if (rc != expected)
		elog(ERROR, "internal query returned %s, expected %s",
			 SPI_result_code_string(rc), SPI_result_code_string(expected));
	return SPI_processed;
}

/*
 * The owner (a regrole) that owner_sql (one text parameter, at most one
 * row) finds for name, or InvalidOid when the name is new.  Runs as the
 * extension owner.
 */
Oid
SpiNameOwner(const char *owner_sql, const char *name)
{
	static const Oid types[1] = {TEXTOID};
	Datum		values[1];
	SecurityFrame frame;
	Oid			owner = InvalidOid;

	values[0] = CStringGetTextDatum(name);
	SecurityAsOwner(&frame);
	if (SpiExec(owner_sql, 1, types, values, NULL, SPI_OK_SELECT) == 1)
	{
		bool		isnull;
		Datum		d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);

		if (!isnull)
			owner = DatumGetObjectId(d);
	}
	SecurityRestore(&frame);
	return owner;
}

/*
 * The owner of the tuvl extension in this database: internal writes to
 * tuvl's tables run as this role (use SecurityOwnerId, which caches it).
 * Must be called inside a transaction.
 */
Oid
TuvlOwnerId(void)
{
	Relation	rel;
	ScanKeyData key;
	SysScanDesc scan;
	HeapTuple	tup;
	Oid			owner = InvalidOid;

	rel = table_open(ExtensionRelationId, AccessShareLock);
	ScanKeyInit(&key, Anum_pg_extension_extname, BTEqualStrategyNumber,
				F_NAMEEQ, CStringGetDatum("tuvl"));
	scan = systable_beginscan(rel, ExtensionNameIndexId, true, NULL, 1, &key);
	tup = systable_getnext(scan);
	if (HeapTupleIsValid(tup))
		owner = ((Form_pg_extension) GETSTRUCT(tup))->extowner;
	systable_endscan(scan);
	table_close(rel, AccessShareLock);

	if (!OidIsValid(owner))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("extension \"tuvl\" is not installed in this database"),
				 errhint("Run CREATE EXTENSION tuvl.")));
	return owner;
}
