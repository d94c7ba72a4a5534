/*
 * form.ts: `people answer`, a prompt built from a Human step's form (its
 * JSON Schema), one question per property.
 *
 * Questions go to stderr and answers come from stdin, line by line, so the
 * prompt works at a terminal and from a pipe (printf 'y\nfine\n' | ...).
 * Booleans take y/n, numbers are checked against their bounds, an enum is
 * chosen by number or value, and anything else (objects, arrays, anyOf) is
 * typed as JSON.  An empty answer leaves an optional property out.  The
 * database checks the whole answer against the form again (tuvl.submit()).
 */
import { createInterface } from "node:readline";

type Schema = Record<string, unknown>;

export class Prompter {
    private readonly lines: AsyncIterator<string>;
    private readonly rl: ReturnType<typeof createInterface>;

    constructor() {
        this.rl = createInterface({ input: process.stdin, terminal: false });
        this.lines = this.rl[Symbol.asyncIterator]();
    }

    async ask(question: string): Promise<string> {
        process.stderr.write(question);
        const next = await this.lines.next();
        if (next.done) throw new Error("no more answers on standard input");
        return next.value.trim();
    }

    close(): void {
        this.rl.close();
    }
}

function typeOf(s: Schema): string | undefined {
    const t = s.type;
    if (typeof t === "string") return t;
    if (Array.isArray(t)) return t.find((x) => x !== "null") as string | undefined;
    return undefined;
}

/* A value for one property, or undefined when left out; throws a message to ask again. */
function parseAnswer(text: string, s: Schema): unknown {
    if (Array.isArray(s.enum)) {
        const n = Number(text);
        if (Number.isInteger(n) && n >= 1 && n <= s.enum.length) return s.enum[n - 1];
        const hit = s.enum.find((v) => (typeof v === "string" ? v : JSON.stringify(v)) === text);
        if (hit === undefined) throw new Error(`choose one of 1 to ${s.enum.length}`);
        return hit;
    }
    switch (typeOf(s)) {
        case "boolean":
            if (/^(y|yes|true|1)$/i.test(text)) return true;
            if (/^(n|no|false|0)$/i.test(text)) return false;
            throw new Error("answer y or n");
        case "integer":
        case "number": {
            const n = Number(text);
            if (text === "" || !Number.isFinite(n) || (typeOf(s) === "integer" && !Number.isInteger(n)))
                throw new Error(`type ${typeOf(s) === "integer" ? "an integer" : "a number"}`);
            if (typeof s.minimum === "number" && n < s.minimum) throw new Error(`at least ${s.minimum}`);
            if (typeof s.maximum === "number" && n > s.maximum) throw new Error(`at most ${s.maximum}`);
            return n;
        }
        case "string":
            if (typeof s.maxLength === "number" && [...text].length > s.maxLength) throw new Error(`at most ${s.maxLength} characters`);
            if (typeof s.minLength === "number" && [...text].length < s.minLength) throw new Error(`at least ${s.minLength} characters`);
            return text;
        default:
            try {
                return JSON.parse(text);
            } catch {
                throw new Error("type JSON");
            }
    }
}

function hintOf(s: Schema): string {
    if (Array.isArray(s.enum)) return s.enum.map((v, i) => `${i + 1}) ${typeof v === "string" ? v : JSON.stringify(v)}`).join("  ");
    switch (typeOf(s)) {
        case "boolean": return "y/n";
        case "integer": return "integer";
        case "number": return "number";
        case "string": return typeof s.maxLength === "number" ? `text, at most ${s.maxLength} characters` : "text";
        default: return "JSON";
    }
}

/* Ask for every property of an object schema; the answers as an object. */
export async function fillForm(p: Prompter, form: Schema): Promise<Record<string, unknown>> {
    const props = (form.properties ?? {}) as Record<string, Schema>;
    const required = new Set(Array.isArray(form.required) ? (form.required as string[]) : []);
    const out: Record<string, unknown> = {};
    if (Object.keys(props).length === 0) {
        const text = await p.ask("the data, as a JSON object: ");
        return parseAnswer(text, {}) as Record<string, unknown>;
    }
    /* the required properties first, in the order of "required" (a stored form's keys are sorted) */
    const names = [...[...required].filter((n) => n in props), ...Object.keys(props).filter((n) => !required.has(n))];
    for (const name of names) {
        const s = props[name];
        const desc = typeof s.description === "string" ? ` (${s.description})` : "";
        for (;;) {
            const text = await p.ask(`${name}${desc} [${hintOf(s)}]${required.has(name) ? "" : " (optional)"}: `);
            if (text === "" && !required.has(name)) break;
            if (text === "" && typeOf(s) !== "string") {
                process.stderr.write(`  ${name} is required\n`);
                continue;
            }
            try {
                out[name] = parseAnswer(text, s);
                break;
            } catch (e) {
                process.stderr.write(`  ${(e as Error).message}\n`);
            }
        }
    }
    return out;
}
