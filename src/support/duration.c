/*-------------------------------------------------------------------------
 *
 * duration.c
 *	  Durations as workflows write them: "250ms", "10s", "5m", "1h", "2d"
 *	  or a number of seconds.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>
#include <limits.h>

#include "utils/builtins.h"
#include "utils/numeric.h"

#include "duration.h"

/*
 * Parse "250ms", "10s", "5m", "1h", "2d" or a plain number of seconds,
 * into milliseconds that may exceed an int (a Sleep step's for:).
 * Returns false when the text is not a duration.
 */
bool
DurationParseLong(const char *text, int64 *ms)
{
	char	   *end;
	double		v;
	double		mult;

	errno = 0;
	v = strtod(text, &end);
	if (end == text || errno != 0 || v < 0)
		return false;
	while (isspace((unsigned char) *end))
		end++;
	if (*end == '\0' || strcmp(end, "s") == 0)
		mult = 1000;
	else if (strcmp(end, "ms") == 0)
		mult = 1;
	else if (strcmp(end, "m") == 0 || strcmp(end, "min") == 0)
		mult = 60000;
	else if (strcmp(end, "h") == 0)
		mult = 3600000;
	else if (strcmp(end, "d") == 0)
		mult = 86400000;
	else
		return false;
	if (v * mult > (double) PG_INT64_MAX / 2)
		return false;
	*ms = (int64) (v * mult);
	return true;
}

/*
 * Parse "250ms", "10s", "5m", "1h", "2d" or a plain number of seconds, up
 * to what an int of milliseconds holds (24 days).  Returns false when the
 * text is not such a duration.
 */
bool
DurationParse(const char *text, int *ms)
{
	int64		v;

	if (!DurationParseLong(text, &v) || v > INT_MAX)
		return false;
	*ms = (int) v;
	return true;
}

/* A duration given as a YAML number (seconds) or string. */
bool
DurationFromJson(JsonbValue *v, int *ms)
{
	char	   *text;

	if (v == NULL)
		return false;
	if (v->type == jbvNumeric)
		text = DatumGetCString(DirectFunctionCall1(numeric_out,
												   NumericGetDatum(v->val.numeric)));
	else if (v->type == jbvString)
		text = pnstrdup(v->val.string.val, v->val.string.len);
	else
		return false;
	return DurationParse(text, ms);
}
