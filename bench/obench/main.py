"""Entry point: python -m obench [--quick] [--out DIR] [--port N] [--only s1,s3] ..."""

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time
import traceback

from . import agents, relay_scenario, report, scenarios
from . import sql as S
from .cluster import Cluster, ClusterError
from .runner import Ctx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

E2E_SYSTEMS = [
    ("outbox_background", "outbox", "background"),
    ("outbox_transaction", "outbox", "transaction"),
    ("plain_notify", "plain_notify", None),
]

FULL = {
    "reps": 3,
    "s1_clients": [1, 4, 16], "s1_seconds": 5,
    # 1: also publish (outbox background) with each of these numbers of named
    # subscriptions existing, at the top client count (0.9.0; target: the largest
    # / the smallest >= 0.95x)
    "s1_subscriptions": [1, 10],
    "s2_seconds": 3,
    "drain_n": 100_000, "drain_batches": [100, 500], "drain_workers": [2, 4], "drain_deadline": 240,
    "drain_cells": None,  # None = every (workers, batch) combination
    "e2e_rates": [1000, 5000], "e2e_seconds": 4, "e2e_batch": 100, "e2e_workers": 2, "e2e_poll": 0.5,
    "e2e_systems": E2E_SYSTEMS, "e2e_system_rates": {}, "wake_rate": 1000,
    # 6a: the history of `default` holds hist_delivered events it acked and
    # hist_log_dead dead letters of its own (claim + fail(permanent), ~1 ms per
    # event here); hist_iters timed claims per run
    "hist_delivered": 1_000_000, "hist_iters": 40, "hist_log_dead": 100_000,
    # 6b, 6c: a backlog of steady_backlog (6c: rotate_backlog, over three ring
    # tables) events drained by 2 workers while a publisher adds steady_rate
    # ev/s; 6c: another session runs the log step of maintenance every 0.1 s
    # with outbox.retention_delivered = rotate_retention s
    "steady_backlog": 50_000, "steady_rate": 1000, "rotate_backlog": 500_000, "rotate_retention": 0,
    "explain_blocked": 10_000, "explain_dead_pile": 20_000, "explain_active": 10_000, "explain_future": 100_000, "explain_ready": 10_000,
    # 7: s7_clients spread evenly over s7_dbs databases; s7_probes wake-up probes per
    # database and run; wait up to s7_attach_wait s for the databases' workers to
    # attach, and s7_probe_grace s after the load for the last notifications
    "s7_dbs": 4, "s7_clients": 16, "s7_seconds": 5, "s7_probes": 15, "s7_attach_wait": 20, "s7_probe_grace": 2,
    # 8: publishers at s8_rate ev/s in total ('background'), s8_workers LISTEN +
    # claim/ack workers; after s8_warmup s (not counted): s8_clean s, then a session
    # holds a transaction id for s8_held s, then s8_after s after it commits.
    # One run by default (s8_reps): each is long. Latencies tabulated in windows of
    # s8_window s; the workers get s8_drain_wait s to catch up at the end.
    # s8_pub_conns: publisher connections (None = the rule of scenario 4, rate/250);
    # 16, because beside 16 workers on 2 cores the 4 of that rule reached ~300 ev/s.
    "s8_rate": 800, "s8_workers": 16, "s8_batch": 100, "s8_poll": 0.5, "s8_reps": 1, "s8_pub_conns": 16,
    "s8_warmup": 2, "s8_clean": 20, "s8_held": 60, "s8_after": 30, "s8_window": 10, "s8_drain_wait": 60,
    # 9: s9_n payloads per column type (jsonb, json, text), read in keyset batches of s9_batch
    "s9_n": 100_000, "s9_batch": 500,
    # 10: drain s10_n events from the log through a named subscription (0.9.0:
    # create_subscription, claim(..., subscription => name), ack) in the (workers,
    # batch) cells s10_log_cells, today's outbox.claim in s10_outbox_cells, plain
    # SKIP LOCKED at s10_plain_batch with s10_plain_workers, PgQ (one consumer) at
    # s10_pgq_batches; the log drain with s10_subjects subjects in s10_subject_cells
    # (None: every log cell); s10_fanout subscriptions with one worker each at
    # s10_fanout_batch, s10_fanout_n events (None: s10_n); s10_reps repetitions
    # (None: reps)
    "s10_n": 100_000,
    "s10_log_cells": [(w, b) for b in (100, 500) for w in (1, 2, 4)],
    "s10_outbox_cells": [(w, b) for b in (100, 500) for w in (1, 2, 4)],
    "s10_plain_batch": 100, "s10_plain_workers": [1, 2, 4],
    "s10_pgq_batches": [100, 500],
    "s10_subjects": 1000, "s10_subject_cells": None,
    "s10_fanout": 10, "s10_fanout_batch": 500, "s10_fanout_n": None,
    "s10_reps": None,
    # 11: bench/relay.py (the relay into JetStream and webhooks), one run
    "s11_events": 50_000, "s11_subjects": 1000, "s11_latency_seconds": 10, "s11_webhook_events": 10_000,
    "s11_timeout": 1800,
    # 6d: the drain of 6b's backlog (steady_backlog; no publisher) while another
    # session holds one claimed event in an open transaction; if the workers ack
    # nothing for s6d_stall s, the holder rolls back then (the run is stalled)
    "s6d_stall": 5,
    # 12: streaming: publishers at s12_rate ev/s in total for s12_seconds
    # (s12_pub_conns connections, as in 8), s12_workers LISTEN workers claiming up
    # to s12_batch, a handler of s12_handler_ms per event, the batch ack; when a
    # claim returns nothing they wait for a notification or s12_poll s. PgQ: one
    # consumer, the harness ticks every s12_pgq_tick s. Each system gets
    # s12_drain_wait s after the publishers stop to deliver the rest;
    # s12_reps runs (None: reps)
    "s12_rate": 800, "s12_seconds": 60, "s12_workers": 16, "s12_batch": 100, "s12_handler_ms": 1,
    "s12_poll": 0.5, "s12_pub_conns": 16, "s12_pgq_tick": 0.1, "s12_drain_wait": 60, "s12_reps": 1,
    # 13: an idle worker's poll: s13_polls empty claims per system and repetition
    "s13_polls": 5_000,
}

