/*-------------------------------------------------------------------------
 *
 * uses.c
 *	  What a workflow or an artifact may use by name.
 *
 * Names are global: a workflow names a model config, a child workflow or
 * an artifact that any role could have registered.  On 0.2.0 a name could
 * be dangling at registration, so another role could register it later
 * and have the victim's runs send it their prompts and keys, or run its
 * steps as the victim.  The rules, from registration to every use:
 *
 * - At registration every name must resolve (validate.c), to an object of
 *   the registering role or of a role that granted its use to it
 *   (tuvl.grant_use, to the role or to a role it belongs to).  The role
 *   whose content it is then gets pinned: the workflow version keeps
 *   {"<kind>:<name>": owner} (tuvl.workflows.refs).
 * - When a run uses the object, the content it uses must still be that
 *   role's (a transfer and a new version by the new owner is refused), and
 *   the grant must still stand (tuvl.revoke_use takes effect for the next
 *   use).  "Whose content": a model config version's registered_by, an
 *   artifact or workflow version's owner.
 * - A guardrail artifact that names a judge model is held to the same
 *   rules with its own owner as the user, without pins.
 * - Workflow versions registered before 0.3.0 have no pins: they may also
 *   use objects of superusers and of tuvl_admin members, which was the
 *   way shared model configs were set up; an ordinary role's object needs
 *   a grant as for any other version.
 *
 * All functions need SPI connected; lookups run as the extension owner.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"

#include "jsonutil.h"
#include "security.h"
#include "spiutil.h"
#include "suggest.h"
#include "uses.h"
#include "tokens.h"

PG_FUNCTION_INFO_V1(tuvl_grant_use);
PG_FUNCTION_INFO_V1(tuvl_revoke_use);

static const char *const kind_names[] = {"workflow", "llm", "artifact"};
static const char *const kind_whats[] = {"workflow", "model config", "artifact"};

const char *
UseKindName(UseKind kind)
{
	return kind_names[kind];
}

/* The kind as messages name it: "model config" for llm. */
const char *
UseKindWhat(UseKind kind)
{
	return kind_whats[kind];
}

/* grant_use()'s kind: workflow, llm (or model) or artifact. */
bool
UseKindFromName(const char *name, UseKind *kind)
{
	for (int i = 0; i < (int) lengthof(kind_names); i++)
		if (strcmp(name, kind_names[i]) == 0)
		{
			*kind = (UseKind) i;
			return true;
		}
	if (strcmp(name, "model") == 0)
	{
		*kind = USE_LLM;
		return true;
	}
	return false;
}

/*
 * The key of a pin in tuvl.workflows.refs: "llm:default".  An artifact
 * named at a version has a pin of its own: "artifact:tone@2".
 */
char *
UsePinKey(UseKind kind, const char *name, int version)
{
	if (kind == USE_ARTIFACT && version > 0)
		return psprintf("%s:%s@%d", kind_names[kind], name, version);
	return psprintf("%s:%s", kind_names[kind], name);
}

/* Whose content each version is; $2 = 0 means the newest. */
static const char *const content_owner_sql[] = {
	"SELECT owner::pg_catalog.oid FROM tuvl.workflows WHERE name OPERATOR(pg_catalog.=) $1 "
	"  AND ($2 OPERATOR(pg_catalog.=) 0 OR version OPERATOR(pg_catalog.=) $2) "
	"ORDER BY version DESC LIMIT 1",
	"SELECT registered_by::pg_catalog.oid FROM tuvl.llm_versions WHERE name OPERATOR(pg_catalog.=) $1 "
	"  AND ($2 OPERATOR(pg_catalog.=) 0 OR version OPERATOR(pg_catalog.=) $2) "
	"ORDER BY version DESC LIMIT 1",
	"SELECT owner::pg_catalog.oid FROM tuvl.artifacts WHERE name OPERATOR(pg_catalog.=) $1 "
	"  AND ($2 OPERATOR(pg_catalog.=) 0 OR version OPERATOR(pg_catalog.=) $2) "
	"ORDER BY version DESC LIMIT 1"
};

/*
 * The role whose content version `version` (0: the newest) of the object
 * is: for a model config, the role that registered that version; for a
 * workflow or an artifact, the owner of that version.  InvalidOid when
 * there is no such object or version.
 */
