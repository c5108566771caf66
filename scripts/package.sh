#!/usr/bin/env bash
# Debian packages of outbox_ext and of the `outbox` command:
#
#   scripts/package.sh [--out DIR] [--pg-config PATH]
#
# writes DIR (default target/debian) /
#   outbox-ext-pg<MAJOR>_<version>_<arch>.deb  the extension for that PostgreSQL major
#                                              (the .so, the control file, the install
#                                              and upgrade scripts), Depends: postgresql-<MAJOR>
#   outbox_<version>_<arch>.deb                /usr/bin/outbox (operator commands, relay)
# so that `apt install ./target/debian/*.deb` installs both. The extension's files come
# from `cargo pgrx package` (a release build against --pg-config, default: pg_config on
# PATH), the binary from `cargo build --release` in crates/outbox. pg_test/suites/package.sh
# installs the result on this machine and tests it.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$REPO/target/debian"
PG_CONFIG="$(command -v pg_config || true)"
while [ "$#" -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --pg-config) PG_CONFIG="$2"; shift 2 ;;
        -h | --help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "package.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
[ -x "$PG_CONFIG" ] || { echo "package.sh: no pg_config (install postgresql-server-dev-N or pass --pg-config)" >&2; exit 2; }
command -v dpkg-deb >/dev/null || { echo "package.sh: dpkg-deb is missing (a Debian system is needed)" >&2; exit 2; }
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"

# The extension's version is the crate's; the binary's is its own crate's.
version_of() { sed -n 's/^version *= *"\(.*\)"/\1/p' "$1" | head -1; }
EXT_VERSION="$(version_of "$REPO/Cargo.toml")"
BIN_VERSION="$(version_of "$REPO/crates/outbox/Cargo.toml")"
PG_MAJOR="$("$PG_CONFIG" --version | sed -n 's/^PostgreSQL \([0-9]*\).*/\1/p')"
ARCH="$(dpkg --print-architecture)"
[ -n "$EXT_VERSION" ] && [ -n "$BIN_VERSION" ] && [ -n "$PG_MAJOR" ] ||
    { echo "package.sh: cannot read the versions (Cargo.toml, pg_config --version)" >&2; exit 1; }

STAGE="$REPO/target/debian-stage"
rm -rf "$STAGE"
mkdir -p "$STAGE" "$OUT"

# control FILE PACKAGE VERSION DEPENDS DESCRIPTION: a binary package's control file.
control() {
    local dir="$1/DEBIAN"
    mkdir -p "$dir"
    local size
    size="$(du -sk --exclude=DEBIAN "$1" | cut -f1)"
    cat >"$dir/control" <<CTL
Package: $2
Version: $3
Architecture: $ARCH
Maintainer: outbox_ext developers <outbox-ext@localhost>
Installed-Size: $size
Depends: $4
Section: database
Priority: optional
Description: $5
CTL
}

echo "package.sh: building the extension for PostgreSQL $PG_MAJOR (cargo pgrx package)"
EXT_ROOT="$STAGE/outbox-ext"
(cd "$REPO" && cargo pgrx package --pg-config "$PG_CONFIG" --out-dir "$EXT_ROOT") >"$STAGE/pgrx-package.log" 2>&1 ||
    { tail -20 "$STAGE/pgrx-package.log" >&2; echo "package.sh: cargo pgrx package failed" >&2; exit 1; }
[ -n "$(find "$EXT_ROOT" -name 'outbox_ext*.so' -print -quit)" ] ||
    { echo "package.sh: cargo pgrx package produced no outbox_ext.so under $EXT_ROOT" >&2; exit 1; }
mkdir -p "$EXT_ROOT/usr/share/doc/outbox-ext-pg$PG_MAJOR"
cp "$REPO/README.md" "$EXT_ROOT/usr/share/doc/outbox-ext-pg$PG_MAJOR/"
control "$EXT_ROOT" "outbox-ext-pg$PG_MAJOR" "$EXT_VERSION" "postgresql-$PG_MAJOR" \
    "transactional outbox for PostgreSQL $PG_MAJOR (extension outbox_ext)
 Publish events in your own transaction; workers claim them with leases,
 ack or fail them, with backoff, dead letters, replay and per-subject order.
 CREATE EXTENSION outbox_ext; see /usr/share/doc/outbox-ext-pg$PG_MAJOR/README.md."

echo "package.sh: building the outbox command (cargo build --release)"
(cd "$REPO/crates/outbox" && cargo build --release --locked) >"$STAGE/cargo-build.log" 2>&1 ||
    { tail -20 "$STAGE/cargo-build.log" >&2; echo "package.sh: cargo build of crates/outbox failed" >&2; exit 1; }
BIN_ROOT="$STAGE/outbox"
install -D -m 0755 "$REPO/crates/outbox/target/release/outbox" "$BIN_ROOT/usr/bin/outbox"
strip "$BIN_ROOT/usr/bin/outbox" 2>/dev/null || true
control "$BIN_ROOT" outbox "$BIN_VERSION" "libc6" \
    "operator command and relay of outbox_ext
 outbox stats|health|events|replay|cancel|topics|subscriptions|purge|tail,
 and outbox relay into NATS JetStream and signed webhooks."

rm -f "$OUT"/outbox-ext-pg"$PG_MAJOR"_*.deb "$OUT"/outbox_*.deb
dpkg-deb --root-owner-group --build "$EXT_ROOT" "$OUT/outbox-ext-pg${PG_MAJOR}_${EXT_VERSION}_${ARCH}.deb" >/dev/null
dpkg-deb --root-owner-group --build "$BIN_ROOT" "$OUT/outbox_${BIN_VERSION}_${ARCH}.deb" >/dev/null
ls -1 "$OUT"/*.deb
