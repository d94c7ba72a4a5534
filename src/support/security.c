/*-------------------------------------------------------------------------
 *
 * security.c
 *	  The one place where tuvl changes the current role: internal work as
 *	  the extension's owner, user code as a run's principal, and the
 *	  rules that keep one role's step from reaching another's.
 *
 * Two kinds of frame, both entered and left here and nowhere else:
 *
 * - An owner frame runs tuvl's own SQL (checkpoints, the journal, the
 *   registry) as the extension's owner, with the restrictions PostgreSQL
 *   applies to maintenance code (SECURITY_RESTRICTED_OPERATION), in a GUC
 *   nest level whose search_path is "pg_catalog, pg_temp".  Every internal
 *   statement also qualifies its types, functions and operators, so
 *   nothing the caller put in its own schemas or in pg_temp can take the
 *   place of what the statement means.
 *
 * - A principal frame runs user code (a ModelOp's SQL, a Functional's
 *   function, an agent's SQL tool) as the run's principal, also security
 *   restricted and in a GUC nest level that is discarded afterwards.  The
 *   principal is also the session user (session_user, and is_superuser
 *   follows it), as if the code ran in the principal's own session: in a
 *   worker the session user is a superuser, and row security or audit
 *   keyed on session_user must not trust a step for it.  The
 *   restrictions refuse temporary tables, SET ROLE, LISTEN, DISCARD,
 *   cursors WITH HOLD and deferred triggers; the utility hook below also
 *   refuses PREPARE and LOAD.  A worker's session serves many principals,
 *   so there a step may not leave anything in pg_temp either, and the
 *   session-level advisory locks it took are released when it ends.
 *   Transaction-scoped state (cursors, transaction-level locks) cannot
 *   cross principals because a worker commits each principal's
 *   transitions in transactions of their own (worker.c).
 *
 * A worker's session runs tuvl's own statements with jit off, and user
 * code with the jit setting the session would have without that (the
 * server's, the database's; a reload changes it).  An internal statement
 * is a few index probes, but its plan is costed from statistics that may
 * be missing or stale, or (SpiExecIndexed) with sequential scans disabled,
 * which prices any plan that keeps one at 10^10: past jit_above_cost,
 * each execution would compile it with LLVM, 10 to 40 ms, stalling every
 * run the worker holds.  A step's own SQL keeps the user's setting.
 *
 * A frame is left by SecurityRestore.  When an ERROR unwinds past a frame,
 * (sub)transaction abort restores the role, the security context and the
 * GUCs, and the (sub)transaction callbacks below forget the user code that
 * was running and give the session user back, so a frame never needs a
 * PG_TRY of its own.
 *
 * The utility hook also guards DROP ROLE: a role that owns tuvl names,
 * holds secret grants or has runs in flight in this database cannot be
 * dropped (as PostgreSQL refuses to drop a role that owns tables).  Roles
 * are identified by OID everywhere, so a new role of the same name never
 * inherits anything in any case.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/indexing.h"
#include "catalog/namespace.h"
#include "catalog/pg_extension.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "nodes/parsenodes.h"
#include "storage/lock.h"
#include "storage/proc.h"
#include "tcop/utility.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/syscache.h"

#include "deadline.h"
#include "security.h"
#include "spiutil.h"

/*
 * Run one internal statement as the extension owner (see SpiExec).
 */
uint64
SecurityExec(const char *sql, int nargs, const Oid *types, Datum *values,
			 const char *nulls, int expected)
{
	SecurityFrame frame;
	uint64		n;

	SecurityAsOwner(&frame);
	n = SpiExec(sql, nargs, types, values, nulls, expected);
	SecurityRestore(&frame);
	return n;
}

/*
 * The same with its nargs parameters (Datums, none of them NULL) as
 * arguments: SecurityExecArgs(sql, SPI_OK_UPDATE, 2, types, a, b).
 */
