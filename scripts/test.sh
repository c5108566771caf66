#!/usr/bin/env bash
# THE test command: sets the machine up, runs every test suite, and ends with the
# line "N passed, N failed" (N counts test cases: one per regress file, spec, pytest
# test, #[pg_test], and suite script).
#
#   scripts/test.sh                    # everything
#   scripts/test.sh SUITE[:FILTER] ... # only these suites, e.g.
#       scripts/test.sh regress            pg_regress files  pg_test/sql/*.sql
#       scripts/test.sh regress:claim      only pg_test/sql/claim.sql
#       scripts/test.sh isolation[:NAME]   isolation specs   pg_test/specs/*.spec
#       scripts/test.sh py[:EXPR]          pytest            pg_test/py (EXPR goes to -k)
#       scripts/test.sh relay[:EXPR]       pytest            pg_test/relay: the relay with nats-server
#       scripts/test.sh cli[:EXPR]         pytest            pg_test/cli: the outbox command's operator subcommands
#       scripts/test.sh dashboard[:EXPR]   pytest            pg_test/dashboard: `outbox serve` in headless Chromium
#       scripts/test.sh pgrx[:NAME]        #[pg_test] unit tests via cargo pgrx test
#       scripts/test.sh suites[:NAME]      pg_test/suites/*.sh (NAME = one script's name)
#       scripts/test.sh docs               the mdBook book (docs/): build, links, SQL reference
#
# Environment knobs:
#   OUTBOX_SKIP_SETUP=1       do not run scripts/setup.sh (you just ran it)
#   OUTBOX_TEST_TIMEOUT=1200  seconds allowed per suite script / pytest run
#   OUTBOX_PGRX_TIMEOUT=2400  seconds allowed for cargo pgrx test (includes building)
#   OUTBOX_DOCS_UPDATE=1      docs: write the regenerated SQL reference into docs/src/reference
#
# Clusters (see scripts/pgcluster.sh): "outbox-test" on port 5441 without preload
# (regress, isolation, pytest), "outbox-test-preload" on port 5442 with
# shared_preload_libraries='outbox_ext' (pytest, suites). All are stopped on exit.
#
# Results and logs are kept in target/test-results/ for inspection.
set -uo pipefail # no -e: a failing suite is counted, not fatal

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
# shellcheck source=scripts/pgenv.sh
. "$SCRIPT_DIR/pgenv.sh" --
PGCLUSTER="$SCRIPT_DIR/pgcluster.sh"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"

TEST_DIR="$REPO/pg_test"
RESULTS="$REPO/target/test-results"
SUITE_TIMEOUT="${OUTBOX_TEST_TIMEOUT:-1200}"
PGRX_TIMEOUT="${OUTBOX_PGRX_TIMEOUT:-2400}"

PLAIN=outbox-test
PLAIN_PORT=5441
PRELOAD=outbox-test-preload
PRELOAD_PORT=5442
PGRX_PGDATA_PARENT=/tmp/outbox-pgrx-test
PGRX_PGDATA="$PGRX_PGDATA_PARENT/data"

PASSED=0
FAILED=0
FAILURES=() # "suite: what" lines repeated in the summary

pass() { PASSED=$((PASSED + ${2:-1})); }
fail() { FAILED=$((FAILED + ${2:-1})); FAILURES+=("$1"); }
section() { printf '\n==== %s ====\n' "$*"; }

# ---------------------------------------------------------------------------
# Suite selection: no arguments = all suites.
# ---------------------------------------------------------------------------
ALL_SUITES=(regress isolation py relay cli dashboard pgrx suites docs)
declare -A WANT=() FILTER=()
if [ "$#" -eq 0 ]; then
    for s in "${ALL_SUITES[@]}"; do WANT[$s]=1; done
else
    for arg in "$@"; do
        case "$arg" in
            -h | --help) sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        esac
        s="${arg%%:*}"
        case " ${ALL_SUITES[*]} " in
            *" $s "*) ;;
            *) echo "test.sh: unknown suite '$s' (one of: ${ALL_SUITES[*]})" >&2; exit 2 ;;
        esac
        WANT[$s]=1
        if [ "$arg" != "$s" ]; then FILTER[$s]="${arg#*:}"; fi
    done
