#!/usr/bin/env python3
"""A/B of two builds of outbox_ext on the same machine, interleaved.

    bench/ab/ab.py --a PORT_A --b PORT_B [--reps 3] [--n 20000]

Each port is a running preloaded server with one build of the library (for
example a released build from the system install and a development build from
a relocated copy of the PostgreSQL tree). Per repetition, A then B, it measures
in database postgres, with outbox.notify = off:
  publish_us       one publish() without subject, in a PL/pgSQL loop of N calls
  publish_subj_us  the same with a subject out of 500 (the subject lock)
  drain_us         claim(100) + batch ack round trips per event until both are drained
A change is a regression only when B is slower than A in every repetition; the
spread between repetitions is printed with the medians.
"""

import argparse
import statistics
import time

import psycopg


def run(port, n):
    with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", autocommit=True) as c:
        # A fresh install per repetition: both builds start from the same empty log.
        c.execute("DROP EXTENSION IF EXISTS outbox_ext CASCADE")
        c.execute("CREATE EXTENSION outbox_ext")
        c.execute("SET outbox.notify = 'off'")
        r = {}
        t = time.perf_counter()
        c.execute(f"DO $$ BEGIN FOR i IN 1..{n} LOOP PERFORM outbox.publish('ab.t', '{{}}'); END LOOP; END $$")
        r["publish_us"] = (time.perf_counter() - t) / n * 1e6
        t = time.perf_counter()
        c.execute(f"DO $$ BEGIN FOR i IN 1..{n} LOOP PERFORM outbox.publish('ab.s', '{{}}', subject => 's' || (i % 500)); END LOOP; END $$")
        r["publish_subj_us"] = (time.perf_counter() - t) / n * 1e6
        t = time.perf_counter()
        done = 0
        while True:
            rows = c.execute("SELECT id, lease_token FROM outbox.claim('ab', 100)").fetchall()
            if not rows:
                break
            done += c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])",
                              ([x[0] for x in rows], [x[1] for x in rows])).fetchone()[0]
        if done != 2 * n:
            raise SystemExit(f"port {port}: drained {done} of {2 * n} events")
        r["drain_us"] = (time.perf_counter() - t) / done * 1e6
        return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=int, required=True)
    ap.add_argument("--b", type=int, required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    res = {"a": [], "b": []}
    for rep in range(args.reps):
        for side, port in (("a", args.a), ("b", args.b)):
            r = run(port, args.n)
            res[side].append(r)
            print(f"rep {rep} {side} (port {port}): " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    print("| metric | A median (range) | B median (range) | B / A |")
    print("|---|---|---|---|")
    for k in res["a"][0]:
        a = [r[k] for r in res["a"]]
        b = [r[k] for r in res["b"]]
        print(f"| {k} | {statistics.median(a):.2f} ({min(a):.2f}-{max(a):.2f}) | "
              f"{statistics.median(b):.2f} ({min(b):.2f}-{max(b):.2f}) | {statistics.median(b) / statistics.median(a):.2f}x |")


if __name__ == "__main__":
    main()
