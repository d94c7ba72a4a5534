/*-------------------------------------------------------------------------
 *
 * runtime.h
 *	  A run as a state machine: one transition per step.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_RUNTIME_H
#define TUVL_RUNTIME_H

#include "nodes/pg_list.h"
#include "utils/jsonb.h"
#include "utils/palloc.h"
#include "utils/timestamp.h"

#include "status.h"
#include "workflow.h"

/* Why a transition was cancelled from outside its step. */
typedef enum RunCancel
{
	RUN_CANCEL_NONE = 0,
	RUN_CANCEL_BATCH,			/* it outlived its batch's time budget */
	RUN_CANCEL_ABORT			/* an operator aborted the run meanwhile */
} RunCancel;

/*
 * A run held by a worker or by the synchronous path.  The committed
 * checkpoint lives in the top fields; a transition stages its results in
 * the "next" fields, which RunApplyTransition copies over once the
 * transaction that wrote them has committed.
 */
typedef struct RunState
{
	int64		id;
	int			attempt;		/* the lease fence */
	char	   *workflow;
	int			version;
	Oid			principal;		/* user code runs as this role */
	char	   *principal_name;
	bool		replay;			/* a tuvl.replay(): effects are served from
								 * its fixture, secrets are never read */
	int			notify_step;	/* >= 0: a run a notify hook started, which
								 * executes this step and ends (hook.c) */
	TimestampTz started_at;		/* when a worker (or tuvl.run()) first took it */
	char	   *traceparent;	/* the trace it continues (start_run()), or
								 * NULL */
	int64		parent_id;		/* the run whose Workflow step started it, or
								 * 0 */
	int			priority;		/* start_run's: model admission orders by it */
	TimestampTz created_at;		/* when it was started: the model configs it
								 * uses are the versions of then (0: now) */
	char	   *trace_id;		/* its trace id, once computed (trace.c) */
	uint64		trace_seed;		/* the hash of trace_id its span ids start
								 * from */
	Jsonb	   *context;
	RunStatus	status;			/* as of the last transition applied */
	int			step;			/* index of the current step; -1: start */
	int			last_seq;
	Jsonb	   *step_state;		/* state within the current step, or NULL:
								 * {step, entry_seq, effects: [...]} */
	Jsonb	   *compensation;	/* tuvl.runs.compensation, or NULL */
	Jsonb	   *control;		/* operator directives seen at the last
								 * checkpoint (tuvl.runs.control), or NULL */
	uint64		control_gen;	/* TuvlControlGen() before control was read */
	int			recoveries;		/* times reclaimed from a dead holder since
								 * its last progress (tuvl.runs.recoveries) */
	MemoryContext cxt;			/* "tuvl run": owns the fields above */

	/* effects (see effect.c), owned by cxt */
	Jsonb	   *fresh_effect;	/* result of the pending effect, to journal */
	struct JournalEvent *fresh_event;	/* ... as journaled this transition: a
										 * guardrail may mask its payload */
	struct EffectRequest *send; /* to perform once the transition commits */
	MemoryContext send_cxt;		/* owns send: gone once it is performed */
	TimestampTz send_at;		/* not before this time */
	void	   *transfer;		/* the worker's in-flight HttpTransfer */

	/* during a transition */
	Jsonb	   *working_effects;	/* journaled results of this step's
									 * effects */
	List	   *effects_added;	/* records appended since (EffectRecord), not
								 * yet folded into working_effects */
	Jsonb	   *working_judged; /* its judge calls' results by id (judge.c),
								 * or NULL */
	char	   *fresh_judge;	/* the id of the judge call that came back in
								 * this transition, or NULL */
	int			entry_seq;		/* seq of this step's agent_started */
	int			fresh_position; /* where the fresh effect landed, or -1 */
	bool		took_effect;	/* an effect's result was journaled */
	int			effect_call;	/* > 0: effects belong to this agent tool call */
	Jsonb	   *tool_args;		/* the model's arguments of that call */
	List	   *step_events;	/* journal events the step added */
	WorkflowDef *wf;			/* the run's workflow version */
	Jsonb	   *artifacts;		/* pinned artifact versions, loaded on use */

	/*
	 * The last model request a step journaled, whole: the next turn journals
	 * what changed since (llm_request.c).  llm_prev_step NULL: not known in
	 * memory (read the journal).
	 */
	char	   *llm_prev_step;
	Jsonb	   *llm_prev_request;

	/*
	 * An agent step's loop as it stood at the top of its latest turn
	 * (agent_loop.c), so that the step's next transition resumes there
	 * instead of replaying every turn before it: one palloc'd chunk in cxt,
	 * or NULL.  Staged like the fields below.
	 */
	void	   *agent_resume;

	/* staged by RunAdvance, applied by RunApplyTransition */
	char	   *next_llm_prev_step;
	Jsonb	   *next_llm_prev_request;
	void	   *next_agent_resume;
	Jsonb	   *next_context;
	Jsonb	   *next_step_state;
	Jsonb	   *next_control;
	uint64		next_control_gen;
	Jsonb	   *next_compensation;
	bool		compensation_changed;
	char	   *key_base;		/* replay: idempotency keys of the recording */
	int			next_step;
	int			next_seq;
	RunStatus	next_status;
	char	   *next_error;

	/* set when RunAdvance raised because of a cancel from outside */
	RunCancel	cancelled;
	bool		solo;			/* its next transition runs alone (a worker
								 * found its step slow) */
	bool		advanced;		/* worker.c: made a transition this batch */
	bool		unstarted;		/* worker.c: claimed, no transition made since */
	TimestampTz retry_at;		/* worker.c: a transition that waited too long
								 * for a lock is made again then (0: ready) */
	int			lock_waits;		/* ... how many times in a row */
	bool		released;		/* worker.c: ... and is let go */
} RunState;

extern RunState *RunStateCreate(MemoryContext parent, int64 id, int attempt,
								const char *workflow, int version, Oid principal,
								const char *principal_name, Jsonb *context,
								const char *current_step, int last_seq,
								Jsonb *step_state);
extern void RunStateFree(RunState *run);
extern void RunAdvance(RunState *run);
extern void RunApplyTransition(RunState *run);
extern void RunFail(RunState *run, const char *error);
extern void RunFailAs(RunState *run, const char *error, const char *error_type);
extern void RunRefreshControl(RunState *run);
extern void RunForgetSend(RunState *run);
extern void RunKeepJsonb(RunState *run, Jsonb **field, Jsonb *value);

#endif							/* TUVL_RUNTIME_H */
