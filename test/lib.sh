# test/lib.sh: shared by the demo and the test runner (source it).
#
# tuvl_setup      install missing Debian packages (quietly, idempotently),
#                 build and install the extension; with TUVL_ASAN=1, into a
#                 PostgreSQL built with AddressSanitizer (tuvl_asan_pg)
# tuvl_start      create and start a throwaway cluster in a temporary
#                 directory with its own port and socket directory; exports
#                 PGHOST, PGPORT, PGUSER, TUVL_TMP, TUVL_PGDATA
# tuvl_stop       stop everything started here and remove the directory
#                 (installed as an EXIT/INT/TERM trap by tuvl_start)
# tuvl_spawn CMD  start a helper server in the background; stopped by tuvl_stop
# tuvl_peers      start the peers the tests talk to on 127.0.0.1: the HTTP test
#                 server (TUVL_HTTP_PORT) and the reference MCP server
#                 @modelcontextprotocol/server-everything (TUVL_MCP_URL)
#                 and the scripted LLM server (TUVL_LLM_PORT, TUVL_LLM_URL)
#                 and an OTLP/HTTP trace receiver checking spans against
#                 OpenTelemetry's definitions (TUVL_OTLP_URL), and servers
#                 other people wrote: the MCP memory server behind the
#                 supergateway stdio bridge (TUVL_MCP2_URL) and the
#                 OpenAI-compatible openai-mock-api (TUVL_OPENAI_MOCK_URL);
#                 a peer that cannot start is an error, never a skipped test

TUVL_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PGBIN=${PGBIN:-/usr/lib/postgresql/15/bin}
# Debian's interpreter: python3-psycopg2 and python3-pytest are installed for it
# (a python3 earlier on PATH, e.g. from pyenv, may lack them).
TUVL_PYTHON=${TUVL_PYTHON:-/usr/bin/python3}
TUVL_PIDS=()

TUVL_PACKAGES="postgresql-15 postgresql-server-dev-15 libcurl4-openssl-dev libyaml-dev
postgresql-15-cron postgresql-15-pgtap libtap-parser-sourcehandler-pgtap-perl
python3 python3-psycopg2 python3-pytest python3-prometheus-client make gcc pkg-config procps iproute2
postgresql-15-auto-failover pg-auto-failover-cli postgresql-15-plproxy pg-bsd-indent"
# clang with libFuzzer's and AddressSanitizer's runtimes and the symbolizer:
# the fuzz harness (test/fuzz) and test/run asan add them to the install
TUVL_CLANG_PACKAGES="clang-14 libclang-rt-14-dev llvm-14"

tuvl_log() { printf '== %s\n' "$*" >&2; }

