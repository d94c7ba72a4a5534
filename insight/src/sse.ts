/*
 * sse.ts: GET /api/runs/{id}/events, a run's journal as Server-Sent Events.
 *
 * A stream sends the journal's events after a seq (Last-Event-ID, or
 * ?after=), then follows the run live until its final event, and ends.
 * Each event is one message: "id:" its seq, "event:" its type, "data:"
 * the event as JSON (with ?summary=true, also a one-line "summary", as
 * tuvl.timeline() gives it).
 *
 * No gap, no duplicate: the stream subscribes to the hub before it reads
 * anything, and reads tuvl.events by seq, after the last seq it sent,
 * whenever the hub says the run has something newer.  Every read is a
 * transaction authenticated with the client's token, so row security and
 * the token's scopes decide, at every read, what the client gets: a
 * revoked or expired token ends the stream at its next read (the next
 * event, or the keepalive every 15 s).  The run is final when its status
 * is; its row and its events are read by one statement, so a final status
 * means every event is in hand.
 *
 * Reads are batched per token (Reader): the streams of one token that
 * have something to read when a read starts are read together, by one
 * statement in one transaction, so a thousand streams of a console's token
 * cost a few transactions per commit of the workers, not a thousand.
 * Streams of different tokens never share a read.  Reads are paced by the
 * client: while a socket's buffer is full its stream asks for nothing, so
 * a slow client costs memory for one page (200 events) at most.
 */
import type { ServerResponse } from "node:http";

import type { Credentials, Database } from "./db.js";
import { toApiError } from "./errors.js";
import type { Follower, Hub } from "./hub.js";
import { FINAL } from "./ops.js";

const PAGE = 200;
const BATCH = 200;
const KEEPALIVE_MS = 15_000;
export const RETRY_MS = 1000;

const EVENT_JSON = (summary: boolean) => `pg_catalog.json_build_object('run_id', e.run_id, 'seq', e.seq, 'ts', e.ts,
    'type', e.type, 'agent_id', e.agent_id, 'engine', e.engine, 'tokens', e.tokens, 'latency_ms', e.latency_ms,
    'payload', e.payload${summary ? ", 'summary', tuvl._event_summary(e.type, e.payload, e.tokens, e.latency_ms)" : ""})`;

/* The events after q.after of each run q.run_id, at most $4 each, with the runs' statuses. */
const BATCH_SQL = `
SELECT q.i, r.status, e.seq, e.type, e.data
FROM ROWS FROM (pg_catalog.unnest($1::bigint[]), pg_catalog.unnest($2::integer[]), pg_catalog.unnest($3::boolean[]))
     WITH ORDINALITY AS q(run_id, after, summary, i)
LEFT JOIN tuvl.runs r ON r.id OPERATOR(pg_catalog.=) q.run_id
LEFT JOIN LATERAL (
    SELECT e.seq, e.type,
           (CASE WHEN q.summary THEN ${EVENT_JSON(true)} ELSE ${EVENT_JSON(false)} END)::text AS data
    FROM tuvl.events e
    WHERE e.run_id OPERATOR(pg_catalog.=) r.id AND e.seq OPERATOR(pg_catalog.>) q.after
    ORDER BY e.seq
    LIMIT $4) e ON true
ORDER BY q.i, e.seq`;

interface BatchRow {
    i: string | number;
    status: string | null;
    seq: number | null;
    type: string | null;
    data: string | null;
}

export interface StreamRead {
    status: string | null;
    rows: BatchRow[];
}

/* The reads of every stream of one token. */
export class Reader {
    private readonly pending = new Set<EventStream>();
    private running = false;
    users = 0;

    constructor(private readonly db: Database, private readonly cred: Credentials) {}

    request(s: EventStream): void {
        this.pending.add(s);
        if (this.running) return;
        this.running = true;
        setImmediate(() => void this.run());
    }

