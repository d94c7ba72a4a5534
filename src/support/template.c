/*-------------------------------------------------------------------------
 *
 * template.c
 *	  Rendering of "{{ path }}" placeholders in workflow step fields.
 *
 * A placeholder is "{{", optional whitespace, a dot-separated path, optional
 * whitespace and "}}".  Path segments consist of ASCII letters, digits, "_"
 * and "-"; each segment selects an object key, or an array element when the
 * current value is an array and the segment is all digits.  A path whose
 * first segment is "secrets" is resolved through the caller's secret hook
 * instead of the context.  A string that is a sole placeholder evaluates to
 * the referenced value with its JSON type; otherwise every placeholder is
 * replaced by the value's text.  Substituted values are never re-scanned.
 *
 * Everything here is pure computation on in-memory values: no SPI, no
 * catalog access and no transaction requirements beyond being able to
 * palloc and ereport (the caller's secret hook may do more).  All results are allocated in CurrentMemoryContext
 * and never point into the template or the context.  Secret values are
 * never included in error messages.
 *
 * src/template.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <string.h>

#include "lib/stringinfo.h"
#include "mb/pg_wchar.h"
#include "utils/datum.h"
#include "utils/fmgrprotos.h"
#include "utils/jsonb.h"

#include "template.h"

#define SECRETS_ROOT "secrets"
#define SECRETS_ROOT_LEN (sizeof(SECRETS_ROOT) - 1)

/* What is wrong with a template or a path */
typedef enum TemplateProblem
{
	TPL_OK,
	TPL_UNTERMINATED,
	TPL_EMPTY_PATH,
	TPL_EMPTY_SEGMENT,
	TPL_BAD_CHAR,
	TPL_NO_SECRET_NAME
} TemplateProblem;

/* One placeholder found in a string */
typedef struct Placeholder
{
	int			start;			/* byte offset of "{{" */
	int			end;			/* byte offset just past "}}" */
	char	   *path;			/* palloc'd path, whitespace trimmed */
} Placeholder;

static inline bool
is_blank_char(char c)
{
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' ||
		c == '\f' || c == '\v';
}

static inline bool
is_path_char(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
		(c >= '0' && c <= '9') || c == '_' || c == '-';
}

static bool
is_blank(const char *s, int from, int to)
{
	for (; from < to; from++)
		if (!is_blank_char(s[from]))
			return false;
	return true;
}

/*
 * Raise a syntax error about "text" (a template, or a bare path when
 * is_template is false).  "pos" is the byte offset of the problem in text;
 * "bad" points at the offending character for TPL_BAD_CHAR.  The detail
 * reports a 1-based character position.
 */
pg_attribute_noreturn()
static void
report_syntax_error(const char *text, int len, bool is_template,
					TemplateProblem problem, int pos, const char *bad)
{
	char	   *str = pnstrdup(text, len);
	int			charpos = pg_mbstrlen_with_len(str, pos) + 1;

	ereport(ERROR,
			(errcode(ERRCODE_SYNTAX_ERROR),
			 is_template ?
			 errmsg("invalid template \"%s\"", str) :
			 errmsg("invalid template path \"%s\"", str),
			 problem == TPL_UNTERMINATED ?
			 errdetail("Placeholder opened at character %d is not closed with \"}}\".", charpos) :
			 problem == TPL_EMPTY_PATH ?
			 errdetail("Placeholder at character %d has an empty path.", charpos) :
			 problem == TPL_EMPTY_SEGMENT ?
			 errdetail("Path at character %d has an empty segment.", charpos) :
			 problem == TPL_NO_SECRET_NAME ?
			 errdetail("Placeholder at character %d must name a secret, as in \"secrets.name\".", charpos) :
			 errdetail("Invalid character \"%.*s\" in path at character %d; a path consists of letters, digits, \"_\" and \"-\" separated by dots.",
					   pg_mbcharcliplen(bad, strlen(bad), 1), bad, charpos)));
	pg_unreachable();
}

/*
 * Check the syntax of a nul-terminated path of "len" bytes.  On failure,
 * returns the problem and sets *badpos to the byte offset where it is.
 */
static TemplateProblem
check_path(const char *path, int len, int *badpos)
{
	int			i;

	if (len == 0)
	{
		*badpos = 0;
		return TPL_EMPTY_PATH;
	}
	for (i = 0; i < len; i++)
	{
		if (path[i] == '.')
		{
			if (i == 0 || i == len - 1 || path[i + 1] == '.')
			{
				*badpos = i;
				return TPL_EMPTY_SEGMENT;
			}
		}
		else if (!is_path_char(path[i]))
		{
			*badpos = i;
			return TPL_BAD_CHAR;
		}
	}
	return TPL_OK;
}

