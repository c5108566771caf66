#!/usr/bin/env python3
"""Measure the subscription storage prototype (proto.sql) against PgQ, a plain
SKIP LOCKED table and today's outbox.claim, in one run on one scratch cluster.

    .venv/bin/python docs/design/log_proto/bench.py --port 5477 [--n 100000] [--reps 3]

Needs the system PostgreSQL with pgq and outbox_ext installed (scripts/setup.sh)
and a C compiler. Every drain is checked: each event acked exactly once, and in
the subject runs, no claim returns two events of one subject and an event is
claimed only after its subject's previous event was acked. Prints a Markdown
report (medians of --reps, interleaved).
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg.types.string import TextLoader

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from obench import agents  # noqa: E402  (bench/run's PgQ consumer)
from obench import sql as S  # noqa: E402  (the payload and PgQ statements of bench/run)

PG_BINDIR = os.environ.get("PG_BINDIR", "/usr/lib/postgresql/15/bin")


def connect(dsn):
    c = psycopg.connect(dsn, autocommit=True, prepare_threshold=0)
    for t in ("jsonb", "json", "uuid"):
        c.adapters.register_loader(t, TextLoader)
    return c


# ---------------------------------------------------------------- setup

def cluster(port):
    subprocess.run(["bash", str(ROOT / "scripts" / "pgcluster.sh"), "start", "logproto", str(port),
                    "-c", "shared_buffers=256MB", "-c", "max_wal_size=4GB", "-c", "checkpoint_timeout=15min", "-c", "max_prepared_transactions=20"],
                   check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PG_BINDIR=PG_BINDIR))
    return f"host=127.0.0.1 port={port} user=postgres dbname=postgres"


def setup(dsn):
    so = "/tmp/proto_next_xid.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-I" + subprocess.check_output(
        [f"{PG_BINDIR}/pg_config" if Path(f"{PG_BINDIR}/pg_config").exists() else "pg_config",
         "--includedir-server"], text=True).strip(), "-o", so, str(HERE / "next_xid.c")], check=True)
    with connect(dsn) as c:
        for stmt in ("DROP SCHEMA IF EXISTS proto CASCADE", "DROP EXTENSION IF EXISTS pgq CASCADE",
                     "DROP TABLE IF EXISTS bench_plain", "SET outbox.allow_drop = on",
                     "DROP EXTENSION IF EXISTS outbox_ext CASCADE"):
            c.execute(stmt)
        c.execute("CREATE EXTENSION outbox_ext")
        c.execute("CREATE EXTENSION pgq")
        c.execute("SELECT pgq.create_queue('bench_q')")
        for stmt in S.PLAIN_SCHEMA.split(";"):
            c.execute(stmt)
    subprocess.run([f"{PG_BINDIR}/psql", dsn, "-q", "-v", "ON_ERROR_STOP=1", "-v", f"next_xid_so={so}",
                    "-f", str(HERE / "proto.sql")], check=True)


# ---------------------------------------------------------------- loading

def reset(c, system, subs=("s0",)):
    if system in ("proto", "floor"):
        c.execute("TRUNCATE proto.log, proto.lanes, proto.batches, proto.delivered, proto.floor_batches")
        c.execute("ALTER SEQUENCE proto.ids RESTART")
        for s in subs:
            c.execute("SELECT proto.create_subscription(%s)", (s,))
    elif system == "outbox":
        c.execute("TRUNCATE outbox.event_queue, outbox.event_archive")
    elif system == "plain":
        c.execute("TRUNCATE bench_plain")
    elif system == "pgq":
        c.execute("SELECT pgq.drop_queue('bench_q', true)")
        c.execute("SELECT pgq.create_queue('bench_q')")
        c.execute("SELECT pgq.register_consumer('bench_q', 'bench_c')")


def load(c, system, n, batch, subjects):
    """The backlog, in transactions of 10,000 events (PgQ: one tick per batch)."""
    if system == "pgq":
        lit = "'" + S.PAYLOAD.replace("'", "''") + "'"
        c.execute(S.LOAD["pgq"].format(batch=batch, chunks=n // batch, payload_lit=lit))
        return
    if system == "plain":
        c.execute(S.LOAD["plain"], {"topic": "bench.drain", "payload": S.PAYLOAD, "n": n})
        c.execute("VACUUM ANALYZE bench_plain")
        return
    fn = "proto.publish_batch" if system in ("proto", "floor") else "outbox.publish_batch"
    for first in range(0, n, 10000):
        k = min(10000, n - first)
        subj = ("(SELECT array_agg('subject-' || (g %% %(s)s::int) ORDER BY g) FROM generate_series(%(f)s::int, %(f)s::int + %(k)s::int - 1) g)"
                if subjects else "NULL::text[]")
        c.execute(f"SELECT count(*) FROM {fn}('bench.drain', (SELECT array_agg(%(p)s::jsonb) FROM generate_series(1, %(k)s::int)), {subj})",
                  {"p": S.PAYLOAD, "k": k, "f": first, "s": subjects})
    c.execute("VACUUM ANALYZE " + ("proto.log" if system in ("proto", "floor") else "outbox.event_queue"))


# ---------------------------------------------------------------- agents

CLAIM = {
    "floor": "SELECT id, lease_token, topic, subject, payload FROM proto.floor_claim(%(sub)s, %(batch)s)",
    "proto": "SELECT id, lease_token, topic, subject, payload FROM proto.claim(%(sub)s, %(w)s, %(batch)s)",
    "outbox": "SELECT id, lease_token, topic, subject, payload FROM outbox.claim(%(w)s, %(batch)s)",
    "plain": S.DRAIN["plain"]["claim"],
}
ACK = {
    "floor": "SELECT proto.floor_ack(%(ids)s::bigint[], %(tokens)s::uuid[])",
    "proto": "SELECT proto.ack(%(ids)s::bigint[], %(tokens)s::uuid[])",
    "outbox": "SELECT outbox.ack(%(ids)s::bigint[], %(tokens)s::uuid[])",
    "plain": S.DRAIN["plain"]["ack"],
}


def drain_agent(*args):
    try:
        _drain_agent(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        args[8].put({"error": f"{type(e).__name__}: {e}"})
        args[7].abort()


def _drain_agent(dsn, system, sub, wid, batch, total, counter, barrier, out, record):
    c = connect(dsn)
    w = f"w{wid}"
    log = []  # (claim seq, t_claimed, t_acked, [(id, subject)])
    barrier.wait()
    t0 = time.monotonic_ns()
    n = claims = 0
    while True:
        rows = c.execute(CLAIM[system], {"sub": sub, "w": w, "batch": batch}).fetchall()
        tc = time.monotonic_ns()
        claims += 1
        if rows:
            ids = [r[0] for r in rows]
            if system == "plain":
                acked = c.execute(ACK[system], {"ids": ids}).rowcount
            else:
                acked = c.execute(ACK[system], {"ids": ids, "tokens": [r[1] for r in rows]}).fetchone()[0]
            if acked != len(rows):
                raise RuntimeError(f"{system}: claimed {len(rows)}, acked {acked}")
            if record:
                log.append((tc, time.monotonic_ns(), [(r[0], r[3] if system != "plain" else None) for r in rows]))
            with counter.get_lock():
                counter.value += acked
            n += acked
        if len(rows) < batch and counter.value >= total:
            break
        if not rows:
            time.sleep(0.001)
    out.put({"wid": wid, "sub": sub, "n": n, "t0": t0, "t1": time.monotonic_ns(), "claims": claims, "log": log})
    c.close()


def pgq_agent(dsn, barrier, out):
    out.put(agents._pgq_consumer(barrier=barrier, dsn=dsn, deadline_s=600))


def check(logs, n, subjects):
    """Each of the n events acked once; per subject, claimed only after the
    previous event of the subject was acked, never two in one claim."""
    seen = {}
    for lg in logs:
        for tc, ta, evs in lg:
            subj_in_claim = [s for _, s in evs if s is not None]
            if len(subj_in_claim) != len(set(subj_in_claim)):
                raise RuntimeError("a claim returned two events of one subject")
            for i, s in evs:
                if i in seen:
                    raise RuntimeError(f"event {i} delivered twice")
                seen[i] = (tc, ta, s)
    if len(seen) != n:
        raise RuntimeError(f"{len(seen)} of {n} events delivered")
    if subjects:
        last = {}
        for i in sorted(seen):
            tc, ta, s = seen[i]
            if s in last and tc < last[s]:
                raise RuntimeError(f"event {i} of {s} claimed before its predecessor was acked")
            last[s] = ta


def drain(dsn, system, workers, batch, n, subjects=0, subs=1):
    """Events per second over all subscriptions (each of `subs` drained by `workers`)."""
    names = [f"s{i}" for i in range(subs)]
    with connect(dsn) as c:
        reset(c, system, names)
        load(c, system, n, batch, subjects)
        c.execute("CHECKPOINT")
    if system == "pgq":
        barrier, out = mp.Barrier(1), mp.Queue()
        p = mp.Process(target=pgq_agent, args=(dsn, barrier, out))
        p.start()
        r = out.get(timeout=600)
        p.join()
        if r["n"] != n:
            raise RuntimeError(f"pgq read {r['n']} of {n}")
        return n / ((r["t1"] - r["t0"]) / 1e9)
    barrier, out = mp.Barrier(workers * subs), mp.Queue()
    procs = []
    for s in names:
        counter = mp.Value("q", 0)
        for w in range(workers):
            procs.append(mp.Process(target=drain_agent, args=(dsn, system, s, w, batch, n, counter, barrier, out,
                                                               system != "plain")))
    for p in procs:
        p.start()
    res = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    errors = [r["error"] for r in res if "error" in r]
    if errors:
        raise RuntimeError(f"{system} drain: " + "; ".join(errors))
    for s in names:
        mine = [r for r in res if r["sub"] == s]
        if system != "plain":
            check([r["log"] for r in mine], n, subjects)
        elif sum(r["n"] for r in mine) != n:
            raise RuntimeError("plain: lost events")
    secs = (max(r["t1"] for r in res) - min(r["t0"] for r in res)) / 1e9
    return subs * n / secs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=5477)
    ap.add_argument("--n", type=int, default=100000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated cell names (debugging)")
    a = ap.parse_args()
    dsn = cluster(a.port)
    setup(dsn)
    cells = []
    for b in (100, 500):
        cells.append((f"pgq b{b}", "pgq", 1, b, 0, 1))
        cells.append((f"floor 1w b{b}", "floor", 1, b, 0, 1))
        for w in (1, 2, 4):
            cells.append((f"proto {w}w b{b}", "proto", w, b, 0, 1))
            cells.append((f"outbox {w}w b{b}", "outbox", w, b, 0, 1))
    for w in (1, 2, 4):
        cells.append((f"plain {w}w b100", "plain", w, 100, 0, 1))
        cells.append((f"proto {w}w b100 1000 subjects", "proto", w, 100, 1000, 1))
    cells.append(("proto fan-out 10 subs x 1w b100", "proto", 1, 100, 0, 10))
    if a.only:
        cells = [c for c in cells if c[0] in a.only.split(",")]
    res = {c[0]: [] for c in cells}
    for rep in range(a.reps):
        for name, system, w, b, subj, subs in cells:
            eps = drain(dsn, system, w, b, a.n, subj, subs)
            res[name].append(eps)
            print(f"rep {rep} {name}: {eps:.0f} ev/s", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}

    def best(prefix, suffix):
        vals = {w: med.get(f"{prefix} {w}w {suffix}") for w in (1, 2, 4)}
        have = [w for w in vals if vals[w]]
        if not have:
            return float("nan"), None
        w = max(have, key=lambda w: vals[w])
        return vals[w], w

    print(f"# Subscription storage prototype: drain of {a.n} events, medians of {a.reps}\n")
    print("| cell | events/s | runs |\n|---|---:|---|")
    for k, v in res.items():
        print(f"| {k} | {med[k]:.0f} | {', '.join(f'{x:.0f}' for x in v)} |")
    print("\n| ratio | value |\n|---|---:|")
    for b in (100, 500):
        if f"pgq b{b}" in med:
            pv, pw = best("proto", f"b{b}")
            ov, ow = best("outbox", f"b{b}")
            print(f"| proto (best: {pw}w) / PgQ at b{b} | {pv / med[f'pgq b{b}']:.2f}x |")
            print(f"| outbox.claim today (best: {ow}w) / PgQ at b{b} | {ov / med[f'pgq b{b}']:.2f}x |")
            if f"floor 1w b{b}" in med:
                print(f"| floor of the design (1w) / PgQ at b{b} | {med[f'floor 1w b{b}'] / med[f'pgq b{b}']:.2f}x |")
    if "plain 1w b100" in med:
        plv, plw = best("plain", "b100")
        pv, pw = best("proto", "b100")
        print(f"| proto (best: {pw}w) / plain SKIP LOCKED (best: {plw}w) at b100 | {pv / plv:.2f}x |")
        sv, sw = best("proto", "b100 1000 subjects")
        print(f"| proto with 1000 subjects (best: {sw}w) / without (best: {pw}w) at b100 | {sv / pv:.2f}x |")
        if "proto fan-out 10 subs x 1w b100" in med:
            print(f"| fan-out: 10 subscriptions together / one alone (1w b100) | "
                  f"{med['proto fan-out 10 subs x 1w b100'] / med['proto 1w b100']:.2f}x |")
    print("\n```\n" + json.dumps({"n": a.n, "reps": a.reps, "runs": res}) + "\n```")


if __name__ == "__main__":
    main()
