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

#include "fmgr.h"

extern PGDLLEXPORT void TuvlLauncherMain(Datum main_arg);
extern void LauncherNoteExtensionCreated(Oid dboid);

#endif							/* TUVL_LAUNCHER_H */
