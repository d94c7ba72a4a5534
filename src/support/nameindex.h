/*-------------------------------------------------------------------------
 *
 * nameindex.h
 *	  Names (step and end ids) to integers, by hash: lookups by id cost the
 *	  same in a workflow of 3 steps or 3,000 (nameindex.c).  The names are
 *	  not copied: they must outlive the index.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_NAMEINDEX_H
#define TUVL_NAMEINDEX_H

typedef struct NameIndex NameIndex;

extern NameIndex *NameIndexCreate(int expected);
extern bool NameIndexAdd(NameIndex *ix, const char *name, int value);
extern int	NameIndexGet(NameIndex *ix, const char *name);

#endif							/* TUVL_NAMEINDEX_H */
