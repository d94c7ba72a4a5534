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

#include "jsonutil.h"
#include "runtime.h"
#include "validate.h"
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
 * executor may set ExecutorErrorType so the failure is classified.  A step
 * that needs work outside the database sets result->pending and
 * result->effect and returns; it is executed again once the effect's
 * result is journaled, and finds it with EffectAt (see effect.c).
 */
typedef void StepExecuteFunc (RunState *run, const StepDef *step, Jsonb *ctx,
							  StepResult *result);
typedef StepExecuteFunc *StepExecuteFn;

/*
 * A step kind: how to execute it, and what the rest of tuvl needs to know
 * about it.  Nothing outside a kind's executor tests the kind itself; it
 * asks its entry here.
 */
typedef struct StepExecutor
{
	StepKind	kind;
	StepExecuteFn execute;
	bool		in_transaction; /* does its work in the transition itself, not
								 * through an effect (as an agent's tool, its
								 * timeout cancels it) */
	bool		tool_callable;	/* an agent may call it as a tool */
	const char *const *reserved_exits;	/* the exits tuvl itself takes for it
										 * (max_iterations, aborted, ...),
										 * NULL-terminated; NULL: none */
	bool		controls_itself;	/* in the middle of its work (step_state
									 * is its own), it applies operator
									 * directives itself */
	bool		default_catches_all;	/* its "default" route catches every
										 * signal it does not map */
	const char *const *keys;	/* the keys of its own a step may have,
								 * NULL-terminated (validate.c adds the common
								 * ones) */
	StepValidateFunc *validate; /* checks them; NULL: nothing to check */
	bool		rate_limited;	/* takes rate_limit (its key in keys) */
} StepExecutor;

extern const char *ExecutorErrorType;

extern void ExecutorRegister(const StepExecutor *executor);
extern const StepExecutor *ExecutorFor(StepKind kind);
extern bool ExecutorIsReservedExit(const StepDef *step, const char *signal);

/*
 * The step kinds: each kind's row of the step table, in the file of its
 * kind (init.c lists them), and its executor.
 */
extern const StepExecutor StepKindFunctional;	/* step_sql.c */
extern const StepExecutor StepKindModelOp;	/* step_sql.c */
extern const StepExecutor StepKindRouter;	/* step_router.c */
extern const StepExecutor StepKindAPICall;	/* step_http.c */
extern const StepExecutor StepKindMCP;	/* step_mcp.c */
extern const StepExecutor StepKindAgent;	/* agent_completion.c */
extern const StepExecutor StepKindHuman;	/* step_human.c */
extern const StepExecutor StepKindSleep;	/* step_sleep.c */
extern const StepExecutor StepKindWorkflow; /* step_workflow.c */

extern StepExecuteFunc StepExecuteRouter;
extern StepExecuteFunc StepExecuteAPICall;
extern StepExecuteFunc StepExecuteAgent;
extern StepExecuteFunc StepExecuteAutonomous;	/* agent_loop.c: mode
												 * autonomous */
extern StepExecuteFunc StepExecuteHuman;
extern StepExecuteFunc StepExecuteMCP;
extern StepExecuteFunc StepExecuteFunctional;
extern StepExecuteFunc StepExecuteModelOp;
extern StepExecuteFunc StepExecuteSleep;
extern void StepSleepAddWake(JsonObjBuilder *b, TimestampTz until);
extern StepExecuteFunc StepExecuteWorkflow;
extern void StepWorkflowChildEnded(int64 parent_id, bool completed);

/*
 * What a replay (replay.c) serves in place of the world, registered by
 * init.c so the step kinds below the SQL layer never call it by name:
 * the recorded outcome of a Workflow step's children, and the operator's
 * actions at the top of an agent turn.  Called only while run->replay.
 */
extern Jsonb *(*ExecutorReplayChildren) (RunState *run, const char *step);
extern Jsonb *(*ExecutorReplayControl) (RunState *run, const char *step, Jsonb *control);

extern const char *const AgentLoopReservedExits[];	/* agent_loop.c */

#endif							/* TUVL_EXECUTOR_H */
