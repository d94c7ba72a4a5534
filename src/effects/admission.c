/*-------------------------------------------------------------------------
 *
 * admission.c
 *	  Model admission: a model config's `limits: {rpm, tpm, concurrency}`,
 *	  kept in shared memory for every worker (and tuvl.run() backend) of
 *	  the database, and the pause a provider's 429 imposes on all of them.
 *
 * Structs.  AdmitShared holds a fixed table of AdmitConfig (one per
 * database and config name with limits, tuvl.max_model_limits of them)
 * and a fixed pool of AdmitTicket (tuvl.model_admission_slots): one ticket
 * per model call from the moment it asks to be sent until its answer is
 * in, whatever process asked.  A config's window is a ring of buckets of
 * BUCKET_MS: the requests and (estimated, then corrected) tokens admitted
 * in each.  A bucket counts until WINDOW_MS + MARGIN_MS (plus the config's
 * late_ms) after its end, so
 * any 60 s window a provider measures sees no more than the limits.
 *
 * Rules a change must not break:
 * - Everything here runs outside any transaction and never raises while
 *   the lock is held; the lock is the one LWLock of this file.
 * - The clock is read once the lock is held (lock_and_now), never before:
 *   a time read before waiting for the lock may be older than a bucket
 *   that another process has since counted calls in.
 * - A call is granted in order: among the waiting tickets of a config,
 *   the highest priority first, then the role served longest ago (fair
 *   across roles), then the oldest run, then the longest waiting.  The
 *   best ticket that does not fit blocks the others (no overtaking).
 * - Whoever frees budget (an answer, a pause that ends, a ticket given
 *   up) grants what now fits and sets the granted owners' latches; a
 *   waiting owner also wakes by itself when the window frees (retry_at).
 * - A process that exits gives its tickets back (before_shmem_exit); a
 *   crash restart resets the segment, and with it the windows.
 * - A granted call is counted in the bucket of the moment it is sent
 *   (AdmissionSent moves it there from its grant's): a provider counts
 *   a request when it arrives, and a busy worker may send a call it was
 *   granted some time after the grant.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "pgstat.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "storage/proc.h"
#include "storage/shmem.h"
#include "utils/timestamp.h"

#include "admission.h"
#include "tuvl.h"

/*
 * The window (tuvl.model_limits_window, 1 min) in buckets of a 120th of
 * it (at least 10 ms), each counted until the window plus a margin after
 * its end: at most NBUCKETS of them count at once.
 */
#define NBUCKETS 160
#define WINDOW_MS ((int64) tuvl_model_limits_window)
#define BUCKET_MS Max((int64) 10, WINDOW_MS / 120)
#define MARGIN_MS Min((int64) 100, 4 * BUCKET_MS)
#define MAX_LATE_MS (WINDOW_MS / 40)	/* late_ms: at most 2.5 % of the rate */
#define PACE 2					/* a bucket admits at most twice its share */
#define DEFAULT_PAUSE_MS 1000	/* a 429 without Retry-After */
#define FAIR_ROLES 16
#define FULL_RETRY_MS 100		/* no ticket free: ask again then */

typedef enum TicketState
{
	TICKET_FREE = 0,
	TICKET_WAITING,
	TICKET_GRANTED
} TicketState;

typedef struct AdmitTicket
{
	int			state;			/* TicketState */
	int			config;			/* index in configs */
	int			pid;			/* the owner */
	Latch	   *latch;
	int			priority;
	TimestampTz age;
	TimestampTz since;			/* asked at */
	Oid			principal;
	int64		run_id;
	int64		tokens;			/* as counted in the bucket */
	int64		input;			/* of which the request's own estimate */
	int64		bucket;			/* granted in */
	bool		waited;			/* not granted when first asked */
	int64		late_ms;		/* the config's late_ms when it was counted */
} AdmitTicket;

