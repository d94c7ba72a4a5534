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
#include "datatype/timestamp.h"
#include "utils/jsonb.h"

/* What starts a run: start_run()'s arguments, or run()'s and replay()'s. */
typedef struct RunStart
{
	const char *workflow;
	Jsonb	   *input;
	const char *key;			/* a second start with it finds the first; or NULL */
	int			priority;		/* higher first */
	int			version;		/* 0: the latest */
	const char *traceparent;	/* the caller's W3C trace context, or NULL */
	TimestampTz not_before;		/* not claimed before then; 0: at once */
	int64		parent_id;		/* a child run: its parent's id; 0: none */
	const char *parent_step;	/* ... and the Workflow step that starts it */
	int64		root_id;		/* ... and the run at the top of its tree;
								 * 0: none */
	bool		held;			/* a child beyond its step's max_parallel */
} RunStart;

extern int64 ApiCreateRun(const RunStart *start, bool running, int *version);

#endif							/* TUVL_API_H */
