#!/usr/bin/env python3
"""Demo summary and invariant check for one subscription; exit status 0 iff every
check holds.

Reads pgbench_history, outbox.events (and, for a named subscription,
outbox.deliveries) and the demo.* tables written by the workers, plus pgbench's
own output, and prints what happened and whether the outbox kept its promise to
that subscription: the delivered events are exactly the committed pgbench
transactions, each acknowledged once, in per-account order.
"""

import argparse
import re
import sys
from collections import Counter, defaultdict

import psycopg


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn", required=True)
    p.add_argument("--topic", default="bank.account.updated")
    p.add_argument("--pgbench-log", help="pgbench's output (for its transaction count)")
    p.add_argument("--clients", type=int)
    p.add_argument("--workers", type=int)
    p.add_argument("--duration", type=int)
    p.add_argument("--subscription", default="default",
                   help="the subscription whose deliveries are checked (default: 'default')")
    return p.parse_args()


def named_states(q, topic, sub):
    """outbox.events' columns as they are for named subscription `sub`.

    A named subscription keeps per-event state only for events that need it
    (outbox.deliveries: retries, dead letters); an event acked on its first try
    has none, and its delivery is the worker's record in demo.deliveries."""
    per_event = {r[0]: r[1:] for r in q(
        "SELECT event_id, state, attempts, max_attempts, errors FROM outbox.deliveries"
        " WHERE subscription = %s", sub)}
    acked = {r[0]: r[1:] for r in q(
        "SELECT event_id, min(acked_at), max(attempt) FROM demo.deliveries"
        " WHERE subscription = %s GROUP BY event_id", sub)}
    out = []
    for eid, subject, payload, published_at in q(
            "SELECT id, subject, payload, published_at FROM outbox.events WHERE topic = %s ORDER BY id",
            topic):
        state, attempts, max_attempts, errors = per_event.get(eid, (None, 0, 5, None))
        delivered_at = None
        if eid in acked:
            state, delivered_at = "delivered", acked[eid][0]
            attempts = max(attempts, acked[eid][1])
        elif state is None:
            state = "pending"  # not finished: it counts against "drained"
        out.append((eid, state, subject, payload, attempts, max_attempts, errors,
                    published_at, delivered_at))
    return out


def pgbench_numbers(path):
    """(transactions processed, failed, tps) from pgbench's report; None if absent."""
    if not path:
        return None
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError:
        return None
    processed = re.search(r"number of transactions actually processed: (\d+)", text)
    failed = re.search(r"number of failed transactions: (\d+)", text)
    tps = re.search(r"tps = ([0-9.]+)", text)
    if not processed:
        return None
    return (int(processed.group(1)), int(failed.group(1)) if failed else 0,
            float(tps.group(1)) if tps else None)


