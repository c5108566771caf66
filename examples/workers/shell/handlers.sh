# shellcheck shell=bash
# Built-in handlers of the shell worker (sourced by outbox-worker.sh). Each runs
# in a subshell with the payload in $PAYLOAD and the OUTBOX_* event variables set:
# return 0 = delivered, $PERMANENT_EXIT = permanent failure, anything else =
# transient failure; what it writes to stderr becomes the error text.

# One JSON line per event on stdout, the payload exactly as stored.
handle_stdout() {
    printf '{"id": %s, "topic": "%s", "subject": %s, "attempt": %s, "payload": %s}\n' \
        "$OUTBOX_EVENT_ID" "$OUTBOX_TOPIC" "$OUTBOX_SUBJECT_JSON" "$OUTBOX_ATTEMPT" "$PAYLOAD"
}

# POST the payload to $OUTBOX_WEBHOOK_URL. 2xx = delivered; 408, 429, 5xx and
# network errors = transient; any other status = permanent.
handle_webhook() {
    local resp="$WORK/resp.$BASHPID" code rc
    local -a args=(-sS -o "$resp" -w '%{http_code}' --max-time "$OUTBOX_WEBHOOK_TIMEOUT"
        -H "Content-Type: application/json" -H "Expect:"
        -H "X-Outbox-Event-Id: $OUTBOX_EVENT_ID" -H "X-Outbox-Topic: $OUTBOX_TOPIC"
        -H "X-Outbox-Attempt: $OUTBOX_ATTEMPT"
        # Receivers deduplicate on this: delivery is at least once.
        -H "Idempotency-Key: ${OUTBOX_DISPATCH_KEY:-outbox-$OUTBOX_EVENT_ID}")
    [ "$OUTBOX_SUBJECT_JSON" = null ] || args+=(-H "X-Outbox-Subject: $OUTBOX_SUBJECT")
    code="$(printf '%s' "$PAYLOAD" | curl "${args[@]}" --data-binary @- "$OUTBOX_WEBHOOK_URL")"
    rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "webhook unreachable (curl exit $rc)" >&2
        rm -f "$resp"
        return 1
    fi
    local text
    text="$(head -c 200 "$resp" 2>/dev/null)"
    rm -f "$resp"
    case "$code" in
        2??) return 0 ;;
        408 | 429 | 5??) printf 'HTTP %s from webhook: %s' "$code" "$text" >&2; return 1 ;;
        *) printf 'HTTP %s from webhook: %s' "$code" "$text" >&2; return "$PERMANENT_EXIT" ;;
    esac
}

# Any other OUTBOX_HANDLER: a command, with the payload on stdin.
handle_command() {
    printf '%s' "$PAYLOAD" | "$HANDLER"
}

# Decode the body of a JSON string literal (the text between the quotes).
json_unescape() {
    local s="$1" out="" c hex ch
    local re='^([^\\]*)\\(.)(.*)$'
    while [[ "$s" =~ $re ]]; do
        out+="${BASH_REMATCH[1]}"
        c="${BASH_REMATCH[2]}"
        s="${BASH_REMATCH[3]}"
        case "$c" in
            n) out+=$'\n' ;;
            t) out+=$'\t' ;;
            r) out+=$'\r' ;;
            b) out+=$'\b' ;;
            f) out+=$'\f' ;;
            u)
                hex="${s:0:4}"
                s="${s:4}"
                # shellcheck disable=SC2059 # the format is the \uXXXX escape itself
                printf -v ch "\\u$hex"
                out+="$ch"
                ;;
            *) out+="$c" ;;
        esac
    done
    printf '%s' "$out$s"
}

# Driven by the payload, for the end-to-end tests:
# {"sleep_ms": N, "fail": "transient"|"permanent", "fail_attempts": k, "error": text}
handle_test() {
    local p="$PAYLOAD" attempts=1 err=""
    local re_sleep='"sleep_ms":[[:space:]]*([0-9]+)' re_fail='"fail":[[:space:]]*"(transient|permanent)"'
    local re_attempts='"fail_attempts":[[:space:]]*([0-9]+)' re_err='"error":[[:space:]]*"(([^"\\]|\\.)*)"'
    if [[ "$p" =~ $re_sleep ]]; then
        local ms="${BASH_REMATCH[1]}"
        sleep "$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
    fi
    [[ "$p" =~ $re_attempts ]] && attempts="${BASH_REMATCH[1]}"
    [[ "$p" =~ $re_err ]] && err="$(json_unescape "${BASH_REMATCH[1]}")"
    if [[ "$p" =~ $re_fail ]]; then
        if [ "${BASH_REMATCH[1]}" = permanent ]; then
            printf '%s' "${err:-permanent test failure}" >&2
            return "$PERMANENT_EXIT"
        fi
        if [ "$OUTBOX_ATTEMPT" -le "$attempts" ]; then
            printf '%s' "${err:-transient test failure}" >&2
            return 1
        fi
    fi
    return 0
}
