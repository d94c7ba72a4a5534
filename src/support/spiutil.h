/*-------------------------------------------------------------------------
 *
 * spiutil.h
 *	  Cached SPI plans and small execution helpers.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_SPIUTIL_H
#define TUVL_SPIUTIL_H

#include "executor/spi.h"
#include "utils/jsonb.h"
#include "utils/resowner.h"

extern SPIPlanPtr SpiPlan(const char *sql, int nargs, const Oid *argtypes);
extern uint64 SpiExec(const char *sql, int nargs, const Oid *argtypes,
					  Datum *values, const char *nulls, int expected);
extern uint64 SpiExecIndexed(const char *sql, int nargs, const Oid *argtypes,
							 Datum *values, const char *nulls, int expected);
extern uint64 SpiExecReplanned(const char *sql, int nargs, const Oid *argtypes,
							   Datum *values, const char *nulls, int expected);
extern uint64 SpiExecOrdered(const char *sql, int nargs, const Oid *argtypes,
							 Datum *values, const char *nulls, int expected);
extern Jsonb *SpiReturnJsonb(Jsonb *result);
extern bool SpiValue(int column, Datum *value);

/*
 * An internal subtransaction around work that may fail: begun where the
 * caller is (its memory context and resource owner), committed or rolled
 * back to there.  The struct is set before PG_TRY and not changed inside,
 * so PG_CATCH may read it.
 */
typedef struct SpiSubxact
{
	MemoryContext cxt;
	ResourceOwner owner;
} SpiSubxact;

extern void SpiSubxactBegin(SpiSubxact *sub);
extern void SpiSubxactCommit(SpiSubxact *sub);
extern ErrorData *SpiSubxactAbort(SpiSubxact *sub);
extern ErrorData *SpiSubxactAbortFinding(SpiSubxact *sub);
extern bool SpiErrorStopsStatement(int sqlerrcode);

#endif							/* TUVL_SPIUTIL_H */
