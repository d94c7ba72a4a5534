#!/usr/bin/env bash
# test/upgrade.sh: ALTER EXTENSION tuvl UPDATE from every release (0.1.0 and
# 0.2.0), each on a cluster of its own (test/run's "upgrade" suite; prints
# "ok"/"not ok" lines).  For each release:
#
# 1. Builds and installs it from the project's history (the last commit
#    before the next release began), starts a cluster with that library
#    and no workers, creates the extension and runs in the statuses 0.1.0
#    has: completed, failed, aborted, queued, paused and waiting_human.
# 2. Installs this tree's library (tuvl.control's version) and restarts with two workers
#    per database: before the update the workers wait, saying why, and run
#    nothing.
# 3. ALTER EXTENSION tuvl UPDATE: the schema equals a fresh install
#    (pg_dump -s of both compared), and the old runs go on: the queued one
#    completes, the paused one resumes and completes, the Human one takes
#    its answer and completes.
# Leaves this tree's build installed.
set -uo pipefail
cd "$(dirname "$0")/.."
. test/lib.sh

# the last commit of each release: the parent of the one that made the next the default
TUVL_V010=${TUVL_V010:-38d2ba7^}
TUVL_V020=${TUVL_V020:-52fbeb6^}
# the version this tree builds, and the update path to it from 0.1.0
NEW=$(sed -n "s/^default_version = '\(.*\)'/\1/p" "$TUVL_ROOT/tuvl.control")

oks=0
fails=0
check() {
    local what=$1
    shift
    if "$@"; then
        echo "ok - $what"
        oks=$((oks + 1))
    else
        echo "not ok - $what"
        fails=$((fails + 1))
    fi
}
sql() { psql -X -At -v ON_ERROR_STOP=1 -d "${DB:-tuvl_upgraded}" "$@"; }

