/*-------------------------------------------------------------------------
 *
 * mcp_oauth.h
 *	  OAuth 2.1 for MCP servers (mcp_oauth.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_MCP_OAUTH_H
#define TUVL_MCP_OAUTH_H

#include "utils/jsonb.h"

#include "http.h"
#include "runtime.h"
#include "secret.h"

extern HttpHeader *McpOAuthHeader(RunState *run, Jsonb *auth, const char *url, SecretUse *use);
extern struct EffectRequest *McpOAuthStep(RunState *run, Jsonb *auth, const char *url,
										  SecretUse *use, int timeout_ms, HttpHeader **header,
										  int *start);
extern void McpOAuthCheckRefused(Jsonb *r, const char *url);

#endif							/* TUVL_MCP_OAUTH_H */
