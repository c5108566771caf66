#!/usr/bin/env bash
# Build the reference workers that need a build step; idempotent (each step is
# skipped when its output is up to date).
#
#   examples/workers/build.sh            # node and rust
#   examples/workers/build.sh node       # npm ci in node/ (only when package-lock.json changed)
#   examples/workers/build.sh rust       # cargo build --release in rust/ (own target dir)
#
# The Python worker needs only psycopg 3 (pip install 'psycopg[binary]>=3.2'), the
# shell worker only bash, psql and curl.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"

build_node() {
    local dir="$HERE/node"
    command -v npm >/dev/null || { echo "build: npm not found" >&2; return 1; }
    # npm ci writes node_modules/.package-lock.json; newer than the lock file
    # means node_modules matches it.
    if [ -f "$dir/node_modules/.package-lock.json" ] &&
        [ "$dir/node_modules/.package-lock.json" -nt "$dir/package-lock.json" ]; then
        echo "build: node worker up to date"
        return 0
    fi
    echo "build: npm ci (node worker)"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
}

build_rust() {
    local dir="$HERE/rust"
    command -v cargo >/dev/null || { echo "build: cargo not found" >&2; return 1; }
    echo "build: cargo build --release (rust worker)"
    # Its own target dir: the extension's build never sees these dependencies.
    (cd "$dir" && CARGO_TARGET_DIR="$dir/target" cargo build --release --locked --quiet)
}

targets=("$@")
[ "${#targets[@]}" -gt 0 ] || targets=(node rust)
for t in "${targets[@]}"; do
    case "$t" in
        node) build_node ;;
        rust) build_rust ;;
        python | shell) echo "build: $t worker needs no build" ;;
        *) echo "build: unknown worker '$t' (node, rust)" >&2; exit 2 ;;
    esac
done
