/*-------------------------------------------------------------------------
 *
 * schedule.c
 *	  The slots of a cron schedule, for the catch-up of missed ones.
 *
 * pg_cron fires a job at each minute its schedule matches and never fires
 * one it missed (the server was down, the job was failing).  A workflow
 * with trigger.catch_up: N has tuvl.start_scheduled() also start the last
 * N slots missed since the last one it started; tuvl._missed_slots()
 * finds them.  Schedules are read as pg_cron (and Vixie cron) read them:
 * minute hour day-of-month month day-of-week, in UTC, with lists, ranges,
 * steps, month and day names and the @ macros; when both day fields are
 * restricted, a day matching either is a match.
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

#include "security.h"

PG_FUNCTION_INFO_V1(tuvl_missed_slots);

/* How far back the catch-up looks: slots older than this are not started. */
#define CATCH_UP_WINDOW_DAYS 400

typedef struct CronSpec
{
	uint64		minute;			/* bit i: minute i matches */
	uint32		hour;
	uint32		dom;			/* bits 1..31 */
	uint32		month;			/* bits 1..12 */
	uint32		dow;			/* bits 0..6, Sunday 0 */
	bool		dom_any;		/* the field was * */
	bool		dow_any;
} CronSpec;

static const char *const month_names[] = {"jan", "feb", "mar", "apr", "may", "jun", "jul", "aug",
"sep", "oct", "nov", "dec", NULL};
static const char *const day_names[] = {"sun", "mon", "tue", "wed", "thu", "fri", "sat", NULL};

/* A number, or a name of names (counted from base); -1 when neither. */
static int
field_value(const char **p, const char *const *names, int base)
{
	int			v = 0;

	if (isdigit((unsigned char) **p))
	{
		while (isdigit((unsigned char) **p) && v < 1000)
			v = v * 10 + (*(*p)++ - '0');
		return v;
	}
	for (int i = 0; names && names[i]; i++)
		if (pg_strncasecmp(*p, names[i], 3) == 0)
		{
			*p += 3;
			return i + base;
		}
	return -1;
}

/* Parse one field (lo..hi) into *bits; false when it is not one. */
static bool
parse_field(const char *text, int lo, int hi, const char *const *names, int base, uint64 *bits,
			bool *any)
{
	const char *p = text;

	*bits = 0;
	*any = text[0] == '*';
	while (*p)
	{
		int			a = lo;
		int			b = hi;
		int			step = 1;

		if (*p == '*')
			p++;
		else
		{
			if ((a = field_value(&p, names, base)) < 0)
				return false;
			b = a;
			if (*p == '-')
			{
				p++;
				if ((b = field_value(&p, names, base)) < 0)
					return false;
			}
		}
		if (*p == '/')
		{
			p++;
			if ((step = field_value(&p, NULL, 0)) <= 0)
				return false;
			if (a == b && text[0] != '*')
				b = hi;			/* "5/10": from 5 on */
		}
		if (a < lo || b > hi || a > b)
			return false;
		for (int v = a; v <= b; v += step)
			*bits |= UINT64CONST(1) << v;
		if (*p == ',')
			p++;
		else if (*p != '\0')
			return false;
	}
	return true;
}

/* Parse a schedule; false when tuvl cannot read it. */
static bool
parse_cron(const char *text, CronSpec *c)
{
	static const char *const macros[][2] = {
		{"@yearly", "0 0 1 1 *"}, {"@annually", "0 0 1 1 *"}, {"@monthly", "0 0 1 * *"},
		{"@weekly", "0 0 * * 0"}, {"@daily", "0 0 * * *"}, {"@midnight", "0 0 * * *"},
		{"@hourly", "0 * * * *"}
	};
	char	   *copy;
	char	   *fields[5];
	char	   *save = NULL;
	uint64		bits;
	bool		any;
	int			n = 0;

	for (int i = 0; i < (int) lengthof(macros); i++)
		if (pg_strcasecmp(text, macros[i][0]) == 0)
			text = macros[i][1];
	copy = pstrdup(text);
	for (char *tok = strtok_r(copy, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save))
	{
		if (n == 5)
			return false;
		fields[n++] = tok;
	}
	if (n != 5)
		return false;
	memset(c, 0, sizeof(CronSpec));
	if (!parse_field(fields[0], 0, 59, NULL, 0, &c->minute, &any) ||
		!parse_field(fields[1], 0, 23, NULL, 0, &bits, &any))
		return false;
	c->hour = (uint32) bits;
	if (!parse_field(fields[2], 1, 31, NULL, 0, &bits, &c->dom_any))
		return false;
	c->dom = (uint32) bits;
	if (!parse_field(fields[3], 1, 12, month_names, 1, &bits, &any))
		return false;
	c->month = (uint32) bits;
	if (!parse_field(fields[4], 0, 7, day_names, 0, &bits, &c->dow_any))
		return false;
	c->dow = (uint32) ((bits | (bits >> 7)) & 0x7f);	/* 7 is Sunday too */
	return true;
}

/* Does the minute at ts (UTC) match? */
static bool
cron_matches(const CronSpec *c, TimestampTz ts)
{
	struct pg_tm tm;
	fsec_t		fsec;
	bool		dom_ok;
	bool		dow_ok;

	if (timestamp2tm(ts, NULL, &tm, &fsec, NULL, NULL) != 0)
		return false;
	if (!(c->minute & (UINT64CONST(1) << tm.tm_min)) || !(c->hour & (1U << tm.tm_hour)) ||
		!(c->month & (1U << tm.tm_mon)))
		return false;
	dom_ok = (c->dom & (1U << tm.tm_mday)) != 0;
	dow_ok = (c->dow & (1U << j2day(date2j(tm.tm_year, tm.tm_mon, tm.tm_mday)))) != 0;
	if (c->dom_any || c->dow_any)
		return dom_ok && dow_ok;
	return dom_ok || dow_ok;
}

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

	if (max <= 0 || !parse_cron(spec, &c) || TIMESTAMP_NOT_FINITE(after) || TIMESTAMP_NOT_FINITE(before))
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
		if (cron_matches(&c, ts))
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