uint64
SecurityExecArgs(const char *sql, int expected, int nargs, const Oid *types,...)
{
	Datum		values[16];
	va_list		args;

	Assert(nargs <= (int) lengthof(values));
	va_start(args, types);
	for (int i = 0; i < nargs; i++)
		values[i] = va_arg(args, Datum);
	va_end(args);
	return SecurityExec(sql, nargs, types, values, NULL, expected);
}

/*
 * The owner (a regrole) that owner_sql (one text parameter, at most one
 * row) finds for name, or InvalidOid when the name is new.  Runs as the
 * extension owner.
 */
Oid
SecurityNameOwner(const char *owner_sql, const char *name)
{
	static const Oid types[1] = {TEXTOID};
	Datum		d;

	if (SecurityExecArgs(owner_sql, SPI_OK_SELECT, 1, types, CStringGetTextDatum(name)) == 1 &&
		SpiValue(1, &d))
		return DatumGetObjectId(d);
	return InvalidOid;
}

/*
 * The owner of the tuvl extension in this database: internal writes to
 * tuvl's tables run as this role (SecurityOwnerId caches it).
 * Must be called inside a transaction.
 */
static Oid
extension_owner(void)
{
	Relation	rel;
	ScanKeyData key;
	SysScanDesc scan;
	HeapTuple	tup;
	Oid			owner = InvalidOid;

	rel = table_open(ExtensionRelationId, AccessShareLock);
	ScanKeyInit(&key, Anum_pg_extension_extname, BTEqualStrategyNumber,
				F_NAMEEQ, CStringGetDatum("tuvl"));
	scan = systable_beginscan(rel, ExtensionNameIndexId, true, NULL, 1, &key);
	tup = systable_getnext(scan);
	if (HeapTupleIsValid(tup))
		owner = ((Form_pg_extension) GETSTRUCT(tup))->extowner;
	systable_endscan(scan);
	table_close(rel, AccessShareLock);

	if (!OidIsValid(owner))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("extension \"tuvl\" is not installed in this database"),
				 errhint("Run CREATE EXTENSION tuvl.")));
	return owner;
}

/* How deeply user code may nest (a step calling tuvl.run() ...). */
#define MAX_USER_CODE_DEPTH 16

/*
 * The transaction nest levels at which user code is running, and for
 * each frame the session user it replaced by the principal (InvalidOid:
 * none), to give back when an error unwinds the frame.
 */
static int	user_code_depth = 0;
static int	user_code_level[MAX_USER_CODE_DEPTH];
static Oid	user_code_session[MAX_USER_CODE_DEPTH];
static bool user_code_session_super[MAX_USER_CODE_DEPTH];

/* A worker's session, shared by many principals (see worker.c). */
static bool shared_session = false;
static char *user_search_path = NULL;
static char *user_lock_timeout = NULL;

/*
 * How long a worker's own statements wait for a lock.  Every row a worker
 * writes may be locked by a session for as long as it likes: a role's
 * tuvl.pause_run() on its own run, in a transaction it leaves open, locks
 * that run's row.  A worker that waited for it would stall every other
 * run it holds, of every role.  So its statements wait this long at most;
 * a transition that times out is made again later (worker.c).  User code
 * (a step's SQL) keeps the session's own lock_timeout.
 */
#define WORKER_LOCK_TIMEOUT "1s"

/* The extension owner, looked up once per transaction. */
static Oid	owner_cache = InvalidOid;
static LocalTransactionId owner_cache_lxid = InvalidLocalTransactionId;

static ProcessUtility_hook_type prev_utility_hook = NULL;

static void check_drop_role(DropRoleStmt *stmt);
static void follow_owned(Node *stmt);
static void check_new_owner(const char *what, const char *name, Oid new_owner);

/* ---------------------------------------------------------------- frames */

/*
 * The owner of the tuvl extension in this database, cached for the
 * current transaction.  Raises when the extension is not installed.
 */
Oid
SecurityOwnerId(void)
{
	if (!OidIsValid(owner_cache) || owner_cache_lxid != MyProc->lxid)
	{
		owner_cache = extension_owner();
		owner_cache_lxid = MyProc->lxid;
	}
	return owner_cache;
}

