/*-------------------------------------------------------------------------
 *
 * yamlparse.c
 *	  Parse a YAML document into jsonb and record where each node came from.
 *
 * libyaml's event parser feeds a small tree of YNodes, which is then walked
 * once to build the jsonb value and, on request, a jsonb object mapping each
 * node's path to its [line, column].  Plain scalars follow the YAML 1.2 core
 * schema; mapping keys are always strings.  An alias shares its anchor's
 * subtree, and every node carries its size after alias expansion, so the
 * node, size and depth limits are enforced before anything is expanded.
 *
 * Invariants: no SPI, no catalog access, no transaction state beyond a
 * current memory context (and the tuvl.max_source_size limit).  Results are palloc'd in the caller's
 * CurrentMemoryContext; scratch memory lives in a private child context that
 * is deleted before returning.  libyaml allocates with malloc, so the parser
 * and the current event are released by a reset callback on that child
 * context, which YamlToJsonb deletes both on success and (in PG_CATCH,
 * before re-throwing) on error.  No libyaml callbacks are installed, so no
 * PostgreSQL code ever runs inside libyaml.
 *
 * src/yamlparse.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <yaml.h>

#include "common/hashfn.h"
#include "lib/stringinfo.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/numeric.h"

#include "tuvl.h"
#include "yamlparse.h"

/* Limits that stop "billion laughs" documents, counted after alias expansion */
#define YAML_MAX_NODES		100000
#define YAML_MAX_DEPTH		100
#define YAML_MAX_SIZE_MB	64

typedef enum YNodeKind
{
	YN_SCALAR,
	YN_SEQUENCE,
	YN_MAPPING,
	YN_ALIAS
} YNodeKind;

typedef enum ScalarType
{
	ST_IMPLICIT,				/* untagged plain scalar: core schema */
	ST_STR,
	ST_NULL,
	ST_BOOL,
	ST_INT,
	ST_FLOAT
} ScalarType;

typedef struct YNode YNode;

typedef struct YPair
{
	char	   *key;			/* key text in the database encoding */
	int			keylen;
	int			line;			/* 1-based position of the key */
	int			column;
	YNode	   *value;
} YPair;

struct YNode
{
	YNodeKind	kind;
	int			line;			/* 1-based start of the node's value */
	int			column;
	int			height;			/* container levels, aliases expanded */
	int			count;			/* nodes produced, aliases expanded */
	int64		size;			/* bytes of text and paths, aliases expanded */
	char	   *text;			/* YN_SCALAR: text in the database encoding */
	int			textlen;
	JsonbValue	value;			/* YN_SCALAR: resolved value */
	int			nitems;			/* YN_SEQUENCE, YN_MAPPING */
	int			maxitems;
	YNode	  **items;			/* YN_SEQUENCE */
	YPair	   *pairs;			/* YN_MAPPING */
	YNode	   *target;			/* YN_ALIAS: the anchored node */
};

typedef struct AnchorEntry
{
	const char *name;			/* hash key: pointer to a palloc'd name */
	YNode	   *node;
} AnchorEntry;

typedef struct YamlParse
{
	const char *what;			/* noun for messages */
	const char *source;			/* UTF-8 text handed to libyaml */
	bool		convert;		/* convert strings from UTF-8 to server
								 * encoding */
	yaml_parser_t parser;
	bool		have_parser;	/* parser needs yaml_parser_delete */
	yaml_event_t event;
	bool		have_event;		/* event needs yaml_event_delete */
	MemoryContextCallback cleanup;
	HTAB	   *anchors;		/* name -> node, created on first anchor */
	YNode	   *errnode;		/* node named in error context, if any */
} YamlParse;

typedef struct BuildState
{
	JsonbParseState *data;
	JsonbParseState *pos;
	bool		want_positions;
	YNode	   *root;
	JsonbValue *result;			/* the root container once complete */
	StringInfoData path;
} BuildState;

static YNode *parse_node(YamlParse *yp, int depth);

/* Memory context reset callback: give libyaml's malloc'd memory back. */
static void
free_libyaml(void *arg)
{
	YamlParse  *yp = (YamlParse *) arg;

	if (yp->have_event)
		yaml_event_delete(&yp->event);
	if (yp->have_parser)
		yaml_parser_delete(&yp->parser);
	yp->have_event = yp->have_parser = false;
}

