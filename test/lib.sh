# test/lib.sh: shared by the demo and the test runner (source it).
#
# tuvl_setup      install missing Debian packages (quietly, idempotently),
#                 build and install the extension
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
postgresql-15-auto-failover pg-auto-failover-cli postgresql-15-plproxy"

tuvl_log() { printf '== %s\n' "$*" >&2; }

# Install what is missing; a machine that has everything does no network work.
tuvl_install_packages() {
    local missing=() p
    for p in $TUVL_PACKAGES ${TUVL_VALGRIND:+valgrind}; do
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
    tuvl_log "building tuvl"
    make -s -C "$TUVL_ROOT" >/dev/null
    make -s -C "$TUVL_ROOT" install >/dev/null
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
    tuvl_install_packages
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