/*
 * Find the first placeholder in s[from .. len).  Returns false if there is
 * none; raises a syntax error for an unterminated or malformed placeholder.
 * ph->path is palloc'd in CurrentMemoryContext.
 */
static bool
next_placeholder(const char *s, int len, int from, Placeholder *ph)
{
	int			open = -1;
	int			close = -1;
	int			pstart;
	int			pend;
	int			badpos;
	TemplateProblem problem;
	int			i;

	for (i = from; i + 1 < len; i++)
		if (s[i] == '{' && s[i + 1] == '{')
		{
			open = i;
			break;
		}
	if (open < 0)
		return false;
	for (i = open + 2; i + 1 < len; i++)
		if (s[i] == '}' && s[i + 1] == '}')
		{
			close = i;
			break;
		}
	if (close < 0)
		report_syntax_error(s, len, true, TPL_UNTERMINATED, open, NULL);

	pstart = open + 2;
	pend = close;
	while (pstart < pend && is_blank_char(s[pstart]))
		pstart++;
	while (pend > pstart && is_blank_char(s[pend - 1]))
		pend--;

	ph->start = open;
	ph->end = close + 2;
	ph->path = pnstrdup(s + pstart, pend - pstart);

	problem = check_path(ph->path, pend - pstart, &badpos);
	if (problem == TPL_EMPTY_PATH)
		report_syntax_error(s, len, true, problem, open, NULL);
	if (problem != TPL_OK)
		report_syntax_error(s, len, true, problem, pstart + badpos,
							ph->path + badpos);
	if (strcmp(ph->path, SECRETS_ROOT) == 0)
		report_syntax_error(s, len, true, TPL_NO_SECRET_NAME, open, NULL);
	return true;
}

/*
 * Walk a syntactically valid path through the context.  Returns NULL if
 * any step is missing.  The result may point into the context's storage.
 */
static JsonbValue *
lookup_path(Jsonb *context, const char *path, int len)
{
	JsonbContainer *cur;
	JsonbValue *v = NULL;
	int			pos = 0;

	if (context == NULL || JB_ROOT_IS_SCALAR(context))
		return NULL;
	cur = &context->root;

	for (;;)
	{
		const char *seg = path + pos;
		int			seglen = 0;

		while (pos + seglen < len && seg[seglen] != '.')
			seglen++;

		if (cur == NULL)
			return NULL;		/* tried to descend into a scalar */
		else if (JsonContainerIsObject(cur))
			v = getKeyJsonValueFromContainer(cur, seg, seglen, NULL);
		else
		{
			uint32		idx = 0;
			int			i;

			for (i = 0; i < seglen; i++)
			{
				if (seg[i] < '0' || seg[i] > '9' ||
					idx > (PG_UINT32_MAX - (seg[i] - '0')) / 10)
					return NULL;
				idx = idx * 10 + (seg[i] - '0');
			}
			v = getIthJsonbValueFromContainer(cur, idx);
		}
		if (v == NULL)
			return NULL;

		pos += seglen + 1;
		if (pos >= len)
			return v;
		cur = (v->type == jbvBinary) ? v->val.binary.data : NULL;
	}
}

/* Wrap a Jsonb container as a jbvBinary value. */
static JsonbValue *
binary_value(Jsonb *jb)
{
	JsonbValue *v = palloc(sizeof(JsonbValue));

	v->type = jbvBinary;
	v->val.binary.data = &jb->root;
	v->val.binary.len = VARSIZE(jb) - VARHDRSZ;
	return v;
}

/*
 * Deep-copy a scalar or jbvBinary value into CurrentMemoryContext.  Copied
 * strings are always nul-terminated.
 */
static JsonbValue *
copy_value(JsonbValue *src)
{
	JsonbValue *v;

	if (src->type == jbvBinary)
		return binary_value(JsonbValueToJsonb(src));

	v = palloc(sizeof(JsonbValue));
	*v = *src;
	if (src->type == jbvString)
		v->val.string.val = pnstrdup(src->val.string.val, src->val.string.len);
	else if (src->type == jbvNumeric)
		v->val.numeric = DatumGetNumeric(datumCopy(NumericGetDatum(src->val.numeric),
												   false, -1));
	return v;
}

