"""Client processes: drain workers, PgQ consumers, publishers, e2e workers.

Each runs in its own process forked from a forkserver (no GIL sharing, no
inherited libpq sockets), connects, waits on a shared barrier so all start together, and puts
one result dict (or {"error": ...}) on the result queue. Times are
time.monotonic_ns(): CLOCK_MONOTONIC is system-wide on Linux, so timestamps
taken in different processes compare directly.
"""

import threading
import time
import traceback

import psycopg
from psycopg.types.string import TextLoader

from . import sql as S

now_ns = time.monotonic_ns


def connect(dsn, notify=None, gucs=None):
    settings = dict(gucs or {})
    if notify:
        settings["outbox.notify"] = notify
    opts = " ".join(f"-c {k}={v}" for k, v in settings.items()) or None
    conn = psycopg.connect(dsn, autocommit=True, options=opts, prepare_threshold=0)
    # Payloads and tokens stay text on the client: parsing JSON would only add
    # client CPU that is the same for every system and blurs the comparison.
    for t in ("jsonb", "json", "uuid"):
        conn.adapters.register_loader(t, TextLoader)
    return conn


def run_agent(kind, out_q, barrier, kw):
    """Process entry point: run agent `kind`, report its result or its error."""
    try:
        out_q.put(AGENTS[kind](barrier=barrier, **kw))
    except BaseException:  # noqa: BLE001 - reported to the harness
        try:
            barrier.abort()  # release the others instead of letting them hang
        except Exception:
            pass
        out_q.put({"error": f"{kind}: " + traceback.format_exc()})


# When the last _claim_ack of this process sent its claim (ns).
LAST_CLAIM_START = 0


def _claim_ack(conn, system, worker, batch, handler_ms=0):
    """One claim and one ack, separate autocommit statements; between them, when
    handler_ms is set, a handler that sleeps handler_ms per claimed event (one
    sleep for the batch). Returns (n_claimed, n_acked, t_claim_returned, ids)."""
    q = S.DRAIN[system]
    global LAST_CLAIM_START
    LAST_CLAIM_START = now_ns()
    rows = conn.execute(q["claim"], {"worker": worker, "batch": batch}).fetchall()
    t_claim = now_ns()
    if not rows:
        return 0, 0, t_claim, []
    if handler_ms:
        time.sleep(handler_ms * len(rows) / 1000)
    ids = [r[0] for r in rows]
    if system.startswith("outbox"):
        acked = conn.execute(q["ack"], {"ids": ids, "tokens": [r[1] for r in rows]}).fetchone()[0]
    else:
        acked = conn.execute(q["ack"], {"ids": ids}).rowcount
    return len(rows), acked, t_claim, ids


def _drain_worker(*, barrier, dsn, system, wid, batch, total, counter, deadline_s, gucs=None):
    """Claim/ack until at least `total` events were acked by all workers together
    and this worker has caught up (a claim returned less than a full batch)."""
    conn = connect(dsn, gucs=gucs)
    worker = f"bench-w{wid}"
    barrier.wait()
    t0 = now_ns()
    deadline = t0 + int(deadline_s * 1e9)
    n = claims = empty = 0
    while True:
        got, acked, _, _ = _claim_ack(conn, system, worker, batch)
        claims += 1
        if acked != got:
            raise RuntimeError(f"{system}: claimed {got} but acked {acked}")
        if acked:
            with counter.get_lock():
                counter.value += acked
            n += acked
        else:
            empty += 1
        if got < batch and counter.value >= total:
            break
        if now_ns() > deadline:
            raise RuntimeError(f"drain did not finish within {deadline_s}s ({counter.value}/{total} acked)")
        if not got:
            time.sleep(0.001)  # others still hold the last rows (or subjects block)
    t1 = now_ns()
    conn.close()
    return {"wid": wid, "n": n, "t0": t0, "t1": t1, "claims": claims, "empty": empty}


