/*
 * conversation.tsx: an agent's conversation as a person reads it, from
 * the journal: the model's answers (text and tool calls), the tools'
 * arguments and results, approvals, steering, guardrail and judge
 * verdicts.  Whatever the provider's format (OpenAI, Anthropic), the
 * text and the tool calls are taken from where each puts them.
 */
import type { ReactNode } from "react";

export interface Ev { seq: number; ts: string; type: string; step?: string | null; agent_id?: string | null; tokens?: number | null;
    latency_ms?: number | null; payload: any; summary?: string | null; run_id?: number; }

function textOf(body: any): string | null {
    if (!body || typeof body !== "object") return typeof body === "string" ? body : null;
    const m = body.choices?.[0]?.message;
    if (m) return typeof m.content === "string" ? m.content : Array.isArray(m.content) ? m.content.map((c: any) => c.text ?? "").join("") : null;
    if (Array.isArray(body.content)) return body.content.filter((c: any) => c.type === "text").map((c: any) => c.text).join("\n") || null;
    if (Array.isArray(body.output)) return body.output.flatMap((o: any) => (o.content ?? []).map((c: any) => c.text ?? "")).join("") || null;
    return typeof body.text === "string" ? body.text : typeof body.content === "string" ? body.content : null;
}

function callsOf(body: any): { name: string; args: unknown }[] {
    if (!body || typeof body !== "object") return [];
    const m = body.choices?.[0]?.message;
    if (m?.tool_calls) return m.tool_calls.map((c: any) => {
        let args: unknown = c.function?.arguments;
        try { if (typeof args === "string") args = JSON.parse(args); } catch { /* as sent */ }
        return { name: c.function?.name ?? c.name, args };
    });
    if (Array.isArray(body.content)) return body.content.filter((c: any) => c.type === "tool_use").map((c: any) => ({ name: c.name, args: c.input }));
    return [];
}

const short = (v: unknown) => <pre>{typeof v === "string" ? v : JSON.stringify(v, null, 2)}</pre>;

export function isAgentEvent(e: Ev): boolean {
    return ["llm_turn", "tool_call", "tool_result", "approval_requested", "approval_decided", "decision", "judge_verdict",
            "guardrail", "guardrail_verdict", "steered", "agent_started", "agent_completed"].includes(e.type);
}

export function Conversation({ events, agentSteps }: { events: Ev[]; agentSteps: Set<string> }): ReactNode {
    const items: ReactNode[] = [];
    /* the calls of the last model turn, shown with it: their tool_call events add nothing (a long agent: a third fewer items) */
    let called: string[] = [];
    for (const e of events) {
        if (e.step && !agentSteps.has(e.step)) continue;
        const p = e.payload ?? {};
        const k = `${e.seq}`;
        switch (e.type) {
            case "agent_started":
                items.push(<div key={k} className="msg user"><div className="who">task · {e.step}</div>
                    {p.prompt || p.task || p.instructions ? short(p.prompt ?? p.task ?? p.instructions) : <span className="muted">the agent starts</span>}</div>);
                break;
            case "llm_turn": {
                const body = p.response ?? p.body ?? p.answer;
                const text = textOf(body);
                const calls = callsOf(body);
                called = calls.map((c) => c.name + "\u0000" + JSON.stringify(c.args ?? {}));
                items.push(<div key={k} className="msg assistant" data-event="llm_turn">
                    <div className="who">model {p.model ?? ""} · {e.tokens ?? 0} tokens · {Math.round(e.latency_ms ?? 0)} ms</div>
                    {text ? <div style={{ whiteSpace: "pre-wrap" }}>{text}</div> : null}
                    {calls.map((c, i) => <div key={i} className="toolcall" data-tool={c.name}>calls <strong>{c.name}</strong>{short(c.args)}</div>)}
                    {!text && calls.length === 0 ? <span className="muted">{p.error ? `error: ${p.error}` : e.summary}</span> : null}
                </div>);
                break;
            }
            case "tool_call": {
                if (!p.tool) break;
                const args = p.arguments ?? p.request?.arguments ?? p.request ?? {};
                const i = called.indexOf(p.tool + "\u0000" + JSON.stringify(args));
                if (i >= 0) {
                    called.splice(i, 1);
                    break;
                }
                items.push(<div key={k} className="msg tool" data-event="tool_call" data-tool={p.tool}><div className="who">tool call · {p.tool}</div>
                    {short(args)}</div>);
                break;
            }
            case "tool_result":
                items.push(<div key={k} className="msg tool" data-event="tool_result"><div className="who">result{p.tool ? ` · ${p.tool}` : ""} · {Math.round(e.latency_ms ?? 0)} ms</div>
                    {short(p.result ?? p.output ?? p)}</div>);
                break;
            case "approval_requested":
                items.push(<div key={k} className="msg steer"><div className="who">approval requested · {p.tool}</div>{short(p.arguments)}</div>);
                break;
            case "approval_decided":
                items.push(<div key={k} className={`msg verdict ${p.approved ? "" : "bad"}`}><div className="who">{p.approved ? "approved" : "rejected"} by {p.by}</div>
                    {p.note ? <div>{p.note}</div> : null}</div>);
                break;
            case "decision":
            case "steered":
                items.push(<div key={k} className="msg steer"><div className="who">{p.kind ?? "steering"} · {p.by}</div><div>{p.message ?? e.summary}</div></div>);
                break;
            case "judge_verdict":
            case "guardrail":
            case "guardrail_verdict":
                items.push(<div key={k} className={`msg verdict ${p.verdict === "pass" || p.action === "allow" ? "" : "bad"}`}>
                    <div className="who">{p.source ?? e.type.replace("_", " ")} {p.rule ?? ""}</div><div>{e.summary}</div></div>);
                break;
            case "agent_completed":
                items.push(<div key={k} className="msg"><div className="who">step done · {e.step}</div><div>{e.summary}</div></div>);
                break;
        }
    }
    if (items.length === 0) return <p className="muted">No agent conversation in this run.</p>;
    return <div className="conv">{items}</div>;
}
