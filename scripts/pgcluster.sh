#!/usr/bin/env bash
# Throwaway PostgreSQL 15 clusters for tests, one per NAME, under /tmp/outbox-pg/NAME.
#
#   scripts/pgcluster.sh start   NAME PORT [--preload] [-c key=value ...]
#   scripts/pgcluster.sh stop    NAME
#   scripts/pgcluster.sh restart NAME            # stop + start again, keeping the data
#   scripts/pgcluster.sh psql    NAME [PORT] [psql args ...]
#   scripts/pgcluster.sh env     NAME [PORT]     # prints `export PGHOST=...` lines for eval
#   scripts/pgcluster.sh dsn     NAME [PORT] [DB]
#   scripts/pgcluster.sh status  NAME
#   scripts/pgcluster.sh destroy NAME            # stop and delete the directory
#
# Layout of /tmp/outbox-pg/NAME: data/ (PGDATA), sock/ (unix socket dir), server.log, port.
# The server listens on the socket in sock/ and on 127.0.0.1:PORT only, with trust
# authentication, so tests never need passwords. Durability settings (fsync,
# synchronous_commit, full_page_writes) stay at their defaults on purpose: crash
# tests must see the same durability a real server has.
#
# initdb refuses to run as root, so everything that touches the data directory runs
# as the `postgres` OS user (runuser when we are root, sudo otherwise).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/pgenv.sh
. "$SCRIPT_DIR/pgenv.sh" --

PG_OS_USER="${PG_OS_USER:-postgres}"

die() { echo "pgcluster: $*" >&2; exit 1; }

