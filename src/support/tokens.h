/*-------------------------------------------------------------------------
 *
 * tokens.h
 *	  API tokens and the scopes they allow (tokens.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_TOKENS_H
#define TUVL_TOKENS_H

extern bool TokenHasScope(const char *scope);
extern void TokenRequireScope(const char *scope);

#endif							/* TUVL_TOKENS_H */
