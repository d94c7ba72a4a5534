/* api.ts: the console's calls to insight's API, as the signed-in person (the session cookie). */
export class ApiFailure extends Error {
    constructor(public status: number, message: string, public sqlstate: string | null,
                public detail: string | null, public hint: string | null) {
        super(message);
    }
}

let csrf = "";
export function setCsrf(token: string): void { csrf = token; }
let onSignedOut: () => void = () => undefined;
export function whenSignedOut(fn: () => void): void { onSignedOut = fn; }

export async function api<T = any>(method: string, path: string, body?: unknown): Promise<T> {
    const headers: Record<string, string> = { Accept: "application/json" };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (method !== "GET") headers["X-CSRF-Token"] = csrf;
    let res: Response;
    try {
        res = await fetch(path, { method, headers, credentials: "same-origin", body: body === undefined ? undefined : JSON.stringify(body) });
    } catch (e) {
        throw new ApiFailure(0, `the server could not be reached (${(e as Error).message})`, null, null, null);
    }
    const text = await res.text();
    let data: any = null;
    try { data = text ? JSON.parse(text) : null; } catch { /* not JSON */ }
    if (!res.ok) {
        if (res.status === 401 && !path.startsWith("/api/console/session")) onSignedOut();
        throw new ApiFailure(res.status, data?.message ?? `HTTP ${res.status}`, data?.sqlstate ?? null, data?.detail ?? null, data?.hint ?? null);
    }
    return data as T;
}

export const get = <T = any>(path: string) => api<T>("GET", path);
export const post = <T = any>(path: string, body: unknown = {}) => api<T>("POST", path, body);

export function qs(params: Record<string, string | number | undefined | null>): string {
    const p = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") p.set(k, String(v));
    const s = p.toString();
    return s ? `?${s}` : "";
}

/*
 * Reads a page starts with, asked for as soon as the script runs (main.tsx
 * imports this module first), while the session is checked: a run's page
 * has its run and journal by the time it mounts.  take() hands a
 * prefetched read to its page once; later reads go to the server.
 */
const early = new Map<string, Promise<any>>();
export function prefetch(path: string): void {
    const p = get(path);
    p.catch(() => undefined);
    early.set(path, p);
}
export function take<T = any>(path: string): Promise<T> {
    const p = early.get(path);
    if (p) {
        early.delete(path);
        /* asked before the sign-in, say: once more now */
        return p.catch(() => get<T>(path));
    }
    return get<T>(path);
}
