#!/usr/bin/env bash
# Build outbox_ext and install it into the system PostgreSQL safely.
#
#   scripts/install-ext.sh [cargo pgrx package options]   # e.g. --pg-config PATH (release build)
#   CARGO_PGRX=scripts/install-ext.sh cargo pgrx test ...  # shim, see below
#
# Why not plain `cargo pgrx install`: it copies over the installed outbox_ext.so in
# place. A running server that has the library mapped (preloaded, or loaded by a
# backend) then executes the new bytes and crashes; several engineers' clusters
# share this machine's PostgreSQL. Unlinking the old file before the install avoids
# that but leaves no library at all while cargo builds (minutes), and servers
# starting meanwhile fail with 'could not access file "outbox_ext"'.
#
# So: build the package first (`cargo pgrx package`, nothing installed yet), then
# put each file in place by copying it next to its destination and renaming it over
# the old one. rename() is atomic: every reader sees the old file or the new one,
# and servers that mapped the old inode keep it until they exit.
#
# Shim mode: pgrx-tests (`cargo pgrx test`) installs its test build by running
# "$CARGO_PGRX pgrx install --test ... [--sudo]". With CARGO_PGRX pointing here, that
# call is turned into the same package-then-rename install.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"

args=()
mode=release
if [ "${1:-}" = "pgrx" ]; then
    shift
    if [ "${1:-}" != "install" ]; then
        # Not an install: nothing to make safe, behave like cargo-pgrx itself.
        exec cargo pgrx "$@"
    fi
    shift
    # `install` builds debug unless told otherwise; `package` builds release
    # unless told otherwise. --sudo is meaningless here (we run as root).
    profile_given=0
    for a in "$@"; do
        case "$a" in
            --sudo) ;;
            --release | --profile | --profile=*) profile_given=1; args+=("$a") ;;
            *) args+=("$a") ;;
        esac
    done
    if [ "$profile_given" -eq 0 ]; then
        args+=(--debug)
        mode=debug
    fi
else
    args=("$@")
fi

# A fresh directory per kind of build, so no stale file from an earlier build is
# installed along with the new ones.
out="$REPO/target/outbox-package/$mode"
rm -rf "$out"
(cd "$REPO" && cargo pgrx package --out-dir "$out" "${args[@]+"${args[@]}"}")

# The package mirrors the filesystem: $out/usr/lib/postgresql/15/lib/outbox_ext.so etc.
# The library goes last, so a backend that sees the new library also finds the
# new SQL script and control file.
mapfile -t files < <(cd "$out" && { find . -type f ! -name '*.so' | LC_ALL=C sort; find . -type f -name '*.so'; })
[ "${#files[@]}" -gt 0 ] || { echo "install-ext: cargo pgrx package produced no files in $out" >&2; exit 1; }
for f in "${files[@]}"; do
    f="${f#./}"
    dest="/$f"
    tmp="$(dirname "$dest")/.$(basename "$dest").tmp.$$"
    mkdir -p "$(dirname "$dest")"
    cp "$out/$f" "$tmp"
    chmod a+r "$tmp"
    mv -f "$tmp" "$dest"
    echo "install-ext: installed $dest"
done

# Scripts of other builds left in the extension directory (a 0.x install, an
# upgrade script a newer checkout shipped) would offer versions this library does
# not serve: the directory holds this package's scripts and nothing else of ours.
ext_dir="$(dirname "/$(printf '%s\n' "${files[@]}" | sed 's|^\./||' | grep -m1 '/extension/outbox_ext.control$')")"
for f in "$ext_dir"/outbox_ext--*.sql; do
    [ -e "$f" ] || continue
    if ! printf '%s\n' "${files[@]}" | grep -qxF "./${f#/}"; then
        rm -f "$f"
        echo "install-ext: removed $f (not in this package)"
    fi
done