usage() {
    sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# Run a command as the postgres OS user. `cd /` first: the caller's working
# directory (e.g. a checkout under /work) is often unreadable for postgres, and
# initdb/pg_ctl fail oddly when they cannot stat their cwd.
as_pg() {
    if [ "$(id -un)" = "$PG_OS_USER" ]; then
        (cd / && "$@")
    elif [ "$(id -u)" -eq 0 ]; then
        (cd / && runuser -u "$PG_OS_USER" -- "$@")
    else
        (cd / && sudo -n -u "$PG_OS_USER" -- "$@")
    fi
}

check_name() {
    [ -n "${1:-}" ] || usage
    case "$1" in
        */* | . | .. | -*) die "bad cluster name '$1' (plain word expected)" ;;
    esac
}

check_port() {
    case "${1:-}" in
        '' | *[!0-9]*) die "bad or missing port '${1:-}'" ;;
    esac
}

# The postmaster's pid from postmaster.pid (empty when there is no pid file).
postmaster_pid() {
    local f
    f="$(outbox_pg_datadir "$1")/postmaster.pid"
    if [ -r "$f" ]; then head -n 1 "$f" 2>/dev/null || true; fi
}

# True while the process exists and is not a zombie. A postmaster killed with
# SIGKILL (crash tests do that) stays a zombie until init reaps it, which can take
# a second here; kill -0 and pg_ctl would still call it alive, and a new
# postmaster would refuse to start on the "live" lock file.
pid_alive() {
    local state
    [ -n "${1:-}" ] && [ -r "/proc/$1/stat" ] || return 1
    state="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" || return 1
    [ -n "$state" ] && [ "$state" != "Z" ]
}

# Wait (up to ~30 s) until a dead postmaster's pid has disappeared altogether.
wait_pid_gone() {
    local pid="$1" _
    for _ in $(seq 1 300); do
        [ -e "/proc/$pid" ] || return 0
        sleep 0.1
    done
    return 0
}

is_running() {
    pid_alive "$(postmaster_pid "$1")"
}

# Quote a value for postgresql.conf: single quotes, embedded quotes doubled.
# A quoted string is accepted for every GUC type (numbers and booleans too).
conf_quote() {
    local v="$1"
    v="${v//\'/\'\'}"
    printf "'%s'" "$v"
}

cmd_stop() {
    local name="$1" data
    check_name "$name"
    data="$(outbox_pg_datadir "$name")"
    local pid
    pid="$(postmaster_pid "$name")"
    if ! pid_alive "$pid"; then
        [ -z "$pid" ] || wait_pid_gone "$pid"
        echo "pgcluster: '$name' is not running"
        return 0
    fi
    # fast: roll back open transactions and shut down cleanly. If that does not
    # finish in time (a stuck backend), fall back to immediate so that a test run
    # can never hang on shutdown.
    if ! as_pg "$PG_BINDIR/pg_ctl" stop -D "$data" -m fast -w -t 60 >/dev/null; then
        echo "pgcluster: fast shutdown of '$name' failed, using immediate" >&2
        as_pg "$PG_BINDIR/pg_ctl" stop -D "$data" -m immediate -w -t 30 >/dev/null || true
    fi
    wait_pid_gone "$pid"
    echo "pgcluster: stopped '$name'"
}

# Start the postmaster on an existing data directory and wait until it accepts
# connections; on failure show the end of the server log, which says why.
pg_start_existing() {
    local name="$1" data log
    data="$(outbox_pg_datadir "$name")"
    log="$(outbox_pg_logfile "$name")"
    # pg_ctl's own chatter (e.g. "another server might be running" after a crash
    # left a stale pid file) goes to pg_ctl.log; it is shown only on failure.
    if ! as_pg "$PG_BINDIR/pg_ctl" start -D "$data" -l "$log" -w -t 120 \
        >"$(outbox_pg_dir "$name")/pg_ctl.log" 2>&1; then
        cat "$(outbox_pg_dir "$name")/pg_ctl.log" >&2 || true
        echo "pgcluster: server '$name' failed to start; end of $log:" >&2
        tail -n 40 "$log" >&2 || true
        exit 1
    fi
}

print_conninfo() {
    local name="$1" port="$2"
    echo "pgcluster: '$name' running on port $port (data $(outbox_pg_datadir "$name"))"
    echo "  dsn:    $(outbox_pg_dsn "$name" "$port")"
    echo "  socket: PGHOST=$(outbox_pg_sockdir "$name") PGPORT=$port PGUSER=$OUTBOX_PG_USER"
}

cmd_start() {
    local name="${1:-}" port="${2:-}"
    check_name "$name"
    check_port "$port"
    shift 2
    local preload=0
    local -a settings=()
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --preload) preload=1 ;;
            -c)
                [ "$#" -ge 2 ] || die "-c needs key=value"
                settings+=("$2")
                shift
                ;;
            -c*) settings+=("${1#-c}") ;;
            *) die "unknown option '$1'" ;;
        esac
        shift
    done

    local dir data sock log
    dir="$(outbox_pg_dir "$name")"
    data="$(outbox_pg_datadir "$name")"
    sock="$(outbox_pg_sockdir "$name")"
    log="$(outbox_pg_logfile "$name")"

    # Always from scratch: a test run must not inherit state from the previous one.
    cmd_stop "$name" >/dev/null
    rm -rf "$dir"

    # The root directory is shared by all clusters; postgres must own each
    # cluster's directory, and be able to traverse the root to reach it.
    mkdir -p "$OUTBOX_PG_ROOT"
    chmod 0755 "$OUTBOX_PG_ROOT"
    chown "$PG_OS_USER:" "$OUTBOX_PG_ROOT" 2>/dev/null || true
    mkdir -p "$dir" "$sock"
    chown -R "$PG_OS_USER:" "$dir"
    chmod 0755 "$dir"

    # --no-sync only skips initdb's own final flush (seconds on slow disks); it
    # does not change any server setting. C locale keeps regression output
    # (sort order, messages) identical on every machine.
    if ! as_pg "$PG_BINDIR/initdb" -D "$data" -U "$OUTBOX_PG_USER" -A trust \
        --encoding=UTF8 --locale=C --no-sync >"$dir/initdb.log" 2>&1; then
        cat "$dir/initdb.log" >&2
        die "initdb failed for '$name'"
    fi

    # Later lines win in postgresql.conf, so appending overrides initdb's values
    # and -c settings (appended last) override ours.
    {
        echo ""
        echo "# ---- added by scripts/pgcluster.sh ----"
        echo "listen_addresses = '127.0.0.1'"
        echo "port = $port"
        echo "unix_socket_directories = $(conf_quote "$sock")"
        echo "logging_collector = off"
        echo "log_line_prefix = '%m [%p] %q%a '"
        if [ "$preload" -eq 1 ]; then
            echo "shared_preload_libraries = 'outbox_ext'"
        fi
        local kv
        for kv in "${settings[@]+"${settings[@]}"}"; do
            case "$kv" in
                *=*) ;;
                *) die "-c expects key=value, got '$kv'" ;;
            esac
            echo "${kv%%=*} = $(conf_quote "${kv#*=}")"
        done
    } | as_pg tee -a "$data/postgresql.conf" >/dev/null

    echo "$port" >"$dir/port"
    chown "$PG_OS_USER:" "$dir/port"

    pg_start_existing "$name"
    print_conninfo "$name" "$port"
}

cmd_restart() {
    local name="${1:-}" port
    check_name "$name"
    [ -f "$(outbox_pg_datadir "$name")/PG_VERSION" ] || die "cluster '$name' does not exist"
    port="$(outbox_pg_port "$name")"
    cmd_stop "$name" >/dev/null
    # A postmaster killed with SIGKILL leaves postmaster.pid behind; pg_ctl start
    # copes with a stale pid file by itself (it checks whether the pid is alive).
    pg_start_existing "$name"
    print_conninfo "$name" "$port"
}

cmd_psql() {
    local name="${1:-}"
    check_name "$name"
    shift
    local port=""
    # PORT is optional: a purely numeric second argument is the port.
    case "${1:-}" in
        '' | *[!0-9]*) port="$(outbox_pg_port "$name")" ;;
        *) port="$1"; shift ;;
    esac
    # psql itself runs as the caller: root may connect to the socket dir anyway,
    # and the role is always the cluster superuser.
    exec "$PG_BINDIR/psql" -h "$(outbox_pg_sockdir "$name")" -p "$port" \
        -U "$OUTBOX_PG_USER" -X -v ON_ERROR_STOP=1 "$@"
}

cmd_env() {
    local name="${1:-}"
    check_name "$name"
    outbox_pg_env "$name" "${2:-}"
    printf 'export PGHOST=%q PGPORT=%q PGUSER=%q\n' "$PGHOST" "$PGPORT" "$PGUSER"
}

cmd_dsn() {
    local name="${1:-}"
    check_name "$name"
    outbox_pg_dsn "$name" "${2:-}" "${3:-postgres}"
}

cmd_status() {
    local name="${1:-}"
    check_name "$name"
    if is_running "$name"; then
        print_conninfo "$name" "$(outbox_pg_port "$name")"
    else
        echo "pgcluster: '$name' is not running"
        return 3
    fi
}

cmd_destroy() {
    local name="${1:-}"
    check_name "$name"
    cmd_stop "$name"
    rm -rf "$(outbox_pg_dir "$name")"
}

[ "$#" -ge 1 ] || usage
sub="$1"
shift
case "$sub" in
    start) cmd_start "$@" ;;
    stop) cmd_stop "${1:-}" ;;
    restart) cmd_restart "$@" ;;
    psql) cmd_psql "$@" ;;
    env) cmd_env "$@" ;;
    dsn) cmd_dsn "$@" ;;
    status) cmd_status "$@" ;;
    destroy) cmd_destroy "$@" ;;
    -h | --help | help) usage ;;
    *) die "unknown command '$sub' (start|stop|restart|psql|env|dsn|status|destroy)" ;;
esac