/* Error context callback naming the value being converted, if any. */
static void
value_errcontext(void *arg)
{
	YamlParse  *yp = (YamlParse *) arg;

	if (yp->errnode)
		errcontext("%s YAML value at line %d, column %d",
				   yp->what, yp->errnode->line, yp->errnode->column);
}

/* 1-based line and column (in characters) of a byte offset in src. */
static void
offset_position(const char *src, size_t offset, int *line, int *column)
{
	size_t		i;

	*line = *column = 1;
	for (i = 0; i < offset && src[i] != '\0'; i++)
	{
		if (src[i] == '\n')
		{
			(*line)++;
			*column = 1;
		}
		else if (((unsigned char) src[i] & 0xC0) != 0x80)
			(*column)++;
	}
}

/* Is the character at 0-based (line, column) of src a tab? */
static bool
tab_at(const char *src, size_t line, size_t column)
{
	const unsigned char *p = (const unsigned char *) src;

	while (line > 0 && *p)
		if (*p++ == '\n')
			line--;
	for (; column > 0 && *p && *p != '\n'; column--)
	{
		p++;
		while ((*p & 0xC0) == 0x80)
			p++;
	}
	return *p == '\t';
}

/*
 * Raise the error for a failed yaml_parser_parse: ERRCODE_OUT_OF_MEMORY if
 * libyaml ran out of memory, else a syntax error with 1-based position.
 */
static void
pg_attribute_noreturn()
report_syntax_error(YamlParse *yp)
{
	yaml_parser_t *p = &yp->parser;
	const char *problem = p->problem ? p->problem : "unknown problem";
	char	   *text;
	int			line;
	int			column;
	const char *hint = "Check the indentation, quoting and brackets near that position.";

	if (p->error == YAML_MEMORY_ERROR)
		ereport(ERROR,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("out of memory"),
				 errdetail("libyaml could not allocate memory while parsing %s.",
						   yp->what)));
	if (p->error == YAML_READER_ERROR)
	{
		offset_position(yp->source, p->problem_offset, &line, &column);
		text = p->problem_value < 0 ? pstrdup(problem) :
			psprintf("%s (character 0x%02X)", problem, (unsigned) p->problem_value);
		hint = "The text must be UTF-8 without control characters other than tab and line breaks.";
	}
	else
	{
		line = (int) p->problem_mark.line + 1;
		column = (int) p->problem_mark.column + 1;
		text = !p->context ? pstrdup(problem) :
			psprintf("%s (%s that started at line %d, column %d)",
					 problem, p->context, (int) p->context_mark.line + 1,
					 (int) p->context_mark.column + 1);
		if (strstr(problem, "tab") != NULL ||
			tab_at(yp->source, p->problem_mark.line, p->problem_mark.column))
			hint = "YAML does not allow tab characters for indentation; indent with spaces instead.";
	}
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_TEXT_REPRESENTATION),
			 errmsg("could not parse %s YAML", yp->what),
			 errdetail("Line %d, column %d: %s.", line, column, text),
			 errhint("%s", hint)));
}

/* Replace the current event by the next one; syntax errors are raised here. */
static void
next_event(YamlParse *yp)
{
	CHECK_FOR_INTERRUPTS();
	if (yp->have_event)
		yaml_event_delete(&yp->event);
	yp->have_event = false;
	if (!yaml_parser_parse(&yp->parser, &yp->event))
		report_syntax_error(yp);
	yp->have_event = true;
}

static YNode *
new_node(YNodeKind kind, const yaml_mark_t *mark)
{
	YNode	   *node = palloc0(sizeof(YNode));

	node->kind = kind;
	node->line = (int) mark->line + 1;
	node->column = (int) mark->column + 1;
	node->count = 1;
	node->height = (kind == YN_SEQUENCE || kind == YN_MAPPING) ? 1 : 0;
	return node;
}

static void
pg_attribute_noreturn()
too_deep(YamlParse *yp, YNode *node)
{
	ereport(ERROR,
			(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
			 errmsg("%s YAML is nested too deeply", yp->what),
			 errdetail("Nesting exceeds %d levels at line %d, column %d, counting each alias as a copy of its anchor.",
					   YAML_MAX_DEPTH, node->line, node->column)));
}

