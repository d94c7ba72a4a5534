/*-------------------------------------------------------------------------
 *
 * grant_hint.c
 *	  Say which role to grant when a role may not call a tuvl function.
 *
 * PostgreSQL checks EXECUTE before a function runs, so a role that is no
 * member of tuvl_user gets "permission denied for function start_run" and
 * nothing from tuvl.  An ExecutorStart hook catches that error and raises
 * it again, unchanged but for a hint naming the role that holds EXECUTE on
 * that tuvl function (tuvl_user, tuvl_operator or tuvl_admin) and the
 * GRANT to run.  The error names the function without its schema: the
 * hint says tuvl.<name>, and is added only when tuvl has a function of
 * that name, so a role's own function of the same name could get it too.
 *
 * Nothing is looked up while the error is being handled: the names of
 * tuvl's functions, with the role to grant for each, are read before the
 * executor starts, once per backend and again after pg_proc changed (a
 * syscache callback), and kept in TopMemoryContext; so is the calling
 * role's name.  Errors that already carry a hint are left alone.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/parallel.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_proc.h"
#include "executor/executor.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/memutils.h"
#include "utils/syscache.h"

#include "grant_hint.h"

typedef struct TuvlFunction
{
	char	   *name;
	const char *role;			/* the tuvl role holding EXECUTE on it */
} TuvlFunction;

static ExecutorStart_hook_type prev_executor_start = NULL;
static TuvlFunction *functions = NULL;
static int	nfunctions = 0;
static int	functions_size = 0;
static bool functions_valid = false;
static Oid	user_cached = InvalidOid;
static char user_name[NAMEDATALEN * 2 + 3]; /* quoted as an identifier */

/* pg_proc changed: read tuvl's functions again before the next query. */
static void
functions_inval(Datum arg, int cacheid, uint32 hashvalue)
{
	functions_valid = false;
}

/* The lowest of tuvl's roles that may execute funcid, or NULL. */
static const char *
role_to_grant(Oid funcid)
{
	static const char *const roles[] = {"tuvl_user", "tuvl_operator", "tuvl_admin"};

	for (int i = 0; i < (int) lengthof(roles); i++)
	{
		Oid			role = get_role_oid(roles[i], true);

		if (OidIsValid(role) && pg_proc_aclcheck(funcid, role, ACL_EXECUTE) == ACLCHECK_OK)
			return roles[i];
	}
	return NULL;
}

/* Read the names of tuvl's functions and the role to grant for each. */
static void
load_functions(void)
{
	Oid			nsp = get_namespace_oid("tuvl", true);
	MemoryContext old;
	Relation	rel;
	SysScanDesc scan;
	ScanKeyData key;
	HeapTuple	tuple;

	for (int i = 0; i < nfunctions; i++)
		pfree(functions[i].name);
	nfunctions = 0;
	functions_valid = true;
	if (!OidIsValid(nsp))
		return;
	old = MemoryContextSwitchTo(TopMemoryContext);
	if (functions == NULL)
	{
		functions_size = 64;
		functions = palloc(sizeof(TuvlFunction) * functions_size);
	}
	ScanKeyInit(&key, Anum_pg_proc_pronamespace, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(nsp));
	rel = table_open(ProcedureRelationId, AccessShareLock);
	scan = systable_beginscan(rel, InvalidOid, false, NULL, 1, &key);
	while (HeapTupleIsValid(tuple = systable_getnext(scan)))
	{
		Form_pg_proc proc = (Form_pg_proc) GETSTRUCT(tuple);
		const char *role = role_to_grant(proc->oid);

		if (role == NULL)
			continue;
		if (nfunctions == functions_size)
		{
			functions_size *= 2;
			functions = repalloc(functions, sizeof(TuvlFunction) * functions_size);
		}
		functions[nfunctions].name = pstrdup(NameStr(proc->proname));
		functions[nfunctions++].role = role;
	}
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	MemoryContextSwitchTo(old);
}

/*
 * The tuvl function the message names (the longest name in it, since a
 * translated message may put the name anywhere), or NULL.
 */
static const TuvlFunction *
function_named_in(const char *message)
{
	const TuvlFunction *found = NULL;

	for (int i = 0; i < nfunctions; i++)
	{
		const char *p = strstr(message, functions[i].name);
		size_t		len = strlen(functions[i].name);

		if (p && (p[len] == '\0' || p[len] == ' ' || p[len] == '"') &&
			(found == NULL || len > strlen(found->name)))
			found = &functions[i];
	}
	return found;
}

/* Raise edata again, with the hint for f. */
static void
pg_attribute_noreturn()
rethrow_with_hint(ErrorData *edata, const TuvlFunction *f)
{
	edata->hint = psprintf("tuvl.%s() is for members of %s: a superuser, or a role with ADMIN OPTION on %s, runs GRANT %s TO %s.",
						   f->name, f->role, f->role, f->role, user_name);
	ReThrowError(edata);
}

static void
executor_start(QueryDesc *queryDesc, int eflags)
{
	MemoryContext cxt = CurrentMemoryContext;

	/*
	 * tuvl's workers (and other background workers) are not users typing a
	 * call: they skip the hook, which otherwise runs for each of their
	 * statements
	 */
	if (IsParallelWorker() || IsBackgroundWorker || !IsTransactionState())
	{
		if (prev_executor_start)
			prev_executor_start(queryDesc, eflags);
		else
			standard_ExecutorStart(queryDesc, eflags);
		return;
	}
	if (!functions_valid)
		load_functions();
	if (GetUserId() != user_cached)
	{
		char	   *name = GetUserNameFromId(GetUserId(), true);

		strlcpy(user_name, name ? quote_identifier(name) : "", sizeof(user_name));
		user_cached = GetUserId();
	}
	PG_TRY();
	{
		if (prev_executor_start)
			prev_executor_start(queryDesc, eflags);
		else
			standard_ExecutorStart(queryDesc, eflags);
	}
	PG_CATCH();
	{
		ErrorData  *edata;
		const TuvlFunction *f;

		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		if (edata->sqlerrcode != ERRCODE_INSUFFICIENT_PRIVILEGE || edata->hint ||
			edata->message_id == NULL ||
			strcmp(edata->message_id, "permission denied for function %s") != 0 ||
			edata->message == NULL || user_name[0] == '\0' ||
			(f = function_named_in(edata->message)) == NULL)
		{
			FreeErrorData(edata);
			PG_RE_THROW();
		}
		FlushErrorState();
		rethrow_with_hint(edata, f);
	}
	PG_END_TRY();
}

/* Install the hook (once per backend, from _PG_init). */
void
GrantHintInit(void)
{
	CacheRegisterSyscacheCallback(PROCOID, functions_inval, (Datum) 0);
	prev_executor_start = ExecutorStart_hook;
	ExecutorStart_hook = executor_start;
}
