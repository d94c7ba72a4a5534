/*-------------------------------------------------------------------------
 *
 * otlp.h
 *	  OTLP/HTTP export of spans: the protobuf writers spans are encoded
 *	  with, the buffer in shared memory, and the launcher's export.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_OTLP_H
#define TUVL_OTLP_H

#include "lib/stringinfo.h"

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

/* protobuf writers */
extern int	OtlpVarintSize(uint64 v);
extern void OtlpPutVarint(StringInfo b, uint64 v);
extern void OtlpPutTag(StringInfo b, int field, int wire);
extern void OtlpPutLen(StringInfo b, int field, Size len);
extern Size OtlpLenFieldSize(Size len);
extern void OtlpPutString(StringInfo b, int field, const char *value, int len);
extern void OtlpPutFixed64(StringInfo b, int field, uint64 v);
extern void OtlpPutId(StringInfo b, int field, const char *hex, int nbytes);
extern void OtlpPutAttrStart(StringInfo b, int field, const char *key, Size value_size);
extern void OtlpPutAttrString(StringInfo b, int field, const char *key, const char *value);

/* the buffer: spans of committed transactions, until the launcher sends them */
extern bool OtlpReady(void);
extern void OtlpBufferSpans(const char *data, const int *starts, int nspans, Size len);
extern Size OtlpShmemSize(void);
extern void OtlpShmemRequest(void);
extern void OtlpShmemStartup(void);
extern long OtlpExport(void);

#endif							/* TUVL_OTLP_H */
