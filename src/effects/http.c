/*-------------------------------------------------------------------------
 *
 * http.c
 *	  HTTP effects through libcurl multi handles, shared by a process's
 *	  transfers.
 *
 * A worker starts many transfers (HttpStart), then waits for any of them
 * together with its latch and postmaster death (HttpWait), and collects
 * those that finished (HttpCollectDone).  The transfers' sockets live in
 * an epoll set maintained by libcurl's socket callback; that epoll fd is
 * one entry of a small, persistent WaitEventSet, so waiting costs the same
 * with one transfer or a thousand.  No transaction may be open while
 * waiting.
 *
 * Shards.  libcurl (7.88) finds a connection to reuse by walking every
 * connection its multi handle has to the request's host, busy ones
 * included: with thousands of requests in flight to one server, that walk
 * took a tenth of a worker's time.  So transfers are spread over shards,
 * each a multi handle with its own connections.  A transfer goes to the
 * first shard with fewer than SHARD_TRANSFERS in flight, so at ordinary
 * loads every request shares shard 0's connections; a shard is added when
 * all are that busy.
 *
 * HTTPS and HTTP/2.  With tuvl.http2 on (the default), a request over TLS
 * offers HTTP/2 by ALPN and waits for a connection that may carry it
 * (CURLOPT_PIPEWAIT) rather than opening one more.  HTTPS requests go to
 * multiplexing shards: at most H2_CONNECTIONS connections to a host,
 * H2_STREAMS streams each (fewer when the server says so),
 * H2_SHARD_TRANSFERS transfers a shard, the rest queued by libcurl until
 * a stream is free.  Without that bound libcurl 7.88 opens a connection
 * for every transfer that finds the streams of the open ones taken, each
 * before it knows the new one could be shared: a hundred connections
 * where two would do.  An HTTPS origin that answers HTTP/1.1 is
 * remembered (H1_ORIGINS of them), its shard loses the bound and becomes
 * a plain one, and its later requests go to plain shards: a server
 * without HTTP/2 is held to H2_CONNECTIONS connections for its first
 * answer only.  A server may allow fewer streams than H2_STREAMS (128 or
 * 256 is common): libcurl then queues the transfers beyond them until a
 * stream is free, a second later with a slow model.  So a multiplexing
 * shard whose transfers waited H2_STALL_MS with none of them given a
 * stream has found the server's bound: its streams in use per connection,
 * times H2_CONNECTIONS, become the room of every multiplexing shard
 * (h2_room, which only ever decreases), and its waiting transfers move to
 * shards with room, on connections of their own.  Cleartext requests
 * use the plain shards, HTTP/1.1, one connection per request in flight,
 * as with tuvl.http2 off.  TLS sessions and DNS
 * answers are shared by every shard, so a new connection resumes a
 * session instead of a full handshake.  tuvl.http_ca_file adds a CA
 * bundle to the system's (libcurl keeps its compiled-in CA directory).
 *
 * libcurl's callbacks never palloc or ereport: transfers, their buffers
 * and headers are malloc'd, and HttpTakeResult copies a finished transfer
 * into palloc'd memory and frees it.  An ERROR in the caller must be
 * followed by HttpAbortAll (the worker's error recovery does it).  Every
 * URL, including each redirect target, must pass tuvl.http_allowed_hosts;
 * redirects are followed here, not by libcurl, so that the check applies.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#include <curl/curl.h>

#include "lib/ilist.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "portability/instr_time.h"
#include "storage/fd.h"
#include "storage/latch.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "http.h"
#include "jsonutil.h"
#include "tuvl.h"

/* Which list a transfer is on. */
typedef enum HttpList
{
	HTTP_LISTED_NOWHERE,
	HTTP_IN_FLIGHT,
	HTTP_DONE
} HttpList;

struct HttpTransfer
{
	CURL	   *easy;
	void	   *owner;
	struct curl_slist *hdrs;
	char	   *method;
	char	   *url;
	char	   *body;
	size_t		body_len;
	bool		body_borrowed;	/* the caller's, not freed here */
	int			timeout_ms;
	int			redirects;
	instr_time	start;
	instr_time	finish;			/* when libcurl reported it done */
	bool		finished;
	/* response, malloc'd */
	char	   *buf;
	size_t		len;
	size_t		cap;
	bool		too_large;
	char	   *hbuf;
	size_t		hlen;
	size_t		hcap;
	char		errbuf[CURL_ERROR_SIZE];
	CURLcode	code;
	long		status;
	bool		paused;			/* waiting for memory */
	size_t		expected;		/* Content-Length, or 0 when not announced */
	bool		admitted;		/* its announced body has room reserved */
	char	   *stop_after;		/* HttpRequest.stop_after, malloc'd */
	bool		stopped;		/* ... arrived: ended by us, complete */
	const char *fail_kind;		/* set when we failed it ourselves */
	char	   *fail_msg;		/* malloc'd */
	char	  **secrets;		/* values of the secrets in the request */
	int			nsecrets;
	bool		done;
	HttpList	list;			/* the list node is in */
	dlist_node	node;
	struct HttpShard *shard;	/* the multi handle it is added to, or NULL */
	bool		sent;			/* on a connection (a stream) of its shard */
};

#define SHARD_TRANSFERS 256
#define MAX_SHARDS 64
/* HTTP/2: connections per host and streams per connection at most, and a
 * multiplexing shard's load */
#define H2_CONNECTIONS 4
#define H2_STREAMS 2048
#define H2_SHARD_TRANSFERS (H2_CONNECTIONS * H2_STREAMS)
/* a multiplexing shard none of whose waiting transfers got a stream for
 * this long is full (see the header comment) */
#define H2_STALL_MS 200
/* HTTPS origins (scheme://host:port) known to answer over HTTP/1.x */
#define H1_ORIGINS 64
#define ORIGIN_LEN 256

typedef struct HttpShard
{
	CURLM	   *multi;
	int			index;
	int			transfers;		/* added to multi and not removed */
	bool		multiplexed;	/* for HTTPS, connections per host bounded */
	TimestampTz deadline;		/* libcurl's timer; 0: none */
	int			sent;			/* of its transfers, those on a connection */
	int			sockets;		/* its sockets (connections) */
	uint64		starts;			/* transfers that got a connection, ever */
	uint64		stall_starts;	/* ... when stalled_since was set */
	TimestampTz stalled_since;	/* transfers waiting, none started; 0: not */
} HttpShard;

/* TLS sessions and DNS answers, shared by every shard's transfers */
static CURLSH *share = NULL;
static char h1_origins[H1_ORIGINS][ORIGIN_LEN];
static int	n_h1_origins = 0;

static HttpShard shards[MAX_SHARDS];
static int	n_shards = 0;
static int	max_shards = 1;		/* what the socket budget allows */
static int	h2_room = H2_SHARD_TRANSFERS;	/* transfers a multiplexing shard
											 * takes */
static long sockets = 0;		/* connections at most (0: no limit) */
static int	epfd = -1;
static WaitEventSet *wait_set = NULL;
static dlist_head in_flight = DLIST_STATIC_INIT(in_flight);
static dlist_head done_list = DLIST_STATIC_INIT(done_list); /* oldest first */
static int	n_in_flight = 0;

/*
 * Memory.  Response bodies are counted as they are buffered; past the
 * budget the worker gives (HttpSetMemoryBudget), every transfer but one
 * is paused until memory is freed, so the bodies in flight stay within
 * the budget plus one response.
 */
static size_t buffered = 0;		/* bytes of body buffers, allocated */
static size_t budget = SIZE_MAX;
static HttpTransfer *exempt = NULL; /* the one transfer that goes on */
static int	n_paused = 0;

/* ---- allow-list ---- */

