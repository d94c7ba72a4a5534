/*
 * openapi.ts: GET /api/openapi.json, an OpenAPI 3.1 document of the API,
 * generated from the registered workflows.
 *
 * Each workflow (its newest version) gets its own path,
 * /api/workflows/<name>/runs, whose request body's "input" is the
 * workflow's trigger.input (components/schemas/input.<name>), and a
 * workflow with trigger.http gets its route under /hooks, whose body is
 * the input itself.  tuvl's schemas are JSON Schema; their "$ref"s to
 * "#/$defs/..." are rewritten to point into the component, since in an
 * OpenAPI document "#" is the document.
 */
import type { WorkflowInfo } from "./ops.js";
import { STATUSES } from "./ops.js";

type Json = Record<string, unknown>;

const ref = (name: string) => ({ $ref: `#/components/schemas/${name}` });
const nullable = (type: string, extra: Json = {}) => ({ type: [type, "null"], ...extra });
const errorResponse = (description: string) => ({ description, content: { "application/json": { schema: ref("Error") } } });
const json = (description: string, schema: Json) => ({ description, content: { "application/json": { schema } } });

/* A copy of a tuvl input schema whose local $refs point into components/schemas/<name>. */
function rebase(schema: unknown, base: string): unknown {
    if (Array.isArray(schema)) return schema.map((s) => rebase(s, base));
    if (schema === null || typeof schema !== "object") return schema;
    const out: Json = {};
    for (const [k, v] of Object.entries(schema as Json)) {
        if (k === "$ref" && typeof v === "string" && v.startsWith("#/")) out[k] = base + v.slice(1);
        else if (k === "properties" || k === "$defs" || k === "definitions") {
            const props: Json = {};
            for (const [p, s] of Object.entries((v ?? {}) as Json)) props[p] = rebase(s, base);
            out[k] = props;
        } else out[k] = rebase(v, base);
    }
    return out;
}

const runId = { name: "id", in: "path", required: true, description: "the run's id", schema: { type: "integer", minimum: 1 } };

const COMMON_ERRORS = {
    "401": errorResponse("no token, or a token that is not valid (malformed, unknown, revoked or expired)"),
    "403": errorResponse("the token lacks the scope, or its role the privilege (SQLSTATE 42501)"),
};

function schemas(): Json {
    const ts = { type: "string", format: "date-time" };
    const runSummary = {
        type: "object",
        properties: {
            id: { type: "integer" }, workflow: { type: "string" }, version: { type: "integer" },
            status: { type: "string", enum: STATUSES }, step: nullable("string"), end: nullable("string"),
            key: nullable("string"), priority: { type: "integer" }, principal: { type: "string" },
            parent_run_id: nullable("integer"), created_at: ts, started_at: nullable("string", { format: "date-time" }),
            finished_at: nullable("string", { format: "date-time" }),
        },
    };
    return {
        Error: {
            type: "object", required: ["sqlstate", "message", "detail", "hint"],
            properties: {
                sqlstate: nullable("string", { description: "the SQLSTATE PostgreSQL raised, or the nearest for an error of the server" }),
                message: { type: "string" }, detail: nullable("string"), hint: nullable("string"),
            },
        },
        Started: {
            type: "object", required: ["run_id", "status", "status_url", "events_url"],
            properties: {
                run_id: { type: "integer" }, status: { type: "string", enum: STATUSES },
                status_url: { type: "string" }, events_url: { type: "string" },
            },
        },
        Ended: {
            type: "object", required: ["run_id", "status", "end", "response"],
            properties: {
                run_id: { type: "integer" }, status: { type: "string", enum: ["completed", "failed", "aborted", "compensated"] },
                end: nullable("string"), response: {}, error: { type: "string" },
                status_url: { type: "string" }, events_url: { type: "string" },
            },
        },
        RunSummary: runSummary,
        Run: {
            allOf: [ref("RunSummary"), {
                type: "object",
                properties: {
                    input: { type: "object" }, context: { type: "object" }, awaiting: {}, response: {},
                    error: nullable("string"), attempt: { type: "integer" }, wake_at: nullable("string", { format: "date-time" }),
                    control: {}, last_seq: { type: "integer" }, events_url: { type: "string" },
                },
            }],
        },
        RunList: {
            type: "object", required: ["runs", "next"],
            properties: { runs: { type: "array", items: ref("RunSummary") }, next: nullable("string") },
        },
        Event: {
            type: "object",
            description: "one journal event, the data of a Server-Sent Event (id: seq, event: type)",
            properties: {
                run_id: { type: "integer" }, seq: { type: "integer" }, ts, type: { type: "string" },
                agent_id: nullable("string"), engine: nullable("string"), tokens: nullable("integer"),
                latency_ms: nullable("number"), payload: {}, summary: nullable("string"),
            },
        },
        TimelineRow: {
            type: "object",
            properties: { at_ms: { type: "number" }, seq: { type: "integer" }, step: nullable("string"), event: { type: "string" }, summary: nullable("string") },
        },
        Person: {
            type: "object",
            properties: {
                run_id: { type: "integer" }, workflow: { type: "string" }, status: { type: "string" }, step: nullable("string"),
                principal: { type: "string" }, answer_with: { type: "string", enum: ["submit", "decide"] }, awaiting: {},
                since: nullable("string", { format: "date-time" }), age_s: nullable("number"),
                deadline: nullable("string", { format: "date-time" }),
            },
        },
        ControlResult: {
            type: "object", required: ["run_id", "status", "notices"],
            properties: { run_id: { type: "integer" }, status: nullable("string"), notices: { type: "array", items: { type: "string" } } },
        },
        Finding: {
            type: "object",
            properties: { severity: { type: "string", enum: ["error", "warning"] }, path: { type: "string" }, message: { type: "string" } },
        },
        Token: {
            type: "object",
            properties: {
                id: { type: "integer" }, role: { type: "string" }, scopes: { type: "array", items: { type: "string" } },
                created_at: ts, expires_at: nullable("string", { format: "date-time" }),
                last_used_at: nullable("string", { format: "date-time" }), revoked_at: nullable("string", { format: "date-time" }),
            },
        },
    };
}

