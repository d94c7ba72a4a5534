// run.mjs: insight's test suite, in one process that shares one database and
// one server (helpers.mjs): `node --test-reporter=tap test/run.mjs`, as
// test/run's insight suite runs it.
import "./api.test.mjs";
import "./sse.test.mjs";
import "./cli.test.mjs";
import "./docs.test.mjs";
