"""Shared plumbing: results, targets, agent processes, table resets, pgbench."""

import multiprocessing as mp
import os
import queue
import re
import statistics
import subprocess
import threading
import time

import psycopg

from . import agents
from . import sql as S
from .cluster import PG_BINDIR


class HarnessError(RuntimeError):
    """The harness itself broke (as opposed to a target being missed)."""


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def pct(xs, p):
    """Percentile p (0..100) by linear interpolation; xs need not be sorted."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def pgoptions(notify=None, gucs=None):
    """The PGOPTIONS of a pgbench run: outbox.notify (when given) and any further
    session settings in gucs ({name: value}), as agents.connect sets them; None
    when there are none."""
    settings = {"outbox.notify": notify} if notify else {}
    settings.update(gucs or {})
    return " ".join(f"-c {k}={v}" for k, v in settings.items()) or None


class Ctx:
    def __init__(self, cluster, prof, out_dir, say):
        self.cluster = cluster
        self.p = prof
        self.out = out_dir
        self.say = say
        self.rows = []        # results.csv rows
        self.targets = []     # target verdicts
        self.sections = []    # (title, markdown) in report order
        self.errors = []      # scenario failures (harness errors)
        self.series = {}      # data for plots
        self.retried = []     # scenarios re-run after the library was replaced
        # forkserver: children fork from a clean server that has psycopg imported
        # already (a fresh interpreter per agent costs ~1 s on a busy machine), and
        # none inherits a libpq socket from us.
        self.mp = mp.get_context("forkserver")
        self.mp.set_forkserver_preload(["obench.agents"])
        self.admin = agents.connect(cluster.dsn())

    # -- results -----------------------------------------------------------
    def rec(self, scenario, system, params, rep, metric, value, unit):
        self.rows.append({
            "scenario": scenario, "system": system,
            "params": ";".join(f"{k}={v}" for k, v in params.items()),
            "rep": rep, "metric": metric, "value": value, "unit": unit,
        })

    def values(self, scenario, system, params, metric):
        key = ";".join(f"{k}={v}" for k, v in params.items())
        return [r["value"] for r in self.rows
                if r["scenario"] == scenario and r["system"] == system
                and r["params"] == key and r["metric"] == metric]

    def med(self, scenario, system, params, metric):
        return median(self.values(scenario, system, params, metric))

    def target(self, tid, what, value, op, threshold, unit="x", note=""):
        if value is None:
            met = False
        elif op == ">=":
            met = value >= threshold
        else:
            met = value <= threshold
        self.targets.append({"id": tid, "what": what, "value": value, "op": op,
                             "threshold": threshold, "unit": unit, "met": met, "note": note})
        fig = "n/a" if value is None else f"{value:.2f}{unit}"
        verdict = "met" if met else f"MISSED ({fig})"
        self.say(f"  target {tid}: {what}: {fig} (target {op} {threshold}{unit}) -> {verdict}")

    def check(self, tid, what, ok, detail):
        """A yes/no target (e.g. a plan shape)."""
        self.targets.append({"id": tid, "what": what, "value": None, "op": "is", "threshold": None,
                             "unit": "", "met": bool(ok), "note": detail})
        self.say(f"  target {tid}: {what}: {'met' if ok else 'MISSED'} ({detail})")

    def section(self, title, md):
        self.sections.append((title, md))

    # -- database helpers ---------------------------------------------------
    def sql(self, q, params=None):
        # A reset's TRUNCATE of several tables takes their locks in its list's
        # order, and can deadlock with the background worker's retention step,
        # which locks them in another order (CI, 0.12.0: scenario 8's reset);
        # PostgreSQL cancels one of the two, and a cancelled TRUNCATE (or the DO
        # block of LOG_RESET, which rolls back as a whole) is tried again.
        for attempt in range(5):
            try:
                return self.admin.execute(q, params)
            except psycopg.errors.DeadlockDetected:
                if attempt == 4 or not q.lstrip().upper().startswith(("TRUNCATE", "DO")):
                    raise
                self.say(f"  (TRUNCATE deadlocked with the background worker; again, attempt {attempt + 2})")
                time.sleep(0.2)

    def one(self, q, params=None):
        return self.admin.execute(q, params).fetchone()[0]

    def reset_outbox(self, log=False):
        """Empty the outbox (sql.py, LOG_RESET); `log` is kept for the callers."""
        self.sql(S.LOG_RESET)

    def reset_plain(self):
        self.sql("TRUNCATE bench_plain")

    def reset_pgq(self):
        self.sql("SELECT pgq.drop_queue('bench_q', true)")
        self.sql("SELECT pgq.create_queue('bench_q')")
        self.sql("SELECT pgq.register_consumer('bench_q', 'bench_c')")

    def reset(self, system):
        if system.startswith("outbox"):
            self.reset_outbox()
        elif system.startswith("plain"):
            self.reset_plain()
        elif system == "pgq":
            self.reset_pgq()

    def checkpoint(self):
        self.sql("CHECKPOINT")

    def load_outbox(self, n, topic="bench.drain", subjects=0, conn=None):
        run = (conn or self.admin).execute
        done = 0
        while done < n:
            k = min(10000, n - done)
            if subjects:
                run(S.LOAD["outbox_subjects"], {"topic": topic, "payload": S.PAYLOAD, "n": k,
                                                "first": done, "subjects": subjects})
            else:
                run(S.LOAD["outbox"], {"topic": topic, "payload": S.PAYLOAD, "n": k})
            done += k

    def load_plain(self, n, topic="bench.drain"):
        self.sql(S.LOAD["plain"], {"topic": topic, "payload": S.PAYLOAD, "n": n})

    def load_pgq(self, n, batch):
        lit = "'" + S.PAYLOAD.replace("'", "''") + "'"
        self.sql(S.LOAD["pgq"].format(batch=batch, chunks=n // batch, payload_lit=lit))

    # -- agents ---------------------------------------------------------------
    def agents(self, specs):
        return AgentGroup(self.mp, specs)

    # -- pgbench ---------------------------------------------------------------
    def _pgbench_cmd(self, script_path, clients, seconds, dbname="postgres", jobs=None):
        jobs = min(clients, 2) if jobs is None else jobs
        return [f"{PG_BINDIR}/pgbench", "-n", "-M", "prepared", "-c", str(clients),
                "-j", str(jobs), "-T", str(seconds), "-f", script_path] + \
            self.cluster.pgbench_args() + [dbname]

    @staticmethod
    def _pgbench_env(notify, gucs=None):
        env = dict(os.environ)
        opts = pgoptions(notify, gucs)
        if opts:
            env["PGOPTIONS"] = opts
        else:
            env.pop("PGOPTIONS", None)
        return env

    @staticmethod
    def _pgbench_tps(cmd, returncode, stdout, stderr):
        m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", stdout)
        failed = re.search(r"number of failed transactions: (\d+)", stdout)
        if returncode != 0 or not m or (failed and int(failed.group(1)) > 0):
            raise HarnessError(f"pgbench failed ({' '.join(cmd)}):\n{stdout[-2000:]}\n{stderr[-2000:]}")
        return float(m.group(1))

    def pgbench(self, script_path, clients, seconds, notify=None, gucs=None):
        cmd = self._pgbench_cmd(script_path, clients, seconds)
        r = subprocess.run(cmd, capture_output=True, text=True, env=self._pgbench_env(notify, gucs),
                           timeout=seconds + 60)
        return self._pgbench_tps(cmd, r.returncode, r.stdout, r.stderr)

    def pgbench_many(self, script_path, runs, seconds, notify=None, jobs=1, gucs=None):
        """Several pgbench processes at once, one per (dbname, clients) in runs, all
        with the same script and duration. Returns {dbname: tps}."""
        env = self._pgbench_env(notify, gucs)
        procs = []
        try:
            for dbname, clients in runs:
                cmd = self._pgbench_cmd(script_path, clients, seconds, dbname, jobs)
                procs.append((dbname, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                            text=True, env=env)))
            deadline = time.monotonic() + seconds + 60
            out = {}
            for dbname, cmd, pr in procs:
                stdout, stderr = pr.communicate(timeout=max(1.0, deadline - time.monotonic()))
                out[dbname] = self._pgbench_tps(cmd, pr.returncode, stdout, stderr)
            return out
        finally:
            for _, _, pr in procs:
                if pr.poll() is None:
                    pr.kill()
                    pr.wait(5)


class AgentGroup:
    """Spawned agent processes released together by a barrier."""

    def __init__(self, ctx, specs):
        self.ctx = ctx
        self.barrier = ctx.Barrier(len(specs) + 1)
        self.q = ctx.Queue()
        self.procs = [ctx.Process(target=agents.run_agent, args=(kind, self.q, self.barrier, kw), daemon=True)
                      for kind, kw in specs]
        self.results = []

    def start(self, timeout=90):
        for p in self.procs:
            p.start()
        try:
            self.barrier.wait(timeout=timeout)
        except threading.BrokenBarrierError:
            self._fail("agents did not start")
        return time.monotonic_ns()

    def _fail(self, why):
        errs = []
        while True:
            try:
                r = self.q.get(timeout=1)
            except queue.Empty:
                break
            if "error" in r:
                errs.append(r["error"])
        self.kill()
        raise HarnessError(why + ("\n" + "\n".join(errs) if errs else ""))

    def collect(self, n, timeout):
        """Wait for n more results; raise on an agent error or timeout."""
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"agents timed out after {timeout}s")
            try:
                r = self.q.get(timeout=min(left, 1.0))
            except queue.Empty:
                if not any(p.is_alive() for p in self.procs) and self.q.empty():
                    self._fail("agents exited without a result")
                continue
            if "error" in r:
                self.kill()
                raise HarnessError(r["error"])
            got.append(r)
        self.results.extend(got)
        return got

    def join(self):
        for p in self.procs:
            p.join(10)
        self.kill()

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