    private async run(): Promise<void> {
        while (this.pending.size > 0) {
            const batch: EventStream[] = [];
            for (const s of this.pending) {
                batch.push(s);
                this.pending.delete(s);
                if (batch.length === BATCH) break;
            }
            let rows: BatchRow[];
            try {
                rows = await this.db.asCaller(this.cred, (tx) => tx.query<BatchRow>(
                    { name: "tuvl_insight_events", text: BATCH_SQL },
                    [batch.map((s) => s.runId), batch.map((s) => s.cursor), batch.map((s) => s.summary), PAGE], { last: true }));
            } catch (e) {
                for (const s of batch) s.failed(e);
                continue;
            }
            const reads: StreamRead[] = batch.map(() => ({ status: null, rows: [] }));
            for (const r of rows) {
                const read = reads[Number(r.i) - 1];
                read.status = r.status;
                if (r.seq !== null) read.rows.push(r);
            }
            batch.forEach((s, k) => s.deliver(reads[k]));
        }
        this.running = false;
    }
}

export class EventStream implements Follower {
    private lastSent: number;
    private notified = 0;
    private busy = false;
    private again = false;
    private closed = false;
    private timer: NodeJS.Timeout | undefined;
    private readonly onClose: () => void;

    constructor(
        private readonly hub: Hub,
        private readonly reader: Reader,
        readonly runId: number,
        private readonly channel: string,
        after: number,
        readonly summary: boolean,
        private readonly res: ServerResponse,
        private readonly log: (msg: string) => void,
        private readonly onEnd: () => void,
    ) {
        this.lastSent = after;
        this.onClose = () => this.close();
    }

    get cursor(): number {
        return this.lastSent;
    }

    /* Subscribe (resolves once the hub listens), then send the headers and what is there. */
    async start(): Promise<void> {
        this.res.on("close", this.onClose);
        await this.hub.follow(this.channel, this.runId, this);
        if (this.closed) return;
        this.res.writeHead(200, {
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache, no-transform",
            Connection: "keep-alive",
            "X-Accel-Buffering": "no",
        });
        this.res.write(`retry: ${RETRY_MS}\n\n`);
        this.timer = setInterval(() => this.keepalive(), KEEPALIVE_MS);
        this.timer.unref();
        this.poke(0);
    }

    poke(seq: number): void {
        if (this.closed) return;
        if (seq > this.notified) this.notified = seq;
        if (seq !== 0 && seq <= this.lastSent) return;
        if (this.busy) {
            this.again = true;
            return;
        }
        this.busy = true;
        this.again = false;
        this.reader.request(this);
    }

    private keepalive(): void {
        if (this.closed) return;
        this.res.write(": keepalive\n\n");
        this.poke(0);
    }

    /* A read's result: send it, then end, wait for the client, or read again. */
    deliver(read: StreamRead): void {
        if (this.closed) return;
        if (read.status === null) {
            this.fail(404, "42704", `run ${this.runId} does not exist`);
            return;
        }
        let chunk = "";
        for (const r of read.rows) {
            chunk += `id: ${r.seq}\nevent: ${r.type}\ndata: ${r.data}\n\n`;
            this.lastSent = r.seq as number;
        }
        const drained = chunk === "" || this.res.write(chunk);
        if (read.rows.length < PAGE && FINAL.has(read.status)) {
            this.close();
            return;
        }
        const next = () => {
            this.busy = false;
            if (read.rows.length === PAGE || this.again || this.notified > this.lastSent) this.poke(0);
        };
        if (drained) next();
        else this.res.once("drain", next);
    }

    failed(e: unknown): void {
        const err = toApiError(e);
        if (err.status >= 500) this.log(`event stream of run ${this.runId}: ${(e as Error).message}`);
        this.fail(err.status, err.sqlstate, err.message);
    }

    /* Tell the client why the stream ends, and end it. */
    private fail(status: number, sqlstate: string | null, message: string): void {
        if (this.closed) return;
        this.res.write(`event: stream_error\ndata: ${JSON.stringify({ status, sqlstate, message })}\n\n`);
        this.close();
    }

    close(): void {
        if (this.closed) return;
        this.closed = true;
        if (this.timer) clearInterval(this.timer);
        this.res.off("close", this.onClose);
        this.hub.unfollow(this.channel, this.runId, this);
        this.res.end();
        this.onEnd();
    }
}
