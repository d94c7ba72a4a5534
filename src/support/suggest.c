/*-------------------------------------------------------------------------
 *
 * suggest.c
 *	  "Did you mean": the known name closest to a misspelt one.
 *
 * A candidate is suggested as PostgreSQL suggests a column ("Perhaps you
 * meant to reference the column ..."): by Levenshtein distance, each
 * insertion, deletion and substitution costing 1, and only when at most
 * half of the written name's characters differ, so that nothing far-fetched
 * is offered.  A name differing only in case is always close.  Of two
 * candidates equally close, the first considered wins.  Names read from
 * tuvl's tables are read as the calling role, so a suggestion never shows
 * a name that role could not read itself.  Results point into the
 * candidates (or are palloc'd in CurrentMemoryContext for tables).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/namespace.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/lsyscache.h"
#include "utils/varlena.h"

#include "spiutil.h"
#include "suggest.h"

/* Names longer than this are not compared (the distance is quadratic). */
#define SUGGEST_MAX_LEN 255

void
SuggestInit(NameSuggestion *s, const char *name)
{
	s->name = name;
	s->best = NULL;
	s->distance = INT_MAX;
}

/* Remember candidate if it is closer to the name than any before it. */
void
SuggestConsider(NameSuggestion *s, const char *candidate)
{
	int			len = strlen(s->name);
	int			clen = candidate ? strlen(candidate) : 0;
	int			max = len / 2;
	int			d;

	if (candidate == NULL || len == 0 || len > SUGGEST_MAX_LEN || clen > SUGGEST_MAX_LEN ||
		strcmp(candidate, s->name) == 0)
		return;
	if (pg_strcasecmp(candidate, s->name) == 0)
		d = 0;
	else
		d = varstr_levenshtein_less_equal(s->name, len, candidate, clen, 1, 1, 1,
										  Min(max, s->distance - 1) + 1, true);
	if (d <= max && d < s->distance)
	{
		s->best = candidate;
		s->distance = d;
	}
}

/* The candidate (a NULL-terminated list) closest to name, or NULL. */
const char *
SuggestName(const char *name, const char *const *candidates)
{
	NameSuggestion s;

	SuggestInit(&s, name);
	for (int i = 0; candidates && candidates[i]; i++)
		SuggestConsider(&s, candidates[i]);
	return s.best;
}

/*
 * The name read by sql (its first column, text), a query of tuvl's table
 * relname, closest to name; NULL when none is close, or when the calling
 * role may not read that table.  Runs as the calling role, so its row
 * security holds.  SPI must be connected; sql must be a string literal
 * (SpiExec caches its plan by address).
 */
const char *
SuggestFromTable(const char *name, const char *relname, const char *sql)
{
	Oid			nsp = get_namespace_oid("tuvl", true);
	Oid			rel = OidIsValid(nsp) ? get_relname_relid(relname, nsp) : InvalidOid;
	NameSuggestion s;
	uint64		n;

	if (!OidIsValid(rel) || pg_class_aclcheck(rel, GetUserId(), ACL_SELECT) != ACLCHECK_OK)
		return NULL;
	n = SpiExec(sql, 0, NULL, NULL, NULL, SPI_OK_SELECT);
	SuggestInit(&s, name);
	for (uint64 i = 0; i < n; i++)
	{
		char	   *candidate = SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1);

		CHECK_FOR_INTERRUPTS();
		if (candidate)
			SuggestConsider(&s, candidate);
	}
	return s.best ? pstrdup(s.best) : NULL;
}
