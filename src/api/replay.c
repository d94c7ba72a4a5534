/*-------------------------------------------------------------------------
 *
 * replay.c
 *	  Pinned fixtures and replay: a recorded run re-executed with every
 *	  result from outside the database served from its journal.
 *
 * tuvl.pin_run(run_id) exports a run as a fixture: the workflow and its
 * source at the version the run used, the input, the artifact versions it
 * resolved, its end and response, and every result that came from outside
 * the database, in order: model answers (llm_turn), HTTP and MCP
 * responses (tool_call/tool_result with a position), data submitted to a
 * Human step, decisions on tool approvals, what child runs came to, and
 * the operators' actions: steer messages where an agent took them in, and
 * aborts, in an agent's turn or between steps.  Private "_" keys of the
 * input and response are redacted; secrets never reached the journal.
 *
 * tuvl.replay(fixture) runs the current version of the workflow in this
 * backend, inside the caller's transaction, exactly like tuvl.run(),
 * except that whenever the run asks for something from outside, the next
 * recorded result is served instead: nothing is sent, no model is paid
 * for.  SQL steps execute for real, so a test can replay and roll back.
 * The replay raises at the first divergence: an effect the recording does
 * not hold, one asked by another step or with other arguments, or a
 * different end, status or response.  An operator's action is applied
 * where the recording took it: a steer or an abort at the top of the agent
 * turn that took it, an abort between steps before the transition that
 * followed it, or instead of a person's answer.  Idempotency keys are those of the
 * recorded run.  Replay is recovery in which every effect is served from
 * the journal: the same code path as the workers'.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "run_create.h"
#include "replay.h"
#include "run_control.h"
#include "driver.h"
#include "effect.h"
#include "executor.h"
#include "journal.h"
#include "jsonutil.h"
#include "llm.h"
#include "runtime.h"
#include "security.h"
#include "spiutil.h"
#include "tuvl.h"
#include "workflow.h"
#include "tokens.h"

PG_FUNCTION_INFO_V1(tuvl_pin_run);
PG_FUNCTION_INFO_V1(tuvl_replay);

#define FIXTURE_FORMAT 1
#define REDACTED "[redacted]"

static bool
jequal(Jsonb *a, Jsonb *b)
{
	if (a == NULL || b == NULL)
		return a == b;
	return compareJsonbContainers(&a->root, &b->root) == 0;
}

/* An object with the values of its top-level "_" keys redacted. */
static Jsonb *
redact_private(Jsonb *j)
{
	JsonbIterator *it;
	JsonbValue	v;
	char	   *key;

	if (j == NULL || !JsonIsObject(j))
		return j;
	it = JsonbIteratorInit(&j->root);
	while (JsonObjectNext(&it, &key, &v))
		if (key[0] == '_')
			j = JsonSetKey(j, key, JsonStringValue(REDACTED));
	return j;
}

/* ---------------------------------------------------------------- pin */

/* The raw result an llm_turn event's payload stands for. */
static Jsonb *
llm_result(Jsonb *p)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "op", "llm");
	JsonObjAddJsonb(&b, "provider", JsonGetJsonb(p, "provider"));
	JsonObjAddJsonb(&b, "model", JsonGetJsonb(p, "model"));
	JsonObjAddJsonb(&b, "status", JsonGetJsonb(p, "status"));
	JsonObjAddJsonb(&b, "headers", JsonGetField(p, "headers") ? JsonGetJsonb(p, "headers") : JsonEmptyObject());
	JsonObjAddJsonb(&b, "body", JsonGetJsonb(p, "response"));
	JsonObjAddJsonb(&b, "latency_ms", JsonGetJsonb(p, "latency_ms"));
	if (JsonGetField(p, "error_kind"))
	{
		JsonObjAddJsonb(&b, "error", JsonGetJsonb(p, "transport_error"));
		JsonObjAddJsonb(&b, "error_kind", JsonGetJsonb(p, "error_kind"));
	}
	if (JsonGetField(p, "body_error"))
		JsonObjAddJsonb(&b, "body_error", JsonGetJsonb(p, "body_error"));
	if (JsonGetField(p, "judge"))
		JsonObjAddJsonb(&b, "judge", JsonGetJsonb(p, "judge"));
	/* the recorded price: a replay reports the recorded cost */
	if (JsonGetField(p, "price"))
		JsonObjAddJsonb(&b, "price", JsonGetJsonb(p, "price"));
	return JsonObjEnd(&b);
}

static Jsonb *
fixture_effect(const char *step, const char *type, Jsonb *request, Jsonb *result)
{
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "step", step);
	JsonObjAddString(&b, "type", type);
	if (request)
		JsonObjAddJsonb(&b, "request", request);
	JsonObjAddJsonb(&b, "result", result);
	return JsonObjEnd(&b);
}

/* Run the SELECT sql with run id as $1; returns the number of rows. */
static uint64
select_for_run(const char *sql, int64 id)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1];

	values[0] = Int64GetDatum(id);
	return SpiExec(sql, 1, types, values, NULL, SPI_OK_SELECT);
}

