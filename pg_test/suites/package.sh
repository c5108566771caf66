#!/usr/bin/env bash
# The Debian packages (scripts/package.sh), installed the way a user would:
# build both, check their contents, `apt-get install ./*.deb`, then on a clean
# cluster (port 5477) CREATE EXTENSION from the packaged files and run the
# packaged `outbox health` and `outbox stats --json` against it.
# The packages stay installed: their files are the ones scripts/setup.sh
# installs from the same source, and removing them would delete the extension
# the remaining suites use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
REPO="$PWD"
OUT="$REPO/target/debian"
CLUSTER=pkgtest
PORT=5477
trap 'bash scripts/pgcluster.sh stop "$CLUSTER" >/dev/null 2>&1 || true' EXIT

bash scripts/package.sh --out "$OUT" --pg-config "$(command -v pg_config)"
EXT_DEB="$(ls "$OUT"/outbox-ext-pg*_*.deb)"
BIN_DEB="$(ls "$OUT"/outbox_*.deb)"

check() { if "$@"; then echo "  ok: $*"; else echo "  FAILED: $*"; exit 1; fi; }
contents() { dpkg-deb -c "$1" | awk '{print $6}'; }
check grep -q 'usr/lib/postgresql/[0-9]*/lib/outbox_ext.so$' <(contents "$EXT_DEB")
check grep -q 'usr/share/postgresql/[0-9]*/extension/outbox_ext.control$' <(contents "$EXT_DEB")
VERSION="$(sed -n 's/^version *= *"\(.*\)"/\1/p' Cargo.toml | head -1)"
check grep -q "extension/outbox_ext--$VERSION.sql\$" <(contents "$EXT_DEB")
# Every released version upgrades: the package carries each upgrade script (none
# before 1.0.0 is tagged).
shopt -s nullglob
for f in sql/outbox_ext--*--*.sql; do
    check grep -q "extension/$(basename "$f")\$" <(contents "$EXT_DEB")
done
check grep -q '^\./usr/bin/outbox$' <(contents "$BIN_DEB")
check test "$(dpkg-deb -f "$EXT_DEB" Depends)" = "postgresql-$(pg_config --version | sed -n 's/^PostgreSQL \([0-9]*\).*/\1/p')"

DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$EXT_DEB" "$BIN_DEB" >/dev/null
check dpkg -s outbox >/dev/null
check test -x /usr/bin/outbox
check dpkg -S "$(pg_config --pkglibdir)/outbox_ext.so" >/dev/null

bash scripts/pgcluster.sh stop "$CLUSTER" >/dev/null 2>&1 || true
rm -rf "/tmp/outbox-pg/$CLUSTER"
bash scripts/pgcluster.sh start "$CLUSTER" "$PORT" --preload >/dev/null
DSN="host=127.0.0.1 port=$PORT user=postgres dbname=postgres"
psql -X -q -v ON_ERROR_STOP=1 "$DSN" -c "CREATE EXTENSION outbox_ext" -c "SELECT outbox.publish('pkg.test', '{}')" >/dev/null
check test "$(psql -X -At "$DSN" -c "SELECT extversion FROM pg_extension WHERE extname = 'outbox_ext'")" = "$VERSION"
set +e
/usr/bin/outbox health --dsn "$DSN" >"$OUT/health.txt" 2>&1
rc=$?
set -e
cat "$OUT/health.txt"
# 0 ok or 1 warning (a fresh cluster may warn, e.g. the xmin check); 2, 3 or a crash fail.
check test "$rc" -le 1
check grep -q 'background_worker' "$OUT/health.txt"
/usr/bin/outbox stats --json --dsn "$DSN" >"$OUT/stats.json"
check python3 -c "import json,sys; rows=json.load(open('$OUT/stats.json')); sys.exit(0 if any(r.get('topic') == 'pkg.test' for r in rows) else 1)"
echo "1 passed, 0 failed"