static void
set_search_path(const char *path)
{
	if (strcmp(namespace_search_path, path) != 0)
		(void) set_config_option("search_path", path, PGC_USERSET, PGC_S_SESSION,
								 GUC_ACTION_SAVE, true, 0, false);
}

/*
 * Make role the session user: what SET SESSION AUTHORIZATION does, with
 * PostgreSQL's own assign hook of it, which also makes role the outer
 * user and sets is_superuser (unless a SET ROLE is active: then both
 * follow that role, as in any session).  That hook may only run outside
 * a security context, so the current user and context are put back
 * around it; it checks nothing, and nothing else of the GUC
 * session_authorization changes (SHOW session_authorization still names
 * the role the session logged in as).
 */
static void
set_session_user(Oid role, bool is_superuser)
{
	Oid			user;
	int			sec;

	GetUserIdAndSecContext(&user, &sec);
	SetUserIdAndSecContext(user, 0);
	SetSessionAuthorization(role, is_superuser);
	SetUserIdAndSecContext(user, sec);
}

/*
 * Run tuvl's own SQL as the extension owner: see the file header.  Call
 * SecurityRestore(frame) when done.
 */
void
SecurityAsOwner(SecurityFrame *frame)
{
	Oid			owner = SecurityOwnerId();

	GetUserIdAndSecContext(&frame->save_user, &frame->save_sec);
	frame->user_code = false;
	frame->temp_before = InvalidOid;
	frame->save_session = InvalidOid;
	frame->save_session_super = false;
	frame->nestlevel = NewGUCNestLevel();
	SetUserIdAndSecContext(owner, frame->save_sec | SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	set_search_path(TUVL_INTERNAL_SEARCH_PATH);
}

/*
 * Run user code as principal: see the file header.  In a worker's shared
 * session the code sees the search_path the session started with (the
 * database's default); elsewhere, the caller's own.  Call SecurityRestore
 * when done, which also checks what the code left behind.
 */
void
SecurityAsPrincipal(SecurityFrame *frame, Oid principal)
{
	Oid			toast;

	if (user_code_depth >= MAX_USER_CODE_DEPTH)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("steps are nested too deeply"),
				 errdetail("A step called a tuvl function that executed another step, %d levels deep.",
						   MAX_USER_CODE_DEPTH)));
	GetUserIdAndSecContext(&frame->save_user, &frame->save_sec);
	GetTempNamespaceState(&frame->temp_before, &toast);
	frame->user_code = true;
	frame->nestlevel = NewGUCNestLevel();
	frame->save_session = InvalidOid;
	frame->save_session_super = false;
	if (GetSessionUserId() != principal)
	{
		bool		super = superuser_arg(principal);

		frame->save_session = GetSessionUserId();
		frame->save_session_super = GetSessionUserIsSuperuser();
		set_session_user(principal, super);

		/*
		 * under SET ROLE is_superuser followed the role: the principal's,
		 * until the nest ends
		 */
		if (OidIsValid(GetCurrentRoleId()))
			(void) set_config_option("is_superuser", super ? "on" : "off", PGC_INTERNAL,
									 PGC_S_SESSION, GUC_ACTION_SAVE, true, 0, false);
	}
	SetUserIdAndSecContext(principal, frame->save_sec | SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	if (shared_session && user_search_path)
		set_search_path(user_search_path);
	if (shared_session && user_lock_timeout)
		(void) set_config_option("lock_timeout", user_lock_timeout, PGC_SUSET, PGC_S_SESSION,
								 GUC_ACTION_SAVE, true, 0, false);
	if (shared_session)
	{
		/* the jit setting the session has under tuvl's own "off" */
		const char *jit = GetConfigOptionResetString("jit");

		if (jit && strcmp(jit, "off") != 0)
			(void) set_config_option("jit", jit, PGC_USERSET, PGC_S_SESSION,
									 GUC_ACTION_SAVE, true, 0, false);
	}
	user_code_session[user_code_depth] = frame->save_session;
	user_code_session_super[user_code_depth] = frame->save_session_super;
	user_code_level[user_code_depth++] = GetCurrentTransactionNestLevel();
	DeadlineUserCode(true);
}

