/*-------------------------------------------------------------------------
 *
 * concurrency.h
 *	  Runs in flight per concurrency key, and child runs' ends.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_CONCURRENCY_H
#define TUVL_CONCURRENCY_H

#include "utils/jsonb.h"

#include "workflow.h"

/* A run's concurrency key: its workflow's concurrency.key, rendered. */
typedef struct ConcurrencyKey
{
	char	   *key;			/* NULL: the workflow sets no concurrency */
	int			limit;
} ConcurrencyKey;

extern void ConcurrencyKeyOf(WorkflowDef *wf, Jsonb *input, ConcurrencyKey *conc);
extern bool ConcurrencyHasRoom(const char *workflow, const ConcurrencyKey *conc, Oid principal);
extern void ConcurrencyAdmitDeferred(void);
extern int	ConcurrencyAdmit(const char *workflow, const char *key, int limit, Oid principal);

#endif							/* TUVL_CONCURRENCY_H */
