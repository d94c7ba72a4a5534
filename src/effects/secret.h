/*-------------------------------------------------------------------------
 *
 * secret.h
 *	  Secrets read while rendering a request, and their scrubbing
 *	  (secret.c).  A value read is in SecretUse.values until the request
 *	  is done; whatever is journaled or stored passes SecretScrub first.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_SECRET_H
#define TUVL_SECRET_H

#include "nodes/pg_list.h"
#include "utils/jsonb.h"

#include "runtime.h"
#include "template.h"

/* Secrets used while rendering one step's request. */
typedef struct SecretUse
{
	TemplateOptions opts;
	List	   *values;			/* char *, the values read */
	RunState   *run;			/* whose principal's grants apply */
	const char *named_by;		/* for messages: "LLM config \"x\"", or NULL */
	Oid			author;			/* the role that wrote what names the secrets
								 * (a model config), who must hold the grants
								 * too; InvalidOid: the principal alone */
} SecretUse;

extern void SecretUseInit(SecretUse *use, RunState *run);
extern char *SecretScrub(const char *text, List *secrets);
extern Jsonb *SecretScrubJsonb(Jsonb *j, List *secrets);

#endif							/* TUVL_SECRET_H */
