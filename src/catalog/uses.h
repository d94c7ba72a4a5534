/*-------------------------------------------------------------------------
 *
 * uses.h
 *	  What a workflow or an artifact may use by name: model configs, child
 *	  workflows and artifacts of its own role, or of another role that
 *	  granted their use (tuvl.grant_use).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_USES_H
#define TUVL_USES_H

#include "utils/jsonb.h"

typedef enum UseKind
{
	USE_WORKFLOW,
	USE_LLM,
	USE_ARTIFACT
} UseKind;

/*
 * Who names an object, for the check when a run uses it: a workflow (its
 * owner, and the owners it pinned at registration) or an artifact (a
 * guardrail naming a judge model: its owner, no pins).
 */
typedef struct UseReferrer
{
	Oid			owner;			/* the role whose definition names it */
	Jsonb	   *pins;			/* {"<kind>:<name>": owner oid}, or NULL */
	bool		unpinned;		/* a workflow version registered before 0.3.0,
								 * which has no pins */
	const char *what;			/* "workflow \"x\"", for messages */
} UseReferrer;

extern const char *UseKindName(UseKind kind);
extern const char *UseKindWhat(UseKind kind);
extern bool UseKindFromName(const char *name, UseKind *kind);
extern char *UsePinKey(UseKind kind, const char *name, int version);
extern Oid	UseContentOwner(UseKind kind, const char *name, int version);
extern const char *UseSuggest(UseKind kind, const char *name);
extern bool UseAllowed(UseKind kind, const char *name, Oid owner, Oid user);
extern void UseCheck(const UseReferrer *by, UseKind kind, const char *name, int version, Oid owner);

#endif							/* TUVL_USES_H */
