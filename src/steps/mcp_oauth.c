/*-------------------------------------------------------------------------
 *
 * mcp_oauth.c
 *	  OAuth 2.1 for MCP servers: the authorization profile of the MCP
 *	  specification, as a client without a browser can follow it.
 *
 * tuvl.mcp_connect(url, auth) discovers what protects a server: an
 * unauthenticated request's WWW-Authenticate (its resource_metadata and
 * scope), the protected-resource metadata (RFC 9728: the URL named there,
 * else the path-based and then the root well-known location), and the
 * authorization server's metadata (RFC 8414 and OpenID discovery, path
 * inserted before or appended after the well-known suffix; a server
 * without protected-resource metadata is its own authorization server,
 * with the endpoints /authorize, /token and /register when it publishes
 * no metadata either, as 2025-03-26 had it).  It picks the client (a
 * pre-registered client_id, a client-ID metadata document URL where the
 * server takes one, else dynamic client registration), the scopes (the
 * step's, else WWW-Authenticate's, else the resource's scopes_supported;
 * offline_access too where the authorization server offers it), makes a
 * PKCE verifier and a state, keeps them in tuvl.mcp_oauth_pending and
 * returns the URL a person opens.  tuvl.mcp_connect_finish(callback_url)
 * takes the code the authorization server sent back, exchanges it (with
 * the resource indicator of RFC 8707 and the client authentication the
 * server asks for: client_secret_basic, client_secret_post or none) and
 * stores the tokens as secrets granted to the calling role.
 *
 * Both run in the caller's backend and make their requests themselves
 * (through tuvl's HTTP client and its allow-list), like
 * tuvl.mcp_list_tools(); nothing they receive is journaled.  An MCP step
 * with mcp.auth finds the token of its URL that its principal holds a
 * grant for and sends it as a bearer token, rendered as a secret (so it is
 * redacted from whatever is journaled).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <curl/curl.h>

#include "catalog/pg_type.h"
#include "common/base64.h"
#include "common/cryptohash.h"
#include "common/sha2.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/jsonb.h"
#include "fmgr.h"

#include "effect.h"
#include "executor.h"
#include "http.h"
#include "jsonutil.h"
#include "mcp.h"
#include "mcp_oauth.h"
#include "secret.h"
#include "security.h"
#include "spiutil.h"
#include "template.h"
#include "tokens.h"
#include "tuvl.h"

PG_FUNCTION_INFO_V1(tuvl_mcp_connect);
PG_FUNCTION_INFO_V1(tuvl_mcp_connect_finish);

/* metadata documents larger than this are refused */
#define OAUTH_MAX_METADATA 65536

/* What discovery found out about a server. */
typedef struct OAuthServer
{
	char	   *resource;		/* the resource indicator */
	char	   *www_scope;		/* scope of WWW-Authenticate, or NULL */
	Jsonb	   *prm_scopes;		/* scopes_supported of the PRM, or NULL */
	char	   *issuer;
	char	   *authorization_endpoint;
	char	   *token_endpoint;
	char	   *registration_endpoint;
	Jsonb	   *as;				/* the AS metadata, or an empty object */
} OAuthServer;

/* -------------------------------------------------------------- helpers */

static void
oauth_error(const char *url, const char *msg, const char *detail)
{
	ereport(ERROR,
			(errcode(ERRCODE_EXTERNAL_ROUTINE_EXCEPTION),
			 errmsg("OAuth for MCP server %s failed: %s", HttpRedactUrl(url), msg),
			 detail ? errdetail("%s", detail) : 0));
}

/* One request of discovery or of the grant, in this backend. */
static HttpResult *
oauth_http(const char *method, const char *url, List *headers, const char *body, List *secrets)
{
	HttpRequest req;
	HttpHeader *h = palloc(sizeof(HttpHeader));

	EffectCheckAllowed(url, secrets);
	memset(&req, 0, sizeof(req));
	req.method = method;
	req.url = url;
	h->name = "Accept";
	h->value = "application/json";
	req.headers = lappend(list_copy(headers), h);
	req.body = body;
	req.body_len = body ? strlen(body) : 0;
	req.timeout_ms = tuvl_http_timeout;
	return HttpPerform(&req, secrets);
}

/*
 * GET a metadata document: the JSON object, or NULL when the server has
 * none there (an HTTP error status).  A document that is not a JSON object,
 * or too large, is an error: the server published something broken.
 */
static Jsonb *
fetch_metadata(const char *url, const char *server)
{
	HttpResult *res = oauth_http("GET", url, NIL, NULL, NIL);
	Jsonb	   *doc;
	const char *why = NULL;

	if (res->status == 0)
		oauth_error(server, psprintf("%s could not be fetched", HttpRedactUrl(url)), res->error);
	if (res->status < 200 || res->status >= 300)
		return NULL;
	if (res->body_len > OAUTH_MAX_METADATA)
		oauth_error(server, psprintf("the metadata at %s is larger than %d bytes", HttpRedactUrl(url),
									 OAUTH_MAX_METADATA), NULL);
	doc = JsonParseExternal(res->body, res->body_len, &why);
	if (doc == NULL || !JsonIsObject(doc))
		oauth_error(server, psprintf("the metadata at %s is not a JSON object", HttpRedactUrl(url)),
					why);
	return doc;
}

/* scheme://host[:port] of url (palloc'd), and its path in *path. */
static char *
url_origin(const char *url, char **path)
{
	const char *p = strstr(url, "://");
	const char *slash;
	const char *q;

	if (p == NULL || (strncmp(url, "http://", 7) != 0 && strncmp(url, "https://", 8) != 0))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("\"%s\" is not an http or https URL", HttpRedactUrl(url))));
	slash = strchr(p + 3, '/');
	q = strpbrk(p + 3, "?#");
	if (slash == NULL || (q && q < slash))
		slash = q;
	if (slash == NULL)
	{
		*path = "";
		return pstrdup(url);
	}
	*path = pnstrdup(slash, strcspn(slash, "?#"));
	if (strcmp(*path, "/") == 0)
		*path = "";
	return pnstrdup(url, slash - url);
}

/* A parameter of a WWW-Authenticate challenge (name="value"), or NULL. */
static char *
www_param(const char *header, const char *name)
{
	const char *p = header;
	size_t		n = strlen(name);

	while (p && (p = strstr(p, name)) != NULL)
	{
		bool		start = p == header || p[-1] == ' ' || p[-1] == ',';

		if (start && p[n] == '=')
		{
			const char *v = p + n + 1;

			if (*v == '"')
			{
				const char *end = strchr(v + 1, '"');

				return end ? pnstrdup(v + 1, end - v - 1) : NULL;
			}
			return pnstrdup(v, strcspn(v, ", "));
		}
		p += n;
	}
	return NULL;
}

/* Does the JSON array a hold the string s? */
static bool
array_has(Jsonb *a, const char *s)
{
	if (a == NULL || !JB_ROOT_IS_ARRAY(a) || JB_ROOT_IS_SCALAR(a))
		return false;
	for (int i = 0; i < (int) JsonContainerSize(&a->root); i++)
	{
		JsonbValue *v = getIthJsonbValueFromContainer(&a->root, i);

		if (v->type == jbvString && (size_t) v->val.string.len == strlen(s) &&
			strncmp(v->val.string.val, s, v->val.string.len) == 0)
			return true;
	}
	return false;
}

/* The strings of a JSON array, joined with spaces ("" for none). */
static char *
array_join(Jsonb *a)
{
	StringInfoData buf;

	initStringInfo(&buf);
	if (a && JB_ROOT_IS_ARRAY(a) && !JB_ROOT_IS_SCALAR(a))
		for (int i = 0; i < (int) JsonContainerSize(&a->root); i++)
		{
			JsonbValue *v = getIthJsonbValueFromContainer(&a->root, i);

			if (v->type != jbvString)
				continue;
			if (buf.len)
				appendStringInfoChar(&buf, ' ');
			appendBinaryStringInfo(&buf, v->val.string.val, v->val.string.len);
		}
	return buf.data;
}