typedef struct AdmitConfig
{
	bool		in_use;
	Oid			db;
	char		name[NAMEDATALEN];
	Oid			owner;
	int			rpm;
	int			tpm;
	int			concurrency;
	int64		bucket_ms;		/* BUCKET_MS when the buckets were filled */
	int64		bucket_no[NBUCKETS];
	int32		reqs[NBUCKETS];
	int64		toks[NBUCKETS];
	int			in_flight;
	int			waiting;
	double		avg_extra;		/* tokens an answer adds to its request's
								 * estimate, on average (the output) */
	TimestampTz paused_until;
	int64		late_ms;		/* counted this much longer: learned from 429s
								 * the limits did not prevent */
	TimestampTz pass_due;		/* when a waiting call may fit again
								 * (DT_NOEND: only when room is freed) */
	TimestampTz last_used;
	Oid			fair_role[FAIR_ROLES];
	TimestampTz fair_at[FAIR_ROLES];
	/* counters for tuvl.metrics */
	double		admitted;
	double		waited;
	double		wait_ms;
	double		rate_limited;
	double		throttled_ms;
} AdmitConfig;

typedef struct AdmitShared
{
	LWLock	   *lock;
	int			nconfigs;
	int			ntickets;
	int			high;			/* tickets [0, high) may be in use */
	double		unlimited;		/* calls sent unlimited: no config room */
	AdmitConfig *configs;		/* in the same segment */
	AdmitTicket *tickets;
} AdmitShared;

static AdmitShared *admit = NULL;
static bool exit_registered = false;

Size
AdmissionShmemSize(void)
{
	Size		s = MAXALIGN(sizeof(AdmitShared));

	s = add_size(s, MAXALIGN(mul_size(sizeof(AdmitConfig), tuvl_max_model_limits)));
	return add_size(s, mul_size(sizeof(AdmitTicket), tuvl_model_admission_slots));
}

void
AdmissionShmemRequest(void)
{
	RequestAddinShmemSpace(AdmissionShmemSize());
	RequestNamedLWLockTranche("tuvl admission", 1);
}

void
AdmissionShmemStartup(void)
{
	bool		found;
	char	   *base;

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	base = ShmemInitStruct("tuvl admission", AdmissionShmemSize(), &found);
	admit = (AdmitShared *) base;
	if (!found)
	{
		memset(base, 0, AdmissionShmemSize());
		admit->lock = &(GetNamedLWLockTranche("tuvl admission"))->lock;
		admit->nconfigs = tuvl_max_model_limits;
		admit->ntickets = tuvl_model_admission_slots;
	}
	/* pointers are per process: the segment is at the same address in all */
	admit->configs = (AdmitConfig *) (base + MAXALIGN(sizeof(AdmitShared)));
	admit->tickets = (AdmitTicket *) (base + MAXALIGN(sizeof(AdmitShared)) +
									  MAXALIGN(mul_size(sizeof(AdmitConfig), admit->nconfigs)));
	LWLockRelease(AddinShmemInitLock);
}

/*
 * A request's tokens before it is sent: its characters / 4 (bytes, which
 * are at least as many), at least 1, as providers estimate them.
 */
int64
AdmissionEstimateTokens(size_t body_len)
{
	return Max((int64) 1, (int64) ((body_len + 3) / 4));
}

static int64
ms_of(TimestampTz t)
{
	return (int64) (t / 1000);
}

/* When bucket b of c stops counting. */
static TimestampTz
bucket_expiry(AdmitConfig *c, int64 b)
{
	return (TimestampTz) (((b + 1) * BUCKET_MS + WINDOW_MS + MARGIN_MS + c->late_ms) * (int64) 1000);
}

/* Requests and tokens of c's window at now; stale buckets are emptied. */
static void
window_sums(AdmitConfig *c, TimestampTz now, int64 *reqs, int64 *toks)
{
	int64		cur = ms_of(now) / BUCKET_MS;

	*reqs = 0;
	*toks = 0;
	for (int i = 0; i < NBUCKETS; i++)
	{
		if (c->bucket_no[i] == 0)
			continue;
		if (c->bucket_no[i] > cur || bucket_expiry(c, c->bucket_no[i]) <= now)
		{
			c->bucket_no[i] = 0;
			c->reqs[i] = 0;
			c->toks[i] = 0;
			continue;
		}
		*reqs += c->reqs[i];
		*toks += c->toks[i];
	}
}

/*
 * When c's window will have room for one more request of tokens, given
 * its sums (0: it has room now).
 */
