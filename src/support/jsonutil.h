/*-------------------------------------------------------------------------
 *
 * jsonutil.h
 *	  Small jsonb helpers shared by the runtime: field access, building
 *	  objects, merging keys into a context.
 *
 *-------------------------------------------------------------------------
 */
#ifndef TUVL_JSONUTIL_H
#define TUVL_JSONUTIL_H

#include "lib/stringinfo.h"
#include "utils/jsonb.h"
#include "utils/palloc.h"

extern JsonbValue *JsonGetField(Jsonb *obj, const char *key);
extern char *JsonGetString(Jsonb *obj, const char *key);
extern Jsonb *JsonGetJsonb(Jsonb *obj, const char *key);
extern bool JsonGetBool(Jsonb *obj, const char *key, bool dflt);
extern int64 JsonGetInt(Jsonb *obj, const char *key, int64 dflt);
extern int32 JsonGetInt32(Jsonb *obj, const char *key, int32 dflt);
extern char *JsonGetText(Jsonb *obj, const char *key);
extern bool JsonObjectNext(JsonbIterator **it, char **key, JsonbValue *val);
extern Jsonb *JsonValueToJsonb(JsonbValue *v);
extern char *JsonValueToText(JsonbValue *v);
extern Jsonb *JsonFromCString(const char *text);
extern Jsonb *JsonParseSafe(const char *text, size_t len);
extern Jsonb *JsonParseExternal(const char *text, size_t len, const char **why);
extern char *TextMakeValid(const char *s, size_t len);
extern Jsonb *JsonEmptyObject(void);
extern Jsonb *JsonCopyTo(Jsonb *j, MemoryContext cxt);
extern bool JsonIsObject(Jsonb *j);
extern Jsonb *JsonSetKey(Jsonb *obj, const char *key, Jsonb *value);
extern Jsonb *JsonMerge(Jsonb *a, Jsonb *b);
extern Jsonb *JsonRemoveKey(Jsonb *obj, const char *key);
extern Jsonb *JsonStringValue(const char *s);
extern Jsonb *JsonPublicContext(Jsonb *ctx);
extern char *JsonClipText(const char *text, int maxbytes);
extern char *TextReplaceAll(const char *text, const char *needle, const char *with);
extern char *TextStripFences(const char *text);
extern int	JsonArraySize(Jsonb *j);
extern Jsonb *JsonArrayAt(Jsonb *j, int i);
extern char *JsonText(Jsonb *j);

/*
 * A builder for objects, written in jsonb's format (no JsonbValue tree):
 * JsonObjStart, JsonObjAdd*, JsonObjEnd.  An entry's key and its value's
 * bytes are as jsonb stores them; keys, strings and numbers the builder
 * made are copied into bytes, a Jsonb's or a JsonbValue's data is pointed
 * to (it must live until JsonObjEnd).
 */
typedef struct JsonObjEntry
{
	int			key_off;		/* the key's bytes in the builder's bytes */
	int			key_len;
	int			order;			/* position among the entries added */
	uint32		type;			/* JENTRY_IS* of the value */
	const char *ext;			/* the value's bytes outside the builder, or
								 * NULL: they are at val_off in bytes */
	int			val_off;
	int			val_len;
	bool		aligned;		/* starts at a 4-byte boundary (numeric,
								 * container) */
} JsonObjEntry;

typedef struct JsonObjBuilder
{
	StringInfoData bytes;		/* keys and values copied at Add time */
	JsonObjEntry *entries;
	int			n;
	int			max;
} JsonObjBuilder;

extern void JsonObjStart(JsonObjBuilder *b);
extern void JsonObjAddString(JsonObjBuilder *b, const char *key, const char *val);
extern void JsonObjAddInt(JsonObjBuilder *b, const char *key, int64 val);
extern void JsonObjAddValue(JsonObjBuilder *b, const char *key, JsonbValue *val);
extern Jsonb *JsonArrayAppend(Jsonb *arr, Jsonb *elem);
extern void JsonObjAddBool(JsonObjBuilder *b, const char *key, bool val);
extern void JsonObjAddJsonb(JsonObjBuilder *b, const char *key, Jsonb *val);
extern void JsonObjAddNull(JsonObjBuilder *b, const char *key);
extern Jsonb *JsonObjEnd(JsonObjBuilder *b);

/*
 * An array built element by element in jsonb's format (no JsonbValue
 * tree): JsonArrayBuildStart, JsonArrayBuildAdd, JsonArrayBuildEnd.
 */
typedef struct JsonArrayBuilder
{
	StringInfoData data;		/* the elements' data */
	JEntry	   *entries;		/* one per element */
	int			n;
	int			max;
} JsonArrayBuilder;

extern void JsonArrayBuildStart(JsonArrayBuilder *ab, Jsonb *prefix);
extern void JsonArrayBuildAdd(JsonArrayBuilder *ab, Jsonb *elem);
extern int64 JsonArrayBuildSize(JsonArrayBuilder *ab, int64 extra);
extern Jsonb *JsonArrayBuildEnd(JsonArrayBuilder *ab);
extern Jsonb *JsonArrayBuildCopy(JsonArrayBuilder *ab);

#endif							/* TUVL_JSONUTIL_H */
