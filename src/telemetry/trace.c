/*-------------------------------------------------------------------------
 *
 * trace.c
 *	  Traces of runs: W3C trace ids, spans, and their export over
 *	  OTLP/HTTP to tuvl.otlp_endpoint.
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
 * Export.  At commit the spans go to a buffer in shared memory
 * (TRACE_BUFFER_BYTES); when it is full they are dropped and counted, so
 * memory stays bounded and a producer never waits.  The launcher sends the
 * buffer's spans in one OTLP/HTTP request at most every
 * TRACE_BATCH_MS, asynchronously (curl multi, latch and sockets), with a
 * timeout; a collector that fails or is not there costs a dropped batch
 * and a log line, never a step's time.  Spans the buffer held when the
 * server stopped are lost; the journal keeps what happened.
 *
 * Encoding.  Spans are written in OTLP's protobuf encoding (binary, the
 * OTLP/HTTP default, Content-Type application/x-protobuf), each as it is
 * made: a Span message, tagged as a ScopeSpans.spans field, so the buffer
 * is a run of such fields and an export only puts the envelope around
 * it.  A span is less than half its JSON size, and bytes are what the
 * export, the network and the collector spend on.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "common/hashfn.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/memutils.h"

#include "effect.h"
#include "http.h"
#include "trace.h"
#include "tuvl.h"

#define TRACE_BUFFER_BYTES (4 * 1024 * 1024)
#define TRACE_BATCH_MS 200
#define TRACE_EXPORT_TIMEOUT_MS 5000

typedef struct TraceShared
{
	LWLock	   *lock;
	uint64		dropped;		/* spans the buffer had no room for */
	uint64		exported;		/* spans the collector accepted */
	uint64		failed;			/* spans of batches the collector refused */
	Size		used;			/* bytes of buf in use */
	int			nspans;			/* spans in buf */
	char		buf[FLEXIBLE_ARRAY_MEMBER]; /* ScopeSpans.spans fields */
} TraceShared;

static TraceShared *trace_shared = NULL;

/*
 * Spans of this backend's transaction, sent to the buffer at commit: their
 * encoded fields one after another in pending_buf (in
 * TopMemoryContext), and where each starts and at which nesting level it
 * was made, so that a subtransaction that rolls back takes its own back.
 */
typedef struct PendingSpan
{
	int			offset;			/* in pending_buf */
	int			level;
} PendingSpan;

static StringInfoData pending_buf;
static PendingSpan *pending = NULL;
static int	n_pending = 0;
static int	max_pending = 0;

/* pending_buf keeps its allocation between transactions up to this */
#define PENDING_KEEP_BYTES (64 * 1024)

/* ---------------------------------------------------------------- identity */

bool
TraceEnabled(RunState *run)
{
	return trace_shared != NULL && tuvl_otlp_endpoint != NULL && tuvl_otlp_endpoint[0] != '\0' &&
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
RunTraceId(RunState *run)
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
		seed = hash_text(RunTraceId(run), UINT64CONST(0x7370616e));
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
	return psprintf("00-%s-%s-01", RunTraceId(run), span_id);
}

/* ---------------------------------------------------------------- protobuf */

/* wire types */
#define PB_VARINT 0
#define PB_FIXED64 1
#define PB_LEN 2

/* Span's fields (opentelemetry/proto/trace/v1/trace.proto) */
#define SPAN_TRACE_ID 1
#define SPAN_SPAN_ID 2
#define SPAN_PARENT_SPAN_ID 4
#define SPAN_NAME 5
#define SPAN_KIND 6
#define SPAN_START 7
#define SPAN_END 8
#define SPAN_ATTRIBUTES 9
#define SPAN_STATUS 15
#define STATUS_MESSAGE 2
#define STATUS_CODE 3
#define STATUS_CODE_OK 1
#define STATUS_CODE_ERROR 2
/* KeyValue, AnyValue (common.proto) */
#define KV_KEY 1
#define KV_VALUE 2
#define ANY_STRING 1
#define ANY_INT 3
/* the envelope: ExportTraceServiceRequest.resource_spans, ResourceSpans
 * .resource and .scope_spans, Resource.attributes, ScopeSpans.scope and
 * .spans, InstrumentationScope.name and .version */
#define REQ_RESOURCE_SPANS 1
#define RS_RESOURCE 1
#define RS_SCOPE_SPANS 2
#define RESOURCE_ATTRIBUTES 1
#define SS_SCOPE 1
#define SS_SPANS 2
#define SCOPE_NAME 1
#define SCOPE_VERSION 2

static int
varint_size(uint64 v)
{
	int			n = 1;

	while (v >= 0x80)
	{
		v >>= 7;
		n++;
	}
	return n;
}