/* An http(s) URL a metadata document names, or NULL when absent. */
static char *
metadata_url(Jsonb *doc, const char *key, const char *server)
{
	char	   *v = doc ? JsonGetString(doc, key) : NULL;

	if (v == NULL)
		return NULL;
	if (strncmp(v, "https://", 8) != 0 && strncmp(v, "http://", 7) != 0)
		oauth_error(server, psprintf("the authorization server's %s is not an http or https URL", key),
					NULL);
	return v;
}

static void
form_add(StringInfo buf, const char *name, const char *value)
{
	char	   *esc;

	if (value == NULL)
		return;
	esc = curl_easy_escape(NULL, value, 0);
	if (buf->len)
		appendStringInfoChar(buf, '&');
	appendStringInfo(buf, "%s=%s", name, esc ? esc : "");
	if (esc)
		curl_free(esc);
}

static char *
b64url(const uint8 *data, int len)
{
	int			cap = pg_b64_enc_len(len) + 1;
	char	   *out = palloc(cap);
	int			n = pg_b64_encode((const char *) data, len, out, cap);

	if (n < 0)
		elog(ERROR, "could not encode base64");
	while (n > 0 && out[n - 1] == '=')
		n--;
	out[n] = '\0';
	for (char *c = out; *c; c++)
		*c = *c == '+' ? '-' : *c == '/' ? '_' : *c;
	return out;
}

static char *
pkce_challenge(const char *verifier)
{
	uint8		digest[PG_SHA256_DIGEST_LENGTH];
	pg_cryptohash_ctx *ctx = pg_cryptohash_create(PG_SHA256);

	if (ctx == NULL || pg_cryptohash_init(ctx) < 0 ||
		pg_cryptohash_update(ctx, (const uint8 *) verifier, strlen(verifier)) < 0 ||
		pg_cryptohash_final(ctx, digest, sizeof(digest)) < 0)
		elog(ERROR, "could not compute a SHA-256 digest");
	pg_cryptohash_free(ctx);
	return b64url(digest, sizeof(digest));
}

/* ------------------------------------------------------------ discovery */

/*
 * The authorization server metadata of issuer: for an issuer with a path,
 * RFC 8414's path-inserted location, OpenID's path-inserted one and
 * OpenID's path-appended one; else the two well-known documents at its
 * root.
 */
static Jsonb *
as_metadata(const char *issuer, const char *server)
{
	char	   *path;
	char	   *origin = url_origin(issuer, &path);
	const char *candidates[4];
	int			n = 0;

	if (*path)
	{
		candidates[n++] = psprintf("%s/.well-known/oauth-authorization-server%s", origin, path);
		candidates[n++] = psprintf("%s/.well-known/openid-configuration%s", origin, path);
		candidates[n++] = psprintf("%s%s/.well-known/openid-configuration", origin, path);
	}
	else
	{
		candidates[n++] = psprintf("%s/.well-known/oauth-authorization-server", origin);
		candidates[n++] = psprintf("%s/.well-known/openid-configuration", origin);
	}
	for (int i = 0; i < n; i++)
	{
		Jsonb	   *doc = fetch_metadata(candidates[i], server);

		if (doc)
			return doc;
	}
	return NULL;
}

/* Is the protected resource's resource the server at url? */
static bool
resource_matches(const char *resource, const char *url)
{
	size_t		n = strlen(resource);

	while (n > 0 && resource[n - 1] == '/')
		n--;
	/* the URL itself, or a prefix of it ending at a path boundary */
	return strncmp(resource, url, n) == 0 &&
		(url[n] == '\0' || url[n] == '/' || url[n] == '?');
}

static void
discover(const char *url, OAuthServer *s)
{
	HttpResult *res;
	HttpHeader *ct = palloc(sizeof(HttpHeader));
	HttpHeader *acc = palloc(sizeof(HttpHeader));
	const char *www;
	char	   *prm_url;
	char	   *path;
	char	   *origin = url_origin(url, &path);
	Jsonb	   *prm = NULL;
	char	   *issuer;

	memset(s, 0, sizeof(OAuthServer));
	s->resource = pstrdup(url);

	/* what the server says without a token */
	ct->name = "Content-Type";
	ct->value = "application/json";
	acc->name = "Accept";
	acc->value = "application/json, text/event-stream";
	{
		HttpRequest req;

		EffectCheckAllowed(url, NIL);
		memset(&req, 0, sizeof(req));
		req.method = "POST";
		req.url = url;
		req.headers = list_make2(ct, acc);
		req.body = "{\"jsonrpc\": \"2.0\", \"id\": \"tuvl-oauth-probe\", \"method\": \"server/discover\"}";
		req.body_len = strlen(req.body);
		req.timeout_ms = tuvl_http_timeout;
		res = HttpPerform(&req, NIL);
	}
	if (res->status == 0)
		oauth_error(url, "the server could not be reached", res->error);
	www = HttpResultHeader(res, "www-authenticate");
	prm_url = www ? www_param(www, "resource_metadata") : NULL;
	s->www_scope = www ? www_param(www, "scope") : NULL;

	/* RFC 9728: where it says, else path-based, else at the root */
	if (prm_url)
		prm = fetch_metadata(prm_url, url);
	if (prm == NULL && *path)
		prm = fetch_metadata(psprintf("%s/.well-known/oauth-protected-resource%s", origin, path), url);
	if (prm == NULL)
		prm = fetch_metadata(psprintf("%s/.well-known/oauth-protected-resource", origin), url);

	if (prm)
	{
		Jsonb	   *servers = JsonGetJsonb(prm, "authorization_servers");
		char	   *resource = JsonGetString(prm, "resource");

		if (resource && !resource_matches(resource, url))
			oauth_error(url, "its protected-resource metadata names another resource",
						psprintf("The metadata is for \"%s\"; tuvl sends tokens only to the resource they are for.",
								 resource));
		if (resource)
			s->resource = resource;
		s->prm_scopes = JsonGetJsonb(prm, "scopes_supported");
		if (servers == NULL || !JB_ROOT_IS_ARRAY(servers) || JB_ROOT_IS_SCALAR(servers) ||
			JsonContainerSize(&servers->root) == 0 ||
			getIthJsonbValueFromContainer(&servers->root, 0)->type != jbvString)
			oauth_error(url, "its protected-resource metadata names no authorization server", NULL);
		issuer = JsonValueToText(getIthJsonbValueFromContainer(&servers->root, 0));
	}
	else
		issuer = origin;		/* 2025-03-26: the server is its own */

	s->issuer = issuer;
	s->as = as_metadata(issuer, url);
	if (s->as == NULL && prm)
		oauth_error(url, psprintf("the authorization server %s publishes no metadata",
								  HttpRedactUrl(issuer)), NULL);
	if (s->as == NULL)
	{
		/* 2025-03-26's defaults, at the server's root */
		s->as = JsonEmptyObject();
		s->authorization_endpoint = psprintf("%s/authorize", origin);
		s->token_endpoint = psprintf("%s/token", origin);
		s->registration_endpoint = psprintf("%s/register", origin);
		return;
	}
	s->authorization_endpoint = metadata_url(s->as, "authorization_endpoint", url);
	s->token_endpoint = metadata_url(s->as, "token_endpoint", url);
	s->registration_endpoint = metadata_url(s->as, "registration_endpoint", url);
	if (s->token_endpoint == NULL)
		oauth_error(url, "the authorization server's metadata has no token_endpoint", NULL);
	/* the token endpoint gets the client's secret: it must be allowed */
	EffectCheckAllowed(s->token_endpoint, NIL);
}

/*
 * The scopes to ask for: the configuration's, else the challenge's, else
 * the resource's scopes_supported (else none), plus offline_access when
 * the authorization server offers it (for a refresh token).
 */
