/*-------------------------------------------------------------------------
 *
 * schedule.c
 *	  The slots of a cron schedule, for the catch-up of missed ones.
 *
 * pg_cron fires a job at each minute its schedule matches and never fires
 * one it missed (the server was down, the job was failing).  A workflow
 * with trigger.catch_up: N has tuvl.start_scheduled() also start the last
 * N slots missed since the last one it started; tuvl._missed_slots()
 * finds them, with the schedule read as pg_cron reads it (cron.c).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/datetime.h"
#include "utils/timestamp.h"

#include "cron.h"
#include "security.h"

PG_FUNCTION_INFO_V1(tuvl_missed_slots);

/* How far back the catch-up looks: slots older than this are not started. */
#define CATCH_UP_WINDOW_DAYS 400

/*
 * tuvl._missed_slots(schedule text, after timestamptz, before timestamptz,
 * max integer) returns timestamptz[]: the last max slots of schedule
 * strictly between after and before (at most CATCH_UP_WINDOW_DAYS back
 * from before), oldest first.  A schedule tuvl cannot read gives none.
 */
Datum
tuvl_missed_slots(PG_FUNCTION_ARGS)
{
	char	   *spec = text_to_cstring(PG_GETARG_TEXT_PP(0));
	TimestampTz after = PG_GETARG_TIMESTAMPTZ(1);
	TimestampTz before = PG_GETARG_TIMESTAMPTZ(2);
	int			max = PG_GETARG_INT32(3);
	TimestampTz floor_ts = before - (int64) CATCH_UP_WINDOW_DAYS * USECS_PER_DAY;
	CronSpec	c;
	Datum	   *found;
	int			n = 0;
	TimestampTz ts;

	if (max <= 0 || !CronParse(spec, &c, NULL) || TIMESTAMP_NOT_FINITE(after) || TIMESTAMP_NOT_FINITE(before))
		PG_RETURN_ARRAYTYPE_P(construct_empty_array(TIMESTAMPTZOID));
	max = Min(max, 1000);
	found = palloc(sizeof(Datum) * max);
	/* the minute before `before`, walking back to just after `after` */
	ts = before - before % USECS_PER_MINUTE;
	if (ts == before)
		ts -= USECS_PER_MINUTE;
	for (; ts > after && ts >= floor_ts && n < max; ts -= USECS_PER_MINUTE)
	{
		CHECK_FOR_INTERRUPTS();
		if (CronMatches(&c, ts))
			found[n++] = TimestampTzGetDatum(ts);
	}
	/* oldest first */
	for (int i = 0; i < n / 2; i++)
	{
		Datum		t = found[i];

		found[i] = found[n - 1 - i];
		found[n - 1 - i] = t;
	}
	PG_RETURN_ARRAYTYPE_P(construct_array(found, n, TIMESTAMPTZOID, sizeof(TimestampTz),
										  FLOAT8PASSBYVAL, TYPALIGN_DOUBLE));
}

/* ---------------------------------------------------------------- slots
 *
 * tuvl.schedule_slots records which slot started which run, so that each
 * slot starts one run.  Sessions do not write it themselves (with UPDATE
 * on it, any role could LOCK it and stop every role's scheduled runs):
 * tuvl.start_scheduled() takes and records slots through these two
 * functions, which check the caller as the table's policies did (the
 * workflow's owner, or a member of tuvl_operator) and write as the
 * extension's owner.
 */
PG_FUNCTION_INFO_V1(tuvl_take_slot);
PG_FUNCTION_INFO_V1(tuvl_record_slot);

/* May the caller start the scheduled runs of workflow?  SPI connected. */
static void
check_slot_caller(const char *workflow)
{
	Oid			owner = SecurityNameOwner("SELECT owner FROM tuvl.workflows "
										  "WHERE name OPERATOR(pg_catalog.=) $1 "
										  "  AND version OPERATOR(pg_catalog.=) 1", workflow);

	if (!OidIsValid(owner))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("workflow \"%s\" does not exist", workflow)));
	if (!is_member_of_role(GetUserId(), owner) && !SecurityIsOperator(GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied to start the scheduled runs of workflow \"%s\"", workflow),
				 errhint("Its owner's pg_cron job starts them, or a member of tuvl_operator.")));
}

/*
 * _take_slot(workflow, slot): true when this call took the slot (no run
 * was started for it yet), false when it was taken before.
 */
Datum
tuvl_take_slot(PG_FUNCTION_ARGS)
{
	static const Oid types[2] = {TEXTOID, TIMESTAMPTZOID};
	char	   *workflow = text_to_cstring(PG_GETARG_TEXT_PP(0));
	uint64		n;

	SPI_connect();
	check_slot_caller(workflow);
	n = SecurityExecArgs("INSERT INTO tuvl.schedule_slots AS s (workflow, slot) VALUES ($1, $2) "
						 "ON CONFLICT DO NOTHING", SPI_OK_INSERT, 2, types,
						 PointerGetDatum(PG_GETARG_TEXT_PP(0)), PG_GETARG_DATUM(1));
	SPI_finish();
	PG_RETURN_BOOL(n == 1);
}

/* _record_slot(workflow, slot, run_id): the run the slot started. */
Datum
tuvl_record_slot(PG_FUNCTION_ARGS)
{
	static const Oid types[3] = {TEXTOID, TIMESTAMPTZOID, INT8OID};
	char	   *workflow = text_to_cstring(PG_GETARG_TEXT_PP(0));

	SPI_connect();
	check_slot_caller(workflow);
	SecurityExecArgs("UPDATE tuvl.schedule_slots s SET run_id = $3 "
					 "WHERE s.workflow OPERATOR(pg_catalog.=) $1 AND s.slot OPERATOR(pg_catalog.=) $2",
					 SPI_OK_UPDATE, 3, types, PointerGetDatum(PG_GETARG_TEXT_PP(0)),
					 PG_GETARG_DATUM(1), PG_GETARG_DATUM(2));
	SPI_finish();
	PG_RETURN_VOID();
}