static void
put_varint(StringInfo b, uint64 v)
{
	char		out[10];
	int			n = 0;

	while (v >= 0x80)
	{
		out[n++] = (char) ((v & 0x7f) | 0x80);
		v >>= 7;
	}
	out[n++] = (char) v;
	appendBinaryStringInfo(b, out, n);
}

static void
put_tag(StringInfo b, int field, int wire)
{
	appendStringInfoChar(b, (char) ((field << 3) | wire));
}

/* a length-delimited field: its tag and length (its len bytes follow) */
static void
put_len(StringInfo b, int field, Size len)
{
	put_tag(b, field, PB_LEN);
	put_varint(b, len);
}

/* the size of a length-delimited field of len bytes, tag included */
static Size
len_field_size(Size len)
{
	return 1 + varint_size(len) + len;
}

static void
put_string(StringInfo b, int field, const char *value, int len)
{
	put_len(b, field, len);
	appendBinaryStringInfo(b, value, len);
}

static void
put_fixed64(StringInfo b, int field, uint64 v)
{
	char		out[8];

	put_tag(b, field, PB_FIXED64);
	for (int i = 0; i < 8; i++, v >>= 8)
		out[i] = (char) (v & 0xff);
	appendBinaryStringInfo(b, out, 8);
}

/* the value of a hex digit, by character (a span is made with three ids) */
static const uint8 hex_value[256] = {
	['0'] = 0,['1'] = 1,['2'] = 2,['3'] = 3,['4'] = 4,['5'] = 5,['6'] = 6,['7'] = 7,
	['8'] = 8,['9'] = 9,['a'] = 10,['b'] = 11,['c'] = 12,['d'] = 13,['e'] = 14,['f'] = 15,
	['A'] = 10,['B'] = 11,['C'] = 12,['D'] = 13,['E'] = 14,['F'] = 15,
};

/* an id (trace or span) given in 2 * nbytes hex digits, as its bytes */
static void
put_id(StringInfo b, int field, const char *hex, int nbytes)
{
	char		out[16];
	const unsigned char *h = (const unsigned char *) hex;

	Assert(nbytes <= (int) sizeof(out));
	for (int i = 0; i < nbytes; i++)
		out[i] = (char) ((hex_value[h[2 * i]] << 4) | hex_value[h[2 * i + 1]]);
	put_string(b, field, out, nbytes);
}

/*
 * An attribute: KeyValue {key, value: AnyValue {value_field: ...}}, as
 * field of its message.  value_size is the size of the AnyValue's one
 * field, which the caller appends after.
 */
static void
put_attr_start(StringInfo b, int field, const char *key, Size value_size)
{
	int			klen = strlen(key);

	put_len(b, field, len_field_size(klen) + len_field_size(value_size));
	put_string(b, KV_KEY, key, klen);
	put_len(b, KV_VALUE, value_size);
}

static void
put_attr_string(StringInfo b, int field, const char *key, const char *value)
{
	int			vlen = strlen(value);

	put_attr_start(b, field, key, len_field_size(vlen));
	put_string(b, ANY_STRING, value, vlen);
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
	put_attr_string(&s->attrs, SPAN_ATTRIBUTES, key, value);
}

void
TraceAttrInt(TraceSpan *s, const char *key, int64 value)
{
	put_attr_start(&s->attrs, SPAN_ATTRIBUTES, key, 1 + varint_size((uint64) value));
	put_tag(&s->attrs, ANY_INT, PB_VARINT);
	put_varint(&s->attrs, (uint64) value);
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
		pending = pending ? repalloc(pending, max_pending * sizeof(PendingSpan))
			: MemoryContextAlloc(TopMemoryContext, max_pending * sizeof(PendingSpan));
	}
	pending[n_pending].offset = j->len;
	pending[n_pending].level = GetCurrentTransactionNestLevel();
	n_pending++;

	resetStringInfo(&span);
	put_id(&span, SPAN_TRACE_ID, RunTraceId(s->run), 16);
	put_id(&span, SPAN_SPAN_ID, s->span_id, 8);
	if (s->parent_id)
		put_id(&span, SPAN_PARENT_SPAN_ID, s->parent_id, 8);
	put_string(&span, SPAN_NAME, s->name, name_len);
	put_tag(&span, SPAN_KIND, PB_VARINT);
	put_varint(&span, s->kind);
	put_fixed64(&span, SPAN_START, unix_nanos(s->start));
	put_fixed64(&span, SPAN_END, unix_nanos(Max(end, s->start)));
	appendBinaryStringInfo(&span, s->attrs.data, s->attrs.len);
	if (error)
	{
		put_len(&span, SPAN_STATUS, len_field_size(error_len) + 2);
		put_string(&span, STATUS_MESSAGE, error, error_len);
	}
	else
		put_len(&span, SPAN_STATUS, 2);
	put_tag(&span, STATUS_CODE, PB_VARINT);
	put_varint(&span, error ? STATUS_CODE_ERROR : STATUS_CODE_OK);

	put_len(j, SS_SPANS, span.len);
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
	pending_buf.len = pending[from].offset;
	pending_buf.data[pending_buf.len] = '\0';
	if (n_pending == 0 && pending_buf.maxlen > PENDING_KEEP_BYTES)
	{
		pfree(pending_buf.data);
		pending_buf.data = NULL;
	}
}

