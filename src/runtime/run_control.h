/*-------------------------------------------------------------------------
 *
 * run_control.h
 *	  Controlling a run from outside its holder (run_control.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_RUN_CONTROL_H
#define TUVL_RUN_CONTROL_H

#include "fmgr.h"
#include "nodes/pg_list.h"
#include "utils/jsonb.h"

#include "status.h"

/* An abort directive, as tuvl.abort_run() writes it into tuvl.runs.control. */
typedef struct AbortDirective
{
	char	   *reason;			/* NULL: none given */
	char	   *by;				/* the role that aborted, or NULL */
	char	   *error;			/* "aborted by <by>: <reason>", the run's
								 * error */
} AbortDirective;

/*
 * The answer to a run waiting for a person (tuvl.submit, tuvl.reject,
 * tuvl.decide).
 */
typedef struct PersonAnswer
{
	bool		human;			/* data for a Human step, else a decision on
								 * an agent's tool call */
	Jsonb	   *data;			/* the Human step's data, or the content
								 * accepting an MCP server's question */
	const char *action;			/* an MCP server's question: "decline" or
								 * "cancel" (tuvl.reject); NULL: accept */
	bool		approved;		/* the decision */
	const char *note;			/* the decision's note, or NULL */
	const char *by;				/* who answered; NULL: the current role */
	bool		replayed;		/* tuvl.replay() answers from its recording */
} PersonAnswer;

/*
 * A run row, locked (ControlLockRun).  A run held by a worker is never
 * written by anyone else: only a directive is stored for its holder
 * (ControlAddDirective); a run nobody holds is changed directly, under
 * this lock (ControlUpdateIdleRun).
 */
typedef struct LockedRun
{
	int64		id;
	RunStatus	status;
	char	   *principal;
	int			last_seq;
	char	   *step;			/* current_step, or NULL */
	Jsonb	   *step_state;
	Jsonb	   *control;
	Jsonb	   *compensation;
	char	   *workflow;
	int			version;
	char	   *by;				/* the role acting */
	int			lease_owner;	/* pid of the holder, or 0 */
	Oid			principal_id;
	int32		priority;
	bool		hold_here;		/* queued for this backend: wake nobody */
} LockedRun;

extern int64 ControlBeginCall(FunctionCallInfo fcinfo);
extern void ControlLockRun(int64 id, LockedRun *r, const char *action);
extern void ControlRequireStatus(LockedRun *r, const char *action, const RunStatus *allowed,
								 const char *hint);
extern void ControlUpdateIdleRun(LockedRun *r, RunStatus status, Jsonb *control, Jsonb *step_state,
								 const char *error, List *events);
extern void ControlAddDirective(LockedRun *r, Jsonb *directive);
extern Jsonb *ControlByObject(LockedRun *r);
extern void ControlAnswer(int64 run_id, const PersonAnswer *answer);
extern bool ControlAbortRequested(Jsonb *control, AbortDirective *abort);
extern char *ControlAbortError(const char *by, const char *reason);
extern void ControlAbortRun(int64 id, const char *reason, const char *by);
extern void ControlAbortChildren(int64 parent_id, const char *reason, const char *by);

#endif							/* TUVL_RUN_CONTROL_H */