static TimestampTz
window_room_at(AdmitConfig *c, TimestampTz now, int64 reqs, int64 toks, int64 tokens)
{
	int64		cur = ms_of(now) / BUCKET_MS;
	int64		need_r = c->rpm > 0 ? reqs + 1 - c->rpm : 0;
	int64		need_t = c->tpm > 0 && toks > 0 ? toks + Min(tokens, c->tpm) - c->tpm : 0;

	if (need_r <= 0 && need_t <= 0)
		return 0;
	/* oldest buckets first: they leave the window first */
	for (int64 b = cur - NBUCKETS + 1; b <= cur; b++)
	{
		int			i = (int) (b % NBUCKETS);

		if (c->bucket_no[i] != b)
			continue;
		need_r -= c->reqs[i];
		need_t -= c->toks[i];
		if (need_r <= 0 && need_t <= 0)
			return bucket_expiry(c, b);
	}
	return TimestampTzPlusMilliseconds(now, BUCKET_MS);
}

/*
 * When the bucket of now may admit one more call of tokens, given its
 * pace (0: now): at most PACE times its even share of rpm and tpm (a
 * 120th), and at least one call.  A burst of calls admitted at once
 * reaches the provider spread over as long as the machine takes to send
 * them; their places in tuvl's window all free at once a window later,
 * and the next burst would reach the provider before the last of the
 * previous one has left its window.  Paced, calls go out as they are
 * admitted.
 */
static TimestampTz
pace_room_at(AdmitConfig *c, TimestampTz now, int64 tokens)
{
	int64		cur = ms_of(now) / BUCKET_MS;
	int			bi = (int) (cur % NBUCKETS);
	int64		reqs = c->bucket_no[bi] == cur ? c->reqs[bi] : 0;
	int64		toks = c->bucket_no[bi] == cur ? c->toks[bi] : 0;
	int64		share_r = PACE * (((int64) c->rpm * BUCKET_MS + WINDOW_MS - 1) / WINDOW_MS);
	int64		share_t = PACE * (((int64) c->tpm * BUCKET_MS + WINDOW_MS - 1) / WINDOW_MS);

	if (reqs == 0)
		return 0;
	if ((c->rpm > 0 && reqs >= share_r) || (c->tpm > 0 && toks + tokens > share_t))
		return (TimestampTz) ((cur + 1) * BUCKET_MS * (int64) 1000);
	return 0;
}

/* When principal was last granted a call of c (0: not lately). */
static TimestampTz
fair_last(AdmitConfig *c, Oid principal)
{
	for (int i = 0; i < FAIR_ROLES; i++)
		if (c->fair_role[i] == principal)
			return c->fair_at[i];
	return 0;
}

static void
fair_note(AdmitConfig *c, Oid principal, TimestampTz now)
{
	int			oldest = 0;

	for (int i = 0; i < FAIR_ROLES; i++)
	{
		if (c->fair_role[i] == principal)
		{
			c->fair_at[i] = now;
			return;
		}
		if (c->fair_at[i] < c->fair_at[oldest])
			oldest = i;
	}
	c->fair_role[oldest] = principal;
	c->fair_at[oldest] = now;
}

/* Does waiting ticket a come before b? */
static bool
ticket_before(AdmitConfig *c, AdmitTicket *a, AdmitTicket *b)
{
	TimestampTz fa,
				fb;

	if (a->priority != b->priority)
		return a->priority > b->priority;
	fa = fair_last(c, a->principal);
	fb = fair_last(c, b->principal);
	if (fa != fb)
		return fa < fb;
	if (a->age != b->age)
		return a->age < b->age;
	return a->since < b->since;
}

/*
 * Grant config ci's waiting tickets in order while they fit; returns when
 * the first that does not fit may (0: on a wake-up only, or none waits).
 * The lock is held exclusively.
 */
static TimestampTz grant_pass_inner(int ci, TimestampTz now);

static TimestampTz
grant_pass(int ci, TimestampTz now)
{
	AdmitConfig *c = &admit->configs[ci];
	TimestampTz at = grant_pass_inner(ci, now);

	/* until then, asking again cannot grant anything: no pass is needed */
	c->pass_due = at != 0 ? at : c->waiting > 0 ? DT_NOEND : 0;
	return at;
}

