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

extern SPIPlanPtr SpiPlan(const char *sql, int nargs, const Oid *argtypes);
extern uint64 SpiExec(const char *sql, int nargs, const Oid *argtypes,
					  Datum *values, const char *nulls, int expected);
extern Jsonb *SpiReturnJsonb(Jsonb *result);

#endif							/* TUVL_SPIUTIL_H */
