/*-------------------------------------------------------------------------
 *
 * run_create.h
 *	  Creating a run (run_create.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_RUN_CREATE_H
#define TUVL_RUN_CREATE_H

#include "datatype/timestamp.h"
#include "utils/jsonb.h"

/* What starts a run: start_run()'s arguments, or run()'s and replay()'s. */
typedef struct RunStart
{
	const char *workflow;
	Jsonb	   *input;
	const char *key;			/* a second start with it finds the first; or
								 * NULL */
	int			priority;		/* higher first */
	int			version;		/* 0: the latest */
	const char *traceparent;	/* the caller's W3C trace context, or NULL */
	TimestampTz not_before;		/* not claimed before then; 0: at once */
	int64		parent_id;		/* a child run: its parent's id; 0: none */
	const char *parent_step;	/* ... and the Workflow step that starts it */
	int64		root_id;		/* ... and the run at the top of its tree; 0:
								 * none */
	bool		held;			/* a child beyond its step's max_parallel */
	int64		debounce;		/* with key: coalesce starts until the key is
								 * quiet this long (microseconds); 0: none */
} RunStart;

/*
 * Insert a run (queued, or with running = true held by this backend) and
 * journal run_queued; returns its id, and its version in *version unless
 * NULL.  A start with a key another run of the role holds returns that run.
 */
extern int64 RunCreate(const RunStart *start, bool running, int *version);
extern bool RunCreateInThisTransaction(int64 id);

#endif							/* TUVL_RUN_CREATE_H */
