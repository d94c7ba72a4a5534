#!/usr/bin/env bash
# test/fuzz/run.sh: build the libFuzzer harness and run it (docs/fuzzing.md).
#
#   test/fuzz/run.sh smoke [TARGET...]     replay each target's seed corpus, then fuzz
#                                          it TUVL_FUZZ_SMOKE_SECONDS (3) seconds
#                                          (test/run's fuzz-smoke suite)
#   test/fuzz/run.sh long [TARGET...]      fuzz each target TUVL_FUZZ_SECONDS (300)
#                                          seconds, inputs up to TUVL_FUZZ_MAX_LEN
#                                          (16384) bytes, growing build/corpus/TARGET
#                                          and restarting after a crash (test/run fuzz)
#   test/fuzz/run.sh repro TARGET FILE...  run inputs once, e.g. a crash file, and
#                                          print what happens
#   test/fuzz/run.sh seeds [TARGET...]     regenerate the seed corpus (seeds.py)
#   test/fuzz/run.sh build                 build only
#
# The targets: yaml validate template schema apicall llm mcp json.  Prints
# one "ok"/"not ok" line per target and exits 1 when one failed; a crash,
# a sanitizer report, a failed assertion, a hang (TUVL_FUZZ_TIMEOUT, 20 s
# per input) or a WARNING is a failure, its input saved under
# build/artifacts/.  "# note" lines report ERRORs that break a function's
# promise never to raise, or internal errors (elog); they do not fail.
#
# PG_CONFIG names the PostgreSQL to build against and run (pg_config on
# PATH by default).  The harness runs in "postgres --single" from a private
# copy of that installation (build/<key>/pg), never in the installation
# itself.  A postgres built with AddressSanitizer (test/run asan's) brings
# its runtime; any other gets clang's preloaded.
set -uo pipefail
cd "$(dirname "$0")/../.."
. test/lib.sh

# a pg_config built with AddressSanitizer would report leaks at exit and
# lose its output
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
FUZZ_DIR=$TUVL_ROOT/test/fuzz
FUZZ_TARGETS="yaml validate template schema apicall llm mcp json"
PG_CONFIG=${PG_CONFIG:-pg_config}
CLANG=${CLANG:-clang-14}

fuzz_log() { tuvl_log "fuzz: $*"; }

# Where the builds, the long run's corpus and the crash inputs go:
# test/fuzz/build, unless the cluster's owner cannot reach it (a clone
# under /root), then a directory in /var/tmp.
fuzz_build_root() {
    if [ "$(id -u)" -eq 0 ] && ! runuser -u postgres -- test -x "$FUZZ_DIR"; then
        echo "/var/tmp/tuvl-fuzz.$(echo "$FUZZ_DIR" | md5sum | cut -c1-8)"
    else
        echo "$FUZZ_DIR/build"
    fi
}

# The build and its private PostgreSQL, per PostgreSQL installation.
fuzz_build_dir() {
    local key
    key=$("$PG_CONFIG" --bindir --includedir-server --configure | md5sum | cut -c1-8)
    echo "$FUZZ_BUILD/pg-$key"
}

