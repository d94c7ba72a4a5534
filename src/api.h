/*-------------------------------------------------------------------------
 *
 * api.h
 *	  SQL-callable functions of schema tuvl.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_API_H
#define TUVL_API_H

#include "fmgr.h"

extern int64 ApiCreateRun(const char *workflow, Jsonb *input, bool running,
						  int *version);

#endif							/* TUVL_API_H */