static char *
choose_scope(OAuthServer *s, Jsonb *configured)
{
	char	   *scope;

	if (configured && JsonContainerSize(&configured->root) > 0)
		scope = array_join(configured);
	else if (s->www_scope && *s->www_scope)
		scope = s->www_scope;
	else
		scope = array_join(s->prm_scopes);
	if (array_has(JsonGetJsonb(s->as, "scopes_supported"), "offline_access") &&
		strstr(scope, "offline_access") == NULL)
		scope = *scope ? psprintf("%s offline_access", scope) : "offline_access";
	return *scope ? scope : NULL;
}

/* How to authenticate to the token endpoint with (or without) a secret. */
static const char *
choose_auth_method(Jsonb *as, const char *secret)
{
	Jsonb	   *methods = JsonGetJsonb(as, "token_endpoint_auth_methods_supported");

	if (secret == NULL)
		return "none";
	if (methods == NULL || array_has(methods, "client_secret_basic"))
		return "client_secret_basic";
	if (array_has(methods, "client_secret_post"))
		return "client_secret_post";
	return "none";
}

/* ---------------------------------------------------------------- tokens */

static char *
token_secret_name(const char *url, Oid role)
{
	char	   *key = psprintf("%u|%s", role, url);
	uint8		digest[PG_SHA256_DIGEST_LENGTH];
	pg_cryptohash_ctx *ctx = pg_cryptohash_create(PG_SHA256);
	char		hex[17];

	if (ctx == NULL || pg_cryptohash_init(ctx) < 0 ||
		pg_cryptohash_update(ctx, (const uint8 *) key, strlen(key)) < 0 ||
		pg_cryptohash_final(ctx, digest, sizeof(digest)) < 0)
		elog(ERROR, "could not compute a SHA-256 digest");
	pg_cryptohash_free(ctx);
	for (int i = 0; i < 8; i++)
		snprintf(hex + 2 * i, 3, "%02x", digest[i]);
	return psprintf("mcp_oauth_%s", hex);
}

static const char store_secret_sql[] =
"WITH s AS (INSERT INTO tuvl.secrets AS s (name, value, updated_by) VALUES ($1, $2, $3) "
"  ON CONFLICT ON CONSTRAINT secrets_pkey DO UPDATE SET value = excluded.value, "
"  updated_at = pg_catalog.now(), updated_by = excluded.updated_by RETURNING s.name) "
"INSERT INTO tuvl.secret_grants AS g (secret, grantee, granted_by) "
"SELECT s.name, $4::pg_catalog.oid::pg_catalog.regrole, $3 FROM s "
"ON CONFLICT (secret, grantee) DO NOTHING";

static const char store_token_sql[] =
"INSERT INTO tuvl.mcp_oauth_tokens AS t (url, role, secret, refresh_secret, expires_at, scope, "
"  token_endpoint, client_id, client_secret, auth_method, resource) "
"VALUES ($1, $2::pg_catalog.oid::pg_catalog.regrole, $3, $4, "
"  pg_catalog.now() OPERATOR(pg_catalog.+) pg_catalog.make_interval(secs => $5::pg_catalog.float8), "
"  $6, $7, $8, $9, $10, $11) "
"ON CONFLICT (url, role) DO UPDATE SET secret = excluded.secret, "
"  refresh_secret = COALESCE(excluded.refresh_secret, t.refresh_secret), "
"  expires_at = excluded.expires_at, scope = excluded.scope, token_endpoint = excluded.token_endpoint, "
"  client_id = excluded.client_id, client_secret = excluded.client_secret, "
"  auth_method = excluded.auth_method, resource = excluded.resource, updated_at = pg_catalog.now()";

/* What a token endpoint answered: the tokens, or an error raised. */
static Jsonb *
token_answer(HttpResult *res, const char *url, List *secrets)
{
	Jsonb	   *doc = NULL;

	if (res->status == 0)
		oauth_error(url, "the token endpoint could not be reached", SecretScrub(res->error, secrets));
	if (res->body_len <= OAUTH_MAX_METADATA)
		doc = JsonParseExternal(res->body, res->body_len, NULL);
	if (res->status < 200 || res->status >= 300)
	{
		char	   *err = doc && JsonIsObject(doc) ? JsonGetString(doc, "error") : NULL;
		char	   *desc = doc && JsonIsObject(doc) ? JsonGetString(doc, "error_description") : NULL;

		oauth_error(url, psprintf("the token endpoint answered HTTP %d%s%s", res->status,
								  err ? ": " : "", err ? JsonClipText(SecretScrub(err, secrets), 200) : ""),
					desc ? JsonClipText(SecretScrub(desc, secrets), 500) : NULL);
	}
	if (doc == NULL || !JsonIsObject(doc) || JsonGetString(doc, "access_token") == NULL)
		oauth_error(url, "the token endpoint's answer holds no access_token", NULL);
	return doc;
}

/*
 * Store the tokens of a token endpoint's answer as secrets granted to
 * role, and what refreshing them needs.
 */
static void
store_tokens(const char *url, Oid role, Jsonb *tok, const char *token_endpoint,
			 const char *client_id, const char *client_secret, const char *auth_method,
			 const char *resource)
{
	static const Oid stypes[4] = {TEXTOID, TEXTOID, TEXTOID, OIDOID};
	static const Oid ttypes[11] = {TEXTOID, OIDOID, TEXTOID, TEXTOID, FLOAT8OID, TEXTOID, TEXTOID,
	TEXTOID, TEXTOID, TEXTOID, TEXTOID};
	char	   *name = token_secret_name(url, role);
	char	   *refresh = JsonGetString(tok, "refresh_token");
	char	   *refresh_name = refresh ? psprintf("%s_refresh", name) : NULL;
	double		expires = JsonGetField(tok, "expires_in") ?
	strtod(JsonGetText(tok, "expires_in"), NULL) : 3600.0;
	Datum		v[11];
	char		nulls[11];
	bool		connected = SPI_connect() == SPI_OK_CONNECT;

	if (!(expires > 0))
		expires = 3600.0;
	v[0] = CStringGetTextDatum(name);
	v[1] = CStringGetTextDatum(JsonGetString(tok, "access_token"));
	v[2] = CStringGetTextDatum(GetUserNameFromId(GetSessionUserId(), false));
	v[3] = ObjectIdGetDatum(role);
	SecurityExec(store_secret_sql, 4, stypes, v, NULL, SPI_OK_INSERT);
	if (refresh)
	{
		v[0] = CStringGetTextDatum(refresh_name);
		v[1] = CStringGetTextDatum(refresh);
		SecurityExec(store_secret_sql, 4, stypes, v, NULL, SPI_OK_INSERT);
	}
	memset(nulls, ' ', sizeof(nulls));
	v[0] = CStringGetTextDatum(url);
	v[1] = ObjectIdGetDatum(role);
	v[2] = CStringGetTextDatum(name);
	v[3] = refresh_name ? CStringGetTextDatum(refresh_name) : (nulls[3] = 'n', (Datum) 0);
	v[4] = Float8GetDatum(expires);
	v[5] = JsonGetString(tok, "scope") ? CStringGetTextDatum(JsonGetString(tok, "scope")) :
		(nulls[5] = 'n', (Datum) 0);
	v[6] = CStringGetTextDatum(token_endpoint);
	v[7] = client_id ? CStringGetTextDatum(client_id) : (nulls[7] = 'n', (Datum) 0);
	v[8] = client_secret ? CStringGetTextDatum(client_secret) : (nulls[8] = 'n', (Datum) 0);
	v[9] = CStringGetTextDatum(auth_method);
	v[10] = resource ? CStringGetTextDatum(resource) : (nulls[10] = 'n', (Datum) 0);
	SecurityExec(store_token_sql, 11, ttypes, v, nulls, SPI_OK_INSERT);
	if (connected)
		SPI_finish();
}

/*
 * POST a token request (form) with the client's authentication; returns
 * the answer's JSON (tokens), raising for a refusal.
 */
/*
 * The credentials of client_secret_basic (RFC 6749 2.3.1): the client id
 * and secret, each form-encoded, joined by a colon, in base64.
 */