/* Error out if node exceeds the node or size limit; "at" names the place. */
static void
check_size(YamlParse *yp, YNode *node, YNode *at)
{
	if (node->count > YAML_MAX_NODES ||
		node->size > (int64) YAML_MAX_SIZE_MB * 1024 * 1024)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("%s YAML is too large", yp->what),
				 errdetail("The limit of %d nodes or %d MB of text and paths was reached at line %d, column %d, counting each alias as a copy of its anchor.",
						   YAML_MAX_NODES, YAML_MAX_SIZE_MB, at->line, at->column),
				 errhint("Use fewer aliases or split the document.")));
}

/*
 * Account for a child just added to a container: expanded node count, size
 * (text plus the bytes its paths will take) and height.  "segment" is the
 * length the child adds to the path.
 */
static void
count_child(YamlParse *yp, YNode *parent, YNode *child, int segment)
{
	parent->count += child->count;
	parent->size += child->size + (int64) segment * child->count;
	parent->height = Max(parent->height, child->height + 1);
	check_size(yp, parent, child);
}

/*
 * Copy a string from an event into palloc'd memory in the database encoding.
 * Rejects NUL bytes and text not valid in the database encoding.
 */
static char *
event_string(YamlParse *yp, YNode *node, const yaml_char_t *s, size_t len)
{
	char	   *result;

	if (memchr(s, '\0', len) != NULL)
		ereport(ERROR,
				(errcode(ERRCODE_UNTRANSLATABLE_CHARACTER),
				 errmsg("%s YAML contains a NUL character", yp->what),
				 errdetail("The string at line %d, column %d contains \\0, which text cannot hold.",
						   node->line, node->column)));
	result = pnstrdup((const char *) s, len);
	if (yp->convert)
	{
		yp->errnode = node;
		result = pg_any_to_server(result, (int) len, PG_UTF8);
		yp->errnode = NULL;
	}
	if (!pg_verifymbstr(result, strlen(result), true))
		ereport(ERROR,
				(errcode(ERRCODE_CHARACTER_NOT_IN_REPERTOIRE),
				 errmsg("%s YAML contains a string that is not valid in the database encoding",
						yp->what),
				 errdetail("The string starts at line %d, column %d.",
						   node->line, node->column)));
	return result;
}

static void
pg_attribute_noreturn()
unsupported_tag(YamlParse *yp, YNode *node, const char *tag)
{
	const char *shown = tag;
	const char *p;

	if (strncmp(tag, "tag:yaml.org,2002:", 18) == 0)
		shown = psprintf("!!%s", tag + 18);
	for (p = shown; *p; p++)
		if ((unsigned char) *p < 0x20 || (unsigned char) *p > 0x7E)
			shown = "(non-ASCII tag)";
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_TEXT_REPRESENTATION),
			 errmsg("unsupported YAML tag \"%s\" in %s", shown, yp->what),
			 errdetail("The tag is used at line %d, column %d.",
					   node->line, node->column),
			 errhint("Supported tags are !!str, !!int, !!float, !!bool and !!null on scalars, !!seq on sequences and !!map on mappings.")));
}

/* How an explicit tag (or its absence) says a scalar must be typed. */
static ScalarType
scalar_type(YamlParse *yp, YNode *node, const char *tag, bool plain)
{
	if (tag == NULL)
		return plain ? ST_IMPLICIT : ST_STR;
	if (strcmp(tag, "!") == 0 || strcmp(tag, YAML_STR_TAG) == 0)
		return ST_STR;
	if (strcmp(tag, YAML_NULL_TAG) == 0)
		return ST_NULL;
	if (strcmp(tag, YAML_BOOL_TAG) == 0)
		return ST_BOOL;
	if (strcmp(tag, YAML_INT_TAG) == 0)
		return ST_INT;
	if (strcmp(tag, YAML_FLOAT_TAG) == 0)
		return ST_FLOAT;
	unsupported_tag(yp, node, tag);
}

/* Core schema: [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)? */
static bool
is_decimal(const char *s, bool *integral)
{
	int			digits = 0;
	int			expdigits = 0;

	*integral = true;
	if (*s == '+' || *s == '-')
		s++;
	for (; *s >= '0' && *s <= '9'; s++)
		digits++;
	if (*s == '.')
	{
		*integral = false;
		for (s++; *s >= '0' && *s <= '9'; s++)
			digits++;
	}
	if (digits == 0)
		return false;
	if (*s == 'e' || *s == 'E')
	{
		*integral = false;
		s++;
		if (*s == '+' || *s == '-')
			s++;
		for (; *s >= '0' && *s <= '9'; s++)
			expdigits++;
		if (expdigits == 0)
			return false;
	}
	return *s == '\0';
}

