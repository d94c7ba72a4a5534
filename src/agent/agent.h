/*-------------------------------------------------------------------------
 *
 * agent.h
 *	  What the two Agent modes share: retry policy, the outcome contract.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_AGENT_H
#define TUVL_AGENT_H

#include "nodes/pg_list.h"
#include "utils/jsonb.h"

#include "guardrail.h"
#include "llm.h"
#include "runtime.h"
#include "workflow.h"

struct StepResult;

extern List *AgentOutcomeEnum(Jsonb *agent);
extern char *AgentFinalFormat(List *values);
extern Jsonb *AgentAnswerSchema(List *values);
extern char *AgentGateCheck(RunState *run, const StepDef *step, GuardrailGate gate,
							char **content);
extern char *AgentGateJudge(RunState *run, const StepDef *step, GuardrailGate gate,
							const char *subject, const char *content,
							struct StepResult *result, int64 *tokens);
extern Jsonb *AgentGateMask(RunState *run, const StepDef *step, GuardrailGate gate,
							Jsonb *value);
extern void AgentViolation(struct StepResult *result, const char *why);
extern char *AgentApplyOutcome(const char *text, List *values, struct StepResult *result);
extern bool AgentShouldRetry(Jsonb *agent, LlmReply *reply, int attempts_made,
							 int *delay_ms);
extern const char *AgentFailureType(LlmReply *reply);
extern char *AgentCostCheck(RunState *run, Jsonb *agent, LlmConfig *cfg, EffectRequest *req,
							double step_spent, int64 prev_output);
extern void AgentBudgetExceeded(struct StepResult *result, const char *why);

/* agent_validate.c */
struct ValidateState;
extern void StepValidateAgent(struct ValidateState *vs, Jsonb *step, const char *path);

#endif							/* TUVL_AGENT_H */