/*
 * Leave a frame: the GUCs set inside it are discarded, the role and the
 * security context are those before it.  Leaving user code in a shared
 * session releases its session-level advisory locks and raises when it
 * created temporary objects (the caller's subtransaction then removes
 * them).
 */
void
SecurityRestore(SecurityFrame *frame)
{
	AtEOXact_GUC(false, frame->nestlevel);
	if (OidIsValid(frame->save_session))
		set_session_user(frame->save_session, frame->save_session_super);
	SetUserIdAndSecContext(frame->save_user, frame->save_sec);
	if (!frame->user_code)
		return;
	if (user_code_depth > 0)
		user_code_depth--;
	DeadlineUserCode(user_code_depth > 0);
	if (shared_session)
	{
		Oid			temp;
		Oid			toast;

		LockReleaseSession(USER_LOCKMETHOD);
		GetTempNamespaceState(&temp, &toast);
		if (OidIsValid(temp) && temp != frame->temp_before)
			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("a step may not create temporary objects"),
					 errdetail("A tuvl worker's session executes the steps of many roles; "
							   "an object in pg_temp would outlive the step."),
					 errhint("Use a table in a schema of your own, or keep the work within one statement.")));
	}
}

/* Is user code executing right now (in any frame)? */
bool
SecurityInUserCode(void)
{
	return user_code_depth > 0;
}

/*
 * This process is a worker: its session serves every principal.  Pin the
 * session's search_path for tuvl's own statements and remember the one
 * the session started with for user code; turn jit off for tuvl's own
 * statements (user code gets the session's reset value back).
 */
void
SecurityBeginSharedSession(void)
{
	user_search_path = MemoryContextStrdup(TopMemoryContext, namespace_search_path);
	SetConfigOption("search_path", TUVL_INTERNAL_SEARCH_PATH, PGC_SUSET, PGC_S_SESSION);
	user_lock_timeout = MemoryContextStrdup(TopMemoryContext,
											GetConfigOption("lock_timeout", false, false));
	SetConfigOption("lock_timeout", WORKER_LOCK_TIMEOUT, PGC_SUSET, PGC_S_SESSION);
	/* tuvl's own statements are never JIT-compiled (see the file header) */
	SetConfigOption("jit", "off", PGC_USERSET, PGC_S_SESSION);
	shared_session = true;
}

bool
SecuritySharedSession(void)
{
	return shared_session;
}

/* ---------------------------------------------------------------- roles */

static bool
member_of(Oid role, const char *group)
{
	Oid			g = get_role_oid(group, true);

	return superuser_arg(role) || (OidIsValid(g) && has_privs_of_role(role, g));
}

/* Does role act as a tuvl_admin (or a superuser)? */
bool
SecurityIsAdmin(Oid role)
{
	return member_of(role, "tuvl_admin");
}

/* Does role act as a tuvl_operator (tuvl_admin includes it)? */
bool
SecurityIsOperator(Oid role)
{
	return member_of(role, "tuvl_operator") || member_of(role, "tuvl_admin");
}

/*
 * A name (workflow, artifact, model config) belongs to the role that
 * registered it first.  Raise unless owner (InvalidOid: the name is new)
 * is the current role: no other role may add versions, superusers
 * included.  The message does not name the owner.
 */
void
SecurityCheckNameOwner(const char *kind, const char *name, Oid owner)
{
	if (!OidIsValid(owner) || owner == GetUserId())
		return;
	ereport(ERROR,
			(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
			 errmsg("%s \"%s\" belongs to another role", kind, name),
			 errdetail("The name of a %s belongs to the role that registered it first; no other role, superusers included, may register a version of it.",
					   kind),
			 errhint("Choose another name, or have its owner (or a member of tuvl_admin) hand it over with tuvl.transfer('%s', '%s', ...).",
					 strcmp(kind, "LLM config") == 0 ? "llm" : kind, name)));
}

/* ---------------------------------------------------------------- hooks */