# Quick: every scenario and target, smaller and shorter; fewer client counts and
# drain cells (the full run has them all).
QUICK = dict(FULL, **{
    "s1_clients": [1, 16], "s1_seconds": 1,
    "s2_seconds": 0.7,
    "drain_n": 50_000, "drain_batches": [100, 500], "drain_workers": [2, 4], "drain_deadline": 120,
    "drain_cells": [(2, 100), (4, 500)],
    "e2e_seconds": 1.5,
    "e2e_system_rates": {"outbox_transaction": [1000], "plain_notify": []},
    "hist_delivered": 100_000, "hist_iters": 20, "hist_log_dead": 5_000,
    "steady_backlog": 10_000, "rotate_backlog": 100_000,
    "s7_seconds": 2, "s7_probes": 8,
    "s8_warmup": 1, "s8_clean": 5, "s8_held": 10, "s8_after": 5, "s8_window": 2, "s8_drain_wait": 20,
    "s9_n": 20_000,
    # 10: one repetition of one cell per system and batch size, a smaller fan-out
    "s10_n": 20_000,
    "s10_log_cells": [(2, 100), (2, 500)], "s10_outbox_cells": [(2, 100)], "s10_plain_workers": [2],
    "s10_subject_cells": [(2, 100)], "s10_fanout_n": 5_000, "s10_reps": 1,
    "s11_events": 5_000, "s11_latency_seconds": 3, "s11_webhook_events": 2_000, "s11_timeout": 600,
    "s12_seconds": 10, "s12_drain_wait": 30, "s13_polls": 1_000,
})

SCENARIOS = [
    ("s1", "1. publish", scenarios.s1_publish),
    ("s2", "2. batch publish", scenarios.s2_batch),
    ("s3", "3. drain", scenarios.s3_drain),
    ("s4", "4. end to end", scenarios.s4_e2e),
    # before 6a: that one leaves a database with the extension (bench_fresh), and in
    # 0.6.0 every such database takes a worker slot (max_worker_processes)
    ("s7", "7. many databases", scenarios.s7_multidb),
    ("s8", "8. held transaction id", scenarios.s8_held_xid),
    ("s9", "9. payload output", scenarios.s9_payload),
    ("s10", "10. log drain", scenarios.s10_log_drain),
    ("s11", "11. relay", relay_scenario.s11_relay),
    ("s12", "12. streaming", scenarios.s12_streaming),
    ("s13", "13. empty poll", scenarios.s13_empty_poll),
    ("s6a", "6a. history", scenarios.s6_history),
    ("s6b", "6b. held snapshot", scenarios.s6_xmin),
    ("s6c", "6c. ring TRUNCATE", scenarios.s6_rotate),
    ("s6d", "6d. held claim", scenarios.s6_held_claim),
    ("plans", "claim plans", scenarios.explain_claims),
]


def _sh(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=10).stdout.strip()
    except Exception:
        return ""


