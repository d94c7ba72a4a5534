/*-------------------------------------------------------------------------
 *
 * journal.c
 *	  The journal: events of a run, appended with gapless seq numbers,
 *	  and the trigger that announces each one with NOTIFY.
 *
 * Only the holder of a run's lease (or the transaction that creates the
 * run, or one holding its row lock while nobody holds a lease) appends to
 * its journal, so the next seq is simply the run's last_seq plus one.
 * Events are collected in memory during a transition and written by
 * JournalWrite inside the transition's (sub)transaction, together with the
 * run's new checkpoint: they commit or vanish together.  SPI must be
 * connected.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "catalog/pg_type.h"
#include "commands/async.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/json.h"
#include "utils/rel.h"

#include "journal.h"
#include "jsonutil.h"
#include "spiutil.h"

PG_FUNCTION_INFO_V1(tuvl_notify_event);

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

static const char insert_event_sql[] =
"INSERT INTO tuvl.events (run_id, seq, type, agent_id, engine, tokens, latency_ms, payload, ts) "
"VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/*
 * Write events with seq last_seq+1, last_seq+2, ...; returns the new last
 * seq.  Runs as the current user: callers write as the extension owner.
 */
int
JournalWrite(int64 run_id, int last_seq, List *events)
{
	static const Oid types[9] = {INT8OID, INT4OID, TEXTOID, TEXTOID, TEXTOID,
	INT4OID, FLOAT8OID, JSONBOID, TIMESTAMPTZOID};
	ListCell   *lc;

	foreach(lc, events)
	{
		JournalEvent *ev = lfirst(lc);
		Datum		values[9];
		char		nulls[9] = {' ', ' ', ' ', ' ', ' ', ' ', ' ', ' ', ' '};

		values[0] = Int64GetDatum(run_id);
		values[1] = Int32GetDatum(++last_seq);
		values[2] = CStringGetTextDatum(ev->type);
		if (ev->agent_id)
			values[3] = CStringGetTextDatum(ev->agent_id);
		else
			nulls[3] = 'n';
		if (ev->engine)
			values[4] = CStringGetTextDatum(ev->engine);
		else
			nulls[4] = 'n';
		if (ev->tokens >= 0)
			values[5] = Int32GetDatum(ev->tokens);
		else
			nulls[5] = 'n';
		if (ev->latency_ms >= 0)
			values[6] = Float8GetDatum(ev->latency_ms);
		else
			nulls[6] = 'n';
		values[7] = JsonbPGetDatum(ev->payload ? ev->payload : JsonEmptyObject());
		values[8] = TimestampTzGetDatum(ev->ts);
		SpiExec(insert_event_sql, 9, types, values, nulls, SPI_OK_INSERT);
	}
	return last_seq;
}

/*
 * AFTER INSERT trigger on tuvl.events: NOTIFY tuvl_events with
 * {"run_id", "seq", "type", "agent_id"}.  Notifications of an aborted
 * (sub)transaction are discarded with it, so listeners only ever hear of
 * committed events, in commit order.
 */
Datum
tuvl_notify_event(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	TupleDesc	tupdesc;
	HeapTuple	tuple;
	bool		isnull;
	Datum		d;
	StringInfoData buf;

	if (!CALLED_AS_TRIGGER(fcinfo) || !TRIGGER_FIRED_AFTER(trigdata->tg_event) ||
		!TRIGGER_FIRED_FOR_ROW(trigdata->tg_event))
		elog(ERROR, "tuvl_notify_event must be an AFTER ROW trigger");

	tupdesc = RelationGetDescr(trigdata->tg_relation);
	tuple = trigdata->tg_trigtuple;

	initStringInfo(&buf);
	d = heap_getattr(tuple, 1, tupdesc, &isnull);
	appendStringInfo(&buf, "{\"run_id\": " INT64_FORMAT, DatumGetInt64(d));
	d = heap_getattr(tuple, 2, tupdesc, &isnull);
	appendStringInfo(&buf, ", \"seq\": %d, \"type\": ", DatumGetInt32(d));
	d = heap_getattr(tuple, 4, tupdesc, &isnull);
	escape_json(&buf, TextDatumGetCString(d));
	appendStringInfoString(&buf, ", \"agent_id\": ");
	d = heap_getattr(tuple, 5, tupdesc, &isnull);
	if (isnull)
		appendStringInfoString(&buf, "null");
	else
		escape_json(&buf, TextDatumGetCString(d));
	appendStringInfoChar(&buf, '}');

	Async_Notify("tuvl_events", buf.data);
	pfree(buf.data);
	return PointerGetDatum(NULL);
}
