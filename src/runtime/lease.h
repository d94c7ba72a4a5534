/*-------------------------------------------------------------------------
 *
 * lease.h
 *	  Claiming runs with SKIP LOCKED, renewing and reclaiming leases.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_LEASE_H
#define TUVL_LEASE_H

#include "nodes/pg_list.h"
#include "utils/palloc.h"

extern List *LeaseClaim(MemoryContext runs_cxt, int max_runs, int64 epoch,
						int lease_ms, bool *more);
extern List *LeaseRenew(List *runs, int lease_ms);
extern int	LeaseQueuedPrincipals;
extern uint64 LeaseReclaim(void);
extern uint64 LeaseRelease(int n, const int64 *ids, const int32 *attempts, bool *released);

#endif							/* TUVL_LEASE_H */
