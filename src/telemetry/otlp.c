/*-------------------------------------------------------------------------
 *
 * otlp.c
 *	  OTLP/HTTP export of the spans trace.c makes: the protobuf writers
 *	  they are encoded with, a buffer in shared memory that committed
 *	  spans go to, and the launcher's export of it to tuvl.otlp_endpoint.
 *
 * The buffer.  At commit a backend's spans go to a buffer in shared
 * memory (TRACE_BUFFER_BYTES); when it is full they are dropped and
 * counted, so memory stays bounded and a producer never waits.  The
 * launcher sends the buffer's spans in one OTLP/HTTP request at most
 * every TRACE_BATCH_MS, asynchronously (curl multi, latch and sockets),
 * with a timeout; a collector that fails or is not there costs a dropped
 * batch and a log line, never a step's time.  Spans the buffer held when
 * the server stopped are lost; the journal keeps what happened.
 *
 * Encoding.  OTLP's protobuf encoding (binary, the OTLP/HTTP default,
 * Content-Type application/x-protobuf): the buffer is a run of
 * ScopeSpans.spans fields, and an export only puts the envelope around
 * it.  A span is less than half its JSON size, and bytes are what the
 * export, the network and the collector spend on.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/memutils.h"

#include "http.h"
#include "otlp.h"
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

/* ---------------------------------------------------------------- protobuf */

int
OtlpVarintSize(uint64 v)
{
	int			n = 1;

	while (v >= 0x80)
	{
		v >>= 7;
		n++;
	}
	return n;
}

void
OtlpPutVarint(StringInfo b, uint64 v)
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

void
OtlpPutTag(StringInfo b, int field, int wire)
{
	appendStringInfoChar(b, (char) ((field << 3) | wire));
}

/* a length-delimited field: its tag and length (its len bytes follow) */
void
OtlpPutLen(StringInfo b, int field, Size len)
{
	OtlpPutTag(b, field, PB_LEN);
	OtlpPutVarint(b, len);
}

/* the size of a length-delimited field of len bytes, tag included */
Size
OtlpLenFieldSize(Size len)
{
	return 1 + OtlpVarintSize(len) + len;
}

void
OtlpPutString(StringInfo b, int field, const char *value, int len)
{
	OtlpPutLen(b, field, len);
	appendBinaryStringInfo(b, value, len);
}

void
OtlpPutFixed64(StringInfo b, int field, uint64 v)
{
	char		out[8];

	OtlpPutTag(b, field, PB_FIXED64);
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
void
OtlpPutId(StringInfo b, int field, const char *hex, int nbytes)
{
	char		out[16];
	const unsigned char *h = (const unsigned char *) hex;

	Assert(nbytes <= (int) sizeof(out));
	for (int i = 0; i < nbytes; i++)
		out[i] = (char) ((hex_value[h[2 * i]] << 4) | hex_value[h[2 * i + 1]]);
	OtlpPutString(b, field, out, nbytes);
}

/*
 * An attribute: KeyValue {key, value: AnyValue {value_field: ...}}, as
 * field of its message.  value_size is the size of the AnyValue's one
 * field, which the caller appends after.
 */
void
OtlpPutAttrStart(StringInfo b, int field, const char *key, Size value_size)
{
	int			klen = strlen(key);

	OtlpPutLen(b, field, OtlpLenFieldSize(klen) + OtlpLenFieldSize(value_size));
	OtlpPutString(b, KV_KEY, key, klen);
	OtlpPutLen(b, KV_VALUE, value_size);
}

void
OtlpPutAttrString(StringInfo b, int field, const char *key, const char *value)
{
	int			vlen = strlen(value);

	OtlpPutAttrStart(b, field, key, OtlpLenFieldSize(vlen));
	OtlpPutString(b, ANY_STRING, value, vlen);
}

/* ---------------------------------------------------------------- the buffer */

/* Is the buffer there (tuvl in shared_preload_libraries)? */
bool
OtlpReady(void)
{
	return trace_shared != NULL;
}

/*
 * A committed transaction's spans: nspans encoded fields in len bytes of
 * data, the i-th starting at starts[i].  As many whole spans as there is
 * room for go to the buffer, in one copy; the rest are counted as dropped.
 */
void
OtlpBufferSpans(const char *data, const int *starts, int nspans, Size len)
{
	bool		wake;
	int			fit = nspans;

	LWLockAcquire(trace_shared->lock, LW_EXCLUSIVE);
	wake = trace_shared->used == 0;
	while (fit > 0 && trace_shared->used + len > TRACE_BUFFER_BYTES)
		len = starts[--fit];
	memcpy(trace_shared->buf + trace_shared->used, data, len);
	trace_shared->used += len;
	trace_shared->nspans += fit;
	trace_shared->dropped += nspans - fit;

	/*
	 * the launcher exports: wake it for a buffer that was empty, or a quarter
	 * full
	 */
	wake |= trace_shared->used > TRACE_BUFFER_BYTES / 4;
	LWLockRelease(trace_shared->lock);
	if (wake && TuvlShmem && TuvlShmem->launcher_latch)
		SetLatch(TuvlShmem->launcher_latch);
}

/* ---------------------------------------------------------------- shared memory */

Size
OtlpShmemSize(void)
{
	return add_size(offsetof(TraceShared, buf), TRACE_BUFFER_BYTES);
}

void
OtlpShmemRequest(void)
{
	RequestAddinShmemSpace(OtlpShmemSize());
	RequestNamedLWLockTranche("tuvl traces", 1);
}

void
OtlpShmemStartup(void)
{
	bool		found;

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	trace_shared = ShmemInitStruct("tuvl traces", OtlpShmemSize(), &found);
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
	OtlpPutAttrString(&env_resource, RESOURCE_ATTRIBUTES, "service.name", "tuvl");
	OtlpPutAttrString(&env_resource, RESOURCE_ATTRIBUTES, "service.version", TUVL_VERSION);
	initStringInfo(&env_scope);
	OtlpPutString(&env_scope, SCOPE_NAME, "tuvl", 4);
	OtlpPutString(&env_scope, SCOPE_VERSION, TUVL_VERSION, strlen(TUVL_VERSION));
	MemoryContextSwitchTo(old);
}

/* What comes before spans_len bytes of spans (body has room for it). */
static void
put_envelope(StringInfo body, Size spans_len)
{
	Size		scope_spans = OtlpLenFieldSize(env_scope.len) + spans_len;

	OtlpPutLen(body, REQ_RESOURCE_SPANS,
			   OtlpLenFieldSize(env_resource.len) + OtlpLenFieldSize(scope_spans));
	OtlpPutLen(body, RS_RESOURCE, env_resource.len);
	appendBinaryStringInfo(body, env_resource.data, env_resource.len);
	OtlpPutLen(body, RS_SCOPE_SPANS, scope_spans);
	OtlpPutLen(body, SS_SCOPE, env_scope.len);
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
OtlpExport(void)
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
