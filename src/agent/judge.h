/*-------------------------------------------------------------------------
 *
 * judge.h
 *	  A model asked for a verdict on content: the llm_judge guardrail
 *	  check (and, later, the supervisor).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_JUDGE_H
#define TUVL_JUDGE_H

#include "effect.h"
#include "runtime.h"

/* What the judge answered, once its call is recorded. */
typedef struct JudgeAnswer
{
	bool		error;			/* no verdict: the call failed, or the answer
								 * is not one of the verdicts */
	char	   *verdict;		/* one of the verdicts asked for, or NULL */
	char	   *reason;			/* the judge's reason, or why it gave none */
	Jsonb	   *answer;			/* the judge's JSON object, when !error */
	int			tokens;			/* what the call cost */
	bool		fresh;			/* the answer came back in this transition */
} JudgeAnswer;

extern int	JudgeTokens(RunState *run, const char *id);
struct UseReferrer;
extern bool JudgeAsk(RunState *run, const char *id, const char *model, const struct UseReferrer *by,
					 const char *instructions, const char *content, const char *const *verdicts,
					 JudgeAnswer *answer, EffectRequest **request);

#endif							/* TUVL_JUDGE_H */
