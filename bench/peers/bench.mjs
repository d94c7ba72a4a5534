// bench/peers/bench.mjs: one measurement of a peer (the job queues pg-boss
// and graphile-worker, the workflow engine DBOS Transact, the agent framework
// LangGraph JS), defined as bench/wakeup.py, bench/throughput.py and
// bench/agents_scale.py define tuvl's, on the same cluster.  Run with the pinned Node 22 that
// bench/peers/install.sh puts in node_modules/.bin/node; bench/peers.py runs
// it, but it also runs on its own:
//
//   node_modules/.bin/node bench.mjs --peer pgboss|graphile|dbos|langgraph \
//       --measure wakeup|trivial|chains|agents --setting NAME --db DB [--n N] [--json OUT]
//       [--llm-url http://127.0.0.1:PORT/lat/0/v1]   (agents: the load generator)
//   node_modules/.bin/node bench.mjs --list        # the settings grids, as JSON
//
// Each invocation installs the peer's schema in DB afresh (drops it, then the
// peer's own migrations) so that every round starts from the same state,
// starts the peer's workers in 1 or 2 child Node processes (the setting says
// how many), measures, stops them, and prints a summary on stderr and the
// result as JSON (on stdout, and in OUT with --json).
//
//   wakeup   one job at a time (--warmup first, then N, default 1,000): open a
//            transaction, insert the job with the peer's own API or SQL,
//            t0 = just before COMMIT is sent, t1 = COMMIT returned; the
//            handler stamps the moment it starts.  latency from before commit
//            = start - t0, after commit = start - t1 (process.hrtime, the
//            machine's monotonic clock, the same in every process).  The next
//            job goes in once the peer has recorded this one complete.
//   trivial  N (default 10,000) no-op jobs inserted in one transaction; jobs/s
//            from COMMIT returned until a poll (every --poll-ms) sees every
//            job complete as the peer records it (pg-boss: state 'completed';
//            graphile-worker: the job row deleted).
//   chains   N (default 2,000) chains of 5 steps: each step is a job whose
//            handler records its result {"n": 1} durably and enqueues the
//            chain's next step (pg-boss: the result is the job's output;
//            graphile-worker: a row of bench_peers.results written in one
//            statement with graphile_worker.add_job of the next step).  steps/s
//            from the first step's start to the last step's completion as
//            recorded, and from COMMIT returned to the poll that sees all done.
//
//   agents   N (default 1,000) LangGraph agents of three model turns against
//            the load generator's script bench_agents (--llm-url; two calls of
//            the tool `note`, each a row of bench_peers.tool_calls, then
//            "done"), `c` at once in each of the setting's processes, after a
//            warm-up of 10 per process: wall from handing them out until all
//            are done; CPU of the Node processes and of the PostgreSQL
//            backends serving them (/proc) per model turn; the processes' RSS
//            growth per agent in flight.
//
// For trivial and chains, WAL bytes and commits per step are the deltas of
// pg_stat_wal and of the database's pg_stat_database.xact_commit (read from
// database postgres, as bench/throughput.py does) over the workers' whole
// life: CHECKPOINT, 2.5 s for the statistics to settle, read, start the
// workers, enqueue, wait, stop the workers (their backends flush their
// statistics when they exit), 2.5 s, read.  The client's own transactions
// (the enqueue and the polls) are subtracted.  --no-counters skips all of
// that (the settings search of bench/peers.py).
import { fork } from 'node:child_process';
import { EventEmitter } from 'node:events';
import { readFileSync, writeFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { parseArgs } from 'node:util';

import pg from 'pg';
import { PgBoss } from 'pg-boss';
import { Logger, run as graphileRun, runMigrations as graphileMigrate } from 'graphile-worker';
import { DBOS, DBOSClient } from '@dbos-inc/dbos-sdk';
import { createReactAgent } from '@langchain/langgraph/prebuilt';
import { PostgresSaver } from '@langchain/langgraph-checkpoint-postgres';
import { ChatOpenAI } from '@langchain/openai';
import { tool } from '@langchain/core/tools';
import { z } from 'zod';

const STEPS = 5;                     // steps per chain, as bench/throughput.py's workflow `five`
const RESULT = { n: 1 };             // what every chain step returns, as bench.five_step
const STATS_SETTLE_MS = 2500;        // as bench/throughput.py's STATS_SETTLE_S
const APP = 'tuvl bench peers';      // application_name of the client's connections
const DEFAULT_N = { wakeup: 1000, trivial: 10000, chains: 2000, agents: 1000 };

// ---------------------------------------------------------------------------
// Settings.  A setting is a name that spells out its options, so any
// combination can be tried by hand; the grids are what bench/peers.py searches
// (the first of each list is what it uses with --no-search).
//
//   pg-boss          p<processes>-c<localConcurrency>-b<batchSize>[-tx][-part]
//     always: useListenNotify with notify: true on the queue (workers woken by
//     NOTIFY), pollingIntervalSeconds and notifyPollingIntervalSeconds 0.5
//     (their minimum), burstWhenBatchFull (fetch again at once while batches
//     come back full).  -tx: chain steps run `transactional` (the next step's
//     insert, the result and the completion in the handler's transaction);
//     without it, a batch's next steps are inserted first and the batch is
//     then settled with per-job outputs (perJobResults).  -part: the queue
//     gets its own partition (partition: true).
//   graphile-worker  p<processes>-c<concurrency>[-lq<localQueue.size>]
//                    [-cb<completeJobBatchDelay and failJobBatchDelay, ms>]
//                    [-pi<pollInterval, ms>][-nt][-np]
//     -nt: useNodeTime; -np: preparedStatements off.  maxPoolSize is
//     concurrency + 3 (graphile-worker's advice, concurrency + 2, and its
//     LISTEN connection).
//   DBOS Transact    p<processes>-c<workerConcurrency>-i<minPollingIntervalMs>
//                    -pool<systemDatabasePoolSize>[-d<maxConcurrentQueueDispatches>]
//     a workflow queue (DBOS.registerQueue) that the processes' executors
//     poll, at least every -i ms (DBOS's default is 1000); the client enqueues
//     with DBOSClient.enqueueInTransaction in the measure's own transaction.
//     Chains: one workflow per chain, each step a DBOS.runStep returning the
//     result (checkpointed by DBOS in dbos.operation_outputs).
//   LangGraph JS     p<processes>-c<agents run at once per process>-pool<PostgresSaver pool>
//     agents only: createReactAgent with ChatOpenAI on the load generator
//     (--llm-url) and PostgresSaver checkpoints, each agent its own thread.
// ---------------------------------------------------------------------------
const GRIDS = {
    pgboss: {
        wakeup: ['p1-c1-b1', 'p1-c2-b1', 'p2-c1-b1'],
        trivial: ['p1-c4-b100', 'p1-c2-b100', 'p1-c4-b50', 'p1-c4-b200', 'p1-c8-b100',
            'p2-c2-b100', 'p2-c4-b50', 'p1-c4-b100-part'],
        chains: ['p1-c4-b100', 'p1-c4-b50', 'p1-c8-b50', 'p2-c2-b100',
            'p1-c4-b100-tx', 'p1-c4-b50-tx', 'p1-c8-b50-tx', 'p2-c2-b100-tx'],
    },
    graphile: {
        wakeup: ['p1-c1', 'p1-c4', 'p1-c4-lq5-cb0'],
        trivial: ['p1-c24-lq500-cb0', 'p1-c4', 'p1-c10', 'p1-c24', 'p1-c10-lq11-cb0',
            'p2-c10-lq11-cb0', 'p1-c24-lq500-cb0-nt', 'p1-c24-lq500-cb0-np', 'p1-c24-lq500-cb0-pi100'],
        chains: ['p1-c24-lq500-cb0', 'p1-c4', 'p1-c10', 'p1-c24', 'p1-c10-lq11-cb0',
            'p2-c10-lq11-cb0', 'p1-c24-lq500-cb0-nt', 'p1-c24-lq500-cb0-np', 'p1-c24-lq500-cb0-pi100'],
    },
    dbos: {
        wakeup: ['p1-c1-i10-pool10', 'p1-c1-i1-pool10', 'p1-c1-i5-pool10', 'p1-c1-i50-pool10'],
        chains: ['p1-c50-i10-pool20', 'p1-c20-i10-pool10', 'p1-c100-i10-pool40', 'p1-c200-i10-pool40',
            'p1-c50-i1-pool20', 'p1-c50-i50-pool20', 'p1-c100-i10-pool40-d6', 'p2-c50-i10-pool20'],
    },
    langgraph: {
        agents: ['p1-c50-pool20', 'p1-c20-pool10', 'p1-c100-pool20', 'p1-c100-pool40', 'p1-c200-pool40',
            'p2-c50-pool20'],
    },
};

function parseSetting(peer, name) {
    const parts = name.split('-');
    const bad = () => { throw new Error(`setting ${name}: not a ${peer} setting (see the comment above GRIDS)`); };
    const num = (prefix) => {
        const p = parts.find(x => x.startsWith(prefix) && /^\d+$/.test(x.slice(prefix.length)));
        return p === undefined ? undefined : Number(p.slice(prefix.length));
    };
    const procs = num('p');
    if (!procs || procs > 8) bad();
    if (peer === 'pgboss') {
        const s = { procs, localConcurrency: num('c'), batchSize: num('b'),
            transactional: parts.includes('tx'), partition: parts.includes('part') };
        if (!s.localConcurrency || !s.batchSize) bad();
        const known = new Set(['p' + procs, 'c' + s.localConcurrency, 'b' + s.batchSize, 'tx', 'part']);
        if (parts.some(x => !known.has(x))) bad();
        return s;
    }
    if (peer === 'graphile') {
        const s = { procs, concurrency: num('c'), localQueueSize: num('lq') ?? -1,
            batchDelay: num('cb') ?? -1, pollInterval: num('pi') ?? 2000,
            useNodeTime: parts.includes('nt'), preparedStatements: !parts.includes('np') };
        if (!s.concurrency) bad();
        const known = new Set(['p' + procs, 'c' + s.concurrency, 'lq' + s.localQueueSize,
            'cb' + s.batchDelay, 'pi' + s.pollInterval, 'nt', 'np']);
        if (parts.some(x => !known.has(x))) bad();
        return s;
    }
    if (peer === 'dbos') {
        const s = { procs, concurrency: num('c'), interval: num('i'), pool: num('pool'), dispatches: num('d') };
        if (!s.concurrency || s.interval === undefined || !s.pool) bad();
        const known = new Set(['p' + procs, 'c' + s.concurrency, 'i' + s.interval, 'pool' + s.pool, 'd' + s.dispatches]);
        if (parts.some(x => !known.has(x))) bad();
        return s;
    }
    if (peer === 'langgraph') {
        const s = { procs, concurrency: num('c'), pool: num('pool') };
        if (!s.concurrency || !s.pool) bad();
        const known = new Set(['p' + procs, 'c' + s.concurrency, 'pool' + s.pool]);
        if (parts.some(x => !known.has(x))) bad();
        return s;
    }
    throw new Error(`unknown peer ${peer}`);
}

// ---------------------------------------------------------------------------
// Helpers shared by the measures
// ---------------------------------------------------------------------------
const hr = () => Number(process.hrtime.bigint()) / 1e6;        // ms, monotonic, machine-wide
const wall = () => performance.timeOrigin + performance.now();  // ms since the epoch, µs resolution
const sleep = (ms) => new Promise(resolve => setTimeout(resolve, ms));
const log = (msg) => process.stderr.write(`== ${new Date().toTimeString().slice(0, 8)} ${msg}\n`);

// Nearest-rank percentile and summary, as bench/common.py's
function percentile(sorted, p) {
    const rank = Math.max(1, Math.ceil(p / 100 * sorted.length));
    return sorted[Math.min(rank, sorted.length) - 1];
}
function summarizeMs(values) {
    const v = [...values].sort((a, b) => a - b);
    return { n: v.length, min: v[0], median: percentile(v, 50), p95: percentile(v, 95),
        p99: percentile(v, 99), max: v[v.length - 1], mean: v.reduce((a, b) => a + b, 0) / v.length };
}

// A client connection that counts its own transactions (each statement
// outside BEGIN ... COMMIT is one), so that they can be told apart from the
// workers' in the database's commit count.  bossDb is the same connection as
// pg-boss's `db` option wants it.
class Conn {
    constructor(db) {
        this.client = new pg.Client({ database: db, application_name: APP });
        this.transactions = 0;
        this.inTx = false;
        this.bossDb = { executeSql: (text, values) => this.query(text, values) };
    }
    async open() { await this.client.connect(); return this; }
    query(text, values) {
        if (!this.inTx) this.transactions++;
        return this.client.query(text, values);
    }
    async begin() { await this.client.query('BEGIN'); this.inTx = true; this.transactions++; }
    async commit() { await this.client.query('COMMIT'); this.inTx = false; }
    async one(text, values) { return (await this.query(text, values)).rows[0]; }
    // Have the backend flush its statistics as soon as it is idle, so that
    // what it did before a counters() read is not reported after it.
    async flushStats() { await this.query('SELECT pg_stat_force_next_flush()'); }
    async close() { if (!this.closed) { this.closed = true; await this.client.end(); } }
}

async function withConn(db, fn) {
    const c = await new Conn(db).open();
    try { return await fn(c); } finally { await c.close(); }
}

// The database's commit count and the cluster's WAL counters, read from
// database postgres (bench/throughput.py's counters()).
async function counters(db) {
    return withConn('postgres', async (c) => {
        const d = await c.one('SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = $1', [db]);
        const w = await c.one('SELECT wal_records, wal_bytes, wal_write, wal_sync FROM pg_stat_wal');
        return { xact_commit: Number(d.xact_commit), xact_rollback: Number(d.xact_rollback),
            wal_records: Number(w.wal_records), wal_bytes: Number(w.wal_bytes),
            wal_write: Number(w.wal_write), wal_sync: Number(w.wal_sync) };
    });
}

// ---------------------------------------------------------------------------
// The peers.  Each has the same parts:
//   prepare(db, measure, s)      the peer installed afresh (its own
//                                migrations), its queue; in the main process
//   client(conn, measure, s)     the enqueueing side on the client connection:
//                                { one(i): job ref, many(n), done(ref), stop() }
//   pending(measure)             SQL: true while a job is not yet complete
//   recorded(measure)            SQL: completed, first_start, last_done (epoch s)
//   work(db, measure, s, hooks)  a worker process's side: start the peer's
//                                workers, return a function that stops them
// ---------------------------------------------------------------------------
const QUEUE = { wakeup: 'wake', trivial: 'trivial', chains: 'chain', agents: 'agents' };

const pgboss = {
    options(db, extra) {
        // every pg-boss instance, the client's and the workers', on the libpq
        // environment's host and port (pg reads PGHOST, PGPORT, PGUSER)
        return { database: db, ...extra };
    },
    async prepare(db, measure, s) {
        // pg-boss installed afresh: emptied tables would keep the planner
        // statistics of the previous measure (another queue's jobs, all
        // completed), which made fetches several times slower
        await withConn(db, (c) => c.query('DROP SCHEMA IF EXISTS pgboss CASCADE'));
        const boss = new PgBoss(this.options(db, { supervise: false, schedule: false, registerInstance: false }));
        boss.on('error', (e) => log(`pg-boss error: ${e.message}`));
        await boss.start();                       // installs the schema
        await boss.createQueue(QUEUE[measure], { notify: true, partition: s.partition });
        await boss.stop();
    },
    async client(conn, measure) {
        // a pg-boss instance whose every statement goes through the client
        // connection (so its transactions are counted as the client's); it
        // only sends, it runs no maintenance and no workers
        const boss = new PgBoss({ db: conn.bossDb, supervise: false, schedule: false,
            registerInstance: false, migrate: false });
        boss.on('error', (e) => log(`pg-boss error: ${e.message}`));
        await boss.start();
        const name = QUEUE[measure];
        const db = conn.bossDb;
        return {
            one: (i) => boss.send(name, { k: i }, { db }),
            many: (n) => boss.insert(name, Array.from({ length: n }, (_, i) =>
                ({ data: measure === 'chains' ? { c: i + 1, s: 1 } : {} })), { db }),
            done: async (id) => (await conn.one('SELECT state FROM pgboss.job WHERE name = $1 AND id = $2',
                [name, id]))?.state === 'completed',
            stop: () => boss.stop({ close: false, graceful: false }),
        };
    },
    pending: (measure) => `SELECT EXISTS (SELECT 1 FROM pgboss.job WHERE name = '${QUEUE[measure]}' ` +
        `AND state IN ('created', 'retry', 'active')) AS pending`,
    recorded: (measure) => `SELECT count(*) FILTER (WHERE state = 'completed')::int AS completed, ` +
        `count(*) FILTER (WHERE state = 'completed' AND output = '${JSON.stringify(RESULT)}'::jsonb)::int ` +
        `AS with_result, ` +
        `extract(epoch FROM min(started_on))::float8 AS first_start, ` +
        `extract(epoch FROM max(completed_on))::float8 AS last_done FROM pgboss.job WHERE name = '${QUEUE[measure]}'`,
    async work(db, measure, s, hooks) {
        const boss = new PgBoss(this.options(db, { useListenNotify: true,
            // a transactional handler holds a connection while it runs
            max: Math.max(10, s.localConcurrency + 4) }));
        boss.on('error', (e) => log(`pg-boss error: ${e.message}`));
        await boss.start();
        const name = QUEUE[measure];
        const opts = { batchSize: s.batchSize, localConcurrency: s.localConcurrency,
            pollingIntervalSeconds: 0.5, notifyPollingIntervalSeconds: 0.5, burstWhenBatchFull: true };
        // the next steps of a batch of chain steps, in one insert
        const next = (jobs, db) => {
            const more = jobs.filter(j => j.data.s < STEPS).map(j => ({ data: { c: j.data.c, s: j.data.s + 1 } }));
            return more.length ? boss.insert(name, more, db ? { db } : undefined) : null;
        };
        if (measure === 'wakeup') {
            await boss.work(name, opts, async (jobs) => { for (const j of jobs) hooks.started(j.data.k); });
        } else if (measure === 'trivial') {
            await boss.work(name, opts, async () => {});
        } else if (s.transactional) {
            // next steps, results and completion commit together (every
            // step's result is RESULT, so one complete() records them all)
            await boss.work(name, { ...opts, transactional: true }, async (jobs, tx) => {
                await next(jobs, tx);
                await boss.complete(name, jobs.map(j => j.id), RESULT, { db: tx });
            });
        } else {
            // next steps first, then each job settled with its own output
            await boss.work(name, { ...opts, perJobResults: true }, async (jobs) => {
                await next(jobs);
                return jobs.map(j => ({ id: j.id, status: 'completed', output: RESULT }));
            });
        }
        return () => boss.stop({ graceful: true, timeout: 10000 });
    },
};

// One statement, so one transaction: the step's result, and its chain's next
// step when there is one (a data-modifying WITH runs whether or not it is read).
const GRAPHILE_STEP_SQL = `
WITH r AS (INSERT INTO bench_peers.results (chain, step, result, started_at)
           VALUES ($1, $2, $3::jsonb, to_timestamp($4)))
SELECT graphile_worker.add_job('step', json_build_object('c', $1::int, 's', $2::int + 1))
WHERE $2::int < ${STEPS}`;
const graphileLogger = new Logger(() => (level, message) => {
    if (level === 'error' || level === 'warning') log(`graphile-worker ${level}: ${message}`);
});

const graphile = {
    task: { wakeup: 'wake', trivial: 'noop', chains: 'step' },
    // the libpq environment's host and port (PGHOST may be a socket directory)
    url: (db) => `postgres:///${db}`,
    async prepare(db) {
        // installed afresh, as pg-boss is
        await withConn(db, (c) => c.query('DROP SCHEMA IF EXISTS graphile_worker, bench_peers CASCADE'));
        await graphileMigrate({ connectionString: graphile.url(db), logger: graphileLogger });
        await withConn(db, async (c) => {
            await c.query('CREATE SCHEMA bench_peers');
            // no index: the cheapest durable record of a step's result
            await c.query(`CREATE TABLE bench_peers.results (chain int NOT NULL, step int NOT NULL,
                result jsonb NOT NULL, started_at timestamptz NOT NULL,
                recorded_at timestamptz NOT NULL DEFAULT clock_timestamp())`);
        });
    },
    async client(conn, measure) {
        const task = this.task[measure];
        return {
            one: async (i) => (await conn.one(
                `SELECT id FROM graphile_worker.add_job($1, json_build_object('k', $2::int))`, [task, i])).id,
            // add_jobs: graphile-worker's batch insert, one NOTIFY for all
            many: (n) => conn.query(`SELECT count(*) FROM graphile_worker.add_jobs(ARRAY(
                SELECT ($1, CASE WHEN $1 = 'step' THEN json_build_object('c', i, 's', 1) ELSE '{}'::json END,
                        NULL, NULL, NULL, NULL, NULL, NULL)::graphile_worker.job_spec
                FROM generate_series(1, $2::int) i))`, [task, n]),
            done: async (id) => (await conn.one(
                'SELECT NOT EXISTS (SELECT 1 FROM graphile_worker._private_jobs WHERE id = $1) AS done', [id])).done,
            stop: async () => {},
        };
    },
    // a job is complete when its row is gone (failed jobs stay, to be retried)
    pending: () => 'SELECT EXISTS (SELECT 1 FROM graphile_worker._private_jobs) AS pending',
    recorded: (measure) => measure !== 'chains'
        ? 'SELECT NULL::int AS completed, NULL::int AS with_result, ' +
          'NULL::float8 AS first_start, NULL::float8 AS last_done'
        : `SELECT count(DISTINCT (chain, step))::int AS completed,
                  count(*) FILTER (WHERE result = '${JSON.stringify(RESULT)}'::jsonb)::int AS with_result,
                  count(*)::int AS rows,
                  extract(epoch FROM min(started_at))::float8 AS first_start,
                  extract(epoch FROM max(recorded_at))::float8 AS last_done FROM bench_peers.results`,
    async work(db, measure, s, hooks) {
        const task = this.task[measure];
        const taskList = {
            wake: async (payload) => { hooks.started(payload.k); },
            noop: async () => {},
            step: async (payload, helpers) => {
                const started = wall();
                await helpers.query(GRAPHILE_STEP_SQL, [payload.c, payload.s, JSON.stringify(RESULT), started / 1000]);
            },
        };
        const events = new EventEmitter();
        const listening = new Promise(resolve => events.once('pool:listen:success', resolve));
        const runner = await graphileRun({
            connectionString: this.url(db), maxPoolSize: s.concurrency + 3,
            concurrency: s.concurrency, pollInterval: s.pollInterval, useNodeTime: s.useNodeTime,
            noPreparedStatements: !s.preparedStatements, noHandleSignals: true, logger: graphileLogger,
            events, crontab: '', taskList: { [task]: taskList[task] },
            preset: { worker: {
                ...(s.localQueueSize > 0 ? { localQueue: { size: s.localQueueSize } } : {}),
                completeJobBatchDelay: s.batchDelay, failJobBatchDelay: s.batchDelay,
            } },
        });
        await listening;
        await sleep(100);  // the LISTEN itself follows the event
        return () => runner.stop();
    },
};

// DBOS Transact: the executors run in the worker processes; the schema is
// made afresh by one launch in the main process (so that two worker
// processes do not migrate at once).  Its URL must name a host and a user;
// PGHOST may be a socket directory, given as ?host=.
const DBOS_APP = 'tuvl-bench';
const dbos = {
    url: (db) => `postgresql://${encodeURIComponent(process.env.PGUSER || 'postgres')}@localhost:` +
        `${process.env.PGPORT || 5432}/${db}` + (process.env.PGHOST && process.env.PGHOST.startsWith('/')
            ? `?host=${encodeURIComponent(process.env.PGHOST)}` : ''),
    config(db, s) {
        return { name: DBOS_APP, systemDatabaseUrl: this.url(db), systemDatabasePoolSize: s.pool, logLevel: 'warn',
            ...(s.dispatches ? { maxConcurrentQueueDispatches: s.dispatches } : {}) };
    },
    async prepare(db, measure, s) {
        await withConn(db, (c) => c.query('DROP SCHEMA IF EXISTS dbos CASCADE'));
        DBOS.setConfig(this.config(db, s));
        await DBOS.launch();
        await DBOS.shutdown();
    },
    async client(conn, measure) {
        const client = await DBOSClient.create({ systemDatabaseUrl: this.url(conn.client.database),
            applicationName: DBOS_APP, systemDatabasePoolSize: 2 });
        const opts = { queueName: QUEUE[measure], workflowName: measure === 'chains' ? 'chain' : 'wake' };
        return {
            // in the measure's transaction, on its connection
            one: async (i) => (await client.enqueueInTransaction(conn.client, opts, i)).workflowID,
            many: async (n) => { for (let i = 1; i <= n; i++) await client.enqueueInTransaction(conn.client, opts, i); },
            done: async (id) => (await conn.one('SELECT status FROM dbos.workflow_status WHERE workflow_uuid = $1',
                [id]))?.status === 'SUCCESS',
            stop: () => client.destroy(),
        };
    },
    pending: (measure) => `SELECT EXISTS (SELECT 1 FROM dbos.workflow_status WHERE queue_name = '${QUEUE[measure]}' ` +
        `AND status IN ('ENQUEUED', 'PENDING')) AS pending`,
    recorded: (measure) => measure !== 'chains'
        ? 'SELECT NULL::int AS completed, NULL::int AS with_result, NULL::float8 AS first_start, NULL::float8 AS last_done'
        : `SELECT (SELECT count(*) FROM dbos.operation_outputs o JOIN dbos.workflow_status w USING (workflow_uuid)
                   WHERE w.status = 'SUCCESS' AND o.error IS NULL)::int AS completed,
                  (SELECT count(*) FROM dbos.operation_outputs
                   WHERE (output::jsonb -> 'json') = '${JSON.stringify(RESULT)}'::jsonb)::int AS with_result,
                  (SELECT count(*) FROM dbos.operation_outputs)::int AS rows,
                  (SELECT min(started_at_epoch_ms) FROM dbos.operation_outputs)::float8 / 1000 AS first_start,
                  (SELECT max(completed_at::bigint) FROM dbos.workflow_status)::float8 / 1000 AS last_done`,
    async work(db, measure, s, hooks) {
        DBOS.setConfig(this.config(db, s));
        if (measure === 'wakeup') {
            DBOS.registerWorkflow(async function wake(k) { hooks.started(k); }, { name: 'wake' });
        } else {
            DBOS.registerWorkflow(async function chain(c) {
                for (let i = 1; i <= STEPS; i++) await DBOS.runStep(async () => RESULT, { name: `s${i}` });
                return c;
            }, { name: 'chain' });
        }
        await DBOS.launch();
        await DBOS.registerQueue(QUEUE[measure], { workerConcurrency: s.concurrency,
            minPollingIntervalMs: s.interval, onConflict: 'always_update' });
        return () => DBOS.shutdown();
    },
};

// LangGraph JS: bench/agents.py's agent (three model turns, the tool `note`
// twice) as a prebuilt ReAct agent, checkpointed by PostgresSaver, each
// agent its own thread; the tool records its call in bench_peers.tool_calls
// as tuvl's bench_agents.note does.
const LG_APP = 'tuvl bench langgraph';
const langgraph = {
    pool: (db, max) => new pg.Pool({ database: db, max, idleTimeoutMillis: 0, application_name: LG_APP }),
    async prepare(db) {
        await withConn(db, (c) => c.query('DROP TABLE IF EXISTS checkpoints, checkpoint_blobs, checkpoint_writes, ' +
            'checkpoint_migrations CASCADE; DROP SCHEMA IF EXISTS bench_peers CASCADE; CREATE SCHEMA bench_peers; ' +
            'CREATE TABLE bench_peers.tool_calls (k int NOT NULL, turn int, ' +
            'at timestamptz NOT NULL DEFAULT clock_timestamp())'));
        const pool = this.pool(db, 2);
        await new PostgresSaver(pool).setup();
        await pool.end();
    },
    agent(pool, llmUrl) {
        const note = tool(async ({ turn }, config) => {
            const r = await pool.query('INSERT INTO bench_peers.tool_calls (k, turn) VALUES ($1, $2) RETURNING turn',
                [config.configurable.k, turn]);
            return JSON.stringify({ noted: r.rows[0].turn });
        }, { name: 'note', description: 'Record a note about the current turn.',
            schema: z.object({ turn: z.coerce.number().int() }) });
        const llm = new ChatOpenAI({ model: 'bench_agents', apiKey: 'bench', maxRetries: 0, timeout: 60000,
            configuration: { baseURL: llmUrl } });
        return createReactAgent({ llm, tools: [note], checkpointSaver: new PostgresSaver(pool),
            prompt: 'Record two notes, then answer done.' });
    },
};

const PEERS = { pgboss, graphile, dbos, langgraph };

// The CPU seconds (user + system) of a process, from /proc, or null.
const CLK_TCK = 100;
function procCpu(pid) {
    try {
        const f = readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1].split(' ');
        return (Number(f[11]) + Number(f[12])) / CLK_TCK;
    } catch { return null; }
}