static TimestampTz
grant_pass_inner(int ci, TimestampTz now)
{
	AdmitConfig *c = &admit->configs[ci];

	while (c->waiting > 0)
	{
		AdmitTicket *best = NULL;
		int64		reqs,
					toks;
		TimestampTz at;

		for (int i = 0; i < admit->high; i++)
		{
			AdmitTicket *t = &admit->tickets[i];

			if (t->state == TICKET_WAITING && t->config == ci &&
				(best == NULL || ticket_before(c, t, best)))
				best = t;
		}
		if (best == NULL)
		{
			c->waiting = 0;
			return 0;
		}
		if (c->paused_until > now)
			return c->paused_until;
		if (c->concurrency > 0 && c->in_flight >= c->concurrency)
			return 0;

		/*
		 * Counted with the output answers have added lately: a call in flight
		 * will be corrected up by about that much.
		 */
		best->tokens = best->input + (int64) Max(0.0, c->avg_extra);
		window_sums(c, now, &reqs, &toks);
		at = window_room_at(c, now, reqs, toks, best->tokens);
		if (at == 0)
			at = pace_room_at(c, now, best->tokens);
		if (at != 0)
			return at;
		/* granted: counted in this bucket */
		best->bucket = ms_of(now) / BUCKET_MS;
		{
			int			bi = (int) (best->bucket % NBUCKETS);

			if (c->bucket_no[bi] != best->bucket)
			{
				c->bucket_no[bi] = best->bucket;
				c->reqs[bi] = 0;
				c->toks[bi] = 0;
			}
			c->reqs[bi]++;
			c->toks[bi] += best->tokens;
		}
		best->state = TICKET_GRANTED;
		best->late_ms = c->late_ms;
		c->waiting--;
		c->in_flight++;
		c->admitted++;
		c->last_used = now;
		fair_note(c, best->principal, now);
		if (best->waited)
		{
			c->waited++;
			c->wait_ms += (double) (now - best->since) / 1000.0;
		}
		if (best->latch && best->pid != MyProcPid)
			SetLatch(best->latch);
	}
	return 0;
}

/*
 * A pass on behalf of an ask: only when one may grant something (the
 * calls waiting may fit by now), so that thousands of waiting calls
 * asking again cost a comparison each, not a scan.  Returns when to ask
 * again (0: on a wake-up).
 */
static TimestampTz
ask_pass(int ci, TimestampTz now)
{
	AdmitConfig *c = &admit->configs[ci];

	if (c->waiting > 1 && c->pass_due != 0 && now < c->pass_due)
		return c->pass_due == DT_NOEND ? 0 : c->pass_due;
	return grant_pass(ci, now);
}

/*
 * Take the lock (exclusively) and read the clock: in that order, so that
 * every holder of the lock sees a time no earlier than the one before it
 * saw.  A time read before waiting for the lock can be a bucket older
 * than a bucket another process has since counted calls in, and
 * window_sums() takes a bucket newer than now for a leftover of a clock
 * set back and empties it: those calls would no longer count, and as
 * many more would be granted (on a loaded machine, with the short
 * buckets of a short window, every few minutes).
 */
static TimestampTz
lock_and_now(void)
{
	LWLockAcquire(admit->lock, LW_EXCLUSIVE);
	return GetCurrentTimestamp();
}

/* Give back the tickets of this process when it exits. */
static void
release_mine(int code, Datum arg)
{
	TimestampTz now;

	if (admit == NULL)
		return;
	now = lock_and_now();
	for (int i = 0; i < admit->high; i++)
	{
		AdmitTicket *t = &admit->tickets[i];

		if (t->state == TICKET_FREE || t->pid != MyProcPid)
			continue;
		if (t->state == TICKET_WAITING)
			admit->configs[t->config].waiting--;
		else
			admit->configs[t->config].in_flight--;
		t->state = TICKET_FREE;
		(void) grant_pass(t->config, now);
	}
	LWLockRelease(admit->lock);
}