/*
 * Read run id as the caller, who must be able to see it, and refuse it
 * unless it has ended and no operator aborted or steered it.  The run's
 * row stays valid until SPI_finish.
 */
static void
read_pinnable_run(int64 id, HeapTuple *tup, TupleDesc *td, char **workflow, int *version,
				  char **status)
{
	bool		isnull;

	/* as the caller: a run it cannot see does not exist for it */
	select_for_run("SELECT r.workflow, r.workflow_version, r.status, r.input, r.end_name, r.response, "
				   "  r.artifacts, w.source "
				   "FROM tuvl.runs r JOIN tuvl.workflows w "
				   "  ON w.name OPERATOR(pg_catalog.=) r.workflow "
				   " AND w.version OPERATOR(pg_catalog.=) r.workflow_version "
				   "WHERE r.id OPERATOR(pg_catalog.=) $1",
				   id);
	if (SPI_processed != 1)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("run " INT64_FORMAT " does not exist", id),
				 errhint("Runs are visible to the role that started them and to members of tuvl_operator.")));
	*tup = SPI_tuptable->vals[0];
	*td = SPI_tuptable->tupdesc;
	*workflow = SPI_getvalue(*tup, *td, 1);
	*version = DatumGetInt32(SPI_getbinval(*tup, *td, 2, &isnull));
	*status = SPI_getvalue(*tup, *td, 3);
	if (!RunStatusIsTerminal(StatusFromName(*status)))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("run " INT64_FORMAT " has not ended: its status is %s", id, *status),
				 errhint("Pin a run once it has ended.")));
}

/* Add the run's own fields, from its row tup, to the fixture b. */
static void
add_run_fields(JsonObjBuilder *b, int64 id, HeapTuple tup, TupleDesc td,
			   const char *workflow, int version, const char *status)
{
	bool		isnull;
	Datum		d;

	JsonObjAddInt(b, "tuvl_fixture", FIXTURE_FORMAT);
	JsonObjAddString(b, "workflow", workflow);
	JsonObjAddInt(b, "version", version);
	JsonObjAddInt(b, "run_id", id);
	d = SPI_getbinval(tup, td, 4, &isnull);
	JsonObjAddJsonb(b, "input", redact_private(DatumGetJsonbPCopy(d)));
	JsonObjAddString(b, "status", status);
	JsonObjAddString(b, "end", SPI_getvalue(tup, td, 5));
	d = SPI_getbinval(tup, td, 6, &isnull);
	JsonObjAddJsonb(b, "response", isnull ? NULL : redact_private(DatumGetJsonbPCopy(d)));
	d = SPI_getbinval(tup, td, 7, &isnull);
	JsonObjAddJsonb(b, "artifacts", isnull ? NULL : DatumGetJsonbPCopy(d));
	JsonObjAddString(b, "source", SPI_getvalue(tup, td, 8));
}

/*
 * The fixture's effect for one journal event of type with payload p, or
 * NULL.  key names the event's step and position; the request of an HTTP
 * tool_call waits in *pending_requests for its tool_result.
 */
