# shellcheck shell=bash
# Sourced helper: where the throwaway test clusters live and how to reach them.
#
#   . scripts/pgenv.sh --              # only defines the variables and functions below
#   . scripts/pgenv.sh NAME [PORT]     # also exports PGHOST/PGPORT/PGUSER for cluster NAME
#
# Scripts must source it with `--` (or some argument): `. file` with no arguments
# inherits the caller's own positional parameters, which we would misread as NAME.
#
# Functions:
#   outbox_pg_env NAME [PORT]      export PGHOST (the cluster's socket dir), PGPORT, PGUSER
#   outbox_pg_dsn NAME [PORT] [DB] print a libpq keyword DSN (TCP on 127.0.0.1)
#   outbox_pg_port NAME            print the port recorded when the cluster was started
#
# PORT may be omitted once `scripts/pgcluster.sh start` has run: start records the
# port in $OUTBOX_PG_ROOT/NAME/port so that stop/psql/env need only the name.
#
# This file is sourced by scripts that may run with `set -u`, so every expansion
# here has a default; it must not call `exit`.

# The Debian PostgreSQL 15 server binaries; override for another install.
: "${PG_BINDIR:=/usr/lib/postgresql/15/bin}"
: "${PG_CONFIG:=$PG_BINDIR/pg_config}"
# pg_regress/pg_isolation_regress ship inside PGXS, not in bindir.
: "${PG_PGXS_TESTDIR:=/usr/lib/postgresql/15/lib/pgxs/src/test}"
# All throwaway clusters live below this directory (one sub-directory per name).
: "${OUTBOX_PG_ROOT:=/tmp/outbox-pg}"
# Clusters are initialised with this superuser; local connections use trust auth.
: "${OUTBOX_PG_USER:=postgres}"

# Directory layout of one cluster.
outbox_pg_dir()     { printf '%s/%s\n' "$OUTBOX_PG_ROOT" "$1"; }
outbox_pg_datadir() { printf '%s/%s/data\n' "$OUTBOX_PG_ROOT" "$1"; }
outbox_pg_sockdir() { printf '%s/%s/sock\n' "$OUTBOX_PG_ROOT" "$1"; }
outbox_pg_logfile() { printf '%s/%s/server.log\n' "$OUTBOX_PG_ROOT" "$1"; }

outbox_pg_port() {
    local f
    f="$(outbox_pg_dir "$1")/port"
    if [ -r "$f" ]; then
        cat "$f"
    else
        echo "pgenv: no port recorded for cluster '$1' (was it started?)" >&2
        return 1
    fi
}

outbox_pg_env() {
    local name="${1:?usage: outbox_pg_env NAME [PORT]}" port="${2:-}"
    if [ -z "$port" ]; then port="$(outbox_pg_port "$name")" || return 1; fi
    # A socket directory as PGHOST makes libpq use the unix socket: no TCP needed.
    PGHOST="$(outbox_pg_sockdir "$name")"
    PGPORT="$port"
    PGUSER="$OUTBOX_PG_USER"
    export PGHOST PGPORT PGUSER
}

outbox_pg_dsn() {
    local name="${1:?usage: outbox_pg_dsn NAME [PORT] [DB]}" port="${2:-}" db="${3:-postgres}"
    if [ -z "$port" ]; then port="$(outbox_pg_port "$name")" || return 1; fi
    # TCP on loopback, so clients that do not share our view of /tmp can connect too.
    printf 'host=127.0.0.1 port=%s user=%s dbname=%s\n' "$port" "$OUTBOX_PG_USER" "$db"
}

if [ "$#" -ge 1 ] && [ -n "${1:-}" ] && [ "${1:-}" != "--" ]; then
    outbox_pg_env "$@"
fi
