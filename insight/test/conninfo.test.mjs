// conninfo.test.mjs: libpq's connection strings as insight/tuvl reads them
// (src/conninfo.ts): multi-host key=value and URI forms, and
// target_session_attrs; the options the server's sessions start with.
import assert from "node:assert/strict";
import { test } from "node:test";

import { connSettings } from "../dist/conninfo.js";

/* Without the environment's PGHOST, PGPORT... (test/run sets them). */
function parse(text) {
    const saved = {};
    for (const k of ["PGHOST", "PGHOSTADDR", "PGPORT", "PGUSER", "PGDATABASE", "PGTARGETSESSIONATTRS", "PGPASSWORD"]) {
        saved[k] = process.env[k];
        delete process.env[k];
    }
    try {
        return connSettings(text, "test");
    } finally {
        for (const [k, v] of Object.entries(saved)) if (v !== undefined) process.env[k] = v;
    }
}

const hosts = (s) => s.hosts.map((h) => `${h.host}:${h.port}`);

test("conninfo: multi-host key=value, one port per host or one for all", () => {
    let s = parse("host=a,b port=5432,5433 dbname=shop user=app target_session_attrs=read-write");
    assert.deepEqual(hosts(s), ["a:5432", "b:5433"]);
    assert.equal(s.targetSessionAttrs, "read-write");
    assert.equal(s.base.database, "shop");
    assert.equal(s.base.user, "app");
    assert.equal(s.base.host, undefined, "the hosts are not in the base config");
    s = parse("host=a,b,c port=6000");
    assert.deepEqual(hosts(s), ["a:6000", "b:6000", "c:6000"]);
    s = parse("host=a,,c port=1,,3");
    assert.equal(s.hosts[1].port, 5432, "an empty port is the default");
    s = parse("host=a,b hostaddr=10.0.0.1,10.0.0.2 port=1,2");
    assert.deepEqual(hosts(s), ["10.0.0.1:1", "10.0.0.2:2"]);
    s = parse("host='/tmp/s one,/tmp/two' port=5433");
    assert.deepEqual(hosts(s), ["/tmp/s one:5433", "/tmp/two:5433"]);
    assert.equal(parse("host=a").targetSessionAttrs, "any");
});

test("conninfo: multi-host URIs, IPv6, percent-encoding, query parameters", () => {
    let s = parse("postgresql://app:s%40cret@h1:5432,h2:5433/shop?target_session_attrs=primary&connect_timeout=2");
    assert.deepEqual(hosts(s), ["h1:5432", "h2:5433"]);
    assert.equal(s.targetSessionAttrs, "primary");
    assert.equal(s.base.user, "app");
    assert.equal(s.base.password, "s@cret");
    assert.equal(s.base.database, "shop");
    assert.equal(s.base.connectionTimeoutMillis, 2000);
    s = parse("postgres://[::1]:6000,[fe80::2],h3/db");
    assert.deepEqual(hosts(s), ["::1:6000", "fe80::2:5432", "h3:5432"]);
    s = parse("postgresql://h1,h2:7000/db");
    assert.deepEqual(hosts(s), ["h1:5432", "h2:7000"]);
    s = parse("postgresql:///db?host=%2Fvar%2Frun%2Fpostgresql&port=5433&user=me");
    assert.deepEqual(hosts(s), ["/var/run/postgresql:5433"]);
    assert.equal(s.base.user, "me");
    s = parse("postgresql://%2Ftmp:5999/db");
    assert.deepEqual(hosts(s), ["/tmp:5999"]);
    s = parse("postgresql://h/db?target_session_attrs=prefer-standby&ssl=true");
    assert.equal(s.targetSessionAttrs, "prefer-standby");
    assert.deepEqual(s.base.ssl, { rejectUnauthorized: false });
});

test("conninfo: target_session_attrs from the environment, and bad ones refused as libpq does", () => {
    process.env.PGTARGETSESSIONATTRS = "standby";
    try {
        assert.equal(connSettings("host=a", "t").targetSessionAttrs, "standby");
        assert.equal(connSettings("host=a target_session_attrs=any", "t").targetSessionAttrs, "any");
    } finally {
        delete process.env.PGTARGETSESSIONATTRS;
    }
    assert.throws(() => parse("host=a target_session_attrs=master"), /invalid target_session_attrs value: "master"/);
    assert.throws(() => parse("host=a,b,c port=1,2"), /could not match 2 port numbers to 3 hosts/);
    assert.throws(() => parse("host=a port=1,2"), /could not match 2 port numbers to 1 hosts/);
    assert.throws(() => parse("host=a,b hostaddr=1.2.3.4"), /could not match 2 host names to 1 hostaddr values/);
    assert.throws(() => parse("host=a,b port=1,x"), /invalid port number: "x"/);
    assert.throws(() => parse("postgresql://h1,h2/db?target_session_atrs=any"), /invalid URI query parameter: "target_session_atrs"/);
    assert.throws(() => parse("postgresql://[::1:5432/db"), /IPv6/);
    assert.throws(() => parse("postgresql://h/d%zzb"), /invalid percent-encoded token/);
});

test("conninfo: the server's sessions run without JIT, unless options turn it on", async () => {
    const pg = (await import("pg")).default;
    const show = async (text) => {
        const { hosts, base } = connSettings(text, "test");
        const c = new pg.Client({ ...base, host: hosts[0].host, port: hosts[0].port });
        await c.connect();
        try {
            return (await c.query("SELECT current_setting('jit') AS jit, current_setting('work_mem') AS wm")).rows[0];
        } finally {
            await c.end();
        }
    };
    /* test/run's environment names the cluster (PGHOST, PGPORT, PGUSER) */
    assert.equal((await show("dbname=postgres")).jit, "off");
    assert.deepEqual(await show("dbname=postgres options='-c work_mem=1234kB'"), { jit: "off", wm: "1234kB" });
    assert.equal((await show("dbname=postgres options='-c jit=on'")).jit, "on");
});