def pct(sorted_vals, q):
    if not sorted_vals:
        return 0.0
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def main():
    a = parse_args()
    with psycopg.connect(a.dsn) as conn:
        # One snapshot for everything we read.
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        q = lambda sql, *p: conn.execute(sql, p).fetchall()
        history = {hid: (aid, tid, bid, delta)
                   for hid, aid, tid, bid, delta in
                   q("SELECT hid, aid, tid, bid, delta FROM pgbench_history")}
        last, called = q("SELECT last_value, is_called FROM pgbench_history_hid_seq")[0]
        hids_drawn = last if called else 0
        if a.subscription == "default":
            events = q("""SELECT id, state, subject, payload, attempts, max_attempts, errors,
                                 published_at, delivered_at
                            FROM outbox.events WHERE topic = %s ORDER BY id""", a.topic)
        else:
            events = named_states(q, a.topic, a.subscription)
        other_topics = q("SELECT count(*) FROM outbox.events WHERE topic <> %s", a.topic)[0][0]
        deliveries = q("SELECT seq, event_id, worker, attempt FROM demo.deliveries"
                       " WHERE subscription = %s ORDER BY seq", a.subscription)
        failures = q("SELECT event_id, attempt, result FROM demo.failures WHERE subscription = %s",
                     a.subscription)
        wstats = q("""SELECT worker, claimed, acked, ack_stale, fail_pending, fail_dead,
                             fail_stale, wakeups, drained
                        FROM demo.worker_stats WHERE subscription = %s ORDER BY worker""",
                   a.subscription)
        started, finished = q("SELECT pgbench_started, pgbench_finished FROM demo.run")[0]

    ev = {e[0]: e for e in events}
    poison = [e for e in events if e[3].get("poison")]
    normal = [e for e in events if not e[3].get("poison")]
    by_state = Counter(e[1] for e in events)
    delivered = [e for e in events if e[1] == "delivered"]
    delivered_normal = [e for e in normal if e[1] == "delivered"]
    dead = [e for e in events if e[1] == "dead"]
    committed = len(history)
    rolled_back = hids_drawn - committed
    retried = sum(1 for f in failures if f[2] == "pending")
    poison_ids = {e[0] for e in poison}
    poison_retries = sum(1 for f in failures if f[2] == "pending" and f[0] in poison_ids)
    lease_expired = sum(1 for e in events for x in (e[6] or []) if x.get("error") == "lease expired")
    pgb = pgbench_numbers(a.pgbench_log)

    checks = []  # (ok, text)

    def check(ok, text):
        checks.append((bool(ok), text))

    # 1. delivered events <-> committed history rows, exactly.
    delivered_keys = Counter(e[3].get("hid") for e in delivered_normal)
    missing = set(history) - set(delivered_keys)
    extra = set(delivered_keys) - set(history)
    doubled = sum(n - 1 for n in delivered_keys.values() if n > 1)
    check(not missing and not extra and not doubled and len(delivered_normal) == committed,
          f"delivered events = committed pgbench_history rows: {len(delivered_normal)} = {committed}"
          f" ({len(missing)} missing, {len(extra)} unknown, {doubled} doubled)")

    # 2. aborted transactions: no history row (by construction) and no event.
    orphans = [e for e in normal if e[3].get("hid") not in history]
    text = (f"no event for a rolled-back transaction: {rolled_back} rolled back"
            f" (hid gaps), {len(orphans)} event(s) without a committed history row")
    ok = not orphans and len(normal) == committed
    if pgb:
        ok = ok and pgb[0] - pgb[1] == committed + rolled_back
        text += f"; pgbench ran {pgb[0]} = {committed} committed + {rolled_back} rolled back"
    check(ok, text)

    # 3. each delivered payload describes its own history row.
    mismatched = [e for e in delivered_normal
                  if e[3].get("hid") in history
                  and ((e[3].get("aid"), e[3].get("tid"), e[3].get("bid"), e[3].get("delta"))
                       != history[e[3]["hid"]] or e[2] != str(e[3].get("aid")))]
    check(not mismatched,
          f"every delivered payload matches its history row (aid, tid, bid, delta, subject):"
          f" {len(mismatched)} mismatch(es)")

    # 4. exactly one successful ack per delivered event.
    rec = Counter(d[1] for d in deliveries)
    dup_acks = sum(n - 1 for n in rec.values() if n > 1)
    delivered_ids = {e[0] for e in delivered}
    unrecorded = delivered_ids - set(rec)
    stray = set(rec) - delivered_ids
    wrong_attempt = sum(1 for d in deliveries if d[1] in ev and d[3] != ev[d[1]][4])
    check(not dup_acks and not unrecorded and not stray and not wrong_attempt,
          f"no duplicate acknowledgement: {len(deliveries)} ack()=true for {len(rec)} distinct"
          f" events ({dup_acks} duplicates, {len(unrecorded)} delivered without a record,"
          f" {len(stray)} recorded but not delivered)")

    # 5. drained; the poison event, and only it, is dead after all its attempts.
    unfinished = by_state["pending"] + by_state["leased"]
    poison_ok = (len(poison) == 1 and poison[0][1] == "dead"
                 and poison[0][4] == poison[0][5])
    check(unfinished == 0 and poison_ok and len(dead) == 1 and other_topics == 0,
          f"outbox drained: {unfinished} pending/leased; dead = {len(dead)}"
          f" ({'the poison event, ' + str(poison[0][4]) + ' attempts' if poison_ok else 'poison NOT dead as expected'})")

    # 5b. the workers themselves: all reported, drained, and their own counts agree.
    expected = a.workers or len(wstats)
    worker_acks = sum(w[2] for w in wstats)
    check(len(wstats) == expected and all(w[8] for w in wstats)
          and worker_acks == len(deliveries),
          f"workers: {len(wstats)}/{expected} exited normally,"
          f" {sum(1 for w in wstats if w[8])} after seeing the outbox drained;"
          f" their ack counts sum to {worker_acks} (records: {len(deliveries)})")

    # 6. every fail() the workers made is in the events' attempt history, and no
    #    attempt is unaccounted for.
    recorded = Counter((f[0], f[1]) for f in failures if f[2] != "stale")
    history_entries = Counter((e[0], x.get("attempt")) for e in events
                              for x in (e[6] or []) if x.get("error") != "lease expired")
    attempts_ok = all(len(e[6] or []) == e[4] - (1 if e[1] == "delivered" else 0)
                      for e in events if e[1] in ("delivered", "dead"))
    check(recorded == history_entries and attempts_ok,
          f"retries accounted: {sum(recorded.values())} fail() calls = {sum(history_entries.values())}"
          f" entries in events.errors; attempts = failures + 1 for every delivered event")

    # 7. per-subject (per-account) delivery order = commit order (= hid order).
    per_subject = defaultdict(list)
    for d in deliveries:
        e = ev.get(d[1])
        if e and not e[3].get("poison"):
            per_subject[e[2]].append(e[3].get("hid"))
    multi = {s: h for s, h in per_subject.items() if len(h) > 1}
    out_of_order = [s for s, h in multi.items() if h != sorted(h)]
    check(not out_of_order,
          f"per-account order: {len(multi)} accounts with several events, {len(out_of_order)}"
          f" delivered out of commit order")

    # ---- summary ----
    pub_times = [e[7] for e in events]
    del_times = [e[8] for e in delivered]
    window = ((max(del_times) - min(pub_times)).total_seconds()
              if del_times and pub_times else 0.0)
    run_secs = (finished - started).total_seconds() if started and finished else 0.0
    drain_secs = ((max(del_times) - finished).total_seconds()
                  if del_times and finished else 0.0)
    lags = sorted((e[8] - e[7]).total_seconds() * 1000 for e in delivered_normal)

    def row(label, value, note=""):
        print(f"  {label:<32}{value:>10}  {note}".rstrip())

    head = f"outbox_ext demo, subscription '{a.subscription}': pgbench TPC-B-like + outbox.publish"
    if a.clients:
        head += f", {a.clients} clients"
    if a.duration:
        head += f", {a.duration} s"
    if a.workers:
        head += f", {a.workers} workers"
    print()
    print(f"== {head} ==")
    if pgb:
        row("pgbench transactions run", pgb[0],
            f"({pgb[1]} failed; pgbench says {pgb[2]:.0f} tps)" if pgb[2] else "")
    row("committed", committed, "(pgbench_history rows)")
    row("rolled back", rolled_back, "(ROLLBACK instead of COMMIT; gaps in hid)")
    row("events published", len(events), f"({len(normal)} + {len(poison)} poison)")
    row("delivered", len(delivered))
    row("retried", retried, f"(fail() -> pending; {poison_retries} of them the poison)")
    row("dead", len(dead), "(dead-lettered after max_attempts)")
    if lease_expired:
        row("lease expirations", lease_expired)
    print("  throughput")
    row("  committed tx/s", f"{committed / run_secs:.1f}" if run_secs else "-",
        f"(over pgbench's {run_secs:.1f} s)")
    row("  delivered events/s", f"{len(delivered) / window:.1f}" if window else "-",
        f"(first publish to last ack, {window:.1f} s)")
    row("  drain after pgbench stopped", f"{drain_secs:.2f} s")
    if lags:
        row("  publish-to-ack p50/p99/max",
            f"{pct(lags, .5):.0f}/{pct(lags, .99):.0f}/{lags[-1]:.0f} ms",
            "(from the publishing transaction's start)")
    print("  workers")
    for w in wstats:
        print(f"    {w[0]:<10} claimed {w[1]:>6}  acked {w[2]:>6}  retried {w[4]:>4}"
              f"  dead {w[5]}  stale {w[3] + w[6]}  wake-ups {w[7]}"
              f"  {'drained' if w[8] else 'NOT drained'}")
    print("invariant")
    for ok, text in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {text}")
    holds = all(ok for ok, _ in checks)
    print("INVARIANT HOLDS" if holds else "INVARIANT VIOLATED")
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
