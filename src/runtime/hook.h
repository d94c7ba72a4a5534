/*-------------------------------------------------------------------------
 *
 * hook.h
 *	  Observe-only hooks around steps and agent tool calls.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_HOOK_H
#define TUVL_HOOK_H

#include "runtime.h"
#include "workflow.h"

typedef enum HookEvent
{
	HOOK_BEFORE_STEP,
	HOOK_AFTER_STEP,
	HOOK_ON_ERROR,
	HOOK_BEFORE_TOOL,
	HOOK_AFTER_TOOL
} HookEvent;

extern void HookFire(RunState *run, const StepDef *step, HookEvent event, const char *tool,
					 const char *signal, const char *error);

#endif							/* TUVL_HOOK_H */
