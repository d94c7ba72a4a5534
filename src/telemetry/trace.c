/*-------------------------------------------------------------------------
 *
 * trace.c
 *	  Traces of runs: W3C trace ids and spans, kept until their
 *	  transaction commits; otlp.c exports them.
 *
 * Identity.  Every run has a trace id (32 lowercase hex digits) made of
 * what tells the run apart from every other: the installation and the run
 * id, as in its idempotency keys (effect.c).  Span ids are made the same
 * way from the trace id and the span's place in the run: the run, a
 * step's entry (its agent_started seq), an agent's iteration, a tool call,
 * an effect's position.  So every worker that ever holds the run, before
 * and after a crash, computes the same ids: a step that ends in another
 * worker than the one that entered it is still the run's child, and the
 * traceparent an outgoing request carries names the span that records it.
 *
 * Spans.  The code that executes runs makes a span where something ends
 * (TraceSpanStart ... TraceSpanEnd): the run at its end, a step at its end
 * (from its entry, kept in the step_state while it waits), an agent's
 * model turn and tool call, every HTTP, MCP and model request when its
 * result comes back (from its measured latency).  A span waits in this
 * backend until the transaction that made it commits, like the journal
 * events it mirrors: a transition that rolls back leaves no span.
 *
 * Export.  At commit the spans go to the export's buffer in shared
 * memory (otlp.c), which the launcher sends to tuvl.otlp_endpoint.
 *
 * Encoding.  Spans are written in OTLP's protobuf encoding (otlp.c's
 * writers), each as it is made: a Span message, tagged as a
 * ScopeSpans.spans field, so the export's buffer is a run of such fields
 * and an export only puts the envelope around it.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "common/hashfn.h"
#include "utils/memutils.h"

#include "effect.h"
#include "otlp.h"
#include "trace.h"
#include "tuvl.h"

/*
 * Spans of this backend's transaction, sent to the export's buffer at
 * commit: their encoded fields one after another in pending_buf (in
 * TopMemoryContext), and where each starts and at which nesting level it
 * was made, so that a subtransaction that rolls back takes its own back.
 */
static StringInfoData pending_buf;
static int *pending_start = NULL;	/* offsets in pending_buf */
static int *pending_level = NULL;
static int	n_pending = 0;
static int	max_pending = 0;

/* pending_buf keeps its allocation between transactions up to this */
#define PENDING_KEEP_BYTES (64 * 1024)

/* ---------------------------------------------------------------- identity */

bool
TraceEnabled(RunState *run)
{
	return OtlpReady() && tuvl_otlp_endpoint != NULL && tuvl_otlp_endpoint[0] != '\0' &&
		!run->replay;
}

static uint64
hash_text(const char *s, uint64 seed)
{
	return hash_bytes_extended((const unsigned char *) s, strlen(s), seed);
}

/* 16 lowercase hex digits of v, and a NUL, at out */
static void
hex16(char *out, uint64 v)
{
	static const char digits[] = "0123456789abcdef";

	for (int i = 15; i >= 0; i--, v >>= 4)
		out[i] = digits[v & 0xf];
	out[16] = '\0';
}

const char *
TraceRunTraceId(RunState *run)
{
	const char *base;
	uint64		hi;
	uint64		lo;

	char		id[33];

	if (run->trace_id)
		return run->trace_id;
	/* a run started with a traceparent continues that trace */
	if (run->traceparent)
		strlcpy(id, run->traceparent + 3, sizeof(id));
	else
	{
		base = run->key_base ? run->key_base : EffectKeyBase(run);
		hi = hash_text(base, UINT64CONST(0x7475766c));
		lo = hash_text(base, UINT64CONST(0x74726163));
		/* all zeros is not a valid trace id */
		if (hi == 0 && lo == 0)
			lo = 1;
		hex16(id, hi);
		hex16(id + 16, lo);
	}
	if (run->cxt == NULL)
		return pstrdup(id);
	run->trace_id = MemoryContextStrdup(run->cxt, id);
	return run->trace_id;
}

/* The span id of what (a place in the run, such as "step:7"). */
char *
TraceSpanId(RunState *run, const char *what)
{
	uint64		seed = run->trace_seed;
	uint64		id;
	char	   *out = palloc(17);

	if (run->trace_id == NULL || seed == 0)
	{
		seed = hash_text(TraceRunTraceId(run), UINT64CONST(0x7370616e));
		if (seed == 0)
			seed = 1;
		if (run->trace_id)
			run->trace_seed = seed;
	}
	id = hash_text(what, seed);
	if (id == 0)
		id = 1;
	hex16(out, id);
	return out;
}

char *
TraceRunSpanId(RunState *run)
{
	return TraceSpanId(run, "run");
}

/* The parent of a run's span: the caller's span of its traceparent, or NULL. */
char *
TraceRunParentId(RunState *run)
{
	return run->traceparent ? pnstrdup(run->traceparent + 36, 16) : NULL;
}

char *
TraceStepSpanId(RunState *run, int entry_seq)
{
	return TraceSpanId(run, psprintf("step:%d", entry_seq));
}

char *
TraceIterationSpanId(RunState *run, int entry_seq, int iteration)
{
	return TraceSpanId(run, psprintf("iteration:%d:%d", entry_seq, iteration));
}

/* The W3C traceparent header value naming span_id of run's trace. */
char *
TraceParent(RunState *run, const char *span_id)
{
	return psprintf("00-%s-%s-01", TraceRunTraceId(run), span_id);
}

/* ---------------------------------------------------------------- spans */

