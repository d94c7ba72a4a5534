/*-------------------------------------------------------------------------
 *
 * metrics.c
 *	  Counters and histograms of what runs do, in shared memory, read
 *	  through the tuvl.metrics view and tuvl.metrics_prometheus().
 *
 * A series is a name, a set of labels (workflow, step, kind, model, ...)
 * and the role whose run it counts; its value is a float8.  The code that
 * executes runs adds to series as things happen (MetricCount,
 * MetricObserveMs); the additions wait in this backend until the
 * transaction commits and are then added to the shared table under one
 * exclusive lock.  A transaction or subtransaction that rolls back counts
 * nothing, so a step that failed and was made again, or a transition a
 * crash cut short, counts once.  Reading takes the lock shared and never
 * scans the journal, so a scrape every few seconds costs a few
 * microseconds per series.
 *
 * The table holds TUVL_METRIC_SERIES series for the whole cluster, in
 * shared memory of a fixed size (HASH_FIXED_SIZE: it never takes the
 * server's free shared memory, which the lock table grows into).  Labels
 * come from run data (a Router's signal, a tool's name), so one role
 * could make any number of series: each role may hold at most
 * tuvl.metric_series_per_role of them (cluster-wide), and an addition to
 * a new series past that quota, or past the table's size, is dropped and
 * counted in tuvl.metrics.dropped, labelled with the role and why.  A
 * second fixed table (metric_roles) keeps, per role, its number of series
 * (key db 0) and, per database, what it had dropped.  Series are never
 * removed: counts start at zero when the server starts, as Prometheus
 * expects of a counter.  Histograms are kept as cumulative buckets (le),
 * a sum and a count.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_authid.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/json.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"

#include "executor/spi.h"
#include "utils/float.h"

#include "admission.h"
#include "jsonutil.h"
#include "metrics.h"
#include "spiutil.h"
#include "tokens.h"
#include "tuvl.h"

PG_FUNCTION_INFO_V1(tuvl_metric_series);

#define TUVL_METRIC_SERIES 8192
#define TUVL_METRIC_ROLES 4096
#define METRIC_LABELS_LEN 384
#define METRIC_VALUE_MAX 63


typedef enum MetricKind
{
	METRIC_COUNTER,
	METRIC_BUCKET
} MetricKind;

typedef struct MetricKey
{
	Oid			db;
	Oid			principal;
	int32		kind;			/* MetricKind */
	int32		bucket;			/* a histogram's bucket: index in
								 * bucket_bounds, or lengthof() for +Inf */
	char		name[METRIC_NAME_LEN];
	char		labels[METRIC_LABELS_LEN];	/* the labels as JSON text */
} MetricKey;

typedef struct MetricEntry
{
	MetricKey	key;
	double		value;
} MetricEntry;

/*
 * A role's use of the table: with db InvalidOid, how many series it holds
 * (in every database); with a database, the additions of its runs there
 * that were dropped.
 */
typedef struct MetricRoleKey
{
	Oid			db;
	Oid			principal;
} MetricRoleKey;

typedef struct MetricRole
{
	MetricRoleKey key;
	int			series;			/* db InvalidOid: series it holds */
	double		over_quota;		/* a database: additions dropped past
								 * tuvl.metric_series_per_role */
	double		table_full;		/* ... and because the table was full */
} MetricRole;

typedef struct MetricsShared
{
	LWLock	   *lock;
	double		dropped;		/* additions dropped because metric_roles had
								 * no room for their role */
} MetricsShared;

static MetricsShared *metrics_shared = NULL;
static HTAB *metrics_table = NULL;
static HTAB *metric_roles = NULL;

/* Additions of this backend's transaction, applied at commit. */
typedef struct PendingMetric
{
	MetricKey	key;
	double		delta;
	int			level;			/* the (sub)transaction nest level */
} PendingMetric;

static PendingMetric *pending = NULL;
static int	n_pending = 0;
static int	max_pending = 0;

/* Histogram bounds of tuvl.step.duration_ms and the like, in ms. */
static const double bucket_bounds[] = {1, 10, 100, 1000, 10000, 60000, 300000};

/* ---------------------------------------------------------------- shared memory */

