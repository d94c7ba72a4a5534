/*
 * graph.tsx: a workflow's graph as tuvl.graph(workflow, 'dot') gives it,
 * drawn as SVG: layers by distance from the first step, the run's current
 * step marked, the steps it went through shaded, breakpoints dashed red.
 */
import type { ReactNode } from "react";

interface GNode { key: string; id: string; sub: string; end: boolean; }
interface GEdge { from: string; to: string; label: string; dashed: boolean; }

function unescapeDot(t: string): string {
    return t.replace(/\\"/g, '"').replace(/&#92;/g, "\\").replace(/&amp;/g, "&");
}

export function parseDot(dot: string): { nodes: GNode[]; edges: GEdge[] } {
    const nodes: GNode[] = [];
    const edges: GEdge[] = [];
    for (const line of dot.split("\n")) {
        let m = /^\s*"([^"]+)" -> "([^"]+)" \[(style=dashed, )?label="((?:[^"\\]|\\.)*)"\];$/.exec(line);
        if (m) { edges.push({ from: m[1], to: m[2], dashed: !!m[3], label: unescapeDot(m[4]) }); continue; }
        m = /^\s*"([^"]+)" \[shape=(box|oval), label="((?:[^"\\]|\\.)*)"\];$/.exec(line);
        if (m) {
            const [id, sub] = m[3].split("\\n");
            nodes.push({ key: m[1], id: unescapeDot(id), sub: unescapeDot(sub ?? ""), end: m[2] === "oval" });
        }
    }
    return { nodes, edges };
}

const W = 150, H = 42, GX = 26, GY = 64, PAD = 16;

export function Graph({ dot, current, visited, breakpoints, onNode, label }: {
    dot: string; current?: string | null; visited?: Set<string>; breakpoints?: string[];
    onNode?: (stepId: string) => void; label: string;
}): ReactNode {
    const { nodes, edges } = parseDot(dot);
    if (nodes.length === 0) return <p className="muted">No graph.</p>;
    const layer = new Map<string, number>();
    const first = nodes.find((n) => !n.end)?.key ?? nodes[0].key;
    layer.set(first, 0);
    const queue = [first];
    while (queue.length) {
        const k = queue.shift() as string;
        for (const e of edges) if (e.from === k && !e.dashed && !layer.has(e.to)) { layer.set(e.to, (layer.get(k) ?? 0) + 1); queue.push(e.to); }
    }
    let maxLayer = Math.max(0, ...layer.values());
    for (const n of nodes) if (!layer.has(n.key)) layer.set(n.key, n.end ? maxLayer + 1 : ++maxLayer);
    const rows = new Map<number, GNode[]>();
    for (const n of nodes) {
        const l = layer.get(n.key) as number;
        if (!rows.has(l)) rows.set(l, []);
        (rows.get(l) as GNode[]).push(n);
    }
    const widest = Math.max(...[...rows.values()].map((r) => r.length));
    const width = PAD * 2 + widest * W + (widest - 1) * GX;
    const pos = new Map<string, { x: number; y: number }>();
    const layers = [...rows.keys()].sort((a, b) => a - b);
    layers.forEach((l, i) => {
        const r = rows.get(l) as GNode[];
        const rowW = r.length * W + (r.length - 1) * GX;
        r.forEach((n, j) => pos.set(n.key, { x: (width - rowW) / 2 + j * (W + GX), y: PAD + i * (H + GY) }));
    });
    const height = PAD * 2 + layers.length * H + (layers.length - 1) * GY;
    const bps = new Set(breakpoints ?? []);
    return <div className="graph">
        <svg viewBox={`0 0 ${width} ${height}`} width={width} height={height} role="img" aria-label={label}>
            <defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">
                <path d="M0,0 L10,5 L0,10 z" fill="#8592a6" /></marker></defs>
            {edges.map((e, i) => {
                const a = pos.get(e.from), b = pos.get(e.to);
                if (!a || !b) return null;
                const x1 = a.x + W / 2, y1 = a.y + H, x2 = b.x + W / 2;
                let d: string, lx: number, ly: number;
                if (b.y > a.y) {
                    const y2 = b.y;
                    d = `M${x1},${y1} C${x1},${y1 + GY / 2} ${x2},${y2 - GY / 2} ${x2},${y2}`;
                    lx = (x1 + x2) / 2; ly = (y1 + y2) / 2;
                } else {
                    /* back or sideways: round the right side */
                    const xr = Math.max(a.x, b.x) + W + 14, yb = b.y + H / 2, ya = a.y + H / 2;
                    d = `M${a.x + W},${ya} C${xr},${ya} ${xr},${yb} ${b.x + W},${yb}`;
                    lx = xr; ly = (ya + yb) / 2;
                }
                return <g key={i}>
                    <path className="edge" d={d} markerEnd="url(#arrow)" strokeDasharray={e.dashed ? "4 3" : undefined} />
                    {e.label && e.label !== "default" ? <text className="edge-label" x={lx + 4} y={ly}>{e.label}</text> : null}
                </g>;
            })}
            {nodes.map((n) => {
                const p = pos.get(n.key) as { x: number; y: number };
                const cls = ["node", n.end ? "end" : "", !n.end && current === n.id ? "current" : "",
                             visited?.has(n.id) && current !== n.id ? "done" : "", !n.end && bps.has(n.id) ? "bp" : ""].join(" ");
                const clickable = onNode && !n.end;
                return <g key={n.key} className={cls} data-step={n.end ? undefined : n.id}
                          transform={`translate(${p.x},${p.y})`}
                          tabIndex={clickable ? 0 : undefined} role={clickable ? "button" : undefined}
                          aria-label={clickable ? `step ${n.id}${bps.has(n.id) ? ", breakpoint set" : ""}` : undefined}
                          onClick={clickable ? () => onNode(n.id) : undefined}
                          onKeyDown={clickable ? (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); onNode(n.id); } } : undefined}
                          style={clickable ? { cursor: "pointer" } : undefined}>
                    <rect width={W} height={H} rx={n.end ? 20 : 6} />
                    <text x={W / 2} y={17} textAnchor="middle" fontWeight={600}>{n.id.length > 20 ? n.id.slice(0, 19) + "…" : n.id}</text>
                    <text x={W / 2} y={33} textAnchor="middle" fill="#5b6577">{!n.end && bps.has(n.id) ? "● " : ""}{n.sub}</text>
                </g>;
            })}
        </svg>
    </div>;
}
