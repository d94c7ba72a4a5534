/*-------------------------------------------------------------------------
 *
 * tokens.c
 *	  API tokens and the scopes they allow, for the HTTP front door.
 *
 * A token stands for a role, with scopes (runs:start, runs:read,
 * runs:control, people:answer, workflows:write, admin) and an expiry.  Its
 * text, "tuvl_<id>_<secret>", is shown once by tuvl.create_token(); the
 * table keeps only the SHA-256 of the secret.  A server (insight/) calls
 * tuvl.authenticate(token) first in each request's transaction: it checks
 * the token (in constant time), returns its role, which the server then
 * takes with SET LOCAL ROLE, and records the token's scopes for the rest
 * of the transaction.  The functions of the SQL API check those scopes
 * themselves (TokenRequireScope), and so do the row security policies of
 * tuvl.runs (tuvl._has_scope): a token without runs:control cannot pause
 * a run, whatever the server does.  A transaction that never called
 * authenticate() is not limited by scopes: the privileges of its role
 * apply, as always.
 *
 * State: the scopes of the current transaction, in backend memory, valid
 * while MyProc->lxid is the one authenticate() ran in.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "common/base64.h"
#include "common/cryptohash.h"
#include "common/hmac.h"
#include "common/sha2.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "storage/proc.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "security.h"
#include "spiutil.h"
#include "tokens.h"

PG_FUNCTION_INFO_V1(tuvl_create_token);
PG_FUNCTION_INFO_V1(tuvl_revoke_token);
PG_FUNCTION_INFO_V1(tuvl_authenticate);
PG_FUNCTION_INFO_V1(tuvl_has_scope);

static const char *const scope_names[] = {
	"runs:start", "runs:read", "runs:control", "people:answer", "workflows:write", "admin", NULL
};

#define SCOPE_ADMIN (1 << 5)

/* The current transaction's token, if any. */
static bool authenticated = false;
static LocalTransactionId authenticated_in = InvalidLocalTransactionId;
static int	granted_scopes = 0;

#define SECRET_BYTES 32

/* The bit of a scope's name; 0 when there is no such scope. */
static int
scope_bit(const char *name)
{
	for (int i = 0; scope_names[i]; i++)
		if (strcmp(scope_names[i], name) == 0)
			return 1 << i;
	return 0;
}

static bool
in_token_transaction(void)
{
	return authenticated && MyProc && authenticated_in == MyProc->lxid;
}

/* Does the transaction's token (if any) allow scope?  admin allows all. */
bool
TokenHasScope(const char *scope)
{
	if (!in_token_transaction())
		return true;
	return (granted_scopes & (scope_bit(scope) | SCOPE_ADMIN)) != 0;
}

/* Raise unless the transaction's token (if any) allows scope. */
void
TokenRequireScope(const char *scope)
{
	if (!TokenHasScope(scope))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("the token of this request does not have scope %s", scope),
				 errhint("Create a token with that scope: tuvl.create_token(role, ARRAY['%s']).", scope)));
}

/* SHA-256 of len bytes of data, into out (PG_SHA256_DIGEST_LENGTH bytes). */
static void
sha256(const uint8 *data, size_t len, uint8 *out)
{
	pg_cryptohash_ctx *ctx = pg_cryptohash_create(PG_SHA256);

	if (ctx == NULL || pg_cryptohash_init(ctx) < 0 || pg_cryptohash_update(ctx, data, len) < 0 ||
		pg_cryptohash_final(ctx, out, PG_SHA256_DIGEST_LENGTH) < 0)
		elog(ERROR, "could not compute a SHA-256 digest: %s", pg_cryptohash_error(ctx));
	pg_cryptohash_free(ctx);
}

/* Are a and b (len bytes each) equal?  Takes the same time whatever they hold. */
static bool
equal_in_constant_time(const uint8 *a, const uint8 *b, size_t len)
{
	uint8		diff = 0;

	for (size_t i = 0; i < len; i++)
		diff |= a[i] ^ b[i];
	return diff == 0;
}