static Jsonb *
event_effect(const char *type, const char *step, Jsonb *p, const char *key,
			 Jsonb **pending_requests, Jsonb **llm_requests)
{
	Jsonb	   *effect = NULL;

	if (strcmp(type, "llm_turn") == 0)
	{
		Jsonb	   *request = JsonGetField(p, "request") ? JsonGetJsonb(p, "request") : NULL;

		/* a step's turns after its first carry what changed (llm_request.c) */
		if (step && JsonGetField(p, "judge") == NULL)
		{
			Jsonb	   *prev = JsonGetField(*llm_requests, step) ? JsonGetJsonb(*llm_requests, step) : NULL;

			request = LlmRequestNext(prev, p);
			if (request)
				*llm_requests = JsonSetKey(*llm_requests, step, request);
		}
		effect = fixture_effect(step, "llm", request, llm_result(p));
	}
	else if (strcmp(type, "tool_call") == 0 && JsonGetField(p, "position"))
		*pending_requests = JsonSetKey(*pending_requests, key, JsonGetJsonb(p, "request"));
	else if (strcmp(type, "tool_result") == 0 && JsonGetField(p, "position"))
		effect = fixture_effect(step, "http", JsonGetJsonb(*pending_requests, key),
								JsonGetJsonb(p, "result"));
	else if (strcmp(type, "decision") == 0 && JsonGetString(p, "action") &&
			 (strcmp(JsonGetString(p, "action"), "submit") == 0 ||
			  strcmp(JsonGetString(p, "action"), "decline") == 0 ||
			  strcmp(JsonGetString(p, "action"), "cancel") == 0))
	{
		/* data for a Human step; an answer to an MCP server's question */
		JsonObjBuilder r;

		JsonObjStart(&r);
		JsonObjAddString(&r, "op", "human");
		if (JsonGetField(p, "data"))
			JsonObjAddJsonb(&r, "data", JsonGetJsonb(p, "data"));
		if (strcmp(JsonGetString(p, "action"), "submit") != 0)
			JsonObjAddString(&r, "action", JsonGetString(p, "action"));
		JsonObjAddJsonb(&r, "by", JsonGetJsonb(p, "by"));
		effect = fixture_effect(step, "human", NULL, JsonObjEnd(&r));
	}
	else if (strcmp(type, "decision") == 0 && JsonGetString(p, "action") &&
			 strcmp(JsonGetString(p, "action"), "steer") == 0)
	{
		JsonObjBuilder r;

		JsonObjStart(&r);
		JsonObjAddJsonb(&r, "message", JsonGetJsonb(p, "message"));
		JsonObjAddJsonb(&r, "by", JsonGetJsonb(p, "by"));
		effect = fixture_effect(step, "steer", NULL, JsonObjEnd(&r));
	}
	else if (strcmp(type, "run_aborted") == 0 && JsonGetField(p, "by"))
	{
		/* an operator's abort between steps, or of a run nobody held */
		JsonObjBuilder r;

		JsonObjStart(&r);
		JsonObjAddString(&r, "at", "between");
		JsonObjAddJsonb(&r, "reason", JsonGetJsonb(p, "reason"));
		JsonObjAddJsonb(&r, "by", JsonGetJsonb(p, "by"));
		effect = fixture_effect(JsonGetString(p, "step") ? JsonGetString(p, "step") : "", "abort", NULL,
								JsonObjEnd(&r));
	}
	else if (strcmp(type, "agent_completed") == 0 && JsonGetString(p, "signal") &&
			 strcmp(JsonGetString(p, "signal"), "aborted") == 0 && JsonGetString(p, "error") &&
			 strncmp(JsonGetString(p, "error"), "aborted by ", 11) == 0)
	{
		/* an operator's abort an agent took at the top of a turn */
		JsonObjBuilder r;

		JsonObjStart(&r);
		JsonObjAddString(&r, "at", "turn");
		JsonObjAddJsonb(&r, "error", JsonGetJsonb(p, "error"));
		effect = fixture_effect(step, "abort", NULL, JsonObjEnd(&r));
	}
	else if (strcmp(type, "children_ended") == 0)
	{
		JsonObjBuilder r;

		JsonObjStart(&r);
		JsonObjAddString(&r, "op", "children");
		JsonObjAddJsonb(&r, "output", JsonGetJsonb(p, "output"));
		JsonObjAddJsonb(&r, "error", JsonGetJsonb(p, "error"));
		effect = fixture_effect(step, "children", NULL, JsonObjEnd(&r));
	}
	else if (strcmp(type, "approval_decided") == 0)
	{
		JsonObjBuilder r;

		JsonObjStart(&r);
		JsonObjAddString(&r, "op", "approval");
		JsonObjAddJsonb(&r, "call", JsonGetJsonb(p, "call"));
		JsonObjAddJsonb(&r, "approved", JsonGetJsonb(p, "approved"));
		JsonObjAddJsonb(&r, "note", JsonGetJsonb(p, "note"));
		JsonObjAddJsonb(&r, "by", JsonGetJsonb(p, "by"));
		effect = fixture_effect(step, "approval", NULL, JsonObjEnd(&r));
	}
	return effect;
}

/*
 * Every result from outside the database in run id's journal, in order,
 * as the fixture's array of effects; *tokens gets the tokens it used.
 * pending_requests maps "step:position" to the requests of HTTP tool_calls.
 * A step's model calls after its first are journaled as deltas and
 * rebuilt here, in order.
 */
static Jsonb *
pin_effects(int64 id, Jsonb *pending_requests, int64 *tokens)
{
	bool		isnull;
	StringInfoData effects;
	Jsonb	   *llm_requests = JsonEmptyObject();	/* step -> its last
													 * request */
	int			n;

	n = (int) select_for_run("SELECT type, agent_id, payload, "
							 "  CASE WHEN type OPERATOR(pg_catalog.=) 'llm_turn' THEN COALESCE(tokens, 0) ELSE 0 END "
							 "FROM tuvl.events "
							 "WHERE run_id OPERATOR(pg_catalog.=) $1 "
							 "  AND type OPERATOR(pg_catalog.=) ANY ('{llm_turn,tool_call,tool_result,"
							 "decision,approval_decided,children_ended,run_aborted,agent_completed}'::pg_catalog.text[]) "
							 "ORDER BY seq",
							 id);
	initStringInfo(&effects);
	for (int i = 0; i < n; i++)
	{
		HeapTuple	et = SPI_tuptable->vals[i];
		TupleDesc	etd = SPI_tuptable->tupdesc;
		char	   *type = SPI_getvalue(et, etd, 1);
		char	   *step = SPI_getvalue(et, etd, 2);
		Jsonb	   *p = DatumGetJsonbPCopy(SPI_getbinval(et, etd, 3, &isnull));
		Jsonb	   *effect;
		char	   *key = psprintf("%s:%s", step ? step : "", JsonGetField(p, "position") ? JsonText(JsonGetJsonb(p, "position")) : "");

		*tokens += DatumGetInt32(SPI_getbinval(et, etd, 4, &isnull));
		effect = event_effect(type, step, p, key, &pending_requests, &llm_requests);
		if (effect)
			appendStringInfo(&effects, "%s%s", effects.len ? ", " : "", JsonText(effect));
	}
	return JsonFromCString(psprintf("[%s]", effects.data));
}

