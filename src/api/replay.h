/*-------------------------------------------------------------------------
 *
 * replay.h
 *	  What a replay serves the step kinds (replay.c), through the
 *	  executor's hooks (ExecutorReplayChildren, ExecutorReplayControl).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_REPLAY_H
#define TUVL_REPLAY_H

#include "runtime.h"

extern Jsonb *ReplayTakeChildren(RunState *run, const char *step);
extern Jsonb *ReplayControl(RunState *run, const char *step, Jsonb *control);

#endif							/* TUVL_REPLAY_H */