static bool
pattern_matches(const char *pattern, size_t plen, const char *host, const char *port)
{
	char	   *pat = pnstrdup(pattern, plen);
	char	   *colon = strrchr(pat, ':');
	char	   *pport = NULL;

	/* "[::1]:8080" or "host:port"; a bare IPv6 address has several colons */
	if (colon && (pat[0] == '[' ? colon > strchr(pat, ']') : strchr(pat, ':') == colon))
	{
		*colon = '\0';
		pport = colon + 1;
	}
	if (pat[0] == '[')
	{
		size_t		l = strlen(pat);

		if (l >= 2 && pat[l - 1] == ']')
		{
			memmove(pat, pat + 1, l - 2);
			pat[l - 2] = '\0';
		}
	}
	if (pport && strcmp(pport, "*") != 0 && strcmp(pport, port) != 0)
		return false;
	if (strcmp(pat, "*") == 0)
		return true;
	if (strncmp(pat, "*.", 2) == 0)
	{
		size_t		hl = strlen(host);
		size_t		sl = strlen(pat + 1);

		return hl > sl && pg_strcasecmp(host + hl - sl, pat + 1) == 0;
	}
	return pg_strcasecmp(pat, host) == 0;
}

/*
 * May an HTTP effect reach url?  Only http and https, to a host (and
 * port) listed in tuvl.http_allowed_hosts.  On refusal *reason says why.
 */
bool
HttpUrlAllowed(const char *url, char **reason)
{
	CURLU	   *u;
	char	   *scheme = NULL;
	char	   *host = NULL;
	char	   *port = NULL;
	bool		ok = false;
	char		hostbuf[256];
	char		portbuf[16];
	const char *p;

	*reason = NULL;
	u = curl_url();
	if (curl_url_set(u, CURLUPART_URL, url, 0) != CURLUE_OK ||
		curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) != CURLUE_OK ||
		curl_url_get(u, CURLUPART_HOST, &host, 0) != CURLUE_OK ||
		curl_url_get(u, CURLUPART_PORT, &port, CURLU_DEFAULT_PORT) != CURLUE_OK)
	{
		*reason = psprintf("\"%s\" is not a valid URL", url);
		goto done;
	}
	if (strcmp(scheme, "http") != 0 && strcmp(scheme, "https") != 0)
	{
		*reason = psprintf("scheme \"%s\" is not allowed; use http or https", scheme);
		goto done;
	}
	strlcpy(hostbuf, host[0] == '[' ? host + 1 : host, sizeof(hostbuf));
	if (host[0] == '[' && strlen(hostbuf) > 0)
		hostbuf[strlen(hostbuf) - 1] = '\0';
	strlcpy(portbuf, port, sizeof(portbuf));

	p = tuvl_http_allowed_hosts ? tuvl_http_allowed_hosts : "";
	while (*p)
	{
		const char *end;

		while (*p == ',' || *p == ' ')
			p++;
		end = p;
		while (*end && *end != ',' && *end != ' ')
			end++;
		if (end > p && pattern_matches(p, end - p, hostbuf, portbuf))
		{
			ok = true;
			break;
		}
		p = end;
	}
	if (!ok)
		*reason = psprintf("host \"%s\" port %s is not in tuvl.http_allowed_hosts", hostbuf, portbuf);
done:
	curl_free(scheme);
	curl_free(host);
	curl_free(port);
	curl_url_cleanup(u);
	return ok;
}

/* Raise when url may not be reached. */
void
HttpCheckAllowed(const char *url)
{
	char	   *reason;

	if (!HttpUrlAllowed(url, &reason))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("HTTP request to %s is not allowed", HttpRedactUrl(url)),
				 errdetail("%s.", reason),
				 errhint("A superuser can add the host to tuvl.http_allowed_hosts, for example 'api.example.com:443'.")));
}

/* The URL without user:password, for the journal and messages. */
char *
HttpRedactUrl(const char *url)
{
	CURLU	   *u = curl_url();
	char	   *out = NULL;
	char	   *res;

	if (curl_url_set(u, CURLUPART_URL, url, 0) == CURLUE_OK)
	{
		curl_url_set(u, CURLUPART_USER, NULL, 0);
		curl_url_set(u, CURLUPART_PASSWORD, NULL, 0);
		curl_url_get(u, CURLUPART_URL, &out, 0);
	}
	res = pstrdup(out ? out : url);
	curl_free(out);
	curl_url_cleanup(u);
	return res;
}

/* ---- libcurl callbacks: malloc only, never palloc or ereport ---- */

/* Append to a malloc'd, NUL-terminated buffer; false when out of memory. */
static bool
buf_append(char **buf, size_t *len, size_t *cap, const char *data, size_t n)
{
	if (*len + n + 1 > *cap)
	{
		size_t		newcap = Max(Max(*cap * 2, *len + n + 1), 1024);
		char	   *nb = realloc(*buf, newcap);

		if (nb == NULL)
			return false;
		*buf = nb;
		*cap = newcap;
	}
	memcpy(*buf + *len, data, n);
	*len += n;
	(*buf)[*len] = '\0';
	return true;
}

/* Pause t for memory (it resumes in resume_paused). */
static size_t
pause_for_memory(HttpTransfer *t)
{
	t->paused = true;
	n_paused++;
	return CURL_WRITEFUNC_PAUSE;
}

static size_t
write_cb(char *data, size_t size, size_t nmemb, void *userp)
{
	HttpTransfer *t = userp;
	size_t		n = size * nmemb;
	size_t		cap = t->cap;
	bool		ok;

	if (t->len + n > (size_t) tuvl_http_max_response_size)
	{
		t->too_large = true;
		return 0;
	}

	/*
	 * A body of announced size is admitted whole: room for all of it, or it
	 * waits before its first byte.  Over the budget, one transfer (exempt)
	 * still goes on, so that something always finishes.
	 */
	if (t->expected > 0 && !t->admitted)
	{
		if (buffered + t->expected > budget && exempt != NULL && exempt != t)
			return pause_for_memory(t);
		if (buffered + t->expected > budget)
			exempt = t;
		if (t->expected + 1 > t->cap)
		{
			char	   *nb = realloc(t->buf, t->expected + 1);

			if (nb == NULL)
				return 0;
			t->buf = nb;
			t->cap = t->expected + 1;
		}
		t->admitted = true;
	}
	/* a body of unknown size waits when it must grow past the budget */
	else if (t->len + n + 1 > t->cap && buffered + n > budget)
	{
		if (exempt == NULL)
			exempt = t;
		else if (exempt != t)
			return pause_for_memory(t);
	}
	ok = buf_append(&t->buf, &t->len, &t->cap, data, n);
	buffered += t->cap - cap;
	if (ok && t->stop_after)
	{
		/* the awaited event is whole: end the stream here */
		char	   *hit = memmem(t->buf, t->len, t->stop_after, strlen(t->stop_after));

		if (hit && (memmem(hit, t->len - (hit - t->buf), "\n\n", 2) ||
					memmem(hit, t->len - (hit - t->buf), "\r\n\r\n", 4)))
		{
			t->stopped = true;
			return 0;
		}
	}
	return ok ? n : 0;
}

static size_t
header_cb(char *data, size_t size, size_t nmemb, void *userp)
{
	HttpTransfer *t = userp;
	size_t		n = size * nmemb;

	/* a new status line starts a new header block (100 Continue) */
	if (n >= 5 && strncmp(data, "HTTP/", 5) == 0)
		t->hlen = 0;
	/* a body of announced size: refused at once when too large */
	if (n > 15 && pg_strncasecmp(data, "content-length:", 15) == 0)
	{
		char	   *end;
		long long	len = strtoll(data + 15, &end, 10);

		if (len > (long long) tuvl_http_max_response_size)
		{
			t->too_large = true;
			return 0;
		}
		t->expected = len > 0 ? (size_t) len : 0;
	}
	if (t->hlen + n + 1 > 65536)
		return n;				/* ignore pathological headers */
	return buf_append(&t->hbuf, &t->hlen, &t->hcap, data, n) ? n : 0;
}

/* The epoll entry of a socket names its shard and its descriptor. */
#define EPOLL_DATA(shard, s) (((uint64) (shard)->index << 32) | (uint32) (s))
#define EPOLL_SHARD(data) (&shards[(data) >> 32])
#define EPOLL_SOCKET(data) ((curl_socket_t) ((data) & 0xFFFFFFFF))

