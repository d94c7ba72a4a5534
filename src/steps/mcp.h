/*-------------------------------------------------------------------------
 *
 * mcp.h
 *	  A Model Context Protocol client over the streamable HTTP transport.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_MCP_H
#define TUVL_MCP_H

#include "utils/jsonb.h"

#define MCP_PROTOCOL_VERSION "2025-11-25"
/* The stateless revision: no initialize, no session, _meta on every request. */
#define MCP_STATELESS_VERSION "2026-07-28"

extern Jsonb *McpParseMessage(const char *body, const char *content_type, const char *id,
							  char **error);
extern Jsonb *McpListTools(const char *url);
extern Jsonb *McpKnownInputSchema(Jsonb *mcp);
extern Jsonb *McpListedTools(const char *url);

#endif							/* TUVL_MCP_H */