/* base64url without padding, of len bytes. */
static char *
base64url(const uint8 *data, int len)
{
	int			n = pg_b64_enc_len(len);
	char	   *out = palloc(n + 1);

	n = pg_b64_encode((const char *) data, len, out, n);
	if (n < 0)
		elog(ERROR, "could not encode a token");
	while (n > 0 && out[n - 1] == '=')
		n--;
	out[n] = '\0';
	for (char *c = out; *c; c++)
		*c = *c == '+' ? '-' : *c == '/' ? '_' : *c;
	return out;
}

/* The scopes of an array, checked: a text[] of known names, at least one. */
static Datum
checked_scopes(ArrayType *scopes)
{
	Datum	   *items;
	bool	   *nulls;
	int			n;

	deconstruct_array(scopes, TEXTOID, -1, false, TYPALIGN_INT, &items, &nulls, &n);
	if (n == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a token needs at least one scope"),
				 errhint("Scopes are runs:start, runs:read, runs:control, people:answer, workflows:write and admin.")));
	for (int i = 0; i < n; i++)
	{
		char	   *s = nulls[i] ? NULL : TextDatumGetCString(items[i]);

		if (s == NULL || scope_bit(s) == 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("\"%s\" is not a scope", s ? s : "NULL"),
					 errhint("Scopes are runs:start, runs:read, runs:control, people:answer, workflows:write and admin.")));
	}
	return PointerGetDatum(scopes);
}

/*
 * create_token(role, scopes, expires): a new token for role, shown once.
 * A member of role (who can act as it anyway) or of tuvl_admin may create
 * one; a request authenticated by a token needs its admin scope.
 */
Datum
tuvl_create_token(PG_FUNCTION_ARGS)
{
	static const Oid types[5] = {OIDOID, TEXTARRAYOID, BYTEAOID, OIDOID, INTERVALOID};
	Oid			role;
	uint8		secret[SECRET_BYTES];
	uint8		digest[PG_SHA256_DIGEST_LENGTH];
	bytea	   *hash;
	Datum		values[5];
	char		nulls[5] = {' ', ' ', ' ', ' ', ' '};
	char	   *secret_text;
	int64		id;
	Datum		d;

	if (PG_ARGISNULL(0) || PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("role and scopes must not be null")));
	TokenRequireScope("admin");
	role = PG_GETARG_OID(0);
	if (GetUserNameFromId(role, true) == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("role with OID %u does not exist", role)));
	if (!is_member_of_role(GetUserId(), role) && !SecurityIsAdmin(GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied to create a token for role \"%s\"", GetUserNameFromId(role, false)),
				 errhint("A member of the role, or of tuvl_admin, may create its tokens.")));
	if (superuser_arg(role))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("a token cannot stand for superuser \"%s\"", GetUserNameFromId(role, false)),
				 errhint("Create tokens for roles that hold only what the token's callers need.")));
	if (!pg_strong_random(secret, sizeof(secret)))
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not generate a random token")));
	sha256(secret, sizeof(secret), digest);
	hash = palloc(VARHDRSZ + sizeof(digest));
	SET_VARSIZE(hash, VARHDRSZ + sizeof(digest));
	memcpy(VARDATA(hash), digest, sizeof(digest));

	values[0] = ObjectIdGetDatum(role);
	values[1] = checked_scopes(PG_GETARG_ARRAYTYPE_P(1));
	values[2] = PointerGetDatum(hash);
	values[3] = ObjectIdGetDatum(GetUserId());
	values[4] = PG_ARGISNULL(2) ? (Datum) 0 : PG_GETARG_DATUM(2);
	nulls[4] = PG_ARGISNULL(2) ? 'n' : ' ';
	SPI_connect();
	if (SecurityExec("INSERT INTO tuvl.token_store (role, scopes, secret_hash, created_by, expires_at) "
					 "VALUES ($1::pg_catalog.oid::pg_catalog.regrole, $2, $3, "
					 "        $4::pg_catalog.oid::pg_catalog.regrole, pg_catalog.now() OPERATOR(pg_catalog.+) $5) "
					 "RETURNING id", 5, types, values, nulls, SPI_OK_INSERT_RETURNING) != 1 ||
		!SpiValue(1, &d))
		elog(ERROR, "could not store a token");
	id = DatumGetInt64(d);
	SPI_finish();
	secret_text = base64url(secret, sizeof(secret));
	explicit_bzero(secret, sizeof(secret));
	PG_RETURN_TEXT_P(cstring_to_text(psprintf("tuvl_" INT64_FORMAT "_%s", id, secret_text)));
}

