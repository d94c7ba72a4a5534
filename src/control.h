/*-------------------------------------------------------------------------
 *
 * control.h
 *	  Operator control and people in the loop.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_CONTROL_H
#define TUVL_CONTROL_H

extern int	ControlExpirePauses(void);

#endif							/* TUVL_CONTROL_H */