/*
 * Core schema 0x[0-9a-fA-F]+ and 0o[0-7]+: returns false if s is neither,
 * stores the value otherwise; errors if it does not fit in 64 bits.
 */
static bool
parse_radix(YamlParse *yp, YNode *node, uint64 *result)
{
	const char *s = node->text;
	bool		hex = (s[1] == 'x');

	if (s[0] != '0' || (s[1] != 'x' && s[1] != 'o') || s[2] == '\0' ||
		s[2 + strspn(s + 2, hex ? "0123456789abcdefABCDEF" : "01234567")] != '\0')
		return false;
	errno = 0;
	*result = strtou64(s + 2, NULL, hex ? 16 : 8);
	if (errno == ERANGE)
		ereport(ERROR,
				(errcode(ERRCODE_NUMERIC_VALUE_OUT_OF_RANGE),
				 errmsg("integer \"%s\" in %s YAML is out of range", s, yp->what),
				 errdetail("Hexadecimal and octal integers must fit in 64 bits; this one is at line %d, column %d.",
						   node->line, node->column)));
	return true;
}

static bool
is_special_float(const char *s)
{
	const char *t = (*s == '+' || *s == '-') ? s + 1 : s;

	return strcmp(t, ".inf") == 0 || strcmp(t, ".Inf") == 0 ||
		strcmp(t, ".INF") == 0 || strcmp(s, ".nan") == 0 ||
		strcmp(s, ".NaN") == 0 || strcmp(s, ".NAN") == 0;
}

static void
set_number(YamlParse *yp, YNode *node, const char *digits)
{
	yp->errnode = node;
	node->value.type = jbvNumeric;
	node->value.val.numeric =
		DatumGetNumeric(DirectFunctionCall3(numeric_in, CStringGetDatum(digits),
											ObjectIdGetDatum(InvalidOid),
											Int32GetDatum(-1)));
	yp->errnode = NULL;
}

/*
 * Give a scalar node its jsonb value according to "type".  Errors if an
 * explicit tag does not fit the text, or for infinities and NaNs.
 */
static void
resolve_scalar(YamlParse *yp, YNode *node, ScalarType type)
{
	const char *s = node->text;
	JsonbValue *v = &node->value;
	bool		implicit = (type == ST_IMPLICIT);
	bool		integral;
	uint64		radix;
	static const char *const tagnames[] = {"", "!!str", "!!null", "!!bool", "!!int", "!!float"};

	if (type == ST_STR)
		goto string;
	if ((implicit || type == ST_NULL) &&
		(*s == '\0' || strcmp(s, "~") == 0 || strcmp(s, "null") == 0 ||
		 strcmp(s, "Null") == 0 || strcmp(s, "NULL") == 0))
	{
		v->type = jbvNull;
		return;
	}
	if ((implicit || type == ST_BOOL) &&
		(strcmp(s, "true") == 0 || strcmp(s, "True") == 0 || strcmp(s, "TRUE") == 0 ||
		 strcmp(s, "false") == 0 || strcmp(s, "False") == 0 || strcmp(s, "FALSE") == 0))
	{
		v->type = jbvBool;
		v->val.boolean = (*s == 't' || *s == 'T');
		return;
	}
	if (implicit || type == ST_INT || type == ST_FLOAT)
	{
		if (is_decimal(s, &integral) && (integral || type != ST_INT))
		{
			set_number(yp, node, s);
			return;
		}
		if (type != ST_FLOAT && parse_radix(yp, node, &radix))
		{
			set_number(yp, node, psprintf(UINT64_FORMAT, radix));
			return;
		}
		if (type != ST_INT && is_special_float(s))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_TEXT_REPRESENTATION),
					 errmsg("%s YAML contains a number that JSON cannot represent", yp->what),
					 errdetail("The value \"%s\" at line %d, column %d is infinite or not a number.",
							   s, node->line, node->column),
					 errhint("Quote the value to use it as a string.")));
	}
	if (!implicit)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_TEXT_REPRESENTATION),
				 errmsg("invalid %s value \"%s\" in %s YAML", tagnames[type], s, yp->what),
				 errdetail("The value at line %d, column %d does not match its tag.",
						   node->line, node->column)));
string:
	v->type = jbvString;
	v->val.string.val = node->text;
	v->val.string.len = node->textlen;
}

static uint32
anchor_hash(const void *key, Size keysize pg_attribute_unused())
{
	const char *name = *(const char *const *) key;

	return hash_bytes((const unsigned char *) name, (int) strlen(name));
}

