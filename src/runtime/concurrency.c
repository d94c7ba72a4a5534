/*-------------------------------------------------------------------------
 *
 * concurrency.c
 *	  Runs in flight per concurrency key.
 *
 * A workflow with concurrency: {key, limit} renders its key from the
 * input of each run it starts; the limit holds per role (principal), so
 * that no role can hold back another's runs by filling a key.  Such a run is inserted queued but held
 * (held_by = 'concurrency'), out of the claims' index; ConcurrencyAdmit
 * then lets go of the held runs of the key, highest priority and oldest
 * first, while fewer than limit runs of it are in flight.  In flight
 * means admitted and not ended: running, parked, sleeping in a step,
 * waiting for children, compensating.  A run started with not_before
 * holds no place until it wakes.  Admission takes tuvl's own lock on the
 * workflow, role and key (SecurityLockKey: no session can take it any
 * other way), so two starts, or a start and an end, never both see the
 * same free place.  A role's session waits for it; a worker never does,
 * since a session of the role that started the run may hold it for as
 * long as its transaction lasts (a start_run() not committed yet): the
 * worker remembers the key and leaves the admission to its maintenance
 * (ConcurrencyAdmitDeferred), which tries again every second until the
 * lock is free: the session that held it has ended its transaction then,
 * and the run it may have added is visible.
 *
 * A keyed run's end admits the next of its key: tuvl._run_ended()
 * (step_workflow.c), in the transaction that ended it.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/builtins.h"
#include "utils/memutils.h"

#include "concurrency.h"
#include "jsonutil.h"
#include "queue.h"
#include "security.h"
#include "spiutil.h"
#include "template.h"
#include "tuvl.h"

/* The rendered concurrency key of a run of wf with input, if wf has one. */
void
ConcurrencyKeyOf(WorkflowDef *wf, Jsonb *input, ConcurrencyKey *conc)
{
	Jsonb	   *c = JsonGetJsonb(wf->definition, "concurrency");
	char	   *tmpl = c && JsonIsObject(c) ? JsonGetString(c, "key") : NULL;

	conc->key = NULL;
	conc->limit = 0;
	if (tmpl == NULL)
		return;
	conc->key = TemplateRenderText(tmpl, input, NULL);
	conc->limit = JsonGetInt32(c, "limit", 1);
}

/*
 * The lock that orders admissions of one key of one role.  A worker does
 * not wait for it: false when another transaction holds it (the caller
 * defers the admission).
 */
static bool
lock_key(const char *workflow, const char *key, Oid principal)
{
	char	   *k = psprintf("%s/%u/%s", workflow, principal, key);

	if (MyTuvlSlot == NULL)
	{
		SecurityLockKey("concurrency", k);
		return true;
	}
	return SecurityTryLockKey("concurrency", k);
}

/* Keys whose admission a worker deferred, in TopMemoryContext. */
typedef struct DeferredKey
{
	char	   *workflow;
	char	   *key;
	int			limit;
	Oid			principal;
} DeferredKey;

static List *deferred = NIL;

static void
defer_admission(const char *workflow, const char *key, int limit, Oid principal)
{
	MemoryContext old;
	DeferredKey *d;
	ListCell   *lc;

	foreach(lc, deferred)
	{
		d = lfirst(lc);
		if (d->principal == principal && strcmp(d->workflow, workflow) == 0 && strcmp(d->key, key) == 0)
			return;
	}
	old = MemoryContextSwitchTo(TopMemoryContext);
	d = palloc(sizeof(DeferredKey));
	d->workflow = pstrdup(workflow);
	d->key = pstrdup(key);
	d->limit = limit;
	d->principal = principal;
	deferred = lappend(deferred, d);
	MemoryContextSwitchTo(old);
}

/* Runs of the key in flight: admitted, not ended, not waiting for not_before. */
#define IN_FLIGHT_SQL \
	"(SELECT pg_catalog.count(*) FROM tuvl.runs f " \
	"  WHERE f.workflow OPERATOR(pg_catalog.=) $1 AND f.concurrency_key OPERATOR(pg_catalog.=) $2 " \
	"    AND f.principal_id::pg_catalog.oid OPERATOR(pg_catalog.=) $4 " \
	"    AND f.finished_at IS NULL AND f.held_by IS NULL " \
	"    AND NOT (f.status OPERATOR(pg_catalog.=) 'sleeping' AND f.current_step IS NULL))"