/*
 * A series' key hashed and compared by what it holds: the name and the
 * labels are strings, most of their fixed-size arrays is zeros, and
 * hashing all of it (448 bytes) for every addition flushed at commit was
 * most of the cost of counting.
 */
static uint32
metric_key_hash(const void *key, Size keysize)
{
	const MetricKey *k = key;
	uint32		h = hash_bytes((const unsigned char *) k, offsetof(MetricKey, name));

	h = hash_combine(h, hash_bytes((const unsigned char *) k->name, strlen(k->name)));
	return hash_combine(h, hash_bytes((const unsigned char *) k->labels, strlen(k->labels)));
}

static int
metric_key_match(const void *key1, const void *key2, Size keysize)
{
	const MetricKey *a = key1;
	const MetricKey *b = key2;

	if (memcmp(a, b, offsetof(MetricKey, name)) != 0 || strcmp(a->name, b->name) != 0)
		return 1;
	return strcmp(a->labels, b->labels);
}

Size
MetricsShmemSize(void)
{
	return add_size(add_size(MAXALIGN(sizeof(MetricsShared)),
							 hash_estimate_size(TUVL_METRIC_SERIES, sizeof(MetricEntry))),
					hash_estimate_size(TUVL_METRIC_ROLES, sizeof(MetricRole)));
}

void
MetricsShmemRequest(void)
{
	RequestAddinShmemSpace(MetricsShmemSize());
	RequestNamedLWLockTranche("tuvl metrics", 1);
}

void
MetricsShmemStartup(void)
{
	bool		found;
	HASHCTL		info;

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	metrics_shared = ShmemInitStruct("tuvl metrics", sizeof(MetricsShared), &found);
	if (!found)
	{
		metrics_shared->lock = &(GetNamedLWLockTranche("tuvl metrics"))->lock;
		metrics_shared->dropped = 0;
	}
	memset(&info, 0, sizeof(info));
	info.keysize = sizeof(MetricKey);
	info.entrysize = sizeof(MetricEntry);
	info.hash = metric_key_hash;
	info.match = metric_key_match;
	/* fixed size: a full table drops series, it never takes more memory */
	metrics_table = ShmemInitHash("tuvl metric series", TUVL_METRIC_SERIES, TUVL_METRIC_SERIES,
								  &info, HASH_ELEM | HASH_FUNCTION | HASH_COMPARE | HASH_FIXED_SIZE);
	memset(&info, 0, sizeof(info));
	info.keysize = sizeof(MetricRoleKey);
	info.entrysize = sizeof(MetricRole);
	metric_roles = ShmemInitHash("tuvl metric roles", TUVL_METRIC_ROLES, TUVL_METRIC_ROLES,
								 &info, HASH_ELEM | HASH_BLOBS | HASH_FIXED_SIZE);
	LWLockRelease(AddinShmemInitLock);
}

/* ---------------------------------------------------------------- adding */

/*
 * Put the first len bytes of s as a JSON string at *p, not past end;
 * false if it does not fit.  Most label values (names of steps, tools,
 * workflows) need no escaping: they are copied whole, as escape_json
 * would write them.
 */
static bool
put_label_string(char **p, const char *end, const char *s, int len)
{
	const char *c = s;

	while (c < s + len && (unsigned char) *c >= 0x20 && *c != '"' && *c != '\\')
		c++;
	if (c < s + len)
	{
		StringInfoData t;
		bool		fits;

		initStringInfo(&t);
		escape_json(&t, pnstrdup(s, len));
		fits = t.len <= end - *p;
		if (fits)
		{
			memcpy(*p, t.data, t.len);
			*p += t.len;
		}
		pfree(t.data);
		return fits;
	}
	if (len + 2 > end - *p)
		return false;
	*(*p)++ = '"';
	memcpy(*p, s, len);
	*p += len;
	*(*p)++ = '"';
	return true;
}

/*
 * The labels as JSON text (values clipped), in the order given, at buf
 * (METRIC_LABELS_LEN bytes); labels too long for it are a marker.
 */