def _log_drain_worker(*, barrier, dsn, reader, wid, batch, total, counter, deadline_s):
    """Drain a named subscription `reader` (scenario 10): outbox.claim(...,
    subscription => reader), then the batch outbox.ack of the whole claim with
    each event's own lease token (two autocommit round trips per batch), until at
    least `total` events were acked by all of the subscription's workers together
    and this worker has caught up (a claim returned less than a full batch).
    Keeps, per non-empty claim, when it returned, when its ack was sent and its
    ids, for the harness to check (each event acked once; with subjects, their
    order)."""
    conn = connect(dsn)
    q = S.LOG_DRAIN
    prm = {"worker": f"bench-{reader}-w{wid}", "reader": reader, "batch": batch}
    tok = S.LOG_TOKEN_COL
    claims_log = []
    barrier.wait()
    t0 = now_ns()
    deadline = t0 + int(deadline_s * 1e9)
    n = claims = empty = acked_total = 0
    while True:
        rows = conn.execute(q["claim"], prm).fetchall()
        t_claim = now_ns()
        claims += 1
        got = len(rows)
        if got:
            ids = [r[0] for r in rows]
            tokens = [r[tok] for r in rows]
            t_ack = now_ns()
            # The arrays go as text literals: psycopg's adaptation of two Python
            # lists cost more client CPU per event than the ack itself (same
            # statement, same per-event tokens).
            acked = conn.execute(q["ack"], {"ids": "{" + ",".join(map(str, ids)) + "}",
                                            "tokens": "{" + ",".join(map(str, tokens)) + "}"}).fetchone()[0]
            if acked != got:
                raise RuntimeError(f"subscription {reader}: claimed {got} but outbox.ack acked {acked}")
            claims_log.append((t_claim, t_ack, ids))
            acked_total += acked
            with counter.get_lock():
                counter.value += acked
            n += acked
        else:
            empty += 1
        if got < batch and counter.value >= total:
            break
        if now_ns() > deadline:
            raise RuntimeError(f"log drain of {reader} did not finish within {deadline_s}s ({counter.value}/{total} acked)")
        if not got:
            time.sleep(0.001)  # other workers hold the last lanes (or subjects wait for acks)
    t1 = now_ns()
    conn.close()
    return {"wid": wid, "reader": reader, "n": n, "t0": t0, "t1": t1, "claims": claims, "empty": empty,
            "acked": acked_total, "log": claims_log}


def _pgq_consumer(*, barrier, dsn, deadline_s):
    conn = connect(dsn)
    q = S.DRAIN["pgq"]
    barrier.wait()
    t0 = now_ns()
    deadline = t0 + int(deadline_s * 1e9)
    n = batches = 0
    while True:
        bid = conn.execute(q["next"]).fetchone()[0]
        if bid is None:
            break
        n += len(conn.execute(q["events"], {"batch_id": bid}).fetchall())
        conn.execute(q["finish"], {"batch_id": bid})
        batches += 1
        if now_ns() > deadline:
            raise RuntimeError(f"pgq drain did not finish within {deadline_s}s")
    t1 = now_ns()
    conn.close()
    return {"n": n, "t0": t0, "t1": t1, "batches": batches}


def _pgq_stream_consumer(*, barrier, dsn, handler_ms, poll_s, stop_evt, counter):
    """PgQ's one consumer of a stream (scenario 12): next_batch, get_batch_events,
    a handler sleeping handler_ms per event, finish_batch; when next_batch finds
    no batch, wait poll_s (PgQ sends no notification) and try again, until
    stop_evt is set. Records (ev_id, t_events_returned)."""
    conn = connect(dsn)
    q = S.DRAIN["pgq"]
    recs = []
    batches = polls = 0
    # Warm, like the e2e workers: a first next_batch before the phase (a batch
    # it opens is taken up by the loop).
    bid = conn.execute(q["next"]).fetchone()[0]
    barrier.wait()
    while True:
        if bid is None:
            bid = conn.execute(q["next"]).fetchone()[0]
        if bid is None:
            if stop_evt.is_set():
                break
            polls += 1
            time.sleep(poll_s)
            continue
        rows = conn.execute(q["events"], {"batch_id": bid}).fetchall()
        t = now_ns()
        if rows:
            time.sleep(handler_ms * len(rows) / 1000)
        conn.execute(q["finish"], {"batch_id": bid})
        bid = None
        batches += 1
        recs.extend((r[0], t) for r in rows)
        with counter.get_lock():
            counter.value += len(rows)
    conn.close()
    return {"recs": recs, "claims": batches, "timeouts": polls, "wakeups": 0}


