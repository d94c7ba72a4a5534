/*-------------------------------------------------------------------------
 *
 * journal_block.c
 *	  The packed form of a block of journal events.
 *
 * A transition's events are stored as one row of tuvl.journal, whose
 * column events holds them packed by JournalBlockPack; the view
 * tuvl.events unpacks them (tuvl._journal_events) into one row per
 * event.  One row and one index entry per transition instead of one per
 * event is most of what keeps a step's WAL small.
 *
 * The format (version 1), all integers little-endian or varints:
 *
 *	 byte		1 (the format version)
 *	 varint		number of events
 *	 per event:
 *	   byte		type: its code in event_types[], or 0 and then the name
 *				as a string (varint length, bytes)
 *	   varint	its time in microseconds since 2000 (the first event), or
 *				the difference to the event before, zigzag encoded
 *	   byte		flags: AGENT, ENGINE, TOKENS, LATENCY, PAYLOAD
 *	   AGENT:	string
 *	   ENGINE:	byte: its code in engines[], or 0 and then a string
 *	   TOKENS:	zigzag varint
 *	   LATENCY:	8 bytes, a float8
 *	   PAYLOAD:	string, the payload as JSON text (no PAYLOAD: {})
 *
 * Payloads are JSON text rather than jsonb's binary form: small objects
 * are shorter so, and unpacking parses them, so that tuvl._journal_events
 * (which any role may call) cannot be led astray by a crafted bytea.
 * Every length is checked against the end of the block, and every
 * string's encoding is verified.
 *
 * Type and engine codes never change their meaning: new names get new
 * codes, and names without a code are stored as strings.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"

#include "journal_block.h"
#include "jsonutil.h"

#define BLOCK_FORMAT 1

#define EV_AGENT	0x01
#define EV_ENGINE	0x02
#define EV_TOKENS	0x04
#define EV_LATENCY	0x08
#define EV_PAYLOAD	0x10

/* Codes 1..n: index + 1.  Append only. */
static const char *const event_types[] = {
	"run_queued", "run_started", "agent_started", "agent_completed", "signal",
	"llm_turn", "tool_call", "tool_result", "decision", "judge_verdict",
	"approval_requested", "approval_decided", "paused", "resumed", "checkpoint",
	"compensation_started", "compensation_completed", "run_completed",
	"run_failed", "run_aborted", "children_started", "children_ended",
	"agent_progress",
};

static const char *const engines[] = {
	"Functional", "ModelOp", "Router", "APICall", "MCP", "Agent", "Human",
	"Sleep", "Workflow",
};

/* ---------------------------------------------------------------- packing */

static void
put_varint(StringInfo buf, uint64 v)
{
	while (v >= 0x80)
	{
		appendStringInfoChar(buf, (char) ((v & 0x7F) | 0x80));
		v >>= 7;
	}
	appendStringInfoChar(buf, (char) v);
}

static void
put_signed(StringInfo buf, int64 v)
{
	put_varint(buf, ((uint64) v << 1) ^ (uint64) (v >> 63));
}

static void
put_string(StringInfo buf, const char *s)
{
	size_t		len = strlen(s);

	put_varint(buf, len);
	appendBinaryStringInfo(buf, s, len);
}

/* A name's code in table (1-based), or 0 followed by the name itself. */
static void
put_coded(StringInfo buf, const char *name, const char *const *table, int n)
{
	for (int i = 0; i < n; i++)
		if (strcmp(name, table[i]) == 0)
		{
			appendStringInfoChar(buf, (char) (i + 1));
			return;
		}
	appendStringInfoChar(buf, 0);
	put_string(buf, name);
}

/*
 * A payload as a string of JSON text, without the blanks JsonbToCString
 * puts after every ':' and ',' (blanks inside strings stay).  The text is
 * written straight into the block and its length put before it, so that
 * a large payload is not copied once more.
 */
static void
put_payload(StringInfo buf, Jsonb *payload)
{
	int			start;
	char	   *text;
	char	   *out;
	bool		in_string = false;
	int			len;
	char		prefix[10];
	int			plen = 0;

	appendStringInfoChar(buf, 0);	/* room for a one-byte length */
	start = buf->len;
	(void) JsonbToCString(buf, &payload->root, VARSIZE(payload));
	text = out = buf->data + start;
	for (char *p = text; p < buf->data + buf->len; p++)
	{
		if (in_string)
		{
			if (*p == '\\' && p + 1 < buf->data + buf->len)
				*out++ = *p++;
			else if (*p == '"')
				in_string = false;
		}
		else if (*p == '"')
			in_string = true;
		else if (*p == ' ')
			continue;
		*out++ = *p;
	}
	len = out - text;
	buf->len = start + len;
	for (uint64 v = len; plen == 0 || v > 0; v >>= 7)
		prefix[plen++] = (char) ((v & 0x7F) | (v >= 0x80 ? 0x80 : 0));
	if (plen > 1)
	{
		/* a longer length: move the text up to make room for it */
		enlargeStringInfo(buf, plen - 1);
		memmove(buf->data + start + plen - 1, buf->data + start, len);
		buf->len += plen - 1;
	}
	memcpy(buf->data + start - 1, prefix, plen);
	buf->data[buf->len] = '\0';
}

static bool
payload_is_empty(Jsonb *payload)
{
	return payload == NULL ||
		(JB_ROOT_IS_OBJECT(payload) && JsonContainerSize(&payload->root) == 0);
}

/*
 * Pack the stored events of a list (JournalEvent *, in seq order) into a
 * bytea in the current memory context.
 */