/*
 * What the replayed run's model calls cost at their recorded prices
 * (tuvl.runs.cost of the replay's run), as a JSON number.
 */
static JsonbValue *
replay_cost(int64 run_id)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1] = {Int64GetDatum(run_id)};
	JsonbValue *v = palloc0(sizeof(JsonbValue));
	bool		isnull;
	SecurityFrame frame;
	uint64		n;

	v->type = jbvNumeric;
	v->val.numeric = int64_to_numeric(0);
	SecurityAsOwner(&frame);
	n = SpiExec("SELECT cost::pg_catalog.numeric FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1", 1,
				types, values, NULL, SPI_OK_SELECT);
	SecurityRestore(&frame);
	if (n == 1)
	{
		Datum		d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);

		if (!isnull)
			v->val.numeric = DatumGetNumericCopy(d);
	}
	return v;
}

/*
 * pin_run(run_id): the run as a replay fixture.
 */
Datum
tuvl_pin_run(PG_FUNCTION_ARGS)
{
	int64		id = PG_GETARG_INT64(0);
	HeapTuple	tup;
	TupleDesc	td;
	char	   *workflow;
	int			version;
	char	   *status;
	JsonObjBuilder b;
	Jsonb	   *pending_requests = JsonEmptyObject();	/* "step:position" ->
														 * request */
	int64		tokens = 0;
	Jsonb	   *result;

	TokenRequireScope("runs:read");
	SPI_connect();
	read_pinnable_run(id, &tup, &td, &workflow, &version, &status);

	JsonObjStart(&b);
	add_run_fields(&b, id, tup, td, workflow, version, status);

	/* every result from outside the database, in order */
	JsonObjAddJsonb(&b, "effects", pin_effects(id, pending_requests, &tokens));
	JsonObjAddInt(&b, "tokens", tokens);
	result = JsonObjEnd(&b);

	/*
	 * the idempotency keys of the recorded run, for the replay to send the
	 * same
	 */
	{
		RunState	fake;

		memset(&fake, 0, sizeof(fake));
		fake.id = id;
		result = JsonSetKey(result, "key_base", JsonStringValue(EffectKeyBase(&fake)));
	}
	PG_RETURN_JSONB_P(SpiReturnJsonb(result));
}

/* ---------------------------------------------------------------- replay */

typedef struct Replay
{
	Jsonb	   *fixture;
	Jsonb	   *effects;		/* the recorded effects, those of live steps
								 * left out */
	int			next;			/* the next effect to serve */
	int64		recorded_run;
	List	   *live;			/* ids of the steps whose effects are made for
								 * real */
	int			live_effects;	/* how many were */
	int64		live_tokens;	/* what their model calls spent */
} Replay;

/* the replay in progress in this backend, or NULL */
static Replay *current_replay = NULL;

static bool
is_live(Replay *rp, const char *step)
{
	ListCell   *lc;

	foreach(lc, rp->live)
	{
		if (strcmp(lfirst(lc), step) == 0)
			return true;
	}
	return false;
}

/*
 * A live step's effect: made for real, as tuvl.run() makes it (the replay
 * lets it through for the time of the request).
 */
static void
perform_live(Replay *rp, RunState *run)
{
	Jsonb	   *result;
	char	   *op = run->send->tag ? JsonGetString(run->send->tag, "op") : NULL;

	TuvlReplayDepth--;
	PG_TRY();
	{
		result = EffectPerform(run->send);
	}
	PG_FINALLY();
	{
		TuvlReplayDepth++;
	}
	PG_END_TRY();
	rp->live_effects++;
	if (op && strcmp(op, "llm") == 0)
	{
		int			tokens = 0;

		(void) LlmTurnPayload(result, &tokens);
		rp->live_tokens += tokens;
	}
	RunKeepJsonb(run, &run->fresh_effect, result);
}

static void
pg_attribute_noreturn()
diverged(Replay *rp, const char *message, const char *detail)
{
	ereport(ERROR,
			(errcode(ERRCODE_DATA_EXCEPTION),
			 errmsg("replay of run " INT64_FORMAT " diverged: %s", rp->recorded_run, message),
			 detail ? errdetail("%s", detail) : 0,
			 errhint("The workflow, its SQL or its artifacts no longer do what the recording did; "
					 "pin a new fixture if the change is intended.")));
}

static const char *
current_step_id(RunState *run)
{
	return run->step >= 0 ? run->wf->steps[run->step].id : "(start)";
}