// The agents measure, a worker process: its share of the agents, `concurrency`
// at once, after a warm-up of a few (not counted).
async function workerAgents(args, s) {
    const pool = langgraph.pool(args.db, s.pool);
    const agent = langgraph.agent(pool, args.llmUrl);
    const runOne = async (k) => {
        const r = await agent.invoke({ messages: [{ role: 'user', content: JSON.stringify({ k }) }] },
            { configurable: { thread_id: `agent-${k}`, k }, recursionLimit: 20 });
        return r.messages.at(-1).content === 'done';
    };
    const lanes = async (keys) => {
        let next = 0, ok = 0, inFlight = 0, peak = 0;
        const lane = async () => {
            while (next < keys.length) {
                const k = keys[next++];
                inFlight++;
                if (inFlight > peak) peak = inFlight;
                if (await runOne(k)) ok++;
                inFlight--;
            }
        };
        await Promise.all(Array.from({ length: Math.min(s.concurrency, keys.length) }, lane));
        return { ok, peak };
    };
    await lanes(Array.from({ length: 10 }, (_, i) => -1 - i - 10 * args.index));   // warm-up: negative keys
    process.on('message', async (m) => {
        if (m.type === 'go') {
            const rss0 = process.memoryUsage.rss();
            let rssPeak = rss0;
            const sampler = setInterval(() => { rssPeak = Math.max(rssPeak, process.memoryUsage.rss()); }, 20);
            const cpu0 = process.cpuUsage();
            const t0 = hr();
            const { ok, peak } = await lanes(m.keys);
            const t1 = hr();
            const cpu = process.cpuUsage(cpu0);
            clearInterval(sampler);
            process.send({ type: 'done', ok, peak, t0, t1, cpu_s: (cpu.user + cpu.system) / 1e6,
                rss0_kb: rss0 / 1024, rss_peak_kb: rssPeak / 1024 });
        }
        if (m.type === 'stop') { await pool.end(); process.exit(0); }
    });
    process.send({ type: 'ready' });
}

