/*-------------------------------------------------------------------------
 *
 * duration.h
 *	  Durations as workflows write them (duration.c).  Each returns false
 *	  for text that is not a duration; none raises.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_DURATION_H
#define TUVL_DURATION_H

#include "utils/jsonb.h"

extern bool DurationParse(const char *text, int *ms);
extern bool DurationFromJson(JsonbValue *v, int *ms);
extern bool DurationParseLong(const char *text, int64 *ms);

#endif							/* TUVL_DURATION_H */
