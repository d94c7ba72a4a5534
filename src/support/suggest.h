/*-------------------------------------------------------------------------
 *
 * suggest.h
 *	  "Did you mean": the known name closest to a misspelt one (suggest.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_SUGGEST_H
#define TUVL_SUGGEST_H

typedef struct NameSuggestion
{
	const char *name;			/* what was written */
	const char *best;			/* the closest candidate so far, or NULL */
	int			distance;		/* its distance */
} NameSuggestion;

extern void SuggestInit(NameSuggestion *s, const char *name);
extern void SuggestConsider(NameSuggestion *s, const char *candidate);
extern const char *SuggestName(const char *name, const char *const *candidates);
extern const char *SuggestFromTable(const char *name, const char *relname, const char *sql);

#endif							/* TUVL_SUGGEST_H */
