/*-------------------------------------------------------------------------
 *
 * retry.h
 *	  Retry policies of effects: the retry block, backoff, Retry-After.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_RETRY_H
#define TUVL_RETRY_H

#include "utils/jsonb.h"

/* The base of the backoff when a retry block names none. */
#define RETRY_DEFAULT_BACKOFF_MS 1000
/* The longest backoff, whatever the number of failures. */
#define RETRY_MAX_BACKOFF_MS (10 * 60 * 1000)

/* Flags of RetryAfterMs. */
#define RETRY_AFTER_MS_HEADER	0x01	/* retry-after-ms first (model APIs) */
#define RETRY_AFTER_HTTP_DATE	0x02	/* RFC 9110 Retry-After: strtod
										 * delta-seconds or an HTTP date */

/*
 * A retry block {on: [...], attempts: n, backoff: duration}.  Each caller
 * consults the conditions it knows: the APICall step all four, the Agent
 * step timeout and error only.
 */
typedef struct RetryPolicy
{
	int			attempts;		/* attempts in all, at least 1 */
	int			backoff_ms;		/* base of the exponential backoff */
	bool		on_timeout;
	bool		on_error;
	bool		on_429;
	bool		on_5xx;
} RetryPolicy;

extern void RetryParse(Jsonb *retry, int default_attempts, RetryPolicy *rp);
extern bool RetryAllowed(const RetryPolicy *rp, int attempts_made, int status,
						 const char *error_kind);
extern int	RetryBackoffMs(const RetryPolicy *rp, int failures);
extern int	RetryDelayMs(const RetryPolicy *rp, int failures, int retry_after_ms);
extern int	RetryAfterMs(Jsonb *result, int cap_ms, int flags);

#endif							/* TUVL_RETRY_H */