static int
socket_cb(CURL *easy, curl_socket_t s, int what, void *userp, void *socketp)
{
	HttpShard  *shard = userp;
	struct epoll_event ev;

	memset(&ev, 0, sizeof(ev));
	ev.data.u64 = EPOLL_DATA(shard, s);
	if (what == CURL_POLL_REMOVE)
	{
		if (socketp != NULL)
			shard->sockets--;
		epoll_ctl(epfd, EPOLL_CTL_DEL, s, NULL);
		curl_multi_assign(shard->multi, s, NULL);
		return 0;
	}
	if (what == CURL_POLL_IN || what == CURL_POLL_INOUT)
		ev.events |= EPOLLIN;
	if (what == CURL_POLL_OUT || what == CURL_POLL_INOUT)
		ev.events |= EPOLLOUT;
	if (socketp == NULL)
	{
		if (epoll_ctl(epfd, EPOLL_CTL_ADD, s, &ev) != 0)
			epoll_ctl(epfd, EPOLL_CTL_MOD, s, &ev);
		curl_multi_assign(shard->multi, s, (void *) 1);
		shard->sockets++;
	}
	else
		epoll_ctl(epfd, EPOLL_CTL_MOD, s, &ev);
	return 0;
}

static int
timer_cb(CURLM *m, long timeout_ms, void *userp)
{
	HttpShard  *shard = userp;

	if (timeout_ms < 0)
		shard->deadline = 0;
	else
		shard->deadline = GetCurrentTimestamp() + (TimestampTz) timeout_ms * 1000;
	return 0;
}

/* ---- the engine ---- */

/*
 * How many sockets the transfers may hold at once.  Each connection is a
 * file descriptor, and a worker holding thousands of runs keeps thousands
 * open, beside the files PostgreSQL opens (up to max_files_per_process,
 * counted from the limit the postmaster started with).  So the process's
 * soft limit is raised to its hard limit, and the connections get what
 * the files leave; beyond that libcurl queues transfers until a
 * connection is free.
 */
static long
socket_budget(void)
{
	struct rlimit rl;
	long		budget;

	if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
		return 0;				/* unknown: no limit of ours */
	if (rl.rlim_cur < rl.rlim_max)
	{
		rlim_t		was = rl.rlim_cur;

		rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? Max(was, 1 << 20) : rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
			rl.rlim_cur = was;
	}
	if (rl.rlim_cur == RLIM_INFINITY)
		return 0;
	budget = (long) rl.rlim_cur - max_files_per_process - 64;
	return Max(budget, 16);
}

/*
 * Idle connections a shard keeps: as many as it may have transfers
 * (SHARD_TRANSFERS, or tuvl.runs_per_worker when lower, but 64 at least),
 * so that a run's next request finds its connection open.  Fewer would
 * close most of them after every burst and open them again for the next
 * (a connect, an accept and a TIME_WAIT socket per request, thousands a
 * second).
 */
static long
connections_kept(void)
{
	long		want = Max(64, Min(tuvl_runs_per_worker, SHARD_TRANSFERS));

	return sockets > 0 ? Min(want, sockets / max_shards) : want;
}

/* Add a shard: a multi handle whose sockets go to the epoll set. */
static HttpShard *
shard_add(bool multiplexed)
{
	HttpShard  *shard = &shards[n_shards];

	shard->multi = curl_multi_init();
	if (shard->multi == NULL)
		elog(ERROR, "could not create a libcurl multi handle");
	shard->index = n_shards++;
	shard->transfers = 0;
	shard->multiplexed = multiplexed;
	shard->deadline = 0;
	shard->sent = 0;
	shard->sockets = 0;
	shard->starts = shard->stall_starts = 0;
	shard->stalled_since = 0;
	if (sockets > 0)
		curl_multi_setopt(shard->multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, sockets / max_shards);
	curl_multi_setopt(shard->multi, CURLMOPT_MAX_HOST_CONNECTIONS,
					  multiplexed ? (long) H2_CONNECTIONS : 0L);
	curl_multi_setopt(shard->multi, CURLMOPT_MAXCONNECTS, connections_kept());
	curl_multi_setopt(shard->multi, CURLMOPT_SOCKETFUNCTION, socket_cb);
	curl_multi_setopt(shard->multi, CURLMOPT_SOCKETDATA, shard);
	curl_multi_setopt(shard->multi, CURLMOPT_TIMERFUNCTION, timer_cb);
	curl_multi_setopt(shard->multi, CURLMOPT_TIMERDATA, shard);
	curl_multi_setopt(shard->multi, CURLMOPT_PIPELINING, (long) CURLPIPE_MULTIPLEX);
	curl_multi_setopt(shard->multi, CURLMOPT_MAX_CONCURRENT_STREAMS, (long) H2_STREAMS);
	return shard;
}

/* The length of url's origin, "scheme://authority" (0 when it has none that fits). */
static size_t
origin_length(const char *url)
{
	const char *p = strstr(url, "://");
	size_t		len;

	if (p == NULL)
		return 0;
	len = (p + 3 - url) + strcspn(p + 3, "/?#");
	return len < ORIGIN_LEN ? len : 0;
}

static bool
origin_is_h1(const char *url)
{
	size_t		len = origin_length(url);

	for (int i = 0; len > 0 && i < n_h1_origins; i++)
		if (strlen(h1_origins[i]) == len && pg_strncasecmp(h1_origins[i], url, len) == 0)
			return true;
	return false;
}

/* url's origin answered over HTTPS with HTTP/1.x: later requests take plain shards. */
static void
remember_h1_origin(const char *url)
{
	size_t		len = origin_length(url);

	if (len == 0 || origin_is_h1(url))
		return;
	/* the oldest is forgotten: its requests are tried multiplexed again */
	if (n_h1_origins == H1_ORIGINS)
	{
		memmove(h1_origins[0], h1_origins[1], sizeof(h1_origins[0]) * (H1_ORIGINS - 1));
		n_h1_origins--;
	}
	memcpy(h1_origins[n_h1_origins], url, len);
	h1_origins[n_h1_origins++][len] = '\0';
}

/*
 * The shard for a new transfer to url: among the shards of its kind
 * (multiplexing for HTTPS with tuvl.http2 on, unless the origin is known
 * to answer HTTP/1.x),
 * the first with room, a new one when none has, the least busy when no
 * more may be added (it queues the transfer until one of its connections
 * is free), or the least busy of any when no shard of its kind may be.
 */
static HttpShard *
shard_for_transfer(const char *url)
{
	bool		multiplexed = tuvl_http2 && pg_strncasecmp(url, "https://", 8) == 0 &&
	!origin_is_h1(url);
	int			room = multiplexed ? h2_room : SHARD_TRANSFERS;
	HttpShard  *least = NULL;

	for (int i = 0; i < n_shards; i++)
	{
		if (shards[i].multiplexed != multiplexed)
			continue;
		if (shards[i].transfers < room)
			return &shards[i];
		if (least == NULL || shards[i].transfers < least->transfers)
			least = &shards[i];
	}
	if (n_shards < max_shards)
		return shard_add(multiplexed);
	if (least != NULL)
		return least;
	/* no room for a shard of its kind: the least busy of any */
	least = &shards[0];
	for (int i = 1; i < n_shards; i++)
		if (shards[i].transfers < least->transfers)
			least = &shards[i];
	return least;
}

/* Take t off its multi handle (a finished, cancelled or redirected transfer). */
static void
transfer_remove(HttpTransfer *t)
{
	if (t->shard == NULL)
		return;
	curl_multi_remove_handle(t->shard->multi, t->easy);
	t->shard->transfers--;
	if (t->sent)
		t->shard->sent--;
	t->sent = false;
	t->shard = NULL;
}