/* User code may not leave session state through these statements. */
static void
check_user_utility(Node *stmt)
{
	const char *what = NULL;

	switch (nodeTag(stmt))
	{
		case T_PrepareStmt:
			what = "PREPARE";
			break;
		case T_LoadStmt:
			what = "LOAD";
			break;
		default:
			return;
	}
	ereport(ERROR,
			(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
			 errmsg("a step may not execute %s", what),
			 errdetail("%s leaves state in the session, which outlives the step.", what),
			 errhint("Write the statement into the step itself; tuvl prepares a step's SQL once per session on its own.")));
}

static void
tuvl_utility_hook(PlannedStmt *pstmt, const char *queryString, bool readOnlyTree,
				  ProcessUtilityContext context, ParamListInfo params,
				  QueryEnvironment *queryEnv, DestReceiver *dest, QueryCompletion *qc)
{
	Node	   *stmt = pstmt->utilityStmt;

	if (user_code_depth > 0)
		check_user_utility(stmt);
	if (IsA(stmt, DropRoleStmt) && IsTransactionState())
		check_drop_role((DropRoleStmt *) stmt);

	if (prev_utility_hook)
		prev_utility_hook(pstmt, queryString, readOnlyTree, context, params,
						  queryEnv, dest, qc);
	else
		standard_ProcessUtility(pstmt, queryString, readOnlyTree, context, params,
								queryEnv, dest, qc);
	if ((IsA(stmt, ReassignOwnedStmt) || IsA(stmt, DropOwnedStmt)) && IsTransactionState())
		follow_owned(stmt);
}

/*
 * Forget the frames of user code at transaction nest level level and
 * deeper (an ERROR unwound them), and give back the session user the
 * outermost of them replaced.
 */
static void
unwind_user_code(int level)
{
	Oid			session = InvalidOid;
	bool		session_super = false;

	while (user_code_depth > 0 && user_code_level[user_code_depth - 1] >= level)
	{
		user_code_depth--;
		if (OidIsValid(user_code_session[user_code_depth]))
		{
			session = user_code_session[user_code_depth];
			session_super = user_code_session_super[user_code_depth];
		}
	}
	if (OidIsValid(session))
		set_session_user(session, session_super);
	DeadlineUserCode(user_code_depth > 0);
}

/* User code whose subtransaction aborts is no longer running. */
static void
security_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
						  SubTransactionId parentSubid, void *arg)
{
	if (event == SUBXACT_EVENT_ABORT_SUB)
		unwind_user_code(GetCurrentTransactionNestLevel());
}

static void
security_xact_callback(XactEvent event, void *arg)
{
	if (event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT)
		unwind_user_code(0);
}

/* Install the hooks; from _PG_init, preloaded or not. */
void
SecurityInit(void)
{
	prev_utility_hook = ProcessUtility_hook;
	ProcessUtility_hook = tuvl_utility_hook;
	RegisterSubXactCallback(security_subxact_callback, NULL);
	RegisterXactCallback(security_xact_callback, NULL);
}

/* ---------------------------------------------------------------- DROP ROLE */

static const char role_objects_sql[] =
"SELECT (SELECT pg_catalog.count(*) FROM tuvl.workflows w "
"        WHERE w.owner OPERATOR(pg_catalog.=) $1 AND w.version OPERATOR(pg_catalog.=) 1), "
"       (SELECT pg_catalog.count(*) FROM tuvl.artifacts a "
"        WHERE a.owner OPERATOR(pg_catalog.=) $1 AND a.version OPERATOR(pg_catalog.=) 1), "
"       (SELECT pg_catalog.count(*) FROM tuvl.llms l WHERE l.owner OPERATOR(pg_catalog.=) $1), "
"       (SELECT pg_catalog.count(*) FROM tuvl.runs r WHERE r.principal_id OPERATOR(pg_catalog.=) $1 "
"          AND r.finished_at IS NULL), "
"       (SELECT pg_catalog.count(*) FROM tuvl.secret_grants g "
"        WHERE g.grantee OPERATOR(pg_catalog.=) $1), "
"       (SELECT pg_catalog.count(*) FROM tuvl.use_grants u "
"        WHERE u.grantee OPERATOR(pg_catalog.=) $1)";

