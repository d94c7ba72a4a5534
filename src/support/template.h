/*-------------------------------------------------------------------------
 *
 * template.h
 *	  Rendering of "{{ path }}" placeholders in workflow step fields.
 *
 * See template.c for the template syntax and the rules for turning
 * referenced context values into JSON values or text.
 *
 * src/template.h
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_TEMPLATE_H
#define TUVL_TEMPLATE_H

#include "nodes/pg_list.h"
#include "utils/jsonb.h"

/*
 * Resolves the secret "name" (the path after "secrets.").  Returns a
 * palloc'd value, or NULL if no such secret exists.
 */
typedef const char *(*TemplateSecretHook) (const char *name, void *arg);

typedef struct TemplateOptions
{
	TemplateSecretHook secret_hook; /* may be NULL */
	void	   *secret_arg;
	bool		used_secret;	/* out: set true when a secret was read */
} TemplateOptions;

extern Jsonb *TemplateRenderJsonb(Jsonb *tmpl, Jsonb *context,
								  TemplateOptions *opts);
extern JsonbValue *TemplateRenderValue(JsonbValue *tmpl, Jsonb *context,
									   TemplateOptions *opts);
extern char *TemplateRenderText(const char *tmpl, Jsonb *context,
								TemplateOptions *opts);
extern JsonbValue *TemplateLookupPath(Jsonb *context, const char *path);
extern List *TemplatePlaceholders(Jsonb *tmpl);
extern bool TemplateHasPlaceholders(const char *s);

#endif							/* TUVL_TEMPLATE_H */