/* ---- libcurl's memory ----
 *
 * libcurl 7.88 mallocs a send buffer of CURLOPT_UPLOAD_BUFFERSIZE (16 kB
 * at least) for every request whose body it sends itself (over HTTP/2, or
 * HTTP/1.1 over TLS) and frees it when the transfer is done (over an
 * HTTP/2 connection that other streams still use, not even then: the handle
 * keeps it for its next request), so it is held through the server's whole
 * answer time; and a receive buffer of CURLOPT_BUFFERSIZE for every handle.  A request touches only as much of
 * them as its body or its answer, but in glibc's heap, where a busy
 * worker's memory is freed and reused all the time, every page of them
 * ends up resident: at thousands of requests in flight, most of a worker's
 * memory.  So libcurl's blocks of CURL_MAPPED_MIN bytes or more live in
 * mappings of their own, apart from the heap, where a page nobody touched
 * costs nothing.  A freed mapping is kept for the next block of its size
 * (mapping and unmapping a block for every request cost a turn a tenth
 * more CPU here: 35 us of page faults and system calls), so it holds only
 * the pages its blocks touched, until the worker is idle and
 * HttpReleaseMemory unmaps them.  Once the mappings reach half the
 * kernel's vm.max_map_count (two a request in flight at most: 32,765 by
 * default), blocks go to the heap.  Every block starts with a header that
 * says where it is; a block libcurl allocated before these functions were
 * installed has no header of ours and goes to free() (the check reads the
 * 16 bytes before it, glibc's own header).  libcurl's resolver thread
 * allocates too (its answers, small blocks): only the process's own thread
 * maps blocks and keeps them, so the kept lists need no lock.
 */
#define CURL_MAPPED_MIN 8192
#define CURL_MAPPED_PAGES 16	/* larger mappings are not kept */
#define CURL_MEM_HEAP UINT64CONST(0x7475766c68656170)	/* "tuvlheap" */
#define CURL_MEM_MAPPED UINT64CONST(0x7475766c6d6d6170) /* "tuvlmmap" */

typedef union CurlMemHeader
{
	struct
	{
		size_t		len;		/* of the mapping; 0 in the heap */
		uint64		magic;		/* CURL_MEM_*, xor the header's address */
		union CurlMemHeader *next;	/* free, kept: the next of its size */
	}			h;
	max_align_t align;
} CurlMemHeader;

static size_t page_size = 0;
static long mappings = 0;		/* libcurl's blocks mapped apart, kept ones
								 * included */
static long max_mappings = 0;
static CurlMemHeader *kept[CURL_MAPPED_PAGES + 1];	/* by pages */
static pthread_t curl_mem_thread;	/* the process's own: it maps and keeps */

/* Half of vm.max_map_count (65,530 by default): the rest is the process's. */
static long
mappings_allowed(void)
{
	FILE	   *f = fopen("/proc/sys/vm/max_map_count", "r");
	long		n = 0;

	if (f != NULL)
	{
		if (fscanf(f, "%ld", &n) != 1)
			n = 0;
		fclose(f);
	}
	return n > 0 ? n / 2 : 32765;
}

static inline uint64
curl_mem_magic(CurlMemHeader *hdr, uint64 kind)
{
	return kind ^ (uint64) (uintptr_t) hdr;
}

/* A mapped block of len bytes (a multiple of the page size), or NULL. */
static CurlMemHeader *
curl_mem_map(size_t len)
{
	size_t		pages = len / page_size;
	CurlMemHeader *hdr;

	if (!pthread_equal(pthread_self(), curl_mem_thread))
		return NULL;
	if (pages <= CURL_MAPPED_PAGES && kept[pages] != NULL)
	{
		hdr = kept[pages];
		kept[pages] = hdr->h.next;
		return hdr;
	}
	if (mappings >= max_mappings)
		return NULL;
	hdr = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (hdr == MAP_FAILED)
		return NULL;
	mappings++;
	hdr->h.len = len;
	hdr->h.magic = curl_mem_magic(hdr, CURL_MEM_MAPPED);
	return hdr;
}

static void
curl_mem_unmap(CurlMemHeader *hdr)
{
	size_t		pages = hdr->h.len / page_size;

	if (!pthread_equal(pthread_self(), curl_mem_thread))
	{
		/* not counted off: the count stays on the safe side */
		munmap(hdr, hdr->h.len);
		return;
	}
	if (pages <= CURL_MAPPED_PAGES)
	{
		hdr->h.next = kept[pages];
		kept[pages] = hdr;
		return;
	}
	munmap(hdr, hdr->h.len);
	mappings--;
}

static void *
curl_mem_malloc(size_t size)
{
	CurlMemHeader *hdr;
	size_t		len;

	if (size > SIZE_MAX - 2 * page_size)
		return NULL;
	len = size + sizeof(CurlMemHeader);
	if (size >= CURL_MAPPED_MIN && (hdr = curl_mem_map(TYPEALIGN(page_size, len))) != NULL)
		return hdr + 1;
	hdr = malloc(len);
	if (hdr == NULL)
		return NULL;
	hdr->h.len = 0;
	hdr->h.magic = curl_mem_magic(hdr, CURL_MEM_HEAP);
	return hdr + 1;
}

/* p's header, or NULL when p was allocated without one */
static CurlMemHeader *
curl_mem_header(void *p)
{
	CurlMemHeader *hdr = (CurlMemHeader *) p - 1;

	if (hdr->h.magic == curl_mem_magic(hdr, hdr->h.len ? CURL_MEM_MAPPED : CURL_MEM_HEAP))
		return hdr;
	return NULL;
}

static void
curl_mem_free(void *p)
{
	CurlMemHeader *hdr;

	if (p == NULL)
		return;
	hdr = curl_mem_header(p);
	if (hdr == NULL)
		free(p);
	else if (hdr->h.len == 0)
	{
		hdr->h.magic = 0;
		free(hdr);
	}
	else
		curl_mem_unmap(hdr);
}

static void *
curl_mem_realloc(void *p, size_t size)
{
	CurlMemHeader *hdr;
	CurlMemHeader *nhdr;
	void	   *np;

	if (p == NULL)
		return curl_mem_malloc(size);
	if (size > SIZE_MAX - 2 * page_size)
		return NULL;
	hdr = curl_mem_header(p);
	if (hdr == NULL)
		return realloc(p, size);
	if (hdr->h.len == 0)
	{
		/* a heap block stays in the heap */
		hdr->h.magic = 0;
		nhdr = realloc(hdr, size + sizeof(CurlMemHeader));
		if (nhdr == NULL)
		{
			hdr->h.magic = curl_mem_magic(hdr, CURL_MEM_HEAP);
			return NULL;
		}
		nhdr->h.magic = curl_mem_magic(nhdr, CURL_MEM_HEAP);
		return nhdr + 1;
	}
	if (size + sizeof(CurlMemHeader) <= hdr->h.len)
		return p;
	np = curl_mem_malloc(size);
	if (np == NULL)
		return NULL;
	memcpy(np, p, hdr->h.len - sizeof(CurlMemHeader));
	curl_mem_unmap(hdr);
	return np;
}

static char *
curl_mem_strdup(const char *s)
{
	size_t		n = strlen(s) + 1;
	char	   *r = curl_mem_malloc(n);

	if (r != NULL)
		memcpy(r, s, n);
	return r;
}

static void *
curl_mem_calloc(size_t nmemb, size_t size)
{
	void	   *p;

	if (size != 0 && nmemb > SIZE_MAX / size)
		return NULL;
	p = curl_mem_malloc(nmemb * size);
	if (p != NULL)
		memset(p, 0, nmemb * size);
	return p;
}

