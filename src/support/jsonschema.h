/*-------------------------------------------------------------------------
 *
 * jsonschema.h
 *	  Validation of jsonb values against a subset of JSON Schema.
 *
 * Supported keywords: type, required, properties, items, enum, minimum,
 * maximum, minLength, maxLength, additionalProperties; description, title,
 * default and $schema are accepted and ignored.  All results are palloc'd
 * in CurrentMemoryContext.  Jsonb arguments must be detoasted and non-NULL.
 *
 * src/jsonschema.h
 *
 *-------------------------------------------------------------------------
 */
#ifndef JSONSCHEMA_H
#define JSONSCHEMA_H

#include "nodes/pg_list.h"
#include "utils/jsonb.h"

typedef struct JsonSchemaError
{
	char	   *path;			/* e.g. "$.items[2].qty", "$" for the root */
	char	   *rule;			/* keyword that failed, e.g. "type",
								 * "required", "minimum" */
	char	   *message;		/* short description, e.g. "expected integer,
								 * got string" or "missing required property
								 * \"order_id\"" */
} JsonSchemaError;

/*
 * Returns NULL when valid, else the FIRST violation found (depth-first:
 * type, enum, then bounds, items or, for objects, properties in schema
 * order, then required, then additionalProperties).
 */
extern JsonSchemaError *JsonSchemaValidate(Jsonb *schema, Jsonb *instance);

/*
 * Like JsonSchemaValidate, but raises ERROR naming "what" (a noun such as
 * "run input") when the instance does not match.
 */
extern void JsonSchemaValidateOrError(Jsonb *schema, Jsonb *instance,
									  const char *what);

/*
 * Well-formedness check of a schema.  Returns a List of JsonSchemaError *
 * whose paths are locations inside the schema, prefixed by basepath
 * (NULL or "" means "$"); NIL when the schema is fine.
 */
extern List *JsonSchemaCheck(Jsonb *schema, const char *basepath);

/*
 * The longest regular expression tuvl compiles, in bytes: a JSON Schema
 * "pattern" or a guardrail's.  PostgreSQL's regex engine refuses a pattern
 * that is too complex, but only after memory that grows with the
 * square of a long literal's length (a 32 kB one reserves half a gigabyte).
 */
#define JSON_SCHEMA_MAX_PATTERN_LEN 8192

#endif							/* JSONSCHEMA_H */
