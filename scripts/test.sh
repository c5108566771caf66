#!/usr/bin/env bash
# THE test command: sets the machine up, runs every suite, and ends with the line
# "N passed, N failed" (N counts test cases: regress files, specs, pytest tests, #[pg_test]s).
#
#   scripts/test.sh                    # everything
#   scripts/test.sh SUITE[:FILTER] ... # only these suites:
#       regress[:NAME]     pg_regress            pg_test/sql/*.sql (PGXS installcheck, pg_test/Makefile)
#       isolation[:NAME]   pg_isolation_regress  pg_test/specs/*.spec
#       py[:EXPR]          pytest pg_test/py         (EXPR goes to -k)
#       relay[:EXPR]       pytest pg_test/relay      the relay against nats-server
#       cli[:EXPR]         pytest pg_test/cli        the outbox command's operator subcommands
#       dashboard[:EXPR]   pytest pg_test/dashboard  `outbox serve` in headless Chromium
#       suites[:EXPR]      pytest pg_test/suites     each pg_test/suites/NAME.sh (crash, checker, soak...)
#       docs[:EXPR]        pytest pg_test/docs       the mdBook book and the generated SQL reference
#       pgrx[:NAME]        #[pg_test] unit tests     cargo pgrx test
#
# Knobs: OUTBOX_SKIP_SETUP=1 (you just ran scripts/setup.sh), OUTBOX_TEST_TIMEOUT=1200 (s per
# pytest run and suite script), OUTBOX_PGRX_TIMEOUT=2400, OUTBOX_DOCS_UPDATE=1 (docs: rewrite
# docs/src/reference). Each pytest suite starts the clusters it needs (pg_test/clusters.py);
# regress and isolation use "outbox-test" (port 5441). Logs: target/test-results/.
set -uo pipefail # no -e: a failing suite is counted, not fatal

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
# shellcheck source=scripts/pgenv.sh
. "$SCRIPT_DIR/pgenv.sh" --
PGCLUSTER="$SCRIPT_DIR/pgcluster.sh"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH" OUTBOX_REPO="$REPO"
RESULTS="$REPO/target/test-results"
TIMEOUT="${OUTBOX_TEST_TIMEOUT:-1200}"
PY="$REPO/.venv/bin/python"
PGRX_PGDATA=/tmp/outbox-pgrx-test/data
# Every cluster a suite may leave behind when its runner is killed: stopped on exit.
CLUSTERS=(outbox-test outbox-test-preload relaytest clitest dashtest)
PYTEST_SUITES=(py relay cli dashboard suites docs)
ALL_SUITES=(regress isolation "${PYTEST_SUITES[@]}" pgrx)
# pytest run limits: suites holds one script run per file, each bounded by $TIMEOUT itself.
declare -A LIMIT=([relay]="${OUTBOX_RELAY_TIMEOUT:-1500}" [suites]=$((TIMEOUT * 8)))

PASSED=0 FAILED=0 FAILURES=()
fail() { FAILED=$((FAILED + ${2:-1})); FAILURES+=("$1"); }
section() { printf '\n==== %s ====\n' "$*"; }

declare -A WANT=() FILTER=()
[ "$#" -eq 0 ] && set -- "${ALL_SUITES[@]}"
for arg in "$@"; do
    case "$arg" in -h | --help) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
    s="${arg%%:*}"
    case " ${ALL_SUITES[*]} " in
        *" $s "*) WANT[$s]=1; [ "$arg" != "$s" ] && FILTER[$s]="${arg#*:}" ;;
        *) echo "test.sh: unknown suite '$s' (one of: ${ALL_SUITES[*]})" >&2; exit 2 ;;
    esac
done

# One run at a time per machine: every run uses the same ports, cluster names and system
# PostgreSQL directories. flock -o keeps the lock out of the servers we start, which may
# outlive a broken run.
LOCK_FILE="${OUTBOX_TEST_LOCK:-/tmp/outbox-test.lock}"
if [ "${OUTBOX_TEST_LOCK_HELD:-}" != "$LOCK_FILE" ]; then
    flock -n -o "$LOCK_FILE" true || echo "test.sh: another run holds $LOCK_FILE; waiting for it"
    OUTBOX_TEST_LOCK_HELD="$LOCK_FILE" exec flock -o "$LOCK_FILE" bash "${BASH_SOURCE[0]}" "$@"
fi