/* Create the first shard, the epoll set and the wait set once. */
static void
engine_init(void)
{
	static bool global_done = false;

	if (n_shards > 0)
		return;
	if (!global_done)
	{
		page_size = (size_t) sysconf(_SC_PAGESIZE);
		max_mappings = mappings_allowed();
		curl_mem_thread = pthread_self();
		if (curl_global_init_mem(CURL_GLOBAL_DEFAULT, curl_mem_malloc, curl_mem_free,
								 curl_mem_realloc, curl_mem_strdup,
								 curl_mem_calloc) != CURLE_OK)
			elog(ERROR, "could not initialize libcurl");
		global_done = true;
	}
	if (share == NULL)
	{
		share = curl_share_init();
		if (share == NULL)
			elog(ERROR, "could not create a libcurl share handle");
		curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
		curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
	}
	epfd = epoll_create1(EPOLL_CLOEXEC);
	if (epfd < 0)
		ereport(ERROR,
				(errcode_for_socket_access(),
				 errmsg("could not create epoll set: %m")));
	sockets = socket_budget();
	max_shards = sockets > 0 ? (int) Max(1, Min(MAX_SHARDS, sockets / SHARD_TRANSFERS)) : MAX_SHARDS;
	(void) shard_add(false);

	wait_set = CreateWaitEventSet(TopMemoryContext, 3);
	AddWaitEventToSet(wait_set, WL_LATCH_SET, PGINVALID_SOCKET, MyLatch, NULL);
	if (IsUnderPostmaster)
		AddWaitEventToSet(wait_set, WL_EXIT_ON_PM_DEATH, PGINVALID_SOCKET, NULL, NULL);
	AddWaitEventToSet(wait_set, WL_SOCKET_READABLE, epfd, NULL, NULL);
}

static void unlink_transfer(HttpTransfer *t);

/*
 * Easy handles of finished transfers, reset, for the next ones: a new
 * handle allocates its state and buffers again, which at thousands of
 * requests a second shows in a worker's profile.  Bounded: what a burst
 * leaves beyond it is freed.
 */
#define EASY_POOL_MAX 256
static CURL *easy_pool[EASY_POOL_MAX];
static int	n_easy_pool = 0;

static CURL *
easy_get(void)
{
	return n_easy_pool > 0 ? easy_pool[--n_easy_pool] : curl_easy_init();
}

/*
 * e is on no multi handle: keep it.  Its transfer's options go at its next
 * use (transfer_submit resets a handle before configuring it).
 */
static void
easy_put(CURL *e)
{
	if (n_easy_pool < EASY_POOL_MAX)
		easy_pool[n_easy_pool++] = e;
	else
		curl_easy_cleanup(e);
}

/*
 * Give back the easy handles kept for the next transfers (with their
 * buffers: libcurl keeps a handle's send buffer for its next request when
 * the transfer ended on an HTTP/2 connection still in use) and the mappings
 * kept for libcurl's next blocks.  An idle worker does, with glibc's
 * malloc_trim.
 */
void
HttpReleaseMemory(void)
{
	while (n_easy_pool > 0)
		curl_easy_cleanup(easy_pool[--n_easy_pool]);
	for (int pages = 0; pages <= CURL_MAPPED_PAGES; pages++)
	{
		while (kept[pages] != NULL)
		{
			CurlMemHeader *hdr = kept[pages];

			kept[pages] = hdr->h.next;
			munmap(hdr, hdr->h.len);
			mappings--;
		}
	}
}

static void
transfer_free(HttpTransfer *t)
{
	unlink_transfer(t);
	transfer_remove(t);
	buffered -= Min(t->cap, buffered);
	if (t == exempt)
		exempt = NULL;
	if (t->paused)
		n_paused--;
	if (t->easy)
		easy_put(t->easy);
	curl_slist_free_all(t->hdrs);
	free(t->method);
	free(t->url);
	if (!t->body_borrowed)
		free(t->body);
	free(t->buf);
	free(t->hbuf);
	free(t->fail_msg);
	free(t->stop_after);
	for (int i = 0; i < t->nsecrets; i++)
		free(t->secrets[i]);
	free(t->secrets);
	free(t);
}

static char *
xstrdup(const char *s)
{
	char	   *r = s ? strdup(s) : NULL;

	if (s && r == NULL)
		ereport(ERROR, (errcode(ERRCODE_OUT_OF_MEMORY), errmsg("out of memory")));
	return r;
}

/* libcurl gave t a connection (a stream over HTTP/2) and sends it now. */
static int
prereq_cb(void *arg, char *primary_ip, char *local_ip, int primary_port, int local_port)
{
	HttpTransfer *t = arg;

	if (t->shard != NULL && !t->sent)
	{
		t->sent = true;
		t->shard->sent++;
		t->shard->starts++;
	}
	return CURL_PREREQFUNC_OK;
}

/* A response body nobody reads. */
static size_t
discard_cb(char *ptr, size_t size, size_t nmemb, void *arg)
{
	return size * nmemb;
}

/* (Re)configure the easy handle for t->method and t->url and add it. */
static void
transfer_submit(HttpTransfer *t)
{
	CURL	   *e = t->easy;

	curl_easy_reset(e);
	curl_easy_setopt(e, CURLOPT_URL, t->url);
	curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
	curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
	curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long) t->timeout_ms);
	curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long) Min(t->timeout_ms, 30000));
	curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, tuvl_http_verify_tls ? 1L : 0L);
	curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, tuvl_http_verify_tls ? 2L : 0L);
	if (tuvl_http_ca_file && tuvl_http_ca_file[0] != '\0')
		curl_easy_setopt(e, CURLOPT_CAINFO, tuvl_http_ca_file);
	curl_easy_setopt(e, CURLOPT_SHARE, share);
	curl_easy_setopt(e, CURLOPT_HTTP_VERSION,
					 tuvl_http2 ? (long) CURL_HTTP_VERSION_2TLS : (long) CURL_HTTP_VERSION_1_1);
	/* over TLS, wait for a connection to know whether it multiplexes */
	curl_easy_setopt(e, CURLOPT_PIPEWAIT,
					 tuvl_http2 && pg_strncasecmp(t->url, "https://", 8) == 0 ? 1L : 0L);
	/* libcurl's receive buffer, 16 kB by default, per transfer in flight */
	curl_easy_setopt(e, CURLOPT_BUFFERSIZE, 8192L);

	/*
	 * and its send buffer, 64 kB by default: libcurl 7.88 mallocs it for
	 * every request whose body goes out in DATA frames (HTTP/2) or through
	 * TLS (HTTP/1.1), and frees it only when the transfer is done, so it is
	 * held through the model's whole answer time.  16 kB is libcurl's least;
	 * a larger body goes out in more writes.
	 */
	curl_easy_setopt(e, CURLOPT_UPLOAD_BUFFERSIZE, 16384L);
	curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, write_cb);
	curl_easy_setopt(e, CURLOPT_WRITEDATA, t);
	curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, header_cb);
	curl_easy_setopt(e, CURLOPT_HEADERDATA, t);
	curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t->errbuf);
	curl_easy_setopt(e, CURLOPT_PRIVATE, t);
	curl_easy_setopt(e, CURLOPT_PREREQFUNCTION, prereq_cb);
	curl_easy_setopt(e, CURLOPT_PREREQDATA, t);
	curl_easy_setopt(e, CURLOPT_USERAGENT, "tuvl/" TUVL_VERSION);
	curl_easy_setopt(e, CURLOPT_ACCEPT_ENCODING, "");
	curl_easy_setopt(e, CURLOPT_HTTPHEADER, t->hdrs);
	if (strcmp(t->method, "GET") == 0)
		curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
	else if (strcmp(t->method, "HEAD") == 0)
		curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
	else
	{
		curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, t->method);
		if (t->body)
		{
			curl_easy_setopt(e, CURLOPT_POSTFIELDS, t->body);
			curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t) t->body_len);
		}
	}
	t->len = 0;
	t->hlen = 0;
	t->expected = 0;
	t->admitted = false;
	t->too_large = false;
	t->errbuf[0] = '\0';
	t->shard = shard_for_transfer(t->url);
	t->shard->transfers++;
	curl_multi_add_handle(t->shard->multi, e);
}

/* tuvl.runs_per_worker changed since the shards were told: tell them. */
static void
keep_connections(void)
{
	static long kept = 0;
	long		want = connections_kept();

	if (want != kept)
	{
		for (int i = 0; i < n_shards; i++)
			curl_multi_setopt(shards[i].multi, CURLMOPT_MAXCONNECTS, want);
		kept = want;
	}
}

