/*-------------------------------------------------------------------------
 *
 * guardrail.h
 *	  Guardrails: checks of guardrail artifacts, run at an Agent step's
 *	  gates.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_GUARDRAIL_H
#define TUVL_GUARDRAIL_H

#include "utils/jsonb.h"


/* Where content passes a step's guardrails. */
typedef enum GuardrailGate
{
	GATE_INPUT,					/* the user text, before anything is sent */
	GATE_TOOLS,					/* each tool observation, before the model
								 * sees it (autonomous mode) */
	GATE_OUTPUT					/* the final answer, before it is written */
} GuardrailGate;

extern void GuardrailCheckDefinition(const char *name, Jsonb *definition);
extern char *GuardrailRun(Jsonb *definition, char **content, int *check_no,
						  char **check_name);
extern Jsonb *GuardrailMaskJsonb(Jsonb *definition, Jsonb *value);
extern const char *GuardrailGateName(GuardrailGate gate);

#endif							/* TUVL_GUARDRAIL_H */
