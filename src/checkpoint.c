/*-------------------------------------------------------------------------
 *
 * checkpoint.c
 *	  The one write at the end of every transition.
 *
 * A transition ends by writing the run's row (its status, context,
 * current step, step_state and operator directives) together with the
 * journal events that explain the change, in the transition's
 * subtransaction.  The row's UPDATE is fenced by the lease (id and
 * attempt) and comes first: a holder that lost its lease touches no row
 * and raises, which rolls the whole transition back.  Whatever fails
 * after it (a journal row, a NOTIFY) rolls the UPDATE back with it, so a
 * checkpoint never commits without its events.
 *
 * The new state is staged in the run's next_* fields, in its own memory:
 * RunApplyTransition makes it current once the transaction committed.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/memutils.h"

#include "journal.h"
#include "jsonutil.h"
#include "security.h"
#include "spiutil.h"
#include "transition.h"
#include "tuvl.h"

static const char fence_sql[] =
"UPDATE tuvl.runs SET status = $3, context = $4, current_step = $5, last_seq = $6, "
"  end_name = $7, response = $8, error = $9, step_state = $10, "
"  finished_at = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY (" RUN_TERMINAL_STATUSES_SQL ") "
"                     THEN pg_catalog.clock_timestamp() END, "
"  lease_expires_at = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY (" RUN_HELD_STATUSES_SQL ") "
"                          THEN lease_expires_at END, "
"  lease_owner = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY (" RUN_HELD_STATUSES_SQL ") "
"                     THEN lease_owner END, "
"  lease_epoch = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY (" RUN_HELD_STATUSES_SQL ") "
"                     THEN lease_epoch END, "
"  compensation = CASE WHEN $14 THEN $15 ELSE compensation END, "
"  wake_at = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY ('{sleeping,waiting_human,waiting_approval}'::pg_catalog.text[]) "
"                 THEN pg_catalog.to_timestamp(($10 OPERATOR(pg_catalog.->) 'awaiting' "
"                      OPERATOR(pg_catalog.->>) 'wake_epoch')::pg_catalog.float8) END, "
"  control = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY (" RUN_TERMINAL_STATUSES_SQL ") "
"                 THEN NULL "
"                 WHEN $11::pg_catalog.text[] IS NULL AND $12::pg_catalog.jsonb IS NULL "
"                      AND $13::pg_catalog.text[] IS NULL "
"                 THEN control ELSE tuvl._control_apply(control, $11, $12, $13) END "
"WHERE id OPERATOR(pg_catalog.=) $1 AND attempt OPERATOR(pg_catalog.=) $2 "
"  AND status OPERATOR(pg_catalog.=) ANY ($16::pg_catalog.text[]) "
"RETURNING control";

#define FENCE_NARGS 16

/* strings as a text[] Datum */
static Datum
text_array(List *strings)
{
	Datum	   *items = palloc(sizeof(Datum) * Max(list_length(strings), 1));
	int			i = 0;
	ListCell   *lc;

	foreach(lc, strings)
		items[i++] = CStringGetTextDatum(lfirst(lc));
	return PointerGetDatum(construct_array(items, i, TEXTOID, -1, false, TYPALIGN_INT));
}

/* Set parameter i to d, or to NULL when isnull. */
static inline void
set_param(Datum *values, char *nulls, int i, Datum d, bool isnull)
{
	values[i] = isnull ? (Datum) 0 : d;
	nulls[i] = isnull ? 'n' : ' ';
}

/*
 * The statuses a holder writes from, as a parameter: a constant would let
 * a generic plan pick the partial index on them (runs_leased_idx) and
 * filter every held run for this id.
 */
static Datum
held_statuses(void)
{
	static List *held = NIL;

	if (held == NIL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		held = list_make2(pstrdup(RunStatusName(RUN_RUNNING)),
						  pstrdup(RunStatusName(RUN_COMPENSATING)));
		MemoryContextSwitchTo(old);
	}
	return text_array(held);
}

