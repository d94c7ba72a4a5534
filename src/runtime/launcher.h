/*-------------------------------------------------------------------------
 *
 * launcher.h
 *	  The tuvl launcher: keeps a pool of workers in every database that
 *	  has the extension.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_LAUNCHER_H
#define TUVL_LAUNCHER_H

#include "access/xact.h"
#include "fmgr.h"

extern PGDLLEXPORT void TuvlLauncherMain(Datum main_arg);
extern void LauncherNoteExtensionCreatedAtCommit(void);
extern void LauncherXactCallback(XactEvent event, void *arg);

#endif							/* TUVL_LAUNCHER_H */
