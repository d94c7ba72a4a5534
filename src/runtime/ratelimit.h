/*-------------------------------------------------------------------------
 *
 * ratelimit.h
 *	  Rate limits of runs and steps (ratelimit.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_RATELIMIT_H
#define TUVL_RATELIMIT_H

#include "datatype/timestamp.h"
#include "utils/jsonb.h"

#include "executor.h"
#include "jsonutil.h"
#include "runtime.h"

/* A rate_limit mapping, its key rendered. */
typedef struct RateLimit
{
	char	   *key;			/* NULL: no rate_limit */
	int			limit;			/* at most this many ... */
	int			per_ms;			/* ... in any window this long */
} RateLimit;

/* A worker found a key's lock taken: the run is postponed, not failed. */
extern bool RateLimitBusy;

extern void RateLimitOf(Jsonb *spec, Jsonb *ctx, RateLimit *rl);
extern char *RateLimitBucket(const char *scope, const char *workflow, Oid principal,
							 const RateLimit *rl);
extern TimestampTz RateLimitReserve(const char *bucket, const RateLimit *rl,
									TimestampTz base);
extern void RateLimitRelease(const char *bucket, TimestampTz at);
extern char *RateLimitPerText(int per_ms);
extern void RateLimitDescribe(JsonObjBuilder *b, const RateLimit *rl, TimestampTz until);
extern bool RateLimitStep(RunState *run, const StepDef *step, Jsonb *ctx, bool first_entry,
						  StepResult *result);

#endif							/* TUVL_RATELIMIT_H */
