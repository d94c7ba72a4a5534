/*-------------------------------------------------------------------------
 *
 * effect.h
 *	  Effects: work outside the database whose results are journaled
 *	  before anything uses them.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_EFFECT_H
#define TUVL_EFFECT_H

#include "utils/jsonb.h"

#include "http.h"
#include "runtime.h"
#include "secret.h"
#include "template.h"

/*
 * What a step needs done outside the database.  The request is rendered
 * with secrets; journal is its redacted description for the tool_call
 * event.  A step's effects are numbered 0, 1, ... in the order it asks
 * for them; retries of one logical call share its idempotency key.
 */
typedef struct EffectRequest
{
	HttpRequest http;
	Jsonb	   *journal;		/* redacted: method, url, ... */
	char	   *idempotency_key;	/* NULL: none */
	int			delay_ms;		/* wait this long before sending */
	List	   *secrets;		/* secret values used: scrubbed from results */
	Jsonb	   *tag;			/* merged into the journaled result, so a
								 * re-executed step knows what it asked for */
} EffectRequest;

extern void EffectCheckAllowed(const char *url, List *secrets);

extern int	EffectCount(RunState *run);
extern Jsonb *EffectAt(RunState *run, int position);
extern Jsonb *EffectRecords(RunState *run);
extern Jsonb *EffectFindOp(RunState *run, const char *op);
extern char *EffectKey(RunState *run, int logical);
extern char *EffectKeyBase(RunState *run);
extern void EffectRecord(RunState *run, Jsonb *record);
extern EffectRequest *EffectRequestCopy(EffectRequest *req, MemoryContext cxt);
extern Jsonb *EffectResultToJsonb(HttpResult *res, List *secrets);
extern Jsonb *EffectFinish(EffectRequest *req, HttpResult *res);
extern Jsonb *EffectPerform(EffectRequest *req);

#endif							/* TUVL_EFFECT_H */
