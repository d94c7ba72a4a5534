/*-------------------------------------------------------------------------
 *
 * yamlparse.h
 *	  Parse YAML documents into jsonb, remembering where each node came from.
 *
 * src/yamlparse.h
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_YAMLPARSE_H
#define TUVL_YAMLPARSE_H

#include "utils/jsonb.h"

/*
 * Parse YAML source into jsonb.  If positions is not NULL, *positions is
 * set to a jsonb object mapping each node's path to the [line, column]
 * (1-based) where that node's value starts.  Paths join object keys with
 * '.' and write array elements as [i], e.g. "name", "steps[2].routes.paid",
 * "trigger.input.properties.order_id"; the root (path "") is not in the
 * map.  what is a noun for messages, e.g. "workflow", "LLM config".
 */
extern Jsonb *YamlToJsonb(const char *source, const char *what, Jsonb **positions);

/*
 * Look up "line L, column C" for a path in a positions object; returns
 * NULL if unknown.  The result is palloc'd.
 */
extern char *YamlPositionText(Jsonb *positions, const char *path);

#endif							/* TUVL_YAMLPARSE_H */
