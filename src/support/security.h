/*-------------------------------------------------------------------------
 *
 * security.h
 *	  The one place where tuvl changes the current role: internal work as
 *	  the extension's owner, user code as a run's principal.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_SECURITY_H
#define TUVL_SECURITY_H

/* The search_path every internal statement runs with. */
#define TUVL_INTERNAL_SEARCH_PATH "pg_catalog, pg_temp"

/*
 * What a switch saved, to be given back to SecurityRestore.  Lives on the
 * caller's stack; an ERROR between the switch and the restore is undone
 * by (sub)transaction abort, which restores the role, the security
 * context and the GUC nest level on its own.
 */
typedef struct SecurityFrame
{
	Oid			save_user;
	int			save_sec;
	int			nestlevel;
	bool		user_code;		/* a principal frame */
	Oid			temp_before;	/* the session's temp schema at entry */
	Oid			save_session;	/* a principal frame that made the principal
								 * the session user: the one before it;
								 * InvalidOid: it did not */
	bool		save_session_super;
} SecurityFrame;

extern void SecurityInit(void);
extern void SecurityBeginSharedSession(void);
extern bool SecuritySharedSession(void);

extern Oid	SecurityOwnerId(void);
extern Oid	SecurityNameOwner(const char *owner_sql, const char *name);
extern uint64 SecurityExec(const char *sql, int nargs, const Oid *types, Datum *values,
						   const char *nulls, int expected);
extern uint64 SecurityExecArgs(const char *sql, int expected, int nargs, const Oid *types,...);
extern void SecurityAsOwner(SecurityFrame *frame);
extern void SecurityAsPrincipal(SecurityFrame *frame, Oid principal);
extern void SecurityRestore(SecurityFrame *frame);
extern bool SecurityInUserCode(void);

extern bool SecurityIsAdmin(Oid role);
extern bool SecurityIsOperator(Oid role);
extern void SecurityCheckNameOwner(const char *kind, const char *name, Oid owner);
extern void SecurityTransferName(const char *kind, const char *name, Oid new_owner);
extern void SecurityLockKey(const char *space, const char *key);
extern bool SecurityTryLockKey(const char *space, const char *key);

#endif							/* TUVL_SECURITY_H */