/* The config entry of spec in this database, made if need be; -1: full. */
static int
config_entry(AdmitSpec *spec, TimestampTz now)
{
	int			free_i = -1;
	int			idle_i = -1;
	AdmitConfig *c;

	for (int i = 0; i < admit->nconfigs; i++)
	{
		c = &admit->configs[i];
		if (!c->in_use)
		{
			if (free_i < 0)
				free_i = i;
			continue;
		}
		if (c->db == MyDatabaseId && strcmp(c->name, spec->config) == 0)
		{
			/* the newest limits seen apply to every version's calls */
			c->rpm = spec->rpm;
			c->tpm = spec->tpm;
			c->concurrency = spec->concurrency;
			c->owner = spec->owner;
			if (c->bucket_ms != BUCKET_MS)
			{
				/* the window changed (a reload): count afresh */
				memset(c->bucket_no, 0, sizeof(c->bucket_no));
				c->bucket_ms = BUCKET_MS;
			}
			return i;
		}
		/* an entry unused for two windows can be given to another config */
		if (c->waiting == 0 && c->in_flight == 0 && c->paused_until < now &&
			TimestampDifferenceExceeds(c->last_used, now, 2 * WINDOW_MS))
			idle_i = i;
	}
	if (free_i < 0)
		free_i = idle_i;
	if (free_i < 0)
		return -1;
	c = &admit->configs[free_i];
	memset(c, 0, sizeof(AdmitConfig));
	c->in_use = true;
	c->db = MyDatabaseId;
	strlcpy(c->name, spec->config, NAMEDATALEN);
	c->owner = spec->owner;
	c->rpm = spec->rpm;
	c->tpm = spec->tpm;
	c->concurrency = spec->concurrency;
	c->bucket_ms = BUCKET_MS;
	c->last_used = now;
	return free_i;
}

/* A free ticket, or -1. */
static int
ticket_take(void)
{
	for (int i = 0; i < admit->ntickets; i++)
		if (admit->tickets[i].state == TICKET_FREE)
		{
			if (i >= admit->high)
				admit->high = i + 1;
			return i;
		}
	return -1;
}

/*
 * May spec's call be sent now?  The first ask takes a ticket (which
 * spec->ticket then names); later asks look at it.  ADMIT_WAIT: ask
 * again at *retry_at, or when the latch is set (0: only then).  Without
 * shared memory (not preloaded) or room in it, ADMIT_UNLIMITED, and the
 * call goes unlimited: the config table full is counted in
 * tuvl.llm.admission.unlimited.
 */
AdmitResult
AdmissionAsk(AdmitSpec *spec, TimestampTz *retry_at)
{
	TimestampTz now;
	AdmitResult result;

	*retry_at = 0;
	if (admit == NULL)
		return ADMIT_UNLIMITED;
	if (!exit_registered)
	{
		before_shmem_exit(release_mine, (Datum) 0);
		exit_registered = true;
	}
	now = lock_and_now();
	if (spec->ticket < 0)
	{
		int			ci = config_entry(spec, now);
		int			ti;
		AdmitTicket *t;

		if (ci < 0)
		{
			admit->unlimited++;
			LWLockRelease(admit->lock);
			return ADMIT_UNLIMITED;
		}
		ti = ticket_take();
		if (ti < 0)
		{
			LWLockRelease(admit->lock);
			*retry_at = TimestampTzPlusMilliseconds(now, FULL_RETRY_MS);
			return ADMIT_WAIT;
		}
		t = &admit->tickets[ti];
		memset(t, 0, sizeof(AdmitTicket));
		t->state = TICKET_WAITING;
		t->config = ci;
		t->pid = MyProcPid;
		t->latch = MyLatch;
		t->priority = spec->priority;
		t->age = spec->age;
		t->since = now;
		t->principal = spec->principal;
		t->run_id = spec->run_id;
		t->tokens = spec->tokens;
		t->input = spec->tokens;
		admit->configs[ci].waiting++;
		spec->ticket = ti;
		*retry_at = ask_pass(ci, now);
		t->waited = t->state == TICKET_WAITING;
	}
	else
	{
		AdmitTicket *t = &admit->tickets[spec->ticket];

		if (t->state == TICKET_WAITING)
			*retry_at = ask_pass(t->config, now);
	}
	result = admit->tickets[spec->ticket].state == TICKET_GRANTED ? ADMIT_GRANTED : ADMIT_WAIT;
	LWLockRelease(admit->lock);
	return result;
}

/*
 * spec's granted call is about to be sent: true, and it counts in the
 * window from now, not from its grant.  Between the two a worker may have
 * advanced a batch of runs; counted from the grant, the call would leave
 * tuvl's window that much before it leaves the provider's, and calls
 * granted then would reach the provider while it still counts this one.
 * A call sent in the bucket of its grant (the usual case) changes nothing.
 * But if a 429 has paused the config since the grant, false: the call
 * waits again, in its place (ask again at *retry_at or on a wake-up),
 * rather than meet the same 429.
 */
