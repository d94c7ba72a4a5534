/*-------------------------------------------------------------------------
 *
 * cron.c
 *	  Cron schedules: parse one, and test a minute against it.
 *
 * Schedules are read as pg_cron (and Vixie cron) read them: minute hour
 * day-of-month month day-of-week, in UTC, with lists, ranges, steps,
 * month and day names and the @ macros; when both day fields are
 * restricted, a day matching either is a match.  Registration uses the
 * parser to refuse a schedule pg_cron would refuse (saying which field is
 * wrong), tuvl._missed_slots() to find missed slots.  Pure computation:
 * results are palloc'd in CurrentMemoryContext, nothing raises.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "utils/datetime.h"

#include "cron.h"

typedef struct CronField
{
	const char *name;
	int			lo;
	int			hi;
	const char *const *names;	/* month or day names, counted from base */
	int			base;
} CronField;

static const char *const month_names[] = {"jan", "feb", "mar", "apr", "may", "jun", "jul", "aug",
"sep", "oct", "nov", "dec", NULL};
static const char *const day_names[] = {"sun", "mon", "tue", "wed", "thu", "fri", "sat", NULL};

static const CronField fields[5] = {
	{"minute", 0, 59, NULL, 0},
	{"hour", 0, 23, NULL, 0},
	{"day of month", 1, 31, NULL, 0},
	{"month", 1, 12, month_names, 1},
	{"day of week", 0, 7, day_names, 0},
};

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

/*
 * Parse one field into *bits; false when it is not one, with *problem
 * saying why.
 */
static bool
parse_field(const char *text, const CronField *f, uint64 *bits, bool *any, char **problem)
{
	const char *p = text;

	*bits = 0;
	*any = text[0] == '*';
	while (*p)
	{
		int			a = f->lo;
		int			b = f->hi;
		int			step = 1;

		if (*p == '*')
			p++;
		else
		{
			if ((a = field_value(&p, f->names, f->base)) < 0)
				break;
			b = a;
			if (*p == '-')
			{
				p++;
				if ((b = field_value(&p, f->names, f->base)) < 0)
					break;
			}
		}
		if (*p == '/')
		{
			p++;
			if ((step = field_value(&p, NULL, 0)) <= 0)
				break;
			if (a == b && text[0] != '*')
				b = f->hi;		/* "5/10": from 5 on */
		}
		if (a < f->lo || b > f->hi)
		{
			*problem = psprintf("the %s field \"%s\" is out of range: %d is not between %d and %d",
								f->name, text, a < f->lo ? a : b, f->lo, f->hi);
			return false;
		}
		if (a > b)
		{
			*problem = psprintf("the %s field \"%s\" has a range from %d down to %d; write the smaller number first",
								f->name, text, a, b);
			return false;
		}
		for (int v = a; v <= b; v += step)
			*bits |= UINT64CONST(1) << v;
		if (*p == ',')
			p++;
		else if (*p != '\0')
			break;
	}
	if (*p == '\0')
		return true;
	*problem = psprintf("the %s field \"%s\" is not a number%s, a list, a range, a step or *",
						f->name, text, f->names ? " or name" : "");
	return false;
}

/*
 * Parse a schedule into *c; false when it is not one, with *problem (when
 * problem is not NULL) saying what is wrong.
 */
bool
CronParse(const char *text, CronSpec *c, char **problem)
{
	static const char *const macros[][2] = {
		{"@yearly", "0 0 1 1 *"}, {"@annually", "0 0 1 1 *"}, {"@monthly", "0 0 1 * *"},
		{"@weekly", "0 0 * * 0"}, {"@daily", "0 0 * * *"}, {"@midnight", "0 0 * * *"},
		{"@hourly", "0 * * * *"}
	};
	char	   *copy;
	char	   *tokens[5];
	char	   *save = NULL;
	uint64		bits[5];
	bool		any[5];
	char	   *why = NULL;
	int			n = 0;

	for (int i = 0; i < (int) lengthof(macros); i++)
		if (pg_strcasecmp(text, macros[i][0]) == 0)
			text = macros[i][1];
	copy = pstrdup(text);
	for (char *tok = strtok_r(copy, " \t", &save); tok; tok = strtok_r(NULL, " \t", &save))
	{
		if (n == 5)
		{
			n++;
			break;
		}
		tokens[n++] = tok;
	}
	if (n != 5)
		why = n > 5 ? pstrdup("it has more than five fields") : psprintf("it has %d field%s, not five", n, n == 1 ? "" : "s");
	for (int i = 0; why == NULL && i < 5; i++)
		(void) parse_field(tokens[i], &fields[i], &bits[i], &any[i], &why);
	if (why)
	{
		if (problem)
			*problem = why;
		return false;
	}
	memset(c, 0, sizeof(CronSpec));
	c->minute = bits[0];
	c->hour = (uint32) bits[1];
	c->dom = (uint32) bits[2];
	c->dom_any = any[2];
	c->month = (uint32) bits[3];
	c->dow = (uint32) ((bits[4] | (bits[4] >> 7)) & 0x7f);	/* 7 is Sunday too */
	c->dow_any = any[4];
	return true;
}

/* Does the minute at ts (UTC) match? */
bool
CronMatches(const CronSpec *c, TimestampTz ts)
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