// The agents measure, the main process: prepare, start the workers (each
// warms up), hand out the agents, wait, count, with the CPU of the worker
// processes and of the PostgreSQL backends serving them.
async function measureAgents(args, s) {
    await langgraph.prepare(args.db);
    const children = [];
    const done = [];
    let failed = null;
    const backendCpu = () => withConn(args.db, async (c) => {
        const r = await c.query('SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name = $2',
            [args.db, LG_APP]);
        return Object.fromEntries(r.rows.map(x => [x.pid, procCpu(x.pid)]));
    });
    try {
        for (let i = 0; i < s.procs; i++) {
            const child = fork(new URL(import.meta.url).pathname,
                ['--role', 'worker', '--peer', 'langgraph', '--measure', 'agents', '--setting', args.setting,
                    '--db', args.db, '--llm-url', args.llmUrl, '--index', String(i)],
                { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
            child.on('message', (m) => { if (m.type === 'ready') child.ready = true; if (m.type === 'done') done.push(m); });
            child.on('exit', (code) => { child.exited = true; if (code) failed = new Error(`worker exited with ${code}`); });
            children.push(child);
        }
        const until = async (cond, what) => {
            const deadline = Date.now() + args.timeout * 1000;
            while (!cond()) {
                if (failed) throw failed;
                if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
                await sleep(5);
            }
        };
        await until(() => children.every(c => c.ready), 'the workers to start');
        await withConn(args.db, (c) => c.query('TRUNCATE bench_peers.tool_calls'));
        const cpuBefore = await backendCpu();
        const t0 = hr();
        children.forEach((c, i) => c.send({ type: 'go',
            keys: Array.from({ length: args.n }, (_, k) => k).filter(k => k % s.procs === i) }));
        await until(() => done.length === children.length, 'the agents');
        const wall = (hr() - t0) / 1000;
        const cpuAfter = await backendCpu();
        const backend = Object.entries(cpuAfter).reduce((a, [pid, v]) => a + (v ?? 0) - (cpuBefore[pid] ?? 0), 0);
        const r = await withConn(args.db, (c) => c.one(`SELECT count(*)::int AS rows,
            count(DISTINCT k)::int AS agents, count(*) FILTER (WHERE turn NOT IN (0, 1))::int AS bad
            FROM bench_peers.tool_calls`));
        const ok = done.reduce((a, d) => a + d.ok, 0);
        const workerCpu = done.reduce((a, d) => a + d.cpu_s, 0);
        const turns = 3 * args.n;
        const inFlight = done.reduce((a, d) => a + d.peak, 0);
        const rssGrowth = done.reduce((a, d) => a + (d.rss_peak_kb - d.rss0_kb), 0);
        return { agents: args.n, turns, wall_s: wall, answered_done: ok, tool_rows: r.rows,
            worker_cpu_s: workerCpu, backend_cpu_s: backend, cpu_s: workerCpu + backend,
            cpu_per_turn_ms: 1000 * (workerCpu + backend) / turns,
            worker_cpu_per_turn_ms: 1000 * workerCpu / turns,
            agents_in_flight: inFlight, rss_growth_kb: rssGrowth,
            kb_per_agent_in_flight: inFlight > 0 ? rssGrowth / inFlight : null,
            ok: ok === args.n && r.rows === 2 * args.n && r.agents === args.n && r.bad === 0 };
    } finally {
        for (const c of children) if (!c.exited) c.send({ type: 'stop' });
        const deadline = Date.now() + 30000;
        while (children.some(c => !c.exited) && Date.now() < deadline) await sleep(20);
        for (const c of children) if (!c.exited) c.kill('SIGKILL');
    }
}

// ---------------------------------------------------------------------------
// Worker processes: forked from the main process, they run the peer's
// workers and report over IPC when they are ready and when a wake-up job's
// handler starts.
// ---------------------------------------------------------------------------
async function workerMain(args) {
    const peer = PEERS[args.peer];
    const s = parseSetting(args.peer, args.setting);
    if (args.measure === 'agents') return workerAgents(args, s);
    const stop = await peer.work(args.db, args.measure, s, {
        started: (k) => process.send({ type: 'started', k, t: hr() }),
    });
    process.on('message', async (m) => {
        if (m.type === 'stop') {
            await stop();
            process.exit(0);
        }
    });
    process.send({ type: 'ready' });
}

class Workers {
    constructor(args, procs) {
        this.started = new Map();      // wake-up job key -> handler start (hr ms)
        this.waiters = new Map();
        this.children = [];
        for (let i = 0; i < procs; i++) {
            const child = fork(new URL(import.meta.url).pathname,
                ['--role', 'worker', '--peer', args.peer, '--measure', args.measure,
                    '--setting', args.setting, '--db', args.db], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] });
            child.on('message', (m) => this.#onMessage(child, m));
            child.on('exit', (code) => {
                child.exited = true;
                if (code && !this.stopping) this.#fail(new Error(`worker process exited with ${code}`));
            });
            this.children.push(child);
        }
    }
    #onMessage(child, m) {
        if (m.type === 'ready') child.ready = true;
        if (m.type === 'started') {
            this.started.set(m.k, m.t);
            const w = this.waiters.get(m.k);
            if (w) { this.waiters.delete(m.k); w.resolve(m.t); }
        }
        this.#wake?.();
    }
    #fail(err) { this.error = err; for (const w of this.waiters.values()) w.reject(err); this.#wake?.(); }
    #wake = null;
    async #until(cond, timeoutMs, what) {
        const deadline = Date.now() + timeoutMs;
        while (!cond()) {
            if (this.error) throw this.error;
            if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
            await new Promise(resolve => { this.#wake = resolve; setTimeout(resolve, 100); });
        }
    }
    ready(timeoutMs = 60000) {
        return this.#until(() => this.children.every(c => c.ready), timeoutMs, 'the workers to start');
    }
    // the handler start of wake-up job k
    handlerStart(k, timeoutMs) {
        if (this.started.has(k)) return Promise.resolve(this.started.get(k));
        if (this.error) return Promise.reject(this.error);
        return new Promise((resolve, reject) => {
            const timer = setTimeout(() => {
                this.waiters.delete(k);
                reject(new Error(`job ${k}: no handler start within ${timeoutMs} ms`));
            }, timeoutMs);
            this.waiters.set(k, { resolve: (t) => { clearTimeout(timer); resolve(t); }, reject });
        });
    }
    async stop() {
        this.stopping = true;
        for (const c of this.children) if (!c.exited) c.send({ type: 'stop' });
        await this.#until(() => this.children.every(c => c.exited), 30000, 'the workers to stop');
    }
    kill() { for (const c of this.children) if (!c.exited) c.kill('SIGKILL'); }
}

// ---------------------------------------------------------------------------
// The measures (main process)
// ---------------------------------------------------------------------------
async function measureWakeup(args, peer, workers, conn) {
    const client = await peer.client(conn, args.measure);
    const after = [], before = [], commit = [];
    try {
        for (let i = 0; i < args.warmup + args.n; i++) {
            await conn.begin();
            const ref = await client.one(i);
            const t0 = hr();
            await conn.commit();
            const t1 = hr();
            const start = await workers.handlerStart(i, args.timeout * 1000);
            // the next job once this one is recorded complete
            while (!(await client.done(ref))) await sleep(1);
            if (i >= args.warmup) {
                after.push(start - t1);
                before.push(start - t0);
                commit.push(t1 - t0);
            }
        }
    } finally {
        await client.stop();
    }
    return { jobs: args.n, warmup: args.warmup, after_commit_ms: summarizeMs(after),
        before_commit_ms: summarizeMs(before), commit_ms: summarizeMs(commit),
        negative_after_commit: after.filter(v => v < 0).length };
}

// trivial and chains: enqueue everything in one transaction, wait, count
async function measureBulk(args, peer, workers, conn, poll) {
    const client = await peer.client(conn, args.measure);
    const steps = args.measure === 'chains' ? STEPS * args.n : args.n;
    await conn.begin();
    const tEnqueue = wall();
    await client.many(args.n);
    const t0 = wall();
    await conn.commit();
    const t1 = wall();
    const deadline = t1 + args.timeout * 1000;
    while ((await poll.one(peer.pending(args.measure))).pending) {
        if (wall() > deadline) throw new Error(`jobs still pending after ${args.timeout} s`);
        await sleep(args.pollMs);
    }
    const tDone = wall();
    await client.stop();
    return { steps, t1, res: {
        enqueue_s: (t0 - tEnqueue) / 1000, commit_s: (t1 - t0) / 1000,
        wall_s: (tDone - t1) / 1000,
    } };
}

async function mainMain(args) {
    const peer = PEERS[args.peer];
    const s = parseSetting(args.peer, args.setting);
    const t = Date.now();
    if (args.measure === 'agents') {
        const out = { peer: args.peer, measure: args.measure, setting: args.setting, settings: s, n: args.n,
            ...(await measureAgents(args, s)) };
        out.invocation_s = (Date.now() - t) / 1000;
        return out;
    }
    await peer.prepare(args.db, args.measure, s);
    const bulk = args.measure !== 'wakeup';
    const conn = await new Conn(args.db).open();
    const poll = await new Conn(args.db).open();
    let before, workers;
    const out = { peer: args.peer, measure: args.measure, setting: args.setting, settings: s, n: args.n };
    try {
        if (bulk && args.counters) {
            await conn.flushStats();
            await poll.flushStats();
            await withConn('postgres', (c) => c.query('CHECKPOINT'));
            await sleep(STATS_SETTLE_MS);
            before = await counters(args.db);
            conn.transactions = 0;
            poll.transactions = 0;
        }
        workers = new Workers(args, s.procs);
        await workers.ready();
        if (!bulk) {
            Object.assign(out, await measureWakeup(args, peer, workers, conn));
        } else {
            const { steps, t1, res } = await measureBulk(args, peer, workers, conn, poll);
            Object.assign(out, res);
            out.steps = steps;
            out.client_transactions = conn.transactions + poll.transactions;
            await workers.stop();
            await conn.close();
            await poll.close();
            if (args.counters) {
                await sleep(STATS_SETTLE_MS);
                const after = await counters(args.db);
                const delta = Object.fromEntries(Object.keys(after).map(k => [k, after[k] - before[k]]));
                out.delta = delta;
                out.worker_commits = delta.xact_commit - out.client_transactions;
                out.commits_per_step = out.worker_commits / steps;
                out.steps_per_commit = out.worker_commits > 0 ? steps / out.worker_commits : null;
                out.wal_bytes_per_step = delta.wal_bytes / steps;
                out.wal_records_per_step = delta.wal_records / steps;
                out.steps_per_wal_sync = delta.wal_sync > 0 ? steps / delta.wal_sync : null;
            }
            const r = await withConn(args.db, (c) => c.one(peer.recorded(args.measure)));
            out.completed = r.completed;
            out.with_result = r.with_result;
            out.steps_per_s_wall = steps / out.wall_s;
            if (r.last_done != null) out.last_done_after_commit_s = r.last_done - t1 / 1000;
            if (args.measure === 'chains') {
                out.server_span_s = r.last_done - r.first_start;
                out.steps_per_s = steps / out.server_span_s;
                // every step recorded exactly once, with its result
                out.ok = r.completed === steps && r.with_result === steps && (r.rows ?? steps) === steps;
            } else {
                out.jobs_per_s = steps / out.wall_s;
                out.ok = r.completed == null || r.completed === steps;
            }
        }
    } finally {
        if (workers) { await workers.stop().catch(() => workers.kill()); }
        await conn.close().catch(() => {});
        await poll.close().catch(() => {});
    }
    out.invocation_s = (Date.now() - t) / 1000;
    return out;
}

function describe(o) {
    if (o.measure === 'agents') {
        return `${o.agents} agents in ${o.wall_s.toFixed(2)} s, ${o.cpu_per_turn_ms.toFixed(2)} ms CPU per turn ` +
            `(node ${o.worker_cpu_s.toFixed(1)} s, backends ${o.backend_cpu_s.toFixed(1)} s), ` +
            `${o.kb_per_agent_in_flight === null ? 'n/a' : o.kb_per_agent_in_flight.toFixed(0)} kB per agent in flight` +
            `${o.ok ? '' : ' NOT ALL COMPLETE'}`;
    }
    if (o.measure === 'wakeup') {
        const b = o.before_commit_ms, a = o.after_commit_ms;
        return `from before commit median ${b.median.toFixed(3)} p95 ${b.p95.toFixed(3)} p99 ${b.p99.toFixed(3)} ` +
            `max ${b.max.toFixed(3)} ms; after commit median ${a.median.toFixed(3)} ms`;
    }
    const rate = o.measure === 'chains'
        ? `${Math.round(o.steps_per_s)} steps/s (span ${o.server_span_s.toFixed(2)} s), ` +
          `${Math.round(o.steps_per_s_wall)} wall`
        : `${Math.round(o.jobs_per_s)} jobs/s wall (${o.wall_s.toFixed(2)} s)`;
    const c = o.worker_commits != null
        ? `; ${o.commits_per_step.toFixed(2)} commits/step, ${Math.round(o.wal_bytes_per_step)} WAL bytes/step` : '';
    return `${rate}${c}${o.ok ? '' : ' NOT ALL COMPLETE'}`;
}

async function main() {
    const { values } = parseArgs({ options: {
        role: { type: 'string', default: 'main' },
        peer: { type: 'string' }, measure: { type: 'string' }, setting: { type: 'string' },
        db: { type: 'string' }, n: { type: 'string' }, warmup: { type: 'string', default: '50' },
        json: { type: 'string' }, 'poll-ms': { type: 'string', default: '10' },
        timeout: { type: 'string', default: '300' }, 'no-counters': { type: 'boolean', default: false },
        list: { type: 'boolean', default: false }, help: { type: 'boolean', short: 'h', default: false },
        'llm-url': { type: 'string' }, index: { type: 'string', default: '0' },
    } });
    if (values.help) {
        process.stdout.write('usage: bench.mjs --peer pgboss|graphile|dbos|langgraph --measure wakeup|trivial|chains|agents --setting NAME ' +
            '--db DB [--n N] [--warmup 50] [--poll-ms 10] [--timeout 300] [--no-counters] [--json OUT] [--llm-url URL]\n' +
            '       bench.mjs --list   (the settings grids as JSON)\n(see the comment at the top of bench.mjs)\n');
        return;
    }
    if (values.list) {
        const grids = {};
        for (const [p, g] of Object.entries(GRIDS)) {
            grids[p] = {};
            for (const [m, names] of Object.entries(g)) {
                grids[p][m] = names.map(n => ({ name: n, ...parseSetting(p, n) }));
            }
        }
        process.stdout.write(JSON.stringify(grids, null, 2) + '\n');
        return;
    }
    if (!PEERS[values.peer]) throw new Error('--peer pgboss|graphile|dbos|langgraph');
    if (!QUEUE[values.measure]) throw new Error('--measure wakeup|trivial|chains|agents');
    if (!GRIDS[values.peer][values.measure]) throw new Error(`${values.peer} has no measure ${values.measure}`);
    if (values.measure === 'agents' && !values['llm-url']) throw new Error('--llm-url URL (the load generator\'s /lat/0/v1)');
    if (!values.db) throw new Error('--db DB');
    const args = { peer: values.peer, measure: values.measure, db: values.db,
        setting: values.setting ?? GRIDS[values.peer][values.measure][0],
        n: Number(values.n ?? DEFAULT_N[values.measure]), warmup: Number(values.warmup),
        pollMs: Number(values['poll-ms']), timeout: Number(values.timeout), counters: !values['no-counters'],
        llmUrl: values['llm-url'], index: Number(values.index) };
    if (values.role === 'worker') return workerMain(args);
    parseSetting(args.peer, args.setting);
    const out = await mainMain(args);
    log(`${args.peer} ${args.measure} ${args.setting}, n=${args.n}: ${describe(out)}`);
    const text = JSON.stringify(out, null, 2) + '\n';
    if (values.json) writeFileSync(values.json, text);
    process.stdout.write(text);
    if (out.ok === false) process.exitCode = 3;
}

main().catch((e) => {
    log(`bench.mjs: ${e.stack || e}`);
    process.exit(1);
});