/* revoke_token(id): the token authenticates nothing from now on. */
Datum
tuvl_revoke_token(PG_FUNCTION_ARGS)
{
	static const Oid types[1] = {INT8OID};
	Datum		d;
	Oid			role;

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("the token id must not be null")));
	TokenRequireScope("admin");
	SPI_connect();
	if (SecurityExecArgs("SELECT role::pg_catalog.oid FROM tuvl.token_store WHERE id OPERATOR(pg_catalog.=) $1",
						 SPI_OK_SELECT, 1, types, PG_GETARG_DATUM(0)) != 1 || !SpiValue(1, &d))
		role = InvalidOid;
	else
		role = DatumGetObjectId(d);
	/* another role's token is answered as one that does not exist */
	if (!OidIsValid(role) ||
		(!is_member_of_role(GetUserId(), role) && !SecurityIsAdmin(GetUserId())))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("token " INT64_FORMAT " does not exist", PG_GETARG_INT64(0))));
	SecurityExecArgs("UPDATE tuvl.token_store SET revoked_at = pg_catalog.now() "
					 "WHERE id OPERATOR(pg_catalog.=) $1 AND revoked_at IS NULL",
					 SPI_OK_UPDATE, 1, types, PG_GETARG_DATUM(0));
	SPI_finish();
	PG_RETURN_VOID();
}

/* The failure of authenticate(): the same, whatever failed. */
pg_attribute_noreturn()
static void
bad_token(void)
{
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_AUTHORIZATION_SPECIFICATION),
			 errmsg("invalid token"),
			 errdetail("The token is malformed, unknown, revoked or expired."),
			 errhint("Create a new one with tuvl.create_token().")));
}

/* Decode base64url text into out (at most outlen bytes); -1 when it is not. */
static int
decode_secret(const char *text, uint8 *out, int outlen)
{
	int			len = strlen(text);
	char	   *b64 = palloc(len + 4);
	int			n;

	for (int i = 0; i < len; i++)
	{
		char		c = text[i];

		if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
			  c == '-' || c == '_'))
			return -1;
		b64[i] = c == '-' ? '+' : c == '_' ? '/' : c;
	}
	while (len % 4 != 0)
		b64[len++] = '=';
	if (pg_b64_dec_len(len) > outlen + 3)
		return -1;
	n = pg_b64_decode(b64, len, (char *) out, outlen);
	return n;
}

/*
 * authenticate(token): the role the token stands for, its scopes recorded
 * for the rest of this transaction.  Raises invalid_authorization_
 * specification (28000) for any token that is not valid now, saying
 * nothing of why.
 */
