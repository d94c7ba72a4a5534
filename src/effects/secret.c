/*-------------------------------------------------------------------------
 *
 * secret.c
 *	  Secrets: read through templates only, and scrubbed from whatever
 *	  is journaled.
 *
 * Secrets reach requests through templates and nothing else: every value
 * read is remembered (SecretUse) and scrubbed from whatever is journaled
 * or stored in the context, including response bodies that echo it.  A
 * value is read as the extension's owner, and only when the run's
 * principal (and the author of what names it, if another role) holds a
 * grant; an error never tells a missing secret from an ungranted one.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <curl/curl.h>

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/json.h"

#include "effect.h"
#include "jsonutil.h"
#include "secret.h"
#include "security.h"
#include "spiutil.h"

#define REDACTED "[redacted]"

static const char secret_sql[] =
"SELECT s.value, "
"  EXISTS (SELECT 1 FROM tuvl.secret_grants g "
"          WHERE g.secret OPERATOR(pg_catalog.=) s.name "
"            AND pg_catalog.pg_has_role($2::pg_catalog.oid, g.grantee::pg_catalog.oid, 'USAGE')), "
"  EXISTS (SELECT 1 FROM tuvl.secret_grants g "
"          WHERE g.secret OPERATOR(pg_catalog.=) s.name "
"            AND pg_catalog.pg_has_role($3::pg_catalog.oid, g.grantee::pg_catalog.oid, 'USAGE')) "
"FROM tuvl.secrets s WHERE s.name OPERATOR(pg_catalog.=) $1";

/* Does role hold a grant of the secret (the column of secret_sql), or need none? */
static bool
holds_grant(int column, Oid role)
{
	bool		isnull;

	return DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, column,
									  &isnull)) || superuser_arg(role);
}

/*
 * Template hook: read a secret as the extension owner and remember its
 * value, if the run's principal holds a grant for it, and so does the
 * author of what names it when that is another role (superusers need
 * none).  A replay never reads secrets: it sends nothing, so a stand-in
 * does.  Never puts a value in an error; the error does not tell a
 * missing secret from one that was not granted.
 */
static const char *
secret_hook(const char *name, void *arg)
{
	SecretUse  *use = arg;
	static const Oid types[3] = {TEXTOID, OIDOID, OIDOID};
	Datum		values[3];
	SecurityFrame frame;
	char	   *value = NULL;
	bool		granted = false;
	bool		connected = false;

	if (use->run && use->run->replay)
		value = pstrdup("[replay]");
	else
	{
		if (SPI_connect() == SPI_OK_CONNECT)
			connected = true;
		values[0] = CStringGetTextDatum(name);
		values[1] = ObjectIdGetDatum(use->run ? use->run->principal : GetUserId());
		values[2] = OidIsValid(use->author) ? ObjectIdGetDatum(use->author) : values[1];
		SecurityAsOwner(&frame);
		if (SpiExec(secret_sql, 3, types, values, NULL, SPI_OK_SELECT) == 1)
		{
			char	   *v = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);

			granted = holds_grant(2, DatumGetObjectId(values[1])) &&
				holds_grant(3, DatumGetObjectId(values[2]));
			value = v && granted ? SPI_palloc(strlen(v) + 1) : NULL;
			if (value)
				strcpy(value, v);
		}
		SecurityRestore(&frame);
		if (connected)
			SPI_finish();
		if (value == NULL && OidIsValid(use->author))
			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("secret \"%s\"%s%s is not available to role \"%s\"", name,
							use->named_by ? " named by " : "", use->named_by ? use->named_by : "",
							use->run ? use->run->principal_name : GetUserNameFromId(GetUserId(), false)),
					 errdetail("It does not exist, or it has not been granted both to the role that started the run and to role \"%s\", which registered %s.",
							   GetUserNameFromId(use->author, false), use->named_by ? use->named_by : "it"),
					 errhint("A member of tuvl_admin stores it with tuvl.set_secret() and grants it with tuvl.grant_secret().")));
		if (value == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("secret \"%s\"%s%s is not available to role \"%s\"", name,
							use->named_by ? " named by " : "", use->named_by ? use->named_by : "",
							use->run ? use->run->principal_name : GetUserNameFromId(GetUserId(), false)),
					 errdetail("It does not exist, or it has not been granted to the role that started the run."),
					 errhint("A member of tuvl_admin stores it with tuvl.set_secret() and grants it with tuvl.grant_secret().")));
	}
	use->values = lappend(use->values, value);
	return value;
}

/* Start collecting the secrets run reads (run may be NULL outside a run). */
void
SecretUseInit(SecretUse *use, RunState *run)
{
	memset(use, 0, sizeof(SecretUse));
	use->opts.secret_hook = secret_hook;
	use->opts.secret_arg = use;
	use->run = run;
}

/*
 * text with every secret value replaced: raw, JSON-escaped and
 * percent-encoded (as in a URL's query).
 */
char *
SecretScrub(const char *text, List *secrets)
{
	ListCell   *lc;
	char	   *out = (char *) text;

	foreach(lc, secrets)
	{
		const char *s = lfirst(lc);
		StringInfoData esc;
		char	   *pct;

		if (s == NULL || *s == '\0')
			continue;
		out = TextReplaceAll(out, s, REDACTED);
		pct = curl_easy_escape(NULL, s, 0);
		if (pct)
		{
			if (strcmp(pct, s) != 0)
				out = TextReplaceAll(out, pct, REDACTED);
			curl_free(pct);
		}
		initStringInfo(&esc);
		escape_json(&esc, s);
		/* strip the quotes escape_json adds */
		esc.data[esc.len - 1] = '\0';
		if (strcmp(esc.data + 1, s) != 0)
			out = TextReplaceAll(out, esc.data + 1, REDACTED);
	}
	return out;
}

/* j with every secret value replaced (SecretScrub). */
Jsonb *
SecretScrubJsonb(Jsonb *j, List *secrets)
{
	char	   *text;
	char	   *scrubbed;

	if (j == NULL || secrets == NIL)
		return j;
	text = JsonbToCString(NULL, &j->root, VARSIZE(j));
	scrubbed = SecretScrub(text, secrets);
	return scrubbed == text ? j : JsonFromCString(scrubbed);
}
