/*-------------------------------------------------------------------------
 *
 * channel.c
 *	  The NOTIFY channels of the journal: one per role, unguessable, and
 *	  one for the operators.
 *
 * PostgreSQL has no privileges on channels: any role may LISTEN on, or
 * NOTIFY, any channel it can name.  So each role gets a channel no other
 * role can name: "tuvl_" and the first 128 bits, in hex, of an HMAC-SHA256
 * of "role:<oid>" keyed by a secret of the database (tuvl.notify_secret,
 * 32 random bytes made by CREATE EXTENSION, readable only by the
 * extension's owner).  The operators' channel is the HMAC of "operators".
 * A journal event is announced on the channel of its run's principal and
 * on the operators' channel (journal.c); tuvl.events_channel() tells the
 * calling role which one to LISTEN on.
 *
 * Every event asks for its principal's channel, so channels are computed
 * once per role and backend and kept in a small hash in
 * TopMemoryContext, with the secret.  Both are forgotten when tuvl's
 * relcache entry of tuvl.notify_secret is invalidated: when
 * tuvl.rotate_events_channels() changes the secret (it invalidates the
 * relation explicitly, which every backend hears of at its commit), and
 * when the extension is dropped.  Reading the secret needs SPI and a
 * transaction; it runs as the extension's owner.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "catalog/namespace.h"
#include "common/hmac.h"
#include "common/sha2.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"

#include "channel.h"
#include "security.h"
#include "spiutil.h"

PG_FUNCTION_INFO_V1(tuvl_events_channel);
PG_FUNCTION_INFO_V1(tuvl_rotate_events_channels);

/* "tuvl_" and 32 hex digits: well within NAMEDATALEN - 1 */
#define CHANNEL_HEX 32
#define CHANNEL_LEN (5 + CHANNEL_HEX + 1)
#define SECRET_LEN 32

typedef struct RoleChannel
{
	Oid			role;
	char		name[CHANNEL_LEN];
} RoleChannel;

static bool secret_known = false;
static uint8 secret[SECRET_LEN];
static Oid	secret_relid = InvalidOid;	/* tuvl.notify_secret */
static char operators_channel[CHANNEL_LEN];
static HTAB *role_channels = NULL;

/* Forget the secret and every channel (the secret changed, or is gone). */
static void
forget_channels(Datum arg, Oid relid)
{
	if (!secret_known || (OidIsValid(relid) && relid != secret_relid))
		return;
	secret_known = false;
	if (role_channels)
		hash_destroy(role_channels);
	role_channels = NULL;
}

/* Install the invalidation callback; from _PG_init. */
void
ChannelInit(void)
{
	CacheRegisterRelcacheCallback(forget_channels, (Datum) 0);
}

/*
 * The channel of label: "tuvl_" and the first CHANNEL_HEX hex digits of
 * HMAC-SHA256(secret, label), at out (CHANNEL_LEN bytes).
 */
static void
channel_of(const char *label, char *out)
{
	pg_hmac_ctx *ctx = pg_hmac_create(PG_SHA256);
	uint8		mac[PG_SHA256_DIGEST_LENGTH];

	if (ctx == NULL ||
		pg_hmac_init(ctx, secret, SECRET_LEN) < 0 ||
		pg_hmac_update(ctx, (const uint8 *) label, strlen(label)) < 0 ||
		pg_hmac_final(ctx, mac, sizeof(mac)) < 0)
		elog(ERROR, "could not compute the channel of \"%s\": %s", label,
			 ctx ? pg_hmac_error(ctx) : "out of memory");
	pg_hmac_free(ctx);
	memcpy(out, "tuvl_", 5);
	hex_encode((const char *) mac, CHANNEL_HEX / 2, out + 5);
	out[CHANNEL_LEN - 1] = '\0';
}

/* Read the secret (once per backend, until it changes).  SPI connected. */
static void
load_secret(void)
{
	bool		isnull;
	bytea	   *b;
	HASHCTL		ctl;

	if (secret_known)
		return;
	if (SecurityExec("SELECT s.secret, 'tuvl.notify_secret'::pg_catalog.regclass::pg_catalog.oid "
					 "FROM tuvl.notify_secret s", 0, NULL, NULL, NULL, SPI_OK_SELECT) != 1)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("tuvl.notify_secret must hold one row"),
				 errhint("A member of tuvl_admin can make a new one with tuvl.rotate_events_channels().")));
	b = DatumGetByteaPP(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	if (isnull || VARSIZE_ANY_EXHDR(b) != SECRET_LEN)
		elog(ERROR, "tuvl.notify_secret does not hold %d bytes", SECRET_LEN);
	memcpy(secret, VARDATA_ANY(b), SECRET_LEN);
	secret_relid = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2,
												  &isnull));
	channel_of("operators", operators_channel);
	memset(&ctl, 0, sizeof(ctl));
	ctl.keysize = sizeof(Oid);
	ctl.entrysize = sizeof(RoleChannel);
	ctl.hcxt = TopMemoryContext;
	role_channels = hash_create("tuvl role channels", 64, &ctl, HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	secret_known = true;
}

/*
 * The channel of role's runs.  The result lives until the secret changes:
 * copy it to keep it.  SPI connected; may read the secret.
 */
const char *
ChannelOfRole(Oid role)
{
	RoleChannel *c;
	bool		found;

	load_secret();
	c = hash_search(role_channels, &role, HASH_ENTER, &found);
	if (!found)
	{
		char		label[32];

		snprintf(label, sizeof(label), "role:%u", role);
		channel_of(label, c->name);
	}
	return c->name;
}

/* The operators' channel, which carries every run's events.  As ChannelOfRole. */
const char *
ChannelOfOperators(void)
{
	load_secret();
	return operators_channel;
}

/*
 * tuvl.events_channel(): the channel the calling role LISTENs on: the
 * operators' for a member of tuvl_operator (or tuvl_admin, or a
 * superuser), its own otherwise.  EXECUTE is granted to tuvl_user.
 */
Datum
tuvl_events_channel(PG_FUNCTION_ARGS)
{
	char		name[CHANNEL_LEN];

	SPI_connect();
	strlcpy(name, SecurityIsOperator(GetUserId()) ? ChannelOfOperators() : ChannelOfRole(GetUserId()),
			sizeof(name));
	SPI_finish();
	PG_RETURN_TEXT_P(cstring_to_text(name));
}

/*
 * tuvl.rotate_events_channels(): a new secret, so new channels for every
 * role and the operators: a role that knew another channel (an operator
 * whose membership was revoked) hears nothing more on it.  Every backend
 * forgets its channels when this transaction commits.  tuvl_admin only.
 */
Datum
tuvl_rotate_events_channels(PG_FUNCTION_ARGS)
{
	Oid			relid;

	SPI_connect();
	SecurityExec("UPDATE tuvl.notify_secret SET secret = pg_catalog.decode(pg_catalog.replace("
				 "  pg_catalog.gen_random_uuid()::pg_catalog.text OPERATOR(pg_catalog.||) "
				 "  pg_catalog.gen_random_uuid()::pg_catalog.text, '-', ''), 'hex'), "
				 "  rotated_at = pg_catalog.now()",
				 0, NULL, NULL, NULL, SPI_OK_UPDATE);
	SPI_finish();
	relid = get_relname_relid("notify_secret", get_namespace_oid("tuvl", false));
	if (OidIsValid(relid))
		CacheInvalidateRelcacheByRelid(relid);
	PG_RETURN_VOID();
}