static void
labels_text(char *buf, const MetricLabel *labels, int nlabels)
{
	char	   *p = buf;
	const char *end = buf + METRIC_LABELS_LEN - 2;	/* room for '}' and NUL */

	*p++ = '{';
	for (int i = 0; i < nlabels; i++)
	{
		const char *v = labels[i].value;
		int			len;

		if (v == NULL)
			continue;
		if (p > buf + 1)
		{
			if (end - p < 2)
				goto too_long;
			*p++ = ',';
			*p++ = ' ';
		}
		if (!put_label_string(&p, end, labels[i].name, strlen(labels[i].name)) || end - p < 2)
			goto too_long;
		*p++ = ':';
		*p++ = ' ';
		len = strlen(v);
		if (len > METRIC_VALUE_MAX)
			len = pg_mbcliplen(v, len, METRIC_VALUE_MAX);
		if (!put_label_string(&p, end, v, len))
			goto too_long;
	}
	*p++ = '}';
	*p = '\0';
	return;

too_long:
	memset(buf, 0, METRIC_LABELS_LEN);
	strlcpy(buf, "{\"labels\": \"too long\"}", METRIC_LABELS_LEN);
}

/*
 * The key of series name of principal, zeroed but for what is set: labels
 * is its labels as text already, or NULL (the caller writes them).
 */
static void
make_key(MetricKey *key, const char *name, Oid principal, MetricKind kind, int bucket,
		 const char *labels)
{
	memset(key, 0, sizeof(MetricKey));
	key->db = MyDatabaseId;
	key->principal = principal;
	key->kind = kind;
	key->bucket = bucket;
	strlcpy(key->name, name, METRIC_NAME_LEN);
	if (labels)
		strlcpy(key->labels, labels, METRIC_LABELS_LEN);
}

static void
add_pending(const MetricKey *key, double delta)
{
	int			level = GetCurrentTransactionNestLevel();

	for (int i = n_pending - 1; i >= 0 && pending[i].level == level; i--)
		if (memcmp(&pending[i].key, key, sizeof(MetricKey)) == 0)
		{
			pending[i].delta += delta;
			return;
		}
	if (n_pending == max_pending)
	{
		max_pending = max_pending ? max_pending * 2 : 16;
		pending = pending ? repalloc(pending, max_pending * sizeof(PendingMetric))
			: MemoryContextAlloc(TopMemoryContext, max_pending * sizeof(PendingMetric));
	}
	pending[n_pending].key = *key;
	pending[n_pending].delta = delta;
	pending[n_pending].level = level;
	n_pending++;
}

/*
 * Add delta to counter name of principal's runs, with these labels (a
 * NULL value leaves its label out), when the transaction commits.
 */
void
MetricCount(const char *name, Oid principal, const MetricLabel *labels, int nlabels, double delta)
{
	MetricKey	key;

	if (metrics_table == NULL || !IsTransactionState())
		return;
	make_key(&key, name, principal, METRIC_COUNTER, 0, NULL);
	labels_text(key.labels, labels, nlabels);
	add_pending(&key, delta);
}

/*
 * Observe ms in histogram name: the one bucket it falls in (reading makes
 * them cumulative), its sum (name.sum) and its count (name.count).
 */
void
MetricObserveMs(const char *name, Oid principal, const MetricLabel *labels, int nlabels,
				double ms)
{
	MetricKey	key;
	char		text[METRIC_LABELS_LEN];
	char		part[METRIC_NAME_LEN];
	int			bucket = 0;

	if (metrics_table == NULL || !IsTransactionState())
		return;
	while (bucket < (int) lengthof(bucket_bounds) && ms > bucket_bounds[bucket])
		bucket++;
	labels_text(text, labels, nlabels);
	make_key(&key, name, principal, METRIC_BUCKET, bucket, text);
	add_pending(&key, 1);
	snprintf(part, sizeof(part), "%s.sum", name);
	make_key(&key, part, principal, METRIC_COUNTER, 0, text);
	add_pending(&key, ms);
	snprintf(part, sizeof(part), "%s.count", name);
	make_key(&key, part, principal, METRIC_COUNTER, 0, text);
	add_pending(&key, 1);
}

