/*-------------------------------------------------------------------------
 *
 * timers.c
 *	  Durable wake-ups: sleeping runs whose time has come, Human steps and
 *	  tool approvals past their timeout, agents paused too long.
 *
 * The workers' maintenance calls these each second, in a transaction with
 * SPI connected.  A due run is found by its wake_at (a partial index per
 * status), requeued with SKIP LOCKED so two workers never wake the same
 * run, and journaled with a resumed event in the same transaction.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"

#include "concurrency.h"
#include "journal.h"
#include "jsonutil.h"
#include "queue.h"
#include "run_control.h"
#include "security.h"
#include "spiutil.h"
#include "timers.h"
#include "tuvl.h"

/*
 * The due runs of one status: each status has a partial index on wake_at
 * of its own, whose predicate this query repeats.  These statements run
 * each second in each worker, so they are planned at each execution
 * (SpiExecReplanned): a plan kept from when tuvl.runs was empty read the
 * whole table every second (the sleeping runs' UPDATE walked the primary
 * key as a nested loop's outer side; the approvals and the pauses scanned
 * the table), up to a fifth of a busy worker's CPU.  The sleeping runs'
 * query also returns what each waited for before the UPDATE clears it
 * (waiting, the step's awaiting object) and its key: the resumed event
 * says why it woke.
 */
static const char wake_sleeping_sql[] =
"WITH due AS MATERIALIZED ( "
"    SELECT w.id, w.waiting FROM tuvl.runs w "
"    WHERE w.status OPERATOR(pg_catalog.=) 'sleeping' AND w.wake_at OPERATOR(pg_catalog.<=) pg_catalog.now() "
"    ORDER BY w.wake_at LIMIT 1000 FOR UPDATE SKIP LOCKED) "
"UPDATE tuvl.runs r SET status = 'queued', wake_at = NULL, waiting = NULL, last_seq = r.last_seq OPERATOR(pg_catalog.+) 1 "
"FROM due WHERE r.id OPERATOR(pg_catalog.=) due.id "
"RETURNING r.id, r.last_seq OPERATOR(pg_catalog.-) 1, r.current_step, r.principal_id, r.priority, "
"  r.workflow, r.concurrency_key, r.concurrency_limit, r.held_by, due.waiting, "
"  r.step_state OPERATOR(pg_catalog.->) 'awaiting', r.key";

static const char wake_human_sql[] =
"UPDATE tuvl.runs r SET status = 'queued', wake_at = NULL, last_seq = r.last_seq OPERATOR(pg_catalog.+) 1 "
"WHERE r.id OPERATOR(pg_catalog.=) ANY (ARRAY( "
"    SELECT w.id FROM tuvl.runs w "
"    WHERE w.status OPERATOR(pg_catalog.=) 'waiting_human' AND w.wake_at IS NOT NULL "
"      AND w.wake_at OPERATOR(pg_catalog.<=) pg_catalog.now() "
"    ORDER BY w.wake_at LIMIT 1000 FOR UPDATE SKIP LOCKED)) "
"RETURNING r.id, r.last_seq OPERATOR(pg_catalog.-) 1, r.current_step, r.principal_id, r.priority, "
"  r.step_state OPERATOR(pg_catalog.->) 'awaiting' OPERATOR(pg_catalog.->>) 'kind'";

/*
 * Tool calls whose approval_timeout passed without a decision: each is
 * rejected as tuvl.decide(run, false, ...) would, by "tuvl", and the model
 * is told so.
 */
static int
reject_late_approvals(void)
{
	uint64		n = SpiExecReplanned("SELECT w.id, (w.step_state OPERATOR(pg_catalog.->) 'awaiting' "
									 "    OPERATOR(pg_catalog.->>) 'timeout_ms')::pg_catalog.int4 "
									 "FROM tuvl.runs w "
									 "WHERE w.status OPERATOR(pg_catalog.=) 'waiting_approval' AND w.wake_at IS NOT NULL "
									 "  AND w.wake_at OPERATOR(pg_catalog.<=) pg_catalog.now() "
									 "ORDER BY w.wake_at LIMIT 100 FOR UPDATE SKIP LOCKED",
									 0, NULL, NULL, NULL, SPI_OK_SELECT);
	SPITupleTable *tt = SPI_tuptable;
	int64	   *ids = palloc(sizeof(int64) * Max(n, 1));
	int		   *ms = palloc(sizeof(int) * Max(n, 1));

	for (uint64 i = 0; i < n; i++)
	{
		bool		isnull;

		ids[i] = DatumGetInt64(SPI_getbinval(tt->vals[i], tt->tupdesc, 1, &isnull));
		ms[i] = DatumGetInt32(SPI_getbinval(tt->vals[i], tt->tupdesc, 2, &isnull));
		if (isnull)
			ms[i] = 0;
	}
	for (uint64 i = 0; i < n; i++)
	{
		PersonAnswer answer;

		memset(&answer, 0, sizeof(answer));
		answer.approved = false;
		answer.by = "tuvl";
		answer.note = psprintf("no decision within the approval_timeout of %s",
							   ms[i] % 1000 == 0 ? psprintf("%d s", ms[i] / 1000) : psprintf("%d ms", ms[i]));
		ControlAnswer(ids[i], &answer);
	}
	return (int) n;
}

