/*-------------------------------------------------------------------------
 *
 * agent_completion.c
 *	  The Agent step.  This file holds the completion mode: one model call
 *	  (retried on transport failures), its answer written to the context.
 *
 * The system and prompt templates are rendered against the public
 * context only: keys starting with "_" never reach a model, and a
 * template that names one fails.  With outcome.enum the model must answer
 * {"outcome": <one of the enum>, "result": <payload>} (code fences are
 * stripped); the outcome becomes the step's signal and an answer outside
 * the enum takes the error route, never an invented signal.  The call is
 * an effect journaled as llm_turn (effect.c, llm.c).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/json.h"
#include "utils/jsonb.h"

#include "agent.h"
#include "artifact.h"
#include "effect.h"
#include "executor.h"
#include "journal.h"
#include "jsonutil.h"
#include "llm.h"
#include "retry.h"
#include "template.h"
#include "uses.h"
#include "validate.h"
#include "workflow.h"

/*
 * After a failed call: retry (returns true with the request's delay set)
 * or give up (raises).
 */
static bool
AgentRetryOrFail(Jsonb *agent, LlmReply *reply, int attempts_made, EffectRequest *next)
{
	if (AgentShouldRetry(agent, reply, attempts_made, &next->delay_ms))
		return true;
	ExecutorErrorType = AgentFailureType(reply);
	ereport(ERROR,
			(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
			 errmsg("%s", reply->error),
			 attempts_made > 1 ? errdetail("Gave up after %d attempts.", attempts_made) : 0));
	return false;
}

static void
execute_completion(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	Jsonb	   *agent = JsonGetJsonb(step->spec, "agent");
	Jsonb	   *public = JsonPublicContext(ctx);
	char	   *model = JsonGetString(agent, "model");
	char	   *system = JsonGetString(agent, "system");
	char	   *prompt = JsonGetString(agent, "prompt");
	List	   *values = AgentOutcomeEnum(agent);
	LlmConfig  *cfg;
	StringInfoData msgs;
	EffectRequest *req;
	int			n = EffectCount(run);
	char	   *user;
	char	   *why;
	UseReferrer by;

	ExecutorErrorType = "llm_error";
	WorkflowReferrer(run->wf, &by);
	cfg = LlmConfigFor(run, model ? model : "default", &by);

	ExecutorErrorType = "error";
	if (system)
		system = ArtifactResolveText(run, system, SITE_STEERING, psprintf("agent.system of step \"%s\"", step->id));
	if (prompt)
		prompt = ArtifactResolveText(run, prompt, SITE_PROMPT, psprintf("agent.prompt of step \"%s\"", step->id));
	ExecutorErrorType = "template_error";
	initStringInfo(&msgs);
	appendStringInfoChar(&msgs, '[');
	if (system || values)
	{
		StringInfoData sys;

		initStringInfo(&sys);
		if (system)
			appendStringInfoString(&sys, TemplateRenderText(system, public, NULL));
		if (values)
		{
			if (sys.len > 0)
				appendStringInfoString(&sys, "\n\n");
			appendStringInfoString(&sys, AgentFinalFormat(values));
		}
		appendStringInfoString(&msgs, "{\"role\": \"system\", \"content\": ");
		escape_json(&msgs, sys.data);
		appendStringInfoString(&msgs, "}, ");
	}
	user = prompt ? TemplateRenderText(prompt, public, NULL) : "Begin.";

	/* the input gate, before anything is sent: the message is what leaves it */
	ExecutorErrorType = "error";
	if ((why = AgentGateCheck(run, step, GATE_INPUT, &user)) != NULL ||
		(why = AgentGateJudge(run, step, GATE_INPUT, "input.1", user, result, NULL)) != NULL)
	{
		AgentViolation(result, why);
		return;
	}
	if (result->pending)
		return;					/* a judge's verdict first */
	appendStringInfoString(&msgs, "{\"role\": \"user\", \"content\": ");
	escape_json(&msgs, user);
	appendStringInfoString(&msgs, "}]");

	ExecutorErrorType = "llm_error";
	req = LlmBuildRequest(run, cfg, JsonFromCString(msgs.data), NULL, AgentAnswerSchema(values), -1);
	if (n > 0)
	{
		LlmReply	reply;

		LlmParseResult(cfg, EffectAt(run, n - 1), &reply);
		if (reply.ok)
		{
			/* the output gate, before anything is written */
			char	   *answer = reply.text ? reply.text : "";
			char	   *given = answer;

			ExecutorErrorType = "error";
			if ((why = AgentGateCheck(run, step, GATE_OUTPUT, &answer)) != NULL)
			{
				AgentViolation(result, why);
				return;
			}
			/* a masked answer is journaled masked too */
			if (answer != given && run->fresh_event && run->fresh_position == n - 1)
				run->fresh_event->payload = AgentGateMask(run, step, GATE_OUTPUT,
														  run->fresh_event->payload);
			if ((why = AgentGateJudge(run, step, GATE_OUTPUT, psprintf("output.%d", n - 1),
									  answer, result, NULL)) != NULL)
			{
				AgentViolation(result, why);
				return;
			}
			if (result->pending)
				return;
			why = AgentApplyOutcome(answer, values, result);
			if (why)
			{
				ExecutorErrorType = "invalid_outcome";
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("%s", why),
						 errhint("Step \"%s\" accepts only the declared outcomes.", step->id)));
			}
			return;
		}
		(void) AgentRetryOrFail(agent, &reply, n, req);
	}
	/* the workflow's max_cost: a call that would pass it is not sent */
	if ((why = AgentCostCheck(run, NULL, cfg, req, 0, -1)) != NULL)
	{
		AgentBudgetExceeded(result, why);
		return;
	}
	result->pending = true;
	result->effect = req;
}

/*
 * The Agent step: mode completion here; autonomous in agent_loop.c.
 */
void
StepExecuteAgent(RunState *run, const StepDef *step, Jsonb *ctx, StepResult *result)
{
	char	   *mode = JsonGetString(step->spec, "mode");

	if (mode && strcmp(mode, "completion") == 0)
		execute_completion(run, step, ctx, result);
	else if (mode && strcmp(mode, "autonomous") == 0)
		StepExecuteAutonomous(run, step, ctx, result);
	else
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("Agent step \"%s\" has mode \"%s\"", step->id, mode ? mode : ""),
				 errhint("Use mode: completion or mode: autonomous.")));
}


static const char *const agent_step_keys[] = {"mode", "agent", "guardrails", "rate_limit", NULL};

/* The Agent's row of the step table (init.c); its checks: agent_validate.c. */
const StepExecutor StepKindAgent = {
	.kind = STEP_AGENT,
	.execute = StepExecuteAgent,
	.reserved_exits = AgentLoopReservedExits,
	.controls_itself = true,
	.keys = agent_step_keys,
	.validate = StepValidateAgent,
	.rate_limited = true,
};