static char *
basic_credentials(const char *client_id, const char *client_secret)
{
	char	   *id = curl_easy_escape(NULL, client_id, 0);
	char	   *sec = curl_easy_escape(NULL, client_secret, 0);
	char	   *pair = psprintf("%s:%s", id, sec);
	int			cap = pg_b64_enc_len(strlen(pair)) + 1;
	char	   *b64 = palloc0(cap);
	int			n = pg_b64_encode(pair, strlen(pair), b64, cap);

	curl_free(id);
	curl_free(sec);
	if (n < 0)
		elog(ERROR, "could not encode base64");
	b64[n] = '\0';
	return b64;
}

static Jsonb *
token_request(const char *url, const char *endpoint, StringInfo form, const char *client_id,
			  const char *client_secret, const char *auth_method)
{
	List	   *headers = NIL;
	List	   *secrets = NIL;
	HttpHeader *h = palloc(sizeof(HttpHeader));

	h->name = "Content-Type";
	h->value = "application/x-www-form-urlencoded";
	headers = lappend(headers, h);
	if (client_secret)
		secrets = lappend(secrets, (char *) client_secret);
	if (strcmp(auth_method, "client_secret_basic") == 0 && client_secret)
	{
		char	   *b64 = basic_credentials(client_id, client_secret);

		h = palloc(sizeof(HttpHeader));
		h->name = "Authorization";
		h->value = psprintf("Basic %s", b64);
		headers = lappend(headers, h);
		secrets = lappend(secrets, b64);
	}
	else
	{
		form_add(form, "client_id", client_id);
		if (strcmp(auth_method, "client_secret_post") == 0)
			form_add(form, "client_secret", client_secret);
	}
	return token_answer(oauth_http("POST", endpoint, headers, form->data, secrets), url, secrets);
}

/* ------------------------------------------------------------ the grant */

/* The oauth mapping of an auth object ({"oauth": {...}}), or NULL. */
static Jsonb *
oauth_config(Jsonb *auth)
{
	Jsonb	   *o;

	if (auth == NULL || JB_ROOT_IS_SCALAR(auth))
		return NULL;
	if (!JsonIsObject(auth) || (o = JsonGetJsonb(auth, "oauth")) == NULL || !JsonIsObject(o))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("auth must be a JSON object such as {\"oauth\": {\"grant\": \"authorization_code\"}}")));
	return o;
}

/* The value of the secret named name, if the calling role holds a grant. */
static char *
read_secret(const char *name)
{
	SecretUse	use;

	SecretUseInit(&use, NULL);
	return TemplateRenderText(psprintf("{{ secrets.%s }}", name), JsonEmptyObject(), &use.opts);
}

/*
 * Dynamic client registration (RFC 7591) of a public client (or what the
 * server offers) with the redirect URI: sets the client's id, secret and
 * token endpoint authentication.
 */
static void
register_client(const char *url, OAuthServer *s, const char *redirect, char **client_id,
				char **client_secret, const char **auth_method)
{
	JsonObjBuilder b;
	Jsonb	   *reg;
	HttpResult *res;
	HttpHeader *h = palloc(sizeof(HttpHeader));
	Jsonb	   *methods = JsonGetJsonb(s->as, "token_endpoint_auth_methods_supported");
	const char *want = methods == NULL || array_has(methods, "none") ? "none" :
	array_has(methods, "client_secret_basic") ? "client_secret_basic" : "client_secret_post";
	const char *why;

	if (s->registration_endpoint == NULL)
		oauth_error(url, "the authorization server offers no dynamic client registration",
					"Register a client with it and give its client_id in auth.oauth.client_id.");
	JsonObjStart(&b);
	JsonObjAddString(&b, "client_name", "tuvl");
	JsonObjAddJsonb(&b, "redirect_uris",
					JsonFromCString(psprintf("[%s]", JsonText(JsonStringValue(redirect)))));
	JsonObjAddJsonb(&b, "grant_types", JsonFromCString("[\"authorization_code\", \"refresh_token\"]"));
	JsonObjAddJsonb(&b, "response_types", JsonFromCString("[\"code\"]"));
	JsonObjAddString(&b, "token_endpoint_auth_method", want);
	reg = JsonObjEnd(&b);
	h->name = "Content-Type";
	h->value = "application/json";
	res = oauth_http("POST", s->registration_endpoint, list_make1(h), JsonText(reg), NIL);
	if (res->status < 200 || res->status >= 300)
		oauth_error(url, psprintf("dynamic client registration answered HTTP %d", res->status),
					res->status ? JsonClipText(res->body, 500) : res->error);
	reg = res->body_len <= OAUTH_MAX_METADATA ? JsonParseExternal(res->body, res->body_len, &why) : NULL;
	if (reg == NULL || !JsonIsObject(reg) || JsonGetString(reg, "client_id") == NULL)
		oauth_error(url, "dynamic client registration returned no client_id", NULL);
	*client_id = JsonGetString(reg, "client_id");
	*client_secret = JsonGetString(reg, "client_secret");
	*auth_method = JsonGetString(reg, "token_endpoint_auth_method");
	if (*auth_method == NULL)
		*auth_method = choose_auth_method(s->as, *client_secret);
}

/*
 * tuvl.mcp_connect(url, auth): discovery, the client, PKCE; returns the
 * authorization URL.
 */
