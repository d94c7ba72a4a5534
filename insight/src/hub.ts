/*
 * hub.ts: one connection LISTENs for the whole server and fans the journal's
 * notifications out to the streams that follow a run.
 *
 * tuvl announces every journal event on the channel of the run's principal
 * and on the operators' channel (tuvl.events_channel() tells a role which
 * is its own).  A stream subscribes with its role's channel and its run;
 * the hub LISTENs on a channel while some stream needs it, and UNLISTENs
 * when the last one goes.  A notification is only a hint that run R has
 * events up to seq S: the stream then reads them from tuvl.events with its
 * own token, so row security and the token's scopes decide what it gets,
 * never the hub.
 *
 * When the connection breaks, the hub connects again (after 0.2 s, then
 * up to 2 s apart), LISTENs again on every channel in use and pokes every
 * stream, which reads what it missed: no event is lost, since streams read
 * the journal by seq.  It connects as libpq would, to the first host of a
 * multi-host connection string that fits its target_session_attrs
 * (target.ts), and moves when the server's pool finds that another host
 * fits now (after a failover, the old primary may still answer, read-only,
 * and send no more notifications).
 */
import pg from "pg";
import type { Notification } from "pg";

import type { HostSpec } from "./conninfo.js";
import { connectFirst, hostName, Target } from "./target.js";

export interface Follower {
    /* the run has events up to seq (0: something may have been missed) */
    poke(seq: number): void;
}

export class Hub {
    private readonly target: Target;
    private readonly log: (msg: string) => void;
    private client: pg.Client | null = null;
    private host: HostSpec | null = null;
    private connecting: Promise<pg.Client> | null = null;
    private readonly channels = new Map<string, Map<number, Set<Follower>>>();
    private readonly listening = new Map<string, Promise<void>>();
    private closed = false;
    private retryMs = 200;
    connected = false;

    constructor(target: Target, log: (msg: string) => void) {
        this.target = target;
        this.log = log;
        /* the pool chose another host: follow it */
        target.on("resolved", (h: HostSpec) => {
            const c = this.client;
            if (c && this.host && (this.host.host !== h.host || this.host.port !== h.port))
                this.lost(c, new Error(`the database moved to ${hostName(h)}`));
        });
    }

    private onNotification(n: Notification): void {
        const runs = this.channels.get(n.channel);
        if (!runs || !n.payload) return;
        let runId: number;
        let seq: number;
        try {
            const p = JSON.parse(n.payload) as { run_id?: unknown; seq?: unknown };
            runId = Number(p.run_id);
            seq = Number(p.seq ?? 0);
        } catch {
            return;
        }
        const followers = runs.get(runId);
        if (followers) for (const f of followers) f.poke(seq);
    }

    private async connection(): Promise<pg.Client> {
        if (this.client) return this.client;
        if (!this.connecting) this.connecting = this.open().finally(() => { this.connecting = null; });
        return this.connecting;
    }

    private async open(): Promise<pg.Client> {
        for (;;) {
            if (this.closed) throw new Error("the server is shutting down");
            let client: pg.Client;
            let host: HostSpec;
            try {
                ({ client, host } = await connectFirst(this.target.settings, {
                    application_name: `${this.target.settings.base.application_name ?? "tuvl insight"} listener`,
                    keepAlive: true, keepAliveInitialDelayMillis: 10_000,
                }));
            } catch (e) {
                this.log(`listener: could not connect (${(e as Error).message}); trying again in ${this.retryMs} ms`);
                await new Promise((r) => setTimeout(r, this.retryMs));
                this.retryMs = Math.min(this.retryMs * 2, 2000);
                continue;
            }
            if (this.closed) {
                await client.end().catch(() => undefined);
                throw new Error("the server is shutting down");
            }
            client.on("notification", (n) => this.onNotification(n));
            client.on("error", (e) => this.lost(client, e));
            client.on("end", () => this.lost(client, new Error("connection ended")));
            this.retryMs = 200;
            this.host = host;
            this.client = client;
            this.connected = true;
            return client;
        }
    }

    private lost(client: pg.Client, e: Error): void {
        if (this.client !== client) return;
        this.client = null;
        this.connected = false;
        this.listening.clear();
        if (this.closed) return;
        this.log(`listener: connection lost (${e.message}); connecting again`);
        client.end().catch(() => undefined);
        void this.reattach();
    }

    /* After a reconnection: LISTEN again on every channel in use, poke everyone. */
    private async reattach(): Promise<void> {
        try {
            for (const ch of this.channels.keys()) await this.listen(ch);
        } catch {
            return;          /* lost again: the next reattach does it */
        }
        for (const runs of this.channels.values())
            for (const followers of runs.values())
                for (const f of followers) f.poke(0);
    }

    private listen(channel: string): Promise<void> {
        let p = this.listening.get(channel);
        if (!p) {
            p = this.connection().then((c) => c.query(`LISTEN ${pg.escapeIdentifier(channel)}`)).then(() => undefined);
            this.listening.set(channel, p);
            p.catch(() => this.listening.delete(channel));
        }
        return p;
    }

    /* Follow run on channel; resolves once the hub listens there. */
    async follow(channel: string, runId: number, f: Follower): Promise<void> {
        let runs = this.channels.get(channel);
        if (!runs) this.channels.set(channel, (runs = new Map()));
        let followers = runs.get(runId);
        if (!followers) runs.set(runId, (followers = new Set()));
        followers.add(f);
        await this.listen(channel);
    }

    unfollow(channel: string, runId: number, f: Follower): void {
        const runs = this.channels.get(channel);
        const followers = runs?.get(runId);
        if (!runs || !followers) return;
        followers.delete(f);
        if (followers.size === 0) runs.delete(runId);
        if (runs.size === 0) {
            this.channels.delete(channel);
            const wasListening = this.listening.delete(channel);
            const c = this.client;
            if (wasListening && c) c.query(`UNLISTEN ${pg.escapeIdentifier(channel)}`).catch(() => undefined);
        }
    }

    /* How many streams follow runs, on how many channels (for /health). */
    stats(): { channels: number; followers: number } {
        let followers = 0;
        for (const runs of this.channels.values()) for (const s of runs.values()) followers += s.size;
        return { channels: this.channels.size, followers };
    }

    async start(): Promise<void> {
        await this.connection();
    }

    async close(): Promise<void> {
        this.closed = true;
        const c = this.client;
        this.client = null;
        if (c) await c.end().catch(() => undefined);
    }
}
