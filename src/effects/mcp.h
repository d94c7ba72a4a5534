/*-------------------------------------------------------------------------
 *
 * mcp.h
 *	  A Model Context Protocol client over the streamable HTTP transport
 *	  (mcp.c), and what the MCP step (step_mcp.c) keeps of its progress.
 *
 * Every message is an effect: the client builds it, the caller returns it
 * and finds its journaled result in front of it when executed again.  The
 * sessions and the revisions the process learned are a cache only; what
 * a step does next follows from its journaled effects alone.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_MCP_H
#define TUVL_MCP_H

#include "datatype/timestamp.h"
#include "nodes/pg_list.h"
#include "utils/jsonb.h"

#include "effect.h"
#include "secret.h"

#define MCP_PROTOCOL_VERSION "2025-11-25"
/* The stateless revision: no initialize, no session, _meta on every request. */
#define MCP_STATELESS_VERSION "2026-07-28"

/* Where an MCP step stands with its server, from the effects so far. */
typedef struct McpProgress
{
	char	   *session;		/* NULL: none (yet) */
	char	   *version;
	bool		notified;		/* notifications/initialized was sent */
	bool		from_cache;		/* the session came from this process's cache */
	bool		discovered;		/* the server's revision is known */
	bool		stateless;		/* ... and it is MCP_STATELESS_VERSION */
	bool		learned;		/* this step learned it (not from memory) */
	bool		downgraded;		/* a stateless call was refused with -32022 */
	const char *elicitation;	/* mcp.elicitation: ask, accept_defaults,
								 * decline */
	bool		can_ask;		/* ask: the run may wait for a person (not in
								 * an agent's tool call) */
	Jsonb	   *input_required; /* the last answer asked for input: retry */
	Jsonb	   *answers;		/* ask: a person's answers to it, by request
								 * key (inputResponses entries) */
	Jsonb	   *waits;			/* ask: when each of its requests times out
								 * (until_us), by request key */
	int			rounds;			/* answers that asked for input */
	char	   *task_id;		/* the call became this task: poll it */
	int			task_poll_ms;	/* ... this often */
	TimestampTz task_until;		/* ... next at this time (0: not set yet) */
	const char *oauth_url;		/* mcp.auth: the server, whose 401/403 fail */
	/* ... checked by the step's callback, which raises (mcp_oauth.c) */
	void		(*oauth_refused) (Jsonb *r, const char *url);
	char	   *resume_id;		/* the stream ended before the answer: the
								 * last event id to resume after, or NULL */
	int			resume_ms;		/* ... after the server's retry delay */
	const char *resume_rpc;		/* ... awaiting the answer to this request */
	int			resumes;		/* resumptions so far */
} McpProgress;

/* messages and their answers */
extern Jsonb *McpParseMessage(const char *body, const char *content_type, const char *id,
							  char **error);
extern List *McpRenderHeaders(JsonbValue *headers, Jsonb *ctx, SecretUse *use);
extern struct EffectRequest *McpStatelessRequest(const char *url, const char *method, Jsonb *params,
												 const char *name, const char *id, const char *op,
												 int timeout_ms, List *extra, bool elicit, bool tasks);
extern Jsonb *McpInputRequests(Jsonb *answer);
extern Jsonb *McpRequestParams(Jsonb *req);
extern bool McpRequestIsForm(Jsonb *req);

/* a step's progress: its effects so far, and the next message */
extern bool McpWalkEffects(RunState *run, int first, int n, const char *url, const char *tool,
						   McpProgress *p, Jsonb **answer);
extern struct EffectRequest *McpNextRequest(const char *url, const char *tool, Jsonb *args,
											const char *id, McpProgress *p, int timeout_ms,
											List *extra);

/* what this process keeps: sessions by server and headers, revisions by URL */
extern char *McpSessionKey(const char *url, List *headers);
extern void McpSyncSessionCache(const char *url, int n, McpProgress *p, const char *server,
								List *headers);
extern void McpEndOwnSession(const char *url, McpProgress *p, const char *server, List *headers);
extern int	McpRevisionKnown(const char *url);
extern void McpRevisionRemember(const char *url, bool stateless);

/* the tools tuvl.mcp_list_tools() listed (SPI connected) */
extern Jsonb *McpKnownInputSchema(Jsonb *mcp);
extern Jsonb *McpListedTools(const char *url);

#endif							/* TUVL_MCP_H */