bool
AdmissionSent(AdmitSpec *spec, TimestampTz *retry_at)
{
	TimestampTz now;
	int64		b;
	AdmitTicket *t;
	AdmitConfig *c;
	bool		send = true;

	*retry_at = 0;
	if (admit == NULL || spec == NULL || spec->ticket < 0)
		return true;
	now = lock_and_now();
	b = ms_of(now) / BUCKET_MS;
	t = &admit->tickets[spec->ticket];
	c = &admit->configs[t->config];
	if (t->state == TICKET_GRANTED && t->pid == MyProcPid)
	{
		int			oi = (int) (t->bucket % NBUCKETS);
		int			ni = (int) (b % NBUCKETS);
		bool		paused = c->paused_until > now;

		if (paused || t->bucket < b)
		{
			if (c->bucket_no[oi] == t->bucket)
			{
				c->reqs[oi]--;
				c->toks[oi] -= t->tokens;
			}
		}
		if (paused)
		{
			/* back in its place among the waiting */
			t->state = TICKET_WAITING;
			t->waited = true;
			c->in_flight--;
			c->waiting++;
			c->admitted--;
			*retry_at = grant_pass(t->config, now);
			send = false;
		}
		else
		{
			if (t->bucket < b)
			{
				if (c->bucket_no[ni] != b)
				{
					c->bucket_no[ni] = b;
					c->reqs[ni] = 0;
					c->toks[ni] = 0;
				}
				c->reqs[ni]++;
				c->toks[ni] += t->tokens;
				t->bucket = b;
			}
			/* the late_ms its place in the window was judged with */
			t->late_ms = c->late_ms;
		}
	}
	LWLockRelease(admit->lock);
	return send;
}

/*
 * spec's call is over, or given up (status 0 and no tokens: never sent):
 * its ticket goes back.  actual_tokens (>= 0) replaces the estimate in
 * the window; a 429 (status) pauses the config for retry_after_ms (or a
 * second) for everyone.  What now fits is granted.
 */
void
AdmissionDone(AdmitSpec *spec, int64 actual_tokens, int status, int retry_after_ms)
{
	TimestampTz now;
	AdmitTicket *t;
	AdmitConfig *c;

	if (admit == NULL || spec == NULL || spec->ticket < 0)
		return;
	now = lock_and_now();
	t = &admit->tickets[spec->ticket];
	spec->ticket = -1;
	if (t->state == TICKET_FREE || t->pid != MyProcPid)
	{
		LWLockRelease(admit->lock);
		return;
	}
	c = &admit->configs[t->config];
	if (t->state == TICKET_WAITING)
		c->waiting--;
	else
	{
		int			bi = (int) (t->bucket % NBUCKETS);

		c->in_flight--;
		if (actual_tokens >= 0 && c->bucket_no[bi] == t->bucket)
			c->toks[bi] += actual_tokens - t->tokens;
		if (actual_tokens >= 0)
			c->avg_extra = 0.9 * c->avg_extra + 0.1 * (double) (actual_tokens - t->input);
		if (status == 429)
		{
			TimestampTz until = TimestampTzPlusMilliseconds(now, retry_after_ms > 0 ? retry_after_ms
															: DEFAULT_PAUSE_MS);
			TimestampTz from = Max(now, c->paused_until);

			c->rate_limited++;

			/*
			 * A 429 the window did not prevent: the provider counts our calls
			 * later than we do (a busy machine delays them between the count
			 * and the provider's clock).  Count one bucket longer than this
			 * call was counted from now on, up to MAX_LATE_MS.  The calls
			 * sent together meet their 429s together: they were counted with
			 * the same late_ms, and raise it one bucket, not one each.
			 */
			if (c->rpm > 0 || c->tpm > 0)
				c->late_ms = Max(c->late_ms, Min(t->late_ms + BUCKET_MS, MAX_LATE_MS));
			if (until > from)
			{
				c->throttled_ms += (double) (until - from) / 1000.0;
				c->paused_until = until;
			}
		}
	}
	t->state = TICKET_FREE;
	c->last_used = now;
	(void) grant_pass(t->config, now);
	LWLockRelease(admit->lock);
}

/*
 * Wait in this backend (tuvl.run()'s synchronous path) until spec's call
 * is admitted, on the latch, checking for interrupts.
 */