# Install what is missing (and TUVL_EXTRA_PACKAGES); a machine that has
# everything does no network work.
tuvl_install_packages() {
    local missing=() p
    for p in $TUVL_PACKAGES ${TUVL_VALGRIND:+valgrind} ${TUVL_EXTRA_PACKAGES:-}; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "missing packages: ${missing[*]} (run as root to install them)" >&2
        return 1
    fi
    tuvl_log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The reference MCP server, from npm, into test/servers/mcp (not committed).
TUVL_MCP_PACKAGE="@modelcontextprotocol/server-everything@2026.8.31"
tuvl_install_mcp() {
    local dir=$TUVL_ROOT/test/servers/mcp
    [ -x "$dir/node_modules/.bin/mcp-server-everything" ] && return 0
    if ! command -v npm >/dev/null 2>&1; then
        if [ "$(id -u)" -eq 0 ]; then
            tuvl_log "installing nodejs and npm"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
        else
            echo "npm is missing" >&2
            return 1
        fi
    fi
    tuvl_log "installing $TUVL_MCP_PACKAGE"
    mkdir -p "$dir"
    (cd "$dir" && npm install --no-audit --no-fund --silent "$TUVL_MCP_PACKAGE" >/dev/null)
}

# OpenTelemetry's protobuf definitions (as protobufjs types), from npm, into
# test/servers/otlp (not committed): the OTLP receiver checks spans with them.
TUVL_OTLP_PACKAGE="@opentelemetry/otlp-transformer@0.57.2"
tuvl_install_otlp() {
    local dir=$TUVL_ROOT/test/servers/otlp
    [ -f "$dir/node_modules/@opentelemetry/otlp-transformer/build/src/generated/root.js" ] && return 0
    command -v npm >/dev/null 2>&1 || tuvl_install_mcp || return 1
    tuvl_log "installing $TUVL_OTLP_PACKAGE"
    mkdir -p "$dir"
    (cd "$dir" && npm install --no-audit --no-fund --silent "$TUVL_OTLP_PACKAGE" >/dev/null)
}

# Servers other people wrote, pinned, from npm, into test/servers/peers (not
# committed): an OpenAI-compatible mock server, a stdio MCP server and the
# bridge that serves it over streamable HTTP (one child process per session).
TUVL_PEER_PACKAGES="openai-mock-api@0.4.0 supergateway@4.0.0 @modelcontextprotocol/server-memory@2026.8.31"
tuvl_install_npm_peers() {
    local dir=$TUVL_ROOT/test/servers/peers
    [ -x "$dir/node_modules/.bin/openai-mock-api" ] && [ -x "$dir/node_modules/.bin/supergateway" ] &&
        [ -x "$dir/node_modules/.bin/mcp-server-memory" ] && return 0
    command -v npm >/dev/null 2>&1 || tuvl_install_mcp || return 1
    tuvl_log "installing $TUVL_PEER_PACKAGES"
    mkdir -p "$dir"
    # shellcheck disable=SC2086
    (cd "$dir" && npm install --no-audit --no-fund --silent $TUVL_PEER_PACKAGES >/dev/null)
}

# The MCP memory server (stdio) behind supergateway's stateful streamable
# HTTP bridge, on port $1; its knowledge graph in $TUVL_TMP.
tuvl_start_mcp2() {
    local bin=$TUVL_ROOT/test/servers/peers/node_modules/.bin
    MEMORY_FILE_PATH=$TUVL_TMP/memory.jsonl tuvl_spawn "$bin/supergateway" --stdio "$bin/mcp-server-memory" \
        --outputTransport streamableHttp --stateful --port "$1" --logLevel none >"$TUVL_TMP/mcp2.log" 2>&1
    tuvl_wait_port "$1"
}

tuvl_build() {
    if [ -n "${TUVL_ASAN:-}" ]; then
        tuvl_asan_build
        return
    fi
    tuvl_log "building tuvl"
    # warnings are errors in the test build (COPT=... to override)
    make -s -C "$TUVL_ROOT" COPT="${COPT--Werror}" >/dev/null
    make -s -C "$TUVL_ROOT" install >/dev/null
}

# TUVL_ASAN=1 (test/run asan): the server under AddressSanitizer.  PostgreSQL
# 15 from Debian's source package (the version installed, from a deb-src
# entry this adds), built by clang with AddressSanitizer and assertions into
# a prefix of its own, $TUVL_ASAN_DIR/pg (src/ holds the sources), with
# pg_cron built the same way (or Debian's build, when the archive lacks
# its sources) and pgTAP's SQL; built once (some 15 minutes on two cores),
# then reused.  tuvl is built out of the tree, in
# $TUVL_ASAN_DIR/tuvl, so that src/*.o stay the plain build's.  The ASan
# runtime is linked into postgres: the postmaster forks without exec, so a
# preloaded one would not reach the children it starts.
TUVL_ASAN_DIR=${TUVL_ASAN_DIR:-/opt/tuvl-asan}
TUVL_ASAN_PACKAGES="dpkg-dev bison flex"
TUVL_ASAN_CFLAGS="-O1 -g -fno-omit-frame-pointer -fsanitize=address"

# deb-src entries for the suites the machine installs from (bookworm's)
tuvl_asan_sources() {
    local f=/etc/apt/sources.list.d/tuvl-deb-src.sources
    apt-cache showsrc postgresql-15 2>/dev/null | grep '^Package:' >/dev/null && return 0
    cat >"$f" <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    apt-get update -qq >/dev/null
}

# Fetch Debian source package $1 into the current directory: the version
# installed package $2 comes from, else the newest the archive serves (a
# mirror may lack a security update's sources); prints where it unpacked.
# Debian's patches are left out: they move the library directory to
# /usr/lib/postgresql/15/lib, where this build would replace Debian's.
tuvl_asan_fetch() {
    local v
    for v in $(dpkg-query -W -f='${source:Version}' "$2") \
        $(apt-cache showsrc "$1" | sed -n 's/^Version: //p' | sort -rV); do
        if apt-get source --download-only -qq "$1=$v" >/dev/null 2>&1 &&
            dpkg-source -x --skip-patches "$1_${v#*:}.dsc" "$1-src" >/dev/null 2>&1; then
            echo "$PWD/$1-src"
            return 0
        fi
    done
    return 1
}

tuvl_asan_pg() {
    local prefix=$TUVL_ASAN_DIR/pg src=$TUVL_ASAN_DIR/src log=$TUVL_ASAN_DIR/build.log stamp dir
    stamp="$(dpkg-query -W -f='${Version} ${source:Version}' postgresql-15 postgresql-15-cron) $TUVL_ASAN_CFLAGS"
    if [ "$(cat "$prefix/.tuvl-stamp" 2>/dev/null)" != "$stamp" ]; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "no AddressSanitizer build in $prefix (run as root to make one)" >&2
            return 1
        fi
        tuvl_log "building PostgreSQL with AddressSanitizer into $prefix (log: $log)"
        # the sources, configured, are kept: a build that stopped goes on
        if [ "$(cat "$src/.tuvl-configured" 2>/dev/null)" != "$stamp" ]; then
            tuvl_asan_sources || return 1
            rm -rf "$src"
            mkdir -p "$src"
            (cd "$src" && dir=$(tuvl_asan_fetch postgresql-15 postgresql-15) && cd "$dir" &&
                echo "== configure" && ASAN_OPTIONS=detect_leaks=0 ./configure --prefix="$prefix" \
                    --enable-cassert --enable-debug --without-icu --without-readline --without-zlib \
                    --without-llvm --disable-nls --with-system-tzdata=/usr/share/zoneinfo CC=clang-14 \
                    CFLAGS="$TUVL_ASAN_CFLAGS" LDFLAGS="-fsanitize=address" &&
                # nothing of this build may land outside its prefix
                ! grep -n '/usr/lib/postgresql' src/Makefile.global) >"$log" 2>&1 ||
                { tail -20 "$log" >&2; return 1; }
            echo "$stamp" >"$src/.tuvl-configured"
        fi
        dir=$src/postgresql-15-src
        # pg_cron, preloaded by the test cluster, is built against this
        # server, or when the archive lacks its sources Debian's build is
        # copied (same major version, and no sanitizer in it); pgTAP is SQL
        if ! (export ASAN_OPTIONS=detect_leaks=0
            echo "== make" && nice -n 10 make -C "$dir" -s -j2 &&
                echo "== install" && rm -rf "$prefix" && make -C "$dir" -s install &&
                echo "== pg_cron" && cd "$src" && rm -rf pg-cron* && {
                { cron=$(tuvl_asan_fetch pg-cron postgresql-15-cron) &&
                    nice -n 10 make -C "$cron" -s PG_CONFIG="$prefix/bin/pg_config" &&
                    make -C "$cron" -s install PG_CONFIG="$prefix/bin/pg_config"; } ||
                    { echo "pg_cron's sources are not in the archive: Debian's build copied" &&
                        cp /usr/lib/postgresql/15/lib/pg_cron.so "$("$prefix/bin/pg_config" --pkglibdir)/" &&
                        cp /usr/share/postgresql/15/extension/pg_cron* \
                            "$("$prefix/bin/pg_config" --sharedir)/extension/"; }; } &&
                cp /usr/share/postgresql/15/extension/pgtap* "$("$prefix/bin/pg_config" --sharedir)/extension/"
        ) >>"$log" 2>&1; then
            tail -20 "$log" >&2
            return 1
        fi
        echo "$stamp" >"$prefix/.tuvl-stamp"
    fi
    export PG_CONFIG=$prefix/bin/pg_config PGBIN=$prefix/bin
    # every program of the build (pg_config, initdb, psql) would report leaks
    # at exit, and end with status 23, having lost what it wrote to a pipe
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
}

# tuvl built with the ASan build's flags, out of the tree, from a copy of
# its sources in $TUVL_ASAN_DIR/tuvl; its reports do not stop the process
# (tuvl_asan_options).
tuvl_asan_build() {
    local b=$TUVL_ASAN_DIR/tuvl
    tuvl_log "building tuvl with AddressSanitizer in $b"
    # objects of other flags or another tree are built again
    if [ "$(cat "$b/.flags" 2>/dev/null)" != "$TUVL_ROOT $PG_CONFIG recover copy" ]; then
        rm -rf "$b"
        mkdir -p "$b"
        echo "$TUVL_ROOT $PG_CONFIG recover copy" >"$b/.flags"
    fi
    mkdir -p "$b/src"
    # a copy of the sources, without the plain build's objects (through
    # VPATH, make would take those for up to date ones and link them
    # uninstrumented); mtimes are kept, so only what changed is built again
    find "$b/src" \( -name '*.c' -o -name '*.h' \) -delete
    (cd "$TUVL_ROOT" && tar cf - --exclude='*.o' --exclude='*.bc' --exclude='*.so' \
        Makefile exports.map ./*.control README.md sql src) | (cd "$b" && tar xf -) || return 1
    make -s -C "$b" PG_CONFIG="$PG_CONFIG" COPT=-fsanitize-recover=address >/dev/null &&
        make -s -C "$b" PG_CONFIG="$PG_CONFIG" install >/dev/null &&
        # instrumented, or nothing checks tuvl's own memory accesses
        nm "$b/tuvl.so" | grep '__asan_report_load' >/dev/null ||
        { echo "tuvl.so in $b is not instrumented by AddressSanitizer" >&2; return 1; }
}

# The server's ASAN_OPTIONS: reports to $1.<pid>; no leak checks (a
# backend keeps its memory to the end by design, and a leak report would
# change every exit status); a report in tuvl's code does not stop the
# process (tuvl is built with -fsanitize-recover=address), so one run
# collects every report and one bug does not fail the tests after it; a
# report that stops a process (in PostgreSQL's code, a failed assertion, a
# segfault) ends it with status 1, as a FATAL error does, not with abort(),
# which the postmaster would answer by restarting every session; malloc
# may fail, as PostgreSQL expects; a smaller quarantine, for forty
# processes.
tuvl_asan_options() {
    local sym
    sym=$(command -v llvm-symbolizer-14 || true)
    echo "log_path=$1:detect_leaks=0:halt_on_error=0:abort_on_error=0:exitcode=1:handle_abort=1:handle_segv=1:allocator_may_return_null=1:quarantine_size_mb=32:malloc_context_size=20:detect_stack_use_after_return=0${sym:+:external_symbolizer_path=$sym}"
}

# The ASan reports in $1 (files $1.<pid>) whose stack passes through tuvl
# (its library, or its sources in this tree): their number; with -s, one
# line per place (the report's kind and its first frame in tuvl) with its
# count, then the first report of each place.
tuvl_asan_reports() {
    local summary=
    [ "$1" = -s ] && { summary=1; shift; }
    TUVL_SUMMARY=$summary "$TUVL_PYTHON" - "$TUVL_ROOT/src/" "$1".* <<'PY'
import collections, os, re, sys
ours = re.compile(r"/tuvl\.so\b|" + re.escape(sys.argv[1]))
places = collections.OrderedDict()
for path in sys.argv[2:]:
    if not os.path.isfile(path):
        continue
    text = open(path, errors="replace").read()
    for r in re.split(r"\n(?===\d+==ERROR: )", "\n" + text):
        if "==ERROR: " not in r or not ours.search(r):
            continue
        kind = re.search(r"ERROR: AddressSanitizer: ([\w-]+)", r)
        frame = next((l.strip() for l in r.splitlines() if re.match(r"\s*#\d+ ", l) and ours.search(l)), "?")
        key = (kind.group(1) if kind else "?", re.sub(r"^#\d+ 0x[0-9a-f]+ in ", "", frame))
        places.setdefault(key, [0, path, r.strip()])[0] += 1
if os.environ.get("TUVL_SUMMARY"):
    for (kind, frame), (n, path, report) in places.items():
        print(f"{n} x {kind} at {frame} ({path})")
    for (kind, frame), (n, path, report) in places.items():
        print("\n".join(report.splitlines()[:40]) + "\n")
else:
    print(sum(v[0] for v in places.values()))
PY
}

# TUVL_VALGRIND=1 runs the server (and every backend and worker) under
# valgrind's memcheck, through a wrapper pg_ctl starts instead of postgres;
# reports go to $TUVL_TMP/valgrind.<pid>, and tuvl_valgrind_reports counts
# the errors whose stack passes through tuvl.  Slow: for a subset of the
# suites (test/run regress, or pytest -k ...), not for timed tests.
tuvl_postgres() {
    if [ -n "${TUVL_VALGRIND:-}" ]; then
        local w=$TUVL_TMP/postgres-valgrind
        cat >"$w" <<WRAP
#!/bin/sh
exec valgrind --quiet --trace-children=yes --leak-check=no --num-callers=30 \\
    --log-file=$TUVL_TMP/valgrind.%p $PGBIN/postgres "\$@"
WRAP
        chmod 755 "$w"
        echo "$w"
    else
        echo "$PGBIN/postgres"
    fi
}

tuvl_valgrind_reports() {
    cat "$TUVL_TMP"/valgrind.* 2>/dev/null | "$TUVL_PYTHON" -c '
import re, sys
blocks = re.split(r"\n==\d+== \n", sys.stdin.read())
print(sum(1 for b in blocks if "tuvl.so" in b and re.search(r"Invalid|uninitialised|Mismatched|overlap", b)))'
}

tuvl_setup() {
    if [ -n "${TUVL_ASAN:-}" ]; then
        TUVL_EXTRA_PACKAGES="${TUVL_EXTRA_PACKAGES:-} $TUVL_CLANG_PACKAGES $TUVL_ASAN_PACKAGES" \
            tuvl_install_packages || return 1
        tuvl_asan_pg || return 1
    else
        tuvl_install_packages || return 1
    fi
    tuvl_build
}

# The suites beyond one server need pg_autoctl (on PATH) and the
# pgautofailover and plproxy extensions in the installation PG_CONFIG
# names.  Debian's packages put them into the system PostgreSQL, which is
# PG_CONFIG's on CI; a private installation (PG_CONFIG elsewhere) must
# hold copies of its own.  Missing, the suite fails: it never skips.
tuvl_require_extension() {
    local share
    share=$("${PG_CONFIG:-pg_config}" --sharedir)
    [ -f "$share/extension/$1.control" ] && return 0
    echo "extension $1 is not installed in $share (package $2)" >&2
    return 1
}

# Wait until something listens on 127.0.0.1:$1.
tuvl_wait_port() {
    local i
    for i in $(seq 1 100); do
        (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0
        sleep 0.1
    done
    echo "nothing listens on port $1" >&2
    return 1
}

# The project's scripted LLM server: the offline model of the demo and tests
# (TUVL_LLM_SCRIPTS: a JSON file of scripts to load at start).
tuvl_start_llm() {
    TUVL_LLM_PORT=$(tuvl_free_port)
    tuvl_spawn "$TUVL_PYTHON" "$TUVL_ROOT/test/servers/llm_server.py" --port "$TUVL_LLM_PORT" \
        ${TUVL_LLM_SCRIPTS:+--scripts "$TUVL_LLM_SCRIPTS"} 2>"$TUVL_TMP/llm.log"
    tuvl_wait_port "$TUVL_LLM_PORT"
    export TUVL_LLM_PORT TUVL_LLM_URL="http://127.0.0.1:$TUVL_LLM_PORT/v1"
}

tuvl_peers() {
    TUVL_HTTP_PORT=$(tuvl_free_port)
    tuvl_spawn "$TUVL_PYTHON" "$TUVL_ROOT/test/servers/http_server.py" --port "$TUVL_HTTP_PORT"
    tuvl_wait_port "$TUVL_HTTP_PORT"
    export TUVL_HTTP_PORT
    tuvl_start_llm
    tuvl_install_mcp || return 1
    local port
    port=$(tuvl_free_port)
    PORT=$port tuvl_spawn "$TUVL_ROOT/test/servers/mcp/node_modules/.bin/mcp-server-everything" \
        streamableHttp >"$TUVL_TMP/mcp.log" 2>&1
    tuvl_wait_port "$port" || return 1
    export TUVL_MCP_URL="http://127.0.0.1:$port/mcp" TUVL_MCP_PORT=$port
    tuvl_install_otlp || return 1
    TUVL_OTLP_PORT=$(tuvl_free_port)
    tuvl_spawn node "$TUVL_ROOT/test/servers/otlp_receiver.js" --port "$TUVL_OTLP_PORT" 2>"$TUVL_TMP/otlp.log"
    tuvl_wait_port "$TUVL_OTLP_PORT" || return 1
    export TUVL_OTLP_PORT TUVL_OTLP_URL="http://127.0.0.1:$TUVL_OTLP_PORT"
    tuvl_install_npm_peers || return 1
    TUVL_MCP2_PORT=$(tuvl_free_port)
    tuvl_start_mcp2 "$TUVL_MCP2_PORT" || return 1
    export TUVL_MCP2_PORT TUVL_MCP2_URL="http://127.0.0.1:$TUVL_MCP2_PORT/mcp"
    TUVL_OPENAI_MOCK_PORT=$(tuvl_free_port)
    tuvl_spawn "$TUVL_ROOT/test/servers/peers/node_modules/.bin/openai-mock-api" \
        --config "$TUVL_ROOT/test/servers/openai_mock.yaml" --port "$TUVL_OPENAI_MOCK_PORT" >"$TUVL_TMP/openai_mock.log" 2>&1
    tuvl_wait_port "$TUVL_OPENAI_MOCK_PORT" || return 1
    export TUVL_OPENAI_MOCK_PORT TUVL_OPENAI_MOCK_URL="http://127.0.0.1:$TUVL_OPENAI_MOCK_PORT/v1"
    # under test/run a test whose peer is missing fails instead of skipping
    export TUVL_REQUIRE_PEERS=1
    tuvl_log "peers: HTTP test server on $TUVL_HTTP_PORT, LLM server at $TUVL_LLM_URL, MCP servers at $TUVL_MCP_URL and $TUVL_MCP2_URL, OTLP receiver at $TUVL_OTLP_URL, openai-mock-api at $TUVL_OPENAI_MOCK_URL"
}

# Run a server-side command as the cluster's owner (initdb refuses root).
as_pg() {
    if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

tuvl_free_port() {
    "$TUVL_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

tuvl_start() {
    TUVL_TMP=$(mktemp -d /tmp/tuvl-test.XXXXXX)
    trap tuvl_stop EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    chmod 755 "$TUVL_TMP"
    [ "$(id -u)" -eq 0 ] && chown postgres: "$TUVL_TMP"
    TUVL_PGDATA=$TUVL_TMP/data
    PGPORT=$(tuvl_free_port)
    as_pg "$PGBIN/initdb" -D "$TUVL_PGDATA" -U postgres -A trust --no-sync -E UTF8 \
        --locale=C >"$TUVL_TMP/initdb.log" 2>&1 || { cat "$TUVL_TMP/initdb.log" >&2; return 1; }
    cat >>"$TUVL_PGDATA/postgresql.conf" <<CONF
port = $PGPORT
unix_socket_directories = '$TUVL_TMP'
listen_addresses = '127.0.0.1'
shared_preload_libraries = 'tuvl,pg_cron'
cron.database_name = 'postgres'
max_worker_processes = 40
max_connections = 200
log_line_prefix = '%m [%p] %q%a '
tuvl.http_allowed_hosts = '127.0.0.1:*,localhost:*'
${TUVL_EXTRA_CONF:-}
CONF
    TUVL_POSTGRES=$(tuvl_postgres)
    as_pg "$PGBIN/pg_ctl" -D "$TUVL_PGDATA" -p "$TUVL_POSTGRES" -l "$TUVL_TMP/server.log" -w -t 300 start >/dev/null \
        || { tail -20 "$TUVL_TMP/server.log" >&2; return 1; }
    export PGHOST=$TUVL_TMP PGPORT PGUSER=postgres TUVL_TMP TUVL_PGDATA TUVL_POSTGRES
    tuvl_log "cluster on port $PGPORT in $TUVL_TMP"
}

tuvl_spawn() {
    "$@" &
    TUVL_PIDS+=($!)
}

tuvl_stop() {
    local rc=$? pid
    trap - EXIT INT TERM
    for pid in "${TUVL_PIDS[@]}"; do
        # a killed server's status is not ours (and must not trip set -e)
        { kill "$pid" && wait "$pid"; } 2>/dev/null || true
    done
    TUVL_PIDS=()
    if [ -n "${TUVL_PGDATA:-}" ] && [ -f "$TUVL_PGDATA/postmaster.pid" ]; then
        as_pg "$PGBIN/pg_ctl" -D "$TUVL_PGDATA" -m immediate -w stop >/dev/null 2>&1 || true
    fi
    if [ -n "${TUVL_TMP:-}" ] && [ -d "$TUVL_TMP" ]; then
        [ -n "${TUVL_KEEP_LOG:-}" ] && cp "$TUVL_TMP/server.log" "$TUVL_KEEP_LOG" 2>/dev/null
        rm -rf "$TUVL_TMP"
    fi
    TUVL_TMP=
    TUVL_PGDATA=
    return $rc
}
