#!/usr/bin/env bash
# Prepare this machine to build and test outbox_ext, then build and install it.
#
#   scripts/setup.sh              # everything (idempotent; a second run takes seconds)
#   scripts/setup.sh --deps-only  # tools only: skip building/installing the extension
#
# Environment knobs:
#   OUTBOX_FORCE_INSTALL=1   reinstall the extension even if nothing changed
#   OUTBOX_PYTHON=python3    interpreter used to create .venv
#
# A fresh CI machine has none of the tools, so each step checks first and only then
# installs. Must run as root (apt, and the extension install writes into the system
# PostgreSQL directories).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
# shellcheck source=scripts/pgenv.sh
. "$SCRIPT_DIR/pgenv.sh" --

PGRX_VERSION="0.18.0"
MDBOOK_VERSION="0.5.4" # the docs book (docs/book.toml); scripts/test.sh docs reads this line
DEPS_ONLY=0
for arg in "$@"; do
    case "$arg" in
        --deps-only) DEPS_ONLY=1 ;;
        -h | --help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup: unknown argument '$arg'" >&2; exit 2 ;;
    esac
done

log() { echo "setup: $*"; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (apt-get, and the install writes into the system PostgreSQL)"

# Keep cargo's binaries reachable even when the caller's PATH lacks them
# (CI runs with a plain environment).
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"

# ---------------------------------------------------------------------------
# 1. Debian packages
# ---------------------------------------------------------------------------
# postgresql-15 / -server-dev-15: the server, pg_config and headers pgrx builds against.
# libclang-dev, clang: bindgen (used by pgrx) needs libclang.
# libssl-dev, pkg-config: cargo-pgrx itself links OpenSSL when it is built.
# sudo: `cargo pgrx test --runas postgres` starts its server through sudo.
# postgresql-15-pgq3, pgqd, postgresql-15-cron: comparison points and neighbours in tests.
# postgresql-15-pgtap, libtap-parser-sourcehandler-pgtap-perl: pgTAP and pg_prove.
# python3-venv: `python3 -m venv` on Debian's python needs it.
# jq, curl: the shell reference worker and its webhook handler.
# faketime: libfaketime, to set a test server's clock back (pg_test/py/test_liveness.py).
# make: pg_test/Makefile runs the regress and isolation suites through PGXS.
# nats-server: NATS JetStream for the relay's tests (pg_test/relay).
# chromium, chromium-driver: headless browser and its WebDriver for the dashboard's tests
#   (pg_test/dashboard drives them with Selenium; nothing is downloaded at test time).
APT_PACKAGES=(
    postgresql-15 postgresql-server-dev-15 postgresql-client-15 make
    libclang-dev clang libssl-dev pkg-config sudo
    postgresql-15-pgq3 pgqd postgresql-15-cron
    postgresql-15-pgtap libtap-parser-sourcehandler-pgtap-perl
    python3-venv jq curl faketime nats-server
    chromium chromium-driver
)

pkg_installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" = "install ok installed" ]
}

missing=()
for p in "${APT_PACKAGES[@]}"; do
    pkg_installed "$p" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing apt packages: ${missing[*]}"
    apt_log="$(mktemp /tmp/outbox-setup-apt.XXXXXX.log)"
    # apt-get update only when something is missing: it is the slow part.
    if ! { env DEBIAN_FRONTEND=noninteractive apt-get update &&
        env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            "${missing[@]}"; } </dev/null >"$apt_log" 2>&1; then
        tail -n 40 "$apt_log" >&2
        die "apt-get failed (full log: $apt_log)"
    fi
    rm -f "$apt_log"
else
    log "apt packages present"
fi

[ -x "$PG_CONFIG" ] || die "pg_config not found at $PG_CONFIG"