/* Append the text form of a scalar or jbvBinary value to buf. */
static void
append_value_text(StringInfo buf, JsonbValue *v)
{
	switch (v->type)
	{
		case jbvString:
			appendBinaryStringInfo(buf, v->val.string.val, v->val.string.len);
			break;
		case jbvNumeric:
			appendStringInfoString(buf,
								   DatumGetCString(DirectFunctionCall1(numeric_out,
																	   NumericGetDatum(v->val.numeric))));
			break;
		case jbvBool:
			appendStringInfoString(buf, v->val.boolean ? "true" : "false");
			break;
		case jbvNull:
			appendStringInfoString(buf, "null");
			break;
		case jbvBinary:
			JsonbToCString(buf, v->val.binary.data, v->val.binary.len);
			break;
		default:
			elog(ERROR, "unexpected jsonb value type %d in template", (int) v->type);
	}
}

/*
 * Resolve one placeholder path to a value: a secret (as a string) or a
 * context value, which may point into the context's storage.
 *
 * Errors: ERRCODE_FEATURE_NOT_SUPPORTED if a secret is referenced without a
 * hook, ERRCODE_UNDEFINED_OBJECT for unknown secrets and missing keys.
 */
static JsonbValue *
resolve_placeholder(const char *path, Jsonb *context, TemplateOptions *opts)
{
	JsonbValue *v;

	if (strncmp(path, SECRETS_ROOT ".", SECRETS_ROOT_LEN + 1) == 0)
	{
		const char *name = path + SECRETS_ROOT_LEN + 1;
		const char *secret;

		if (opts == NULL || opts->secret_hook == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("secrets are not available in this template"),
					 errhint("Reference secrets only in fields that are rendered with access to the secret store.")));
		secret = opts->secret_hook(name, opts->secret_arg);
		if (secret == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_UNDEFINED_OBJECT),
					 errmsg("secret \"%s\" does not exist", name),
					 errhint("Create the secret or correct its name in the template.")));
		opts->used_secret = true;

		v = palloc(sizeof(JsonbValue));
		v->type = jbvString;
		v->val.string.val = (char *) secret;
		v->val.string.len = strlen(secret);
		return v;
	}

	v = lookup_path(context, path, strlen(path));
	if (v == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("template refers to missing context key \"%s\"", path),
				 errhint("Make sure the run input or an earlier step provides this key, or correct the path in the template.")));
	return v;
}

/*
 * Render one string.  A sole placeholder (ignoring surrounding whitespace)
 * yields a copy of the referenced value; anything else yields a jbvString
 * with every placeholder interpolated as text.  Result strings are always
 * freshly palloc'd and nul-terminated.
 */
static JsonbValue *
render_string(const char *s, int len, Jsonb *context, TemplateOptions *opts)
{
	Placeholder ph;
	StringInfoData buf;
	JsonbValue *v;
	int			pos = 0;

	if (!next_placeholder(s, len, 0, &ph))
	{
		v = palloc(sizeof(JsonbValue));
		v->type = jbvString;
		v->val.string.val = pnstrdup(s, len);
		v->val.string.len = len;
		return v;
	}

	if (is_blank(s, 0, ph.start) && is_blank(s, ph.end, len))
		return copy_value(resolve_placeholder(ph.path, context, opts));

	initStringInfo(&buf);
	do
	{
		appendBinaryStringInfo(&buf, s + pos, ph.start - pos);
		append_value_text(&buf, resolve_placeholder(ph.path, context, opts));
		pos = ph.end;
	} while (next_placeholder(s, len, pos, &ph));
	appendBinaryStringInfo(&buf, s + pos, len - pos);

	v = palloc(sizeof(JsonbValue));
	v->type = jbvString;
	v->val.string.val = buf.data;
	v->val.string.len = buf.len;
	return v;
}

/*
 * Render every string value (not key) inside a container, returning the
 * rebuilt container in expanded form.  Allocated in CurrentMemoryContext.
 */
static JsonbValue *
render_container(JsonbContainer *c, Jsonb *context, TemplateOptions *opts)
{
	JsonbParseState *state = NULL;
	JsonbIterator *it = JsonbIteratorInit(c);
	JsonbIteratorToken tok;
	JsonbValue	v;
	JsonbValue *res = NULL;

	while ((tok = JsonbIteratorNext(&it, &v, false)) != WJB_DONE)
	{
		if ((tok == WJB_VALUE || tok == WJB_ELEM) && v.type == jbvString)
			res = pushJsonbValue(&state, tok,
								 render_string(v.val.string.val,
											   v.val.string.len,
											   context, opts));
		else
			res = pushJsonbValue(&state, tok, tok < WJB_BEGIN_ARRAY ? &v : NULL);
	}
	return res;
}

