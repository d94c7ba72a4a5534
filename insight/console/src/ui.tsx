/* ui.tsx: small pieces every page uses. */
import { useEffect, useRef, useState } from "react";
import type { ReactNode } from "react";
import { ApiFailure } from "./api";

export function navigate(to: string): void {
    history.pushState(null, "", to);
    window.dispatchEvent(new PopStateEvent("popstate"));
}

export function Link({ to, children, className }: { to: string; children: ReactNode; className?: string }) {
    return <a href={to} className={className} onClick={(e) => {
        if (e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;
        e.preventDefault();
        navigate(to);
    }}>{children}</a>;
}

export function Badge({ status }: { status: string | null | undefined }) {
    return <span className={`badge s-${status ?? "none"}`} data-status={status ?? ""}>{(status ?? "?").replace(/_/g, " ")}</span>;
}

export function ErrorBox({ error }: { error: unknown }) {
    if (!error) return null;
    const e = error as ApiFailure;
    return <div className="error" role="alert">
        <strong>{e.message ?? String(error)}</strong>
        {e.sqlstate ? <span className="muted"> ({e.sqlstate})</span> : null}
        {e.detail ? <div>{e.detail}</div> : null}
        {e.hint ? <div className="muted">{e.hint}</div> : null}
    </div>;
}

export function Json({ value }: { value: unknown }) {
    if (value === undefined) return <span className="muted">—</span>;
    return <pre>{typeof value === "string" ? value : JSON.stringify(value, null, 2)}</pre>;
}

export function time(t: string | null | undefined): string {
    if (!t) return "—";
    const d = new Date(t);
    return d.toLocaleString(undefined, { year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

export function duration(ms: number | null | undefined): string {
    if (ms === null || ms === undefined || Number.isNaN(ms)) return "—";
    if (ms < 1000) return `${Math.round(ms)} ms`;
    if (ms < 60_000) return `${(ms / 1000).toFixed(ms < 10_000 ? 2 : 1)} s`;
    const m = Math.floor(ms / 60_000);
    return `${m} min ${Math.round((ms % 60_000) / 1000)} s`;
}

/* A confirmation: a modal <dialog>, Escape cancels, the confirm button has the focus. */
export interface ConfirmRequest {
    title: string;
    body?: ReactNode;
    confirm: string;
    danger?: boolean;
    withText?: string;          /* a text field (a reason, a message) */
    requireText?: boolean;
    run: (text: string) => Promise<void>;
}

let openConfirm: (r: ConfirmRequest) => void = () => undefined;
export function confirmAction(r: ConfirmRequest): void { openConfirm(r); }

export function ConfirmHost() {
    const [req, setReq] = useState<ConfirmRequest | null>(null);
    const [text, setText] = useState("");
    const [error, setError] = useState<unknown>(null);
    const [busy, setBusy] = useState(false);
    const ref = useRef<HTMLDialogElement>(null);
    openConfirm = (r) => { setReq(r); setText(""); setError(null); };
    useEffect(() => {
        const d = ref.current;
        if (!d) return;
        if (req && !d.open) d.showModal();
        if (!req && d.open) d.close();
    }, [req]);
    const go = async () => {
        if (!req) return;
        setBusy(true);
        try {
            await req.run(text);
            setReq(null);
        } catch (e) {
            setError(e);
        } finally {
            setBusy(false);
        }
    };
    return <dialog ref={ref} onClose={() => setReq(null)} aria-labelledby="confirm-title">
        {req ? <form method="dialog" onSubmit={(e) => { e.preventDefault(); void go(); }}>
            <h2 id="confirm-title">{req.title}</h2>
            {req.body}
            {req.withText !== undefined ? <label style={{ display: "flex" }}>{req.withText}
                <textarea name="confirm-text" value={text} onChange={(e) => setText(e.target.value)} autoFocus /></label> : null}
            <ErrorBox error={error} />
            <div className="actions">
                <button type="submit" className={req.danger ? "danger" : "primary"} autoFocus={req.withText === undefined}
                        disabled={busy || (req.requireText === true && text.trim() === "")}>{req.confirm}</button>
                <button type="button" onClick={() => setReq(null)}>Cancel</button>
            </div>
        </form> : null}
    </dialog>;
}

/* Data that loads, and loads again on demand or every `every` ms. */
export function useLoad<T>(load: () => Promise<T>, deps: unknown[], every = 0): { data: T | null; error: unknown; reload: () => void } {
    const [data, setData] = useState<T | null>(null);
    const [error, setError] = useState<unknown>(null);
    const [n, setN] = useState(0);
    useEffect(() => {
        let live = true;
        let timer: number | undefined;
        const tick = async () => {
            try {
                const d = await load();
                if (live) { setData(d); setError(null); }
            } catch (e) {
                if (live) setError(e);
            }
            if (live && every > 0) timer = window.setTimeout(tick, document.hidden ? every * 4 : every);
        };
        void tick();
        return () => { live = false; if (timer) clearTimeout(timer); };
        // eslint-disable-next-line react-hooks/exhaustive-deps
    }, [...deps, n]);
    return { data, error, reload: () => setN((x) => x + 1) };
}

export function download(name: string, value: unknown): void {
    const blob = new Blob([JSON.stringify(value, null, 2) + "\n"], { type: "application/json" });
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.appendChild(a);
    a.click();
    setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
}