# ---------------------------------------------------------------------------
# 2. cargo-pgrx, pinned to the pgrx version in Cargo.toml (they must match)
# ---------------------------------------------------------------------------
have_pgrx="$(cargo pgrx --version 2>/dev/null || true)"
if [ "$have_pgrx" != "cargo-pgrx $PGRX_VERSION" ]; then
    log "installing cargo-pgrx $PGRX_VERSION (found: '${have_pgrx:-none}'; takes ~6 min)"
    cargo install cargo-pgrx --version "$PGRX_VERSION" --locked --force </dev/null
else
    log "cargo-pgrx $PGRX_VERSION present"
fi

# ---------------------------------------------------------------------------
# 3. cargo pgrx init: register Debian's PostgreSQL 15 (no download of our own)
# ---------------------------------------------------------------------------
PGRX_CONFIG="${PGRX_HOME:-$HOME/.pgrx}/config.toml"
if grep -Eq "^pg15[[:space:]]*=[[:space:]]*\"$PG_CONFIG\"" "$PGRX_CONFIG" 2>/dev/null; then
    log "pgrx already initialised for pg15"
else
    log "cargo pgrx init --pg15 $PG_CONFIG"
    cargo pgrx init --pg15 "$PG_CONFIG" </dev/null
fi

# ---------------------------------------------------------------------------
# 4. Python venv for the multi-connection tests (pg_test/py)
# ---------------------------------------------------------------------------
VENV="$REPO/.venv"
PY_REQS=("psycopg[binary]>=3.1,<4" "pytest>=7")
EXTRA_REQS="$REPO/pg_test/py/requirements.txt"
if [ ! -x "$VENV/bin/python" ]; then
    py="${OUTBOX_PYTHON:-python3}"
    log "creating $VENV with $py"
    # Fall back to Debian's interpreter (python3-venv is installed above) if the
    # one on PATH cannot make venvs.
    "$py" -m venv "$VENV" 2>/dev/null || { rm -rf "$VENV"; /usr/bin/python3 -m venv "$VENV"; }
fi
if ! "$VENV/bin/python" -c 'import psycopg, pytest' 2>/dev/null; then
    log "pip install ${PY_REQS[*]}"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PY_REQS[@]}" </dev/null
else
    log "python venv ready"
fi
# Other engineers may add test dependencies in pg_test/py/requirements.txt;
# reinstall only when that file changes.
if [ -f "$EXTRA_REQS" ]; then
    want="$(sha256sum "$EXTRA_REQS" | cut -d' ' -f1)"
    if [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null || true)" != "$want" ]; then
        log "pip install -r pg_test/py/requirements.txt"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$EXTRA_REQS" </dev/null
        echo "$want" >"$VENV/.requirements.sha256"
    fi
fi
# The relay's tests (pg_test/relay): NATS and Standard Webhooks clients.
RELAY_REQS="$REPO/pg_test/relay/requirements.txt"
if [ -f "$RELAY_REQS" ]; then
    want="$(sha256sum "$RELAY_REQS" | cut -d' ' -f1)"
    if [ "$(cat "$VENV/.relay-requirements.sha256" 2>/dev/null || true)" != "$want" ]; then
        log "pip install -r pg_test/relay/requirements.txt"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$RELAY_REQS" </dev/null
        echo "$want" >"$VENV/.relay-requirements.sha256"
    fi
fi
# The dashboard's tests (pg_test/dashboard): Selenium, driving Debian's chromium.
DASH_REQS="$REPO/pg_test/dashboard/requirements.txt"
if [ -f "$DASH_REQS" ]; then
    want="$(sha256sum "$DASH_REQS" | cut -d' ' -f1)"
    if [ "$(cat "$VENV/.dashboard-requirements.sha256" 2>/dev/null || true)" != "$want" ]; then
        log "pip install -r pg_test/dashboard/requirements.txt"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$DASH_REQS" </dev/null
        echo "$want" >"$VENV/.dashboard-requirements.sha256"
    fi
fi

