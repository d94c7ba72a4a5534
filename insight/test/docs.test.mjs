// docs.test.mjs: the examples of docs/insight.md, and the README's curl, run
// as written against the test server.
//
// Every ```sh and ```sql block of docs/insight.md runs, in the order of the
// file, unless the line before it is `<!-- not run -->`; of the README, the
// ```sh blocks that call the server.  The server's address in the docs,
// http://127.0.0.1:8080, is the test server's; sh blocks run with bash
// (errexit, pipefail) in a scratch directory where `insight/tuvl` is this
// checkout's, connected as the cluster's superuser to the test database;
// the variables a block sets are there for the next ones.  sql blocks run
// with psql as that superuser.  A block must succeed; when a ```json block
// follows it, the last JSON value it printed must have the same keys.
// Every path of the API must have an example.
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { appendFileSync, mkdtempSync, readFileSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { DB, INSIGHT, ROOT, TMP, URL_ } from "./helpers.mjs";

const DOC_URL = "http://127.0.0.1:8080";

/* The fenced blocks of a Markdown file: language, text, line, whether marked not run, and the block after it. */
function fenced(file) {
    const lines = readFileSync(join(ROOT, file), "utf8").split("\n");
    const out = [];
    for (let i = 0; i < lines.length; i++) {
        const m = /^```(\w*)\s*$/.exec(lines[i]);
        if (!m) continue;
        const start = i;
        const body = [];
        for (i++; i < lines.length && !/^```\s*$/.test(lines[i]); i++) body.push(lines[i]);
        let prev = start - 1;
        while (prev >= 0 && lines[prev].trim() === "") prev--;
        out.push({ file, lang: m[1], text: body.join("\n") + "\n", line: start + 1, end: i,
                   notRun: prev >= 0 && lines[prev].trim() === "<!-- not run -->" });
    }
    /* a json block right after a block (only blank lines between) is its expected output */
    for (let k = 0; k + 1 < out.length; k++) {
        const between = lines.slice(out[k].end + 1, out[k + 1].line - 1);
        if (out[k + 1].lang === "json" && between.every((l) => l.trim() === "")) out[k].expect = out[k + 1];
    }
    return out;
}

/* The top-level JSON values of a text, in order (curl prints them back to back). */
function jsonValues(text) {
    const values = [];
    let i = 0;
    while (i < text.length) {
        const c = text[i];
        if (c !== "{" && c !== "[") {
            i++;
            continue;
        }
        let depth = 0;
        let inString = false;
        let j = i;
        for (; j < text.length; j++) {
            const d = text[j];
            if (inString) {
                if (d === "\\") j++;
                else if (d === '"') inString = false;
            } else if (d === '"') inString = true;
            else if (d === "{" || d === "[") depth++;
            else if (d === "}" || d === "]") {
                depth--;
                if (depth === 0) break;
            }
        }
        try {
            values.push(JSON.parse(text.slice(i, j + 1)));
            i = j + 1;
        } catch {
            i++;
        }
    }
    return values;
}

/* The keys of an expected JSON block, which may elide values with "...". */
function expectedKeys(block) {
    const v = JSON.parse(block.text.replace(/^\s*\.\.\.\s*\n/gm, ""));
    return Object.keys(v).sort();
}

const dir = mkdtempSync(join(TMP, "docs-"));
symlinkSync(INSIGHT, join(dir, "insight"));
const STATE = join(dir, ".doc-state");
writeFileSync(STATE, "");

function runBlock(b) {
    const text = b.text.replaceAll(DOC_URL, URL_);
    const env = { ...process.env, PGDATABASE: DB };
    if (b.lang === "sql")
        return spawnSync("psql", ["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", DB], { input: text, encoding: "utf8", env, cwd: dir });
    /* the variables the block sets, kept for the next blocks */
    const names = [...new Set([...text.matchAll(/^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=/gm)].map((m) => m[1]))];
    const script = `set -eo pipefail
set -a
. ${STATE}
set +a
${text}
${names.length ? `declare -p ${names.join(" ")} >> ${STATE}` : ""}
`;
    return spawnSync("bash", ["-c", script], { encoding: "utf8", env, cwd: dir, timeout: 60_000 });
}

const blocks = [
    ...fenced("docs/insight.md").filter((b) => (b.lang === "sh" || b.lang === "sql") && !b.notRun),
    ...fenced("README.md").filter((b) => b.lang === "sh" && b.text.includes(DOC_URL)),
];

test("docs: every example of docs/insight.md and the README's curl run as written", () => {
    assert.ok(blocks.length >= 20, `only ${blocks.length} examples found`);
    for (const b of blocks) {
        const where = `${b.file}:${b.line}`;
        const r = runBlock(b);
        /* INSIGHT_DOCS_TRACE=FILE: what each example printed, to keep the doc's outputs true */
        if (process.env.INSIGHT_DOCS_TRACE)
            appendFileSync(process.env.INSIGHT_DOCS_TRACE, `--- ${where} (${r.status})\n${r.stdout}\n${r.stderr}\n`);
        assert.equal(r.status, 0, `${where} failed (${r.status}):\n${b.text}\nstdout: ${r.stdout}\nstderr: ${r.stderr}`);
        if (b.expect) {
            const got = jsonValues(r.stdout);
            assert.ok(got.length > 0, `${where} printed no JSON:\n${r.stdout}`);
            const last = got[got.length - 1];
            assert.deepEqual(Object.keys(last).sort(), expectedKeys(b.expect),
                             `${where}: the keys of its output differ from the doc's (${b.file}:${b.expect.line}):\n${r.stdout}`);
        }
    }
});

test("docs: every path of the API has a curl example in docs/insight.md", () => {
    const src = readFileSync(join(INSIGHT, "src/openapi.ts"), "utf8");
    const paths = [...src.matchAll(/^ {8}"(\/api\/[^"]+)":/gm)].map((m) => m[1]);
    assert.ok(paths.length >= 15, `paths found: ${paths}`);
    const examples = blocks.filter((b) => b.file === "docs/insight.md").map((b) => b.text).join("\n");
    for (const p of [...paths, "/api/openapi.json", "/api/workflows/{name}/runs", "/hooks/", "/health"]) {
        const re = new RegExp(DOC_URL.replace(/[.]/g, "\\.") + p.replace(/\{[a-z]+\}/g, "[^/ ?'\"]+").replace(/[.]/g, "\\."));
        assert.match(examples, re, `no example calls ${p}`);
    }
});