fi
want() { [ -n "${WANT[$1]:-}" ]; }

# ---------------------------------------------------------------------------
# One run at a time per machine: every run uses the same ports (5441/5442) and
# cluster names, and installs into the same system PostgreSQL directories, so a
# second run (another checkout, a colleague) waits instead of wrecking the first.
# ---------------------------------------------------------------------------
# The lock is held by a flock(1) process that runs this script again as its child;
# -o keeps the lock's descriptor out of the child, so servers started below (which
# may outlive a broken run) can never hold the lock and block every later run.
LOCK_FILE="${OUTBOX_TEST_LOCK:-/tmp/outbox-test.lock}"
if [ "${OUTBOX_TEST_LOCK_HELD:-}" != "$LOCK_FILE" ]; then
    if ! flock -n -o "$LOCK_FILE" true; then
        echo "test.sh: another scripts/test.sh run holds $LOCK_FILE; waiting for it"
    fi
    OUTBOX_TEST_LOCK_HELD="$LOCK_FILE" exec flock -o "$LOCK_FILE" bash "${BASH_SOURCE[0]}" "$@"
fi

# ---------------------------------------------------------------------------
# Cleanup: every server we started is stopped, whatever happens.
# ---------------------------------------------------------------------------
STARTED=()
stop_pgrx_cluster() {
    # `cargo pgrx test` normally stops its server; if the test binary was killed
    # (timeout), the server is left behind, so stop it here by its data directory.
    # pgrx puts the data in --pgdata/<major>-<pid of the test binary>.
    local pidfile pid
    for pidfile in "$PGRX_PGDATA"/*/postmaster.pid; do
        [ -f "$pidfile" ] || continue
        pid="$(head -n 1 "$pidfile" 2>/dev/null || true)"
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
            (cd / && runuser -u postgres -- "$PG_BINDIR/pg_ctl" stop -D "$(dirname "$pidfile")" \
                -m fast -w -t 60) >/dev/null 2>&1 || kill -9 "$pid" 2>/dev/null || true
        fi
    done
}
cleanup() {
    local c
    for c in "${STARTED[@]+"${STARTED[@]}"}"; do
        "$PGCLUSTER" stop "$c" >/dev/null 2>&1 || true
    done
    STARTED=()
    stop_pgrx_cluster
}
trap cleanup EXIT
trap 'echo "test.sh: interrupted" >&2; exit 130' INT TERM

summary_and_exit() {
    cleanup
    echo
    if [ "${#FAILURES[@]}" -gt 0 ]; then
        echo "Failures:"
        printf '  %s\n' "${FAILURES[@]}"
    fi
    echo "$PASSED passed, $FAILED failed"
    [ "$FAILED" -eq 0 ]
    exit
}

# ---------------------------------------------------------------------------
# Setup (tools + extension build/install). Nothing can run without it.
# ---------------------------------------------------------------------------
if [ "${OUTBOX_SKIP_SETUP:-0}" != "1" ]; then
    section "setup"
    setup_args=()
    # The #[pg_test] suite installs its own build; the others need the release one.
    if [ "${#WANT[@]}" -eq 1 ] && want pgrx; then setup_args+=(--deps-only); fi
    if ! bash "$SCRIPT_DIR/setup.sh" "${setup_args[@]+"${setup_args[@]}"}" </dev/null; then
        fail "setup: scripts/setup.sh failed (see above)"
        summary_and_exit
    fi
fi

rm -rf "$RESULTS"
mkdir -p "$RESULTS"

# The system PostgreSQL is shared by every checkout on this machine: another run
# (a colleague's, or cargo pgrx test) may have installed a different build since
# our setup. Before each suite, re-run setup (about a second when nothing changed);
# its stamp compares the installed files with our build and reinstalls ours if not.
ensure_extension() {
    [ "${OUTBOX_SKIP_SETUP:-0}" = "1" ] && return 0
    local log="$RESULTS/setup-recheck.log"
    if ! bash "$SCRIPT_DIR/setup.sh" </dev/null >"$log" 2>&1; then
        tail -n 30 "$log"
        fail "$1: scripts/setup.sh failed when re-checking the installed extension"
        return 1
    fi
    if grep -q '^setup: extension installed' "$log"; then
        echo "test.sh: the installed outbox_ext was not this checkout's build; reinstalled it"
    fi
}

# ---------------------------------------------------------------------------
# Cluster helpers
# ---------------------------------------------------------------------------
# start_cluster NAME PORT [pgcluster options]: (re)create a fresh cluster.
start_cluster() {
    local name="$1"
    STARTED+=("$name")
    # Prepared transactions are part of what the tests exercise (2PC publishers).
    # Only the first line ("running on port ..."); errors go to stderr anyway.
    "$PGCLUSTER" start "$@" -c max_prepared_transactions=64 | sed -n 1p
}

PLAIN_UP=0
ensure_plain_cluster() {
    [ "$PLAIN_UP" -eq 1 ] && return 0
    if start_cluster "$PLAIN" "$PLAIN_PORT"; then
        PLAIN_UP=1
    else
        return 1
    fi
}

# Sorted list of test names: files DIR/*.EXT, minus the extension, optionally
# filtered to names equal to FILTER.
list_tests() {
    local dir="$1" ext="$2" filter="${3:-}" f n
    [ -d "$dir" ] || return 0
    for f in "$dir"/*."$ext"; do
        [ -e "$f" ] || continue
        n="$(basename "$f" ."$ext")"
        if [ -z "$filter" ] || [ "$n" = "$filter" ]; then echo "$n"; fi
    done | LC_ALL=C sort
}

# A new test has no expected file yet: pg_regress still ran it (then failed on the
# diff), so point at the output to review and copy.
no_expected_hint() {
    if [ ! -f "$TEST_DIR/expected/$1.out" ]; then
        echo "  $1: no pg_test/expected/$1.out; review $2/results/$1.out and copy it there"
    fi
}

# Show the diff of a failed pg_regress/pg_isolation_regress run.
show_diffs() {
    if [ -s "$1/regression.diffs" ]; then
        sed 's/^/    /' "$1/regression.diffs" | head -n 200
        cat "$1/regression.diffs" >>"$1/all.diffs"
    fi
}

# ---------------------------------------------------------------------------
# a, b. regress and isolation: pg_test/Makefile (PGXS installcheck)
# ---------------------------------------------------------------------------
# run_pgxs SUITE VAR OTHER DIR EXT TOOL: `make -C pg_test installcheck` with only this
# suite's files (VAR=REGRESS or ISOLATION; the other one empty), against the
# plain cluster. One pg_regress run per suite, in one fresh database; each test
# line it prints ("test NAME ... ok|FAILED") counts as one case.
run_pgxs() {
    local suite="$1" var="$2" other="$3" dir="$4" ext="$5" tool="$6" base="${7:-$TEST_DIR}" names out rc ok bad
    mapfile -t names < <(list_tests "$base/$dir" "$ext" "${FILTER[$suite]:-}")
    if [ "${#names[@]}" -eq 0 ]; then
        [ -n "${FILTER[$suite]:-}" ] && fail "$suite: no test named '${FILTER[$suite]}'"
        return 0
    fi
    section "$suite ($tool, ${base#"$REPO"/}/$dir)"
    ensure_extension "$suite" || return 0
    ensure_plain_cluster || { fail "$suite: cluster $PLAIN did not start"; return 0; }
    out="$RESULTS/$suite"
    rm -rf "$out"
    mkdir -p "$out"
    PGHOST="$(outbox_pg_sockdir "$PLAIN")" PGPORT="$PLAIN_PORT" PGUSER="$OUTBOX_PG_USER" \
        timeout -k 10 "$SUITE_TIMEOUT" make -s -C "$base" installcheck PG_CONFIG="$PG_CONFIG" \
        "$var=${names[*]}" "$other=" EXTRA_REGRESS_OPTS="--outputdir=$out" </dev/null >"$out/make.log" 2>&1
    rc=$?
    grep -E '^(test| ) *[a-z_0-9]+ +\.\.\. ' "$out/make.log" | sed 's/^/  /'
    ok="$(grep -cE '\.\.\. +ok' "$out/make.log")"
    bad="$(grep -cE '\.\.\. +(FAILED|failed)' "$out/make.log")"
    pass "" "$ok"
    for t in "${names[@]}"; do
        no_expected_hint "$t" "$out"
    done
    if [ "$bad" -gt 0 ]; then
        fail "$suite: $bad file(s) failed (diffs: $out/regression.diffs)" "$bad"
        show_diffs "$out"
    elif [ "$rc" -ne 0 ] || [ "$ok" -ne "${#names[@]}" ]; then
        [ "$rc" -eq 124 ] && echo "  $suite: timed out after ${SUITE_TIMEOUT}s"
        fail "$suite: make installcheck exited $rc after $ok of ${#names[@]} files (log: $out/make.log)"
        tail -n 20 "$out/make.log"
    fi
}

# ---------------------------------------------------------------------------
# Environment handed to pytest and suite scripts.
# ---------------------------------------------------------------------------
# OUTBOX_TEST_DSN / OUTBOX_TEST_DSN_PRELOAD point at database "postgres" on each
# cluster, as superuser over TCP. The extension is NOT pre-created there: tests
# run `CREATE EXTENSION IF NOT EXISTS outbox_ext` (or make their own database).
# On the preload cluster, the launcher serves every database that has the
# extension, "postgres" included.
export_cluster_env() {
    export OUTBOX_TEST_DSN
    OUTBOX_TEST_DSN="$(outbox_pg_dsn "$PLAIN" "$PLAIN_PORT" postgres)"
    export OUTBOX_TEST_DSN_PRELOAD
    OUTBOX_TEST_DSN_PRELOAD="$(outbox_pg_dsn "$PRELOAD" "$PRELOAD_PORT" postgres)"
    # For suites that stop, crash or restart a server themselves
    # (e.g. kill -9 the postmaster, then "$OUTBOX_PGCLUSTER" restart NAME).
    export OUTBOX_PGCLUSTER="$PGCLUSTER"
    export OUTBOX_TEST_CLUSTER="$PLAIN" OUTBOX_TEST_PORT="$PLAIN_PORT"
    export OUTBOX_TEST_CLUSTER_PRELOAD="$PRELOAD" OUTBOX_TEST_PORT_PRELOAD="$PRELOAD_PORT"
    export OUTBOX_TEST_PGDATA OUTBOX_TEST_PGDATA_PRELOAD
    OUTBOX_TEST_PGDATA="$(outbox_pg_datadir "$PLAIN")"
    OUTBOX_TEST_PGDATA_PRELOAD="$(outbox_pg_datadir "$PRELOAD")"
    export OUTBOX_TEST_PYTHON="$REPO/.venv/bin/python"
    export OUTBOX_REPO="$REPO" PG_BINDIR
}

# (Re)create both clusters from scratch; each failure is counted against $1.
fresh_clusters() {
    local who="$1" ok=0
    if start_cluster "$PLAIN" "$PLAIN_PORT"; then PLAIN_UP=1; else fail "$who: cluster $PLAIN did not start"; ok=1; fi
    if ! start_cluster "$PRELOAD" "$PRELOAD_PORT" --preload; then
        fail "$who: cluster $PRELOAD (shared_preload_libraries=outbox_ext) did not start"
        ok=1
    fi
    export_cluster_env
    return "$ok"
}

# ---------------------------------------------------------------------------
# c. pytest: pg_test/py (multi-connection client tests)
# ---------------------------------------------------------------------------
run_py() {
    local dir="$TEST_DIR/py"
    # Only files pytest would collect count as tests.
    if [ ! -d "$dir" ] || [ -z "$(find "$dir" -name 'test_*.py' -o -name '*_test.py' | head -n 1)" ]; then
        return 0
    fi
    section "py (pytest, pg_test/py)"
    ensure_extension py || return 0
    fresh_clusters py || true
    run_pytest py "$dir" "$SUITE_TIMEOUT"
}

# ---------------------------------------------------------------------------
# c2. the relay (`outbox relay`, crates/outbox) against real servers:
#     pg_test/relay starts its own cluster (relaytest, port 5472) and its own
#     nats-server instances on loopback ports, and stops them.
# ---------------------------------------------------------------------------
run_relay() {
    section "relay (pytest, pg_test/relay)"
    ensure_extension relay || return 0
    if [ ! -x /usr/local/bin/outbox ]; then
        fail "relay: /usr/local/bin/outbox is missing (scripts/setup.sh builds it)"
        return 0
    fi
    STARTED+=(relaytest)
    OUTBOX_BIN=/usr/local/bin/outbox run_pytest relay "$TEST_DIR/relay" "${OUTBOX_RELAY_TIMEOUT:-1500}"
}

# ---------------------------------------------------------------------------
# c3. the outbox command's operator subcommands (crates/outbox/src/cli):
#     pg_test/cli starts its own cluster (clitest, port 5473) and stops it.
# ---------------------------------------------------------------------------
run_cli() {
    section "cli (pytest, pg_test/cli)"
    ensure_extension cli || return 0
    if [ ! -x /usr/local/bin/outbox ]; then
        fail "cli: /usr/local/bin/outbox is missing (scripts/setup.sh builds it)"
        return 0
    fi
    STARTED+=(clitest)
    OUTBOX_BIN=/usr/local/bin/outbox run_pytest cli "$TEST_DIR/cli" "$SUITE_TIMEOUT"
}

# ---------------------------------------------------------------------------
# c4. the web dashboard (`outbox serve`, crates/outbox/src/serve) in headless
#     Chromium (Selenium with Debian's chromedriver): pg_test/dashboard starts
#     its own cluster (dashtest, port 5476) and stops it.
# ---------------------------------------------------------------------------
run_dashboard() {
    section "dashboard (pytest, pg_test/dashboard)"
    ensure_extension dashboard || return 0
    # OUTBOX_BIN may name another build (crates/outbox/target/release/outbox while developing).
    local bin="${OUTBOX_BIN:-/usr/local/bin/outbox}"
    if [ ! -x "$bin" ]; then
        fail "dashboard: $bin is missing (scripts/setup.sh builds /usr/local/bin/outbox)"
        return 0
    fi
    if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
        fail "dashboard: chromium or chromedriver is missing (scripts/setup.sh installs them)"
        return 0
    fi
    STARTED+=(dashtest)
    OUTBOX_BIN="$bin" run_pytest dashboard "$TEST_DIR/dashboard" "$SUITE_TIMEOUT"
}

# run_pytest SUITE DIR TIMEOUT: pytest over DIR, counting its test cases.
run_pytest() {
    local suite="$1" dir="$2" limit="$3" out rc
    out="$RESULTS/$suite"
    mkdir -p "$out"
    local -a args=(-q -p no:cacheprovider --junitxml="$out/junit.xml" "$dir")
    [ -n "${FILTER[$suite]:-}" ] && args+=(-k "${FILTER[$suite]}")
    (cd "$REPO" && timeout -k 10 "$limit" "$REPO/.venv/bin/python" -m pytest "${args[@]}") </dev/null
    rc=$?
    # Count test cases from the JUnit report; fall back to one failure when
    # pytest failed without producing one (collection error, timeout, ...).
    local counts p=0 f=0
    if [ -f "$out/junit.xml" ]; then
        counts="$("$REPO/.venv/bin/python" - "$out/junit.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
t = sum(int(s.get("tests", 0)) for s in suites)
f = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
sk = sum(int(s.get("skipped", 0)) for s in suites)
print(t - f - sk, f)
EOF
)" && read -r p f <<<"$counts"
    fi
    if [ "$rc" -eq 5 ]; then
        # Exit 5 = no tests collected although test files exist: a broken suite
        # (unless a -k filter legitimately matched nothing).
        if [ -n "${FILTER[$suite]:-}" ]; then
            fail "$suite: no test matched -k '${FILTER[$suite]}'"
        else
            fail "$suite: pytest collected no tests from $dir"
        fi
        return 0
    fi
    pass "" "$p"
    if [ "$f" -gt 0 ]; then
        FAILED=$((FAILED + f))
        FAILURES+=("$suite: $f pytest test(s) failed (report: $out/junit.xml)")
    elif [ "$rc" -ne 0 ]; then
        [ "$rc" -eq 124 ] && echo "  pytest timed out after ${limit}s"
        fail "$suite: pytest exited $rc"
    fi
}

# ---------------------------------------------------------------------------
# d. #[pg_test] unit tests: cargo pgrx test
# ---------------------------------------------------------------------------
# cargo-pgrx builds a test variant of the extension, installs it into Debian's
# PostgreSQL (as root that needs no sudo) and runs its own temporary cluster.
# initdb refuses root, hence --runas postgres (pgrx then uses sudo, so the sudo
# package is required) and a --pgdata that postgres owns.
# Note: the test build overwrites the installed release .so; setup.sh notices
# (it keys its stamp on the installed file) and reinstalls on the next run.
run_pgrx() {
    [ -d "$REPO/src" ] || return 0
    section "pgrx (cargo pgrx test pg15)"
    stop_pgrx_cluster
    rm -rf "$PGRX_PGDATA"
    mkdir -p "$PGRX_PGDATA_PARENT"
    chown postgres: "$PGRX_PGDATA_PARENT"
    local out="$RESULTS/pgrx" rc
    mkdir -p "$out"
    local -a args=(pgrx test pg15 --runas postgres --pgdata "$PGRX_PGDATA")
    [ -n "${FILTER[pgrx]:-}" ] && args+=("${FILTER[pgrx]}")
    # CARGO_PGRX: the test framework installs its build through this command;
    # install-ext.sh does that without rewriting the installed library in place
    # (which would crash other servers on this machine that have it mapped).
    (cd "$REPO" && CARGO_PGRX="$SCRIPT_DIR/install-ext.sh" \
        timeout -k 30 "$PGRX_TIMEOUT" cargo "${args[@]}") </dev/null 2>&1 | tee "$out/cargo-pgrx-test.log"
    rc="${PIPESTATUS[0]}"
    stop_pgrx_cluster
    local p f
    p="$(grep -oE '^test result: .* ([0-9]+) passed' "$out/cargo-pgrx-test.log" | grep -oE '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')"
    f="$(grep -oE '^test result: .*; ([0-9]+) failed' "$out/cargo-pgrx-test.log" | grep -oE '[0-9]+ failed' | awk '{s+=$1} END {print s+0}')"
    pass "" "$p"
    if [ "$f" -gt 0 ]; then
        FAILED=$((FAILED + f))
        FAILURES+=("pgrx: $f #[pg_test] test(s) failed (log: $out/cargo-pgrx-test.log)")
    elif [ "$rc" -ne 0 ]; then
        [ "$rc" -eq 124 ] && echo "  cargo pgrx test timed out after ${PGRX_TIMEOUT}s"
        fail "pgrx: cargo pgrx test exited $rc (log: $out/cargo-pgrx-test.log)"
    fi
}

# ---------------------------------------------------------------------------
# e. suite scripts: pg_test/suites/NAME.sh (crash, soak, worker tests ...)
# ---------------------------------------------------------------------------
# Each script runs with bash, from the repo root, on two freshly created clusters
# (it may crash or restart them), with the OUTBOX_TEST_* variables above. Its exit
# code is the verdict; it counts as one test.
run_suites() {
    local names n rc out="$RESULTS/suites"
    mapfile -t names < <(list_tests "$TEST_DIR/suites" sh "${FILTER[suites]:-}")
    if [ "${#names[@]}" -eq 0 ]; then
        [ -n "${FILTER[suites]:-}" ] && fail "suites: no script named '${FILTER[suites]}.sh'"
        return 0
    fi
    mkdir -p "$out"
    for n in "${names[@]}"; do
        section "suite $n (pg_test/suites/$n.sh)"
        ensure_extension "suite $n" || continue
        if ! fresh_clusters "suite $n"; then
            continue
        fi
        (cd "$REPO" && timeout -k 10 "$SUITE_TIMEOUT" bash "$TEST_DIR/suites/$n.sh") </dev/null 2>&1 |
            tee "$out/$n.log"
        rc="${PIPESTATUS[0]}"
        if [ "$rc" -eq 0 ]; then
            echo "  suite $n ... ok"
            pass
        else
            [ "$rc" -eq 124 ] && echo "  suite $n timed out after ${SUITE_TIMEOUT}s"
            echo "  suite $n ... FAILED (exit $rc)"
            fail "suite: $n (exit $rc, log: $out/$n.log)"
        fi
    done
}

# ---------------------------------------------------------------------------
# f. docs: the mdBook book (docs/) built with the mdbook version setup.sh pins,
#    its internal links (docs/check-links.py), and the SQL reference pages
#    (docs/src/reference), regenerated by scripts/sql-reference.py from a fresh
#    install on the plain cluster: they must equal the committed pages and cover
#    every public object. OUTBOX_DOCS_UPDATE=1 writes the regenerated pages
#    into docs/src/reference instead of comparing (then commit them).
# ---------------------------------------------------------------------------
run_docs() {
    local out="$RESULTS/docs" ref="$REPO/docs/src/reference" dsn t0
    local py="$REPO/.venv/bin/python" gen="$SCRIPT_DIR/sql-reference.py" pin
    pin="$(sed -n 's/^MDBOOK_VERSION="\([^"]*\)".*/\1/p' "$SCRIPT_DIR/setup.sh")"
    section "docs (mdbook $pin, docs/)"
    mkdir -p "$out"
    ensure_extension docs || return 0
    # A fresh cluster: earlier suites may have stopped it or left roles behind.
    if start_cluster "$PLAIN" "$PLAIN_PORT"; then PLAIN_UP=1; else fail "docs: cluster $PLAIN did not start"; return 0; fi
    dsn="$(outbox_pg_dsn "$PLAIN" "$PLAIN_PORT" postgres)"
    if [ "${OUTBOX_DOCS_UPDATE:-0}" = "1" ]; then
        if "$py" "$gen" --dsn "$dsn" --write "$ref"; then pass; else fail "docs: regenerating $ref failed"; fi
    elif "$py" "$gen" --dsn "$dsn" --check "$ref" >"$out/reference.diff" 2>"$out/reference.log"; then
        tail -n 1 "$out/reference.diff" | sed 's/^/  /'
        pass
    else
        head -n 60 "$out/reference.diff" "$out/reference.log" | sed 's/^/    /'
        fail "docs: the SQL reference differs from a regeneration (diff: $out/reference.diff)"
    fi
    if "$py" "$gen" --dsn "$dsn" --coverage "$ref" >"$out/coverage.log" 2>&1; then
        sed 's/^/  /' "$out/coverage.log"
        pass
    else
        sed 's/^/    /' "$out/coverage.log" | head -n 60
        fail "docs: public objects missing from the SQL reference (log: $out/coverage.log)"
    fi
    if [ "$(mdbook --version 2>/dev/null)" != "mdbook v$pin" ]; then
        fail "docs: mdbook $pin is not installed (found: '$(mdbook --version 2>/dev/null)'; scripts/setup.sh installs it)"
        return 0
    fi
    t0=$SECONDS
    rm -rf "$out/book"
    if mdbook build "$REPO/docs" -d "$out/book" >"$out/mdbook.log" 2>&1 && ! grep -q ' ERROR \| WARN ' "$out/mdbook.log"; then
        echo "  book built in $((SECONDS - t0)) s: $out/book/index.html"
        pass
    else
        sed 's/^/    /' "$out/mdbook.log" | tail -n 40
        fail "docs: mdbook build failed or warned (log: $out/mdbook.log)"
        return 0
    fi
    if "$py" "$REPO/docs/check-links.py" "$out/book" >"$out/links.log" 2>&1; then
        tail -n 1 "$out/links.log" | sed 's/^/  /'
        pass
    else
        sed 's/^/    /' "$out/links.log" | tail -n 60
        fail "docs: broken internal links in the book (log: $out/links.log)"
    fi
}

want regress && run_pgxs regress REGRESS ISOLATION sql sql pg_regress
want isolation && run_pgxs isolation ISOLATION REGRESS specs spec pg_isolation_regress
want py && run_py
want relay && run_relay
want cli && run_cli
want dashboard && run_dashboard
want suites && run_suites
want docs && run_docs
# Last: it replaces the installed extension with its test build.
if want pgrx; then
    run_pgrx
    # Put the release build back, so that whatever uses this machine's PostgreSQL
    # next (a developer's cluster, the next run) gets the real extension. Cheap:
    # the release build is cached, setup.sh only copies and regenerates the SQL.
    if [ "${OUTBOX_SKIP_SETUP:-0}" != "1" ] &&
        ! bash "$SCRIPT_DIR/setup.sh" </dev/null >"$RESULTS/pgrx/reinstall-release.log" 2>&1; then
        echo "test.sh: warning: reinstalling the release build failed (see $RESULTS/pgrx/reinstall-release.log)"
    fi
fi

summary_and_exit