/* The entry of principal in db of metric_roles (zeroed when new), or NULL. */
static MetricRole *
role_entry(Oid db, Oid principal)
{
	MetricRoleKey key;
	bool		found;
	MetricRole *r;

	memset(&key, 0, sizeof(key));
	key.db = db;
	key.principal = principal;
	r = hash_search(metric_roles, &key, HASH_ENTER_NULL, &found);
	if (r && !found)
	{
		r->series = 0;
		r->over_quota = 0;
		r->table_full = 0;
	}
	return r;
}

/*
 * Add one pending addition to the shared table, creating its series when
 * its role may have another and the table has room; otherwise count it
 * as dropped for its role.  The lock is held exclusively.
 */
static void
flush_one(const PendingMetric *p)
{
	bool		found;
	MetricEntry *e = hash_search(metrics_table, &p->key, HASH_FIND, &found);
	MetricRole *role;
	MetricRole *drops;

	if (e)
	{
		e->value += p->delta;
		return;
	}
	role = role_entry(InvalidOid, p->key.principal);
	if (role && role->series < tuvl_metric_series_per_role &&
		(e = hash_search(metrics_table, &p->key, HASH_ENTER_NULL, &found)) != NULL)
	{
		e->value = p->delta;
		role->series++;
		return;
	}
	drops = role ? role_entry(p->key.db, p->key.principal) : NULL;
	if (drops == NULL)
		metrics_shared->dropped += 1;
	else if (role->series >= tuvl_metric_series_per_role)
		drops->over_quota += 1;
	else
		drops->table_full += 1;
}

/* At commit: add what the transaction counted to the shared table. */
static void
flush_pending(void)
{
	if (n_pending == 0)
		return;
	LWLockAcquire(metrics_shared->lock, LW_EXCLUSIVE);
	for (int i = 0; i < n_pending; i++)
		flush_one(&pending[i]);
	LWLockRelease(metrics_shared->lock);
	n_pending = 0;
}

void
MetricsXactCallback(XactEvent event, void *arg)
{
	if ((event == XACT_EVENT_COMMIT || event == XACT_EVENT_PARALLEL_COMMIT) && metrics_table)
		flush_pending();
	else if (event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT ||
			 event == XACT_EVENT_PREPARE)
		n_pending = 0;
}

/* A subtransaction's additions go to its parent, or away with it. */
void
MetricsSubXactCallback(SubXactEvent event, SubTransactionId mySubid,
					   SubTransactionId parentSubid, void *arg)
{
	int			level = GetCurrentTransactionNestLevel();

	if (event == SUBXACT_EVENT_ABORT_SUB)
	{
		while (n_pending > 0 && pending[n_pending - 1].level >= level)
			n_pending--;
	}
	else if (event == SUBXACT_EVENT_COMMIT_SUB)
	{
		for (int i = n_pending - 1; i >= 0 && pending[i].level >= level; i--)
			pending[i].level = level - 1;
	}
}

/* ---------------------------------------------------------------- reading */

/* May the current user see the series of principal's runs? */
static bool
may_see(Oid principal, bool operator)
{
	return operator || has_privs_of_role(GetUserId(), principal);
}

static void
put_row(ReturnSetInfo *rsinfo, const char *name, const char *kind, const char *labels, double value)
{
	Datum		values[4];
	bool		nulls[4] = {false, false, false, false};

	values[0] = CStringGetTextDatum(name);
	values[1] = CStringGetTextDatum(kind);
	values[2] = JsonbPGetDatum(JsonFromCString(labels));
	values[3] = Float8GetDatum(value);
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
}

/* The bucket counts of one histogram series (one role). */
typedef struct BucketGroup
{
	MetricKey	key;			/* bucket 0 */
	double		counts[lengthof(bucket_bounds) + 1];
} BucketGroup;

/*
 * The histograms among rows, with cumulative buckets: a bucket's count is
 * of the observations at most its bound (le), the last is +Inf.
 */