static int
anchor_match(const void *key1, const void *key2,
			 Size keysize pg_attribute_unused())
{
	return strcmp(*(const char *const *) key1, *(const char *const *) key2);
}

/* Remember node under anchor "name" (palloc'd, or NULL for no anchor). */
static void
define_anchor(YamlParse *yp, char *name, YNode *node)
{
	AnchorEntry *entry;

	if (name == NULL)
		return;
	if (yp->anchors == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(char *);
		ctl.entrysize = sizeof(AnchorEntry);
		ctl.hash = anchor_hash;
		ctl.match = anchor_match;
		ctl.hcxt = CurrentMemoryContext;
		yp->anchors = hash_create("YAML anchors", 64, &ctl,
								  HASH_ELEM | HASH_FUNCTION | HASH_COMPARE | HASH_CONTEXT);
	}
	entry = hash_search(yp->anchors, &name, HASH_ENTER, NULL);
	entry->node = node;
}

/* The node the current alias event refers to; errors if there is none. */
static YNode *
find_anchor(YamlParse *yp)
{
	const char *name = (const char *) yp->event.data.alias.anchor;
	AnchorEntry *entry = NULL;

	if (yp->anchors)
		entry = hash_search(yp->anchors, &name, HASH_FIND, NULL);
	if (entry == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_TEXT_REPRESENTATION),
				 errmsg("unknown YAML alias \"*%s\" in %s", name, yp->what),
				 errdetail("The alias at line %d, column %d does not refer to an anchor defined before it.",
						   (int) yp->event.start_mark.line + 1,
						   (int) yp->event.start_mark.column + 1)));
	return entry->node;
}

static char *
anchor_name(const yaml_char_t *anchor)
{
	return anchor ? pstrdup((const char *) anchor) : NULL;
}

/* Scalar event -> node; "as_key" keeps the text as a string whatever it is. */
static YNode *
parse_scalar(YamlParse *yp, bool as_key)
{
	yaml_event_t *ev = &yp->event;
	YNode	   *node = new_node(YN_SCALAR, &ev->start_mark);
	ScalarType	type;

	node->text = event_string(yp, node, ev->data.scalar.value, ev->data.scalar.length);
	node->textlen = strlen(node->text);
	node->size = node->textlen;
	type = scalar_type(yp, node, (const char *) ev->data.scalar.tag,
					   ev->data.scalar.style == YAML_PLAIN_SCALAR_STYLE);
	resolve_scalar(yp, node, as_key ? ST_STR : type);
	define_anchor(yp, anchor_name(ev->data.scalar.anchor), node);
	return node;
}

/* Alias event -> node sharing the anchored subtree. */
static YNode *
parse_alias(YamlParse *yp, int depth)
{
	YNode	   *target = find_anchor(yp);
	YNode	   *node = new_node(YN_ALIAS, &yp->event.start_mark);

	node->target = target;
	node->count = target->count;
	node->size = target->size;
	node->height = target->height;
	if (depth + target->height > YAML_MAX_DEPTH)
		too_deep(yp, node);
	return node;
}

/* The current event starts a mapping key: fill in the pair's key. */
static void
parse_key(YamlParse *yp, YPair *pair)
{
	yaml_event_t *ev = &yp->event;
	YNode	   *key = NULL;

	pair->line = (int) ev->start_mark.line + 1;
	pair->column = (int) ev->start_mark.column + 1;
	if (ev->type == YAML_SCALAR_EVENT)
		key = parse_scalar(yp, true);
	else if (ev->type == YAML_ALIAS_EVENT)
		key = find_anchor(yp);
	if (key == NULL || key->kind != YN_SCALAR)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_TEXT_REPRESENTATION),
				 errmsg("%s YAML has a mapping key that is not a scalar", yp->what),
				 errdetail("The key at line %d, column %d is a sequence or a mapping.",
						   pair->line, pair->column),
				 errhint("Mapping keys must be strings.")));
	pair->key = key->text;
	pair->keylen = key->textlen;
}

static int
pair_cmp(const void *a, const void *b)
{
	const YPair *pa = (const YPair *) a;
	const YPair *pb = (const YPair *) b;
	int			r;

	if (pa->keylen != pb->keylen)
		return pa->keylen < pb->keylen ? -1 : 1;
	if ((r = memcmp(pa->key, pb->key, pa->keylen)) != 0)
		return r;
	if (pa->line != pb->line)
		return pa->line < pb->line ? -1 : 1;
	return (pa->column > pb->column) - (pa->column < pb->column);
}