/*
 * Render a JSON value.  tmpl may be a scalar, a jbvBinary value or an
 * expanded array/object.  The result is a scalar or a jbvBinary value
 * (never an expanded container), so it can be passed to pushJsonbValue as
 * an element or object value.  Allocated in CurrentMemoryContext.
 *
 * Errors: see resolve_placeholder and next_placeholder.
 */
JsonbValue *
TemplateRenderValue(JsonbValue *tmpl, Jsonb *context, TemplateOptions *opts)
{
	JsonbValue	scalar;

	if (tmpl->type == jbvArray || tmpl->type == jbvObject)
		tmpl = binary_value(JsonbValueToJsonb(tmpl));
	if (tmpl->type == jbvBinary &&
		JsonContainerIsScalar(tmpl->val.binary.data) &&
		JsonbExtractScalar(tmpl->val.binary.data, &scalar))
		tmpl = &scalar;

	if (tmpl->type == jbvString)
		return render_string(tmpl->val.string.val, tmpl->val.string.len,
							 context, opts);
	if (tmpl->type != jbvBinary)
		return copy_value(tmpl);
	return binary_value(JsonbValueToJsonb(render_container(tmpl->val.binary.data,
														   context, opts)));
}

/*
 * Render a whole Jsonb document (see TemplateRenderValue).  Returns a new
 * Jsonb in CurrentMemoryContext, or NULL if tmpl is NULL.
 */
Jsonb *
TemplateRenderJsonb(Jsonb *tmpl, Jsonb *context, TemplateOptions *opts)
{
	JsonbValue	v;

	if (tmpl == NULL)
		return NULL;
	v.type = jbvBinary;
	v.val.binary.data = &tmpl->root;
	v.val.binary.len = VARSIZE(tmpl) - VARHDRSZ;
	return JsonbValueToJsonb(TemplateRenderValue(&v, context, opts));
}

/*
 * Render a C string to text.  Equivalent to rendering it as a JSON string
 * and taking the result's text: a sole placeholder referring to a string
 * gives the raw string (surrounding whitespace dropped), any other value
 * its JSON text.  Returns a palloc'd string in CurrentMemoryContext.
 */
char *
TemplateRenderText(const char *tmpl, Jsonb *context, TemplateOptions *opts)
{
	JsonbValue *v = render_string(tmpl, strlen(tmpl), context, opts);
	StringInfoData buf;

	if (v->type == jbvString)
		return v->val.string.val;	/* always a fresh nul-terminated copy */
	initStringInfo(&buf);
	append_value_text(&buf, v);
	return buf.data;
}

/*
 * Look up a dot-separated path in context without any template semantics
 * ("secrets" is an ordinary key here).  Returns a copy of the value (scalar
 * or jbvBinary) in CurrentMemoryContext, or NULL if it is missing.
 *
 * Errors: ERRCODE_SYNTAX_ERROR if the path itself is malformed.
 */
JsonbValue *
TemplateLookupPath(Jsonb *context, const char *path)
{
	int			len = strlen(path);
	int			badpos;
	TemplateProblem problem = check_path(path, len, &badpos);
	JsonbValue *v;

	if (problem != TPL_OK)
		report_syntax_error(path, len, false, problem, badpos, path + badpos);
	v = lookup_path(context, path, len);
	return v ? copy_value(v) : NULL;
}

/*
 * List the distinct placeholder paths used in string values (not keys) of
 * a Jsonb template, in order of first appearance, as palloc'd C strings.
 * "secrets.*" paths are included.  Raises syntax errors like rendering.
 */
List *
TemplatePlaceholders(Jsonb *tmpl)
{
	List	   *result = NIL;
	JsonbIterator *it;
	JsonbIteratorToken tok;
	JsonbValue	v;

	if (tmpl == NULL)
		return NIL;
	it = JsonbIteratorInit(&tmpl->root);
	while ((tok = JsonbIteratorNext(&it, &v, false)) != WJB_DONE)
	{
		Placeholder ph;
		int			pos = 0;

		if ((tok != WJB_VALUE && tok != WJB_ELEM) || v.type != jbvString)
			continue;
		while (next_placeholder(v.val.string.val, v.val.string.len, pos, &ph))
		{
			ListCell   *lc;
			bool		seen = false;

			foreach(lc, result)
			{
				if (strcmp((char *) lfirst(lc), ph.path) == 0)
				{
					seen = true;
					break;
				}
			}
			if (!seen)
				result = lappend(result, ph.path);
			pos = ph.end;
		}
	}
	return result;
}

/*
 * Cheap test whether s may contain placeholders, i.e. whether it contains
 * "{{".  Does not validate syntax and never raises an error.
 */
bool
TemplateHasPlaceholders(const char *s)
{
	return s != NULL && strstr(s, "{{") != NULL;
}