void
TraceSpanStart(TraceSpan *s, RunState *run, const char *name, int kind, char *span_id,
			   const char *parent_id, TimestampTz start)
{
	memset(s, 0, sizeof(TraceSpan));
	s->run = run;
	s->name = name;
	s->kind = kind;
	s->span_id = span_id;
	s->parent_id = parent_id;
	s->start = start;
	initStringInfo(&s->attrs);
	TraceAttrInt(s, "tuvl.run.id", run->id);
	TraceAttrString(s, "tuvl.workflow", run->workflow);
}

/* key: an attribute name of the code's own */
void
TraceAttrString(TraceSpan *s, const char *key, const char *value)
{
	if (value == NULL)
		return;
	OtlpPutAttrString(&s->attrs, SPAN_ATTRIBUTES, key, value);
}

void
TraceAttrInt(TraceSpan *s, const char *key, int64 value)
{
	OtlpPutAttrStart(&s->attrs, SPAN_ATTRIBUTES, key, 1 + OtlpVarintSize((uint64) value));
	OtlpPutTag(&s->attrs, ANY_INT, PB_VARINT);
	OtlpPutVarint(&s->attrs, (uint64) value);
}

/* Unix nanoseconds of a timestamp */
static uint64
unix_nanos(TimestampTz ts)
{
	return (uint64) (ts + (int64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * SECS_PER_DAY *
					 USECS_PER_SEC) * 1000;
}

/*
 * End span s at end: an error (NULL: none) makes its status ERROR.  The
 * span is exported once the transaction commits.
 */
void
TraceSpanEnd(TraceSpan *s, TimestampTz end, const char *error)
{
	static StringInfoData span;
	StringInfo	j = &pending_buf;
	int			name_len = strlen(s->name);
	int			error_len = error ? strlen(error) : 0;

	if (j->data == NULL || span.data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		if (j->data == NULL)
			initStringInfo(j);
		if (span.data == NULL)
			initStringInfo(&span);
		MemoryContextSwitchTo(old);
	}
	if (n_pending == max_pending)
	{
		max_pending = max_pending ? max_pending * 2 : 16;
		pending_start = pending_start ? repalloc(pending_start, max_pending * sizeof(int))
			: MemoryContextAlloc(TopMemoryContext, max_pending * sizeof(int));
		pending_level = pending_level ? repalloc(pending_level, max_pending * sizeof(int))
			: MemoryContextAlloc(TopMemoryContext, max_pending * sizeof(int));
	}
	pending_start[n_pending] = j->len;
	pending_level[n_pending] = GetCurrentTransactionNestLevel();
	n_pending++;

	resetStringInfo(&span);
	OtlpPutId(&span, SPAN_TRACE_ID, TraceRunTraceId(s->run), 16);
	OtlpPutId(&span, SPAN_SPAN_ID, s->span_id, 8);
	if (s->parent_id)
		OtlpPutId(&span, SPAN_PARENT_SPAN_ID, s->parent_id, 8);
	OtlpPutString(&span, SPAN_NAME, s->name, name_len);
	OtlpPutTag(&span, SPAN_KIND, PB_VARINT);
	OtlpPutVarint(&span, s->kind);
	OtlpPutFixed64(&span, SPAN_START, unix_nanos(s->start));
	OtlpPutFixed64(&span, SPAN_END, unix_nanos(Max(end, s->start)));
	appendBinaryStringInfo(&span, s->attrs.data, s->attrs.len);
	if (error)
	{
		OtlpPutLen(&span, SPAN_STATUS, OtlpLenFieldSize(error_len) + 2);
		OtlpPutString(&span, STATUS_MESSAGE, error, error_len);
	}
	else
		OtlpPutLen(&span, SPAN_STATUS, 2);
	OtlpPutTag(&span, STATUS_CODE, PB_VARINT);
	OtlpPutVarint(&span, error ? STATUS_CODE_ERROR : STATUS_CODE_OK);

	OtlpPutLen(j, SS_SPANS, span.len);
	appendBinaryStringInfo(j, span.data, span.len);
	pfree(s->attrs.data);
	/* a long error message does not keep its room */
	if (span.maxlen > PENDING_KEEP_BYTES)
	{
		pfree(span.data);
		span.data = NULL;
	}
}

/* Forget the pending spans from index from on. */
static void
forget_pending(int from)
{
	if (from >= n_pending)
		return;
	n_pending = from;
	pending_buf.len = pending_start[from];
	pending_buf.data[pending_buf.len] = '\0';
	if (n_pending == 0 && pending_buf.maxlen > PENDING_KEEP_BYTES)
	{
		pfree(pending_buf.data);
		pending_buf.data = NULL;
	}
}

/* At commit: the spans go to the export's buffer (otlp.c). */
static void
flush_pending(void)
{
	OtlpBufferSpans(pending_buf.data, pending_start, n_pending, pending_buf.len);
	forget_pending(0);
}

void
TraceXactCallback(XactEvent event, void *arg)
{
	if ((event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT) && n_pending > 0 &&
		OtlpReady())
		flush_pending();
	else if (event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT ||
			 event == XACT_EVENT_PREPARE)
		forget_pending(0);
}

void
TraceSubXactCallback(SubXactEvent event, SubTransactionId mySubid,
					 SubTransactionId parentSubid, void *arg)
{
	int			level = GetCurrentTransactionNestLevel();
	int			keep = n_pending;

	if (event == SUBXACT_EVENT_ABORT_SUB)
	{
		while (keep > 0 && pending_level[keep - 1] >= level)
			keep--;
		forget_pending(keep);
	}
	else if (event == SUBXACT_EVENT_COMMIT_SUB)
	{
		for (int i = n_pending - 1; i >= 0 && pending_level[i] >= level; i--)
			pending_level[i] = level - 1;
	}
}
