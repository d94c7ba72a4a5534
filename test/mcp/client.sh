#!/usr/bin/env bash
# test/mcp/client.sh: the client command of the MCP conformance suite.
#
# The suite (@modelcontextprotocol/conformance, run by test/mcp/run.sh)
# starts a server for one scenario and runs
#
#   test/mcp/client.sh <server-url>
#
# with MCP_CONFORMANCE_SCENARIO naming the scenario and, for some scenarios,
# MCP_CONFORMANCE_CONTEXT holding a JSON object (client_id, client_secret,
# ...).  This script is a user of tuvl, through SQL only: it registers a
# workflow whose MCP step does what the scenario asks of a client, runs it
# with tuvl.run() and exits 0 when the run ended as it must, 1 otherwise
# (with the reason on stderr, which the suite saves).  It connects with the
# libpq environment it inherits (PGHOST, PGPORT, PGUSER, PGDATABASE: a
# database with the tuvl extension, whose tuvl.http_allowed_hosts allows
# localhost:*), as a superuser.
#
# Authorization-code scenarios play the person too: when a step fails
# because the server wants an OAuth authorization tuvl does not hold yet
# (its error names tuvl.mcp_connect()), the script calls
# tuvl.mcp_connect(url, auth), follows the authorization URL it returns
# without following the redirect (the suite's authorization server
# approves at once and redirects to the redirect URI with the code), hands
# that redirect to tuvl.mcp_connect_finish() and runs the workflow again; at
# most three times, as a person would give up (auth/scope-retry-limit).
#
# The auth/* branches are written against the interface issue 40 plans
# (the mcp.auth key, tuvl.mcp_connect(), tuvl.mcp_connect_finish()), which
# tuvl does not have yet: those scenarios fail with "the workflow was not
# registered" and are listed, with that reason, in
# test/mcp/conformance-expected.yml until the feature lands.
set -uo pipefail

url=${1:?usage: MCP_CONFORMANCE_SCENARIO=<scenario> $0 <server-url>}
scenario=${MCP_CONFORMANCE_SCENARIO:?MCP_CONFORMANCE_SCENARIO is not set}
ctx=${MCP_CONFORMANCE_CONTEXT:-'{}'}

PSQL=psql
[ -n "${PGBIN:-}" ] && [ -x "$PGBIN/psql" ] && PSQL=$PGBIN/psql
# a scenario's server gives up after 30 s: so does everything here
export PGOPTIONS="${PGOPTIONS:-} -c statement_timeout=25s"

# The client-ID metadata document tuvl offers where the authorization server
# takes one (the URL the suite's reference client uses; nothing fetches it).
CIMD_URL=https://conformance-test.local/client-metadata.json
# Where the authorization server sends the person back; never fetched here.
REDIRECT_URI=http://localhost:3000/callback

die() { echo "client.sh ($scenario): $*" >&2; exit 1; }

# psql with the scenario's values as variables (:'url', :'ctx', :'name',
# :'auth', :'secret'), the SQL on stdin
sql() {
    "$PSQL" -qAtX -F $'\x1f' -v ON_ERROR_STOP=1 -v url="$url" -v ctx="$ctx" -v name="$name" \
        -v auth="${auth:-null}" -v secret="${secret:-}" -v redirect="$REDIRECT_URI" "$@"
}

ctx_get() { sql <<<"SELECT :'ctx'::jsonb ->> '$1'"; }

name=conformance_$(printf '%s' "$scenario" | tr -c 'a-z0-9' '_')_$$

