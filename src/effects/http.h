/*-------------------------------------------------------------------------
 *
 * http.h
 *	  HTTP effects through one libcurl multi handle per process.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_HTTP_H
#define TUVL_HTTP_H

#include "nodes/pg_list.h"

typedef struct HttpHeader
{
	char	   *name;
	char	   *value;
} HttpHeader;

/* A request, fully rendered (secrets included); palloc'd by the caller. */
typedef struct HttpRequest
{
	const char *method;
	const char *url;
	List	   *headers;		/* of HttpHeader */
	const char *body;			/* NULL: no body */
	size_t		body_len;
	int			timeout_ms;
	bool		body_borrowed;	/* body outlives the transfer: not copied */
	const char *stop_after;		/* NULL, or: an event stream that never ends
								 * is complete once this text has arrived and
								 * the event holding it has ended (a blank
								 * line); the rest is not waited for */
} HttpRequest;

/* The outcome of a request, palloc'd by HttpTakeResult. */
typedef struct HttpResult
{
	int			status;			/* HTTP status; 0 when the transfer failed */
	const char *error_kind;		/* NULL, or "timeout", "too_large",
								 * "not_allowed", "redirects", "error" */
	char	   *error;			/* human-readable transport error */
	char	   *body;			/* NUL-terminated */
	size_t		body_len;
	List	   *headers;		/* of HttpHeader, names lower-cased */
	double		latency_ms;
	char	   *final_url;		/* after redirects */
} HttpResult;

typedef struct HttpTransfer HttpTransfer;

extern void HttpCheckAllowed(const char *url);
extern bool HttpUrlAllowed(const char *url, char **reason);
extern HttpTransfer *HttpStart(const HttpRequest *req, List *secrets, void *owner);
extern int	HttpInFlight(void);
extern long HttpTimeoutMs(void);
extern bool HttpWait(long timeout_ms);
extern List *HttpCollectDone(void);
extern void *HttpTransferOwner(HttpTransfer *t);
extern void HttpDisown(HttpTransfer *t);
extern void HttpCancel(HttpTransfer *t);
extern HttpResult *HttpTakeResult(HttpTransfer *t);
extern void HttpAbortAll(void);
extern long HttpSendAtExit(const char *method, const char *url, List *headers, long timeout_ms);
extern HttpResult *HttpPerform(const HttpRequest *req, List *secrets);
extern const char *HttpResultHeader(HttpResult *res, const char *name);
extern void HttpSetMemoryBudget(size_t bytes);
extern void HttpReleaseMemory(void);
extern size_t HttpBufferedBytes(void);
extern char *HttpRedactUrl(const char *url);

#endif							/* TUVL_HTTP_H */