def _load():
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench/run", description="outbox_ext benchmark suite")
    ap.add_argument("--quick", action="store_true", help="short mode (~2 min; what CI runs)")
    ap.add_argument("--out", help="results directory (default bench/results/<date>)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("OUTBOX_BENCH_PORT", 5470)))
    ap.add_argument("--only", help="comma-separated scenario ids: " + ",".join(s[0] for s in SCENARIOS))
    ap.add_argument("--reps", type=int, help="override the repetitions (>= 3 for meaningful medians)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a profile value, e.g. --set drain_n=20000 (Python literal)")
    ap.add_argument("--keep-cluster", action="store_true", help="leave the cluster running afterwards")
    args = ap.parse_args(argv)

    prof = dict(QUICK if args.quick else FULL)
    if args.reps:
        prof["reps"] = args.reps
        prof["s10_reps"] = None  # an explicit --reps applies to scenario 10 too
    for kv in args.set:
        k, _, v = kv.partition("=")
        if k not in prof:
            ap.error(f"unknown profile key {k!r}")
        import ast
        prof[k] = ast.literal_eval(v)
    only = set(args.only.split(",")) if args.only else None
    if only and not only <= {s[0] for s in SCENARIOS}:
        ap.error(f"unknown scenario in --only {args.only}")

    started = time.monotonic()
    date = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    out_dir = args.out or os.path.join(REPO, "bench", "results", date)
    os.makedirs(out_dir, exist_ok=True)
    logf = open(os.path.join(out_dir, "run.log"), "a")

    def say(msg):
        line = f"[{time.monotonic() - started:6.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)

    _wait_for_library(say)
    so_start = _so_info()
    _clean_stale_dirs(args.port, say)
    # One directory per run: a second benchmark on the machine (e.g. a CI clone)
    # must never stop or delete this run's cluster; a port clash fails at start.
    cluster = Cluster(f"/tmp/outbox-bench-{args.port}-{os.getpid()}", args.port)
    ctx = None
    rc = 0
    load_start = _load()
    try:
        say(f"creating cluster on port {args.port} in {cluster.root}; library: {so_start}")
        cluster.create()
        cluster.start()
        cluster_lib = _so_stat()
        ctx = Ctx(cluster, prof, out_dir, say)
        ctx.sql(S.OUTBOX_SCHEMA)
        for stmt in S.PGQ_SCHEMA.split(";\n"):
            ctx.sql(stmt.rstrip(";"))
        for stmt in S.PLAIN_SCHEMA.split(";\n"):
            ctx.sql(stmt.rstrip(";"))
        # 'background' mode needs the worker attached to this database.
        for _ in range(100):
            pid = ctx.one("SELECT worker_pid FROM outbox.wakeup_status()")
            if pid:
                break
            time.sleep(0.1)
        else:
            raise ClusterError("the outbox_ext background worker did not start")
        settings = ctx.sql("SELECT name, current_setting(name), NULL, source FROM pg_settings "
                           "WHERE source NOT IN ('default', 'override', 'client', 'session') ORDER BY name").fetchall()
        say("server settings: " + ", ".join(f"{n}={s}{(' ' + u) if u else ''}" for n, s, u, _ in settings))
        for sid, title, fn in SCENARIOS:
            if only and sid not in only:
                continue
            t = time.monotonic()
            say(f"scenario {title}")
            for attempt in (1, 2, 3):
                marks = (len(ctx.rows), len(ctx.targets), len(ctx.sections))
                if _so_stat() != cluster_lib:
                    cluster_lib = _restart_on_new_library(ctx, cluster, say)
                try:
                    fn(ctx)
                    break
                except Exception:
                    err = traceback.format_exc()
                    # On a shared machine someone may reinstall the extension under the
                    # running server, or stop it: restart it (on the new library) and
                    # run the scenario again.
                    time.sleep(1)
                    if _so_stat() != cluster_lib or not cluster.is_running():
                        cluster_lib = _restart_on_new_library(ctx, cluster, say)
                        if attempt < 3:
                            del ctx.rows[marks[0]:], ctx.targets[marks[1]:], ctx.sections[marks[2]:]
                            ctx.retried.append(title)
                            say(f"scenario {title}: retrying on the new library")
                            continue
                    ctx.errors.append((title, err))
                    say(f"scenario {title} FAILED:\n{err}")
                    try:
                        ctx.admin.close()
                    except Exception:
                        pass
                    ctx.admin = agents.connect(cluster.dsn())
                    break
            say(f"scenario {title} took {time.monotonic() - t:.0f}s")
    except BaseException as e:  # noqa: BLE001
        say(f"harness failed: {e!r}\n{traceback.format_exc()}")
        rc = 1
    finally:
        if ctx is not None:
            try:
                meta = _meta(ctx, args, argv, date, started, load_start)
                if meta["so"] != so_start:
                    meta["so"] = f"{so_start}; **replaced during the run**, now: {meta['so']}"
                report.write_csv(ctx, os.path.join(out_dir, "results.csv"))
                made = report.plots(ctx, out_dir)
                report.write_markdown(ctx, os.path.join(out_dir, "report.md"), meta, made)
                say(f"report: {os.path.join(out_dir, 'report.md')}")
                missed = [t for t in ctx.targets if not t["met"]]
                say(f"targets: {len(ctx.targets) - len(missed)} met, {len(missed)} missed"
                    + "".join(f"\n  MISSED {t['id']}: {t['what']} = "
                              + ("n/a" if t["value"] is None else f"{t['value']:.2f}{t['unit']}")
                              for t in missed))
            except Exception:
                say(f"writing the report failed:\n{traceback.format_exc()}")
                rc = 1
            if ctx.errors:
                say(f"{len(ctx.errors)} scenario(s) failed: " + ", ".join(n for n, _ in ctx.errors))
                rc = 1
        if not args.keep_cluster:
            cluster.destroy()
        logf.close()
    return rc


def _q(ctx, sql, default="?"):
    try:
        return ctx.one(sql)
    except Exception:
        try:  # the admin session may have died with a scenario; try once more
            ctx.admin = agents.connect(ctx.cluster.dsn())
            return ctx.one(sql)
        except Exception:
            return default


def _meta(ctx, args, argv, date, started, load_start):
    try:
        settings = ctx.sql("SELECT name, current_setting(name), NULL, source FROM pg_settings "
                           "WHERE source NOT IN ('default', 'override', 'client', 'session') ORDER BY name").fetchall()
    except Exception:
        settings = []
    dirty = _sh(["git", "status", "--porcelain", "--untracked-files=no"])
    return {
        "date": date, "mode": "quick" if args.quick else "full",
        "elapsed": f"{time.monotonic() - started:.0f} s",
        "command": "bench/run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": _sh(["git", "rev-parse", "--short", "HEAD"]) + (" (dirty)" if dirty else ""),
        "ext_version": _q(ctx, "SELECT extversion FROM pg_extension WHERE extname = 'outbox_ext'"),
        "pgq_version": _q(ctx, "SELECT extversion FROM pg_extension WHERE extname = 'pgq'"),
        "so": _so_info(),
        "server_version": _q(ctx, "SELECT version()"),
        "machine": f"{os.cpu_count()} CPUs, {_sh(['uname', '-sr'])}",
        "load_start": load_start, "load_end": _load(),
        "settings": settings,
    }


def _wait_for_library(say, path="/usr/lib/postgresql/15/lib/outbox_ext.so", seconds=180):
    """A reinstall unlinks the library for a while; wait instead of failing."""
    if os.path.exists(path):
        return
    say(f"{path} is missing (a reinstall in progress?); waiting up to {seconds} s")
    for _ in range(seconds):
        time.sleep(1)
        if os.path.exists(path):
            time.sleep(2)  # let the install finish writing the SQL files
            return


def _is_debug_build(path):
    out = _sh(["readelf", "-S", "--wide", path])
    if out:
        return ".debug_info" in out
    return os.path.getsize(path) > 20 * 1024 * 1024


def _clean_stale_dirs(port, say):
    """Remove cluster directories of earlier runs whose harness process is gone."""
    import glob
    import shutil
    for d in glob.glob(f"/tmp/outbox-bench-{port}-*"):
        pid = d.rsplit("-", 1)[-1]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        c = Cluster(d, port)
        if c.is_running():
            c.stop()
        shutil.rmtree(d, ignore_errors=True)
        say(f"removed the stale cluster directory {d}")


def _restart_on_new_library(ctx, cluster, say):
    say("the outbox_ext library was replaced or the server stopped; restarting the cluster")
    _wait_for_library(say)
    try:
        ctx.admin.close()
    except Exception:
        pass
    cluster.stop()
    cluster.start()
    ctx.admin = agents.connect(cluster.dsn())
    # The new build may come with new SQL (columns, functions): install it afresh.
    ctx.sql("SET outbox.allow_drop = on")
    ctx.sql("DROP EXTENSION outbox_ext CASCADE")
    ctx.sql(S.OUTBOX_SCHEMA)
    ctx.sql("RESET outbox.allow_drop")
    return _so_stat()


def _so_stat(path="/usr/lib/postgresql/15/lib/outbox_ext.so"):
    try:
        st = os.stat(path)
        return (st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return None


def _so_info():
    path = "/usr/lib/postgresql/15/lib/outbox_ext.so"
    try:
        st = os.stat(path)
        kind = "**DEBUG build: figures are not representative**" if _is_debug_build(path) else "release build"
        return (f"{path}, {st.st_size // 1024} KiB, {kind}, "
                f"installed {datetime.datetime.fromtimestamp(st.st_mtime):%Y-%m-%d %H:%M}")
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
