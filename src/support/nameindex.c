/*-------------------------------------------------------------------------
 *
 * nameindex.c
 *	  Names (step and end ids) to integers, by hash.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "common/hashfn.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"

#include "nameindex.h"

/*
 * A NameIndex maps names to integers through a dynahash table whose keys
 * are pointers to the names (hashed and compared as strings), so a name
 * may be of any length.  The names are not copied: they must live as long
 * as the index, in the same memory context or a longer-lived one.
 */
typedef struct NameEntry
{
	const char *name;			/* the key: a pointer to the name */
	int			value;
} NameEntry;

static uint32
name_hash(const void *key, Size keysize)
{
	const char *name = *(const char *const *) key;

	return hash_bytes((const unsigned char *) name, strlen(name));
}

static int
name_match(const void *key1, const void *key2, Size keysize)
{
	return strcmp(*(const char *const *) key1, *(const char *const *) key2);
}

/* A new, empty index in CurrentMemoryContext, sized for about expected names. */
NameIndex *
NameIndexCreate(int expected)
{
	HASHCTL		ctl;

	ctl.keysize = sizeof(const char *);
	ctl.entrysize = sizeof(NameEntry);
	ctl.hash = name_hash;
	ctl.match = name_match;
	ctl.hcxt = CurrentMemoryContext;
	return (NameIndex *) hash_create("tuvl names", Max(expected, 8), &ctl,
									 HASH_ELEM | HASH_FUNCTION | HASH_COMPARE | HASH_CONTEXT);
}

/* Add name with value; false (and no change) when the name is there already. */
bool
NameIndexAdd(NameIndex *ix, const char *name, int value)
{
	bool		found;
	NameEntry  *e = hash_search((HTAB *) ix, &name, HASH_ENTER, &found);

	if (!found)
		e->value = value;
	return !found;
}

/* The value of name, or -1 when it is not in the index. */
int
NameIndexGet(NameIndex *ix, const char *name)
{
	NameEntry  *e = hash_search((HTAB *) ix, &name, HASH_FIND, NULL);

	return e ? e->value : -1;
}