# cargo pgrx test stops its own server unless its test binary was killed (a timeout); pgrx
# keeps the data in --pgdata/<major>-<pid>.
stop_pgrx_cluster() {
    local pidfile && for pidfile in "$PGRX_PGDATA"/*/postmaster.pid; do
        [ -f "$pidfile" ] && (cd / && runuser -u postgres -- "$PG_BINDIR/pg_ctl" stop -m fast -w -t 60 \
            -D "$(dirname "$pidfile")") >/dev/null 2>&1
    done
}
cleanup() {
    for c in "${CLUSTERS[@]}"; do "$PGCLUSTER" stop "$c" >/dev/null 2>&1; done
    stop_pgrx_cluster
}
trap cleanup EXIT
trap 'echo "test.sh: interrupted" >&2; exit 130' INT TERM

summary_and_exit() {
    cleanup; echo
    [ "${#FAILURES[@]}" -gt 0 ] && printf 'Failures:\n' && printf '  %s\n' "${FAILURES[@]}"
    echo "$PASSED passed, $FAILED failed"
    exit "$((FAILED > 0))"
}

# The system PostgreSQL is shared by every checkout here, and cargo pgrx test installs its
# own build: before each suite, setup (about a second when nothing changed) puts ours back.
setup() {
    [ "${OUTBOX_SKIP_SETUP:-0}" = "1" ] && return 0
    local log="$RESULTS/setup.log" rc
    mkdir -p "$RESULTS"
    if [ -z "${SETUP_QUIET:-}" ]; then # the first run shows its progress: a fresh machine builds
        bash "$SCRIPT_DIR/setup.sh" "$@" </dev/null 2>&1 | tee "$log"
        rc="${PIPESTATUS[0]}" SETUP_QUIET=1
    else
        bash "$SCRIPT_DIR/setup.sh" "$@" </dev/null >"$log" 2>&1; rc=$?
        grep '^setup: extension installed' "$log"
    fi
    [ "$rc" -eq 0 ] && return 0
    tail -n 40 "$log" && fail "setup: scripts/setup.sh failed (log: $log)" && return 1
}

section setup
# The #[pg_test] suite installs its own build; every other one needs the release build.
if [ "${#WANT[@]}" -eq 1 ] && [ -n "${WANT[pgrx]:-}" ]; then setup --deps-only; else setup; fi ||
    summary_and_exit
rm -rf "$RESULTS"/{regress,isolation,py,relay,cli,dashboard,suites,docs,pgrx}

# run_pgxs SUITE VAR DIR EXT: `make -C pg_test installcheck` (PGXS) with only this suite's
# files in VAR (REGRESS or ISOLATION), in one fresh database; each "test NAME ... ok" counts.
run_pgxs() {
    local suite="$1" var="$2" dir="$3" ext="$4" out="$RESULTS/$1" names=() f n ok bad rc
    for f in "$REPO/pg_test/$dir"/*."$ext"; do
        n="$(basename "$f" ."$ext")"
        [ -z "${FILTER[$suite]:-}" ] || [ "$n" = "${FILTER[$suite]}" ] && [ -e "$f" ] && names+=("$n")
    done
    [ "${#names[@]}" -eq 0 ] && { fail "$suite: no test named '${FILTER[$suite]:-}'"; return; }
    section "$suite (${names[*]})"
    setup && mkdir -p "$out" || return
    "$PGCLUSTER" start outbox-test 5441 -c max_prepared_transactions=64 | sed -n 1p ||
        { fail "$suite: cluster outbox-test did not start"; return; }
    PGHOST="$(outbox_pg_sockdir outbox-test)" PGPORT=5441 PGUSER="$OUTBOX_PG_USER" \
        timeout -k 10 "$TIMEOUT" make -s -C "$REPO/pg_test" installcheck PG_CONFIG="$PG_CONFIG" \
        REGRESS= ISOLATION= "$var=${names[*]}" EXTRA_REGRESS_OPTS="--outputdir=$out" </dev/null >"$out/make.log" 2>&1
    rc=$? && "$PGCLUSTER" stop outbox-test >/dev/null 2>&1
    grep -E '^(test| ) *[a-z_0-9]+ +\.\.\. ' "$out/make.log" | sed 's/^/  /'
    ok="$(grep -cE '\.\.\. +ok' "$out/make.log")"
    bad="$(grep -cE '\.\.\. +(FAILED|failed)' "$out/make.log")"
    PASSED=$((PASSED + ok)) && for n in "${names[@]}"; do
        [ -f "$REPO/pg_test/expected/$n.out" ] ||
            echo "  $n: no pg_test/expected/$n.out; review $out/results/$n.out and copy it there"
    done
    if [ "$bad" -gt 0 ]; then
        fail "$suite: $bad file(s) failed (diffs: $out/regression.diffs)" "$bad"
        sed 's/^/    /' "$out/regression.diffs" 2>/dev/null | head -n 200
    elif [ "$rc" -ne 0 ] || [ "$ok" -ne "${#names[@]}" ]; then
        fail "$suite: make installcheck exited $rc after $ok of ${#names[@]} files (log: $out/make.log)"
        tail -n 20 "$out/make.log"
    fi
}

# run_pytest SUITE: pytest over pg_test/SUITE; its JUnit report gives the counts.
run_pytest() {
    local suite="$1" out="$RESULTS/$1" rc p=0 f=1 args
    section "$suite (pytest, pg_test/$suite)"
    setup && mkdir -p "$out" || return
    args=(-q -p no:cacheprovider --junitxml="$out/junit.xml" "$REPO/pg_test/$suite")
    # Long scripts show their output as it comes; their helpers (crash_test.py) are not tests.
    [ "$suite" = suites ] && args=(-s "${args[@]:0:4}" "$REPO/pg_test/suites/test_suites.py")
    [ -n "${FILTER[$suite]:-}" ] && args+=(-k "${FILTER[$suite]}")
    (cd "$REPO" && OUTBOX_TEST_START_CLUSTERS=1 OUTBOX_BIN="${OUTBOX_BIN:-/usr/local/bin/outbox}" \
        timeout -k 30 "${LIMIT[$suite]:-$TIMEOUT}" "$PY" -m pytest "${args[@]}") </dev/null; rc=$?
    [ -f "$out/junit.xml" ] && read -r p f < <("$PY" - "$out/junit.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
s = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = lambda k: sum(int(x.get(k, 0)) for x in s)
print(n("tests") - n("failures") - n("errors") - n("skipped"), n("failures") + n("errors"))
EOF
)
    PASSED=$((PASSED + p))
    if [ "$rc" -eq 5 ]; then # exit 5: nothing collected
        fail "$suite: no test collected${FILTER[$suite]:+ for -k '${FILTER[$suite]}'}"
    elif [ "$f" -gt 0 ]; then
        fail "$suite: $f pytest test(s) failed (report: $out/junit.xml)" "$f"
    elif [ "$rc" -ne 0 ]; then
        fail "$suite: pytest exited $rc$([ "$rc" -eq 124 ] && echo ' (timed out)')"
    fi
}

# cargo-pgrx builds a test variant of the extension, installs it into Debian's PostgreSQL
# through install-ext.sh (never rewriting a library another server has mapped) and runs its
# own cluster; initdb refuses root, hence --runas postgres and a --pgdata postgres owns.
run_pgrx() {
    local out="$RESULTS/pgrx" rc p f args=(pgrx test pg15 --runas postgres --pgdata "$PGRX_PGDATA")
    section "pgrx (cargo pgrx test pg15)"
    stop_pgrx_cluster
    rm -rf "$PGRX_PGDATA" && mkdir -p "$out" "$(dirname "$PGRX_PGDATA")"
    chown postgres: "$(dirname "$PGRX_PGDATA")"
    [ -n "${FILTER[pgrx]:-}" ] && args+=("${FILTER[pgrx]}")
    (cd "$REPO" && CARGO_PGRX="$SCRIPT_DIR/install-ext.sh" \
        timeout -k 30 "${OUTBOX_PGRX_TIMEOUT:-2400}" cargo "${args[@]}") </dev/null 2>&1 | tee "$out/cargo-pgrx-test.log"
    rc="${PIPESTATUS[0]}" && stop_pgrx_cluster
    p="$(grep -oE '^test result: .* [0-9]+ passed' "$out/cargo-pgrx-test.log" | grep -oE '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')"
    f="$(grep -oE '^test result: .* [0-9]+ failed' "$out/cargo-pgrx-test.log" | grep -oE '[0-9]+ failed' | awk '{s+=$1} END {print s+0}')"
    PASSED=$((PASSED + p))
    if [ "$f" -gt 0 ]; then
        fail "pgrx: $f #[pg_test] test(s) failed (log: $out/cargo-pgrx-test.log)" "$f"
    elif [ "$rc" -ne 0 ]; then
        fail "pgrx: cargo pgrx test exited $rc (log: $out/cargo-pgrx-test.log)"
    fi
    # Last of all, because it replaced the installed extension: put the release build back.
    setup >/dev/null
}

[ -n "${WANT[regress]:-}" ] && run_pgxs regress REGRESS sql sql
[ -n "${WANT[isolation]:-}" ] && run_pgxs isolation ISOLATION specs spec
for s in "${PYTEST_SUITES[@]}"; do [ -n "${WANT[$s]:-}" ] && run_pytest "$s"; done
[ -n "${WANT[pgrx]:-}" ] && run_pgrx
summary_and_exit
