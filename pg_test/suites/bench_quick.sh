#!/usr/bin/env bash
# Exercises the benchmark harness: `bench/run --quick` into a temporary results
# directory. Targets are not enforced here (a missed target is a finding, not a
# test failure); the suite fails only if the harness breaks or its report is
# incomplete.
set -uo pipefail

REPO="${OUTBOX_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
OUT="$(mktemp -d /tmp/outbox-bench-quick.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT

# scripts/test.sh has already run setup.sh; the repo's venv comes from it.
if [ -n "${OUTBOX_TEST_PYTHON:-}" ]; then
    export OUTBOX_BENCH_VENV="$(cd "$(dirname "$OUTBOX_TEST_PYTHON")/.." && pwd)"
fi
# Port 5471: a manual bench/run (default 5470) may be running on the same machine.
OUTBOX_SKIP_SETUP=1 "$REPO/bench/run" --quick --port "${OUTBOX_BENCH_SUITE_PORT:-5471}" --out "$OUT" </dev/null
rc=$?

ok=1
if [ "$rc" -ne 0 ]; then
    echo "bench_quick: bench/run exited with $rc"
    ok=0
fi
for f in report.md results.csv publish.png drain.png e2e_backlog.png; do
    if [ ! -s "$OUT/$f" ]; then
        echo "bench_quick: $f missing from the results"
        ok=0
    fi
done
if [ -s "$OUT/report.md" ] && grep -q '^## Harness errors' "$OUT/report.md"; then
    echo "bench_quick: the report lists harness errors"
    ok=0
fi
[ -s "$OUT/report.md" ] && sed -n '/^## Targets/,/targets met/p' "$OUT/report.md"

if [ "$ok" -eq 1 ]; then
    echo "1 passed, 0 failed"
    exit 0
fi
echo "0 passed, 1 failed"
exit 1
