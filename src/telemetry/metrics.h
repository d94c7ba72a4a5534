/*-------------------------------------------------------------------------
 *
 * metrics.h
 *	  Counters and histograms of what runs do, in shared memory.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_METRICS_H
#define TUVL_METRICS_H

#include "access/xact.h"

/* One label of a series: both strings, value clipped to 63 bytes. */
/* A series name's room, its terminating NUL included. */
#define METRIC_NAME_LEN 48

typedef struct MetricLabel
{
	const char *name;
	const char *value;
} MetricLabel;

extern void MetricCount(const char *name, Oid principal, const MetricLabel *labels, int nlabels,
						double delta);
extern void MetricObserveMs(const char *name, Oid principal, const MetricLabel *labels,
							int nlabels, double ms);

extern Size MetricsShmemSize(void);
extern void MetricsShmemRequest(void);
extern void MetricsShmemStartup(void);
extern void MetricsXactCallback(XactEvent event, void *arg);
extern void MetricsSubXactCallback(SubXactEvent event, SubTransactionId mySubid,
								   SubTransactionId parentSubid, void *arg);

#endif							/* TUVL_METRICS_H */