static void
add_count(StringInfo buf, int64 n, const char *one, const char *many)
{
	if (n == 0)
		return;
	if (buf->len > 0)
		appendStringInfoString(buf, ", ");
	appendStringInfo(buf, INT64_FORMAT " %s", n, n == 1 ? one : many);
}

/*
 * Refuse DROP ROLE of a role that owns tuvl objects here; a role that does
 * not exist is left to DROP ROLE itself (IF EXISTS, or its own error).
 */
static void
check_drop_role(DropRoleStmt *stmt)
{
	ListCell   *lc;

	if (!OidIsValid(get_extension_oid("tuvl", true)))
		return;
	foreach(lc, stmt->roles)
	{
		RoleSpec   *spec = lfirst(lc);
		Oid			role;
		Datum		values[1];
		static const Oid types[1] = {REGROLEOID};
		StringInfoData what;
		SecurityFrame frame;

		if (spec->roletype != ROLESPEC_CSTRING)
			continue;
		role = get_role_oid(spec->rolename, true);
		if (!OidIsValid(role))
			continue;
		values[0] = ObjectIdGetDatum(role);
		initStringInfo(&what);
		SPI_connect();
		SecurityAsOwner(&frame);
		SpiExec(role_objects_sql, 1, types, values, NULL, SPI_OK_SELECT);
		SecurityRestore(&frame);
		for (int i = 0; i < 6; i++)
		{
			bool		isnull;
			int64		n = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
														SPI_tuptable->tupdesc, i + 1, &isnull));
			static const char *const one[] = {"workflow", "artifact", "LLM config",
			"run in flight", "secret grant", "use grant"};
			static const char *const many[] = {"workflows", "artifacts", "LLM configs",
			"runs in flight", "secret grants", "use grants"};

			add_count(&what, n, one[i], many[i]);
		}
		SPI_finish();
		if (what.len > 0)
			ereport(ERROR,
					(errcode(ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST),
					 errmsg("role \"%s\" cannot be dropped because it owns tuvl objects",
							spec->rolename),
					 errdetail("In this database it has %s.", what.data),
					 errhint("Hand its names over with tuvl.transfer() or REASSIGN OWNED, revoke its secrets and "
							 "uses with tuvl.revoke_secret(), tuvl.revoke_use() or DROP OWNED, and let its runs "
							 "finish or abort them with tuvl.abort_run().")));
	}
}

/*
 * REASSIGN OWNED BY old TO new also hands over old's tuvl names in this
 * database (and fails when new is one of tuvl's group roles, as
 * tuvl.transfer() does); DROP OWNED BY old also revokes its secret and use
 * grants (as it revokes its privileges).  PostgreSQL has checked the
 * caller's right to act for both roles.
 */
