#!/usr/bin/env bash
# Reference outbox_ext worker for operators: a bash loop around one psql session.
# Needs bash >= 5.0, psql, and curl for the webhook handler. Settings come from the
# environment (see examples/workers/README.md).
#
# Handlers: OUTBOX_HANDLER=stdout|webhook|test runs a built-in (handlers.sh);
# anything else is a command run once per event with the payload on stdin and
# OUTBOX_EVENT_ID, OUTBOX_TOPIC, OUTBOX_SUBJECT, OUTBOX_SUBJECT_JSON,
# OUTBOX_DISPATCH_KEY, OUTBOX_ATTEMPT in its environment. Exit 0 = delivered,
# exit $OUTBOX_PERMANENT_EXIT (100) = permanent failure, any other = transient
# failure; what it wrote to stderr becomes the error text.
#
# psql shows NOTIFY messages only after it runs a command, so while idle the
# worker sends its LISTENing session a `SELECT 1` every OUTBOX_LISTEN_TICK
# seconds (0.25) and claims only when a notification arrived or
# OUTBOX_POLL_INTERVAL passed.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

: "${OUTBOX_DSN:?OUTBOX_DSN is required}"
NAME="${OUTBOX_WORKER_NAME:-sh-$(hostname)-$$}"
SUBSCRIPTION="${OUTBOX_SUBSCRIPTION:-}"
SUBSCRIPTION="${SUBSCRIPTION//[[:space:]]/}"
TOPICS="${OUTBOX_TOPICS:-}"
BATCH="${OUTBOX_BATCH_SIZE:-10}"
LEASE="${OUTBOX_LEASE:-30}"
CONCURRENCY="${OUTBOX_CONCURRENCY:-1}"
POLL="${OUTBOX_POLL_INTERVAL:-5}"
RETRY_IN="${OUTBOX_RETRY_IN:-}"
RECONNECT_MAX="${OUTBOX_RECONNECT_MAX:-30}"
HANDLER="${OUTBOX_HANDLER:-stdout}"
PERMANENT_EXIT="${OUTBOX_PERMANENT_EXIT:-100}"
TICK="${OUTBOX_LISTEN_TICK:-0.25}"
DELIVERY_LOG="${OUTBOX_DELIVERY_LOG:-}"
export OUTBOX_WEBHOOK_URL="${OUTBOX_WEBHOOK_URL:-}" OUTBOX_WEBHOOK_TIMEOUT="${OUTBOX_WEBHOOK_TIMEOUT:-10}"

log() { printf '%(%Y-%m-%dT%H:%M:%S)T %s\n' -1 "$*" >&2; }
die() { log "$*"; exit 2; }