/* At commit: the spans go to the shared buffer, or are counted as dropped. */
static void
flush_pending(void)
{
	bool		wake;
	int			fit = n_pending;
	Size		len = pending_buf.len;

	LWLockAcquire(trace_shared->lock, LW_EXCLUSIVE);
	wake = trace_shared->used == 0;
	/* as many whole spans as there is room for, in one copy */
	while (fit > 0 && trace_shared->used + len > TRACE_BUFFER_BYTES)
		len = pending[--fit].offset;
	memcpy(trace_shared->buf + trace_shared->used, pending_buf.data, len);
	trace_shared->used += len;
	trace_shared->nspans += fit;
	trace_shared->dropped += n_pending - fit;

	/*
	 * the launcher exports: wake it for a buffer that was empty, or a quarter
	 * full
	 */
	wake |= trace_shared->used > TRACE_BUFFER_BYTES / 4;
	LWLockRelease(trace_shared->lock);
	forget_pending(0);
	if (wake && TuvlShmem && TuvlShmem->launcher_latch)
		SetLatch(TuvlShmem->launcher_latch);
}

void
TraceXactCallback(XactEvent event, void *arg)
{
	if ((event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT) && n_pending > 0 &&
		trace_shared)
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
		while (keep > 0 && pending[keep - 1].level >= level)
			keep--;
		forget_pending(keep);
	}
	else if (event == SUBXACT_EVENT_COMMIT_SUB)
	{
		for (int i = n_pending - 1; i >= 0 && pending[i].level >= level; i--)
			pending[i].level = level - 1;
	}
}

/* ---------------------------------------------------------------- shared memory */

Size
TraceShmemSize(void)
{
	return add_size(offsetof(TraceShared, buf), TRACE_BUFFER_BYTES);
}

void
TraceShmemRequest(void)
{
	RequestAddinShmemSpace(TraceShmemSize());
	RequestNamedLWLockTranche("tuvl traces", 1);
}

void
TraceShmemStartup(void)
{
	bool		found;

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	trace_shared = ShmemInitStruct("tuvl traces", TraceShmemSize(), &found);
	if (!found)
	{
		memset(trace_shared, 0, offsetof(TraceShared, buf));
		trace_shared->lock = &(GetNamedLWLockTranche("tuvl traces"))->lock;
	}
	LWLockRelease(AddinShmemInitLock);
}

/* ---------------------------------------------------------------- export (the launcher) */

static HttpTransfer *export_in_flight = NULL;
static int	export_spans = 0;	/* spans in the batch in flight */
static TimestampTz last_export = 0;
static TimestampTz last_complaint = 0;
static bool failing = false;

/* Log a failed export: the first after a success, then at most once a minute. */
static void
complain(const char *why)
{
	TimestampTz now = GetCurrentTimestamp();

	if (!failing || TimestampDifferenceExceeds(last_complaint, now, 60 * 1000))
	{
		ereport(LOG, (errmsg("tuvl could not export spans to %s: %s", tuvl_otlp_endpoint, why),
					  errdetail("Spans are dropped while the collector fails; runs are not affected.")));
		last_complaint = now;
	}
	failing = true;
}

/* The finished export, if any: count it. */
static void
collect_export(void)
{
	List	   *done = HttpCollectDone();
	ListCell   *lc;

	foreach(lc, done)
	{
		HttpResult *res = HttpTakeResult(lfirst(lc));

		if (lfirst(lc) != export_in_flight)
			continue;
		export_in_flight = NULL;
		LWLockAcquire(trace_shared->lock, LW_EXCLUSIVE);
		if (res->status >= 200 && res->status < 300)
		{
			trace_shared->exported += export_spans;
			failing = false;
		}
		else
			trace_shared->failed += export_spans;
		LWLockRelease(trace_shared->lock);
		if (res->status < 200 || res->status >= 300)
			complain(res->error ? res->error : psprintf("HTTP status %d", res->status));
	}
}

/*
 * The request body of the export in flight: kept from one export to the
 * next (one at a time), so that a batch of megabytes is neither allocated
 * and faulted in again nor copied once more by http.c.
 */
static StringInfoData export_body;