# upgrade_from VERSION COMMIT PATH: install VERSION from COMMIT, make runs,
# update to this tree's version along PATH and check that they go on.
upgrade_from() {
local from=$1 commit=$2 path=$3
tuvl_log "upgrade from $from"
# a shallow clone lacks the history: deepen it (origin is where it came from)
if ! git -C "$TUVL_ROOT" cat-file -e "$commit^{commit}" 2>/dev/null; then
    git -C "$TUVL_ROOT" fetch -q --unshallow 2>/dev/null || true
fi
old_src=$(mktemp -d /tmp/tuvl-old.XXXXXX)
cleanup_old() { rm -rf "$old_src"; }
if ! git -C "$TUVL_ROOT" archive "$commit" | tar -x -C "$old_src"; then
    echo "not ok - the $from sources ($commit) are not in this clone's history"
    fails=$((fails + 1))
    cleanup_old
    return 1
fi
tuvl_log "building tuvl $from ($commit)"
if ! { make -s -C "$old_src" >/dev/null 2>&1 && make -s -C "$old_src" install >/dev/null 2>&1; }; then
    echo "not ok - tuvl $from builds"
    fails=$((fails + 1))
    cleanup_old
    tuvl_build
    return 1
fi

if ! TUVL_EXTRA_CONF="tuvl.workers_per_database = 0" tuvl_start; then
    echo "not ok - a cluster with tuvl $from starts"
    fails=$((fails + 1))
    return 1
fi
DB=postgres sql -c "CREATE DATABASE tuvl_upgraded" >/dev/null
sql -c "CREATE EXTENSION tuvl" >/dev/null
check "$from is installed" test "$(sql -c "SELECT extversion FROM pg_extension WHERE extname = 'tuvl'")" = "$from"

sql >/dev/null <<'SQL'
SELECT tuvl.register_workflow($$
name: quick
steps:
  - { id: s, kind: ModelOp, sql: "SELECT $1::int + 1 AS n", params: ["{{ n }}"], output: r, routes: { default: done } }
ends:
  - { id: done, status: completed, response: "{{ r.0.n }}" }
$$);
SELECT tuvl.register_workflow($$
name: asks
steps:
  - id: review
    kind: Human
    form: { type: object, required: [ok], properties: { ok: { type: boolean } } }
    output: answer
    routes: { default: done }
ends:
  - { id: done, status: completed, response: "{{ answer.ok }}" }
$$);
SELECT tuvl.run('quick', '{"n": 1}');                       -- completed
SELECT tuvl.run('quick', '{"n": "x"}');                     -- failed
SELECT tuvl.run('asks', '{}');                              -- waiting_human
SELECT tuvl.start_run('quick', '{"n": 10}');                -- queued
SELECT tuvl.start_run('quick', '{"n": 20}');                -- paused, below
SELECT tuvl.start_run('quick', '{"n": 30}');                -- aborted, below
SELECT tuvl.pause_run(5);
SELECT tuvl.abort_run(6, 'before the upgrade');
SQL
check "$from runs in six statuses" test "$(sql -c "SELECT string_agg(status, ',' ORDER BY id) FROM tuvl.runs")" \
    = "completed,failed,waiting_human,queued,paused,aborted"

as_pg "$PGBIN/pg_ctl" -D "$TUVL_PGDATA" -m fast -w stop >/dev/null
cleanup_old
tuvl_build
sed -i '/tuvl.workers_per_database = 0/d' "$TUVL_PGDATA/postgresql.conf"
as_pg "$PGBIN/pg_ctl" -D "$TUVL_PGDATA" -p "$TUVL_POSTGRES" -l "$TUVL_TMP/server.log" -w -t 120 start >/dev/null

waiting() { grep -q "tuvl worker waiting: extension tuvl is at version $from in this database, the library at $NEW" "$TUVL_TMP/server.log"; }
for _ in $(seq 1 100); do waiting && break; sleep 0.1; done
check "the $NEW workers wait for the update, saying why" waiting
sleep 1
check "and run nothing meanwhile" test "$(sql -c "SELECT status FROM tuvl.runs WHERE id = 4")" = queued
check "nothing crashed" bash -c "! grep -qE 'terminated by signal|PANIC' '$TUVL_TMP/server.log'"

check "ALTER EXTENSION tuvl UPDATE" sql -c "ALTER EXTENSION tuvl UPDATE" -o /dev/null
check "the extension is at $NEW" test "$(sql -c "SELECT extversion FROM pg_extension WHERE extname = 'tuvl'")" = "$NEW"
check "pg_extension_update_paths goes from $from to $NEW through each release" test \
    "$(sql -c "SELECT path FROM pg_extension_update_paths('tuvl') WHERE source = '$from' AND target = '$NEW'")" = "$path"

DB=postgres sql -c "CREATE DATABASE fresh" >/dev/null
DB=fresh sql -c "CREATE EXTENSION tuvl" >/dev/null
# --binary-upgrade dumps an extension's member objects one by one (a plain
# dump names only the extension); the OIDs it pins differ between databases
schema() {
    as_pg "$PGBIN/pg_dump" -h "$PGHOST" -p "$PGPORT" -U postgres -s --binary-upgrade "$1" \
        | grep -vE "binary_upgrade_set_next_|^-- Dumped|pg_catalog.setval|binary_upgrade_set_record_init_privs|^.(un)?restrict |relfrozenxid|^WHERE oid = '[0-9]+';" \
        | sed -E -e "s/'\{[0-9,]+\}'/'{oids}'/" -e "s/\b$1\b/DB/g"
}
schema tuvl_upgraded >"$TUVL_TMP/up.sql"
schema fresh >"$TUVL_TMP/fresh.sql"
check "the dump lists tuvl's tables" grep -q "CREATE TABLE tuvl.llm_versions" "$TUVL_TMP/up.sql"
if diff -u "$TUVL_TMP/fresh.sql" "$TUVL_TMP/up.sql" >"$TUVL_TMP/schema.diff"; then
    check "the updated schema equals a fresh $NEW install (pg_dump -s)" true
else
    head -40 "$TUVL_TMP/schema.diff"
    check "the updated schema equals a fresh $NEW install (pg_dump -s)" false
fi

finished() { sql -c "SELECT tuvl.wait($1, '30 s')"; }
check "the queued run completes" test "$(finished 4)" = completed
sql -c "SELECT tuvl.resume_run(5)" -o /dev/null
check "the paused run resumes and completes" test "$(finished 5)" = completed
sql -c "SELECT tuvl.submit(3, '{\"ok\": true}')" -o /dev/null
check "the Human step takes its answer and the run completes" test "$(finished 3)" = completed
check "their responses" test "$(sql -c "SELECT string_agg(response::text, ',' ORDER BY id) FROM tuvl.runs WHERE id IN (3, 4, 5)")" \
    = "true,11,21"
check "a new run on the updated schema" test "$(sql -c "SELECT tuvl.run('quick', '{\"n\": 41}') ->> 'response'")" = 42
check "the journals have no gaps" test "$(sql -c "SELECT count(*) FROM tuvl.runs r WHERE r.last_seq <> (SELECT count(*) FROM tuvl.events e WHERE e.run_id = r.id)")" = 0
check "nothing crashed after the update" bash -c "! grep -qE 'terminated by signal|PANIC' '$TUVL_TMP/server.log'"

tuvl_stop
}

upgrade_from 0.1.0 "$TUVL_V010" "0.1.0--0.2.0--$NEW"
upgrade_from 0.2.0 "$TUVL_V020" "0.2.0--$NEW"
echo "upgrade: $oks passed, $fails failed"
[ "$fails" -eq 0 ]
