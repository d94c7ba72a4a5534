/*-------------------------------------------------------------------------
 *
 * status.c
 *	  The one mapping between RunStatus and the text in tuvl.runs.status.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "utils/array.h"
#include "utils/builtins.h"

#include "status.h"

static const char *const status_names[] = {
	[RUN_NONE] = "none",
	[RUN_QUEUED] = "queued",
	[RUN_RUNNING] = "running",
	[RUN_COMPENSATING] = "compensating",
	[RUN_PAUSED] = "paused",
	[RUN_WAITING_HUMAN] = "waiting_human",
	[RUN_WAITING_APPROVAL] = "waiting_approval",
	[RUN_SLEEPING] = "sleeping",
	[RUN_WAITING_CHILDREN] = "waiting_children",
	[RUN_COMPLETED] = "completed",
	[RUN_FAILED] = "failed",
	[RUN_ABORTED] = "aborted",
	[RUN_COMPENSATED] = "compensated",
};

const char *
StatusName(RunStatus status)
{
	Assert(status >= RUN_NONE && status <= RUN_COMPENSATED);
	return status_names[status];
}

/*
 * The status named name.  A name tuvl never writes means the row was
 * changed by hand: that is reported, not guessed at.
 */
RunStatus
StatusFromName(const char *name)
{
	for (int s = RUN_QUEUED; s <= RUN_COMPENSATED; s++)
		if (strcmp(status_names[s], name) == 0)
			return (RunStatus) s;
	ereport(ERROR,
			(errcode(ERRCODE_DATA_CORRUPTED),
			 errmsg("\"%s\" is not a status of a tuvl run", name),
			 errdetail("tuvl.runs.status holds one of queued, running, compensating, paused, "
					   "waiting_human, waiting_approval, sleeping, waiting_children, completed, failed, aborted and compensated.")));
	return RUN_NONE;			/* keep compiler quiet */
}

/*
 * The statuses a holder executes (RUN_HELD_STATUSES_SQL) as a text[]
 * Datum, in the current memory context, for a statement's parameter.  As
 * a constant in the statement, the list would let a generic plan pick
 * the partial index on it (runs_leased_idx) and go through every held run
 * of every worker for each run it means.
 */
Datum
StatusHeldParam(void)
{
	Datum		items[2];

	items[0] = CStringGetTextDatum(StatusName(RUN_RUNNING));
	items[1] = CStringGetTextDatum(StatusName(RUN_COMPENSATING));
	return PointerGetDatum(construct_array(items, 2, TEXTOID, -1, false, TYPALIGN_INT));
}