/* The next recorded effect, which must be of this step and type. */
static Jsonb *
take_effect_of(Replay *rp, const char *step, const char *type, const char *what)
{
	Jsonb	   *e;
	char	   *rstep;
	char	   *rtype;

	if (rp->next >= JsonArraySize(rp->effects))
		diverged(rp, psprintf("step \"%s\" asked for %s, which the recording does not hold", step, what),
				 psprintf("All %d recorded effects were used.", JsonArraySize(rp->effects)));
	e = JsonArrayAt(rp->effects, rp->next);
	rstep = JsonGetString(e, "step");
	rtype = JsonGetString(e, "type");
	if (rstep == NULL || rtype == NULL || strcmp(rstep, step) != 0 || strcmp(rtype, type) != 0)
		diverged(rp, psprintf("step \"%s\" asked for %s, but the recording's next effect (number %d) is a %s of step \"%s\"",
							  step, what, rp->next + 1, rtype ? rtype : "?", rstep ? rstep : "?"),
				 NULL);
	rp->next++;
	return e;
}

static Jsonb *
take_effect(Replay *rp, RunState *run, const char *type, const char *what)
{
	return take_effect_of(rp, current_step_id(run), type, what);
}

/*
 * Did the replay ask the model what the recording asked?  Tool results
 * inside the conversation are left out: SQL tools really run again, and
 * the rows they return may differ (a new serial id) without the workflow
 * having changed.  The prompts, the tools offered, the context and the
 * model's own calls must be the same.
 */
static bool
same_llm_request(Jsonb *recorded, Jsonb *replayed)
{
	static const Oid types[2] = {JSONBOID, JSONBOID};
	Datum		values[2];
	bool		isnull;
	SecurityFrame frame;
	bool		same;

	if (recorded == NULL || replayed == NULL)
		return recorded == replayed;
	values[0] = JsonbPGetDatum(recorded);
	values[1] = JsonbPGetDatum(replayed);
	SecurityAsOwner(&frame);
	SpiExec("SELECT tuvl._llm_request_shape($1) OPERATOR(pg_catalog.=) tuvl._llm_request_shape($2)",
			2, types, values, NULL, SPI_OK_SELECT);
	same = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	SecurityRestore(&frame);
	return same;
}

/* Serve the effect the run is waiting for from the recording. */
static void
serve_effect(RunState *run, void *arg)
{
	Replay	   *rp = arg;
	EffectRequest *req = run->send;
	char	   *op = req->tag ? JsonGetString(req->tag, "op") : NULL;
	bool		llm = op && strcmp(op, "llm") == 0;
	Jsonb	   *e;
	Jsonb	   *recorded;

	if (is_live(rp, current_step_id(run)))
	{
		perform_live(rp, run);
		return;
	}
	if (llm)
	{
		e = take_effect(rp, run, "llm", "a model call");
		recorded = JsonGetJsonb(e, "request");
		if (!same_llm_request(recorded, JsonGetJsonb(req->tag, "request")))
			diverged(rp, psprintf("step \"%s\" sent the model a different request than the recording (effect %d)",
								  current_step_id(run), rp->next),
					 psprintf("Recorded: %s\nReplayed: %s", JsonClipText(JsonText(recorded), 2000),
							  JsonClipText(JsonText(JsonGetJsonb(req->tag, "request")), 2000)));
	}
	else
	{
		char	   *method = JsonGetString(req->journal, "method");
		char	   *url = JsonGetString(req->journal, "url");
		char	   *rmethod;
		char	   *rurl;

		e = take_effect(rp, run, "http", psprintf("%s %s", method ? method : "", url ? url : ""));
		recorded = JsonGetJsonb(e, "request");
		rmethod = recorded ? JsonGetString(recorded, "method") : NULL;
		rurl = recorded ? JsonGetString(recorded, "url") : NULL;
		if (rmethod == NULL || rurl == NULL || method == NULL || url == NULL ||
			strcmp(rmethod, method) != 0 || strcmp(rurl, url) != 0)
			diverged(rp, psprintf("step \"%s\" sent %s %s, but the recording sent %s %s (effect %d)",
								  current_step_id(run), method ? method : "?", url ? url : "?",
								  rmethod ? rmethod : "?", rurl ? rurl : "?", rp->next),
					 NULL);
		/* the same MCP tool with the same arguments; the same request body */
		{
			static const char *const keys[] = {"tool", "arguments", "body_md5", NULL};

			for (int i = 0; keys[i]; i++)
			{
				Jsonb	   *mine = JsonGetField(req->journal, keys[i]) ? JsonGetJsonb(req->journal, keys[i]) : NULL;
				Jsonb	   *theirs = JsonGetField(recorded, keys[i]) ? JsonGetJsonb(recorded, keys[i]) : NULL;

				if (mine && theirs && !jequal(mine, theirs))
					diverged(rp, psprintf("step \"%s\" sent %s %s with another %s than the recording (effect %d)",
										  current_step_id(run), method, url,
										  strcmp(keys[i], "body_md5") == 0 ? "body" : keys[i], rp->next),
							 psprintf("Recorded: %s\nReplayed: %s", JsonText(theirs), JsonText(mine)));
			}
		}
	}
	RunKeepJsonb(run, &run->fresh_effect, JsonGetJsonb(e, "result"));
}

