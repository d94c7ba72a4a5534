/*
 * format.ts: what the command line prints for a person (--json prints the
 * API's JSON instead).
 */

type Row = Record<string, unknown>;

/* A value as a cell: text as it is, null as empty, the rest as JSON. */
export function cell(v: unknown): string {
    if (v === null || v === undefined) return "";
    if (v instanceof Date) return localTime(v);
    if (typeof v === "string") return v;
    if (typeof v === "number" || typeof v === "boolean") return String(v);
    return JSON.stringify(v);
}

function localTime(d: Date): string {
    const p = (n: number, w = 2) => String(n).padStart(w, "0");
    return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

const asDate = (v: unknown): Date | null =>
    v instanceof Date ? v : typeof v === "string" && v !== "" ? new Date(v) : null;

/* A duration for a person: 850 ms, 12.3 s, 4 min 10 s, 3 h 5 min, 2 d 4 h. */
export function duration(ms: number): string {
    if (!Number.isFinite(ms)) return "";
    if (ms < 1000) return `${Math.round(ms)} ms`;
    const s = ms / 1000;
    if (s < 60) return `${s.toFixed(1)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} d ${Math.round((s % 86400) / 3600)} h`;
}

/* Columns of rows, aligned; cells cut at 60 characters. */
export function table(rows: Row[], columns: [string, string][]): string {
    const cells = rows.map((r) => columns.map(([key]) => {
        const t = cell(r[key]).replace(/\s+/g, " ");
        return t.length > 60 ? t.slice(0, 59) + "…" : t;
    }));
    const widths = columns.map(([, title], i) => Math.max(title.length, ...cells.map((c) => c[i].length)));
    const line = (c: string[]) => c.map((t, i) => t.padEnd(widths[i])).join("  ").trimEnd();
    const out = [line(columns.map(([, t]) => t)), line(widths.map((w) => "-".repeat(w))), ...cells.map(line)];
    out.push(`(${rows.length} row${rows.length === 1 ? "" : "s"})`);
    return out.join("\n");
}

export function runsTable(runs: Row[]): string {
    const rows = runs.map((r) => {
        const created = asDate(r.created_at);
        const finished = asDate(r.finished_at);
        return {
            ...r,
            took: created && finished ? duration(finished.getTime() - created.getTime()) : "",
        };
    });
    return table(rows, [["id", "id"], ["workflow", "workflow"], ["version", "v"], ["status", "status"], ["step", "step"],
                        ["end", "end"], ["principal", "principal"], ["created_at", "created"], ["took", "took"]]);
}

/* "+1.234s" since the run was created. */
function since(ms: number): string {
    return `+${(ms / 1000).toFixed(3)}s`;
}

export interface TimelineLine {
    at_ms: number;
    seq: number;
    step: string | null;
    event: string;
    summary: string | null;
}

/* One line of a timeline: time since the run's creation, seq, step, event, what it says. */
export function timelineLine(t: TimelineLine): string {
    return `${since(t.at_ms).padStart(10)}  ${String(t.seq).padStart(4)}  ${(t.step ?? "").padEnd(16)} ${t.event.padEnd(20)} ${t.summary ?? ""}`.trimEnd();
}

export function timelineHeader(): string {
    return `${"at".padStart(10)}  ${"seq".padStart(4)}  ${"step".padEnd(16)} ${"event".padEnd(20)} summary`;
}

/* A journal event (the API's Event) as a timeline line, against the run's creation. */
export function eventLine(e: Row, createdAt: Date | null): string {
    const ts = asDate(e.ts);
    return timelineLine({
        at_ms: ts && createdAt ? ts.getTime() - createdAt.getTime() : 0,
        seq: Number(e.seq), step: (e.agent_id as string | null) ?? null, event: String(e.type),
        summary: (e.summary as string | null) ?? null,
    });
}

/* The head of `runs show` and `runs tail`. */
export function runHeader(r: Row): string {
    const created = asDate(r.created_at);
    const finished = asDate(r.finished_at);
    const lines = [
        `run ${r.id}: ${r.workflow} version ${r.version}, ${r.status}${r.end ? ` at end ${r.end}` : ""}` +
            (r.step && !r.end ? `, at step ${r.step}` : ""),
        `  started by ${r.principal}${r.key ? `, key ${r.key}` : ""}${r.parent_run_id ? `, child of run ${r.parent_run_id}` : ""}` +
            `, created ${created ? localTime(created) : "?"}` + (created && finished ? `, took ${duration(finished.getTime() - created.getTime())}` : ""),
    ];
    return lines.join("\n");
}

/* The end of `runs show`: the response or the error, and what it waits for. */
export function runFooter(r: Row): string {
    const out: string[] = [];
    if (r.awaiting) out.push(`waiting for: ${JSON.stringify(r.awaiting)}`);
    if (r.response !== null && r.response !== undefined) out.push(`response: ${JSON.stringify(r.response)}`);
    if (r.error) out.push(`error: ${r.error}`);
    return out.join("\n");
}

/* A form's fields, the required ones first. */
function formFields(form: Row): string {
    const props = Object.keys((form.properties ?? {}) as Row);
    const req = Array.isArray(form.required) ? (form.required as string[]) : [];
    return [...req.filter((n) => props.includes(n)), ...props.filter((n) => !req.includes(n))].join(", ");
}

export function peopleTable(rows: Row[]): string {
    const shown = rows.map((p) => {
        const a = (p.awaiting ?? {}) as Row;
        const what = p.answer_with === "submit"
            ? `form: ${formFields((a.form ?? {}) as Row)}`
            : `approve ${a.tool ?? "?"}(${JSON.stringify(a.arguments ?? {})})`;
        return { ...p, what, age: duration(Number(p.age_s) * 1000) };
    });
    return table(shown, [["run_id", "run"], ["workflow", "workflow"], ["step", "step"], ["principal", "principal"],
                         ["answer_with", "answer"], ["what", "what"], ["age", "waiting"], ["deadline", "deadline"]]);
}

export function tokensTable(rows: Row[]): string {
    return table(rows.map((t) => ({ ...t, scopes: Array.isArray(t.scopes) ? t.scopes.join(",") : t.scopes })),
                 [["id", "id"], ["role", "role"], ["scopes", "scopes"], ["created_at", "created"], ["expires_at", "expires"],
                  ["last_used_at", "last used"], ["revoked_at", "revoked"]]);
}
