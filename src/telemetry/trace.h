/*-------------------------------------------------------------------------
 *
 * trace.h
 *	  Traces of runs: W3C trace ids and spans (otlp.h exports them).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_TRACE_H
#define TUVL_TRACE_H

#include "access/xact.h"
#include "lib/stringinfo.h"
#include "utils/timestamp.h"

#include "runtime.h"

/* OpenTelemetry span kinds (the OTLP enum). */
#define SPAN_KIND_INTERNAL 1
#define SPAN_KIND_CLIENT 3

/* A span being built: its attributes accumulate in attrs. */
typedef struct TraceSpan
{
	RunState   *run;
	const char *name;
	int			kind;
	char	   *span_id;
	const char *parent_id;		/* NULL: a root span */
	TimestampTz start;
	StringInfoData attrs;		/* OTLP JSON attribute objects,
								 * comma-separated */
} TraceSpan;

extern bool TraceEnabled(RunState *run);
extern const char *TraceRunTraceId(RunState *run);
extern char *TraceSpanId(RunState *run, const char *what);
extern char *TraceParent(RunState *run, const char *span_id);
extern void TraceSpanStart(TraceSpan *s, RunState *run, const char *name, int kind,
						   char *span_id, const char *parent_id, TimestampTz start);
extern void TraceAttrString(TraceSpan *s, const char *key, const char *value);
extern void TraceAttrInt(TraceSpan *s, const char *key, int64 value);
extern void TraceSpanEnd(TraceSpan *s, TimestampTz end, const char *error);

/* span ids of a run's structure, the same wherever they are computed */
extern char *TraceRunSpanId(RunState *run);
extern char *TraceRunParentId(RunState *run);
extern char *TraceStepSpanId(RunState *run, int entry_seq);
extern char *TraceIterationSpanId(RunState *run, int entry_seq, int iteration);

extern void TraceXactCallback(XactEvent event, void *arg);
extern void TraceSubXactCallback(SubXactEvent event, SubTransactionId mySubid,
								 SubTransactionId parentSubid, void *arg);

#endif							/* TUVL_TRACE_H */
