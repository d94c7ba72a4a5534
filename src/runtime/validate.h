/*-------------------------------------------------------------------------
 *
 * validate.h
 *	  Static checks of a workflow definition.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_VALIDATE_H
#define TUVL_VALIDATE_H

#include "nodes/pg_list.h"
#include "utils/jsonb.h"

typedef struct Finding
{
	const char *severity;		/* "error" or "warning" */
	char	   *path;			/* e.g. steps[2].routes.paid */
	char	   *message;		/* what is wrong and what to write instead */
} Finding;

extern List *ValidateWorkflow(Jsonb *definition, Jsonb *positions, bool strict, Jsonb **refs);
extern bool FindingsHaveErrors(List *findings);
extern char *FindingsFormat(List *findings, const char *severity);

#endif							/* TUVL_VALIDATE_H */
