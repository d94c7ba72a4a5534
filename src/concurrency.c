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
 * holds no place until it wakes.  Admission takes a transaction-scoped
 * advisory lock on the workflow and key, so two starts, or a start and
 * an end, never both see the same free place.
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

/* The lock that orders admissions of one key: workflow, role and key hashed. */
static void
lock_key(const char *workflow, const char *key, Oid principal)
{
	static const Oid types[2] = {TEXTOID, TEXTOID};
	Datum		values[2];

	values[0] = CStringGetTextDatum(psprintf("%s/%u", workflow, principal));
	values[1] = CStringGetTextDatum(key);
	SpiExec("SELECT pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext($1), pg_catalog.hashtext($2))",
			2, types, values, NULL, SPI_OK_SELECT);
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
	SecurityAsOwner(&frame);
	lock_key(workflow, conc->key, principal);
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
	SecurityAsOwner(&frame);
	lock_key(workflow, key, principal);
	n = SpiExecIndexed("UPDATE tuvl.runs r SET held_by = NULL "
				"WHERE r.id OPERATOR(pg_catalog.=) ANY (ARRAY( "
				"    SELECT h.id FROM tuvl.runs h "
				"    WHERE h.workflow OPERATOR(pg_catalog.=) $1 AND h.concurrency_key OPERATOR(pg_catalog.=) $2 "
				"      AND h.principal_id::pg_catalog.oid OPERATOR(pg_catalog.=) $4 "
				"      AND h.finished_at IS NULL AND h.held_by OPERATOR(pg_catalog.=) 'concurrency' "
				"      AND h.status OPERATOR(pg_catalog.=) 'queued' "
				"    ORDER BY OPERATOR(pg_catalog.-) h.priority::pg_catalog.int8, h.id "
				"    LIMIT GREATEST($3 OPERATOR(pg_catalog.-) " IN_FLIGHT_SQL ", 0))) "
				"RETURNING r.id, r.principal_id, r.priority",
				4, types, values, NULL, SPI_OK_UPDATE_RETURNING);
	for (uint64 i = 0; i < n; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	td = SPI_tuptable->tupdesc;
		bool		isnull;

		QueueNoteAtCommit(DatumGetObjectId(SPI_getbinval(tup, td, 2, &isnull)),
						  DatumGetInt32(SPI_getbinval(tup, td, 3, &isnull)),
						  DatumGetInt64(SPI_getbinval(tup, td, 1, &isnull)));
	}
	SecurityRestore(&frame);
	if (n > 0)
		TuvlWakeWorkersAtCommit();
	return (int) n;
}
