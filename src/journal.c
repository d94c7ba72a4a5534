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
 * NOTIFYs on tuvl_events.  Every event goes through JournalWrite.  SPI
 * must be connected.
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

#include "journal.h"
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

static const char insert_events_sql[] =
"INSERT INTO tuvl.events (run_id, seq, ts, type, agent_id, engine, tokens, latency_ms, payload) "
"SELECT $1, $2 OPERATOR(pg_catalog.+) e.n, e.ts, e.type, e.agent_id, e.engine, e.tokens, "
"       e.latency_ms, e.payload "
"FROM ROWS FROM (pg_catalog.unnest($3::pg_catalog.timestamptz[]), pg_catalog.unnest($4::pg_catalog.text[]), "
"               pg_catalog.unnest($5::pg_catalog.text[]), pg_catalog.unnest($6::pg_catalog.text[]), "
"               pg_catalog.unnest($7::pg_catalog.int4[]), pg_catalog.unnest($8::pg_catalog.float8[]), "
"               pg_catalog.unnest($9::pg_catalog.jsonb[])) WITH ORDINALITY "
"     AS e(ts, type, agent_id, engine, tokens, latency_ms, payload, n)";

/*
 * NOTIFY tuvl_events with {"run_id", "seq", "type", "agent_id"}; a
 * notify-only event (agent progress) adds its payload's fields, and its
 * seq is that of the newest stored event before it.
 */
static void
notify_event(int64 run_id, int seq, JournalEvent *ev)
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
	Async_Notify("tuvl_events", buf.data);
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
 * Write events with seq last_seq+1, last_seq+2, ... in one statement, and
 * announce each with NOTIFY (delivered at commit, discarded on abort).
 * Returns the new last seq.  Callers hold an owner frame (security.c).
 */
int
JournalWrite(int64 run_id, int last_seq, List *events)
{
	static const Oid types[9] = {INT8OID, INT4OID, TIMESTAMPTZARRAYOID, TEXTARRAYOID,
		TEXTARRAYOID, TEXTARRAYOID, INT4ARRAYOID, FLOAT8ARRAYOID, JSONBARRAYOID};
	int			n = JournalCount(events);
	Datum	   *ts,
			   *type,
			   *agent,
			   *engine,
			   *tokens,
			   *latency,
			   *payload;
	bool	   *agent_null,
			   *engine_null,
			   *tokens_null,
			   *latency_null;
	Datum		values[9];
	int			dims[1];
	int			lbs[1] = {1};
	int			i = 0;
	ListCell   *lc;

	if (n == 0)
	{
		foreach(lc, events)
			notify_event(run_id, last_seq, lfirst(lc));
		return last_seq;
	}
	ts = palloc(sizeof(Datum) * n);
	type = palloc(sizeof(Datum) * n);
	agent = palloc(sizeof(Datum) * n);
	engine = palloc(sizeof(Datum) * n);
	tokens = palloc(sizeof(Datum) * n);
	latency = palloc(sizeof(Datum) * n);
	payload = palloc(sizeof(Datum) * n);
	agent_null = palloc0(sizeof(bool) * n);
	engine_null = palloc0(sizeof(bool) * n);
	tokens_null = palloc0(sizeof(bool) * n);
	latency_null = palloc0(sizeof(bool) * n);
	foreach(lc, events)
	{
		JournalEvent *ev = lfirst(lc);

		if (ev->notify_only)
			continue;
		ts[i] = TimestampTzGetDatum(ev->ts);
		type[i] = CStringGetTextDatum(ev->type);
		agent_null[i] = ev->agent_id == NULL;
		agent[i] = ev->agent_id ? CStringGetTextDatum(ev->agent_id) : (Datum) 0;
		engine_null[i] = ev->engine == NULL;
		engine[i] = ev->engine ? CStringGetTextDatum(ev->engine) : (Datum) 0;
		tokens_null[i] = ev->tokens < 0;
		tokens[i] = Int32GetDatum(ev->tokens);
		latency_null[i] = ev->latency_ms < 0;
		latency[i] = Float8GetDatum(ev->latency_ms);
		payload[i] = JsonbPGetDatum(ev->payload ? ev->payload : JsonEmptyObject());
		i++;
	}
	dims[0] = n;
	values[0] = Int64GetDatum(run_id);
	values[1] = Int32GetDatum(last_seq);
	values[2] = PointerGetDatum(construct_md_array(ts, NULL, 1, dims, lbs, TIMESTAMPTZOID,
												   8, true, TYPALIGN_DOUBLE));
	values[3] = PointerGetDatum(construct_md_array(type, NULL, 1, dims, lbs, TEXTOID,
												   -1, false, TYPALIGN_INT));
	values[4] = PointerGetDatum(construct_md_array(agent, agent_null, 1, dims, lbs, TEXTOID,
												   -1, false, TYPALIGN_INT));
	values[5] = PointerGetDatum(construct_md_array(engine, engine_null, 1, dims, lbs, TEXTOID,
												   -1, false, TYPALIGN_INT));
	values[6] = PointerGetDatum(construct_md_array(tokens, tokens_null, 1, dims, lbs, INT4OID,
												   4, true, TYPALIGN_INT));
	values[7] = PointerGetDatum(construct_md_array(latency, latency_null, 1, dims, lbs, FLOAT8OID,
												   8, true, TYPALIGN_DOUBLE));
	values[8] = PointerGetDatum(construct_md_array(payload, NULL, 1, dims, lbs, JSONBOID,
												   -1, false, TYPALIGN_INT));
	SpiExec(insert_events_sql, 9, types, values, NULL, SPI_OK_INSERT);

	i = 0;
	foreach(lc, events)
	{
		JournalEvent *ev = lfirst(lc);

		notify_event(run_id, ev->notify_only ? last_seq + i : last_seq + (++i), ev);
	}
	return last_seq + n;
}