/*
 * What the children of the current Workflow step came to, from the
 * recording: {output} or {error}.  A replay starts no runs.
 */
Jsonb *
ReplayTakeChildren(RunState *run, const char *step)
{
	if (current_replay == NULL)
		elog(ERROR, "no replay in progress");
	return JsonGetJsonb(take_effect_of(current_replay, step, "children", "the outcome of its child runs"),
						"result");
}

/* The next recorded effect if it is an operator's action of type at (NULL: any). */
static Jsonb *
next_action(Replay *rp, const char *type, const char *at)
{
	Jsonb	   *e;
	char	   *etype;

	if (rp == NULL || rp->next >= JsonArraySize(rp->effects))
		return NULL;
	e = JsonArrayAt(rp->effects, rp->next);
	etype = JsonGetString(e, "type");
	if (etype == NULL || strcmp(etype, type) != 0)
		return NULL;
	if (at && (JsonGetString(JsonGetJsonb(e, "result"), "at") == NULL ||
			   strcmp(JsonGetString(JsonGetJsonb(e, "result"), "at"), at) != 0))
		return NULL;
	return JsonGetJsonb(e, "result");
}

/* The abort directive {reason, by} of error "aborted by <by>[: <reason>]". */
static Jsonb *
abort_from_error(const char *error)
{
	const char *by = error + strlen("aborted by ");
	const char *colon = strstr(by, ": ");
	JsonObjBuilder b;

	JsonObjStart(&b);
	JsonObjAddString(&b, "by", colon ? pnstrdup(by, colon - by) : by);
	JsonObjAddString(&b, "reason", colon ? colon + 2 : NULL);
	return JsonObjEnd(&b);
}

/*
 * An agent of step at the top of a turn, in a replay: the operator's steer
 * messages and abort the recording applied here, merged into control as
 * tuvl.steer_run() and tuvl.abort_run() wrote them.
 */
Jsonb *
ReplayControl(RunState *run, const char *step, Jsonb *control)
{
	Replay	   *rp = current_replay;
	Jsonb	   *r;

	while ((r = next_action(rp, "steer", NULL)) != NULL ||
		   (r = next_action(rp, "abort", "turn")) != NULL)
	{
		bool		steer = JsonGetField(r, "message") != NULL;
		Jsonb	   *queue;

		(void) take_effect_of(rp, step, steer ? "steer" : "abort", "an operator's action");
		if (control == NULL)
			control = JsonEmptyObject();
		if (!steer)
			return JsonSetKey(control, "abort", abort_from_error(JsonGetString(r, "error")));
		queue = JsonGetField(control, "steer") ? JsonGetJsonb(control, "steer") : JsonEmptyObject();
		control = JsonSetKey(control, "steer",
							 JsonSetKey(queue, psprintf("%020d", rp->next), JsonRemoveKey(r, "at")));
	}
	return control;
}

/*
 * Before a transition: an operator's abort that the recording applied
 * between steps here becomes the run's abort directive.
 */
static bool
serve_between(RunState *run, void *arg)
{
	Replay	   *rp = arg;
	Jsonb	   *r = next_action(rp, "abort", "between");

	if (r)
	{
		Jsonb	   *control = run->control ? run->control : JsonEmptyObject();

		rp->next++;
		RunKeepJsonb(run, &run->control, JsonSetKey(control, "abort", JsonRemoveKey(r, "at")));
	}
	return true;
}

/*
 * The run waits for a person: answer from the recording, as tuvl.submit()
 * or tuvl.decide() did, and take the run again.
 */
static bool
serve_person(RunState *run, void *arg)
{
	Replay	   *rp = arg;
	bool		human = run->status == RUN_WAITING_HUMAN;
	Jsonb	   *e;
	Jsonb	   *record;
	PersonAnswer answer;

	if (run->status == RUN_PAUSED)
		return false;
	/* the recording was aborted while it waited */
	if (next_action(rp, "abort", "between"))
	{
		Jsonb	   *r = next_action(rp, "abort", "between");

		rp->next++;
		ControlAbortRun(run->id, JsonGetString(r, "reason"), JsonGetString(r, "by"));
		run->status = RUN_ABORTED;
		return false;
	}
	e = take_effect(rp, run, human ? "human" : "approval",
					human ? "data for a Human step" : "a decision on a tool call");
	record = JsonGetJsonb(e, "result");
	memset(&answer, 0, sizeof(answer));
	answer.human = human;
	answer.data = JsonGetField(record, "data") ? JsonGetJsonb(record, "data") : NULL;
	answer.action = JsonGetString(record, "action");
	answer.approved = JsonGetBool(record, "approved", false);
	answer.note = JsonGetString(record, "note");
	answer.by = JsonGetString(record, "by");
	answer.replayed = true;
	ControlAnswer(run->id, &answer);
	DriveHoldHere(run);
	return true;
}