# Seconds (possibly fractional) -> integer microseconds, and back.
to_us() {
    local v="$1" int frac
    [[ "$v" =~ ^[0-9]*(\.[0-9]*)?$ && -n "$v" ]] || die "not a number of seconds: '$v'"
    int="${v%%.*}"
    if [[ "$v" == *.* ]]; then frac="${v#*.}"; else frac=""; fi
    frac="${frac}000000"
    echo $((10#${int:-0} * 1000000 + 10#${frac:0:6}))
}
us_to_s() { printf '%d.%06d' $(($1 / 1000000)) $(($1 % 1000000)); }
# The hot paths avoid $(...): every command substitution forks.
secs_of() { printf -v SECS '%d.%06d' $(($1 / 1000000)) $(($1 % 1000000)); }

[[ "$BATCH" =~ ^[0-9]+$ && "$CONCURRENCY" =~ ^[0-9]+$ ]] || die "OUTBOX_BATCH_SIZE and OUTBOX_CONCURRENCY must be integers"
[ "$CONCURRENCY" -ge 1 ] || CONCURRENCY=1
LEASE_US="$(to_us "$LEASE")"
POLL_US="$(to_us "$POLL")"
RECONNECT_MAX_US="$(to_us "$RECONNECT_MAX")"
HEARTBEAT_US=$((LEASE_US / 3)) # two missed beats still leave the lease alive
TICK_US="$(to_us "$TICK")"
LEASE_SQL="make_interval(secs => $(us_to_s "$LEASE_US"))"
if [ -n "$RETRY_IN" ]; then
    RETRY_SQL="make_interval(secs => $(us_to_s "$(to_us "$RETRY_IN")"))"
else
    RETRY_SQL="NULL" # the extension's backoff
fi

sql_literal() { printf "'%s'" "${1//\'/\'\'}"; }
# Arbitrary text (error messages) goes to SQL hex-encoded: no quoting to get
# wrong. iconv -c drops invalid UTF-8, which convert_from would reject.
sql_text() {
    local hex
    hex="$(printf '%s' "$1" | iconv -c -f UTF-8 -t UTF-8 2>/dev/null | od -An -v -tx1 | tr -d ' \n')"
    printf "convert_from(decode('%s', 'hex'), 'UTF8')" "$hex"
}
json_string() {
    local s="$1"
    s="${s//\\/\\\\}"; s="${s//\"/\\\"}"; s="${s//$'\n'/\\n}"; s="${s//$'\t'/\\t}"; s="${s//$'\r'/\\r}"
    printf '"%s"' "$s"
}

SUBSCRIPTION_SQL="NULL" # unset or empty: the 'default' subscription
[ -n "$SUBSCRIPTION" ] && SUBSCRIPTION_SQL="$(sql_literal "$SUBSCRIPTION")"
TOPICS_SQL="NULL"
WANTED=()
if [ -n "$TOPICS" ]; then
    IFS=',' read -ra WANTED <<<"$TOPICS"
    parts=()
    for t in "${WANTED[@]}"; do parts+=("$(sql_literal "${t// /}")"); done
    TOPICS_SQL="ARRAY[$(IFS=,; echo "${parts[*]}")]::text[]"
fi
# Whether a notification for topic $1 wakes the worker. A notification names a
# topic, not a subscription: WANTED is the claim's own filter (OUTBOX_TOPICS;
# every topic when unset), never the subscription's topics, so a worker of a
# filtered subscription wakes for each of its topics, and a wake-up for a topic
# its subscription does not take costs one empty claim.
topic_wanted() {
    [ "${#WANTED[@]}" -eq 0 ] && return 0
    local p
    for p in "${WANTED[@]}"; do
        p="${p// /}"
        if [ "$p" = "*" ] || [ "$p" = "$1" ] || { [[ "$p" == *.\* ]] && [[ "$1" == "${p%\*}"* ]]; }; then
            return 0
        fi
    done
    return 1
}

# ------------------------------------------------------------------ handlers

# shellcheck source-path=SCRIPTDIR source=handlers.sh
. "$HERE/handlers.sh"
case "$HANDLER" in
    stdout | webhook | test) HANDLER_FN="handle_$HANDLER" ;;
    *)
        command -v "$HANDLER" >/dev/null || die "OUTBOX_HANDLER '$HANDLER' is neither a built-in (stdout, webhook, test) nor a command"
        HANDLER_FN="handle_command"
        ;;
esac
if [ "$HANDLER" = webhook ]; then
    [ -n "$OUTBOX_WEBHOOK_URL" ] || die "OUTBOX_HANDLER=webhook needs OUTBOX_WEBHOOK_URL"
    command -v curl >/dev/null || die "the webhook handler needs curl"
fi

# ------------------------------------------------------------------ the psql session

STOP=0
trap 'STOP=1' TERM INT
NOTIFIED=0
SESSION_UP=0
LISTENED=0
SEQ=0
RESULT=()  # result lines of the last query
SQLERR=""  # its ERROR line, if any

# psql in a coprocess: one session for LISTEN, claims, acks and heartbeats.
# Query output goes to a file (\o): bash reads a pipe one byte per system
# call, a regular file in blocks. Only a short marker line comes back through
# the pipe. -A -t and a unit-separator field delimiter give one row per line,
# fields split exactly (JSON never contains a raw 0x1f). Non-interactive psql
# exits when the connection drops, which is how we notice; its own messages go
# to our stderr.
start_session() {
    coproc PSQL {
        PGAPPNAME="$NAME" PGCLIENTENCODING=UTF8 exec psql "$OUTBOX_DSN" -X -q -A -t \
            -F $'\x1f' -v ON_ERROR_STOP=0
    }
    PSQL_IN="${PSQL[1]}"
    PSQL_OUT="${PSQL[0]}"
    SESSION_UP=1
}

stop_session() {
    if [ "$SESSION_UP" -eq 1 ]; then
        local pid="${PSQL_PID:-}"
        # bash closes the coprocess's fds itself once psql has exited.
        [ -n "${PSQL[1]:-}" ] && exec {PSQL_IN}>&-
        if [ -n "$pid" ]; then
            kill -0 "$pid" 2>/dev/null && ! [ "$STOP" -eq 1 ] && kill "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
        fi
    fi
    SESSION_UP=0
}

# Read one line from psql's stdout into LINE. A trapped signal interrupts
# `read`; keep the partial input and carry on. Fails on EOF or after 60 s.
read_line() {
    local part="" chunk rc deadline
    deadline=$((${EPOCHREALTIME/./} + 60000000))
    while :; do
        chunk=""
        IFS= read -r -t 1 -u "$PSQL_OUT" chunk 2>/dev/null
        rc=$?
        part+="$chunk"
        if [ "$rc" -eq 0 ]; then LINE="$part"; return 0; fi
        if [ "$rc" -le 128 ]; then return 1; fi # EOF: psql is gone
        [ "${EPOCHREALTIME/./}" -lt "$deadline" ] || return 1
    done
}

# Run SQL in the session; RESULT gets the result lines. Returns 0 on success,
# 1 on an SQL error (SQLERR), 2 when the session died.
run_sql() {
    local marker="__outbox_done_$((++SEQ))__" line failed="" state="" msg=""
    local -a lines
    RESULT=()
    SQLERR=""
    [ "$SESSION_UP" -eq 1 ] || return 2
    if ! printf '%s\n' "\\o '$OUT_FILE'" "$1;" '\o' \
        "\\echo $marker :ERROR :LAST_ERROR_SQLSTATE :LAST_ERROR_MESSAGE" 1>&"$PSQL_IN" 2>/dev/null; then
        log "worker=$NAME connection lost"
        stop_session
        return 2
    fi
    while :; do
        if ! read_line; then
            log "worker=$NAME connection lost"
            stop_session
            return 2
        fi
        [[ "$LINE" == "$marker "* ]] && break
    done
    read -r _ failed state msg <<<"$LINE"
    mapfile -t lines <"$OUT_FILE"
    for line in "${lines[@]}"; do
        # psql prints notifications that arrived after each command.
        if [[ "$line" =~ ^Asynchronous\ notification\ \"outbox\"\ with\ payload\ \"(.*)\"\ received ]]; then
            topic_wanted "${BASH_REMATCH[1]}" && NOTIFIED=1
        else
            RESULT+=("$line")
        fi
    done
    if [ "$failed" = true ]; then
        SQLERR="$state $msg"
        return 1
    fi
    return 0
}

backoff_sleep() { # attempt
    local d=$((100000 << ($1 < 20 ? $1 : 20)))
    [ "$d" -le "$RECONNECT_MAX_US" ] || d="$RECONNECT_MAX_US"
    d=$((d / 2 + RANDOM * (d / 2) / 32768))
    log "worker=$NAME reconnecting in $(us_to_s "$d")s"
    sleep_us "$d" "${2:-1}"
}

# Sleep; a stop request cuts it short when $2 is 1.
sleep_us() {
    local end=$((${EPOCHREALTIME/./} + $1)) left
    while left=$((end - ${EPOCHREALTIME/./})) && [ "$left" -gt 0 ]; do
        [ "${2:-1}" -eq 1 ] && [ "$STOP" -eq 1 ] && return
        [ "$left" -le 200000 ] || left=200000
        secs_of "$left"
        read -r -t "$SECS" -u "$IDLE_FD" _ 2>/dev/null
    done
}

# (Re)open the session and LISTEN. Fails only when stopping (or past $1, a
# deadline in microseconds).
ensure_session() {
    local attempt=0
    while [ "$SESSION_UP" -ne 1 ]; do
        start_session
        # outbox.claim refuses SERIALIZABLE (0A000): whatever the database's
        # default_transaction_isolation, this session claims at READ COMMITTED.
        if run_sql "SET default_transaction_isolation = 'read committed'; LISTEN outbox"; then
            [ "$LISTENED" -eq 1 ] && log "worker=$NAME reconnected, LISTEN outbox again"
            LISTENED=1
            return 0
        fi
        stop_session
        if [ -n "${1:-}" ]; then
            [ "${EPOCHREALTIME/./}" -lt "$1" ] || return 1
            backoff_sleep "$attempt" 0
        else
            [ "$STOP" -eq 0 ] || return 1
            backoff_sleep "$attempt" 1
        fi
        attempt=$((attempt + 1))
    done
}

# run_sql with reconnects, until deadline $2 (microseconds; empty = until stopping).
# An SQL error on a healthy session is fatal: it is a bug or a misconfiguration.
db() {
    local rc
    while :; do
        ensure_session "${2:-}" || return 2
        run_sql "$1"
        rc=$?
        [ "$rc" -eq 0 ] && return 0
        [ "$rc" -eq 1 ] && die "fatal: $SQLERR (in: ${1:0:200})"
        if [ -n "${2:-}" ] && [ "${EPOCHREALTIME/./}" -ge "$2" ]; then return 2; fi
        if [ -z "${2:-}" ] && [ "$STOP" -eq 1 ]; then return 2; fi
    done
}

# ------------------------------------------------------------------ a batch

WORK="$(mktemp -d "${TMPDIR:-/tmp}/outbox-worker.XXXXXX")"
OUT_FILE="$WORK/out"
mkfifo "$WORK/done" "$WORK/idle"
exec {DONE_FD}<>"$WORK/done" # handlers report "index exit-code" here
exec {IDLE_FD}<>"$WORK/idle" # never written: `read -t` on it is an interruptible sleep
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() { stop_session; rm -rf "$WORK"; }
trap cleanup EXIT
NAME_JSON="$(json_string "$NAME")"

# Per-event arrays, indexed by position in the batch.
declare -a E_ID E_TOPIC E_ATTEMPT E_TOKEN E_SUBJ_JSON E_SUBJ E_DK E_PAYLOAD E_STARTED E_PID
declare -A LIVE RUNNING # leases to keep alive; handlers not yet reported

start_handler() { # index
    local i="$1"
    E_STARTED[i]="$EPOCHREALTIME"
    (
        # In-flight handlers run to completion on SIGTERM/SIGINT: the worker
        # waits for them, then acks or fails.
        trap '' TERM INT
        set +o pipefail # a handler need not read all of its stdin
        export OUTBOX_EVENT_ID="${E_ID[i]}" OUTBOX_TOPIC="${E_TOPIC[i]}" OUTBOX_ATTEMPT="${E_ATTEMPT[i]}" \
            OUTBOX_SUBJECT="${E_SUBJ[i]}" OUTBOX_SUBJECT_JSON="${E_SUBJ_JSON[i]}" OUTBOX_DISPATCH_KEY="${E_DK[i]}"
        # shellcheck disable=SC2034 # read by the handler functions
        PAYLOAD="${E_PAYLOAD[i]}"
        "$HANDLER_FN" 2>"$WORK/$i.err"
        echo "$i $?" 1>&"$DONE_FD"
    ) &
    E_PID[i]=$!
    RUNNING[$i]=1
}

# Ack or fail event i after its handler exited with code $2; sets OUTCOME.
# (Not called in $(...): a reconnect there would die with the subshell.)
finish_event() {
    local i="$1" code="$2" err="" deadline
    deadline=$((${EPOCHREALTIME/./} + LEASE_US)) # retrying past the lease is pointless
    if [ "$code" -eq 0 ]; then
        if ! db "SELECT outbox.ack(${E_ID[i]}, '${E_TOKEN[i]}')" "$deadline"; then OUTCOME=lost; return; fi
        local acked=false
        [ "${RESULT[0]:-}" = t ] && acked=true
        if [ -n "$DELIVERY_LOG" ]; then
            printf '{"worker": %s, "id": %s, "topic": "%s", "subject": %s, "attempt": %s, "started": %s, "finished": %s, "acked": %s}\n' \
                "$NAME_JSON" "${E_ID[i]}" "${E_TOPIC[i]}" "${E_SUBJ_JSON[i]}" "${E_ATTEMPT[i]}" \
                "${E_STARTED[i]}" "$EPOCHREALTIME" "$acked" >>"$DELIVERY_LOG" || die "fatal: cannot write $DELIVERY_LOG"
        fi
        if [ "$acked" = true ]; then OUTCOME=acked; else OUTCOME=stale; fi
        return
    fi
    [ -f "$WORK/$i.err" ] && IFS= read -r -d '' err <"$WORK/$i.err"
    err="${err:0:8000}"
    [ -n "$err" ] || err="handler exited with code $code"
    local retry="$RETRY_SQL, false"
    [ "$code" -eq "$PERMANENT_EXIT" ] && retry="NULL, true"
    if ! db "SELECT outbox.fail(${E_ID[i]}, '${E_TOKEN[i]}', $(sql_text "$err"), $retry)" "$deadline"; then
        OUTCOME=lost
        return
    fi
    case "${RESULT[0]:-}" in pending) OUTCOME=retry ;; dead) OUTCOME=dead ;; *) OUTCOME=stale ;; esac
}

heartbeat() {
    local ids=() toks=() i stale IFS=,
    for i in "${!LIVE[@]}"; do
        ids+=("${E_ID[i]}")
        toks+=("'${E_TOKEN[i]}'")
    done
    [ "${#ids[@]}" -gt 0 ] || return 0
    db "SELECT t.id FROM unnest(ARRAY[${ids[*]}]::bigint[], ARRAY[${toks[*]}]::uuid[]) AS t(id, tok)
         WHERE outbox.extend_lease(t.id, t.tok, $LEASE_SQL) IS NULL" "$((${EPOCHREALTIME/./} + HEARTBEAT_US))" || return 0
    for stale in "${RESULT[@]}"; do
        for i in "${!LIVE[@]}"; do
            if [ "${E_ID[i]}" = "$stale" ]; then
                unset 'LIVE[$i]'
                log "worker=$NAME lease lost for event $stale"
            fi
        done
    done
}

# Read one handler report ("index exit-code") within $1 microseconds into
# DONE_LINE. `read -t` may stop mid-line (timeout, signal): keep the piece.
DONE_PART=""
read_done() {
    local chunk="" rc
    secs_of "$1"
    IFS= read -r -t "$SECS" -u "$DONE_FD" chunk
    rc=$?
    DONE_PART+="$chunk"
    [ "$rc" -eq 0 ] || return 1
    DONE_LINE="$DONE_PART"
    DONE_PART=""
}

on_done() { # index code
    [[ "${1:-}" =~ ^[0-9]+$ && "${2:-}" =~ ^[0-9]+$ && -n "${RUNNING[$1]:-}" ]] || return 0
    unset 'RUNNING[$1]'
    finish_event "$1" "$2"
    counts[$OUTCOME]=$((counts[$OUTCOME] + 1))
    unset 'LIVE[$1]'
    rm -f "$WORK/$1.err"
}

# A handler subshell that died without reporting (killed) would be waited for
# forever: fail its event instead. Reports are written before the subshell
# exits, so after draining them a missing report means it is gone.
reap_vanished() {
    local i gone=()
    for i in "${!RUNNING[@]}"; do
        kill -0 "${E_PID[i]}" 2>/dev/null || gone+=("$i")
    done
    [ "${#gone[@]}" -gt 0 ] || return 0
    while read_done 1000; do on_done "${DONE_LINE% *}" "${DONE_LINE#* }"; done
    for i in "${gone[@]}"; do
        [ -n "${RUNNING[$i]:-}" ] && echo "handler process vanished" >"$WORK/$i.err" && on_done "$i" 137
    done
}

process_batch() {
    local n="${#E_ID[@]}" next=0 t0 i hb_due wait_us
    local -A counts=([acked]=0 [retry]=0 [dead]=0 [stale]=0 [released]=0 [lost]=0)
    t0="${EPOCHREALTIME/./}"
    LIVE=()
    RUNNING=()
    for ((i = 0; i < n; i++)); do LIVE[$i]=1; done
    hb_due=$((t0 + HEARTBEAT_US))
    while [ "$next" -lt "$n" ] || [ "${#RUNNING[@]}" -gt 0 ]; do
        # Start handlers up to the concurrency limit; once stopping, give back
        # the events that have not started.
        while [ "$next" -lt "$n" ] && [ "${#RUNNING[@]}" -lt "$CONCURRENCY" ]; do
            if [ "$STOP" -eq 1 ]; then
                if db "SELECT outbox.fail(${E_ID[next]}, '${E_TOKEN[next]}', 'worker stopping before delivery', interval '0')" \
                    "$((${EPOCHREALTIME/./} + LEASE_US))"; then
                    counts[released]=$((counts[released] + 1))
                else
                    counts[lost]=$((counts[lost] + 1))
                fi
                unset 'LIVE[$next]'
            else
                start_handler "$next"
            fi
            next=$((next + 1))
        done
        [ "${#RUNNING[@]}" -gt 0 ] || continue
        wait_us=$((hb_due - ${EPOCHREALTIME/./}))
        [ "$wait_us" -ge 1000 ] || wait_us=1000
        if read_done "$wait_us"; then
            on_done "${DONE_LINE% *}" "${DONE_LINE#* }"
        fi
        if [ "${EPOCHREALTIME/./}" -ge "$hb_due" ]; then
            heartbeat
            reap_vanished
            hb_due=$((${EPOCHREALTIME/./} + HEARTBEAT_US))
        fi
    done
    BATCHES=$((BATCHES + 1))
    log "worker=$NAME batch=$BATCHES claimed=$n acked=${counts[acked]} retry=${counts[retry]} dead=${counts[dead]} stale=${counts[stale]} released=${counts[released]} lost=${counts[lost]} ms=$(((${EPOCHREALTIME/./} - t0) / 1000))"
}

# ------------------------------------------------------------------ main loop

CLAIM_SQL="SELECT id, topic, attempt, lease_token, coalesce(to_json(subject)::text, 'null'),
       regexp_replace(coalesce(subject, ''), '[[:cntrl:]]', ' ', 'g'),
       regexp_replace(coalesce(dispatch_key, ''), '[[:cntrl:]]', ' ', 'g'),
       payload::text
  FROM outbox.claim($(sql_literal "$NAME"), $BATCH, $LEASE_SQL, $TOPICS_SQL, $SUBSCRIPTION_SQL)"

# Wait for a wanted notification, the poll interval, or a stop request.
wait_for_work() {
    local end=$((${EPOCHREALTIME/./} + POLL_US))
    while [ "$STOP" -eq 0 ] && [ "$NOTIFIED" -eq 0 ] && [ "${EPOCHREALTIME/./}" -lt "$end" ]; do
        sleep_us "$TICK_US"
        # Any command makes psql print the notifications that arrived.
        db "SELECT 1" || return
    done
}

BATCHES=0
log "worker=$NAME starting: handler=$HANDLER subscription=${SUBSCRIPTION:-default} topics=${TOPICS:-*} batch=$BATCH lease=${LEASE}s concurrency=$CONCURRENCY poll=${POLL}s"
while [ "$STOP" -eq 0 ]; do
    # A fresh session claims at once: that covers notifications missed meanwhile.
    ensure_session || break
    NOTIFIED=0
    db "$CLAIM_SQL" || break
    if [ "${#RESULT[@]}" -gt 0 ]; then
        E_ID=() E_TOPIC=() E_ATTEMPT=() E_TOKEN=() E_SUBJ_JSON=() E_SUBJ=() E_DK=() E_PAYLOAD=() E_STARTED=() E_PID=()
        for row in "${RESULT[@]}"; do
            IFS=$'\x1f' read -r id topic attempt token sj s d payload <<<"$row"
            [[ "$id" =~ ^[0-9]+$ && "$token" =~ ^[0-9a-f-]{36}$ ]] || die "fatal: unexpected claim output: ${row:0:200}"
            E_ID+=("$id") E_TOPIC+=("$topic") E_ATTEMPT+=("$attempt") E_TOKEN+=("$token")
            E_SUBJ_JSON+=("$sj") E_SUBJ+=("$s") E_DK+=("$d") E_PAYLOAD+=("$payload")
        done
        # Acks may have unblocked later events of the same subjects, and no
        # NOTIFY announces that: claim again before sleeping.
        process_batch
        continue
    fi
    wait_for_work
done
[ "$STOP" -eq 1 ] && log "worker=$NAME got a stop signal: in-flight events finished"
log "worker=$NAME stopped"
exit 0
