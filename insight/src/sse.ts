/*
 * sse.ts: GET /api/runs/{id}/events, a run's journal as Server-Sent Events.
 *
 * A stream sends the journal's events after a seq (Last-Event-ID, or
 * ?after=), then follows the run live until its final event, and ends.
 * Each event is one message: "id:" its seq, "event:" its type, "data:"
 * the event as JSON (with a one-line "summary", as tuvl.timeline() gives).
 *
 * No gap, no duplicate: the stream subscribes to the hub before it reads
 * anything, and reads tuvl.events by seq, after the last seq it sent,
 * whenever the hub says the run has something newer.  Every read is its
 * own transaction authenticated with the client's token, so row security
 * and the token's scopes decide, at every read, what the client gets: a
 * revoked or expired token ends the stream at its next read (the next
 * event, or the keepalive every 15 s).  The run is final when its status
 * is; its row and its events are read by one statement, so a final status
 * means every event is in hand.
 *
 * Reads are paced by the client: while the socket's buffer is full the
 * stream waits for it to drain, so a slow client costs memory for one page
 * (500 events) at most.
 */
import type { ServerResponse } from "node:http";

import type { Credentials, Database } from "./db.js";
import { toApiError } from "./errors.js";
import type { Follower, Hub } from "./hub.js";
import { eventsSql, FINAL } from "./ops.js";

const PAGE = 500;
const KEEPALIVE_MS = 15_000;
export const RETRY_MS = 2000;

const EVENTS_SQL = eventsSql(true);

interface EventRow {
    status: string;
    seq: number | null;
    type: string | null;
    data: string | null;
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
        private readonly db: Database,
        private readonly hub: Hub,
        private readonly cred: Credentials,
        private readonly runId: number,
        private readonly channel: string,
        after: number,
        private readonly res: ServerResponse,
        private readonly log: (msg: string) => void,
    ) {
        this.lastSent = after;
        this.onClose = () => this.close();
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
        void this.pump();
    }

    private keepalive(): void {
        if (this.closed) return;
        this.res.write(": keepalive\n\n");
        this.poke(0);
    }

    private async pump(): Promise<void> {
        this.busy = true;
        try {
            do {
                this.again = false;
                const rows = await this.db.asCaller(this.cred, (tx) =>
                    tx.query<EventRow>(EVENTS_SQL, [this.runId, this.lastSent, PAGE]));
                if (this.closed) return;
                if (rows.length === 0) {
                    this.fail(404, "42704", `run ${this.runId} does not exist`);
                    return;
                }
                let chunk = "";
                let n = 0;
                for (const r of rows) {
                    if (r.seq === null) continue;
                    chunk += `id: ${r.seq}\nevent: ${r.type}\ndata: ${r.data}\n\n`;
                    this.lastSent = r.seq;
                    n++;
                }
                const drained = chunk === "" || this.res.write(chunk);
                if (n === PAGE) this.again = true;
                else if (FINAL.has(rows[0].status)) {
                    this.close();
                    return;
                }
                if (!drained) await new Promise<void>((resolve) => {
                    this.res.once("drain", resolve);
                    this.res.once("close", resolve);
                });
                if (this.notified > this.lastSent) this.again = true;
            } while (this.again && !this.closed);
        } catch (e) {
            const err = toApiError(e);
            if (err.status >= 500) this.log(`event stream of run ${this.runId}: ${(e as Error).message}`);
            this.fail(err.status, err.sqlstate, err.message);
        } finally {
            this.busy = false;
        }
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
    }
}