Oid
UseContentOwner(UseKind kind, const char *name, int version)
{
	static const Oid types[2] = {TEXTOID, INT4OID};
	Datum		d;

	if (SecurityExecArgs(content_owner_sql[kind], SPI_OK_SELECT, 2, types,
						 CStringGetTextDatum(name), Int32GetDatum(version)) == 1 &&
		SpiValue(1, &d))
		return DatumGetObjectId(d);
	return InvalidOid;
}

/* The names of each kind, as the caller reads them (suggest.c). */
static const char *const names_sql[] = {
	"SELECT DISTINCT w.name FROM tuvl.workflows w LIMIT 10000",
	"SELECT l.name FROM tuvl.llms l LIMIT 10000",
	"SELECT DISTINCT a.name FROM tuvl.artifacts a LIMIT 10000"
};
static const char *const tables[] = {"workflows", "llms", "artifacts"};

/*
 * The name of that kind closest to name, for a "did you mean", among the
 * names the calling role can read itself; NULL when none is close.  SPI
 * must be connected.
 */
const char *
UseSuggest(UseKind kind, const char *name)
{
	return SuggestFromTable(name, tables[kind], names_sql[kind]);
}

static const char grant_exists_sql[] =
"SELECT EXISTS (SELECT 1 FROM tuvl.use_grants g "
"               WHERE g.kind OPERATOR(pg_catalog.=) $1 AND g.name OPERATOR(pg_catalog.=) $2 "
"                 AND pg_catalog.pg_has_role($3::pg_catalog.oid, g.grantee::pg_catalog.oid, 'USAGE'))";

/*
 * May role user use the object whose content is owner's: its own, or
 * granted (to user or a role user belongs to)?
 */
bool
UseAllowed(UseKind kind, const char *name, Oid owner, Oid user)
{
	static const Oid types[3] = {TEXTOID, TEXTOID, OIDOID};
	Datum		d;

	if (owner == user)
		return true;
	return SecurityExecArgs(grant_exists_sql, SPI_OK_SELECT, 3, types,
							CStringGetTextDatum(kind_names[kind]), CStringGetTextDatum(name),
							ObjectIdGetDatum(user)) == 1 &&
		SpiValue(1, &d) && DatumGetBool(d);
}

static char *
role_name(Oid role)
{
	char	   *name = GetUserNameFromId(role, true);

	return name ? name : psprintf("%u", role);
}

/*
 * Raise unless by may use the object (kind, name) whose content, as the
 * run uses it, is owner's: the content must be that of the role pinned at
 * registration, and the use allowed now.  version: as the referrer names
 * it (0: floating, or a kind without versions).
 */
void
UseCheck(const UseReferrer *by, UseKind kind, const char *name, int version, Oid owner)
{
	if (by->pins)
	{
		char	   *key = UsePinKey(kind, name, version);
		JsonbValue *pin = JsonGetField(by->pins, key);
		Oid			pinned = pin ? (Oid) JsonGetInt(by->pins, key, 0) : InvalidOid;

		if (!OidIsValid(pinned))
			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("%s names %s \"%s\", which was not resolved when it was registered",
							by->what, kind_whats[kind], name),
					 errhint("Register the workflow again.")));
		if (pinned != owner)
			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("%s \"%s\" is now the work of role \"%s\", not of role \"%s\" as when %s was registered",
							kind_whats[kind], name, role_name(owner), role_name(pinned), by->what),
					 errdetail("It was handed to another role, which changed it."),
					 errhint("Check the new version, then register the workflow again to use it.")));
	}
	if (UseAllowed(kind, name, owner, by->owner))
		return;

	/*
	 * versions from before 0.3.0 (no pins) still trust the administrators'
	 * objects
	 */
	if (by->unpinned && SecurityIsAdmin(owner))
		return;
	ereport(ERROR,
			(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
			 errmsg("%s may not use %s \"%s\" of role \"%s\"", by->what, kind_whats[kind], name,
					role_name(owner)),
			 errdetail("Role \"%s\" has not granted its use to role \"%s\".", role_name(owner),
					   role_name(by->owner)),
			 errhint("Its owner can: SELECT tuvl.grant_use('%s', '%s', '%s');", kind_names[kind],
					 name, role_name(by->owner))));
}