/*
 * Row i of a re-queue's RETURNING (id, last_seq before it, current_step,
 * principal_id, priority): tell the queue at commit, and journal payload
 * as its resumed event (engine kind, NULL: none).
 */
void
TimersJournalRequeued(SPITupleTable *tt, uint64 i, const char *kind, Jsonb *payload)
{
	bool		isnull;
	int64		id = DatumGetInt64(SPI_getbinval(tt->vals[i], tt->tupdesc, 1, &isnull));
	int			last_seq = DatumGetInt32(SPI_getbinval(tt->vals[i], tt->tupdesc, 2, &isnull));
	Oid			principal = DatumGetObjectId(SPI_getbinval(tt->vals[i], tt->tupdesc, 4, &isnull));
	List	   *events = NIL;

	QueueNoteAtCommit(principal, DatumGetInt32(SPI_getbinval(tt->vals[i], tt->tupdesc, 5, &isnull)),
					  id);
	JournalAdd(&events, "resumed", SPI_getvalue(tt->vals[i], tt->tupdesc, 3), kind, payload);
	(void) JournalWrite(id, principal, last_seq, events);
}

/* Column col of row i of tt as jsonb (NULL when NULL), in the caller's context. */
static Jsonb *
row_jsonb(SPITupleTable *tt, uint64 i, int col)
{
	bool		isnull;
	Datum		d = SPI_getbinval(tt->vals[i], tt->tupdesc, col, &isnull);

	return isnull ? NULL : DatumGetJsonbPCopy(d);
}

/* "the rate limit of key K (N per P)" of a rate limit's description r */
static char *
rate_limit_text(Jsonb *r)
{
	return psprintf("the rate limit of key %s (%d per %s)", JsonGetString(r, "key"),
					JsonGetInt32(r, "limit", 0), JsonGetString(r, "per"));
}

/*
 * Why sleeping run i of wake_sleeping_sql's RETURNING wakes, for its
 * resumed event: a Sleep step's time, a step's rate limit, or, before its
 * first step, its not_before, its debounce or its workflow's rate limit.
 */
static const char *
wake_reason(SPITupleTable *tt, uint64 i, const char *step)
{
	Jsonb	   *waiting = row_jsonb(tt, i, 10);
	Jsonb	   *awaiting = row_jsonb(tt, i, 11);
	char	   *key = SPI_getvalue(tt->vals[i], tt->tupdesc, 12);
	char	   *kind;
	char	   *debounce = NULL;

	if (step)
	{
		kind = awaiting ? JsonGetString(awaiting, "kind") : NULL;
		if (kind && strcmp(kind, "rate_limit") == 0)
			return psprintf("%s lets step %s go", rate_limit_text(awaiting), step);
		return "the Sleep step's time has come";
	}
	/* a run started for later has no step yet */
	kind = waiting ? JsonGetString(waiting, "for") : NULL;
	if (kind == NULL)
		return "its not_before has come";
	debounce = JsonGetString(waiting, "debounce");
	if (strcmp(kind, "rate_limit") == 0 && JsonGetJsonb(waiting, "rate_limit") != NULL)
		return debounce
			? psprintf("the debounce of key %s is over (quiet for %s) and %s lets it start", key, debounce,
					   rate_limit_text(JsonGetJsonb(waiting, "rate_limit")))
			: psprintf("%s lets it start", rate_limit_text(JsonGetJsonb(waiting, "rate_limit")));
	if (strcmp(kind, "debounce") == 0 && debounce)
		return psprintf("the debounce of key %s is over: it was quiet for %s", key, debounce);
	return "its not_before has come";
}

