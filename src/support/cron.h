/*-------------------------------------------------------------------------
 *
 * cron.h
 *	  Cron schedules as pg_cron reads them (cron.c).  None raises.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_CRON_H
#define TUVL_CRON_H

#include "utils/timestamp.h"

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

extern bool CronParse(const char *text, CronSpec *c, char **problem);
extern bool CronMatches(const CronSpec *c, TimestampTz ts);

#endif							/* TUVL_CRON_H */
