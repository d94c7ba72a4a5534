/*-------------------------------------------------------------------------
 *
 * deadline.c
 *	  Cancelling what runs too long: a step past its timeout, a transition
 *	  past its batch's time budget, an agent's tool past its limit.
 *
 * Deadlines nest: a worker gives a batch's transition its budget, the
 * runtime gives the step its timeout, an agent gives each tool call its
 * limit.  They live on a small stack; one timer (a USER_TIMEOUT) is
 * armed at the earliest of them.  When it fires, the earliest deadline
 * that passed is marked and the statement in progress is cancelled the
 * way statement_timeout cancels one (QueryCancelPending): whatever SQL a
 * step runs stops at its next interrupt check with SQLSTATE 57014.
 * Whoever pushed a deadline pops it, on success and in its PG_CATCH, and
 * learns from DeadlinePop whether its own deadline was the one that
 * fired; a cancel that fired for an outer deadline is for the outer
 * level to handle (DeadlineFiredOuter).
 *
 * The stack is changed only with the timer disabled, so the handler
 * never sees it half-written.  Nothing here allocates.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "storage/latch.h"
#include "utils/timeout.h"

#include "deadline.h"

#define MAX_DEADLINES 8

typedef struct Deadline
{
	DeadlineKind kind;
	TimestampTz at;
	volatile bool fired;
} Deadline;

static Deadline stack[MAX_DEADLINES];
static volatile int depth = 0;
static volatile bool in_user_code = false;
static bool registered = false;
static TimeoutId timer_id;

/*
 * Mark the earliest deadline that passed and cancel.  A batch's budget
 * cancels only user code (a step's SQL): tuvl's own work on a large
 * result is not moved out of its batch, it only ends the batch after it.
 * A budget that passes outside user code fires when user code starts.
 */
static void
fire_passed(void)
{
	TimestampTz now = GetCurrentTimestamp();
	int			best = -1;

	for (int i = 0; i < depth; i++)
		if (!stack[i].fired && stack[i].at <= now &&
			(stack[i].kind != DEADLINE_BATCH || in_user_code) &&
			(best < 0 || stack[i].at < stack[best].at))
			best = i;
	if (best < 0)
		return;
	stack[best].fired = true;
	InterruptPending = true;
	QueryCancelPending = true;
	SetLatch(MyLatch);
}

static void
deadline_handler(void)
{
	fire_passed();
}

/* Arm the timer at the earliest deadline not fired yet (or disarm it). */
static void
rearm(void)
{
	TimestampTz next = 0;

	for (int i = 0; i < depth; i++)
		if (!stack[i].fired && (next == 0 || stack[i].at < next))
			next = stack[i].at;
	if (next != 0)
		enable_timeout_at(timer_id, next);
}

static void
stop_timer(void)
{
	if (!registered)
	{
		timer_id = RegisterTimeout(USER_TIMEOUT, deadline_handler);
		registered = true;
	}
	disable_timeout(timer_id, false);
}

/*
 * Push a deadline; returns the level to give DeadlinePop.  A deadline
 * already past fires at once.
 */
int
DeadlinePush(DeadlineKind kind, TimestampTz at)
{
	int			level = depth;

	if (depth >= MAX_DEADLINES)
		elog(ERROR, "too many nested tuvl deadlines");
	stop_timer();
	stack[depth].kind = kind;
	stack[depth].at = at;
	stack[depth].fired = false;
	depth++;
	rearm();
	return level;
}

/*
 * Pop the deadlines pushed since level.  Returns the kind of the one of
 * them that fired, or DEADLINE_NONE.  A cancel that fired and was not
 * consumed yet (the code finished first) is withdrawn, so it cannot hit
 * what comes next.
 */
DeadlineKind
DeadlinePop(int level)
{
	DeadlineKind fired = DEADLINE_NONE;

	stop_timer();
	while (depth > level)
	{
		depth--;
		if (stack[depth].fired)
			fired = stack[depth].kind;
	}
	if (fired != DEADLINE_NONE)
		QueryCancelPending = false;
	rearm();
	return fired;
}

/* The kind of a deadline still on the stack that fired, or DEADLINE_NONE. */
DeadlineKind
DeadlineFiredOuter(void)
{
	for (int i = depth - 1; i >= 0; i--)
		if (stack[i].fired)
			return stack[i].kind;
	return DEADLINE_NONE;
}

/*
 * User code starts (true) or ends (false): from security.c.  A budget
 * that passed meanwhile fires now.
 */
void
DeadlineUserCode(bool running)
{
	in_user_code = running;
	if (running && depth > 0)
		fire_passed();
}

/* Forget every deadline (a worker recovering from an error). */
void
DeadlineReset(void)
{
	stop_timer();
	depth = 0;
	in_user_code = false;
}