/* Queue the runs wake_sql finds, each with a resumed event; returns how many. */
static int
wake(const char *wake_sql, bool human)
{
	uint64		n = SpiExecReplanned(wake_sql, 0, NULL, NULL, NULL, SPI_OK_UPDATE_RETURNING);
	SPITupleTable *tt = SPI_tuptable;

	for (uint64 i = 0; i < n; i++)
	{
		char	   *step = SPI_getvalue(tt->vals[i], tt->tupdesc, 3);

		/* an MCP step waiting on its server's question (step_mcp.c) */
		char	   *kind = human ? SPI_getvalue(tt->vals[i], tt->tupdesc, 6) : NULL;
		bool		mcp = kind && strcmp(kind, "mcp_elicitation") == 0;
		JsonObjBuilder b;
		bool		null;

		JsonObjStart(&b);
		JsonObjAddString(&b, "by", "tuvl");
		JsonObjAddString(&b, "reason", mcp ? "the MCP server's question waited past its elicitation_timeout" :
						 human ? "the Human step's timeout passed" : wake_reason(tt, i, step));
		TimersJournalRequeued(tt, i, mcp ? "MCP" : human ? "Human" : step ? "Sleep" : NULL, JsonObjEnd(&b));

		/*
		 * a run of a concurrency key that waited for not_before now asks for
		 * a place
		 */
		if (!human && SPI_getvalue(tt->vals[i], tt->tupdesc, 9) != NULL)
			(void) ConcurrencyAdmit(SPI_getvalue(tt->vals[i], tt->tupdesc, 6),
									SPI_getvalue(tt->vals[i], tt->tupdesc, 7),
									pg_strtoint32(SPI_getvalue(tt->vals[i], tt->tupdesc, 8)),
									DatumGetObjectId(SPI_getbinval(tt->vals[i], tt->tupdesc, 4, &null)));
	}
	return (int) n;
}

/*
 * Queue the sleeping runs whose time has come and the runs whose Human
 * step waited past its timeout (at most 1,000 of each at a time, those due
 * first); their step then ends.  Called by the workers' maintenance each
 * second; SPI connected, in a transaction.  While nothing is due, each is
 * a probe of its index's first entry.
 */
int
TimersWakeSleepers(void)
{
	SecurityFrame frame;
	int			n;

	SecurityAsOwner(&frame);
	n = wake(wake_sleeping_sql, false);
	n += wake(wake_human_sql, true);
	n += reject_late_approvals();
	SecurityRestore(&frame);
	if (n > 0)
		TuvlRunChangedAtCommit();
	return n;
}

/*
 * Abort agents paused longer than tuvl.agent_pause_max: re-queue them
 * with an abort directive, so each takes its aborted exit.  Called by the
 * workers' maintenance; SPI connected, in a transaction.
 */
int
TimersExpirePauses(void)
{
	static const Oid types[1] = {INT4OID};
	Datum		values[1];
	uint64		n;
	char	   *reason = psprintf("paused longer than tuvl.agent_pause_max (%d s)", tuvl_agent_pause_max);
	SecurityFrame frame;

	values[0] = Int32GetDatum(tuvl_agent_pause_max);
	SecurityAsOwner(&frame);
	n = SpiExecReplanned("UPDATE tuvl.runs SET status = 'queued', last_seq = last_seq OPERATOR(pg_catalog.+) 1, "
						 "  control = (control OPERATOR(pg_catalog.-) '{paused_at,pause_max,pause}'::pg_catalog.text[]) "
						 "    OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object('abort', "
						 "      pg_catalog.jsonb_build_object('reason', "
						 "        pg_catalog.format('paused longer than tuvl.agent_pause_max (%s s)', $1), "
						 "        'by', 'tuvl')) "
						 "WHERE status OPERATOR(pg_catalog.=) 'paused' "
						 "  AND (control OPERATOR(pg_catalog.->>) 'pause_max')::pg_catalog.bool "
						 "  AND (control OPERATOR(pg_catalog.->>) 'paused_at')::pg_catalog.timestamptz "
						 "      OPERATOR(pg_catalog.<) (pg_catalog.now() OPERATOR(pg_catalog.-) "
						 "      pg_catalog.make_interval(secs => $1::pg_catalog.float8)) "
						 "RETURNING id, last_seq OPERATOR(pg_catalog.-) 1, current_step, principal_id, priority",
						 1, types, values, NULL, SPI_OK_UPDATE_RETURNING);
	if (n > 0)
	{
		SPITupleTable *tt = SPI_tuptable;

		/* each is journaled: the run goes on to take its aborted exit */
		for (uint64 i = 0; i < n; i++)
		{
			JsonObjBuilder b;

			JsonObjStart(&b);
			JsonObjAddString(&b, "by", "tuvl");
			JsonObjAddString(&b, "reason", reason);
			JsonObjAddBool(&b, "abort", true);
			TimersJournalRequeued(tt, i, NULL, JsonObjEnd(&b));
		}
		TuvlRunChangedAtCommit();
	}
	SecurityRestore(&frame);
	return (int) n;
}