/*
 * Start a request; the returned transfer is collected by HttpCollectDone
 * once finished.  secrets are the values of the secrets the request
 * holds: a redirect to another origin carries none of them.  Raises when
 * the URL is not allowed, and while a replay executes.
 */
HttpTransfer *
HttpStart(const HttpRequest *req, List *secrets, void *owner)
{
	HttpTransfer *t;
	ListCell   *lc;

	TuvlRefuseWhileReplaying("an HTTP request");
	HttpCheckAllowed(req->url);
	engine_init();

	keep_connections();
	t = calloc(1, sizeof(HttpTransfer));
	if (t == NULL)
		ereport(ERROR, (errcode(ERRCODE_OUT_OF_MEMORY), errmsg("out of memory")));
	t->owner = owner;
	if (secrets != NIL)
	{
		t->secrets = calloc(list_length(secrets), sizeof(char *));
		if (t->secrets == NULL)
		{
			free(t);
			ereport(ERROR, (errcode(ERRCODE_OUT_OF_MEMORY), errmsg("out of memory")));
		}
		foreach(lc, secrets)
		{
			if (lfirst(lc) && *(char *) lfirst(lc))
				t->secrets[t->nsecrets++] = xstrdup(lfirst(lc));
		}
	}
	t->method = xstrdup(req->method ? req->method : "GET");
	t->url = xstrdup(req->url);
	t->stop_after = req->stop_after ? xstrdup(req->stop_after) : NULL;
	if (req->body && req->body_borrowed)
	{
		t->body = (char *) req->body;
		t->body_len = req->body_len;
		t->body_borrowed = true;
	}
	else if (req->body)
	{
		t->body = malloc(req->body_len + 1);
		memcpy(t->body, req->body, req->body_len);
		t->body[req->body_len] = '\0';
		t->body_len = req->body_len;
	}
	t->timeout_ms = req->timeout_ms > 0 ? req->timeout_ms : tuvl_http_timeout;
	foreach(lc, req->headers)
	{
		HttpHeader *h = lfirst(lc);
		char	   *line = psprintf("%s: %s", h->name, h->value);

		t->hdrs = curl_slist_append(t->hdrs, line);
		pfree(line);
	}
	/* no "Expect: 100-continue" round trip */
	t->hdrs = curl_slist_append(t->hdrs, "Expect:");
	t->easy = easy_get();
	if (t->easy == NULL)
	{
		transfer_free(t);
		elog(ERROR, "could not create a libcurl handle");
	}
	INSTR_TIME_SET_CURRENT(t->start);
	transfer_submit(t);
	dlist_push_head(&in_flight, &t->node);
	t->list = HTTP_IN_FLIGHT;
	n_in_flight++;
	return t;
}

int
HttpInFlight(void)
{
	return n_in_flight;
}

/* Milliseconds until libcurl needs attention; -1 when it does not. */
long
HttpTimeoutMs(void)
{
	TimestampTz first = 0;
	long		ms;

	for (int i = 0; i < n_shards; i++)
	{
		TimestampTz stall = shards[i].stalled_since;

		if (shards[i].deadline != 0 && (first == 0 || shards[i].deadline < first))
			first = shards[i].deadline;
		/* when a stall becomes a full shard (unstall_shards) */
		if (stall != 0)
		{
			stall += (TimestampTz) H2_STALL_MS * 1000;
			if (first == 0 || stall < first)
				first = stall;
		}
	}
	if (first == 0)
		return -1;
	ms = (long) ((first - GetCurrentTimestamp()) / 1000);
	return Max(ms, 0);
}

static void
unlink_transfer(HttpTransfer *t)
{
	if (t->list == HTTP_LISTED_NOWHERE)
		return;
	dlist_delete(&t->node);
	if (t->list == HTTP_IN_FLIGHT)
		n_in_flight--;
	t->list = HTTP_LISTED_NOWHERE;
}

/* scheme://host:port of a URL, malloc'd; NULL when it does not parse. */
static char *
url_origin(const char *url)
{
	CURLU	   *u = curl_url();
	char	   *scheme = NULL;
	char	   *host = NULL;
	char	   *port = NULL;
	char	   *out = NULL;

	if (curl_url_set(u, CURLUPART_URL, url, 0) == CURLUE_OK &&
		curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK &&
		curl_url_get(u, CURLUPART_HOST, &host, 0) == CURLUE_OK &&
		curl_url_get(u, CURLUPART_PORT, &port, CURLU_DEFAULT_PORT) == CURLUE_OK)
	{
		size_t		len = strlen(scheme) + strlen(host) + strlen(port) + 5;

		out = malloc(len);
		if (out)
			snprintf(out, len, "%s://%s:%s", scheme, host, port);
	}
	curl_free(scheme);
	curl_free(host);
	curl_free(port);
	curl_url_cleanup(u);
	return out;
}

/* Does text hold the value of one of the request's secrets? */
static bool
holds_secret(HttpTransfer *t, const char *text, size_t len)
{
	for (int i = 0; i < t->nsecrets; i++)
	{
		size_t		sl = strlen(t->secrets[i]);

		for (size_t off = 0; off + sl <= len; off++)
			if (memcmp(text + off, t->secrets[i], sl) == 0)
				return true;
	}
	return false;
}

/*
 * A redirect to another origin must not carry credentials: drop the
 * headers that hold them by name (as browsers and curl do) and every
 * header whose value holds one of the request's secrets.
 */
static void
drop_credentials(HttpTransfer *t)
{
	static const char *const sensitive[] = {
		"authorization:", "proxy-authorization:", "cookie:", "x-api-key:", "api-key:", NULL
	};
	struct curl_slist *kept = NULL;

	for (struct curl_slist *h = t->hdrs; h; h = h->next)
	{
		bool		drop = holds_secret(t, h->data, strlen(h->data));

		for (int i = 0; sensitive[i]; i++)
			if (pg_strncasecmp(h->data, sensitive[i], strlen(sensitive[i])) == 0)
				drop = true;
		if (!drop)
			kept = curl_slist_append(kept, h->data);
	}
	curl_slist_free_all(t->hdrs);
	t->hdrs = kept;
}

/*
 * May t follow a redirect to location (tuvl.http_allowed_hosts)?  When not,
 * t fails with the reason.  The check pallocs: in a context of its own,
 * deleted before returning (and on an ERROR), so nothing of it outlives the
 * check, whatever the context of the caller (a worker's long-lived one).
 */
static bool
redirect_allowed(HttpTransfer *t, const char *location)
{
	MemoryContext cxt;
	MemoryContext old;
	volatile bool allowed = false;

	/* a URL is visible ASCII (RFC 3986); the server's bytes are not kept */
	for (const char *c = location; *c; c++)
		if ((unsigned char) *c <= 0x20 || (unsigned char) *c >= 0x7f)
		{
			t->fail_kind = "not_allowed";
			t->fail_msg = strdup("redirect refused: the Location header is not a URL (it holds bytes other than visible ASCII)");
			return false;
		}
	cxt = AllocSetContextCreate(TopMemoryContext, "tuvl redirect check", ALLOCSET_SMALL_SIZES);
	old = MemoryContextSwitchTo(cxt);
	PG_TRY();
	{
		char	   *reason;

		allowed = HttpUrlAllowed(location, &reason);
		if (!allowed)
		{
			t->fail_kind = "not_allowed";
			t->fail_msg = strdup(psprintf("redirect refused: %s", reason));
		}
	}
	PG_CATCH();
	{
		/*
		 * Checking a URL is pure computation: an error of it (out of memory,
		 * say) fails this transfer, not the worker with every transfer it has
		 * in flight.  A cancel is thrown on.
		 */
		if (ERRCODE_TO_CATEGORY(geterrcode()) == ERRCODE_OPERATOR_INTERVENTION)
		{
			MemoryContextSwitchTo(old);
			MemoryContextDelete(cxt);
			PG_RE_THROW();
		}
		MemoryContextSwitchTo(cxt);
		FlushErrorState();
		t->fail_kind = "not_allowed";
		t->fail_msg = strdup("redirect refused: its URL could not be checked");
		allowed = false;
	}
	PG_END_TRY();
	MemoryContextSwitchTo(old);
	MemoryContextDelete(cxt);
	return allowed;
}