const control = (action: string, summary: string, scope: string, body?: Json) => ({
    post: {
        operationId: `${action}Run`, summary, tags: ["runs"],
        description: `Needs scope ${scope}.`,
        parameters: [runId],
        ...(body ? { requestBody: { required: action !== "abort" && action !== "reject", content: { "application/json": { schema: body } } } } : {}),
        responses: {
            "200": json("done; status is the run's status afterwards, if the token may read it", ref("ControlResult")),
            "400": errorResponse("a malformed body"), ...COMMON_ERRORS,
            "404": errorResponse("no such run, or one the caller may not see"),
            "409": errorResponse("the run's status does not allow it (SQLSTATE 55000)"),
            ...(action === "submit" ? { "422": errorResponse("data that does not match the step's form") } : {}),
        },
    },
});

function startResponses(): Json {
    return {
        "200": json("the run ended within the wait", ref("Ended")),
        "202": json("the run was queued (or is still running, or waits for someone)", ref("Started")),
        "400": errorResponse("a malformed body or parameter"), ...COMMON_ERRORS,
        "404": errorResponse("no such workflow"),
        "413": errorResponse("a body larger than the server takes, or an input larger than tuvl.max_input_size"),
        "422": errorResponse("an input that does not match the workflow's trigger.input"),
    };
}

const waitParam = {
    name: "wait", in: "query", required: false,
    description: "how long to execute the run here before answering 202 (an interval: 30s, 500ms, 2 minutes); 0: answer 202 at once. Default: the workflow's trigger.http.sync_timeout or trigger.sync_timeout, else 0",
    schema: { type: "string" },
};

function workflowPaths(w: WorkflowInfo, paths: Json, comps: Json, schemes: Json): void {
    const inputName = `input.${w.name}`;
    const input = (w.trigger?.input ?? { type: "object" }) as Json;
    comps[inputName] = rebase(input, `#/components/schemas/${inputName}`);
    comps[`start.${w.name}`] = {
        type: "object", additionalProperties: false,
        properties: {
            input: ref(inputName),
            key: { type: "string", minLength: 1, description: "a second start with the same key, by the same role, returns the first run" },
            not_before: { type: "string", format: "date-time", description: "not claimed before then" },
            priority: { type: "integer", description: "among the role's queued runs, higher first" },
            debounce: {
                type: "string", minLength: 1,
                description: "an interval such as \"5 s\", with key: starts of the key coalesce into one run that starts once the key has been quiet that long, with the latest start's input (latest wins); every coalesced start answers that run's id",
            },
        },
    };
    paths[`/api/workflows/${w.name}/runs`] = {
        post: {
            operationId: `start_${w.name}`, tags: ["workflows"],
            summary: `start a run of ${w.name} (version ${w.version})`,
            description: `${w.description ?? ""}\n\nNeeds scope runs:start.`.trim(),
            parameters: [waitParam, { name: "traceparent", in: "header", required: false, schema: { type: "string" } }],
            requestBody: { required: false, content: { "application/json": { schema: ref(`start.${w.name}`) } } },
            responses: startResponses(),
        },
    };
    const http = w.trigger?.http as Json | undefined;
    if (!http || typeof http.path !== "string") return;
    const method = String(http.method ?? "POST").toLowerCase();
    const sig = http.signature as Json | undefined;
    const security: Json[] = [{ bearer: [] }];
    if (sig) {
        const header = String(sig.header ?? "X-Signature");
        const scheme = `signature.${header}`;
        schemes[scheme] = {
            type: "apiKey", in: "header", name: header,
            description: "the HMAC-SHA256 of the request body under the workflow's secret, as hex or sha256=<hex>",
        };
        security.push({ [scheme]: [] });
    }
    paths[`/hooks${http.path}`] = {
        [method]: {
            operationId: `hook_${w.name}`, tags: ["hooks"],
            summary: `the webhook of ${w.name}: the body is the run's input`,
            parameters: [waitParam],
            security,
            requestBody: { required: true, content: { "application/json": { schema: ref(inputName) } } },
            responses: startResponses(),
        },
    };
}