# A copy of the installation PG_CONFIG describes, in $FB/pg: bin, lib and
# share at the same places relative to each other, so that its postgres
# finds its own files; tuvl's from this tree replace any installed ones.
fuzz_prefix() {
    local bindir libdir sharedir top stamp
    bindir=$("$PG_CONFIG" --bindir)
    libdir=$("$PG_CONFIG" --pkglibdir)
    sharedir=$("$PG_CONFIG" --sharedir)
    # the longest directory the three have in common
    top=$(printf '%s\n%s\n%s\n' "$bindir" "$libdir" "$sharedir" |
        sed -e '1{h;d}' -e 'G;s,\(.*/\).*\n\1.*,\1,;h;$!d' -e 's,/$,,')
    stamp="$bindir $(stat -c %Y "$bindir/postgres")"
    FP=$FB/pg
    PGBIN_FUZZ=$FP${bindir#"$top"}
    if [ "$(cat "$FP/.stamp" 2>/dev/null)" != "$stamp" ]; then
        rm -rf "$FP"
        mkdir -p "$FP${bindir#"$top"}" "$FP${libdir#"$top"}" "$FP${sharedir#"$top"}"
        cp -a "$bindir/." "$FP${bindir#"$top"}/"
        cp -a "$libdir/." "$FP${libdir#"$top"}/"
        cp -a "$sharedir/." "$FP${sharedir#"$top"}/"
        echo "$stamp" >"$FP/.stamp"
    fi
    rm -f "$FP${libdir#"$top"}/tuvl.so" "$FP${sharedir#"$top"}"/extension/tuvl[.-]*
    cp "$FB/tuvl.so" "$FP${libdir#"$top"}/tuvl.so"
    cp "$TUVL_ROOT/tuvl.control" "$TUVL_ROOT"/sql/tuvl--*.sql "$FP${sharedir#"$top"}/extension/"
}

# What the single-user backend runs with: clang's ASan runtime preloaded
# unless postgres has its own, and ASan options for a fuzzer (no leak
# checks: a backend keeps memory to the end by design).
fuzz_env() {
    local sym
    sym=$(command -v llvm-symbolizer-14 || command -v llvm-symbolizer || true)
    local opts="detect_leaks=0:handle_abort=1:malloc_context_size=20"
    opts="$opts${sym:+:external_symbolizer_path=$sym}${TUVL_FUZZ_ASAN_OPTIONS:+:$TUVL_FUZZ_ASAN_OPTIONS}"
    FUZZ_ENV=(ASAN_OPTIONS="$opts" TUVL_FUZZ_ARTIFACTS="$FUZZ_ART")
    if ! nm -D "$PGBIN_FUZZ/postgres" 2>/dev/null | grep ' __asan_init' >/dev/null; then
        # asan-preload.so first: its comparison hooks must win over the
        # runtime's weak defaults (asan_preload.c)
        FUZZ_ENV[0]="${FUZZ_ENV[0]}:verify_asan_link_order=0"
        FUZZ_ENV+=(LD_PRELOAD="$FB/asan-preload.so $("$CLANG" -print-file-name=libclang_rt.asan-x86_64.so)")
    fi
}

# The command of a postgres --single session on $1, as the cluster's owner
# (initdb and postgres refuse root), in FUZZ_CMD; SQL comes on stdin.
fuzz_single() {
    local data=$1
    shift
    FUZZ_CMD=(env "${FUZZ_ENV[@]}" "$PGBIN_FUZZ/postgres" --single -D "$data" -F
        -c shared_buffers=16MB -c max_connections=10 -c autovacuum=off
        -c max_stack_depth=4MB "$@" postgres)
    [ "$(id -u)" -eq 0 ] && FUZZ_CMD=(runuser -u postgres -- "${FUZZ_CMD[@]}")
}

# The database every target's run starts from: initdb, the extension and
# setup.sql; rebuilt when the library, the SQL scripts or setup.sql change.
fuzz_template() {
    local stamp
    stamp=$(cat "$FB/tuvl.so" "$TUVL_ROOT/tuvl.control" "$TUVL_ROOT"/sql/tuvl--*.sql \
        "$FUZZ_DIR/setup.sql" | md5sum)
    FUZZ_TEMPLATE=$FB/data.template
    [ "$(cat "$FB/data.stamp" 2>/dev/null)" = "$stamp" ] && [ -d "$FUZZ_TEMPLATE" ] && return 0
    rm -rf "$FUZZ_TEMPLATE" "$FB/data.stamp"
    mkdir -p "$FUZZ_TEMPLATE"
    [ "$(id -u)" -eq 0 ] && chown postgres: "$FUZZ_TEMPLATE"
    as_pg "$PGBIN_FUZZ/initdb" -D "$FUZZ_TEMPLATE" -U postgres -A trust --no-sync -E UTF8 \
        --locale=C >"$FB/initdb.log" 2>&1 || { cat "$FB/initdb.log" >&2; return 1; }
    fuzz_single "$FUZZ_TEMPLATE" -j
    if ! "${FUZZ_CMD[@]}" <"$FUZZ_DIR/setup.sql" >"$FB/setup.log" 2>&1 ||
        grep -qE '(ERROR|FATAL|PANIC):|^==[0-9]+==' "$FB/setup.log"; then
        grep -E -A5 '(ERROR|FATAL|PANIC):|^==[0-9]+==' "$FB/setup.log" | head -40 >&2
        return 1
    fi
    echo "$stamp" >"$FB/data.stamp"
}

# Build the harness and everything it runs in.  Sets FB, FP, PGBIN_FUZZ,
# FUZZ_TEMPLATE, FUZZ_ENV, FUZZ_ART and FUZZ_RUN.
fuzz_setup() {
    TUVL_EXTRA_PACKAGES="$TUVL_CLANG_PACKAGES" tuvl_install_packages || return 1
    FUZZ_BUILD=$(fuzz_build_root)
    FB=$(fuzz_build_dir)
    mkdir -p "$FB"
    fuzz_log "building the harness in ${FB#"$TUVL_ROOT"/}"
    if ! nice -n 10 make -s -j2 -C "$FUZZ_DIR" BUILD="$FB" PG_CONFIG="$PG_CONFIG" CLANG="$CLANG" \
        >"$FB/make.log" 2>&1; then
        tail -30 "$FB/make.log" >&2
        return 1
    fi
    grep -E 'warning:' "$FB/make.log" >&2
    fuzz_prefix || return 1
    FUZZ_ART=$FUZZ_BUILD/artifacts
    FUZZ_RUN=$FB/run
    mkdir -p "$FUZZ_ART" "$FUZZ_RUN" "$FUZZ_BUILD/corpus"
    [ "$(id -u)" -eq 0 ] && chown postgres: "$FUZZ_ART" "$FUZZ_RUN" "$FUZZ_BUILD/corpus"
    fuzz_env
    fuzz_template
}

# A copy of target $1's seeds where the cluster's owner reads them; prints
# its path.
fuzz_seed_copy() {
    local dir=$FUZZ_RUN/seeds-$1
    rm -rf "$dir"
    mkdir -p "$dir"
    cp "$FUZZ_DIR/corpus/$1"/* "$dir/" 2>/dev/null
    [ "$(id -u)" -eq 0 ] && chown -R postgres: "$dir"
    echo "$dir"
}

# Run the harness on target $1 with libFuzzer's arguments $3...; its output
# goes to $2.  A fresh copy of the template database each time.
fuzz_exec() {
    local target=$1 log=$2 data rc args a
    shift 2
    data=$FUZZ_RUN/data-$target-$$
    rm -rf "$data"
    cp -a "$FUZZ_TEMPLATE" "$data"
    args="'$target'"
    for a in "$@"; do
        args="$args, '${a//\'/\'\'}'"
    done
    fuzz_single "$data"
    echo "SELECT public.tuvl_fuzz(ARRAY[$args])" |
        timeout -k 10 "${FUZZ_WALL:-600}" "${FUZZ_CMD[@]}" >"$log" 2>&1
    rc=$?
    rm -rf "$data"
    return $rc
}

# libFuzzer's last status line: "#N DONE cov: C ft: F corp: ..."; prints
# "executions cov ft corpus".
fuzz_stats() {
    local line runs
    line=$(grep -E '^#[0-9]+.*cov: [0-9]+' "$1" | tail -1)
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$1" | tail -1)
    [ -z "$runs" ] && runs=$(echo "$line" | sed -n 's/^#\([0-9]*\).*/\1/p')
    echo "${runs:-0} $(echo "$line" | sed -n 's/.*cov: \([0-9]*\).*/\1/p') \
$(echo "$line" | sed -n 's/.* ft: \([0-9]*\).*/\1/p') $(echo "$line" | sed -n 's/.*corp: \([0-9]*\).*/\1/p')"
}

# What went wrong in a run's log, or nothing when it went well ($2: its
# exit status).
fuzz_failure() {
    local log=$1 rc=$2
    if grep -q '^tuvl fuzz: \|TRAP: ' "$log"; then
        grep -m1 '^tuvl fuzz: \|TRAP: ' "$log" | sed 's/^tuvl fuzz: //'
    elif grep -q 'ERROR: AddressSanitizer' "$log"; then
        grep -m1 'ERROR: AddressSanitizer' "$log" | sed 's/^==[0-9]*==ERROR: //; s/ (pc .*//'
    elif grep -q 'ALARM: working on the last Unit' "$log"; then
        echo "an input ran longer than ${TUVL_FUZZ_TIMEOUT:-20} s"
    elif grep -q 'out-of-memory\|deadly signal' "$log"; then
        grep -m1 'out-of-memory\|deadly signal' "$log" | sed 's/^==[0-9]*== //'
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "the run did not end in time"
    elif [ "$rc" -ne 0 ] || ! grep -qE '^Done [0-9]+ runs|fuzzing was not performed' "$log"; then
        echo "the backend ended with status $rc: $(grep -E 'FATAL|PANIC|ERROR' "$log" | head -1)"
    fi
}

# The artifact a failed run wrote ("Test unit written to PATH").
fuzz_artifact() {
    sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$1" | tail -1
}

# Print a failed run's report: from the sanitizer's or libFuzzer's first
# line of it, the frames that matter.
fuzz_report() {
    grep -n -m1 -E 'ERROR: AddressSanitizer|deadly signal|ALARM:|out-of-memory|TRAP:|^tuvl fuzz:' "$1" |
        cut -d: -f1 | { read -r n && tail -n +"$n" "$1" |
            grep -v '^ *#[0-9]* .* in \(fuzzer::\|__libc_start\|_start \)' | head -50; } |
        sed 's/ (BuildId: [0-9a-f]*)//; s/^/#   /'
}

fuzz_notes() {
    grep '^NOTE: ' "$1" | sed 's/^NOTE: /# note: /'
}

# The harness sees an overflow, a failed assertion, a WARNING and an
# internal error: the selftest target on each of its words (fuzz.c).
fuzz_selftest() {
    local word expect log bad=()
    for word in overflow assert warning internal; do
        case $word in
            overflow) expect='heap-buffer-overflow' ;;
            assert) expect='TRAP: FailedAssertion' ;;
            warning) expect='WARNING while running an input' ;;
            internal) expect='NOTE: selftest: selftest raised ERROR XX000' ;;
        esac
        printf '%s' "$word" >"$FUZZ_RUN/selftest-$word"
        log=$FUZZ_RUN/selftest-$word.log
        fuzz_exec selftest "$log" -artifact_prefix="$FUZZ_RUN/selftest-" "$FUZZ_RUN/selftest-$word"
        grep -q "$expect" "$log" || bad+=("$word")
    done
    rm -f "$FUZZ_RUN"/selftest-* "$FUZZ_ART"/note-selftest-*
    if [ ${#bad[@]} -gt 0 ]; then
        echo "not ok - fuzz harness: the self-test's ${bad[*]} went unnoticed"
        return 1
    fi
    echo "ok - fuzz harness: an overflow, a failed assertion, a WARNING and an internal error are caught"
}

# Replay target $1's seeds, then fuzz it for a few seconds.
fuzz_smoke_target() {
    local t=$1 log=$FUZZ_RUN/smoke-$t.log rc why work=$FUZZ_RUN/new-$t s c
    local seeds copy
    rm -rf "$work"
    mkdir -p "$work"
    [ "$(id -u)" -eq 0 ] && chown postgres: "$work"
    seeds=$(find "$FUZZ_DIR/corpus/$t" -type f | wc -l)
    copy=$(fuzz_seed_copy "$t")
    FUZZ_WALL=$((${TUVL_FUZZ_SMOKE_SECONDS:-3} + 120)) fuzz_exec "$t" "$log" \
        -max_total_time="${TUVL_FUZZ_SMOKE_SECONDS:-3}" -timeout="${TUVL_FUZZ_TIMEOUT:-20}" \
        -print_final_stats=1 -artifact_prefix="$FUZZ_ART/$t-" "$work" "$copy"
    rc=$?
    rm -rf "$work"
    why=$(fuzz_failure "$log" "$rc")
    read -r s c f n <<<"$(fuzz_stats "$log")"
    fuzz_notes "$log"
    if [ -n "$why" ]; then
        echo "not ok - fuzz $t: $why (input: $(fuzz_artifact "$log"))"
        fuzz_report "$log"
        return 1
    fi
    echo "ok - fuzz $t: $seeds seeds replayed, $s inputs run (cov: $c, ft: $f)"
}

# Fuzz target $1 for TUVL_FUZZ_SECONDS, restarting after a crash until the
# time is used up (at most 5 crashes).
fuzz_long_target() {
    local t=$1 total=${TUVL_FUZZ_SECONDS:-300} left start log rc why crashes=0 runs=0
    local corpus=$FUZZ_BUILD/corpus/$t s c f n found=() copy
    mkdir -p "$corpus"
    [ "$(id -u)" -eq 0 ] && chown postgres: "$corpus"
    copy=$(fuzz_seed_copy "$t")
    start=$SECONDS
    left=$total
    while [ "$left" -gt 0 ] && [ "$crashes" -lt 5 ]; do
        log=$FUZZ_RUN/long-$t.$((crashes + 1)).log
        FUZZ_WALL=$((left + 300)) fuzz_exec "$t" "$log" -max_total_time="$left" \
            -max_len="${TUVL_FUZZ_MAX_LEN:-16384}" -timeout="${TUVL_FUZZ_TIMEOUT:-20}" -print_final_stats=1 \
            -artifact_prefix="$FUZZ_ART/$t-" "$corpus" "$copy"
        rc=$?
        read -r s c f n <<<"$(fuzz_stats "$log")"
        runs=$((runs + ${s:-0}))
        fuzz_notes "$log"
        why=$(fuzz_failure "$log" "$rc")
        if [ -n "$why" ]; then
            crashes=$((crashes + 1))
            found+=("$why (input: $(fuzz_artifact "$log"), log: $log)")
            fuzz_report "$log"
        fi
        # done, or a failure without an input that going on would repeat
        [ -z "$why" ] || [ -z "$(fuzz_artifact "$log")" ] && break
        left=$((total - (SECONDS - start)))
    done
    n=$(find "$corpus" -type f | wc -l)
    if [ "$crashes" -gt 0 ]; then
        printf '# %s\n' "${found[@]}"
        echo "not ok - fuzz $t: $crashes crashes; $runs inputs in $((SECONDS - start)) s" \
            "(cov: $c, ft: $f, corpus: $n)"
        return 1
    fi
    echo "ok - fuzz $t: $runs inputs in $((SECONDS - start)) s, $((runs / (SECONDS - start + 1)))/s" \
        "(cov: $c, ft: $f, corpus: $n)"
}

# Regenerate the seed corpus: of seeds.py's candidates, the hostile ones
# and those that add coverage are kept, under their names; any other file
# in corpus/TARGET (a seed added by hand) stays.  libFuzzer's -merge=1
# runs its inner step in child processes, which a backend cannot start:
# run.sh runs that step itself (-merge_inner=1 on a control file from
# seeds.py), and seeds.py picks the files as the merge would.
fuzz_seeds() {
    local raw=$FUZZ_RUN/seeds t f control log hand kept attempt bad=0
    rm -rf "$raw"
    mkdir -p "$raw"
    "$TUVL_PYTHON" "$FUZZ_DIR/seeds.py" "$raw" || return 1
    for t in "${targets[@]}"; do
        find "$FUZZ_DIR/corpus/$t" -type f \( -name 'doc-*' -o -name 'test-*' -o -name 'srv-*' \
            -o -name 'hostile-*' \) -delete
        # the hostile ones are kept whatever they cover
        cp "$raw/$t"/hostile-* "$FUZZ_DIR/corpus/$t/" 2>/dev/null
        rm -f "$raw/$t"/hostile-*
        control=$FUZZ_RUN/merge-$t.control
        "$TUVL_PYTHON" "$FUZZ_DIR/seeds.py" --control "$control" "$(fuzz_seed_copy "$t")" "$raw/$t"
        [ "$(id -u)" -eq 0 ] && chown postgres: "$control"
        # after a crash the next inner step goes on after the input that crashed
        for attempt in 1 2 3 4 5; do
            log=$FUZZ_RUN/seeds-$t.$attempt.log
            fuzz_exec "$t" "$log" -merge_inner=1 -merge_control_file="$control" \
                -timeout="${TUVL_FUZZ_TIMEOUT:-20}" -artifact_prefix="$FUZZ_ART/$t-" && break
            echo "not ok - fuzz seeds $t: $(fuzz_failure "$log" 1) (input: $(fuzz_artifact "$log"))"
            fuzz_report "$log"
            bad=1
        done
        hand=$(find "$FUZZ_DIR/corpus/$t" -type f | wc -l)
        "$TUVL_PYTHON" "$FUZZ_DIR/seeds.py" --select "$control" | while read -r f; do
            cp "$f" "$FUZZ_DIR/corpus/$t/"
        done
        kept=$(find "$FUZZ_DIR/corpus/$t" -type f | wc -l)
        echo "ok - fuzz seeds $t: $((kept - hand)) of $(find "$raw/$t" -type f | wc -l) candidates kept," \
            "$kept seeds"
        rm -f "$control"
    done
    rm -rf "$raw"
    return $bad
}

fuzz_repro() {
    local t=$1 f files=() log dir=$FUZZ_RUN/repro
    shift
    rm -rf "$dir"
    mkdir -p "$dir"
    for f in "$@"; do
        cp "$f" "$dir/" && files+=("$dir/$(basename "$f")")
    done
    [ "$(id -u)" -eq 0 ] && chown -R postgres: "$dir"
    log=$FUZZ_RUN/repro-$t.log
    fuzz_exec "$t" "$log" -timeout="${TUVL_FUZZ_TIMEOUT:-20}" "${files[@]}"
    cat "$log"
}

mode=${1:-smoke}
shift
case "$mode" in
    smoke | long | seeds | repro | build) ;;
    *) echo "usage: test/fuzz/run.sh smoke|long|seeds|repro|build [TARGET...]" >&2; exit 2 ;;
esac
targets=("$@")
[ ${#targets[@]} -eq 0 ] && [ "$mode" != repro ] && read -ra targets <<<"$FUZZ_TARGETS"
# the targets named must exist (repro's: its first argument)
for t in "${targets[@]}"; do
    case " $FUZZ_TARGETS selftest " in
        *" $t "*) ;;
        *) echo "not ok - fuzz: no target $t (the targets: $FUZZ_TARGETS)"; exit 1 ;;
    esac
    [ "$mode" = repro ] && break
done
fuzz_setup || { echo "not ok - fuzz: the harness builds and its database starts"; exit 1; }
bad=0
case "$mode" in
    build) echo "ok - fuzz: built ${FB#"$TUVL_ROOT"/}/tuvl.so" ;;
    smoke | long)
        [ "$mode" = smoke ] && { fuzz_selftest || bad=1; }
        for t in "${targets[@]}"; do
            "fuzz_${mode}_target" "$t" || bad=1
        done
        ;;
    repro) fuzz_repro "$@" ;;
    seeds) fuzz_seeds || bad=1 ;;
esac
exit $bad
