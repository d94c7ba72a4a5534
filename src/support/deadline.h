/*-------------------------------------------------------------------------
 *
 * deadline.h
 *	  Cancelling what runs too long: a step past its timeout, a transition
 *	  past its batch's time budget, an agent's tool past its limit.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_DEADLINE_H
#define TUVL_DEADLINE_H

#include "utils/timestamp.h"

/* Why a statement was cancelled (the earliest deadline that passed). */
typedef enum DeadlineKind
{
	DEADLINE_NONE = 0,
	DEADLINE_BATCH,				/* the batch's time budget: move the
								 * transition out of the batch */
	DEADLINE_STEP,				/* the step's timeout */
	DEADLINE_TOOL				/* an agent tool's limit */
} DeadlineKind;

extern int	DeadlinePush(DeadlineKind kind, TimestampTz at);
extern DeadlineKind DeadlinePop(int level);
extern DeadlineKind DeadlineFiredOuter(void);
extern void DeadlineUserCode(bool running);
extern void DeadlineReset(void);

#endif							/* TUVL_DEADLINE_H */