/*
 * The export's envelope: ExportTraceServiceRequest {resource_spans:
 * [{resource: {attributes: service.name, service.version}, scope_spans:
 * [{scope: {name, version}, spans: (the buffer's fields)}]}]}.  Its
 * resource and scope never change: they are encoded once.
 */
static StringInfoData env_resource;
static StringInfoData env_scope;

static void
envelope_parts(void)
{
	MemoryContext old;

	if (env_scope.data)
		return;
	old = MemoryContextSwitchTo(TopMemoryContext);
	initStringInfo(&env_resource);
	put_attr_string(&env_resource, RESOURCE_ATTRIBUTES, "service.name", "tuvl");
	put_attr_string(&env_resource, RESOURCE_ATTRIBUTES, "service.version", TUVL_VERSION);
	initStringInfo(&env_scope);
	put_string(&env_scope, SCOPE_NAME, "tuvl", 4);
	put_string(&env_scope, SCOPE_VERSION, TUVL_VERSION, strlen(TUVL_VERSION));
	MemoryContextSwitchTo(old);
}

/* What comes before spans_len bytes of spans (body has room for it). */
static void
put_envelope(StringInfo body, Size spans_len)
{
	Size		scope_spans = len_field_size(env_scope.len) + spans_len;

	put_len(body, REQ_RESOURCE_SPANS,
			len_field_size(env_resource.len) + len_field_size(scope_spans));
	put_len(body, RS_RESOURCE, env_resource.len);
	appendBinaryStringInfo(body, env_resource.data, env_resource.len);
	put_len(body, RS_SCOPE_SPANS, scope_spans);
	put_len(body, SS_SCOPE, env_scope.len);
	appendBinaryStringInfo(body, env_scope.data, env_scope.len);
}

/* Take the buffer's spans and send them in one request. */
static void
start_export(void)
{
	StringInfo	body = &export_body;
	HttpRequest req;
	HttpHeader	ctype = {"Content-Type", "application/x-protobuf"};
	int			n = 0;

	Assert(export_in_flight == NULL);
	if (body->data == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		initStringInfo(body);
		MemoryContextSwitchTo(old);
	}
	resetStringInfo(body);
	envelope_parts();
	LWLockAcquire(trace_shared->lock, LW_EXCLUSIVE);
	/* one allocation, not a doubling of the copy while workers wait */
	enlargeStringInfo(body, trace_shared->used + env_resource.len + env_scope.len + 64);
	put_envelope(body, trace_shared->used);
	appendBinaryStringInfo(body, trace_shared->buf, trace_shared->used);
	n = trace_shared->nspans;
	trace_shared->used = 0;
	trace_shared->nspans = 0;
	LWLockRelease(trace_shared->lock);

	memset(&req, 0, sizeof(req));
	req.method = "POST";
	req.url = tuvl_otlp_endpoint;
	req.headers = list_make1(&ctype);
	req.body = body->data;
	req.body_len = body->len;
	req.body_borrowed = true;
	req.timeout_ms = TRACE_EXPORT_TIMEOUT_MS;
	export_spans = n;
	last_export = GetCurrentTimestamp();
	PG_TRY();
	{
		export_in_flight = HttpStart(&req, NIL, trace_shared);
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(TopMemoryContext);
		edata = CopyErrorData();
		FlushErrorState();
		export_in_flight = NULL;
		trace_shared->failed += n;
		complain(edata->message);
		FreeErrorData(edata);
	}
	PG_END_TRY();
}

/*
 * The launcher's part: collect a finished export, start the next when
 * spans wait and none is in flight (at most every TRACE_BATCH_MS).
 * Returns how long the launcher may sleep before it is needed again, in
 * ms (-1: until woken).
 */
long
TraceExport(void)
{
	Size		used;
	long		since;

	if (trace_shared == NULL)
		return -1;
	collect_export();
	LWLockAcquire(trace_shared->lock, LW_SHARED);
	used = trace_shared->used;
	LWLockRelease(trace_shared->lock);
	if (used == 0 || export_in_flight != NULL)
		return export_in_flight ? TRACE_BATCH_MS : -1;
	if (tuvl_otlp_endpoint == NULL || tuvl_otlp_endpoint[0] == '\0')
	{
		/* turned off meanwhile: what waits is dropped */
		LWLockAcquire(trace_shared->lock, LW_EXCLUSIVE);
		trace_shared->used = 0;
		trace_shared->nspans = 0;
		LWLockRelease(trace_shared->lock);
		return -1;
	}
	since = (long) ((GetCurrentTimestamp() - last_export) / 1000);
	/* batch for TRACE_BATCH_MS, unless the buffer fills up faster */
	if (since < TRACE_BATCH_MS && used < TRACE_BUFFER_BYTES / 4)
		return TRACE_BATCH_MS - since;
	start_export();
	return TRACE_BATCH_MS;
}