/* ---------------------------------------------------------------- SQL */

/* The object's owner now (the name's, not a version's); raises when there is none. */
static Oid
name_owner(UseKind kind, const char *name)
{
	static const char *const owner_sql[] = {
		"SELECT owner FROM tuvl.workflows WHERE name OPERATOR(pg_catalog.=) $1 "
		"  AND version OPERATOR(pg_catalog.=) 1",
		"SELECT owner FROM tuvl.llms WHERE name OPERATOR(pg_catalog.=) $1",
		"SELECT owner FROM tuvl.artifacts WHERE name OPERATOR(pg_catalog.=) $1 "
		"  AND version OPERATOR(pg_catalog.=) 1"
	};
	Oid			owner = SecurityNameOwner(owner_sql[kind], name);

	if (!OidIsValid(owner))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("%s \"%s\" does not exist", kind_whats[kind], name)));
	return owner;
}

/*
 * grant_use()'s and revoke_use()'s start: the token's scope, SPI connected
 * (the owner's lookup needs it), the arguments checked.
 */
static void
use_begin(FunctionCallInfo fcinfo, UseKind *kind, char **name, Oid *role)
{
	char	   *k;

	TokenRequireScope("workflows:write");
	SPI_connect();
	if (PG_ARGISNULL(0) || PG_ARGISNULL(1) || PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("kind, name and role must not be null")));
	k = text_to_cstring(PG_GETARG_TEXT_PP(0));
	if (!UseKindFromName(k, kind))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("\"%s\" is not a kind of object whose use can be granted", k),
				 errhint("Use 'workflow', 'llm' or 'artifact'.")));
	*name = text_to_cstring(PG_GETARG_TEXT_PP(1));
	*role = PG_GETARG_OID(2);
	if (!OidIsValid(*role) || GetUserNameFromId(*role, true) == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("role with OID %u does not exist", *role)));
	if (name_owner(*kind, *name) != GetUserId() && !SecurityIsAdmin(GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("%s \"%s\" belongs to another role", kind_whats[*kind], *name),
				 errhint("Its owner, a member of tuvl_admin or a superuser can grant or revoke its use.")));
}

/*
 * grant_use(kind, name, role): let role's workflows (and its members')
 * use the object by name.  Its owner, tuvl_admin or a superuser may.
 */
Datum
tuvl_grant_use(PG_FUNCTION_ARGS)
{
	static const Oid types[4] = {TEXTOID, TEXTOID, OIDOID, OIDOID};
	UseKind		kind;
	char	   *name;
	Oid			role;

	use_begin(fcinfo, &kind, &name, &role);
	SecurityExecArgs("INSERT INTO tuvl.use_grants (kind, name, grantee, granted_by) "
					 "VALUES ($1, $2, $3::pg_catalog.oid::pg_catalog.regrole, $4::pg_catalog.oid::pg_catalog.regrole) "
					 "ON CONFLICT (kind, name, grantee) DO NOTHING",
					 SPI_OK_INSERT, 4, types, CStringGetTextDatum(kind_names[kind]),
					 CStringGetTextDatum(name), ObjectIdGetDatum(role), ObjectIdGetDatum(GetUserId()));
	SPI_finish();
	PG_RETURN_VOID();
}

/* revoke_use(kind, name, role): the next use by role's runs is refused. */
Datum
tuvl_revoke_use(PG_FUNCTION_ARGS)
{
	static const Oid types[3] = {TEXTOID, TEXTOID, OIDOID};
	UseKind		kind;
	char	   *name;
	Oid			role;

	use_begin(fcinfo, &kind, &name, &role);
	SecurityExecArgs("DELETE FROM tuvl.use_grants WHERE kind OPERATOR(pg_catalog.=) $1 "
					 "  AND name OPERATOR(pg_catalog.=) $2 "
					 "  AND grantee::pg_catalog.oid OPERATOR(pg_catalog.=) $3",
					 SPI_OK_DELETE, 3, types, CStringGetTextDatum(kind_names[kind]),
					 CStringGetTextDatum(name), ObjectIdGetDatum(role));
	SPI_finish();
	PG_RETURN_VOID();
}