/*
 * Sort a mapping's pairs by key, then position, and report the earliest
 * repeated key, if any.
 */
static void
check_duplicate_keys(YamlParse *yp, YNode *map)
{
	YPair	   *dup = NULL;
	int			i;

	if (map->nitems < 2)
		return;
	qsort(map->pairs, map->nitems, sizeof(YPair), pair_cmp);
	for (i = 1; i < map->nitems; i++)
	{
		YPair	   *a = &map->pairs[i - 1];
		YPair	   *b = &map->pairs[i];

		if (a->keylen == b->keylen && memcmp(a->key, b->key, a->keylen) == 0 &&
			(dup == NULL || b->line < dup->line ||
			 (b->line == dup->line && b->column < dup->column)))
			dup = b;
	}
	if (dup)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_TEXT_REPRESENTATION),
				 errmsg("duplicate key \"%s\" in %s YAML", dup->key, yp->what),
				 errdetail("The key at line %d, column %d was already used at line %d, column %d of the same mapping.",
						   dup->line, dup->column, dup[-1].line, dup[-1].column)));
}

/*
 * Sequence or mapping start event -> node, consuming events up to and
 * including the matching end event.  "depth" counts enclosing containers.
 */
static YNode *
parse_collection(YamlParse *yp, int depth)
{
	yaml_event_t *ev = &yp->event;
	bool		is_map = (ev->type == YAML_MAPPING_START_EVENT);
	YNode	   *node = new_node(is_map ? YN_MAPPING : YN_SEQUENCE, &ev->start_mark);
	const char *tag = (const char *) (is_map ? ev->data.mapping_start.tag :
									  ev->data.sequence_start.tag);
	char	   *anchor = anchor_name(is_map ? ev->data.mapping_start.anchor :
									 ev->data.sequence_start.anchor);

	if (tag && strcmp(tag, "!") != 0 &&
		strcmp(tag, is_map ? YAML_MAP_TAG : YAML_SEQ_TAG) != 0)
		unsupported_tag(yp, node, tag);
	if (depth >= YAML_MAX_DEPTH)
		too_deep(yp, node);

	for (;;)
	{
		YNode	   *child;

		next_event(yp);
		if (ev->type == YAML_SEQUENCE_END_EVENT || ev->type == YAML_MAPPING_END_EVENT)
			break;
		if (node->nitems == node->maxitems)
		{
			node->maxitems = node->maxitems ? node->maxitems * 2 : 8;
			if (is_map)
				node->pairs = node->pairs ?
					repalloc(node->pairs, node->maxitems * sizeof(YPair)) :
					palloc(node->maxitems * sizeof(YPair));
			else
				node->items = node->items ?
					repalloc(node->items, node->maxitems * sizeof(YNode *)) :
					palloc(node->maxitems * sizeof(YNode *));
		}
		if (is_map)
		{
			YPair	   *pair = &node->pairs[node->nitems];

			parse_key(yp, pair);
			next_event(yp);
			child = pair->value = parse_node(yp, depth + 1);
			node->nitems++;
			count_child(yp, node, child, pair->keylen + 1);
		}
		else
		{
			child = node->items[node->nitems++] = parse_node(yp, depth + 1);
			count_child(yp, node, child, 8);
		}
	}
	if (is_map)
		check_duplicate_keys(yp, node);
	define_anchor(yp, anchor, node);
	return node;
}

/* The current event starts a node: parse the whole node into a tree. */
static YNode *
parse_node(YamlParse *yp, int depth)
{
	check_stack_depth();
	switch (yp->event.type)
	{
		case YAML_SCALAR_EVENT:
			return parse_scalar(yp, false);
		case YAML_ALIAS_EVENT:
			return parse_alias(yp, depth);
		case YAML_SEQUENCE_START_EVENT:
		case YAML_MAPPING_START_EVENT:
			return parse_collection(yp, depth);
		default:
			elog(ERROR, "unexpected libyaml event type %d", (int) yp->event.type);
	}
	return NULL;				/* keep compiler quiet */
}

