/*-------------------------------------------------------------------------
 *
 * artifact.h
 *	  The artifact registry.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_ARTIFACT_H
#define TUVL_ARTIFACT_H

#include "utils/jsonb.h"

#include "runtime.h"

#define ARTIFACT_PREFIX "artifact://"

/* Where a reference is used decides which types it may name. */
typedef enum ArtifactSite
{
	SITE_STEERING,				/* steering or prompt */
	SITE_PROMPT,				/* prompt */
	SITE_SKILL,
	SITE_GUARDRAIL,
	SITE_HOOK
} ArtifactSite;

/* An artifact as a run resolved a reference to it. */
typedef struct ArtifactRef
{
	char	   *name;
	int			version;
	char	   *type;
	char	   *body;			/* NULL for guardrails and hooks */
	Jsonb	   *definition;		/* the parsed YAML it was registered from */
	Oid			owner;			/* whose work the version is */
} ArtifactRef;

struct UseReferrer;

extern bool ArtifactParseRef(const char *text, char **name, int *version);
extern bool ArtifactSiteAccepts(ArtifactSite site, const char *type);
extern const char *ArtifactSiteTypes(ArtifactSite site);
extern bool ArtifactLookup(const char *name, int version, char **type, char **body,
						   int *version_out, int *latest, Jsonb **definition, Oid *owner);
extern Jsonb *ArtifactPinFloating(Jsonb *definition);
extern char *ArtifactResolveText(RunState *run, const char *text, ArtifactSite site,
								 const char *what);
extern char *ArtifactResolveTextBy(RunState *run, const char *text, ArtifactSite site,
								   const char *what, const struct UseReferrer *by);
extern bool ArtifactResolveCached(RunState *run, const char *text, ArtifactSite site,
								  ArtifactRef *ref);
extern void ArtifactResolve(RunState *run, const char *text, ArtifactSite site,
							const char *what, ArtifactRef *ref);

/* Shared with the workflow registry (api.c). */
extern void ArtifactLockName(const char *kind, const char *owner_sql, const char *name);

#endif							/* TUVL_ARTIFACT_H */