static void
follow_owned(Node *stmt)
{
	static const char *const reassign_sql[] = {
		"UPDATE tuvl.workflows SET owner = $2 WHERE owner OPERATOR(pg_catalog.=) $1 RETURNING name",
		"UPDATE tuvl.artifacts SET owner = $2 WHERE owner OPERATOR(pg_catalog.=) $1 RETURNING name",
		"UPDATE tuvl.llms SET owner = $2 WHERE owner OPERATOR(pg_catalog.=) $1 RETURNING name",
		NULL
	};
	static const char *const reassign_what[] = {"workflow", "artifact", "LLM config"};
	static const char revoke_sql[] =
	"DELETE FROM tuvl.secret_grants WHERE grantee OPERATOR(pg_catalog.=) $1";
	static const char revoke_use_sql[] =
	"DELETE FROM tuvl.use_grants WHERE grantee OPERATOR(pg_catalog.=) $1";
	static const Oid types[2] = {REGROLEOID, REGROLEOID};
	List	   *roles;
	List	   *role_ids = NIL;
	Oid			new_owner = InvalidOid;
	ListCell   *lc;
	SecurityFrame frame;

	if (!OidIsValid(get_extension_oid("tuvl", true)))
		return;
	if (IsA(stmt, ReassignOwnedStmt))
	{
		roles = ((ReassignOwnedStmt *) stmt)->roles;
		new_owner = get_rolespec_oid(((ReassignOwnedStmt *) stmt)->newrole, false);
	}
	else
		roles = ((DropOwnedStmt *) stmt)->roles;
	/* as the caller: inside the owner frame CURRENT_USER is the owner */
	foreach(lc, roles)
		role_ids = lappend_oid(role_ids, get_rolespec_oid(lfirst(lc), false));
	SPI_connect();
	SecurityAsOwner(&frame);
	foreach(lc, role_ids)
	{
		Datum		values[2];

		values[0] = ObjectIdGetDatum(lfirst_oid(lc));
		values[1] = ObjectIdGetDatum(new_owner);
		if (OidIsValid(new_owner))
		{
			for (int i = 0; reassign_sql[i]; i++)
				if (SpiExec(reassign_sql[i], 2, types, values, NULL, SPI_OK_UPDATE_RETURNING) > 0)
					check_new_owner(reassign_what[i],
									SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1),
									new_owner);
		}
		else
		{
			SpiExec(revoke_sql, 1, types, values, NULL, SPI_OK_DELETE);
			SpiExec(revoke_use_sql, 1, types, values, NULL, SPI_OK_DELETE);
		}
	}
	SecurityRestore(&frame);
	SPI_finish();
}

/* ---------------------------------------------------------------- locks
 *
 * PostgreSQL's advisory locks are one space that every role can take
 * locks in (pg_advisory_xact_lock): a lock tuvl took there, on a name
 * being registered or a concurrency key being admitted, any session could
 * take first and hold, stalling registrations, starts and the workers.
 * tuvl's own locks are advisory locktags whose fourth field no SQL
 * function sets (pg_advisory_* set 1 and 2): nobody can take them but
 * through tuvl's own calls, which hold them until their transaction ends.
 * The key is hashed into the two 32-bit fields: two keys that collide only
 * wait for each other.
 */
#define TUVL_LOCK_SPACE 0x7475	/* "tu" */

static void
key_locktag(LOCKTAG *tag, const char *space, const char *key)
{
	uint64		h = hash_bytes_extended((const unsigned char *) key, strlen(key),
										hash_bytes((const unsigned char *) space, strlen(space)));

	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (h >> 32), (uint32) h, TUVL_LOCK_SPACE);
}

/* Take tuvl's lock on key (in space: "workflow", "concurrency"...) until the transaction ends. */
void
SecurityLockKey(const char *space, const char *key)
{
	LOCKTAG		tag;

	key_locktag(&tag, space, key);
	(void) LockAcquire(&tag, ExclusiveLock, false, false);
}

/* The same without waiting: false when another transaction holds it. */
bool
SecurityTryLockKey(const char *space, const char *key)
{
	LOCKTAG		tag;

	key_locktag(&tag, space, key);
	return LockAcquire(&tag, ExclusiveLock, false, true) != LOCKACQUIRE_NOT_AVAIL;
}

/* ---------------------------------------------------------------- transfer */

typedef struct NameKind
{
	const char *kind;			/* as tuvl.transfer() takes it */
	const char *what;			/* in messages */
	const char *owner_sql;
	const char *update_sql;
} NameKind;

static const NameKind name_kinds[] = {
	{"workflow", "workflow",
		"SELECT owner FROM tuvl.workflows WHERE name OPERATOR(pg_catalog.=) $1 "
		"  AND version OPERATOR(pg_catalog.=) 1",
	"UPDATE tuvl.workflows SET owner = $2 WHERE name OPERATOR(pg_catalog.=) $1"},
	{"artifact", "artifact",
		"SELECT owner FROM tuvl.artifacts WHERE name OPERATOR(pg_catalog.=) $1 "
		"  AND version OPERATOR(pg_catalog.=) 1",
	"UPDATE tuvl.artifacts SET owner = $2 WHERE name OPERATOR(pg_catalog.=) $1"},
	{"llm", "LLM config",
		"SELECT owner FROM tuvl.llms WHERE name OPERATOR(pg_catalog.=) $1",
	"UPDATE tuvl.llms SET owner = $2 WHERE name OPERATOR(pg_catalog.=) $1"},
	{NULL, NULL, NULL, NULL}
};