static void
put_histograms(ReturnSetInfo *rsinfo, List *rows, bool operator)
{
	HASHCTL		ctl;
	HTAB	   *groups;
	HASH_SEQ_STATUS seq;
	BucketGroup *g;
	ListCell   *lc;

	memset(&ctl, 0, sizeof(ctl));
	ctl.keysize = sizeof(MetricKey);
	ctl.entrysize = sizeof(BucketGroup);
	ctl.hcxt = CurrentMemoryContext;
	groups = hash_create("tuvl histograms", 64, &ctl, HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	foreach(lc, rows)
	{
		MetricEntry *c = lfirst(lc);
		MetricKey	k;
		bool		found;

		if (c->key.kind != METRIC_BUCKET ||
			(OidIsValid(c->key.principal) && !may_see(c->key.principal, operator)))
			continue;
		k = c->key;
		k.bucket = 0;
		g = hash_search(groups, &k, HASH_ENTER, &found);
		if (!found)
			memset(g->counts, 0, sizeof(g->counts));
		if (c->key.bucket >= 0 && c->key.bucket <= (int) lengthof(bucket_bounds))
			g->counts[c->key.bucket] += c->value;
	}
	hash_seq_init(&seq, groups);
	while ((g = hash_seq_search(&seq)) != NULL)
	{
		double		cumulative = 0;
		size_t		len = strlen(g->key.labels);
		char	   *open = pnstrdup(g->key.labels, len - 1);	/* without its '}' */

		for (int i = 0; i <= (int) lengthof(bucket_bounds); i++)
		{
			char	   *le = i < (int) lengthof(bucket_bounds) ? psprintf("%g", bucket_bounds[i]) : "+Inf";

			cumulative += g->counts[i];
			put_row(rsinfo, g->key.name, "histogram_bucket",
					psprintf("%s%s\"le\": \"%s\"}", open, len > 2 ? ", " : "", le), cumulative);
		}
	}
}

/* A row of tuvl.metrics.dropped for principal (InvalidOid: none), why, value. */
static MetricEntry *
dropped_row(Oid principal, const char *reason, double value)
{
	MetricEntry *c = palloc0(sizeof(MetricEntry));
	MetricLabel labels[2] = {{"role", NULL}, {"reason", reason}};

	if (OidIsValid(principal))
	{
		labels[0].value = GetUserNameFromId(principal, true);
		if (labels[0].value == NULL)
			labels[0].value = psprintf("%u", principal);
	}
	c->key.db = MyDatabaseId;
	c->key.principal = principal;
	strlcpy(c->key.name, "tuvl.metrics.dropped", METRIC_NAME_LEN);
	labels_text(c->key.labels, labels, lengthof(labels));
	c->value = value;
	return c;
}

/* Copies of the entries of metric_roles of this database.  The lock is held. */
static List *
copy_drops(void)
{
	HASH_SEQ_STATUS seq;
	MetricRole *r;
	List	   *drops = NIL;

	hash_seq_init(&seq, metric_roles);
	while ((r = hash_seq_search(&seq)) != NULL)
		if (r->key.db == MyDatabaseId)
		{
			MetricRole *c = palloc(sizeof(MetricRole));

			*c = *r;
			drops = lappend(drops, c);
		}
	return drops;
}

/*
 * The rows of tuvl.metrics.dropped, per role and reason (role_quota,
 * table_full) from copy_drops(), and, for operators, the additions whose
 * role found no room in metric_roles (roles_full).
 */
static List *
dropped_rows(List *drops, double roles_full, bool operator)
{
	ListCell   *lc;
	List	   *rows = NIL;

	foreach(lc, drops)
	{
		MetricRole *r = lfirst(lc);

		if (r->over_quota > 0)
			rows = lappend(rows, dropped_row(r->key.principal, "role_quota", r->over_quota));
		if (r->table_full > 0)
			rows = lappend(rows, dropped_row(r->key.principal, "table_full", r->table_full));
	}
	if (operator && roles_full > 0)
		rows = lappend(rows, dropped_row(InvalidOid, "roles_full", roles_full));
	return rows;
}

/*
 * The model admission series (admission.c), per model config, for the
 * operators and the roles that own the config.
 */
static void
put_admission(ReturnSetInfo *rsinfo, bool operator)
{
	ListCell   *lc;

	foreach(lc, AdmissionMetrics())
	{
		AdmitMetric *m = lfirst(lc);
		MetricLabel labels[1] = {{"config", m->config}};
		char		buf[METRIC_LABELS_LEN];

		if (OidIsValid(m->owner) ? !may_see(m->owner, operator) : !operator)
			continue;
		labels_text(buf, labels, m->config[0] ? 1 : 0);
		put_row(rsinfo, m->name, m->kind, buf, m->value);
	}
}

/*
 * tuvl._metric_series(): the series of this database the caller may see
 * (its own roles' runs; every run for tuvl_operator): name, kind, labels,
 * value, one row per role.  tuvl.metrics sums them.
 */
Datum
tuvl_metric_series(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	Oid			op = get_role_oid("tuvl_operator", true);
	bool		operator = superuser() || (OidIsValid(op) && has_privs_of_role(GetUserId(), op));
	HASH_SEQ_STATUS seq;
	MetricEntry *e;
	List	   *rows = NIL;
	List	   *drops;
	double		roles_full;
	ListCell   *lc;

	TokenRequireScope("runs:read");
	InitMaterializedSRF(fcinfo, 0);
	if (metrics_table == NULL)
		PG_RETURN_VOID();

	/* copy under the lock, build the tuples after it */
	LWLockAcquire(metrics_shared->lock, LW_SHARED);
	hash_seq_init(&seq, metrics_table);
	while ((e = hash_seq_search(&seq)) != NULL)
		if (e->key.db == MyDatabaseId)
		{
			MetricEntry *c = palloc(sizeof(MetricEntry));

			*c = *e;
			rows = lappend(rows, c);
		}
	drops = copy_drops();
	roles_full = metrics_shared->dropped;
	LWLockRelease(metrics_shared->lock);
	rows = list_concat(rows, dropped_rows(drops, roles_full, operator));

	foreach(lc, rows)
	{
		MetricEntry *c = lfirst(lc);

		if (OidIsValid(c->key.principal) && !may_see(c->key.principal, operator))
			continue;
		if (c->key.kind == METRIC_BUCKET)
			continue;
		put_row(rsinfo, c->key.name, "counter", c->key.labels, c->value);
	}
	put_histograms(rsinfo, rows, operator);
	put_admission(rsinfo, operator);
	PG_RETURN_VOID();
}

PG_FUNCTION_INFO_V1(tuvl_model_admission_waits);

/*
 * tuvl._model_admission_waits(): the model calls of this database waiting
 * for their config's limits now (admission.c), those of the caller's
 * roles' runs (every run's for tuvl_operator): run_id, config, since,
 * reason.
 */
Datum
tuvl_model_admission_waits(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	Oid			op = get_role_oid("tuvl_operator", true);
	bool		operator = superuser() || (OidIsValid(op) && has_privs_of_role(GetUserId(), op));
	ListCell   *lc;

	TokenRequireScope("runs:read");
	InitMaterializedSRF(fcinfo, 0);
	foreach(lc, AdmissionWaits())
	{
		AdmitWait  *w = lfirst(lc);
		Datum		values[4];
		bool		nulls[4] = {false, false, false, false};

		if (!may_see(w->principal, operator))
			continue;
		values[0] = Int64GetDatum(w->run_id);
		values[1] = CStringGetTextDatum(w->config);
		values[2] = TimestampTzGetDatum(w->since);
		values[3] = CStringGetTextDatum(w->reason);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	PG_RETURN_VOID();
}

/* ---------------------------------------------------------------- Prometheus */

PG_FUNCTION_INFO_V1(tuvl_metrics_prometheus);

/* A metric name as Prometheus spells it: [a-zA-Z0-9_], dots become _. */
static char *
prom_name(const char *name)
{
	char	   *s = pstrdup(name);

	for (char *p = s; *p; p++)
		if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9')))
			*p = '_';
	return s;
}

/* {k="v",...} of a labels object, values escaped, or "" when empty. */
static void
append_labels(StringInfo buf, Jsonb *labels)
{
	JsonbIterator *it = JsonbIteratorInit(&labels->root);
	JsonbValue	v;
	char	   *key;
	bool		first = true;

	while (JsonObjectNext(&it, &key, &v))
	{
		char	   *val = v.type == jbvString ? pnstrdup(v.val.string.val, v.val.string.len)
		: JsonValueToText(&v);

		appendStringInfoString(buf, first ? "{" : ",");
		appendStringInfo(buf, "%s=\"", prom_name(key));
		for (char *p = val; *p; p++)
		{
			if (*p == '\\' || *p == '"')
				appendStringInfoChar(buf, '\\');
			if (*p == '\n')
				appendStringInfoString(buf, "\\n");
			else
				appendStringInfoChar(buf, *p);
		}
		appendStringInfoChar(buf, '"');
		first = false;
	}
	if (!first)
		appendStringInfoChar(buf, '}');
}

/* Is name "<a histogram's name>.sum" or ".count"?  *base gets the histogram's. */
static bool
histogram_part(const char *name, List *histograms, char **base, const char **suffix)
{
	const char *dot = strrchr(name, '.');
	ListCell   *lc;

	if (dot == NULL || (strcmp(dot, ".sum") != 0 && strcmp(dot, ".count") != 0))
		return false;
	foreach(lc, histograms)
	{
		if (strlen(lfirst(lc)) == (size_t) (dot - name) && strncmp(lfirst(lc), name, dot - name) == 0)
		{
			*base = lfirst(lc);
			*suffix = strcmp(dot, ".sum") == 0 ? "_sum" : "_count";
			return true;
		}
	}
	return false;
}

/*
 * tuvl.metrics_prometheus(): tuvl.metrics in the Prometheus text format
 * (version 0.0.4): counters as <name>_total, gauges, and histograms as
 * _bucket, _sum and _count, dots in names as underscores.  Reads the view
 * as the caller, so a role sees what tuvl.metrics shows it.
 */
Datum
tuvl_metrics_prometheus(PG_FUNCTION_ARGS)
{
	StringInfoData buf;
	List	   *histograms = NIL;
	char	   *family = NULL;
	uint64		n;

	TokenRequireScope("runs:read");
	initStringInfo(&buf);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "could not connect to SPI");
	n = SpiExec("SELECT name, kind, labels, value FROM tuvl.metrics ORDER BY name, labels::pg_catalog.text",
				0, NULL, NULL, NULL, SPI_OK_SELECT);
	for (uint64 i = 0; i < n; i++)
		if (strcmp(SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 2), "histogram_bucket") == 0)
		{
			char	   *name = SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1);

			if (histograms == NIL || strcmp(llast(histograms), name) != 0)
				histograms = lappend(histograms, name);
		}
	for (uint64 i = 0; i < n; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	td = SPI_tuptable->tupdesc;
		char	   *name = SPI_getvalue(tup, td, 1);
		char	   *kind = SPI_getvalue(tup, td, 2);
		bool		isnull;
		Jsonb	   *labels = DatumGetJsonbP(SPI_getbinval(tup, td, 3, &isnull));
		double		value = DatumGetFloat8(SPI_getbinval(tup, td, 4, &isnull));
		char	   *base;
		const char *suffix;
		char	   *fam;
		char	   *sample;
		const char *type;

		if (strcmp(kind, "histogram_bucket") == 0)
		{
			fam = prom_name(name);
			sample = psprintf("%s_bucket", fam);
			type = "histogram";
		}
		else if (strcmp(kind, "counter") == 0 && histogram_part(name, histograms, &base, &suffix))
		{
			fam = prom_name(base);
			sample = psprintf("%s%s", fam, suffix);
			type = "histogram";
		}
		else if (strcmp(kind, "counter") == 0)
		{
			fam = prom_name(name);
			if (strlen(fam) < 6 || strcmp(fam + strlen(fam) - 6, "_total") != 0)
				fam = psprintf("%s_total", fam);
			sample = fam;
			type = "counter";
		}
		else
		{
			fam = prom_name(name);
			sample = fam;
			type = "gauge";
		}
		if (family == NULL || strcmp(family, fam) != 0)
		{
			appendStringInfo(&buf, "# TYPE %s %s\n", fam, type);
			family = fam;
		}
		appendStringInfoString(&buf, sample);
		append_labels(&buf, labels);
		appendStringInfo(&buf, " %s\n", float8out_internal(value));
	}
	SPI_finish();
	PG_RETURN_TEXT_P(cstring_to_text(buf.data));
}
