/*-------------------------------------------------------------------------
 *
 * journal.h
 *	  The journal: events of a run, appended with gapless seq numbers.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_JOURNAL_H
#define TUVL_JOURNAL_H

#include "nodes/pg_list.h"
#include "utils/jsonb.h"
#include "utils/timestamp.h"

typedef struct JournalEvent
{
	TimestampTz ts;				/* when it happened (JournalAdd time) */
	char	   *type;
	char	   *agent_id;		/* the step id, or NULL for run events */
	char	   *engine;			/* the step kind, or NULL */
	int			tokens;			/* -1: none */
	double		latency_ms;		/* < 0: none */
	Jsonb	   *payload;		/* NULL: empty object */
	bool		notify_only;	/* not stored: a NOTIFY with the payload's
								 * fields (agent progress) */
} JournalEvent;

extern JournalEvent *JournalAdd(List **events, const char *type,
								const char *agent_id, const char *engine,
								Jsonb *payload);
extern int	JournalCount(List *events);
extern int	JournalWrite(int64 run_id, Oid principal, int last_seq, List *events);

#endif							/* TUVL_JOURNAL_H */