/* Follow a redirect ourselves, so the allow-list applies; false if not one. */
static bool
maybe_redirect(HttpTransfer *t)
{
	char	   *location = NULL;

	if (t->code != CURLE_OK || t->status < 300 || t->status > 399 ||
		t->status == 304 || t->status == 300)
		return false;
	curl_easy_getinfo(t->easy, CURLINFO_REDIRECT_URL, &location);
	if (location == NULL)
		return false;
	if (t->redirects >= tuvl_http_max_redirects)
	{
		t->fail_kind = "redirects";
		t->fail_msg = strdup("too many redirects");
		return false;
	}
	if (!redirect_allowed(t, location))
		return false;
	t->redirects++;
	{
		char	   *from = url_origin(t->url);
		char	   *to = url_origin(location);
		bool		cross = from == NULL || to == NULL || strcmp(from, to) != 0;

		free(from);
		free(to);
		/* 307 and 308 send the body again: not one that holds a secret */
		if (cross && (t->status == 307 || t->status == 308) && t->body &&
			holds_secret(t, t->body, t->body_len))
		{
			t->fail_kind = "not_allowed";
			t->fail_msg = strdup("redirect refused: the request body holds a secret and the redirect leaves its origin");
			return false;
		}
		if (cross)
			drop_credentials(t);
	}
	free(t->url);
	t->url = strdup(location);
	/* 301/302/303 turn a POST into a GET, as browsers and curl do */
	if (t->status == 303 || ((t->status == 301 || t->status == 302) &&
							 strcmp(t->method, "POST") == 0))
	{
		free(t->method);
		t->method = xstrdup("GET");
		if (!t->body_borrowed)
			free(t->body);
		t->body = NULL;
		t->body_len = 0;
	}
	transfer_remove(t);
	transfer_submit(t);
	return true;
}

/* Move the finished transfers of a shard to the done list. */
/*
 * An HTTPS origin answered HTTP/1.x on a multiplexing shard: remember it,
 * make the shard a plain one, and start again the transfers waiting in it
 * for one of its few connections (libcurl would let them go one per
 * finished transfer).  Only those that sent nothing yet are taken back.
 */
static void
unbound_shard(HttpShard *shard, const char *url)
{
	dlist_mutable_iter iter;

	remember_h1_origin(url);
	shard->multiplexed = false;
	curl_multi_setopt(shard->multi, CURLMOPT_MAX_HOST_CONNECTIONS, 0L);
	dlist_foreach_modify(iter, &in_flight)
	{
		HttpTransfer *w = dlist_container(HttpTransfer, node, iter.cur);
		curl_off_t	sent_at = 0;

		if (w->shard != shard || w->done)
			continue;
		curl_easy_getinfo(w->easy, CURLINFO_PRETRANSFER_TIME_T, &sent_at);
		if (sent_at != 0)
			continue;
		transfer_remove(w);
		w->shard = shard_for_transfer(w->url);
		w->shard->transfers++;
		curl_multi_add_handle(w->shard->multi, w->easy);
	}
}

static void
drain_shard(HttpShard *shard)
{
	CURLMsg    *msg;
	int			left;

	while ((msg = curl_multi_info_read(shard->multi, &left)) != NULL)
	{
		HttpTransfer *t;

		if (msg->msg != CURLMSG_DONE)
			continue;
		curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **) &t);
		t->code = msg->data.result;
		curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &t->status);
		if (t->code == CURLE_OK && shard->multiplexed)
		{
			long		version = 0;

			curl_easy_getinfo(t->easy, CURLINFO_HTTP_VERSION, &version);
			if (version == CURL_HTTP_VERSION_1_0 || version == CURL_HTTP_VERSION_1_1)
				unbound_shard(shard, t->url);
		}
		if (maybe_redirect(t))
			continue;
		transfer_remove(t);
		t->done = true;
		/* latency ends here, not when a busy worker gets to the result */
		INSTR_TIME_SET_CURRENT(t->finish);
		t->finished = true;
		unlink_transfer(t);
		dlist_push_tail(&done_list, &t->node);
		t->list = HTTP_DONE;
	}
}

/*
 * A multiplexing shard has transfers waiting and none of them got a
 * stream for H2_STALL_MS while libcurl was driven: the server's streams
 * on its connections are taken.  Its streams in use per connection, times
 * the connections a shard may have, become the room of every multiplexing
 * shard (libcurl may not have opened them all yet: it opens one for
 * waiting transfers when a transfer ends), and the transfers waiting in
 * it (those that sent nothing) go to shards with room.
 */
static void
unstall_shards(TimestampTz now)
{
	for (int i = 0; i < n_shards; i++)
	{
		HttpShard  *shard = &shards[i];
		dlist_mutable_iter iter;

		if (!shard->multiplexed || shard->transfers <= shard->sent)
		{
			shard->stalled_since = 0;
			continue;
		}
		if (shard->stalled_since == 0 || shard->starts != shard->stall_starts)
		{
			shard->stalled_since = now;
			shard->stall_starts = shard->starts;
			continue;
		}
		if (now - shard->stalled_since < (TimestampTz) H2_STALL_MS * 1000)
			continue;
		shard->stalled_since = 0;
		if (shard->sent == 0)
			continue;			/* no stream yet: not a bound of streams */
		/* the streams of a connection, times the connections a shard has */
		h2_room = Min(h2_room, Max(1, shard->sent / Max(1, shard->sockets)) * H2_CONNECTIONS);
		dlist_foreach_modify(iter, &in_flight)
		{
			HttpTransfer *w = dlist_container(HttpTransfer, node, iter.cur);
			HttpShard  *to;

			if (w->shard != shard || w->sent || w->done)
				continue;
			to = shard_for_transfer(w->url);
			if (to == shard)
				break;			/* no shard with room: they wait here */
			transfer_remove(w);
			w->shard = to;
			to->transfers++;
			curl_multi_add_handle(to->multi, w->easy);
		}
	}
}

/* Move finished transfers to the done list. */
static void
drain_messages(void)
{
	for (int i = 0; i < n_shards; i++)
		drain_shard(&shards[i]);
}

/* Memory was freed: let paused transfers go on (they pause again if need be). */
static void
resume_paused(void)
{
	dlist_iter	it;

	if (n_paused == 0 || buffered >= budget)
		return;
	dlist_foreach(it, &in_flight)
	{
		HttpTransfer *t = dlist_container(HttpTransfer, node, it.cur);

		if (t->paused)
		{
			t->paused = false;
			n_paused--;
			curl_easy_pause(t->easy, CURLPAUSE_CONT);
		}
	}
}

/* How much the response bodies in flight may hold, in bytes. */
void
HttpSetMemoryBudget(size_t bytes)
{
	budget = bytes;
}

/* Bytes held by the response bodies in flight (and not taken yet). */
size_t
HttpBufferedBytes(void)
{
	return buffered;
}

/*
 * Wait up to timeout_ms (-1: forever) for the latch or transfer progress,
 * and drive libcurl.  Returns true when the latch was set (and resets it).
 * Must not be called inside a transaction.
 */
