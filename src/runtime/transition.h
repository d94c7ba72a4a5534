/*-------------------------------------------------------------------------
 *
 * transition.h
 *	  What the parts of a transition share: runtime.c (the transition),
 *	  checkpoint.c (its one write) and compensation.c (undoing a run).
 *	  Not for the rest of tuvl, which uses runtime.h.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_TRANSITION_H
#define TUVL_TRANSITION_H

#include "portability/instr_time.h"

#include "executor.h"
#include "runtime.h"
#include "status.h"

/* What a transition knows before and after its step executed. */
typedef struct Transition
{
	RunState   *run;
	WorkflowDef *wf;
	const StepDef *step;
	List	   *events;			/* journaled whatever the step does */
	instr_time	start;
	bool		first_entry;	/* agent_started is among events */
	TimestampTz entered;		/* when the step was entered */
	Jsonb	   *ctx;			/* the context the step executes against */
	TimestampTz deadline;		/* when the step's time is up; 0: never */
	int			deadline_level; /* the deadline's level while it runs, or -1 */
	bool		timed_out;		/* the step was found past its deadline */
	Jsonb	   *effects;		/* working_effects once the fresh effect is in */
	Jsonb	   *judged;			/* working_judged likewise */
	bool		stopped;		/* boundary control ended the transition */
} Transition;

/*
 * Everything a transition writes at its end: the run's new row, fenced by
 * its lease, and the journal events that explain it.
 */
typedef struct Checkpoint
{
	RunStatus	status;
	Jsonb	   *context;
	const char *step;			/* the run's current step after it, or NULL */
	const char *end_name;		/* the end reached, or NULL */
	Jsonb	   *response;		/* the end's rendered response, or NULL */
	const char *error;			/* the run's error, or NULL */
	Jsonb	   *step_state;		/* state within the step, or NULL */
	List	   *consume;		/* control keys applied: removed */
	Jsonb	   *control_add;	/* merged into tuvl.runs.control */
	List	   *steer_done;		/* ids of control.steer messages applied */
	List	   *events;			/* the transition's journal events */
} Checkpoint;

/* checkpoint.c */
extern void CheckpointWrite(RunState *run, const Checkpoint *cp);

/* compensation.c */
extern bool CompensationActive(RunState *run);
extern Jsonb *CompensationTop(Jsonb *comp);
extern void CompensationRemember(RunState *run, const StepDef *step, StepResult *result);
extern const char *CompensationBegin(RunState *run, RunStatus status, const char *end_name,
									 Jsonb *response, const char *error);
extern Jsonb *CompensationContext(RunState *run, Jsonb *context);
extern void CompensationFinish(Transition *t, StepResult *result, ErrorData *edata);

#endif							/* TUVL_TRANSITION_H */