static void
replay_reset(int code, Datum arg)
{
	TuvlReplayDepth--;
	current_replay = NULL;
}

/* The fixture's parts, or a clear error when it is not a fixture. */
static void
parse_fixture(Jsonb *fixture, Replay *rp, char **workflow, Jsonb **input)
{
	memset(rp, 0, sizeof(Replay));
	rp->fixture = fixture;
	*workflow = JsonIsObject(fixture) ? JsonGetString(fixture, "workflow") : NULL;
	*input = JsonIsObject(fixture) ? JsonGetJsonb(fixture, "input") : NULL;
	rp->effects = JsonIsObject(fixture) ? JsonGetJsonb(fixture, "effects") : NULL;
	if (*workflow == NULL || *input == NULL || !JsonIsObject(*input) || rp->effects == NULL ||
		!JB_ROOT_IS_ARRAY(rp->effects) || JB_ROOT_IS_SCALAR(rp->effects) ||
		JsonGetField(fixture, "tuvl_fixture") == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("not a tuvl replay fixture"),
				 errdetail("A fixture is the object tuvl.pin_run() returns, with tuvl_fixture, workflow, input and effects."),
				 errhint("Pin a run with SELECT tuvl.pin_run(run_id).")));
	rp->recorded_run = JsonGetInt(fixture, "run_id", 0);
}

/* The replay's run, held by this backend, with the recording's artifacts and keys. */
static RunState *
replay_run(Jsonb *fixture, const char *workflow, Jsonb *input, int *version)
{
	RunStart	start;
	int64		id;
	Jsonb	   *artifacts = JsonGetField(fixture, "artifacts") ? JsonGetJsonb(fixture, "artifacts") : NULL;
	RunState   *run;

	memset(&start, 0, sizeof(start));
	start.workflow = workflow;
	start.input = input;
	id = RunCreate(&start, true, version);

	if (artifacts && JsonIsObject(artifacts))
	{
		static const Oid types[2] = {INT8OID, JSONBOID};

		SecurityExecArgs("UPDATE tuvl.runs SET artifacts = $2 WHERE id OPERATOR(pg_catalog.=) $1",
						 SPI_OK_UPDATE, 2, types, Int64GetDatum(id), JsonbPGetDatum(artifacts));
	}
	run = RunStateCreate(CurrentMemoryContext, id, 1, workflow, *version, GetUserId(),
						 GetUserNameFromId(GetUserId(), false), input, NULL, 1, NULL);
	run->replay = true;
	if (JsonGetString(fixture, "key_base"))
		run->key_base = MemoryContextStrdup(run->cxt, JsonGetString(fixture, "key_base"));
	return run;
}

/* Did the replay end as the recording did, using every recorded effect? */
static void
check_ending(Replay *rp, RunStatus status, RunEnd *end)
{
	char	   *rstatus = JsonGetString(rp->fixture, "status");
	char	   *rend = JsonGetString(rp->fixture, "end");
	Jsonb	   *rresponse = JsonGetJsonb(rp->fixture, "response");

	if (rresponse && JB_ROOT_IS_SCALAR(rresponse) &&
		getIthJsonbValueFromContainer(&rresponse->root, 0)->type == jbvNull)
		rresponse = NULL;
	if (rstatus && strcmp(rstatus, StatusName(status)) != 0)
		diverged(rp, psprintf("the recorded run ended %s, the replay %s", rstatus, StatusName(status)),
				 end->error ? psprintf("The replay's error: %s", end->error) : NULL);
	if ((rend == NULL) != (end->end_name == NULL) || (rend && strcmp(rend, end->end_name) != 0))
		diverged(rp, psprintf("the recorded run ended at %s, the replay at %s",
							  rend ? psprintf("end \"%s\"", rend) : "no end",
							  end->end_name ? psprintf("end \"%s\"", end->end_name) : "no end"),
				 NULL);
	if (!jequal(rresponse, end->response))
		diverged(rp, "the replay's response differs from the recording's",
				 psprintf("Recorded: %s\nReplayed: %s", JsonClipText(JsonText(rresponse), 2000),
						  JsonClipText(JsonText(end->response), 2000)));
	if (rp->next < JsonArraySize(rp->effects))
	{
		Jsonb	   *e = JsonArrayAt(rp->effects, rp->next);

		diverged(rp, psprintf("the replay used %d of the %d recorded effects; the next one is a %s of step \"%s\"",
							  rp->next, JsonArraySize(rp->effects), JsonGetString(e, "type"),
							  JsonGetString(e, "step")),
				 NULL);
	}
}

/* The replay's own run is scaffolding: leave no trace of it. */
static void
remove_run(int64 id)
{
	static const Oid types[1] = {INT8OID};
	Datum		values[1];
	SecurityFrame frame;

	values[0] = Int64GetDatum(id);
	SecurityAsOwner(&frame);
	SpiExec("DELETE FROM tuvl.journal WHERE run_id OPERATOR(pg_catalog.=) $1", 1, types, values,
			NULL, SPI_OK_DELETE);
	SpiExec("DELETE FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1", 1, types, values,
			NULL, SPI_OK_DELETE);
	SecurityRestore(&frame);
}

