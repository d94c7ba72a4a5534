/*
 * main.tsx: tuvl Insight, the web console.  Every page reads and acts
 * through insight's API as the signed-in person (the session cookie), so
 * it shows and allows exactly what their role may in SQL.
 */
import "./prefetch";
import { lazy, StrictMode, Suspense, useEffect, useMemo, useRef, useState } from "react";
import type { FormEvent, ReactNode } from "react";
import { createRoot } from "react-dom/client";

import { api, ApiFailure, get, post, qs, setCsrf, take, whenSignedOut } from "./api";
import { Conversation, isAgentEvent } from "./conversation";
import type { Ev } from "./conversation";
import { Graph } from "./graph";

/* the form library, a chunk loaded when a page first shows a form */
const SchemaForm = lazy(() => import("./form"));
import { Badge, ConfirmHost, confirmAction, download, duration, ErrorBox, Json, Link, navigate, time, useLoad } from "./ui";

const STATUSES = ["queued", "sleeping", "running", "waiting_human", "waiting_approval", "waiting_children",
                  "paused", "completed", "failed", "aborted", "compensating", "compensated"];
const FINAL = new Set(["completed", "failed", "aborted", "compensated"]);
/* journal events after which the run's row (status, step, context) has changed */
const MOVES = new Set(["checkpoint", "paused", "resumed", "run_completed", "run_failed", "run_aborted", "approval_requested",
                       "approval_decided", "decision", "compensation_started", "compensation_completed", "children_started", "children_ended"]);

interface Me { role: string; operator: boolean; scopes: string[] | null; csrf: string; signed_in_with: string; }

/* ------------------------------------------------------------ routing */

function usePath(): string {
    const [path, setPath] = useState(location.pathname + location.search);
    useEffect(() => {
        const on = () => setPath(location.pathname + location.search);
        window.addEventListener("popstate", on);
        return () => window.removeEventListener("popstate", on);
    }, []);
    return path;
}

const PAGES: [string, string][] = [["runs", "Runs"], ["people", "People"], ["fixtures", "Fixtures"],
                                   ["workflows", "Workflows"], ["metrics", "Metrics"], ["workers", "Workers"], ["mcp", "MCP"]];