Datum
tuvl_mcp_connect(PG_FUNCTION_ARGS)
{
	char	   *url;
	Jsonb	   *auth = PG_ARGISNULL(1) ? NULL : PG_GETARG_JSONB_P(1);
	Jsonb	   *cfg;
	OAuthServer s;
	char	   *client_id = NULL;
	char	   *client_secret = NULL;
	const char *auth_method;
	char	   *redirect = tuvl_oauth_redirect_uri;
	char	   *scope;
	char	   *verifier;
	char	   *state;
	uint8		rnd[32];
	StringInfoData q;

	TokenRequireScope("workflows:write");
	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("the MCP server's URL must not be null")));
	url = text_to_cstring(PG_GETARG_TEXT_PP(0));
	TuvlRefuseWhileReplaying("tuvl.mcp_connect()");
	cfg = oauth_config(auth);
	if (cfg && JsonGetString(cfg, "grant") && strcmp(JsonGetString(cfg, "grant"), "authorization_code") != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("tuvl.mcp_connect() starts an authorization_code grant, not %s",
						JsonGetString(cfg, "grant")),
				 errhint("A client_credentials grant needs no person: the step gets its token itself.")));
	if (redirect == NULL || *redirect == '\0')
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("tuvl.oauth_redirect_uri is not set"),
				 errdetail("The authorization server sends the person back to that URL with the code."),
				 errhint("Set it to the console's /oauth/callback, or to a page that hands its URL to tuvl.mcp_connect_finish().")));

	discover(url, &s);
	if (s.authorization_endpoint == NULL)
		oauth_error(url, "the authorization server's metadata has no authorization_endpoint", NULL);

	/* the client */
	if (cfg)
		client_id = JsonGetString(cfg, "client_id");
	if (cfg && JsonGetString(cfg, "client_secret_secret"))
		client_secret = read_secret(JsonGetString(cfg, "client_secret_secret"));
	if (client_id && (strncmp(client_id, "https://", 8) == 0 || strncmp(client_id, "http://", 7) == 0) &&
		!JsonGetBool(s.as, "client_id_metadata_document_supported", false))
		client_id = NULL;		/* a metadata document the server does not
								 * take */
	auth_method = choose_auth_method(s.as, client_secret);
	if (client_id == NULL)
		register_client(url, &s, redirect, &client_id, &client_secret, &auth_method);

	scope = choose_scope(&s, cfg ? JsonGetJsonb(cfg, "scopes") : NULL);

	if (!pg_strong_random(rnd, sizeof(rnd)))
		elog(ERROR, "could not generate random bytes");
	verifier = b64url(rnd, 32);
	if (!pg_strong_random(rnd, 16))
		elog(ERROR, "could not generate random bytes");
	state = b64url(rnd, 16);

	{
		static const Oid types[11] = {TEXTOID, OIDOID, TEXTOID, TEXTOID, TEXTOID, TEXTOID, TEXTOID,
		TEXTOID, TEXTOID, TEXTOID, TEXTOID};
		Datum		v[11];
		char		nulls[11];
		bool		connected = SPI_connect() == SPI_OK_CONNECT;

		memset(nulls, ' ', sizeof(nulls));
		v[0] = CStringGetTextDatum(state);
		v[1] = ObjectIdGetDatum(GetUserId());
		v[2] = CStringGetTextDatum(url);
		v[3] = CStringGetTextDatum(verifier);
		v[4] = CStringGetTextDatum(redirect);
		v[5] = CStringGetTextDatum(s.token_endpoint);
		v[6] = CStringGetTextDatum(client_id);
		v[7] = client_secret ? CStringGetTextDatum(client_secret) : (nulls[7] = 'n', (Datum) 0);
		v[8] = CStringGetTextDatum(auth_method);
		v[9] = CStringGetTextDatum(s.resource);
		v[10] = scope ? CStringGetTextDatum(scope) : (nulls[10] = 'n', (Datum) 0);
		/* a role's grants older than an hour are forgotten */
		SecurityExec("DELETE FROM tuvl.mcp_oauth_pending "
					 "WHERE created_at OPERATOR(pg_catalog.<) (pg_catalog.now() OPERATOR(pg_catalog.-) '1 hour'::pg_catalog.interval)",
					 0, NULL, NULL, NULL, SPI_OK_DELETE);
		SecurityExec("INSERT INTO tuvl.mcp_oauth_pending (state, role, url, verifier, redirect_uri, "
					 "token_endpoint, client_id, client_secret, auth_method, resource, scope) "
					 "VALUES ($1, $2::pg_catalog.oid::pg_catalog.regrole, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
					 11, types, v, nulls, SPI_OK_INSERT);
		if (connected)
			SPI_finish();
	}

	initStringInfo(&q);
	form_add(&q, "response_type", "code");
	form_add(&q, "client_id", client_id);
	form_add(&q, "redirect_uri", redirect);
	form_add(&q, "state", state);
	form_add(&q, "code_challenge", pkce_challenge(verifier));
	form_add(&q, "code_challenge_method", "S256");
	form_add(&q, "resource", s.resource);
	form_add(&q, "scope", scope);
	PG_RETURN_TEXT_P(cstring_to_text(psprintf("%s%c%s", s.authorization_endpoint,
											  strchr(s.authorization_endpoint, '?') ? '&' : '?',
											  q.data)));
}

/* The value of query parameter name in url (decoded), or NULL. */
static char *
query_param(const char *url, const char *name)
{
	const char *q = strchr(url, '?');
	size_t		n = strlen(name);

	while (q)
	{
		q++;
		if (strncmp(q, name, n) == 0 && q[n] == '=')
		{
			const char *v = q + n + 1;
			size_t		len = strcspn(v, "&#");
			int			outlen;
			char	   *dec = curl_easy_unescape(NULL, v, len, &outlen);
			char	   *out;

			if (dec == NULL)
				return NULL;
			for (char *c = dec; *c; c++)
				if (*c == '+')
					*c = ' ';
			out = pstrdup(dec);
			curl_free(dec);
			return out;
		}
		q = strchr(q, '&');
	}
	return NULL;
}

/*
 * tuvl.mcp_connect_finish(callback_url): the code for the tokens, stored
 * as secrets of the role that started the grant.  Returns the server URL.
 */
Datum
tuvl_mcp_connect_finish(PG_FUNCTION_ARGS)
{
	char	   *callback = text_to_cstring(PG_GETARG_TEXT_PP(0));
	char	   *state = query_param(callback, "state");
	char	   *code = query_param(callback, "code");
	char	   *error = query_param(callback, "error");
	static const Oid types[2] = {TEXTOID, OIDOID};
	char	   *f[10];
	bool		connected;
	bool		found = false;
	Jsonb	   *tok;
	StringInfoData form;

	TokenRequireScope("workflows:write");
	TuvlRefuseWhileReplaying("tuvl.mcp_connect_finish()");
	if (state == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("the callback URL has no state parameter"),
				 errhint("Pass the whole URL the authorization server sent the person back to.")));
	connected = SPI_connect() == SPI_OK_CONNECT;
	if (SecurityExecArgs("DELETE FROM tuvl.mcp_oauth_pending p "
						 "WHERE p.state OPERATOR(pg_catalog.=) $1 "
						 "  AND p.role OPERATOR(pg_catalog.=) $2::pg_catalog.oid::pg_catalog.regrole "
						 "  AND p.created_at OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.-) '1 hour'::pg_catalog.interval) "
						 "RETURNING url, verifier, redirect_uri, token_endpoint, client_id, client_secret, "
						 "  auth_method, resource, scope",
						 SPI_OK_DELETE_RETURNING, 2, types, CStringGetTextDatum(state),
						 ObjectIdGetDatum(GetUserId())) == 1)
	{
		found = true;
		for (int i = 0; i < 9; i++)
		{
			char	   *v = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, i + 1);

			f[i] = v ? SPI_palloc(strlen(v) + 1) : NULL;
			if (v)
				strcpy(f[i], v);
		}
	}
	if (connected)
		SPI_finish();
	if (!found)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("no OAuth grant of role \"%s\" is waiting for this callback",
						GetUserNameFromId(GetUserId(), false)),
				 errdetail("Its state is unknown, was used already, is older than an hour, or belongs to another role."),
				 errhint("Start again with tuvl.mcp_connect().")));
	if (error || code == NULL)
		oauth_error(f[0], psprintf("the authorization server refused: %s",
								   error ? JsonClipText(error, 200) : "the callback has no code"),
					query_param(callback, "error_description"));

	initStringInfo(&form);
	form_add(&form, "grant_type", "authorization_code");
	form_add(&form, "code", code);
	form_add(&form, "redirect_uri", f[2]);
	form_add(&form, "code_verifier", f[1]);
	form_add(&form, "resource", f[7]);
	tok = token_request(f[0], f[3], &form, f[4], f[5], f[6]);
	store_tokens(f[0], GetUserId(), tok, f[3], f[4], f[5], f[6], f[7]);
	PG_RETURN_TEXT_P(cstring_to_text(f[0]));
}

/* ------------------------------------------------------------- the step */

/*
 * Tokens a token endpoint sent to this process, by the idempotency key of
 * the request, until the step that asked stores them (in its next
 * transition, in this process).  They never reach the journal: the hook
 * below scrubs them from the response before it is journaled.  A process
 * that dies in between loses them, and the step asks again.
 */
typedef struct StashedToken
{
	char		key[256];		/* hash key */
	char	   *json;			/* the answer, in TopMemoryContext */
} StashedToken;

static HTAB *stash = NULL;

static StashedToken *
stash_lookup(const char *key, bool create)
{
	char		k[256];
	StashedToken *st;
	bool		found;

	if (stash == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(k);
		ctl.entrysize = sizeof(StashedToken);
		stash = hash_create("tuvl OAuth tokens in flight", 16, &ctl, HASH_ELEM | HASH_STRINGS);
	}
	if (strlen(key) >= sizeof(k))
		return NULL;
	memset(k, 0, sizeof(k));
	strlcpy(k, key, sizeof(k));
	st = hash_search(stash, k, create ? HASH_ENTER : HASH_FIND, &found);
	if (st && !found)
		st->json = NULL;
	return st;
}

