#!/usr/bin/env bash
# The demo (scripts/demo.sh) with a short workload: pgbench TPC-B-like + publish for
# 8 s, two workers, poison event, invariant check. Its exit code is the verdict.
# scripts/test.sh has already run setup, so skip it; own cluster on port 5451 so a
# demo someone runs by hand on 5450 is not disturbed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if bash scripts/demo.sh --skip-setup --duration 8 --cluster demo-suite --port 5451; then
    echo "1 passed, 0 failed"
else
    echo "0 passed, 1 failed"
    exit 1
fi
