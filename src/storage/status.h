/*-------------------------------------------------------------------------
 *
 * status.h
 *	  The statuses of a run (tuvl.runs.status), as an enum.
 *
 * C code compares RunStatus values; text appears only where a status is
 * read from or written to tuvl.runs, through StatusName and
 * StatusFromName.  SQL that lists statuses uses the macros below, so
 * each list is written once.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_STATUS_H
#define TUVL_STATUS_H

typedef enum RunStatus
{
	RUN_NONE = 0,				/* no status (a step that does not park) */
	RUN_QUEUED,
	RUN_RUNNING,
	RUN_COMPENSATING,
	RUN_PAUSED,
	RUN_WAITING_HUMAN,
	RUN_WAITING_APPROVAL,
	RUN_SLEEPING,				/* a Sleep step waits for its time (wake_at) */
	RUN_WAITING_CHILDREN,		/* a Workflow step waits for its child runs */
	/* terminal */
	RUN_COMPLETED,
	RUN_FAILED,
	RUN_ABORTED,
	RUN_COMPENSATED
} RunStatus;

/* The statuses of a run a holder executes, and of an ended run, for SQL. */
#define RUN_HELD_STATUSES_SQL "'{running,compensating}'::pg_catalog.text[]"
#define RUN_TERMINAL_STATUSES_SQL "'{completed,failed,aborted,compensated}'::pg_catalog.text[]"

extern const char *StatusName(RunStatus status);
extern RunStatus StatusFromName(const char *name);
extern Datum StatusHeldParam(void);

/* Has the run ended? */
static inline bool
RunStatusIsTerminal(RunStatus status)
{
	return status >= RUN_COMPLETED;
}

/* Is the run executed by whoever holds its lease (running, compensating)? */
static inline bool
RunStatusIsHeld(RunStatus status)
{
	return status == RUN_RUNNING || status == RUN_COMPENSATING;
}

/*
 * Does the run wait for someone (an operator, a person, an approver)?
 * A sleeping run waits for its time, and counts as still going.
 */
static inline bool
RunStatusIsParked(RunStatus status)
{
	return status == RUN_PAUSED || status == RUN_WAITING_HUMAN ||
		status == RUN_WAITING_APPROVAL;
}

#endif							/* TUVL_STATUS_H */
