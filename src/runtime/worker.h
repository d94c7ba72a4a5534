/*-------------------------------------------------------------------------
 *
 * worker.h
 *	  The tuvl worker: claims runs of one database and advances them.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_WORKER_H
#define TUVL_WORKER_H

#include "fmgr.h"

extern PGDLLEXPORT void TuvlWorkerMain(Datum main_arg);

#endif							/* TUVL_WORKER_H */