function fixedPaths(): Json {
    const body = (schema: Json) => ({ required: true, content: { "application/json": { schema } } });
    return {
        "/api/runs": {
            get: {
                operationId: "listRuns", tags: ["runs"], summary: "the runs the caller may see, newest first (scope runs:read)",
                parameters: [
                    { name: "workflow", in: "query", schema: { type: "string" } },
                    { name: "status", in: "query", description: "one status, or several separated by commas", schema: { type: "string" } },
                    { name: "key", in: "query", schema: { type: "string" } },
                    { name: "before", in: "query", description: "runs with a smaller id (the next page)", schema: { type: "integer" } },
                    { name: "limit", in: "query", schema: { type: "integer", minimum: 1, maximum: 1000, default: 50 } },
                ],
                responses: { "200": json("a page of runs; next is the URL of the next page, or null", ref("RunList")), "400": errorResponse("a bad filter"), ...COMMON_ERRORS },
            },
        },
        "/api/runs/{id}": {
            get: {
                operationId: "getRun", tags: ["runs"], summary: "a run (scope runs:read)", parameters: [runId],
                responses: { "200": json("the run", ref("Run")), ...COMMON_ERRORS, "404": errorResponse("no such run, or one the caller may not see") },
            },
        },
        "/api/runs/{id}/events": {
            get: {
                operationId: "runEvents", tags: ["runs"],
                summary: "the run's journal as Server-Sent Events, then live, until its final event (scope runs:read)",
                parameters: [runId,
                    { name: "after", in: "query", description: "send the events after this seq", schema: { type: "integer", minimum: 0 } },
                    { name: "Last-Event-ID", in: "header", description: "the seq of the last event the client has (a reconnection)", schema: { type: "integer", minimum: 0 } }],
                responses: {
                    "200": { description: "the stream: id is the seq, event the type, data the Event as JSON", content: { "text/event-stream": { schema: { type: "string" } } } },
                    "204": { description: "the run has ended and the client has every event: do not reconnect" },
                    ...COMMON_ERRORS, "404": errorResponse("no such run, or one the caller may not see"),
                },
            },
        },
        "/api/runs/{id}/timeline": {
            get: {
                operationId: "runTimeline", tags: ["runs"], summary: "tuvl.timeline(): the journal as readable rows (scope runs:read)", parameters: [runId],
                responses: { "200": json("the rows", { type: "object", properties: { timeline: { type: "array", items: ref("TimelineRow") } } }), ...COMMON_ERRORS, "404": errorResponse("no such run") },
            },
        },
        "/api/runs/{id}/pause": control("pause", "pause the run at its next step or agent turn", "runs:control"),
        "/api/runs/{id}/resume": control("resume", "queue a paused run again", "runs:control"),
        "/api/runs/{id}/abort": control("abort", "stop the run, and its children", "runs:control",
            { type: "object", additionalProperties: false, properties: { reason: { type: "string" } } }),
        "/api/runs/{id}/steer": control("steer", "guidance for the run's agent at its next turn", "runs:control",
            { type: "object", additionalProperties: false, required: ["message"], properties: { message: { type: "string", minLength: 1 } } }),
        "/api/runs/{id}/submit": control("submit", "answer a waiting Human step", "people:answer",
            { type: "object", additionalProperties: false, required: ["data"], properties: { data: { type: "object" } } }),
        "/api/runs/{id}/reject": control("reject", "decline or cancel the question an MCP server asked the run (tuvl.reject)", "people:answer",
            { type: "object", additionalProperties: false, properties: { action: { type: "string", enum: ["decline", "cancel"], default: "decline" } } }),
        "/api/runs/{id}/decide": control("decide", "approve or reject the tool call a run waits on", "people:answer",
            { type: "object", additionalProperties: false, required: ["approved"], properties: { approved: { type: "boolean" }, note: { type: "string" } } }),
        "/api/runs/{id}/fixture": {
            get: {
                operationId: "pinRun", tags: ["replay"], summary: "tuvl.pin_run(): the ended run as a replay fixture (scope runs:read)", parameters: [runId],
                responses: { "200": json("the fixture", { type: "object" }), ...COMMON_ERRORS, "404": errorResponse("no such run"), "409": errorResponse("the run has not ended") },
            },
        },
        "/api/replay": {
            post: {
                operationId: "replay", tags: ["replay"],
                summary: "tuvl.replay(): re-execute a fixture with zero tokens; the SQL steps' writes are rolled back (scope runs:start)",
                requestBody: body({ type: "object", additionalProperties: false, required: ["fixture"], properties: { fixture: { type: "object" }, live: { type: "array", items: { type: "string" } } } }),
                responses: {
                    "200": json("the replay ended as the recording did", { type: "object" }), "400": errorResponse("not a fixture"), ...COMMON_ERRORS,
                    "404": errorResponse("the fixture's workflow does not exist"),
                    "409": errorResponse("the replay diverged from the recording (SQLSTATE 22000)"),
                },
            },
        },
        "/api/people": {
            get: {
                operationId: "people", tags: ["people"], summary: "runs waiting for a person (tuvl.people_queue; scope runs:read)",
                responses: { "200": json("the queue, oldest first", { type: "object", properties: { people: { type: "array", items: ref("Person") } } }), ...COMMON_ERRORS },
            },
        },
        "/api/validate": {
            post: {
                operationId: "validate", tags: ["workflows"], summary: "tuvl.validate(): the static checks of a workflow's YAML",
                requestBody: body({ type: "object", additionalProperties: false, required: ["source"], properties: { source: { type: "string" }, strict: { type: "boolean" } } }),
                responses: { "200": json("the findings; ok is false when one is an error", { type: "object", properties: { ok: { type: "boolean" }, findings: { type: "array", items: ref("Finding") } } }), ...COMMON_ERRORS },
            },
        },
        "/api/workflows": {
            post: {
                operationId: "ship", tags: ["workflows"], summary: "validate, then register a workflow's YAML as its next version (scope workflows:write)",
                requestBody: body({ type: "object", additionalProperties: false, required: ["source"], properties: { source: { type: "string" }, strict: { type: "boolean" } } }),
                responses: {
                    "201": json("registered", { type: "object", properties: { workflow: { type: "string" }, version: { type: "integer" }, warnings: { type: "array", items: ref("Finding") } } }),
                    "400": errorResponse("a malformed body"), ...COMMON_ERRORS, "422": errorResponse("the workflow has errors (findings lists them)"),
                },
            },
        },
        "/api/tokens": {
            get: {
                operationId: "listTokens", tags: ["tokens"], summary: "the tokens of the caller's roles, without secrets (scope admin)",
                responses: { "200": json("the tokens", { type: "object", properties: { tokens: { type: "array", items: ref("Token") } } }), ...COMMON_ERRORS },
            },
            post: {
                operationId: "createToken", tags: ["tokens"], summary: "tuvl.create_token(): a new token, shown once (scope admin)",
                requestBody: body({ type: "object", additionalProperties: false, required: ["role", "scopes"], properties: {
                    role: { type: "string" }, scopes: { type: "array", items: { type: "string" }, minItems: 1 },
                    expires: { type: ["string", "null"], description: "an interval; null: never; absent: 90 days" } } }),
                responses: { "201": json("the token", { type: "object", properties: { id: { type: "integer" }, token: { type: "string" } } }), "400": errorResponse("a bad scope or interval"), ...COMMON_ERRORS },
            },
        },
        "/api/tokens/{id}": {
            delete: {
                operationId: "revokeToken", tags: ["tokens"], summary: "tuvl.revoke_token() (scope admin)",
                parameters: [{ name: "id", in: "path", required: true, schema: { type: "integer" } }],
                responses: { "200": json("revoked", { type: "object" }), ...COMMON_ERRORS, "404": errorResponse("no such token") },
            },
        },
    };
}

export function openapi(version: string, flows: WorkflowInfo[]): Json {
    const paths: Json = {};
    const comps = schemas();
    const schemes: Json = {
        bearer: { type: "http", scheme: "bearer", description: "a token of tuvl.create_token(): tuvl_<id>_<secret>" },
    };
    for (const w of flows) workflowPaths(w, paths, comps, schemes);
    Object.assign(paths, fixedPaths());
    return {
        openapi: "3.1.0",
        info: {
            title: "tuvl",
            version,
            description: "The HTTP front door of tuvl (insight/): every request is a transaction in the database, as the role of its token. See docs/insight.md.",
        },
        security: [{ bearer: [] }],
        tags: [{ name: "workflows" }, { name: "runs" }, { name: "people" }, { name: "replay" }, { name: "hooks" }, { name: "tokens" }],
        paths,
        components: { schemas: comps, securitySchemes: schemes },
    };
}