/* EffectFinishHook: keep a token endpoint's tokens, scrub them. */
static List *
finish_hook(EffectRequest *req, HttpResult *res, List *secrets)
{
	char	   *op = JsonGetString(req->tag, "op");
	char	   *key = JsonGetString(req->tag, "key");
	Jsonb	   *doc;
	StashedToken *st;

	if (op == NULL || strcmp(op, "oauth_token") != 0 || key == NULL || res->body == NULL ||
		res->status < 200 || res->status >= 300 || res->body_len > OAUTH_MAX_METADATA)
		return secrets;
	doc = JsonParseExternal(res->body, res->body_len, NULL);
	if (doc == NULL || !JsonIsObject(doc))
		return secrets;
	secrets = list_copy(secrets);
	if (JsonGetString(doc, "access_token"))
		secrets = lappend(secrets, JsonGetString(doc, "access_token"));
	if (JsonGetString(doc, "refresh_token"))
		secrets = lappend(secrets, JsonGetString(doc, "refresh_token"));
	if (JsonGetString(doc, "id_token"))
		secrets = lappend(secrets, JsonGetString(doc, "id_token"));
	st = stash_lookup(key, true);
	if (st)
	{
		if (st->json)
			pfree(st->json);
		st->json = MemoryContextStrdup(TopMemoryContext, JsonText(doc));
	}
	return secrets;
}

/* The stashed answer of the token request key (taken away), or NULL. */
static Jsonb *
stash_take(const char *key)
{
	StashedToken *st = key ? stash_lookup(key, false) : NULL;
	Jsonb	   *doc;

	if (st == NULL || st->json == NULL)
		return NULL;
	doc = JsonFromCString(st->json);
	pfree(st->json);
	hash_search(stash, st->key, HASH_REMOVE, NULL);
	return doc;
}

/*
 * The rest of a query of the token of url ($1) that a role ($2) may use:
 * one granted to it (or a role it is a member of), its own first, then
 * the one that lives longest.
 */
#define TOKEN_FOR_URL_AND_ROLE \
	"FROM tuvl.mcp_oauth_tokens t " \
	"WHERE t.url OPERATOR(pg_catalog.=) $1 AND EXISTS (" \
	"  SELECT 1 FROM tuvl.secret_grants g WHERE g.secret OPERATOR(pg_catalog.=) t.secret " \
	"    AND pg_catalog.pg_has_role($2::pg_catalog.oid, g.grantee::pg_catalog.oid, 'USAGE')) " \
	"ORDER BY t.role::pg_catalog.oid OPERATOR(pg_catalog.=) $2::pg_catalog.oid DESC, " \
	"  t.expires_at DESC NULLS LAST LIMIT 1"

/* The token row of url that principal may use. */
typedef struct TokenRow
{
	char	   *secret;
	char	   *refresh_secret;
	bool		fresh;			/* not expiring within a minute */
	bool		valid;			/* not expired */
	char	   *token_endpoint;
	char	   *client_id;
	char	   *client_secret;
	char	   *auth_method;
	char	   *resource;
} TokenRow;

static bool
token_row(const char *url, Oid principal, TokenRow *row)
{
	static const Oid types[2] = {TEXTOID, OIDOID};
	bool		connected = SPI_connect() == SPI_OK_CONNECT;
	bool		found = false;

	memset(row, 0, sizeof(TokenRow));
	if (SecurityExecArgs("SELECT t.secret, t.refresh_secret, "
						 "  COALESCE(t.expires_at OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.+) '1 minute'::pg_catalog.interval), true)::pg_catalog.text, "
						 "  t.token_endpoint, t.client_id, t.client_secret, t.auth_method, t.resource, "
						 "  COALESCE(t.expires_at OPERATOR(pg_catalog.>) pg_catalog.now(), true)::pg_catalog.text "
						 TOKEN_FOR_URL_AND_ROLE,
						 SPI_OK_SELECT, 2, types, CStringGetTextDatum(url),
						 ObjectIdGetDatum(principal)) == 1)
	{
		char	   *f[9];

		for (int i = 0; i < 9; i++)
		{
			char	   *v = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, i + 1);

			f[i] = v ? SPI_palloc(strlen(v) + 1) : NULL;
			if (v)
				strcpy(f[i], v);
		}
		row->secret = f[0];
		row->refresh_secret = f[1];
		row->fresh = f[2] && strcmp(f[2], "true") == 0;
		row->token_endpoint = f[3];
		row->client_id = f[4];
		row->client_secret = f[5];
		row->auth_method = f[6];
		row->resource = f[7];
		row->valid = f[8] && strcmp(f[8], "true") == 0;
		found = true;
	}
	if (connected)
		SPI_finish();
	return found;
}

/* An OAuth request of a step, as an effect. */
static EffectRequest *
oauth_effect(RunState *run, int n, const char *op, const char *method, const char *url,
			 List *headers, const char *body, int timeout_ms, List *secrets)
{
	EffectRequest *req = palloc0(sizeof(EffectRequest));
	HttpHeader *h = palloc(sizeof(HttpHeader));
	JsonObjBuilder b;

	EffectCheckAllowed(url, secrets);
	h->name = "Accept";
	h->value = strcmp(op, "oauth_probe") == 0 ? "application/json, text/event-stream" : "application/json";
	req->http.method = method;
	req->http.url = pstrdup(url);
	req->http.headers = lappend(list_copy(headers), h);
	req->http.body = body;
	req->http.body_len = body ? strlen(body) : 0;
	req->http.timeout_ms = timeout_ms;
	req->secrets = secrets;
	JsonObjStart(&b);
	JsonObjAddString(&b, "method", method);
	JsonObjAddString(&b, "url", HttpRedactUrl(url));
	JsonObjAddString(&b, "rpc", op);
	req->journal = SecretScrubJsonb(JsonObjEnd(&b), secrets);
	JsonObjStart(&b);
	JsonObjAddString(&b, "op", op);
	JsonObjAddString(&b, "key", EffectKey(run, n));
	req->tag = JsonObjEnd(&b);
	EffectFinishHook = finish_hook;
	return req;
}

/* A step's OAuth records so far. */
typedef struct OAuthWalk
{
	int			last;			/* index of the last OAuth record, -1 */
	int			tokens;			/* token requests */
	Jsonb	   *probe;
	int			prm_tries;
	Jsonb	   *prm;
	int			as_tries;
	Jsonb	   *as;
	char	   *token_endpoint; /* where the last token request went */
} OAuthWalk;

static void
fail_request(Jsonb *r, const char *url, const char *what)
{
	oauth_error(url, psprintf("%s could not be fetched", what),
				JsonGetString(r, "error") ? JsonGetString(r, "error") : "no response");
}

/* The body of a metadata record: an object, NULL for none, else raise. */
static Jsonb *
record_metadata(Jsonb *r, const char *url, const char *what)
{
	int			status = JsonGetInt32(r, "status", 0);
	Jsonb	   *body;

	if (status == 0)
		fail_request(r, url, what);
	if (status < 200 || status >= 300)
		return NULL;
	body = JsonGetJsonb(r, "body");
	if (body == NULL || !JsonIsObject(body) || JsonGetField(r, "body_error"))
		oauth_error(url, psprintf("the %s is not a JSON object", what), NULL);
	if (VARSIZE(body) > OAUTH_MAX_METADATA)
		oauth_error(url, psprintf("the %s is larger than %d bytes", what, OAUTH_MAX_METADATA), NULL);
	return body;
}

