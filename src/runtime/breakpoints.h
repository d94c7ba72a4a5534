/*-------------------------------------------------------------------------
 *
 * breakpoints.h
 *	  Dev mode: breakpoints and step mode (breakpoints.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_BREAKPOINTS_H
#define TUVL_BREAKPOINTS_H

extern const char *BreakpointsStop(int64 run_id, Oid principal, const char *workflow,
								   const char *step);
extern void BreakpointsRunEnded(int64 run_id);
extern void BreakpointsCount(void);
extern void BreakpointsStepMode(int64 run_id, const char *pass_step);

#endif							/* TUVL_BREAKPOINTS_H */