function App() {
    const [me, setMe] = useState<Me | null | undefined>(undefined);
    const path = usePath();
    useEffect(() => {
        whenSignedOut(() => setMe(null));
        get<Me>("/api/console/session").then((m) => { setCsrf(m.csrf); setMe(m); }).catch(() => setMe(null));
    }, []);
    useEffect(() => {
        const page = path.split("?")[0].split("/")[2] || "runs";
        document.title = `${PAGES.find((p) => p[0] === page)?.[1] ?? "Run"} · tuvl Insight`;
    }, [path]);
    if (me === undefined) return <p className="loading">Loading…</p>;
    if (me === null) return <SignIn onIn={(m) => { setCsrf(m.csrf); setMe(m); }} />;
    const parts = path.split("?")[0].replace(/^\/console\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
    const search = new URLSearchParams(path.split("?")[1] ?? "");
    const page = parts[0] ?? "runs";
    let body: ReactNode;
    if (page === "runs" && parts[1]) body = <RunPage id={Number(parts[1])} key={parts[1]} />;
    else if (page === "runs") body = <RunsPage search={search} />;
    else if (page === "people") body = <PeoplePage />;
    else if (page === "fixtures") body = <FixturesPage initialRun={search.get("run") ?? ""} />;
    else if (page === "workflows" && parts[1]) body = <WorkflowPage name={parts[1]} key={parts[1]} />;
    else if (page === "workflows") body = <WorkflowsPage />;
    else if (page === "metrics") body = <MetricsPage />;
    else if (page === "workers") body = <WorkersPage />;
    else if (page === "mcp") body = <McpPage callback={parts[1] === "callback"} key={parts[1] ?? ""} />;
    else body = <p>No such page. <Link to="/console/runs">Runs</Link></p>;
    return <>
        <a className="skip" href="#main">Skip to the page</a>
        <header className="top">
            <Link to="/console/runs" className="brand">tuvl Insight</Link>
            <nav aria-label="Pages">
                {PAGES.map(([p, label]) => <a key={p} href={`/console/${p}`} aria-current={page === p ? "page" : undefined}
                    onClick={(e) => { e.preventDefault(); navigate(`/console/${p}`); }}>{label}</a>)}
            </nav>
            <div className="who"><span data-testid="role">{me.role}{me.operator ? " (operator)" : ""}</span>
                <button type="button" onClick={async () => { await api("DELETE", "/api/console/session").catch(() => undefined); setMe(null); }}>Sign out</button>
            </div>
        </header>
        <main id="main" tabIndex={-1}>{body}</main>
        <ConfirmHost />
    </>;
}

/* ------------------------------------------------------------ sign-in */

function SignIn({ onIn }: { onIn: (m: Me) => void }) {
    const [mode, setMode] = useState<"password" | "token">("password");
    const [error, setError] = useState<unknown>(null);
    const [busy, setBusy] = useState(false);
    const submit = async (e: FormEvent<HTMLFormElement>) => {
        e.preventDefault();
        const f = new FormData(e.currentTarget);
        setBusy(true);
        setError(null);
        try {
            const body = mode === "password" ? { role: f.get("role"), password: f.get("password") } : { token: f.get("token") };
            onIn(await post<Me>("/api/console/session", body));
        } catch (err) {
            setError(err);
        } finally {
            setBusy(false);
        }
    };
    return <main className="signin">
        <div className="card">
            <h1>Sign in to tuvl Insight</h1>
            <div className="tabs" role="tablist">
                <button type="button" role="tab" aria-selected={mode === "password"} onClick={() => setMode("password")}>Role and password</button>
                <button type="button" role="tab" aria-selected={mode === "token"} onClick={() => setMode("token")}>API token</button>
            </div>
            <form onSubmit={submit} key={mode}>
                {mode === "password" ? <>
                    <label>PostgreSQL role<input name="role" autoComplete="username" required autoFocus /></label>
                    <label>Password<input name="password" type="password" autoComplete="current-password" required /></label>
                    <p className="muted">PostgreSQL checks the password. You see and may do what your role may in SQL.</p>
                </> : <>
                    <label>Token<input name="token" type="password" autoComplete="off" required autoFocus placeholder="tuvl_…" /></label>
                    <p className="muted">A token from tuvl.create_token(); its scopes bound what you may do.</p>
                </>}
                <ErrorBox error={error} />
                <button className="primary" type="submit" disabled={busy}>Sign in</button>
            </form>
        </div>
    </main>;
}

/* ------------------------------------------------------------ runs */

function RunsPage({ search }: { search: URLSearchParams }) {
    const f = {
        workflow: search.get("workflow") ?? "", status: search.get("status") ?? "", key: search.get("key") ?? "",
        from: search.get("from") ?? "", to: search.get("to") ?? "", q: search.get("q") ?? "", before: search.get("before") ?? "",
    };
    const filterQs = qs({ workflow: f.workflow, status: f.status, key: f.key, from: f.from && new Date(f.from).toISOString(),
                          to: f.to && new Date(f.to).toISOString(), q: f.q });
    const runs = useLoad(() => get(`/api/console/runs${qs({ workflow: f.workflow, status: f.status, key: f.key,
        from: f.from && new Date(f.from).toISOString(), to: f.to && new Date(f.to).toISOString(), q: f.q, before: f.before })}`),
        [search.toString()], 2000);
    const counts = useLoad(() => get(`/api/console/counts${filterQs}`), [filterQs], 5000);
    const workflows = useLoad(() => get("/api/console/workflows"), []);
    const go = (patch: Record<string, string>) => {
        const p = new URLSearchParams(search);
        for (const [k, v] of Object.entries(patch)) if (v) p.set(k, v); else p.delete(k);
        if (!("before" in patch)) p.delete("before");
        const s = p.toString();
        navigate(`/console/runs${s ? "?" + s : ""}`);
    };
    const onFilter = (e: FormEvent<HTMLFormElement>) => {
        e.preventDefault();
        const d = new FormData(e.currentTarget);
        go({ workflow: String(d.get("workflow") ?? ""), status: String(d.get("status") ?? ""), key: String(d.get("key") ?? ""),
             from: String(d.get("from") ?? ""), to: String(d.get("to") ?? ""), q: String(d.get("q") ?? "") });
    };
    const c = counts.data?.counts ?? {};
    const capped: string[] = counts.data?.capped ?? [];
    return <>
        <h1>Runs</h1>
        <form className="card row" onSubmit={onFilter} aria-label="Filters" key={search.toString()}>
            <label>Workflow<select name="workflow" defaultValue={f.workflow}>
                <option value="">all</option>
                {(workflows.data?.workflows ?? []).map((w: any) => <option key={w.name}>{w.name}</option>)}
                {f.workflow && !(workflows.data?.workflows ?? []).some((w: any) => w.name === f.workflow) ? <option>{f.workflow}</option> : null}
            </select></label>
            <label>Status<select name="status" defaultValue={f.status}>
                <option value="">all</option>{STATUSES.map((s) => <option key={s}>{s}</option>)}</select></label>
            <label>Key<input name="key" defaultValue={f.key} size={10} /></label>
            <label>From<input name="from" type="datetime-local" defaultValue={f.from} /></label>
            <label>To<input name="to" type="datetime-local" defaultValue={f.to} /></label>
            <label>Text in input or response<input name="q" defaultValue={f.q} size={14} /></label>
            <button className="primary" type="submit">Filter</button>
            <button type="button" onClick={() => navigate("/console/runs")}>Clear</button>
        </form>
        <div className="chips" aria-label="Counts by status">
            {STATUSES.filter((s) => c[s]).map((s) => <button type="button" key={s} className="chip" aria-pressed={f.status === s}
                data-count={s} onClick={() => go({ status: f.status === s ? "" : s })}>{s.replace(/_/g, " ")}: {c[s].toLocaleString()}{capped.includes(s) ? "+" : ""}</button>)}
            {capped.length ? <span className="muted">(a count stops at {counts.data.cap.toLocaleString()})</span> : null}
            {counts.data?.window ? <span className="muted">(counts of the newest {counts.data.window.toLocaleString()} runs the other filters select)</span> : null}
        </div>
        <ErrorBox error={runs.error} />
        {runs.data?.text_window ? <p className="muted">Text is searched in the newest {runs.data.text_window.toLocaleString()} runs
            {f.before ? ` before #${f.before}` : ""} that the other filters select; <em>Older →</em> searches on.</p> : null}
        <div className="table-wrap"><table aria-label="Runs">
            <thead><tr><th>Run</th><th>Workflow</th><th>Status</th><th className="hide-sm">Step</th><th className="hide-sm">Key</th>
                <th className="hide-sm">By</th><th>Created</th><th className="hide-sm">Took</th></tr></thead>
            <tbody>{(runs.data?.runs ?? []).map((r: any) => <tr key={r.id} data-run={r.id}>
                <td><Link to={`/console/runs/${r.id}`}>#{r.id}</Link>{r.parent_run_id ? <span className="muted"> ↳{r.parent_run_id}</span> : null}</td>
                <td>{r.workflow} <span className="muted">v{r.version}</span></td>
                <td><Badge status={r.status} /></td>
                <td className="hide-sm">{r.end ? <span className="muted">end {r.end}</span> : r.step ?? "—"}</td>
                <td className="hide-sm">{r.key ?? ""}</td>
                <td className="hide-sm">{r.principal}</td>
                <td>{time(r.created_at)}</td>
                <td className="hide-sm">{r.finished_at ? duration(Date.parse(r.finished_at) - Date.parse(r.created_at)) : ""}</td>
            </tr>)}
            {runs.data && runs.data.runs.length === 0 ? <tr><td colSpan={8} className="muted">No runs.</td></tr> : null}</tbody>
        </table></div>
        <div className="actions">
            {f.before ? <button type="button" onClick={() => history.back()}>← Newer</button> : null}
            {runs.data?.next_before ? <button type="button" onClick={() => go({ ...f, before: String(runs.data.next_before) })}>Older →</button> : null}
        </div>
    </>;
}

/* ------------------------------------------------------------ a run */

function useEvents(id: number): { events: Ev[]; ended: boolean; error: string | null } {
    const [events, setEvents] = useState<Ev[]>([]);
    const [ended, setEnded] = useState(false);
    const [error, setError] = useState<string | null>(null);
    useEffect(() => {
        const buf: Ev[] = [];
        let flush: number | undefined;
        let es: EventSource | null = null;
        let closed = false;
        const step = (ev: Ev & { agent_id?: string | null }) => {
            ev.step = ev.step ?? ev.agent_id ?? null;      /* the journal's agent_id is the step's id */
            return ev;
        };
        const push = (e: MessageEvent) => {
            try {
                buf.push(step(JSON.parse(e.data)));
            } catch { return; }
            if (flush === undefined) flush = window.setTimeout(() => { flush = undefined; setEvents((old) => [...old, ...buf.splice(0)]); }, 100);
        };
        const follow = (after: number) => {
            es = new EventSource(`/api/runs/${id}/events?after=${after}`);
            const types = ["run_queued", "run_started", "agent_started", "agent_completed", "signal", "checkpoint", "tool_call", "tool_result",
                           "llm_turn", "judge_verdict", "decision", "approval_requested", "approval_decided", "paused", "resumed", "run_completed",
                           "run_failed", "run_aborted", "compensation_started", "compensation_completed", "children_started", "children_ended",
                           "guardrail", "guardrail_verdict", "steered", "human_submitted", "message"];
            for (const t of types) es.addEventListener(t, push as EventListener);
            es.onmessage = push;
            /* other event types: the stream's own error event, or any type not listed */
            es.addEventListener("stream_error", (e) => { setError(JSON.parse((e as MessageEvent).data).message); es?.close(); });
            es.onerror = () => {
                /* the server ends the stream after the run's final event (204 on reconnection) */
                if (es?.readyState === EventSource.CLOSED) setEnded(true);
            };
        };
        /* the journal so far in one read and one render; then the stream, from its last seq */
        take<{ status: string; events: Ev[] }>(`/api/console/runs/${id}/journal`).then((j) => {
            if (closed) return;
            const evs = j.events.map(step);
            setEvents(evs);
            const last = evs.length ? Number(evs[evs.length - 1].seq) : 0;
            if (FINAL.has(j.status)) setEnded(true);
            else follow(last);
        }, (e: Error) => { if (!closed) setError(e.message); });
        return () => { closed = true; es?.close(); if (flush) clearTimeout(flush); };
    }, [id]);
    return { events, ended, error };
}

function RunPage({ id }: { id: number }) {
    const detail = useLoad(() => take(`/api/console/runs/${id}`), [id]);
    const { events, error: streamError } = useEvents(id);
    /* no choice yet: the conversation of a run with an agent, else the timeline (never both rendered) */
    const [chosen, setTab] = useState<"timeline" | "conversation" | "data" | null>(null);
    const [notice, setNotice] = useState<string | null>(null);
    /* the run's row again when the journal says its status or step moved (at most every 300 ms) */
    const moves = useMemo(() => events.filter((e) => MOVES.has(e.type)).length, [events]);
    const reload = detail.reload;
    useEffect(() => {
        if (!moves) return;
        const t = window.setTimeout(reload, 300);
        return () => clearTimeout(t);
        /* eslint-disable-next-line */
    }, [moves]);
    const d = detail.data;
    const run = d?.run;
    const agentSteps = useMemo(() => new Set<string>((d?.steps ?? []).filter((s: any) => s.kind === "Agent").map((s: any) => s.id)), [d]);
    const visited = useMemo(() => new Set(events.filter((e) => e.type === "agent_started" && e.step).map((e) => e.step as string)), [events]);
    const hasAgent = agentSteps.size > 0;
    const conversation = useMemo(() => hasAgent ? <Conversation events={events.filter(isAgentEvent)} agentSteps={agentSteps} /> : null,
                                 [events, agentSteps, hasAgent]);
    const tab = chosen ?? (hasAgent ? "conversation" : "timeline");
    const [bps, toggleBp] = useBreakpoints(run?.workflow ?? "", d?.breakpoints, reload, (e) => setNotice(e ? (e as Error).message : null));
    if (detail.error && !d) return <ErrorBox error={detail.error} />;
    if (!d) return <p className="loading">Loading run {id}…</p>;
    const status: string = run.status;
    const act = (action: string, body: unknown = {}) => post(`/api/runs/${id}/${action}`, body).then((r: any) => {
        setNotice(r.notices?.length ? r.notices.join(" ") : null);
        reload();
    });
    const t0 = Date.parse(run.created_at);

    return <>
        <h1>Run #{id} <Badge status={status} /></h1>
        <div className="card">
            <dl className="kv">
                <dt>Workflow</dt><dd><Link to={`/console/workflows/${run.workflow}`}>{run.workflow}</Link> v{run.version}</dd>
                <dt>Step</dt><dd data-testid="current-step">{run.end ? `ended at ${run.end}` : run.step ?? "—"}</dd>
                <dt>By</dt><dd>{run.principal}</dd>
                {run.key ? <><dt>Key</dt><dd>{run.key}</dd></> : null}
                <dt>Created</dt><dd>{time(run.created_at)}</dd>
                {run.finished_at ? <><dt>Took</dt><dd>{duration(Date.parse(run.finished_at) - t0)}</dd></> : null}
                {d.parent ? <><dt>Parent</dt><dd><Link to={`/console/runs/${d.parent.id}`}>#{d.parent.id}</Link> {d.parent.workflow} <Badge status={d.parent.status} /></dd></> : null}
                {run.error ? <><dt>Error</dt><dd className="error">{run.error}</dd></> : null}
            </dl>
            <div className="actions" aria-label="Control">
                {["queued", "running"].includes(status) ? <button type="button" onClick={() => confirmAction({
                    title: `Pause run #${id}?`, body: <p>It stops before its next step (an agent: before its next turn).</p>,
                    confirm: "Pause", run: () => act("pause") })}>Pause</button> : null}
                {status === "paused" ? <button type="button" className="primary" onClick={() => confirmAction({
                    title: `Resume run #${id}?`, confirm: "Resume", run: () => act("resume") })}>Resume</button> : null}
                {status === "paused" ? <button type="button" onClick={() => confirmAction({
                    title: `Run one step of #${id}?`, body: <p>The run executes step <strong>{run.step}</strong> and pauses before the next one.</p>,
                    confirm: "Step", run: () => act("step") })}>Step</button> : null}
                {["running", "paused", "waiting_human", "waiting_approval", "queued"].includes(status) && hasAgent ? <button type="button" onClick={() => confirmAction({
                    title: `Steer run #${id}`, body: <p>The agent reads this guidance at its next turn.</p>, withText: "Message", requireText: true,
                    confirm: "Steer", run: (m) => act("steer", { message: m }) })}>Steer</button> : null}
                {!FINAL.has(status) && status !== "compensating" ? <button type="button" className="danger" onClick={() => confirmAction({
                    title: `Abort run #${id}?`, body: <p>The run ends as aborted (its completed steps are compensated). This cannot be undone.</p>,
                    withText: "Reason (optional)", danger: true, confirm: "Abort run", run: (r) => act("abort", r ? { reason: r } : {}) })}>Abort</button> : null}
                <button type="button" onClick={async () => {
                    try { download(`run-${id}.fixture.json`, await get(`/api/runs/${id}/fixture`)); } catch (e) { setNotice((e as Error).message); }
                }}>Pin (download fixture)</button>
                <Link className="button" to={`/console/fixtures?run=${id}`}>Replay…</Link>
            </div>
            {notice ? <div className="notice" role="status">{notice}</div> : null}
            <ErrorBox error={detail.error} />
            {streamError ? <div className="error">{streamError}</div> : null}
        </div>
        {status === "waiting_human" || status === "waiting_approval" ? <div className="card"><h2>Waiting for a person</h2>
            <Answer item={{ run_id: id, status, step: run.step, awaiting: run.awaiting }} onDone={reload} /></div> : null}
        <div className="grid2">
            <section aria-label="Graph">
                <h2>Graph</h2>
                {d.graph ? <Graph dot={d.graph} current={FINAL.has(status) ? null : run.step} visited={visited} breakpoints={bps}
                    onNode={(step) => void toggleBp(step)} label={`graph of workflow ${run.workflow}`} /> : <p className="muted">No graph.</p>}
                <p className="muted">Select a step to set or clear a breakpoint before it (dev mode): runs of {run.workflow} pause there.</p>
                {d.children.length ? <><h2>Children ({d.children.length})</h2>
                    <ul>{d.children.map((c: any) => <li key={c.id}><Link to={`/console/runs/${c.id}`}>#{c.id}</Link> {c.workflow} <Badge status={c.status} /></li>)}</ul></> : null}
            </section>
            <section aria-label="Journal">
                <div className="tabs" role="tablist">
                    {hasAgent ? <button type="button" role="tab" aria-selected={tab === "conversation"} onClick={() => setTab("conversation")}>Conversation</button> : null}
                    <button type="button" role="tab" aria-selected={tab === "timeline"} onClick={() => setTab("timeline")}>Timeline ({events.length})</button>
                    <button type="button" role="tab" aria-selected={tab === "data"} onClick={() => setTab("data")}>Context and response</button>
                </div>
                {tab === "conversation" ? conversation : null}
                {tab === "timeline" ? <Timeline events={events} t0={t0} /> : null}
                {tab === "data" ? <>
                    <h2>Input</h2><Json value={run.input} />
                    <h2>Context</h2><Json value={run.context} />
                    <h2>Response</h2><Json value={run.response ?? null} />
                </> : null}
            </section>
        </div>
    </>;
}

function Timeline({ events, t0 }: { events: Ev[]; t0: number }) {
    const tokens = events.reduce((s, e) => s + (e.tokens ?? 0), 0);
    return <>
        <p className="muted">{events.length} events{tokens ? `, ${tokens.toLocaleString()} tokens` : ""}</p>
        <div className="table-wrap"><table className="timeline" aria-label="Timeline">
            <thead><tr><th>At</th><th>#</th><th>Step</th><th>Event</th><th>Summary</th><th className="hide-sm">Latency</th><th className="hide-sm">Tokens</th></tr></thead>
            <tbody>{events.map((e) => <tr key={e.seq} data-event={e.type}>
                <td className="at">+{duration(Date.parse(e.ts) - t0)}</td><td>{e.seq}</td><td>{e.step ?? ""}</td><td>{e.type}</td>
                <td>{e.summary}</td><td className="hide-sm">{e.latency_ms ? duration(e.latency_ms) : ""}</td><td className="hide-sm">{e.tokens ?? ""}</td>
            </tr>)}</tbody>
        </table></div>
    </>;
}

/* ------------------------------------------------------------ MCP: connect a server (OAuth) */

/*
 * A person connects their role to an MCP server that wants OAuth (the
 * authorization-code grant): the server's URL (and, if it needs them, a
 * client id and scopes) goes to tuvl.mcp_connect(); the browser goes to the
 * authorization server, which sends it back to /console/mcp/callback, and
 * that page hands its URL to tuvl.mcp_connect_finish().  The tokens are
 * secrets of the role: its runs' MCP steps with
 * auth: { oauth: { grant: authorization_code } } use them.
 */
function McpPage({ callback }: { callback: boolean }) {
    const [error, setError] = useState<unknown>(null);
    const [busy, setBusy] = useState(false);
    const [connected, setConnected] = useState<string | null>(null);
    const finished = useRef(false);
    useEffect(() => {
        if (!callback || finished.current) return;
        finished.current = true;
        const sent = location.href;
        history.replaceState(null, "", "/console/mcp");
        post<{ url: string }>("/api/console/mcp/finish", { callback_url: sent })
            .then((r) => setConnected(r.url), (e) => setError(e));
    }, [callback]);
    const submit = async (e: FormEvent<HTMLFormElement>) => {
        e.preventDefault();
        const f = new FormData(e.currentTarget);
        const oauth: Record<string, unknown> = { grant: "authorization_code" };
        const clientId = String(f.get("client_id") ?? "").trim();
        const scopes = String(f.get("scopes") ?? "").split(/[\s,]+/).filter(Boolean);
        if (clientId) oauth.client_id = clientId;
        if (scopes.length) oauth.scopes = scopes;
        setBusy(true);
        setError(null);
        try {
            const r = await post<{ authorize_url: string }>("/api/console/mcp/connect", { url: String(f.get("url") ?? "").trim(), auth: { oauth } });
            location.assign(r.authorize_url);
        } catch (err) {
            setError(err);
            setBusy(false);
        }
    };
    return <>
        <h1>MCP servers</h1>
        {callback && !connected && !error ? <p className="loading" role="status">Finishing the connection…</p> : null}
        {connected ? <div className="notice" role="status" data-testid="mcp-connected">Connected: your runs' MCP steps
            with <code>auth: {"{ oauth: { grant: authorization_code } }"}</code> now call <strong>{connected}</strong> as you.</div> : null}
        <ErrorBox error={error} />
        <form className="card" onSubmit={submit} aria-label="Connect an MCP server">
            <h2>Connect a server that wants OAuth</h2>
            <p className="muted">You are sent to the server's authorization page; when you allow access there, you come back here
                and the tokens are kept as secrets of your role (<code>tuvl.mcp_connect()</code>).</p>
            <label>MCP server URL<input name="url" type="url" required placeholder="https://mcp.example.com/mcp" size={40} /></label>
            <label>Client id (optional)<input name="client_id" placeholder="registered for you when empty" /></label>
            <label>Scopes (optional)<input name="scopes" placeholder="the server's when empty" /></label>
            <div className="actions"><button className="primary" type="submit" disabled={busy}>Connect</button></div>
        </form>
    </>;
}

/* ------------------------------------------------------------ people */

/*
 * An answer's confirmation is the page's (onDone), not the card's: the
 * run leaves the list as soon as a worker takes it on, often before the
 * reload that follows the answer.
 */
function Answer({ item, onDone }: { item: any; onDone: (notice: string) => void }) {
    const [error, setError] = useState<unknown>(null);
    const [note, setNote] = useState("");
    const [done, setDone] = useState<string | null>(null);
    const a = item.awaiting ?? {};
    if (done) return <p className="muted">{done}</p>;
    if (item.status === "waiting_human") {
        const schema = a.form ?? { type: "object" };
        /* an MCP server's question (mcp.elicitation ask): also declined or cancelled */
        const mcp = a.kind === "mcp_elicitation";
        const reject = async (action: "decline" | "cancel") => {
            setError(null);
            try {
                await post(`/api/runs/${item.run_id}/reject`, { action });
                setDone("Sent.");
                onDone(`${action === "decline" ? "Declined" : "Cancelled"}: the question of run #${item.run_id}.`);
            } catch (e) { setError(e); }
        };
        return <div className="rjsf" data-testid={`form-${item.run_id}`}>
            {mcp ? <p>Step <strong>{item.step}</strong> of run <Link to={`/console/runs/${item.run_id}`}>#{item.run_id}</Link>:
                the MCP server {a.server} asks, for its tool <strong>{a.tool}</strong>: {a.message}
                {a.mode === "url" ? <> (at <a href={a.url} target="_blank" rel="noreferrer noopener">{a.url}</a>)</> : null}</p>
                : <p>Step <strong>{item.step}</strong> of run <Link to={`/console/runs/${item.run_id}`}>#{item.run_id}</Link> asks:</p>}
            <Suspense fallback={<p className="loading">Loading the form…</p>}>
            <SchemaForm schema={mcp && a.mode === "url" ? { type: "object" } : schema}
                onSubmit={async (formData) => {
                    setError(null);
                    try {
                        await post(`/api/runs/${item.run_id}/submit`, { data: formData ?? {} });
                        setDone("Sent.");
                        onDone(`Submitted to run #${item.run_id}.`);
                    } catch (e) { setError(e); }
                }}>
                <div className="actions"><button type="submit" className="primary">{mcp ? "Accept" : "Submit"}</button>
                    {mcp ? <>
                        <button type="button" className="danger" onClick={() => void reject("decline")}>Decline</button>
                        <button type="button" onClick={() => void reject("cancel")}>Cancel</button></> : null}</div>
            </SchemaForm>
            </Suspense>
            <ErrorBox error={error} />
        </div>;
    }
    const decide = async (approved: boolean) => {
        setError(null);
        try {
            await post(`/api/runs/${item.run_id}/decide`, note ? { approved, note } : { approved });
            setDone("Sent.");
            onDone(`${approved ? "Approved" : "Rejected"}: ${a.tool} of run #${item.run_id}.`);
        } catch (e) { setError(e); }
    };
    return <div data-testid={`approval-${item.run_id}`}>
        <p>Run <Link to={`/console/runs/${item.run_id}`}>#{item.run_id}</Link> (step {item.step}) asks to call <strong>{a.tool}</strong> with:</p>
        <Json value={a.arguments} />
        <label style={{ display: "flex" }}>Note (optional)<textarea value={note} onChange={(e) => setNote(e.target.value)} /></label>
        <div className="actions">
            <button type="button" className="primary" onClick={() => void decide(true)}>Approve</button>
            <button type="button" className="danger" onClick={() => void decide(false)}>Reject</button>
        </div>
        <ErrorBox error={error} />
    </div>;
}

function PeoplePage() {
    const people = useLoad(() => get("/api/people"), [], 3000);
    const paused = useLoad(() => get("/api/console/runs?status=paused&limit=100"), [], 3000);
    const items: any[] = people.data?.people ?? [];
    const [notice, setNotice] = useState<string | null>(null);
    const answered = (n: string) => { setNotice(n); people.reload(); };
    return <>
        <h1>People</h1>
        <p className="muted">What waits for a person: forms of Human steps, tool calls to approve, paused runs.</p>
        {notice ? <div className="notice" role="status">{notice}</div> : null}
        <ErrorBox error={people.error} />
        {items.length === 0 && people.data ? <p>Nothing waits for you.</p> : null}
        <div className="grid3">
            {items.map((p) => <div className="card" key={`${p.run_id}-${p.step}`} data-run={p.run_id}>
                <h2>{p.status === "waiting_human" ? "Form" : "Approval"} · {p.workflow} #{p.run_id}</h2>
                <p className="muted">waiting {duration((p.age_s ?? 0) * 1000)}{p.deadline ? `, due ${time(p.deadline)}` : ""}</p>
                <Answer item={p} onDone={answered} />
            </div>)}
        </div>
        <h2>Paused runs</h2>
        {(paused.data?.runs ?? []).length === 0 ? <p className="muted">None.</p> : <ul>
            {paused.data.runs.map((r: any) => <li key={r.id} data-run={r.id}><Link to={`/console/runs/${r.id}`}>#{r.id}</Link> {r.workflow} before step {r.step}{" "}
                <button type="button" onClick={() => confirmAction({ title: `Resume run #${r.id}?`, confirm: "Resume",
                    run: async () => { await post(`/api/runs/${r.id}/resume`); paused.reload(); } })}>Resume</button></li>)}
        </ul>}
    </>;
}

/* ------------------------------------------------------------ fixtures */

function FixturesPage({ initialRun }: { initialRun: string }) {
    const [runId, setRunId] = useState(initialRun);
    const [fixture, setFixture] = useState<any>(null);
    const [live, setLive] = useState<Set<string>>(new Set());
    const [result, setResult] = useState<any>(null);
    const [error, setError] = useState<unknown>(null);
    const [busy, setBusy] = useState(false);
    const fileRef = useRef<HTMLInputElement>(null);
    const pin = async (id: string, save: boolean) => {
        setError(null); setResult(null);
        try {
            const f = await get(`/api/runs/${Number(id)}/fixture`);
            setFixture(f);
            if (save) download(`run-${id}.fixture.json`, f);
        } catch (e) { setError(e); }
    };
    useEffect(() => { if (initialRun) void pin(initialRun, false); /* eslint-disable-next-line */ }, [initialRun]);
    const steps: string[] = useMemo(() => {
        if (!fixture) return [];
        const seen: string[] = [];
        for (const e of fixture.effects ?? fixture.steps ?? []) if (e.step && !seen.includes(e.step)) seen.push(e.step);
        return seen;
    }, [fixture]);
    const replay = async () => {
        setBusy(true); setError(null); setResult(null);
        try {
            setResult(await post("/api/replay", live.size ? { fixture, live: [...live] } : { fixture }));
        } catch (e) {
            /* tuvl.replay() raises at the first divergence: where and why */
            if (e instanceof ApiFailure && /diverged/.test(e.message)) setResult({ diverged: { message: e.message, detail: e.detail, hint: e.hint } });
            else setError(e);
        } finally { setBusy(false); }
    };
    return <>
        <h1>Fixtures</h1>
        <div className="card">
            <h2>Pin a run</h2>
            <form className="row" onSubmit={(e) => { e.preventDefault(); void pin(runId, true); }}>
                <label>Run<input name="run" value={runId} onChange={(e) => setRunId(e.target.value)} inputMode="numeric" size={10} required /></label>
                <button type="submit" className="primary">Pin and download</button>
                <button type="button" onClick={() => void pin(runId, false)}>Load for replay</button>
            </form>
            <p className="muted">Or load a fixture file: <input ref={fileRef} type="file" accept="application/json,.json" aria-label="Fixture file"
                onChange={async (e) => {
                    const file = e.target.files?.[0];
                    if (!file) return;
                    try { setFixture(JSON.parse(await file.text())); setResult(null); setError(null); } catch (err) { setError(err); }
                }} /></p>
        </div>
        {fixture ? <div className="card">
            <h2>Replay run #{fixture.run_id} of {fixture.workflow} v{fixture.version}</h2>
            <p>Recorded: <Badge status={fixture.status} /> at end {fixture.end ?? "—"}.</p>
            <fieldset><legend>Steps to run live (the others replay their recorded effects)</legend>
                {steps.length === 0 ? <span className="muted">The recording has no effects.</span> : null}
                <div className="row">{steps.map((s) => <label key={s} style={{ flexDirection: "row", gap: 6 }}>
                    <input type="checkbox" checked={live.has(s)} onChange={(e) => {
                        const n = new Set(live); if (e.target.checked) n.add(s); else n.delete(s); setLive(n);
                    }} />{s}</label>)}</div>
            </fieldset>
            <div className="actions"><button type="button" className="primary" onClick={() => void replay()} disabled={busy}>Replay</button></div>
        </div> : null}
        <ErrorBox error={error} />
        {result ? <ReplayResult result={result} fixture={fixture} /> : null}
    </>;
}

function ReplayResult({ result, fixture }: { result: any; fixture: any }) {
    const diverged = result.diverged ?? result.divergence ?? null;
    const same = !diverged && result.status === fixture.status && JSON.stringify(result.response) === JSON.stringify(fixture.response);
    return <div className="card" data-testid="replay-result">
        <h2>Result: {diverged ? "diverged" : same ? "same as recorded" : "different outcome"}</h2>
        {diverged ? <div className="error" data-testid="divergence" role="alert"><strong>{diverged.message ?? "Diverged"}</strong>
            {diverged.detail ? <div>{diverged.detail}</div> : null}{diverged.hint ? <div className="muted">{diverged.hint}</div> : null}</div> : null}
        <div className="grid2">
            <div><h2>Recorded</h2><p><Badge status={fixture.status} /> end {fixture.end ?? "—"}</p><Json value={fixture.response} /></div>
            <div><h2>Replayed</h2><p><Badge status={result.status} /> end {result.end ?? "—"}</p><Json value={result.response} /></div>
        </div>
        <details><summary>Everything the replay returned</summary><Json value={result} /></details>
    </div>;
}

/* ------------------------------------------------------------ workflows, metrics, workers */

function WorkflowsPage() {
    const w = useLoad(() => get("/api/console/workflows"), []);
    return <>
        <h1>Workflows</h1>
        <ErrorBox error={w.error} />
        <div className="table-wrap"><table aria-label="Workflows">
            <thead><tr><th>Name</th><th>Version</th><th>Versions</th><th className="hide-sm">Owner</th><th className="hide-sm">Description</th><th className="hide-sm">Updated</th></tr></thead>
            <tbody>{(w.data?.workflows ?? []).map((x: any) => <tr key={x.name}>
                <td><Link to={`/console/workflows/${x.name}`}>{x.name}</Link></td><td>{x.version}</td><td>{x.versions}</td>
                <td className="hide-sm">{x.owner}</td><td className="hide-sm">{x.description ?? ""}</td><td className="hide-sm">{time(x.updated_at)}</td>
            </tr>)}</tbody>
        </table></div>
    </>;
}

function WorkflowPage({ name }: { name: string }) {
    const [version, setVersion] = useState<number | undefined>(undefined);
    const w = useLoad(() => get(`/api/console/workflows/${encodeURIComponent(name)}${qs({ version })}`), [name, version]);
    const [error, setError] = useState<unknown>(null);
    const d = w.data;
    const [bps, toggle] = useBreakpoints(name, d?.breakpoints, w.reload, setError);
    return <>
        <h1>Workflow {name}</h1>
        <ErrorBox error={w.error ?? error} />
        {d ? <>
            <div className="row card">
                <label>Version<select value={d.version} onChange={(e) => setVersion(Number(e.target.value))}>
                    {d.versions.map((v: any) => <option key={v.version} value={v.version}>v{v.version} · {v.owner} · {time(v.created_at)}</option>)}
                </select></label>
                <Link className="button" to={`/console/runs?workflow=${encodeURIComponent(name)}`}>Its runs</Link>
            </div>
            <div className="grid2">
                <section><h2>Graph (newest version)</h2>
                    <Graph dot={d.graph} breakpoints={bps} onNode={toggle} label={`graph of workflow ${name}`} />
                    <h2>Dev mode</h2>
                    <p className="muted">A breakpoint pauses your runs of {name} before that step; from the run's page, Step runs one step at a time.</p>
                    <ul aria-label="Breakpoints">{d.steps.map((s: any) => <li key={s.id}><label style={{ flexDirection: "row", gap: 6 }}>
                        <input type="checkbox" checked={bps.includes(s.id)} onChange={() => void toggle(s.id)} data-breakpoint={s.id} />
                        breakpoint before <strong>{s.id}</strong> <span className="muted">({s.kind})</span></label></li>)}</ul>
                </section>
                <section><h2>YAML (v{d.version})</h2><pre>{d.source}</pre></section>
            </div>
        </> : null}
    </>;
}

/* A workflow's breakpoints of the signed-in role, changed at once on the page and then in the database. */
function useBreakpoints(workflow: string, loaded: string[] | undefined, reload: () => void,
                        onError: (e: unknown) => void): [string[], (step: string) => Promise<void>] {
    const [local, setLocal] = useState<string[] | null>(null);
    useEffect(() => setLocal(null), [loaded]);
    const bps = local ?? loaded ?? [];
    const toggle = async (step: string) => {
        const on = !bps.includes(step);
        setLocal(on ? [...bps, step] : bps.filter((b) => b !== step));
        try {
            await post("/api/console/breakpoints", { workflow, step, on });
            onError(null);
        } catch (e) {
            onError(e);
        }
        reload();
    };
    return [bps, toggle];
}

function Bars({ title, data, unit }: { title: string; data: [string, number][]; unit?: string }) {
    const max = Math.max(1, ...data.map((d) => d[1]));
    const rowH = 22, labelW = 150, w = 460;
    return <div className="card chart"><h2>{title}</h2>
        {data.length === 0 ? <p className="muted">No data yet.</p> :
            <svg viewBox={`0 0 ${w} ${data.length * rowH + 4}`} role="img" aria-label={title}>
                {data.map(([k, v], i) => <g key={k} transform={`translate(0,${i * rowH})`}>
                    <text x={labelW - 6} y={15} textAnchor="end">{k.length > 24 ? k.slice(0, 23) + "…" : k}</text>
                    <rect className="bar" x={labelW} y={4} height={14} width={Math.max(1, ((w - labelW - 70) * v) / max)} rx={2} />
                    <text x={labelW + Math.max(1, ((w - labelW - 70) * v) / max) + 4} y={15}>{Number.isInteger(v) ? v.toLocaleString() : v.toFixed(1)}{unit ?? ""}</text>
                </g>)}
            </svg>}
    </div>;
}

function MetricsPage() {
    const m = useLoad(() => get("/api/console/metrics"), [], 5000);
    const rows: any[] = m.data?.metrics ?? [];
    const byStatus: [string, number][] = rows.filter((r) => r.name === "tuvl.runs").map((r) => [r.labels?.status ?? "?", r.value]);
    /* step latency: the histograms' mean (sum / count) by step kind or step */
    const lat = new Map<string, { sum: number; count: number }>();
    for (const r of rows) {
        const base = String(r.name).replace(/\.(sum|count)$/, "");
        if (!/latency|duration|seconds/.test(base) || !/\.(sum|count)$/.test(r.name)) continue;
        const key = `${base.replace(/^tuvl\./, "")} ${r.labels?.kind ?? r.labels?.step ?? r.labels?.model ?? ""}`.trim();
        const e = lat.get(key) ?? { sum: 0, count: 0 };
        if (r.name.endsWith(".sum")) e.sum += r.value; else e.count += r.value;
        lat.set(key, e);
    }
    const latency: [string, number][] = [...lat].filter(([, e]) => e.count > 0).map(([k, e]) => [k, (e.sum / e.count) * (/seconds/.test(k) ? 1000 : 1)]);
    const tok = new Map<string, number>();
    for (const r of rows) if (/tokens/.test(r.name) && r.kind === "counter") {
        const k = `${r.labels?.model ?? "?"}${r.labels?.direction || r.labels?.type ? " " + (r.labels.direction ?? r.labels.type) : ""}`;
        tok.set(k, (tok.get(k) ?? 0) + r.value);
    }
    return <>
        <h1>Metrics</h1>
        <ErrorBox error={m.error} />
        <div className="grid3">
            <Bars title="Runs by status" data={byStatus} />
            <Bars title="Step latency (mean)" data={latency} unit=" ms" />
            <Bars title="Tokens by model" data={[...tok]} />
        </div>
        <details className="card"><summary>Every series of tuvl.metrics ({rows.length})</summary>
            <div className="table-wrap"><table><thead><tr><th>Name</th><th>Kind</th><th>Labels</th><th>Value</th></tr></thead>
                <tbody>{rows.map((r, i) => <tr key={i}><td className="mono">{r.name}</td><td>{r.kind}</td><td className="mono">{JSON.stringify(r.labels)}</td><td>{r.value}</td></tr>)}</tbody>
            </table></div>
        </details>
    </>;
}

function WorkersPage() {
    const w = useLoad(() => get("/api/console/workers"), [], 3000);
    return <>
        <h1>Workers</h1>
        <ErrorBox error={w.error} />
        <div className="table-wrap"><table aria-label="Workers">
            <thead><tr><th>Pid</th><th>Database</th><th>Worker</th><th>Runs held</th><th>Transfers</th><th className="hide-sm">Peak</th><th>Heartbeat</th><th className="hide-sm">State</th></tr></thead>
            <tbody>{(w.data?.workers ?? []).map((x: any) => <tr key={x.pid}>
                <td>{x.pid}</td><td>{x.database}</td><td>{x.worker}</td><td>{x.runs_held}</td><td>{x.transfers_in_flight}</td>
                <td className="hide-sm">{x.peak_transfers_in_flight}</td><td>{x.since_heartbeat_s === null ? "—" : `${x.since_heartbeat_s.toFixed(1)} s ago`}</td><td className="hide-sm">{x.state ?? ""}</td>
            </tr>)}
            {w.data && w.data.workers.length === 0 ? <tr><td colSpan={8} className="muted">No workers (or your role may not see them).</td></tr> : null}</tbody>
        </table></div>
    </>;
}

createRoot(document.getElementById("root") as HTMLElement).render(<StrictMode><App /></StrictMode>);
