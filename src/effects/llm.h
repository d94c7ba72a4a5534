/*-------------------------------------------------------------------------
 *
 * llm.h
 *	  Model configurations and the two wire formats (OpenAI Chat
 *	  Completions, Anthropic Messages).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_LLM_H
#define TUVL_LLM_H

#include "datatype/timestamp.h"
#include "utils/jsonb.h"

#include "effect.h"

typedef struct LlmConfig
{
	char	   *name;
	int			version;		/* of tuvl.llm_versions */
	char	   *provider;		/* "openai" or "anthropic" */
	char	   *base_url;
	char	   *model;
	char	   *api_key_secret; /* NULL: no key (local servers) */
	int			timeout_ms;
	Jsonb	   *params;			/* extra request fields, or NULL */
	Jsonb	   *headers;		/* extra request headers (templates), or NULL */
	bool		structured_outputs; /* send an answer's schema as the
									 * provider's structured output format */
	Oid			owner;			/* who registered this version (uses.c) */
	bool		has_limits;		/* limits: calls go through admission.c */
	int			rpm;			/* 0: none */
	int			tpm;
	int			concurrency;
	bool		has_price;		/* price: per million tokens */
	double		price_input;
	double		price_output;
	double		price_cached;	/* cached input; input's when not given */
} LlmConfig;

/* A model's answer, in the provider-neutral form. */
typedef struct LlmReply
{
	bool		ok;
	char	   *text;			/* may be NULL */
	Jsonb	   *tool_calls;		/* [{id, name, arguments (JSON text)}], or
								 * NULL */
	Jsonb	   *thinking;		/* Anthropic thinking and redacted_thinking
								 * blocks, as sent, or NULL */
	char	   *finish_reason;
	int			prompt_tokens;
	int			completion_tokens;
	int			total_tokens;
	int			cached_tokens;	/* of prompt_tokens, read from a cache */
	int			reasoning_tokens;	/* of completion_tokens, spent reasoning */
	/* when !ok */
	char	   *error;
	bool		retryable;		/* a transient failure (408, 429, 529, 5xx,
								 * transport error or timeout) */
	const char *error_class;	/* "timeout" or "error", for retry.on */
	const char *error_type;		/* _last_error_type when it is not the class's
								 * (bad_response), or NULL */
	int			retry_after_ms; /* -1: none */
	char	   *malformed;		/* while parsing: what is wrong with a count */
} LlmReply;

extern LlmConfig *LlmConfigLoad(const char *name, TimestampTz as_of);
struct UseReferrer;
extern LlmConfig *LlmConfigFor(RunState *run, const char *name, const struct UseReferrer *by);
extern EffectRequest *LlmBuildRequest(RunState *run, LlmConfig *cfg, Jsonb *messages, Jsonb *tools,
									  Jsonb *answer_schema, int timeout_ms);

/*
 * The journal form of a conversation's first count messages as an
 * earlier request sent them (LlmBuildRequestReusing), so that the next
 * request of the same conversation parses only its new messages.
 */
typedef struct LlmWireCache
{
	Jsonb	   *messages;		/* NULL: none yet */
	int			count;
} LlmWireCache;

extern EffectRequest *LlmBuildRequestReusing(RunState *run, LlmConfig *cfg, Jsonb *messages,
											 Jsonb *tools, Jsonb *answer_schema, int timeout_ms,
											 LlmWireCache *cache);
extern Jsonb *LlmEnumAnswerSchema(const char *key, const char *const *values, int nvalues,
								  const char *other, const char *other_type);
extern void LlmParseResult(LlmConfig *cfg, Jsonb *result, LlmReply *reply);
extern Jsonb *LlmTurnPayload(Jsonb *result, int *tokens);
extern Jsonb *LlmTurnPayloadAs(Jsonb *result, int *tokens, int position, const char *request_key,
							   Jsonb *request);
extern Jsonb *LlmStripRequest(Jsonb *result);
extern double LlmCost(const LlmConfig *cfg, int64 prompt, int64 cached, int64 completion);
extern double LlmEstimateCost(const LlmConfig *cfg, EffectRequest *req, int64 output_tokens);
extern int64 LlmMaxOutputTokens(const LlmConfig *cfg);

/* llm_request.c: an llm_turn's request journaled as a delta */
extern Jsonb *LlmRequestDelta(Jsonb *prev, Jsonb *next);
extern Jsonb *LlmRequestRebuild(List *payloads);
extern Jsonb *LlmRequestNext(Jsonb *prev, Jsonb *payload);
extern Jsonb *LlmRequestPrev(int64 run_id, const char *agent_id);

#endif							/* TUVL_LLM_H */
