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

#include "breakpoints.h"
#include "journal.h"
#include "jsonutil.h"
#include "security.h"
#include "spiutil.h"
#include "transition.h"
#include "tuvl.h"

/*
 * The fenced UPDATE, in four forms chosen by the transition (they take
 * the same parameters; a form leaves out those it does not use):
 *
 * - The status is assigned only when it changes, or the run is no longer
 *   held: a step of a chain or an agent's turn leaves a held run's status
 *   as it was, so the runs_ended trigger (AFTER UPDATE OF status, whose
 *   WHEN clause would be read again for each statement) is not even
 *   considered, and the lease is left as it is, without the CASEs.  That
 *   form is fenced on exactly the status the run has.
 * - control is assigned only when the transition changes the directives
 *   ($11 to $13): the runs_control trigger then tells every worker that
 *   its copies may be stale (TuvlControlGen), so a turn that changes
 *   nothing must not.  A run that ends clears them: in this statement
 *   when it changes them anyway, after it when the row had some.
 */
#define FENCE_COMMON_SQL \
"context = $4, current_step = $5, last_seq = $6, end_name = $7, response = $8, error = $9, " \
"  step_state = $10, compensation = CASE WHEN $14 THEN $15 ELSE compensation END, " \
"  recoveries = CASE WHEN $17 THEN 0 ELSE recoveries END"
#define FENCE_STATUS_SQL \
"status = $3, " \
"  finished_at = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY (" RUN_TERMINAL_STATUSES_SQL ") " \
"                     THEN pg_catalog.clock_timestamp() END, " \
"  lease_expires_at = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY (" RUN_HELD_STATUSES_SQL ") " \
"                          THEN lease_expires_at END, " \
"  lease_owner = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY (" RUN_HELD_STATUSES_SQL ") " \
"                     THEN lease_owner END, " \
"  lease_epoch = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY (" RUN_HELD_STATUSES_SQL ") " \
"                     THEN lease_epoch END, " \
"  wake_at = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY ('{sleeping,waiting_human,waiting_approval}'::pg_catalog.text[]) " \
"                 THEN pg_catalog.to_timestamp(($10 OPERATOR(pg_catalog.->) 'awaiting' " \
"                      OPERATOR(pg_catalog.->>) 'wake_epoch')::pg_catalog.float8) END, "
#define FENCE_SAME_STATUS_SQL \
"finished_at = NULL, wake_at = NULL, "
#define FENCE_CONTROL_SQL \
", control = CASE WHEN $3 OPERATOR(pg_catalog.=) ANY (" RUN_TERMINAL_STATUSES_SQL ") " \
"                 THEN NULL " \
"                 WHEN $11::pg_catalog.text[] IS NULL AND $12::pg_catalog.jsonb IS NULL " \
"                      AND $13::pg_catalog.text[] IS NULL " \
"                 THEN control ELSE tuvl._control_apply(control, $11, $12, $13) END "
#define FENCE_WHERE_SQL \
" WHERE id OPERATOR(pg_catalog.=) $1 AND attempt OPERATOR(pg_catalog.=) $2 " \
"  AND status OPERATOR(pg_catalog.=) ANY ($16::pg_catalog.text[]) " \
"RETURNING control"
#define FENCE_SAME_WHERE_SQL \
" WHERE id OPERATOR(pg_catalog.=) $1 AND attempt OPERATOR(pg_catalog.=) $2 " \
"  AND status OPERATOR(pg_catalog.=) $3 " \
"RETURNING control"

/* [same status][control assigned] */
static const char *const fence_sql[2][2] = {
	{
		"UPDATE tuvl.runs SET " FENCE_STATUS_SQL FENCE_COMMON_SQL FENCE_WHERE_SQL,
		"UPDATE tuvl.runs SET " FENCE_STATUS_SQL FENCE_COMMON_SQL FENCE_CONTROL_SQL FENCE_WHERE_SQL
	},
	{
		"UPDATE tuvl.runs SET " FENCE_SAME_STATUS_SQL FENCE_COMMON_SQL FENCE_SAME_WHERE_SQL,
		"UPDATE tuvl.runs SET " FENCE_SAME_STATUS_SQL FENCE_COMMON_SQL FENCE_CONTROL_SQL FENCE_SAME_WHERE_SQL
	}
};