/* Parse the whole stream, which must hold exactly one non-empty document. */
static YNode *
parse_stream(YamlParse *yp)
{
	YNode	   *root = NULL;

	next_event(yp);				/* STREAM-START */
	next_event(yp);
	if (yp->event.type == YAML_DOCUMENT_START_EVENT)
	{
		next_event(yp);
		root = parse_node(yp, 0);
		next_event(yp);			/* DOCUMENT-END */
		next_event(yp);
		if (yp->event.type != YAML_STREAM_END_EVENT)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_TEXT_REPRESENTATION),
					 errmsg("%s YAML contains more than one document", yp->what),
					 errdetail("A second document starts at line %d, column %d.",
							   (int) yp->event.start_mark.line + 1,
							   (int) yp->event.start_mark.column + 1),
					 errhint("Remove the extra \"---\" or \"...\" document marker.")));
	}
	if (root == NULL ||
		(root->kind == YN_SCALAR && root->textlen == 0 && root->value.type == jbvNull))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s is empty", yp->what),
				 errdetail("The YAML text contains no value, only whitespace, comments or document markers.")));
	check_size(yp, root, root);
	return root;
}

/* Add [line, column] of node under the current path to the positions. */
static void
record_position(BuildState *bs, YNode *node)
{
	JsonbValue	v;

	v.type = jbvString;
	v.val.string.val = pnstrdup(bs->path.data, bs->path.len);
	v.val.string.len = bs->path.len;
	(void) pushJsonbValue(&bs->pos, WJB_KEY, &v);
	(void) pushJsonbValue(&bs->pos, WJB_BEGIN_ARRAY, NULL);
	v.type = jbvNumeric;
	v.val.numeric = int64_to_numeric(node->line);
	(void) pushJsonbValue(&bs->pos, WJB_ELEM, &v);
	v.val.numeric = int64_to_numeric(node->column);
	(void) pushJsonbValue(&bs->pos, WJB_ELEM, &v);
	(void) pushJsonbValue(&bs->pos, WJB_END_ARRAY, NULL);
}

/*
 * Push node (and, with aliases expanded, everything below it) into the jsonb
 * being built, as "token" (WJB_ELEM or WJB_VALUE) of its container.
 */
static void
build_node(BuildState *bs, YNode *node, JsonbIteratorToken token)
{
	int			save = bs->path.len;
	int			i;

	check_stack_depth();
	if (bs->want_positions && node != bs->root)
		record_position(bs, node);
	if (node->kind == YN_ALIAS)
		node = node->target;
	if (node->kind == YN_SCALAR)
	{
		(void) pushJsonbValue(&bs->data, token, &node->value);
		return;
	}
	(void) pushJsonbValue(&bs->data, node->kind == YN_MAPPING ?
						  WJB_BEGIN_OBJECT : WJB_BEGIN_ARRAY, NULL);
	for (i = 0; i < node->nitems; i++)
	{
		if (node->kind == YN_MAPPING)
		{
			YPair	   *pair = &node->pairs[i];
			JsonbValue	key;

			key.type = jbvString;
			key.val.string.val = pair->key;
			key.val.string.len = pair->keylen;
			(void) pushJsonbValue(&bs->data, WJB_KEY, &key);
			if (save > 0)
				appendStringInfoChar(&bs->path, '.');
			appendBinaryStringInfo(&bs->path, pair->key, pair->keylen);
			build_node(bs, pair->value, WJB_VALUE);
		}
		else
		{
			appendStringInfo(&bs->path, "[%d]", i);
			build_node(bs, node->items[i], WJB_ELEM);
		}
		bs->path.len = save;
		bs->path.data[save] = '\0';
	}
	bs->result = pushJsonbValue(&bs->data, node->kind == YN_MAPPING ?
								WJB_END_OBJECT : WJB_END_ARRAY, NULL);
}

/*
 * Body of YamlToJsonb: parse and build with scratch memory in workcxt, which
 * must be a fresh child of the current context.  The results are palloc'd in
 * the current context, which is current again on return.
 */
