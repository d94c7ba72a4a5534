/*-------------------------------------------------------------------------
 *
 * timers.h
 *	  Durable wake-ups, run by the workers' maintenance (timers.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_TIMERS_H
#define TUVL_TIMERS_H

#include "utils/jsonb.h"

struct SPITupleTable;

extern int	TimersExpirePauses(void);
extern int	TimersWakeSleepers(void);
extern void TimersJournalRequeued(struct SPITupleTable *tt, uint64 i, const char *kind, Jsonb *payload);

#endif							/* TUVL_TIMERS_H */