bytea *
JournalBlockPack(List *events)
{
	StringInfoData buf;
	ListCell   *lc;
	TimestampTz prev = 0;
	bool		first = true;
	int			n = 0;
	bytea	   *result;

	initStringInfo(&buf);
	appendStringInfoSpaces(&buf, VARHDRSZ);
	appendStringInfoChar(&buf, BLOCK_FORMAT);
	foreach(lc, events)
		n += ((JournalEvent *) lfirst(lc))->notify_only ? 0 : 1;
	put_varint(&buf, n);
	foreach(lc, events)
	{
		JournalEvent *ev = lfirst(lc);
		uint8		flags = 0;

		if (ev->notify_only)
			continue;
		put_coded(&buf, ev->type, event_types, lengthof(event_types));
		put_signed(&buf, first ? ev->ts : ev->ts - prev);
		prev = ev->ts;
		first = false;
		if (ev->agent_id)
			flags |= EV_AGENT;
		if (ev->engine)
			flags |= EV_ENGINE;
		if (ev->tokens >= 0)
			flags |= EV_TOKENS;
		if (ev->latency_ms >= 0)
			flags |= EV_LATENCY;
		if (!payload_is_empty(ev->payload))
			flags |= EV_PAYLOAD;
		appendStringInfoChar(&buf, (char) flags);
		if (ev->agent_id)
			put_string(&buf, ev->agent_id);
		if (ev->engine)
			put_coded(&buf, ev->engine, engines, lengthof(engines));
		if (ev->tokens >= 0)
			put_signed(&buf, ev->tokens);
		if (ev->latency_ms >= 0)
			appendBinaryStringInfo(&buf, (char *) &ev->latency_ms, sizeof(double));
		if (flags & EV_PAYLOAD)
			put_payload(&buf, ev->payload);
	}
	result = (bytea *) buf.data;
	SET_VARSIZE(result, buf.len);
	return result;
}

/* -------------------------------------------------------------- unpacking */

typedef struct Reader
{
	const uint8 *p;
	const uint8 *end;
} Reader;

static void
corrupted(const char *what)
{
	ereport(ERROR,
			(errcode(ERRCODE_DATA_CORRUPTED),
			 errmsg("journal block is not well formed: %s", what),
			 errhint("A block of tuvl.journal is written only by tuvl; restore the row from a backup.")));
}

static uint8
get_byte(Reader *r)
{
	if (r->p >= r->end)
		corrupted("it ends early");
	return *r->p++;
}

static uint64
get_varint(Reader *r)
{
	uint64		v = 0;

	for (int shift = 0; shift < 64; shift += 7)
	{
		uint8		b = get_byte(r);

		v |= (uint64) (b & 0x7F) << shift;
		if ((b & 0x80) == 0)
			return v;
	}
	corrupted("a number is too long");
	return 0;					/* keep the compiler quiet */
}

static int64
get_signed(Reader *r)
{
	uint64		v = get_varint(r);

	return (int64) (v >> 1) ^ -(int64) (v & 1);
}

/* A string, NUL-terminated, its encoding verified. */
static char *
get_string(Reader *r, int *lenp)
{
	uint64		len = get_varint(r);
	char	   *s;

	if (len > (uint64) (r->end - r->p))
		corrupted("a string runs past its end");
	s = palloc(len + 1);
	memcpy(s, r->p, len);
	s[len] = '\0';
	r->p += len;
	if (strlen(s) != len || !pg_verifymbstr(s, (int) len, true))
		corrupted("a string is not valid text");
	if (lenp)
		*lenp = (int) len;
	return s;
}

static char *
get_coded(Reader *r, const char *const *table, int n)
{
	uint8		code = get_byte(r);

	if (code == 0)
		return get_string(r, NULL);
	if (code > n)
		corrupted("an unknown code");
	return pstrdup(table[code - 1]);
}

/*
 * The events of a block, as JournalEvent (payloads parsed), in the
 * current memory context.
 */
List *
JournalBlockUnpack(bytea *block)
{
	Reader		r;
	List	   *events = NIL;
	uint64		n;
	TimestampTz ts = 0;

	r.p = (const uint8 *) VARDATA_ANY(block);
	r.end = r.p + VARSIZE_ANY_EXHDR(block);
	if (get_byte(&r) != BLOCK_FORMAT)
		corrupted("an unknown format");
	n = get_varint(&r);
	if (n > (uint64) (r.end - r.p))
		corrupted("more events than bytes");
	for (uint64 i = 0; i < n; i++)
	{
		JournalEvent *ev = palloc0(sizeof(JournalEvent));
		uint8		flags;

		ev->type = get_coded(&r, event_types, lengthof(event_types));
		ts = i == 0 ? get_signed(&r) : ts + get_signed(&r);
		ev->ts = ts;
		flags = get_byte(&r);
		ev->agent_id = (flags & EV_AGENT) ? get_string(&r, NULL) : NULL;
		ev->engine = (flags & EV_ENGINE) ? get_coded(&r, engines, lengthof(engines)) : NULL;
		ev->tokens = (flags & EV_TOKENS) ? (int) get_signed(&r) : -1;
		ev->latency_ms = -1;
		if (flags & EV_LATENCY)
		{
			if (r.end - r.p < (ptrdiff_t) sizeof(double))
				corrupted("it ends early");
			memcpy(&ev->latency_ms, r.p, sizeof(double));
			r.p += sizeof(double);
		}
		if (flags & EV_PAYLOAD)
		{
			int			len;
			char	   *text = get_string(&r, &len);

			ev->payload = JsonParseSafe(text, len);
			if (ev->payload == NULL)
				corrupted("a payload is not JSON");
			pfree(text);
		}
		else
			ev->payload = JsonEmptyObject();
		events = lappend(events, ev);
	}
	if (r.p != r.end)
		corrupted("bytes after its last event");
	return events;
}
