/*-------------------------------------------------------------------------
 *
 * grant_hint.h
 *	  A hint naming the tuvl role to grant, on PostgreSQL's "permission
 *	  denied for function" of a tuvl function (grant_hint.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_GRANT_HINT_H
#define TUVL_GRANT_HINT_H

extern void GrantHintInit(void);

#endif							/* TUVL_GRANT_HINT_H */
