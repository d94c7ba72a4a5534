/*-------------------------------------------------------------------------
 *
 * journal.c
 *	  The journal: events of a run, appended with gapless seq numbers and
 *	  announced with NOTIFY.
 *
 * Only the holder of a run's lease (or the transaction that creates the
 * run, or one holding its row lock while nobody holds a lease) appends to
 * its journal, so the next seq is simply the run's last_seq plus one.
 * Events are collected in memory during a transition and written by
 * JournalWrite inside the transition's (sub)transaction, together with the
 * run's new checkpoint: they commit or vanish together, and so do their
 * NOTIFYs, on the channel of the run's principal and on the operators'
 * (channel.c).  Every event goes through JournalWrite.  SPI must be
 * connected.
 *
 * A transition's events are stored as one row of tuvl.journal, a block
 * whose seq is its first event's (journal_block.c); the view tuvl.events
 * shows one row per event.
 *
 * A notify-only event (an agent's progress) is not stored and takes no
 * seq: it is announced in its place among the others, carrying the seq of
 * the stored event before it.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "catalog/pg_type.h"
#include "commands/async.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/json.h"
#include "utils/rel.h"

#include "channel.h"
#include "journal.h"
#include "journal_block.h"
#include "jsonutil.h"
#include "spiutil.h"


/*
 * Queue an event in a transition's in-memory list, stamped with the time
 * it happened.  The event is written by JournalWrite; fields can be
 * completed (tokens, latency) before that.
 */
JournalEvent *
JournalAdd(List **events, const char *type, const char *agent_id,
		   const char *engine, Jsonb *payload)
{
	JournalEvent *ev = palloc0(sizeof(JournalEvent));

	ev->ts = GetCurrentTimestamp();
	ev->type = pstrdup(type);
	ev->agent_id = agent_id ? pstrdup(agent_id) : NULL;
	ev->engine = engine ? pstrdup(engine) : NULL;
	ev->tokens = -1;
	ev->latency_ms = -1;
	ev->payload = payload;
	*events = lappend(*events, ev);
	return ev;
}

/* One row per transition: its events packed (journal_block.c). */
static const char insert_block_sql[] =
"INSERT INTO tuvl.journal (run_id, seq, n, events) VALUES ($1, $2, $3, $4)";

/*
 * NOTIFY {"run_id", "seq", "type", "agent_id"} on channel and on the
 * operators' channel; a notify-only event (agent progress) adds its
 * payload's fields, and its seq is that of the newest stored event
 * before it.
 */
static void
notify_event(int64 run_id, const char *channel, int seq, JournalEvent *ev)
{
	StringInfoData buf;
	char	   *fields = ev->notify_only && ev->payload
	? JsonbToCString(NULL, &ev->payload->root, VARSIZE(ev->payload)) : NULL;

	initStringInfo(&buf);
	appendStringInfo(&buf, "{\"run_id\": " INT64_FORMAT ", \"seq\": %d, \"type\": ", run_id, seq);
	escape_json(&buf, ev->type);
	appendStringInfoString(&buf, ", \"agent_id\": ");
	if (ev->agent_id)
		escape_json(&buf, ev->agent_id);
	else
		appendStringInfoString(&buf, "null");
	/* splice the payload object's fields in */
	if (fields && strlen(fields) > 2 && fields[0] == '{')
		appendStringInfo(&buf, ", %s", fields + 1);
	else
		appendStringInfoChar(&buf, '}');
	Async_Notify(channel, buf.data);
	Async_Notify(ChannelOfOperators(), buf.data);
	pfree(buf.data);
}

/* How many of events are stored (have a seq). */
int
JournalCount(List *events)
{
	ListCell   *lc;
	int			n = 0;

	foreach(lc, events)
		n += ((JournalEvent *) lfirst(lc))->notify_only ? 0 : 1;
	return n;
}

/*
 * Write events with seq last_seq+1, last_seq+2, ... as one row of
 * tuvl.journal (journal_block.c), and announce each with NOTIFY on the
 * channels of principal (the run's) and of the operators (delivered at
 * commit, discarded on abort).  Returns the new last seq.  Callers hold
 * an owner frame (security.c).
 */
int
JournalWrite(int64 run_id, Oid principal, int last_seq, List *events)
{
	static const Oid types[4] = {INT8OID, INT4OID, INT4OID, BYTEAOID};
	int			n = JournalCount(events);
	Datum		values[4];
	int			i = 0;
	ListCell   *lc;
	char		channel[NAMEDATALEN];

	if (n > 0)
	{
		values[0] = Int64GetDatum(run_id);
		values[1] = Int32GetDatum(last_seq + 1);
		values[2] = Int32GetDatum(n);
		values[3] = PointerGetDatum(JournalBlockPack(events));
		SpiExec(insert_block_sql, 4, types, values, NULL, SPI_OK_INSERT);
	}
	if (events != NIL)
		strlcpy(channel, ChannelOfRole(principal), sizeof(channel));
	foreach(lc, events)
	{
		JournalEvent *ev = lfirst(lc);

		notify_event(run_id, channel, ev->notify_only ? last_seq + i : last_seq + (++i), ev);
	}
	return last_seq + n;
}