void
AdmissionWait(AdmitSpec *spec)
{
	for (;;)
	{
		TimestampTz retry_at;
		long		ms = -1;
		int			events = WL_LATCH_SET | WL_EXIT_ON_PM_DEATH;

		if (AdmissionAsk(spec, &retry_at) != ADMIT_WAIT)
			return;
		if (retry_at != 0)
		{
			ms = Max(1, (long) ((retry_at - GetCurrentTimestamp()) / 1000));
			events |= WL_TIMEOUT;
		}
		(void) WaitLatch(MyLatch, events, ms, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
}

/* Append one row of AdmissionMetrics. */
static List *
metric_row(List *rows, const char *name, const char *kind, AdmitConfig *c, double value)
{
	AdmitMetric *m = palloc0(sizeof(AdmitMetric));

	m->name = name;
	m->kind = kind;
	if (c)
	{
		strlcpy(m->config, c->name, NAMEDATALEN);
		m->owner = c->owner;
	}
	m->value = value;
	return lappend(rows, m);
}

/*
 * The series of tuvl.metrics for the configs of this database, in the
 * caller's memory context (copied under the lock, built after it).
 */
List *
AdmissionMetrics(void)
{
	List	   *rows = NIL;
	TimestampTz now;
	AdmitConfig *copy;
	double		unlimited;
	int			n;

	if (admit == NULL)
		return NIL;
	copy = palloc(sizeof(AdmitConfig) * admit->nconfigs);
	LWLockAcquire(admit->lock, LW_SHARED);
	n = admit->nconfigs;
	memcpy(copy, admit->configs, sizeof(AdmitConfig) * n);
	unlimited = admit->unlimited;
	LWLockRelease(admit->lock);
	/* read after the copy: no bucket in it is newer than now */
	now = GetCurrentTimestamp();
	for (int i = 0; i < n; i++)
	{
		AdmitConfig *c = &copy[i];
		int64		reqs,
					toks;

		if (!c->in_use || c->db != MyDatabaseId)
			continue;
		window_sums(c, now, &reqs, &toks);
		rows = metric_row(rows, "tuvl.llm.admission.admitted", "counter", c, c->admitted);
		rows = metric_row(rows, "tuvl.llm.admission.waits", "counter", c, c->waited);
		rows = metric_row(rows, "tuvl.llm.admission.wait_ms", "counter", c, c->wait_ms);
		rows = metric_row(rows, "tuvl.llm.rate_limited", "counter", c, c->rate_limited);
		rows = metric_row(rows, "tuvl.llm.throttled_ms", "counter", c, c->throttled_ms);
		rows = metric_row(rows, "tuvl.llm.admission.waiting", "gauge", c, c->waiting);
		rows = metric_row(rows, "tuvl.llm.admission.in_flight", "gauge", c, c->in_flight);
		rows = metric_row(rows, "tuvl.llm.window.requests", "gauge", c, (double) reqs);
		rows = metric_row(rows, "tuvl.llm.window.tokens", "gauge", c, (double) toks);
	}
	if (unlimited > 0)
		rows = metric_row(rows, "tuvl.llm.admission.unlimited", "counter", NULL, unlimited);
	return rows;
}

/*
 * The calls of this database waiting for admission now, and what holds
 * each back (paused by a 429, the config's concurrency, or its rate):
 * copies, in the caller's memory context.
 */
List *
AdmissionWaits(void)
{
	List	   *rows = NIL;
	TimestampTz now = GetCurrentTimestamp();
	AdmitWait  *copy;
	int			n = 0;

	if (admit == NULL)
		return NIL;
	copy = palloc(sizeof(AdmitWait) * admit->ntickets);
	LWLockAcquire(admit->lock, LW_SHARED);
	for (int i = 0; i < admit->high; i++)
	{
		AdmitTicket *t = &admit->tickets[i];
		AdmitConfig *c;

		if (t->state != TICKET_WAITING)
			continue;
		c = &admit->configs[t->config];
		if (c->db != MyDatabaseId)
			continue;
		copy[n].run_id = t->run_id;
		strlcpy(copy[n].config, c->name, NAMEDATALEN);
		copy[n].principal = t->principal;
		copy[n].since = t->since;
		copy[n].reason = c->paused_until > now ? "paused" :
			c->concurrency > 0 && c->in_flight >= c->concurrency ? "concurrency" : "rate";
		n++;
	}
	LWLockRelease(admit->lock);
	for (int i = 0; i < n; i++)
		rows = lappend(rows, &copy[i]);
	return rows;
}
