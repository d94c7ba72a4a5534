/*-------------------------------------------------------------------------
 *
 * executor.h
 *	  The one dispatch table of step kinds.
 *
 * Every surface that executes a step (the workers, the synchronous
 * tuvl.run(), replay, an agent dispatching a tool) goes through
 * ExecutorFor(kind)->execute, so there are no per-surface forks.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_EXECUTOR_H
#define TUVL_EXECUTOR_H

#include "runtime.h"
#include "workflow.h"

struct EffectRequest;

typedef struct StepResult
{
	bool		has_output;		/* write output to the step's output key */
	Jsonb	   *output;			/* may be a JSON null */
	char	   *signal;			/* NULL means "default" */
	bool		pending;		/* the step needs an effect first */
	struct EffectRequest *effect;	/* ... this one */
	Jsonb	   *context_merge;	/* merged into the context first, or NULL */
	char	   *exit_error;		/* why a reserved exit was taken, or NULL */
	RunStatus	park;			/* wait for someone (RUN_PAUSED,
								 * RUN_WAITING_HUMAN, RUN_WAITING_APPROVAL),
								 * or RUN_NONE */
	Jsonb	   *park_info;		/* what is awaited (step_state.awaiting) */
	List	   *consume;		/* control keys applied: removed at commit */
	Jsonb	   *control_add;	/* merged into tuvl.runs.control at commit */
	List	   *steer_done;		/* ids of control.steer messages applied */
} StepResult;

/*
 * Execute a step against ctx (the run's context, or an agent tool's view
 * of it).  Runs inside the transition's subtransaction; raises on failure,
 * which the caller turns into the "error" signal.  Before each phase an
 * executor may set StepErrorType so the failure is classified.  A step
 * that needs work outside the database sets result->pending and
 * result->effect and returns; it is executed again once the effect's
 * result is journaled, and finds it with EffectAt (see effect.c).
 */
typedef void (*StepExecuteFn) (RunState *run, const StepDef *step, Jsonb *ctx,
							   StepResult *result);

/*
 * A step kind: how to execute it, and what the rest of tuvl needs to know
 * about it.  Nothing outside a kind's executor tests the kind itself; it
 * asks its entry here.
 */
typedef struct StepExecutor
{
	StepKind	kind;
	StepExecuteFn execute;
	bool		in_transaction; /* does its work in the transition itself,
								 * not through an effect (as an agent's
								 * tool, its timeout cancels it) */
	bool		tool_callable;	/* an agent may call it as a tool */
	bool		reserved_exits; /* may end on the reserved exits
								 * (max_iterations, aborted, ...) */
	bool		controls_itself;	/* in the middle of its work (step_state
									 * is its own), it applies operator
									 * directives itself */
	bool		default_catches_all;	/* its "default" route catches every
										 * signal it does not map */
} StepExecutor;

extern const char *StepErrorType;

extern const StepExecutor *ExecutorFor(StepKind kind);
extern bool ExecutorIsReservedExit(const StepDef *step, const char *signal);

/* step_http.c */
extern void StepExecuteAPICall(RunState *run, const StepDef *step, Jsonb *ctx,
							   StepResult *result);

/* step_agent.c */
extern void StepExecuteAgent(RunState *run, const StepDef *step, Jsonb *ctx,
							 StepResult *result);

/* agent.c */
extern void StepExecuteAutonomous(RunState *run, const StepDef *step, Jsonb *ctx,
								  StepResult *result);
extern bool AgentIsReservedExit(const char *signal);

/* control.c */
extern void StepExecuteHuman(RunState *run, const StepDef *step, Jsonb *ctx,
							 StepResult *result);

/* mcp.c */
extern void StepExecuteMCP(RunState *run, const StepDef *step, Jsonb *ctx,
						   StepResult *result);

/* step_sql.c */
extern void StepExecuteFunctional(RunState *run, const StepDef *step, Jsonb *ctx,
								  StepResult *result);
extern void StepExecuteModelOp(RunState *run, const StepDef *step, Jsonb *ctx,
							   StepResult *result);

#endif							/* TUVL_EXECUTOR_H */