/*
 * Is there room for one more run of the key now?  (tuvl.run() asks: it
 * cannot wait in the queue.)  Takes the key's lock.  SPI connected.
 */
bool
ConcurrencyHasRoom(const char *workflow, const ConcurrencyKey *conc, Oid principal)
{
	static const Oid types[4] = {TEXTOID, TEXTOID, INT4OID, OIDOID};
	Datum		values[4];
	SecurityFrame frame;
	bool		room;

	values[0] = CStringGetTextDatum(workflow);
	values[1] = CStringGetTextDatum(conc->key);
	values[2] = Int32GetDatum(conc->limit);
	values[3] = ObjectIdGetDatum(principal);
	(void) lock_key(workflow, conc->key, principal);
	SecurityAsOwner(&frame);
	SpiExec("SELECT " IN_FLIGHT_SQL " OPERATOR(pg_catalog.<) $3", 4, types, values, NULL, SPI_OK_SELECT);
	room = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &room));
	SecurityRestore(&frame);
	return room;
}

/*
 * Let go of the held runs of workflow's key while fewer than limit are in
 * flight; each is queued for the workers at commit.  Returns how many.
 * SPI connected.
 */
int
ConcurrencyAdmit(const char *workflow, const char *key, int limit, Oid principal)
{
	static const Oid types[4] = {TEXTOID, TEXTOID, INT4OID, OIDOID};
	Datum		values[4];
	SecurityFrame frame;
	uint64		n;

	values[0] = CStringGetTextDatum(workflow);
	values[1] = CStringGetTextDatum(key);
	values[2] = Int32GetDatum(limit);
	values[3] = ObjectIdGetDatum(principal);
	if (!lock_key(workflow, key, principal))
	{
		defer_admission(workflow, key, limit, principal);
		return 0;
	}
	SecurityAsOwner(&frame);
	n = SpiExecIndexed("UPDATE tuvl.runs r SET held_by = NULL "
					   "WHERE r.id OPERATOR(pg_catalog.=) ANY (ARRAY( "
					   "    SELECT h.id FROM tuvl.runs h "
					   "    WHERE h.workflow OPERATOR(pg_catalog.=) $1 AND h.concurrency_key OPERATOR(pg_catalog.=) $2 "
					   "      AND h.principal_id::pg_catalog.oid OPERATOR(pg_catalog.=) $4 "
					   "      AND h.finished_at IS NULL AND h.held_by OPERATOR(pg_catalog.=) 'concurrency' "
					   "      AND h.status OPERATOR(pg_catalog.=) 'queued' "
					   "    ORDER BY OPERATOR(pg_catalog.-) h.priority::pg_catalog.int8, h.id "
					   "    LIMIT GREATEST($3 OPERATOR(pg_catalog.-) " IN_FLIGHT_SQL ", 0))) "
					   "RETURNING r.principal_id, r.priority, r.id",
					   4, types, values, NULL, SPI_OK_UPDATE_RETURNING);
	QueueNoteReturnedAtCommit();
	SecurityRestore(&frame);
	if (n > 0)
		TuvlWakeWorkersAtCommit();
	return (int) n;
}

/*
 * The admissions this worker deferred, tried again: each key whose lock
 * is free now is admitted and forgotten, the others wait for the next
 * try.  Called by the worker's maintenance, SPI connected.
 */
void
ConcurrencyAdmitDeferred(void)
{
	List	   *todo = deferred;
	ListCell   *lc;

	if (todo == NIL)
		return;
	deferred = NIL;
	foreach(lc, todo)
	{
		DeferredKey *d = lfirst(lc);

		/* deferred again (by ConcurrencyAdmit) while the lock is still held */
		(void) ConcurrencyAdmit(d->workflow, d->key, d->limit, d->principal);
		pfree(d->workflow);
		pfree(d->key);
		pfree(d);
	}
	list_free(todo);
}
