/*-------------------------------------------------------------------------
 *
 * validate.h
 *	  Static checks of a workflow definition.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_VALIDATE_H
#define TUVL_VALIDATE_H

#include "nodes/pg_list.h"
#include "utils/jsonb.h"

#include "artifact.h"
#include "uses.h"

typedef struct Finding
{
	const char *severity;		/* "error" or "warning" */
	char	   *path;			/* e.g. steps[2].routes.paid */
	char	   *message;		/* what is wrong and what to write instead */
	const char *suggestion;		/* the name probably meant, or NULL */
} Finding;

/*
 * The state of one workflow's validation, opaque outside validate.c.  A
 * step kind checks its own keys (its entry of the step table, executor.h)
 * with the helpers below; each adds its findings to vs and never raises.
 */
typedef struct ValidateState ValidateState;

/* A step kind's check of its own keys; path is the step's ("steps[2]"). */
typedef void StepValidateFunc (ValidateState *vs, Jsonb *step, const char *path);

extern List *ValidateWorkflow(Jsonb *definition, Jsonb *positions, bool strict, Jsonb **refs);

/* Findings */
extern void ValidateFinding(ValidateState *vs, const char *severity, const char *path,
							const char *fmt,...) pg_attribute_printf(4, 5);
extern void ValidateUnknownKeys(ValidateState *vs, Jsonb *obj, const char *path,
								const char *const *allowed, const char *const *allowed2);
extern void ValidateUnknownKeysExcept(ValidateState *vs, Jsonb *obj, const char *path,
									  const char *const *allowed, const char *const *skip);

/* Values of a mapping, each reported at path.key when it is wrong */
extern char *ValidateRequireString(ValidateState *vs, Jsonb *obj, const char *key,
								   const char *path, const char *what);
extern void ValidateDuration(ValidateState *vs, Jsonb *obj, const char *key, const char *path);
extern void ValidateText(ValidateState *vs, Jsonb *obj, const char *key, const char *path);
extern void ValidatePositiveInt(ValidateState *vs, Jsonb *obj, const char *key, const char *path);
extern void ValidatePositiveNumber(ValidateState *vs, Jsonb *obj, const char *key,
								   const char *path);
extern void ValidateScalarMapping(ValidateState *vs, Jsonb *obj, const char *name, const char *path,
								  const char *example);
extern void ValidateRetry(ValidateState *vs, Jsonb *parent, const char *path,
						  const char *const *on_values, const char *example);
extern void ValidateSchema(ValidateState *vs, Jsonb *schema, const char *path);
extern void ValidateStepMapping(ValidateState *vs, Jsonb *step, const char *path, const char *key,
								StepValidateFunc check, const char *missing);

/* What a workflow names: registered objects, artifacts, its own steps */
extern void ValidateUse(ValidateState *vs, UseKind kind, const char *name, int version,
						const char *path);
extern bool ValidateArtifactRef(ValidateState *vs, JsonbValue *v, const char *path,
								ArtifactSite site);
extern void ValidateArtifactList(ValidateState *vs, JsonbValue *v, const char *path,
								 ArtifactSite site, const char *what);
extern void ValidateGuardrails(ValidateState *vs, JsonbValue *g, const char *path,
							   bool autonomous);
extern Jsonb *ValidateFindStep(ValidateState *vs, const char *id);
extern Jsonb *ValidateDefinition(ValidateState *vs);

/* Shapes of a value */
extern bool ValidateIsMapping(JsonbValue *v);
extern bool ValidateIsList(JsonbValue *v);
extern int	ValidateListLength(ValidateState *vs, JsonbValue *v, const char *path,
							   const char *message);
extern bool ValidateStringIn(JsonbValue *v, const char *const *options);
extern bool ValidateIsPositiveInt4(JsonbValue *v);
extern const char *ValidateTypeName(JsonbValue *v);
extern bool FindingsHaveErrors(List *findings);
extern char *FindingsFormat(List *findings, const char *severity);
extern const char *FindingsSuggestion(List *findings);

#endif							/* TUVL_VALIDATE_H */