static void
walk_oauth(RunState *run, int n, const char *url, OAuthWalk *w)
{
	memset(w, 0, sizeof(OAuthWalk));
	w->last = -1;
	for (int i = 0; i < n; i++)
	{
		Jsonb	   *r = EffectAt(run, i);
		char	   *op = JsonGetString(r, "op");
		int			status = JsonGetInt32(r, "status", 0);

		if (op == NULL || strncmp(op, "oauth_", 6) != 0)
			continue;
		w->last = i;
		if (strcmp(op, "oauth_probe") == 0)
		{
			if (status == 0)
				fail_request(r, url, "the server");
			w->probe = r;
		}
		else if (strcmp(op, "oauth_prm") == 0)
		{
			w->prm_tries++;
			w->prm = record_metadata(r, url, "protected-resource metadata");
		}
		else if (strcmp(op, "oauth_as") == 0)
		{
			w->as_tries++;
			w->as = record_metadata(r, url, "authorization server's metadata");
		}
		else if (strcmp(op, "oauth_token") == 0)
		{
			Jsonb	   *body = JsonGetJsonb(r, "body");
			Jsonb	   *tok;

			w->tokens++;
			if (status == 0)
				fail_request(r, url, "a token");
			if (status < 200 || status >= 300)
			{
				char	   *err = body && JsonIsObject(body) ? JsonGetString(body, "error") : NULL;
				char	   *desc = body && JsonIsObject(body) ? JsonGetString(body, "error_description") : NULL;

				ExecutorErrorType = "mcp_auth_error";
				oauth_error(url, psprintf("the token endpoint answered HTTP %d%s%s", status,
										  err ? ": " : "", err ? JsonClipText(err, 200) : ""),
							desc ? JsonClipText(desc, 500) : NULL);
			}
			/* the tokens, when this process has them: store them now */
			tok = stash_take(JsonGetString(r, "key"));
			if (tok && JsonGetString(tok, "access_token") && !run->replay)
			{
				char	   *endpoint = JsonGetString(r, "token_endpoint");
				char	   *client_id = JsonGetString(r, "client_id");
				char	   *method = JsonGetString(r, "auth_method");
				char	   *resource = JsonGetString(r, "resource");

				store_tokens(url, run->principal, tok, endpoint ? endpoint : "", client_id, NULL,
							 method ? method : "none", resource);
			}
		}
	}
}

/* The scopes a 401/403 record's WWW-Authenticate names, or NULL. */
static char *
record_scope(Jsonb *r)
{
	Jsonb	   *headers = r ? JsonGetJsonb(r, "headers") : NULL;
	char	   *www = headers ? JsonGetString(headers, "www-authenticate") : NULL;

	return www ? www_param(www, "scope") : NULL;
}

/*
 * The next discovery request of a client-credentials grant (the probe,
 * protected-resource metadata, authorization-server metadata, each
 * location in turn), or NULL when discovery is over.  known_endpoint: a
 * token endpoint is known already (a token of the URL expired).
 */
static EffectRequest *
discovery_request(RunState *run, int n, const char *url, OAuthWalk *w, bool known_endpoint,
				  int timeout_ms)
{
	char	   *path;
	char	   *origin = url_origin(url, &path);

	if (w->probe == NULL && !known_endpoint)
	{
		HttpHeader *ct = palloc(sizeof(HttpHeader));

		ct->name = "Content-Type";
		ct->value = "application/json";
		return oauth_effect(run, n, "oauth_probe", "POST", url, list_make1(ct),
							"{\"jsonrpc\": \"2.0\", \"id\": \"tuvl-oauth-probe\", \"method\": \"server/discover\"}",
							timeout_ms, NIL);
	}
	if (w->probe && w->prm == NULL && w->as == NULL)
	{
		Jsonb	   *ph = JsonGetJsonb(w->probe, "headers");
		char	   *www = ph ? JsonGetString(ph, "www-authenticate") : NULL;
		char	   *named = www ? www_param(www, "resource_metadata") : NULL;
		List	   *cands = NIL;

		if (named)
			cands = lappend(cands, named);
		if (*path)
			cands = lappend(cands, psprintf("%s/.well-known/oauth-protected-resource%s", origin, path));
		cands = lappend(cands, psprintf("%s/.well-known/oauth-protected-resource", origin));
		if (w->prm_tries < list_length(cands))
			return oauth_effect(run, n, "oauth_prm", "GET", list_nth(cands, w->prm_tries), NIL, NULL,
								timeout_ms, NIL);
	}
	if (w->probe && w->as == NULL)
	{
		char	   *issuer = origin;
		char	   *ipath;
		char	   *iorigin;
		List	   *cands = NIL;

		if (w->prm)
		{
			Jsonb	   *servers = JsonGetJsonb(w->prm, "authorization_servers");
			char	   *res = JsonGetString(w->prm, "resource");

			if (res && !resource_matches(res, url))
				oauth_error(url, "its protected-resource metadata names another resource",
							psprintf("The metadata is for \"%s\"; tuvl sends tokens only to the resource they are for.",
									 res));
			if (servers == NULL || !JB_ROOT_IS_ARRAY(servers) || JB_ROOT_IS_SCALAR(servers) ||
				JsonContainerSize(&servers->root) == 0 ||
				getIthJsonbValueFromContainer(&servers->root, 0)->type != jbvString)
				oauth_error(url, "its protected-resource metadata names no authorization server", NULL);
			issuer = JsonValueToText(getIthJsonbValueFromContainer(&servers->root, 0));
		}
		iorigin = url_origin(issuer, &ipath);
		if (*ipath)
		{
			cands = lappend(cands, psprintf("%s/.well-known/oauth-authorization-server%s", iorigin, ipath));
			cands = lappend(cands, psprintf("%s/.well-known/openid-configuration%s", iorigin, ipath));
			cands = lappend(cands, psprintf("%s%s/.well-known/openid-configuration", iorigin, ipath));
		}
		else
		{
			cands = lappend(cands, psprintf("%s/.well-known/oauth-authorization-server", iorigin));
			cands = lappend(cands, psprintf("%s/.well-known/openid-configuration", iorigin));
		}
		if (w->as_tries < list_length(cands))
			return oauth_effect(run, n, "oauth_as", "GET", list_nth(cands, w->as_tries), NIL, NULL,
								timeout_ms, NIL);
		if (w->prm)
			oauth_error(url, psprintf("the authorization server %s publishes no metadata",
									  HttpRedactUrl(issuer)), NULL);
	}
	return NULL;
}

/*
 * The token request of a step (form: the grant's parameters), with the
 * client's authentication, as an effect whose tag says what storing the
 * tokens needs.
 */
static EffectRequest *
token_effect(RunState *run, int n, const char *endpoint, StringInfo form, const char *client_id,
			 const char *client_secret, const char *method, const char *resource, SecretUse *use,
			 int timeout_ms)
{
	List	   *headers = NIL;
	HttpHeader *h;
	EffectRequest *req;
	JsonObjBuilder b;

	h = palloc(sizeof(HttpHeader));
	h->name = "Content-Type";
	h->value = "application/x-www-form-urlencoded";
	headers = lappend(headers, h);
	if (strcmp(method, "client_secret_basic") == 0 && client_secret)
	{
		char	   *b64 = basic_credentials(client_id ? client_id : "", client_secret);

		h = palloc(sizeof(HttpHeader));
		h->name = "Authorization";
		h->value = psprintf("Basic %s", b64);
		headers = lappend(headers, h);
		use->values = lappend(use->values, b64);
	}
	else
	{
		form_add(form, "client_id", client_id);
		if (strcmp(method, "client_secret_post") == 0)
			form_add(form, "client_secret", client_secret);
	}
	req = oauth_effect(run, n, "oauth_token", "POST", endpoint, headers, form->data, timeout_ms,
					   use->values);
	/* what storing the tokens needs, in the journaled result */
	JsonObjStart(&b);
	JsonObjAddString(&b, "token_endpoint", endpoint);
	if (client_id)
		JsonObjAddString(&b, "client_id", client_id);
	JsonObjAddString(&b, "auth_method", method);
	if (resource)
		JsonObjAddString(&b, "resource", resource);
	req->tag = JsonMerge(req->tag, JsonObjEnd(&b));
	return req;
}

/*
 * An MCP step with mcp.auth, before its MCP messages: returns the next
 * OAuth request to make (discovery, a client-credentials grant, a
 * refresh), or NULL with *header set to the bearer token to send and
 * *start to the position of the step's first MCP message.
 */