def _publisher(*, barrier, dsn, system, rate, nconns, duration_s, stop_evt, notify, record, pid):
    """Publish one event per autocommit statement at `rate` events/s in total,
    spread over nconns connections (threads). Runs for duration_s, or until
    stop_evt is set when duration_s is None. Records (id, t_commit_returned)."""
    conns = [connect(dsn, notify) for _ in range(nconns)]
    stmt = S.E2E_PUBLISH[system]
    per_conn = rate / nconns
    results = [None] * nconns
    barrier.wait()
    start = now_ns()
    end = start + int(duration_s * 1e9) if duration_s else None

    def loop(k):
        try:
            _loop(k)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            results[k] = e

    def _loop(k):
        conn = conns[k]
        recs = []
        i = 0
        late = 0
        # Stagger connections so the combined schedule is evenly spaced.
        offset = k / nconns
        while True:
            target = start + int((i + offset) / per_conn * 1e9)
            # Duration-bound: a publisher that falls behind stops on time too (its
            # achieved rate is reported), rather than catching up afterwards.
            if end is not None and (target >= end or now_ns() >= end):
                break
            if end is None and stop_evt.is_set():
                break
            wait = target - now_ns()
            if wait > 0:
                time.sleep(wait / 1e9)
            elif wait < -5_000_000:
                late += 1
            ev_id = conn.execute(stmt, {"payload": S.PAYLOAD}).fetchone()[0]
            t = now_ns()
            if record:
                recs.append((ev_id, t))
            i += 1
        results[k] = (i, late, recs)

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(nconns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1 = now_ns()
    for c in conns:
        c.close()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    recs = []
    for _, _, r in results:
        recs.extend(r)
    return {"pid": pid, "n": sum(r[0] for r in results), "late": sum(r[1] for r in results),
            "t0": start, "t1": t1, "recs": recs}



def _e2e_worker(*, barrier, dsn, system, wid, batch, stop_evt, counter, poll_s, handler_ms=0, wait_empty=False,
                warm=False):
    """LISTEN outbox; claim until a claim returns less than a full batch (with
    wait_empty: until a claim returns nothing), then wait for a notification (or
    poll_s). handler_ms: see _claim_ack. Records (id, t_claim, t_ack).
    warm: one claim before the barrier, so that a connection's first use
    (catalog caches, prepared statements) falls before the phase, as for a
    worker that has been running; its events, if any, count like the others."""
    conn = connect(dsn)
    conn.execute("LISTEN outbox")
    worker = f"bench-e2e-{wid}"
    recs = []
    empties = []  # (sent, returned) of each claim that returned nothing
    claims = wakeups = timeouts = 0
    pending = [_claim_ack(conn, system, worker, batch, handler_ms)] if warm else []
    barrier.wait()
    while True:
        got, acked, t_claim, ids = pending.pop() if pending else _claim_ack(conn, system, worker, batch, handler_ms)
        t_ack = now_ns()
        claims += 1
        if not got:
            empties.append((LAST_CLAIM_START, t_claim))
        if acked != got:
            raise RuntimeError(f"{system}: claimed {got} but acked {acked}")
        if got:
            with counter.get_lock():
                counter.value += got
            recs.extend((i, t_claim, t_ack) for i in ids)
        if got >= batch or (wait_empty and got):
            continue
        if stop_evt.is_set():
            break
        n = 0
        for _ in conn.notifies(timeout=poll_s, stop_after=1):
            n += 1
        if n:
            wakeups += 1
        else:
            timeouts += 1
    conn.close()
    return {"wid": wid, "recs": recs, "claims": claims, "wakeups": wakeups, "timeouts": timeouts,
            "empties": empties}



def _wake_listener(*, barrier, dsn, prefix, stop_evt, counter):
    """LISTEN outbox in one database until stop_evt is set. Records (payload,
    t_arrived, sender pid) of the notifications whose payload starts with prefix
    (the probes) and counts the others. counter: probes heard (a worker may notify
    a topic again, e.g. in its periodic sweep of due events: counted once)."""
    conn = connect(dsn)
    conn.execute(S.MULTIDB_LISTEN)
    recs = []
    seen = set()
    other = 0
    barrier.wait()
    while not stop_evt.is_set():
        for n in conn.notifies(timeout=0.1):
            t = now_ns()
            if n.payload.startswith(prefix):
                recs.append((n.payload, t, n.pid))
                if n.payload not in seen:
                    seen.add(n.payload)
                    with counter.get_lock():
                        counter.value += 1
            else:
                other += 1
    conn.close()
    return {"kind": "listener", "dsn": dsn, "recs": recs, "other": other}


def _wake_prober(*, barrier, dsn, tag, n, warmup_s, span_s, offset):
    """n probe publishes (autocommit, outbox.notify = background), each to its own
    topic bench.probe.<tag>-<i>, evenly spaced over span_s after warmup_s (offset:
    fraction of the spacing, to stagger probers). Records (topic, t_commit_returned)
    and its backend pid (a notification from that pid was sent at the probe's
    commit, i.e. 'transaction' mode; one from another pid came from a worker)."""
    conn = connect(dsn, notify="background")
    pid = conn.info.backend_pid
    # prepare the statement outside the probed window (a topic the listener ignores)
    conn.execute(S.MULTIDB_PROBE, {"topic": f"bench.probe-warmup.{tag}", "payload": S.PAYLOAD})
    recs = []
    barrier.wait()
    start = now_ns() + int(warmup_s * 1e9)
    step = span_s / n
    for i in range(n):
        wait = start + int((i + offset) * step * 1e9) - now_ns()
        if wait > 0:
            time.sleep(wait / 1e9)
        topic = f"bench.probe.{tag}-{i}"
        conn.execute(S.MULTIDB_PROBE, {"topic": topic, "payload": S.PAYLOAD})
        recs.append((topic, now_ns()))
    conn.close()
    return {"kind": "prober", "dsn": dsn, "pid": pid, "recs": recs}


AGENTS = {
    "drain_worker": _drain_worker,
    "log_drain_worker": _log_drain_worker,
    "pgq_consumer": _pgq_consumer,
    "pgq_stream_consumer": _pgq_stream_consumer,
    "publisher": _publisher,
    "e2e_worker": _e2e_worker,
    "wake_listener": _wake_listener,
    "wake_prober": _wake_prober,
}