bool
HttpWait(long timeout_ms)
{
	WaitEvent	events[4];
	int			n;
	bool		latch = false;
	long		curl_ms;
	int			running;
	TimestampTz now;

	engine_init();
	curl_ms = HttpTimeoutMs();
	if (curl_ms >= 0 && (timeout_ms < 0 || curl_ms < timeout_ms))
		timeout_ms = curl_ms;

	n = WaitEventSetWait(wait_set, timeout_ms, events, lengthof(events), PG_WAIT_EXTENSION);
	for (int i = 0; i < n; i++)
	{
		if (events[i].events & WL_LATCH_SET)
		{
			ResetLatch(MyLatch);
			latch = true;
		}
		if (events[i].events & WL_SOCKET_READABLE)
		{
			struct epoll_event evs[256];
			int			m;

			while ((m = epoll_wait(epfd, evs, lengthof(evs), 0)) > 0)
			{
				for (int j = 0; j < m; j++)
				{
					int			flags = 0;

					if (evs[j].events & (EPOLLIN | EPOLLHUP | EPOLLERR))
						flags |= CURL_CSELECT_IN;
					if (evs[j].events & EPOLLOUT)
						flags |= CURL_CSELECT_OUT;
					if (evs[j].events & EPOLLERR)
						flags |= CURL_CSELECT_ERR;
					curl_multi_socket_action(EPOLL_SHARD(evs[j].data.u64)->multi,
											 EPOLL_SOCKET(evs[j].data.u64), flags, &running);
				}
				if (m < (int) lengthof(evs))
					break;
			}
		}
	}
	now = GetCurrentTimestamp();
	for (int i = 0; i < n_shards; i++)
		if (shards[i].deadline != 0 && now >= shards[i].deadline)
		{
			shards[i].deadline = 0;
			curl_multi_socket_action(shards[i].multi, CURL_SOCKET_TIMEOUT, 0, &running);
		}
	drain_messages();
	unstall_shards(now);
	resume_paused();
	return latch;
}

/* The transfers that finished since the last call (a List, palloc'd). */
List *
HttpCollectDone(void)
{
	List	   *done = NIL;

	while (!dlist_is_empty(&done_list))
	{
		HttpTransfer *t = dlist_head_element(HttpTransfer, node, &done_list);

		unlink_transfer(t);
		done = lappend(done, t);
	}
	return done;
}

void *
HttpTransferOwner(HttpTransfer *t)
{
	return t->owner;
}

/* Stop a transfer and forget it (its run was aborted). */
void
HttpCancel(HttpTransfer *t)
{
	transfer_free(t);
}

/* The owner no longer wants the result: it is discarded when done. */
void
HttpDisown(HttpTransfer *t)
{
	t->owner = NULL;
}

/*
 * Parse the raw header block into HttpHeader items, names lower-cased,
 * names and values valid text in the database encoding.
 */
static List *
parse_headers(const char *raw)
{
	List	   *headers = NIL;
	const char *p = raw;

	while (p && *p)
	{
		const char *eol = strstr(p, "\r\n");
		const char *colon;
		size_t		linelen = eol ? (size_t) (eol - p) : strlen(p);

		colon = memchr(p, ':', linelen);
		if (colon && strncmp(p, "HTTP/", 5) != 0)
		{
			HttpHeader *h = palloc(sizeof(HttpHeader));
			const char *v = colon + 1;

			/* a server's bytes: made valid text before anything keeps them */
			h->name = TextMakeValid(p, colon - p);
			for (char *c = h->name; *c; c++)
				*c = pg_tolower((unsigned char) *c);
			while (*v == ' ' || *v == '\t')
				v++;
			h->value = TextMakeValid(v, p + linelen - v);
			headers = lappend(headers, h);
		}
		if (!eol)
			break;
		p = eol + 2;
	}
	return headers;
}

/*
 * Copy a finished transfer into a palloc'd result and free the transfer.
 */
HttpResult *
HttpTakeResult(HttpTransfer *t)
{
	HttpResult *res = palloc0(sizeof(HttpResult));
	instr_time	d;

	if (t->finished)
		d = t->finish;
	else
		INSTR_TIME_SET_CURRENT(d);
	INSTR_TIME_SUBTRACT(d, t->start);
	res->latency_ms = INSTR_TIME_GET_MILLISEC(d);
	res->final_url = TextMakeValid(HttpRedactUrl(t->url), strlen(HttpRedactUrl(t->url)));
	res->headers = parse_headers(t->hbuf);
	res->body = t->buf ? pnstrdup(t->buf, t->len) : pstrdup("");
	res->body_len = t->len;
	res->status = (int) t->status;

	if (t->fail_kind)
	{
		res->error_kind = t->fail_kind;
		res->error = t->fail_msg ? TextMakeValid(t->fail_msg, strlen(t->fail_msg)) : pstrdup(t->fail_kind);
		res->status = 0;
	}
	else if (t->too_large)
	{
		res->error_kind = "too_large";
		res->error = psprintf("response body exceeds tuvl.http_max_response_size (%d bytes)",
							  tuvl_http_max_response_size);
		res->status = 0;
		res->body = pstrdup("");
		res->body_len = 0;
	}
	else if (t->stopped)
	{
		/* ended by us once the awaited event was there: complete */
	}
	else if (t->code == CURLE_OPERATION_TIMEDOUT)
	{
		res->error_kind = "timeout";
		res->error = psprintf("request timed out after %d ms", t->timeout_ms);
		res->status = 0;
	}
	else if (t->code != CURLE_OK)
	{
		const char *msg = t->errbuf[0] ? t->errbuf : curl_easy_strerror(t->code);

		res->error_kind = "error";
		res->error = TextMakeValid(msg, strlen(msg));
		res->status = 0;
	}
	transfer_free(t);
	return res;
}

/*
 * Send one request with no body and wait for it, for at most timeout_ms,
 * without checking for interrupts: only for a process that is exiting
 * (an MCP session's DELETE).  Returns the HTTP status, or 0.
 */
long
HttpSendAtExit(const char *method, const char *url, List *headers, long timeout_ms)
{
	CURL	   *e = curl_easy_init();
	struct curl_slist *hdrs = NULL;
	ListCell   *lc;
	long		status = 0;
	char		line[2048];

	if (e == NULL)
		return 0;
	foreach(lc, headers)
	{
		HttpHeader *h = lfirst(lc);

		snprintf(line, sizeof(line), "%s: %s", h->name, h->value);
		hdrs = curl_slist_append(hdrs, line);
	}
	curl_easy_setopt(e, CURLOPT_URL, url);
	curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
	curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
	curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, timeout_ms);
	curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, timeout_ms);
	curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, tuvl_http_verify_tls ? 1L : 0L);
	curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, tuvl_http_verify_tls ? 2L : 0L);
	if (tuvl_http_ca_file && tuvl_http_ca_file[0] != '\0')
		curl_easy_setopt(e, CURLOPT_CAINFO, tuvl_http_ca_file);
	curl_easy_setopt(e, CURLOPT_USERAGENT, "tuvl/" TUVL_VERSION);
	curl_easy_setopt(e, CURLOPT_HTTPHEADER, hdrs);
	curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, discard_cb);
	if (curl_easy_perform(e) == CURLE_OK)
		curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &status);
	curl_slist_free_all(hdrs);
	curl_easy_cleanup(e);
	return status;
}

/* Abandon every transfer (after an ERROR, or at exit). */
void
HttpAbortAll(void)
{
	while (!dlist_is_empty(&in_flight))
	{
		HttpTransfer *t = dlist_head_element(HttpTransfer, node, &in_flight);

		transfer_free(t);
	}
	while (!dlist_is_empty(&done_list))
	{
		HttpTransfer *t = dlist_head_element(HttpTransfer, node, &done_list);

		transfer_free(t);
	}
}

/*
 * Execute one request to completion in this backend (the synchronous
 * path), checking for interrupts while it is in flight.
 */
HttpResult *
HttpPerform(const HttpRequest *req, List *secrets)
{
	HttpTransfer *volatile t = HttpStart(req, secrets, NULL);
	HttpResult *res = NULL;

	PG_TRY();
	{
		while (!t->done)
		{
			CHECK_FOR_INTERRUPTS();
			(void) HttpWait(100);
		}
	}
	PG_CATCH();
	{
		transfer_free(t);
		PG_RE_THROW();
	}
	PG_END_TRY();

	unlink_transfer(t);			/* off the done list */
	res = HttpTakeResult(t);
	return res;
}

/* A response header's value (names are lower-case), or NULL. */
const char *
HttpResultHeader(HttpResult *res, const char *name)
{
	ListCell   *lc;

	foreach(lc, res->headers)
	{
		HttpHeader *h = lfirst(lc);

		if (pg_strcasecmp(h->name, name) == 0)
			return h->value;
	}
	return NULL;
}