EffectRequest *
McpOAuthStep(RunState *run, Jsonb *auth, const char *url, SecretUse *use, int timeout_ms,
			 HttpHeader **header, int *start)
{
	Jsonb	   *cfg = oauth_config(auth);
	char	   *grant = cfg ? JsonGetString(cfg, "grant") : NULL;
	bool		cc = grant && strcmp(grant, "client_credentials") == 0;
	int			n = EffectCount(run);
	OAuthWalk	w;
	TokenRow	row;
	bool		have;
	char	   *forced_scope = NULL;
	bool		forced = false;
	Jsonb	   *last = n > 0 ? EffectAt(run, n - 1) : NULL;
	char	   *lastop = last ? JsonGetString(last, "op") : NULL;
	char	   *path;
	char	   *origin = url_origin(url, &path);
	StringInfoData form;
	const char *endpoint;
	const char *client_id;
	const char *client_secret = NULL;
	const char *method;
	const char *resource;
	EffectRequest *req;

	walk_oauth(run, n, url, &w);
	*start = w.last + 1;

	/* a client-credentials token refused since: ask again, once */
	if (cc && last && lastop && strncmp(lastop, "oauth_", 6) != 0 &&
		(JsonGetInt32(last, "status", 0) == 401 || JsonGetInt32(last, "status", 0) == 403) &&
		w.tokens < 2)
	{
		forced = true;
		forced_scope = record_scope(last);
	}

	have = token_row(url, run->principal, &row);

	/*
	 * a token this step just got is used even when it lives less than a
	 * minute
	 */
	if (!forced && have && (row.fresh || (w.tokens > 0 && row.valid) || run->replay))
	{
		*header = McpOAuthHeader(run, auth, url, use);
		return NULL;
	}
	if (w.tokens >= 3)
		oauth_error(url, "no usable token after three token requests", NULL);

	initStringInfo(&form);
	if (!forced && have && row.refresh_secret && row.token_endpoint && *row.token_endpoint)
	{
		/* refresh before it expires */
		SecretUse	ru;

		SecretUseInit(&ru, run);
		form_add(&form, "grant_type", "refresh_token");
		form_add(&form, "refresh_token",
				 TemplateRenderText(psprintf("{{ secrets.%s }}", row.refresh_secret), JsonEmptyObject(),
									&ru.opts));
		use->values = list_concat(use->values, ru.values);
		form_add(&form, "resource", row.resource);
		endpoint = row.token_endpoint;
		client_id = row.client_id;
		client_secret = row.client_secret;
		method = row.auth_method ? row.auth_method : "none";
		resource = row.resource;
		if (client_secret)
			use->values = lappend(use->values, (char *) client_secret);
	}
	else if (!cc)
	{
		/* an authorization-code grant: a person connects (this raises) */
		*header = McpOAuthHeader(run, auth, url, use);
		return NULL;
	}
	else
	{
		char	   *scope;

		/* discovery, as tuvl.mcp_connect() does it, one request at a time */
		req = discovery_request(run, n, url, &w, have && row.token_endpoint && *row.token_endpoint,
								timeout_ms);
		if (req)
			return req;
		if (w.as)
			endpoint = metadata_url(w.as, "token_endpoint", url);
		else if (have && row.token_endpoint && *row.token_endpoint && w.probe == NULL)
			endpoint = row.token_endpoint;
		else
			endpoint = psprintf("%s/token", origin);
		if (endpoint == NULL)
			oauth_error(url, "the authorization server's metadata has no token_endpoint", NULL);
		resource = w.prm && JsonGetString(w.prm, "resource") ? JsonGetString(w.prm, "resource") : url;
		client_id = JsonGetString(cfg, "client_id");
		client_secret = TemplateRenderText(psprintf("{{ secrets.%s }}", JsonGetString(cfg, "client_secret_secret")),
										   JsonEmptyObject(), &use->opts);
		method = choose_auth_method(w.as ? w.as : JsonEmptyObject(), client_secret);
		if (forced_scope)
			scope = forced_scope;
		else
		{
			OAuthServer s;

			memset(&s, 0, sizeof(s));
			s.www_scope = w.probe ? record_scope(w.probe) : NULL;
			s.prm_scopes = w.prm ? JsonGetJsonb(w.prm, "scopes_supported") : NULL;
			s.as = JsonEmptyObject();	/* no offline_access: nothing to
										 * refresh */
			scope = choose_scope(&s, JsonGetJsonb(cfg, "scopes"));
		}
		form_add(&form, "grant_type", "client_credentials");
		form_add(&form, "scope", scope);
		form_add(&form, "resource", resource);
	}

	return token_effect(run, n, endpoint, &form, client_id, client_secret, method, resource, use,
						timeout_ms);
}


/*
 * The Authorization header an MCP step with mcp.auth sends to url: the
 * bearer token of the URL that the run's principal holds a grant for (its
 * own, else one granted to it), rendered as a secret so that it is
 * redacted from the journal.  Without one, the step fails saying how to
 * get one.
 */
HttpHeader *
McpOAuthHeader(RunState *run, Jsonb *auth, const char *url, SecretUse *use)
{
	static const Oid types[2] = {TEXTOID, OIDOID};
	Jsonb	   *cfg = oauth_config(auth);
	char	   *grant = cfg ? JsonGetString(cfg, "grant") : NULL;
	char	   *name = NULL;
	bool		expired = false;
	bool		connected = SPI_connect() == SPI_OK_CONNECT;
	Oid			principal = run ? run->principal : GetUserId();
	HttpHeader *h;

	if (SecurityExecArgs("SELECT t.secret, t.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now() "
						 TOKEN_FOR_URL_AND_ROLE,
						 SPI_OK_SELECT, 2, types, CStringGetTextDatum(url),
						 ObjectIdGetDatum(principal)) == 1)
	{
		char	   *v = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
		char	   *e = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2);

		name = SPI_palloc(strlen(v) + 1);
		strcpy(name, v);
		expired = e && strcmp(e, "t") == 0;
	}
	if (connected)
		SPI_finish();
	if (name == NULL || expired)
	{
		ExecutorErrorType = "mcp_auth_required";
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("MCP server %s needs an OAuth authorization that role \"%s\" does not hold%s: connect it with tuvl.mcp_connect()",
						HttpRedactUrl(url), run ? run->principal_name : GetUserNameFromId(principal, false),
						expired ? " any more (its token expired)" : ""),
				 errhint("%s", grant && strcmp(grant, "client_credentials") == 0 ?
						 "The client_credentials grant is not available yet: connect with tuvl.mcp_connect() as a person." :
						 "A person connects it with tuvl.mcp_connect(url, auth) and tuvl.mcp_connect_finish(callback_url), as the role that runs the workflow.")));
	}
	h = palloc(sizeof(HttpHeader));
	h->name = "Authorization";
	h->value = psprintf("Bearer %s", TemplateRenderText(psprintf("{{ secrets.%s }}", name),
														JsonEmptyObject(), &use->opts));
	return h;
}

/*
 * Raise for an effect result r that refuses the step's token (401, or 403
 * insufficient_scope): the person has to connect (again), with the scopes
 * the server named.
 */
void
McpOAuthCheckRefused(Jsonb *r, const char *url)
{
	int			status = JsonGetInt32(r, "status", 0);
	Jsonb	   *headers = JsonGetJsonb(r, "headers");
	char	   *www = headers ? JsonGetString(headers, "www-authenticate") : NULL;
	char	   *scope = www ? www_param(www, "scope") : NULL;
	char	   *error = www ? www_param(www, "error") : NULL;

	if (status != 401 && status != 403)
		return;
	ExecutorErrorType = "mcp_auth_required";
	ereport(ERROR,
			(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
			 errmsg("MCP server %s refused the OAuth token (HTTP %d%s%s)%s%s%s: connect it again with tuvl.mcp_connect()",
					HttpRedactUrl(url), status, error ? ", " : "", error ? error : "",
					scope ? ": it needs scopes \"" : "", scope ? scope : "", scope ? "\"" : ""),
			 errhint("A person connects it again with tuvl.mcp_connect(url, auth)%s.",
					 scope ? ", with these scopes in auth.oauth.scopes" : "")));
}