/* The fenced UPDATE; raises when the lease was lost.  Returns the control. */
static Jsonb *
fenced_update(RunState *run, const Checkpoint *cp, int last_seq)
{
	static const Oid types[FENCE_NARGS] = {INT8OID, INT4OID, TEXTOID, JSONBOID, TEXTOID,
		INT4OID, TEXTOID, JSONBOID, TEXTOID, JSONBOID, TEXTARRAYOID, JSONBOID, TEXTARRAYOID,
	BOOLOID, JSONBOID, TEXTARRAYOID};
	Datum		values[FENCE_NARGS];
	char		nulls[FENCE_NARGS];
	bool		isnull;
	Datum		d;

	set_param(values, nulls, 0, Int64GetDatum(run->id), false);
	set_param(values, nulls, 1, Int32GetDatum(run->attempt), false);
	set_param(values, nulls, 2, CStringGetTextDatum(RunStatusName(cp->status)), false);
	set_param(values, nulls, 3, JsonbPGetDatum(cp->context), false);
	set_param(values, nulls, 4, cp->step ? CStringGetTextDatum(cp->step) : 0, cp->step == NULL);
	set_param(values, nulls, 5, Int32GetDatum(last_seq), false);
	set_param(values, nulls, 6, cp->end_name ? CStringGetTextDatum(cp->end_name) : 0,
			  cp->end_name == NULL);
	set_param(values, nulls, 7, JsonbPGetDatum(cp->response), cp->response == NULL);
	set_param(values, nulls, 8, cp->error ? CStringGetTextDatum(cp->error) : 0, cp->error == NULL);
	set_param(values, nulls, 9, JsonbPGetDatum(cp->step_state), cp->step_state == NULL);
	set_param(values, nulls, 10, cp->consume ? text_array(cp->consume) : 0, cp->consume == NIL);
	set_param(values, nulls, 11, JsonbPGetDatum(cp->control_add), cp->control_add == NULL);
	set_param(values, nulls, 12, cp->steer_done ? text_array(cp->steer_done) : 0,
			  cp->steer_done == NIL);
	/* a transition that changed the compensation record writes it too */
	set_param(values, nulls, 13, BoolGetDatum(run->compensation_changed), false);
	set_param(values, nulls, 14, JsonbPGetDatum(run->next_compensation),
			  !run->compensation_changed || run->next_compensation == NULL);
	set_param(values, nulls, 15, held_statuses(), false);

	if (SpiExec(fence_sql, FENCE_NARGS, types, values, nulls, SPI_OK_UPDATE_RETURNING) != 1)
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("lease on run " INT64_FORMAT " was lost", run->id),
				 errdetail("Attempt %d no longer holds the run; another claimer took it over.",
						   run->attempt)));
	d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	return isnull ? NULL : DatumGetJsonbP(d);
}

/*
 * Write checkpoint cp of run: the fenced UPDATE, then the journal, as the
 * extension's owner; stage the new state for RunApplyTransition.  Raises
 * when the lease was lost or anything fails, leaving the caller's
 * subtransaction to roll both back.
 */
void
CheckpointWrite(RunState *run, const Checkpoint *cp)
{
	SecurityFrame frame;
	Jsonb	   *control;
	int			next_seq = run->last_seq + JournalCount(cp->events);

	Assert(cp->status != RUN_NONE);
	SecurityAsOwner(&frame);
	/* a child that ends locks its parent first (see lock_run in control.c) */
	if (run->parent_id != 0 && RunStatusIsTerminal(cp->status))
	{
		static const Oid types[1] = {INT8OID};
		Datum		values[1];

		values[0] = Int64GetDatum(run->parent_id);
		SpiExec("SELECT 1 FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1 FOR UPDATE",
				1, types, values, NULL, SPI_OK_SELECT);
	}
	run->next_control_gen = TuvlControlGen();
	control = fenced_update(run, cp, next_seq);
	(void) JournalWrite(run->id, run->last_seq, cp->events);
	SecurityRestore(&frame);
	/* tuvl.wait() and tuvl.run()'s callers hear of every run that settles */
	if (!RunStatusIsHeld(cp->status))
		TuvlRunChangedAtCommit();

	/* SPI's memory is gone at commit: what stays is copied into the run's */
	run->next_seq = next_seq;
	run->next_status = cp->status;
	run->next_control = JsonCopyTo(control, run->cxt);
	run->next_context = JsonCopyTo(cp->context, run->cxt);
	run->next_step_state = JsonCopyTo(cp->step_state, run->cxt);
	run->next_step = cp->step ? WorkflowFindStep(run->wf, cp->step) : -1;
	if (run->next_error)
		pfree(run->next_error);
	run->next_error = cp->error ? MemoryContextStrdup(run->cxt, cp->error) : NULL;
}
