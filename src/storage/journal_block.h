/*-------------------------------------------------------------------------
 *
 * journal_block.h
 *	  The packed form of a block of journal events: what one transition
 *	  appends to tuvl.journal, and what the view tuvl.events unpacks.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_JOURNAL_BLOCK_H
#define TUVL_JOURNAL_BLOCK_H

#include "fmgr.h"
#include "nodes/pg_list.h"

#include "journal.h"

/* The packed events of list events (notify-only ones left out), as bytea. */
extern bytea *JournalBlockPack(List *events);

/*
 * Unpack a block: a List of JournalEvent (payloads parsed), in order, in
 * the current context.  Raises data_corrupted on a block that is not
 * well formed.
 */
extern List *JournalBlockUnpack(bytea *block);

#endif							/* TUVL_JOURNAL_BLOCK_H */