# One MCP step calling $1 with arguments $2 (YAML flow mapping), plus any
# further keys of the mcp mapping in $3; ends "done" with the tool's result,
# or "oops" with the error.
register() {
    local yaml
    yaml="name: $name
steps:
  - id: call
    kind: MCP
    mcp:
      url: \"{{ url }}\"
      tool: $1
      arguments: $2
      timeout: 20s${3:+
      $3}
    output: res
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: { text: \"{{ res.text }}\" } }
  - { id: oops, status: completed, response: { error: \"{{ _last_error }}\", type: \"{{ _last_error_type }}\" } }
"
    sql -v yaml="$yaml" <<<"SELECT tuvl.register_workflow(:'yaml')" >/dev/null ||
        die "the workflow was not registered"
}

# Run the workflow once; sets end_name, text, error.
run() {
    local out
    out=$(sql <<'SQL'
SELECT r ->> 'end', translate(coalesce(r -> 'response' ->> 'text', ''), E'\n\r', '  '),
       translate(coalesce(r -> 'response' ->> 'error', r ->> 'error', ''), E'\n\r', '  ')
FROM tuvl.run(:'name', jsonb_build_object('url', :'url')) AS r
SQL
    ) || die "tuvl.run() failed"
    IFS=$'\x1f' read -r end_name text error <<<"$out"
}

# Run; when it ends "done" and its text contains $1, succeed.
expect_text() {
    run
    [ "$end_name" = done ] || die "the MCP step failed: $error"
    case "$text" in
        *"$1"*) exit 0 ;;
        *) die "unexpected tool result: $text" ;;
    esac
}

# The authorization-code grant, a person clicking "connect" up to 3 times.
authorization_code() {
    local connects=0 location authz
    while :; do
        run
        [ "$end_name" = done ] && exit 0
        case "$error" in
            *mcp_connect*) ;;
            *) die "the MCP step failed: $error" ;;
        esac
        [ $connects -ge 3 ] && die "still refused after $connects authorizations: $error"
        connects=$((connects + 1))
        authz=$(sql <<'SQL'
SET tuvl.oauth_redirect_uri = :'redirect';
SELECT tuvl.mcp_connect(:'url', :'auth'::jsonb);
SQL
        ) || die "tuvl.mcp_connect() failed"
        location=$(curl -s -o /dev/null --max-time 10 -w '%{redirect_url}' "$authz") ||
            die "the authorization URL $authz did not answer"
        [ -n "$location" ] || die "the authorization URL $authz did not redirect"
        sql -v callback="$location" <<<"SELECT tuvl.mcp_connect_finish(:'callback')" >/dev/null ||
            die "tuvl.mcp_connect_finish() failed"
    done
}

case "$scenario" in
    initialize)
        # a client that connects and lists the tools (the server has none)
        tools=$(sql <<<"SELECT tuvl.mcp_list_tools(:'url')") || die "tuvl.mcp_list_tools() failed"
        [ "$tools" = "[]" ] || die "unexpected tools: $tools"
        ;;
    tools_call)
        register add_numbers "{ a: 2, b: 40 }"
        expect_text "The sum of 2 and 40 is 42"
        ;;
    sse-retry)
        register test_reconnection "{}"
        expect_text "Reconnection test completed successfully"
        ;;
    elicitation-sep1034-client-defaults)
        # unattended: accept what the server asks for with its defaults
        register test_client_elicitation_defaults "{}" "elicitation: accept_defaults"
        expect_text ""
        ;;
    auth/client-credentials-basic)
        secret=$name
        sql -v value="$(ctx_get client_secret)" <<<"SELECT tuvl.set_secret(:'secret', :'value')" >/dev/null ||
            die "tuvl.set_secret() failed"
        register test-tool "{}" "auth: { oauth: { grant: client_credentials, client_id: \"$(ctx_get client_id)\", client_secret_secret: $secret } }"
        expect_text ""
        ;;
    auth/client-credentials-jwt)
        # private_key_jwt: tuvl's mcp.auth has no key to sign with; the
        # client-credentials grant with what it has is refused
        die "private_key_jwt client authentication is not offered by tuvl's mcp.auth"
        ;;
    auth/cross-app-access-complete-flow)
        die "cross-app access (an identity provider's ID token exchanged for a grant, SEP-990) is not offered by tuvl's mcp.auth"
        ;;
    auth/pre-registration)
        secret=$name
        sql -v value="$(ctx_get client_secret)" <<<"SELECT tuvl.set_secret(:'secret', :'value')" >/dev/null ||
            die "tuvl.set_secret() failed"
        auth="{\"oauth\": {\"grant\": \"authorization_code\", \"client_id\": \"$(ctx_get client_id)\", \"client_secret_secret\": \"$secret\"}}"
        register test-tool "{}" "auth: $auth"
        authorization_code
        ;;
    auth/*)
        # every other auth scenario: a public client identified by its
        # client-ID metadata document where the server takes one, else
        # registered dynamically, authorized by a person
        auth="{\"oauth\": {\"grant\": \"authorization_code\", \"client_id\": \"$CIMD_URL\"}}"
        register test-tool "{}" "auth: $auth"
        authorization_code
        ;;
    *)
        die "no client behaviour for this scenario; add one to test/mcp/client.sh"
        ;;
esac
exit 0