/*
 * tuvl's own group roles, through which its privileges are granted: no
 * name may belong to one of them (nor to PUBLIC).  A name owned by
 * tuvl_user would look official to every user, and only a member of
 * tuvl_admin could register versions of it.  Raise when new_owner is one
 * of them; what and name are for the message.
 */
static void
check_new_owner(const char *what, const char *name, Oid new_owner)
{
	static const char *const groups[] = {"tuvl_user", "tuvl_operator", "tuvl_admin"};

	if (!OidIsValid(new_owner))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("cannot hand %s \"%s\" to PUBLIC", what, name),
				 errdetail("A name belongs to one role."),
				 errhint("Name the role that is to register its versions.")));
	for (int i = 0; i < (int) lengthof(groups); i++)
		if (new_owner == get_role_oid(groups[i], true))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("cannot hand %s \"%s\" to role \"%s\"", what, name, groups[i]),
					 errdetail("tuvl_user, tuvl_operator and tuvl_admin are the roles tuvl's privileges are granted through: "
							   "a name one of them owned would look official to every user, and only a member of tuvl_admin could register its versions."),
					 errhint("Hand it to a role of its own (CREATE ROLE ... NOLOGIN), granted to the people who maintain it.")));
}

/*
 * Hand the name of a workflow, artifact or model config (every version of
 * it) to new_owner.  Its owner, members of tuvl_admin and superusers may;
 * to anyone else a name it does not own is refused without saying whose
 * it is.  SPI must be connected.
 */
void
SecurityTransferName(const char *kind, const char *name, Oid new_owner)
{
	const NameKind *k = NULL;
	Oid			owner;
	static const Oid types[2] = {TEXTOID, REGROLEOID};
	Datum		values[2];
	SecurityFrame frame;

	for (int i = 0; name_kinds[i].kind; i++)
		if (strcmp(kind, name_kinds[i].kind) == 0 ||
			(strcmp(kind, "model") == 0 && strcmp(name_kinds[i].kind, "llm") == 0))
			k = &name_kinds[i];
	if (k == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("\"%s\" is not a kind of name tuvl.transfer() hands over", kind),
				 errhint("Use 'workflow', 'artifact' or 'llm'.")));
	check_new_owner(k->what, name, new_owner);
	if (!SearchSysCacheExists1(AUTHOID, ObjectIdGetDatum(new_owner)))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("role with OID %u does not exist", new_owner)));

	/* the same lock registration takes: no version slips in meanwhile */
	SecurityLockKey(k->kind, name);

	owner = SecurityNameOwner(k->owner_sql, name);
	if (!OidIsValid(owner))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("%s \"%s\" does not exist", k->what, name)));
	if (owner != GetUserId() && !SecurityIsAdmin(GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("%s \"%s\" belongs to another role", k->what, name),
				 errhint("Its owner, a member of tuvl_admin or a superuser can hand it over.")));
	/* as ALTER ... OWNER TO: nobody gives a name to a role it cannot act as */
	if (!SecurityIsAdmin(GetUserId()) && !has_privs_of_role(GetUserId(), new_owner))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied to hand %s \"%s\" to role \"%s\"", k->what, name,
						GetUserNameFromId(new_owner, false)),
				 errdetail("Only a member of the new owner's role, of tuvl_admin or a superuser may."),
				 errhint("A name given to another role would look like that role's own.")));
	values[0] = CStringGetTextDatum(name);
	values[1] = ObjectIdGetDatum(new_owner);
	SecurityAsOwner(&frame);
	SpiExec(k->update_sql, 2, types, values, NULL, SPI_OK_UPDATE);
	SecurityRestore(&frame);
}