Datum
tuvl_authenticate(PG_FUNCTION_ARGS)
{
	static const Oid types[1] = {INT8OID};
	char	   *token;
	char	   *p;
	char	   *end;
	int64		id;
	uint8		secret[SECRET_BYTES + 3];
	uint8		digest[PG_SHA256_DIGEST_LENGTH];
	int			n;
	bool		ok;
	Oid			role;
	int			scopes = 0;

	if (in_token_transaction())
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_TRANSACTION_STATE),
				 errmsg("this transaction is authenticated already"),
				 errhint("Authenticate once per transaction, first.")));
	if (PG_ARGISNULL(0))
		bad_token();
	token = text_to_cstring(PG_GETARG_TEXT_PP(0));
	if (strncmp(token, "tuvl_", 5) != 0)
		bad_token();
	/* one spelling per token: digits without sign, space or leading 0 */
	if (token[5] < '1' || token[5] > '9')
		bad_token();
	errno = 0;
	id = strtoll(token + 5, &end, 10);
	if (errno != 0 || end == token + 5 || *end != '_' || id <= 0)
		bad_token();
	p = end + 1;
	n = decode_secret(p, secret, sizeof(secret));
	/* and the secret as create_token() spells it (no stray low bits) */
	if (n != SECRET_BYTES || strcmp(base64url(secret, SECRET_BYTES), p) != 0)
	{
		explicit_bzero(secret, sizeof(secret));
		bad_token();
	}
	sha256(secret, SECRET_BYTES, digest);
	explicit_bzero(secret, sizeof(secret));

	SPI_connect();
	ok = SecurityExecArgs("SELECT secret_hash, role::pg_catalog.oid, scopes FROM tuvl.token_store "
						  "WHERE id OPERATOR(pg_catalog.=) $1 AND revoked_at IS NULL "
						  "  AND (expires_at IS NULL OR expires_at OPERATOR(pg_catalog.>) pg_catalog.now())",
						  SPI_OK_SELECT, 1, types, Int64GetDatum(id)) == 1;
	if (ok)
	{
		bool		isnull;
		bytea	   *hash = DatumGetByteaPP(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
		ArrayType  *arr = DatumGetArrayTypeP(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 3, &isnull));
		Datum	   *items;
		bool	   *nulls;
		int			nitems;

		ok = VARSIZE_ANY_EXHDR(hash) == PG_SHA256_DIGEST_LENGTH &&
			equal_in_constant_time((uint8 *) VARDATA_ANY(hash), digest, PG_SHA256_DIGEST_LENGTH);
		role = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
		deconstruct_array(arr, TEXTOID, -1, false, TYPALIGN_INT, &items, &nulls, &nitems);
		for (int i = 0; i < nitems; i++)
			if (!nulls[i])
				scopes |= scope_bit(TextDatumGetCString(items[i]));
	}
	if (!ok)
	{
		SPI_finish();
		bad_token();
	}
	/* when it was last used, to the minute: not one write per request */
	SecurityExecArgs("UPDATE tuvl.token_store SET last_used_at = pg_catalog.now() "
					 "WHERE id OPERATOR(pg_catalog.=) $1 AND (last_used_at IS NULL "
					 "  OR last_used_at OPERATOR(pg_catalog.<) (pg_catalog.now() OPERATOR(pg_catalog.-) '1 minute'::pg_catalog.interval))",
					 SPI_OK_UPDATE, 1, types, Int64GetDatum(id));
	SPI_finish();
	authenticated = true;
	authenticated_in = MyProc->lxid;
	granted_scopes = scopes;
	PG_RETURN_OID(role);
}

/* _has_scope(scope): for row security policies (see TokenHasScope). */
Datum
tuvl_has_scope(PG_FUNCTION_ARGS)
{
	PG_RETURN_BOOL(TokenHasScope(text_to_cstring(PG_GETARG_TEXT_PP(0))));
}

/* _require_scope(scope): for the SQL functions of the API written in SQL. */
PG_FUNCTION_INFO_V1(tuvl_require_scope);

Datum
tuvl_require_scope(PG_FUNCTION_ARGS)
{
	TokenRequireScope(text_to_cstring(PG_GETARG_TEXT_PP(0)));
	PG_RETURN_VOID();
}

/* ---------------------------------------------------------------- hooks
 *
 * A workflow with trigger.http is served under /hooks<path>.  A caller
 * authenticates with a token (runs:start), or, for a webhook that cannot
 * send one, with trigger.http.signature: an HMAC-SHA256 of the request's
 * body under a secret, in a header.  tuvl.verify_hook() checks such a
 * signature (in constant time) and, when it holds, authenticates the
 * transaction as the workflow's owner with scope runs:start only: the
 * server then takes that role and starts the run.  The owner must hold
 * the secret's grant.
 */
PG_FUNCTION_INFO_V1(tuvl_verify_hook);

/* The value of hex digits; -1 when text is not len/2 bytes of hex. */
static int
decode_hex(const char *text, uint8 *out, int outlen)
{
	int			len = strlen(text);

	if (len != outlen * 2)
		return -1;
	for (int i = 0; i < outlen; i++)
	{
		int			v = 0;

		for (int k = 0; k < 2; k++)
		{
			char		c = pg_tolower((unsigned char) text[2 * i + k]);

			v <<= 4;
			if (c >= '0' && c <= '9')
				v |= c - '0';
			else if (c >= 'a' && c <= 'f')
				v |= c - 'a' + 10;
			else
				return -1;
		}
		out[i] = (uint8) v;
	}
	return outlen;
}