# ---------------------------------------------------------------------------
# 4b. mdbook, pinned, for the docs book (scripts/test.sh docs): the search feature
#     only (no `mdbook serve`/watch, which would pull a web server in)
# ---------------------------------------------------------------------------
have_mdbook="$(mdbook --version 2>/dev/null || true)"
if [ "$have_mdbook" != "mdbook v$MDBOOK_VERSION" ]; then
    log "installing mdbook $MDBOOK_VERSION (found: '${have_mdbook:-none}'; takes a few minutes)"
    cargo install mdbook --version "=$MDBOOK_VERSION" --locked --force \
        --no-default-features --features search </dev/null
else
    log "mdbook $MDBOOK_VERSION present"
fi

# Directories postgres must be able to own (for `cargo pgrx test --runas postgres`).
mkdir -p /tmp/outbox-pgrx-test
chown postgres: /tmp/outbox-pgrx-test

if [ "$DEPS_ONLY" -eq 1 ]; then
    log "done (--deps-only)"
    exit 0
fi

# ---------------------------------------------------------------------------
# 5a. The `outbox` command (crates/outbox: the relay), into /usr/local/bin
# ---------------------------------------------------------------------------
# Its own crate and workspace (it cannot be a target of the pgrx cdylib
# package); cargo rebuilds only what changed, and `install -C` leaves an
# identical binary alone.
log "building the outbox command (crates/outbox)"
(cd "$REPO/crates/outbox" && cargo build --release --locked --quiet) </dev/null
install -C -m 0755 "$REPO/crates/outbox/target/release/outbox" /usr/local/bin/outbox
log "outbox command installed: $(/usr/local/bin/outbox --version)"

# ---------------------------------------------------------------------------
# 5. Build and install the extension into Debian's PostgreSQL 15
# ---------------------------------------------------------------------------
# Skip when neither the sources nor the installed files changed since our last
# install. The installed .so is part of the key because `cargo pgrx test` installs
# its own (debug, test-only) build over ours into the same directory.
PKGLIBDIR="$("$PG_CONFIG" --pkglibdir)"
EXTDIR="$("$PG_CONFIG" --sharedir)/extension"
STAMP="$REPO/target/.outbox-install.stamp"

source_hash() {
    (
        cd "$REPO"
        # Everything that can change what `cargo pgrx install` produces.
        find src sql Cargo.toml Cargo.lock outbox_ext.control build.rs .cargo \
            -type f 2>/dev/null | LC_ALL=C sort | xargs -r sha256sum
        echo "pgrx=$PGRX_VERSION pg_config=$PG_CONFIG"
    ) | sha256sum | cut -d' ' -f1
}

installed_hash() {
    # The library plus every control/SQL file of ours; any missing file changes it.
    {
        sha256sum "$PKGLIBDIR/outbox_ext.so" 2>/dev/null || echo "no .so"
        find "$EXTDIR" -maxdepth 1 -name 'outbox_ext*' -type f 2>/dev/null |
            LC_ALL=C sort | xargs -r sha256sum
    } | sha256sum | cut -d' ' -f1
}

key="$(source_hash) $(installed_hash)"
if [ "${OUTBOX_FORCE_INSTALL:-0}" != "1" ] && [ -f "$STAMP" ] &&
    [ "$(cat "$STAMP")" = "$key" ] && [ -f "$PKGLIBDIR/outbox_ext.so" ]; then
    log "extension up to date in $PKGLIBDIR (stamp $STAMP)"
    exit 0
fi

log "building and installing (scripts/install-ext.sh: cargo pgrx package, then atomic renames)"
rm -f "$STAMP"
# Not `cargo pgrx install`: it rewrites the installed library in place, which
# crashes running servers that have it mapped (see scripts/install-ext.sh).
bash "$SCRIPT_DIR/install-ext.sh" --pg-config "$PG_CONFIG" </dev/null
[ -f "$PKGLIBDIR/outbox_ext.so" ] || die "install finished but $PKGLIBDIR/outbox_ext.so is missing"
mkdir -p "$(dirname "$STAMP")"
echo "$(source_hash) $(installed_hash)" >"$STAMP"
log "extension installed"