#define FENCE_NARGS 17

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
 * Did the transition get the run further: journal an effect's result,
 * move to another step, change the run's status?  Then the recoveries
 * counted since its last progress start again (see LeaseReclaim): a run
 * whose worker dies again and again is in a crash loop only when it dies
 * at the same place.  A transition that merely asks for an effect again
 * (what a reclaimed run does first) is no progress.
 */
static bool
made_progress(RunState *run, const Checkpoint *cp)
{
	const char *was = run->step >= 0 && run->wf ? run->wf->steps[run->step].id : NULL;

	if (run->took_effect || cp->status != run->status)
		return true;
	if ((was == NULL) != (cp->step == NULL))
		return true;
	return was != NULL && strcmp(was, cp->step) != 0;
}

/* The fenced UPDATE; raises when the lease was lost.  Returns the control. */
static Jsonb *
fenced_update(RunState *run, const Checkpoint *cp, int last_seq)
{
	static const Oid types[FENCE_NARGS] = {INT8OID, INT4OID, TEXTOID, JSONBOID, TEXTOID,
		INT4OID, TEXTOID, JSONBOID, TEXTOID, JSONBOID, TEXTARRAYOID, JSONBOID, TEXTARRAYOID,
	BOOLOID, JSONBOID, TEXTARRAYOID, BOOLOID};
	Datum		values[FENCE_NARGS];
	char		nulls[FENCE_NARGS];
	bool		isnull;
	Datum		d;
	bool		same = RunStatusIsHeld(cp->status) && cp->status == run->status;
	bool		control = cp->consume != NIL || cp->control_add != NULL || cp->steer_done != NIL;

	set_param(values, nulls, 0, Int64GetDatum(run->id), false);
	set_param(values, nulls, 1, Int32GetDatum(run->attempt), false);
	set_param(values, nulls, 2, CStringGetTextDatum(StatusName(cp->status)), false);
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
	set_param(values, nulls, 15, same ? (Datum) 0 : StatusHeldParam(), same);
	set_param(values, nulls, 16, BoolGetDatum(made_progress(run, cp)), false);

	/*
	 * Always the generic plan, through the primary key: a custom plan would
	 * fold the context (megabytes, maybe hundreds) into the plan as a
	 * constant, copying it several times per transition.
	 */
	if (SpiExecIndexed(fence_sql[same][control], FENCE_NARGS, types, values, nulls,
					   SPI_OK_UPDATE_RETURNING) != 1)
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("lease on run " INT64_FORMAT " was lost", run->id),
				 errdetail("Attempt %d no longer holds the run; another claimer took it over.",
						   run->attempt)));
	d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	if (isnull)
		return NULL;

	/*
	 * An ended run keeps no directives.  Rare: the row is ours (locked by the
	 * update), so nothing changes them between the two statements.
	 */
	if (!control && RunStatusIsTerminal(cp->status))
	{
		static const Oid clear_types[1] = {INT8OID};
		Datum		clear_values[1];

		clear_values[0] = Int64GetDatum(run->id);
		SpiExec("UPDATE tuvl.runs SET control = NULL WHERE id OPERATOR(pg_catalog.=) $1",
				1, clear_types, clear_values, NULL, SPI_OK_UPDATE);
		return NULL;
	}
	return DatumGetJsonbP(d);
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
	(void) JournalWrite(run->id, run->principal, run->last_seq, cp->events);
	SecurityRestore(&frame);
	/* a run that ends in step mode holds dev mode's gate open no longer */
	if (RunStatusIsTerminal(cp->status) && TuvlDevGate())
		BreakpointsRunEnded(run->id);
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