/* The failure of verify_hook(): the same, whatever failed. */
static void
bad_signature(void)
{
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_AUTHORIZATION_SPECIFICATION),
			 errmsg("invalid signature"),
			 errdetail("The request's signature does not match its body, or the route takes none."),
			 errhint("Sign the body with HMAC-SHA256 under the workflow's secret and send it as hex, or as sha256=<hex>.")));
}

/*
 * verify_hook(path, body, signature): the owner of the workflow served at
 * path when signature is the HMAC-SHA256 of body under the secret its
 * trigger.http.signature names; the transaction is then authenticated as
 * that role, with scope runs:start.
 */
Datum
tuvl_verify_hook(PG_FUNCTION_ARGS)
{
	static const Oid types[1] = {TEXTOID};
	char	   *sig;
	text	   *body;
	uint8		given[PG_SHA256_DIGEST_LENGTH];
	uint8		mac[PG_SHA256_DIGEST_LENGTH];
	char	   *secret = NULL;
	bool		granted = false;
	Oid			owner = InvalidOid;
	pg_hmac_ctx *ctx;

	if (in_token_transaction())
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_TRANSACTION_STATE),
				 errmsg("this transaction is authenticated already")));
	if (PG_ARGISNULL(0) || PG_ARGISNULL(1) || PG_ARGISNULL(2))
		bad_signature();
	body = PG_GETARG_TEXT_PP(1);
	sig = text_to_cstring(PG_GETARG_TEXT_PP(2));
	if (strncmp(sig, "sha256=", 7) == 0)
		sig += 7;
	if (decode_hex(sig, given, sizeof(given)) < 0)
		bad_signature();

	SPI_connect();
	if (SecurityExecArgs("SELECT s.value, w.owner::pg_catalog.oid, "
						 "  EXISTS (SELECT 1 FROM tuvl.secret_grants g "
						 "             WHERE g.secret OPERATOR(pg_catalog.=) s.name "
						 "               AND pg_catalog.pg_has_role(w.owner::pg_catalog.oid, g.grantee::pg_catalog.oid, 'USAGE')) "
						 "FROM tuvl.workflows w JOIN tuvl.secrets s "
						 "  ON s.name OPERATOR(pg_catalog.=) (w.definition OPERATOR(pg_catalog.#>>) '{trigger,http,signature,secret}') "
						 "WHERE w.definition OPERATOR(pg_catalog.#>>) '{trigger,http,path}' OPERATOR(pg_catalog.=) $1 "
						 "  AND w.version OPERATOR(pg_catalog.=) (SELECT pg_catalog.max(x.version) FROM tuvl.workflows x "
						 "                                        WHERE x.name OPERATOR(pg_catalog.=) w.name)",
						 SPI_OK_SELECT, 1, types, PG_GETARG_DATUM(0)) == 1)
	{
		bool		isnull;

		secret = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
		owner = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
		/* the owner's grant (a superuser owner needs none) */
		granted = superuser_arg(owner) ||
			DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 3, &isnull));
	}
	if (secret == NULL || !granted)
	{
		SPI_finish();
		bad_signature();
	}
	ctx = pg_hmac_create(PG_SHA256);
	if (ctx == NULL || pg_hmac_init(ctx, (uint8 *) secret, strlen(secret)) < 0 ||
		pg_hmac_update(ctx, (uint8 *) VARDATA_ANY(body), VARSIZE_ANY_EXHDR(body)) < 0 ||
		pg_hmac_final(ctx, mac, sizeof(mac)) < 0)
		elog(ERROR, "could not compute an HMAC: %s", pg_hmac_error(ctx));
	pg_hmac_free(ctx);
	explicit_bzero(secret, strlen(secret));
	SPI_finish();
	if (!equal_in_constant_time(mac, given, sizeof(mac)))
		bad_signature();
	authenticated = true;
	authenticated_in = MyProc->lxid;
	granted_scopes = scope_bit("runs:start");
	PG_RETURN_OID(owner);
}