static Jsonb *
yaml_to_jsonb(const char *source, const char *what, Jsonb **positions,
			  MemoryContext workcxt)
{
	MemoryContext callercxt = MemoryContextSwitchTo(workcxt);
	YamlParse  *yp;
	ErrorContextCallback errcb;
	BuildState	bs;
	JsonbValue *posval = NULL;
	Jsonb	   *result;
	int			encoding = GetDatabaseEncoding();

	yp = palloc0(sizeof(YamlParse));
	yp->what = what;
	yp->cleanup.func = free_libyaml;
	yp->cleanup.arg = yp;
	MemoryContextRegisterResetCallback(workcxt, &yp->cleanup);

	yp->convert = (encoding != PG_UTF8 && encoding != PG_SQL_ASCII);
	yp->source = yp->convert ?
		pg_server_to_any(source, strlen(source), PG_UTF8) : source;
	if (!yaml_parser_initialize(&yp->parser))
		ereport(ERROR,
				(errcode(ERRCODE_OUT_OF_MEMORY),
				 errmsg("out of memory"),
				 errdetail("Could not create a YAML parser.")));
	yp->have_parser = true;
	yaml_parser_set_encoding(&yp->parser, YAML_UTF8_ENCODING);
	yaml_parser_set_input_string(&yp->parser, (const unsigned char *) yp->source,
								 strlen(yp->source));

	errcb.callback = value_errcontext;
	errcb.arg = yp;
	errcb.previous = error_context_stack;
	error_context_stack = &errcb;
	memset(&bs, 0, sizeof(bs));
	bs.root = parse_stream(yp);
	error_context_stack = errcb.previous;
	free_libyaml(yp);

	bs.want_positions = (positions != NULL);
	initStringInfo(&bs.path);
	if (bs.want_positions)
		(void) pushJsonbValue(&bs.pos, WJB_BEGIN_OBJECT, NULL);
	if (bs.root->kind != YN_SCALAR)
		build_node(&bs, bs.root, WJB_VALUE);
	if (bs.want_positions)
		posval = pushJsonbValue(&bs.pos, WJB_END_OBJECT, NULL);

	MemoryContextSwitchTo(callercxt);
	result = JsonbValueToJsonb(bs.root->kind == YN_SCALAR ? &bs.root->value : bs.result);
	if (positions)
		*positions = JsonbValueToJsonb(posval);
	return result;
}

/*
 * Parse YAML source into jsonb; see yamlparse.h.  The result (and
 * *positions) are palloc'd in the caller's memory context.  Errors: syntax
 * errors, empty or multi-document input, duplicate or non-scalar keys,
 * unsupported tags, values not fitting their tag, infinities and NaNs,
 * unknown aliases, bad strings, sources over tuvl.max_source_size, and
 * the node, size and depth limits.  The
 * scratch context, and with it libyaml's memory, is deleted on error too,
 * so callers that catch errors in a long-lived context leak nothing.
 */
Jsonb *
YamlToJsonb(const char *source, const char *what, Jsonb **positions)
{
	MemoryContext callercxt = CurrentMemoryContext;
	MemoryContext workcxt = AllocSetContextCreate(callercxt, "YAML parser",
												  ALLOCSET_DEFAULT_SIZES);
	Jsonb	   *volatile result = NULL;

	/* a document is small: a huge one would take the backend's memory */
	GucsCheckSize(psprintf("the %s source", what), strlen(source), tuvl_max_source_size,
				  "tuvl.max_source_size");
	PG_TRY();
	{
		result = yaml_to_jsonb(source, what, positions, workcxt);
	}
	PG_CATCH();
	{
		MemoryContextSwitchTo(callercxt);
		MemoryContextDelete(workcxt);
		PG_RE_THROW();
	}
	PG_END_TRY();
	MemoryContextDelete(workcxt);
	return result;
}

/*
 * Look up "line L, column C" for a path in a positions object made by
 * YamlToJsonb; returns NULL if unknown.  The result is palloc'd.
 */
char *
YamlPositionText(Jsonb *positions, const char *path)
{
	JsonbValue	vbuf;
	JsonbValue *pos;
	JsonbValue *line;
	JsonbValue *column;

	if (positions == NULL || path == NULL || !JB_ROOT_IS_OBJECT(positions))
		return NULL;
	pos = getKeyJsonValueFromContainer(&positions->root, path, strlen(path), &vbuf);
	if (pos == NULL || pos->type != jbvBinary || !JsonContainerIsArray(pos->val.binary.data))
		return NULL;
	line = getIthJsonbValueFromContainer(pos->val.binary.data, 0);
	column = getIthJsonbValueFromContainer(pos->val.binary.data, 1);
	if (line == NULL || column == NULL ||
		line->type != jbvNumeric || column->type != jbvNumeric)
		return NULL;
	return psprintf("line %d, column %d",
					DatumGetInt32(DirectFunctionCall1(numeric_int4,
													  NumericGetDatum(line->val.numeric))),
					DatumGetInt32(DirectFunctionCall1(numeric_int4,
													  NumericGetDatum(column->val.numeric))));
}