/*
 * The step ids of replay()'s live argument, and the recorded effects
 * without those of these steps (their models and requests are asked
 * again; what people answered is still served).
 */
static void
take_live(Replay *rp, ArrayType *arr)
{
	Datum	   *items;
	bool	   *nulls;
	int			n;
	StringInfoData kept;

	deconstruct_array(arr, TEXTOID, -1, false, TYPALIGN_INT, &items, &nulls, &n);
	for (int i = 0; i < n; i++)
		if (!nulls[i])
			rp->live = lappend(rp->live, TextDatumGetCString(items[i]));
	if (rp->live == NIL)
		return;
	initStringInfo(&kept);
	appendStringInfoChar(&kept, '[');
	for (int i = 0; i < JsonArraySize(rp->effects); i++)
	{
		Jsonb	   *e = JsonArrayAt(rp->effects, i);
		char	   *step = JsonGetString(e, "step");
		char	   *type = JsonGetString(e, "type");

		if (step && type && is_live(rp, step) && (strcmp(type, "llm") == 0 || strcmp(type, "http") == 0))
			continue;
		if (kept.len > 1)
			appendStringInfoString(&kept, ", ");
		appendStringInfoString(&kept, JsonText(e));
	}
	appendStringInfoChar(&kept, ']');
	rp->effects = JsonFromCString(kept.data);
}

/* Every live step must be a step of the workflow replayed. */
static void
check_live(Replay *rp, const char *workflow, int version)
{
	WorkflowDef *wf = rp->live ? WorkflowLoad(workflow, version) : NULL;
	ListCell   *lc;

	foreach(lc, rp->live)
	{
		int			idx = WorkflowFindStep(wf, lfirst(lc));

		if (idx < 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("live names step \"%s\", which workflow \"%s\" does not have",
							(char *) lfirst(lc), workflow),
					 errhint("Name steps of the workflow's current version, such as its Agent steps.")));
		if (wf->steps[idx].kind == STEP_WORKFLOW)
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("live names step \"%s\", a Workflow step, which cannot run live in a replay",
							(char *) lfirst(lc)),
					 errdetail("Its child runs would run in other transactions, outside the replay."),
					 errhint("Pin a child run and replay it with its own live steps.")));
	}
}

/*
 * replay(fixture, live): see the file header.  The steps named in live
 * make their effects for real (the change engine's check: the changed
 * agent live, the rest from the recording).
 */
Datum
tuvl_replay(PG_FUNCTION_ARGS)
{
	Jsonb	   *fixture;
	Replay		rp;
	char	   *workflow;
	Jsonb	   *input;
	int			version;
	RunState   *run;
	RunStatus	status;
	RunEnd		end;
	JsonObjBuilder b;
	int			transitions = 0;
	RunPerformer performer = {serve_effect, serve_person, serve_between, &rp};
	JsonbValue *cost;

	TokenRequireScope("runs:start");
	if (PG_ARGISNULL(0))
		PG_RETURN_NULL();
	fixture = PG_GETARG_JSONB_P(0);
	parse_fixture(fixture, &rp, &workflow, &input);
	if (PG_NARGS() > 1 && !PG_ARGISNULL(1))
		take_live(&rp, PG_GETARG_ARRAYTYPE_P(1));
	TuvlRefuseWhileReplaying("tuvl.replay()");
	SPI_connect();
	TuvlReplayDepth++;
	PG_ENSURE_ERROR_CLEANUP(replay_reset, (Datum) 0);
	{
		run = replay_run(fixture, workflow, input, &version);
		check_live(&rp, workflow, version);
		current_replay = &rp;
		status = DriveRun(run, &performer, &transitions);
	}
	PG_END_ENSURE_ERROR_CLEANUP(replay_reset, (Datum) 0);
	TuvlReplayDepth--;
	current_replay = NULL;

	DriveReadEnd(run->id, true, &end);
	cost = replay_cost(run->id);
	end.response = end.response ? redact_private(end.response) : NULL;
	check_ending(&rp, status, &end);
	remove_run(run->id);

	JsonObjStart(&b);
	JsonObjAddString(&b, "status", StatusName(status));
	JsonObjAddString(&b, "end", end.end_name);
	JsonObjAddJsonb(&b, "response", end.response);
	JsonObjAddInt(&b, "effects_served", rp.next);
	JsonObjAddInt(&b, "effects_live", rp.live_effects);
	JsonObjAddInt(&b, "transitions", transitions);
	JsonObjAddInt(&b, "tokens_spent", rp.live_tokens);
	JsonObjAddJsonb(&b, "tokens_recorded", JsonGetJsonb(fixture, "tokens"));
	JsonObjAddValue(&b, "cost_recorded", cost);
	JsonObjAddInt(&b, "workflow_version", version);
	RunStateFree(run);
	PG_RETURN_JSONB_P(SpiReturnJsonb(JsonObjEnd(&b)));
}
