"""The benchmark scenarios (numbers as in bench/README.md)."""

import bisect
import os
import re
import shutil
import tempfile
import threading
import time

import psycopg
from psycopg.rows import dict_row

from . import agents
from . import sql as S
from .runner import HarnessError, median, pct, pgoptions

ns = 1e9


def _fmt(v, d=0):
    if v is None:
        return "n/a"
    return f"{v:,.{d}f}"


def _ratio(a, b):
    if a is None or not b:
        return None
    return a / b


def _diff(a, b):
    if a is None or b is None:
        return None
    return a - b


def _code(sqltext, lang="sql"):
    return f"```{lang}\n{sqltext.rstrip()}\n```\n"


def _listener(ctx, stop):
    """An idle LISTEN outbox session that reads its notifications, as a real
    worker fleet would: NOTIFY costs include signalling listeners."""
    conn = agents.connect(ctx.cluster.dsn())
    conn.execute("LISTEN outbox")
    n = 0
    while not stop.is_set():
        for _ in conn.notifies(timeout=0.2):
            n += 1
    conn.close()
    return n


# ---------------------------------------------------------------------------
# 1. Publish, one event per transaction
# ---------------------------------------------------------------------------
S1_SYSTEMS = [
    # (name, pgbench script, outbox.notify, further session settings, table to reset)
    ("outbox_off", "outbox", "off", None, "outbox"),
    ("outbox_transaction", "outbox", "transaction", None, "outbox"),
    ("outbox_background", "outbox", "background", None, "outbox"),
    ("plain", "plain", None, None, "plain"),
    ("plain_notify", "plain_notify", None, None, "plain"),
    ("pgq", "pgq", None, None, "pgq"),
]
# 0.9.0: publish with named subscriptions existing (the issue's target: publish
# at 16 clients with 10 subscriptions >= 0.95x publish with 1; publish writes
# nothing per subscription). outbox_background's script and mode, with
# `s1_subscriptions` (1 and 10) subscriptions named S1_SUB_PREFIX<i>, at the top
# client count only, right after outbox_background in each repetition.
S1_SUB_PREFIX = "bench-pub-"


def _s1_sub_system(k):
    return (f"outbox_subs{k}", "outbox", "background", None, "outbox", k)


def _named_subscriptions(ctx):
    return [r[0] for r in ctx.sql(S.SUBSCRIPTIONS_NAMED).fetchall()]


def _drop_subscriptions(ctx, quiet=False):
    """Drop every named subscription (force: their leases in flight too). quiet:
    on the way out of a scenario, where an error must not hide the one that ended it."""
    try:
        for name in _named_subscriptions(ctx):
            ctx.sql(S.SUBSCRIPTION_DROP, {"name": name})
    except Exception as e:  # noqa: BLE001
        if not quiet:
            raise
        ctx.say(f"  dropping the named subscriptions failed: {e!r}")


def _subscriptions_reset_sql(truncate):
    """The statements of a reset with subscriptions, as the report prints them."""
    return (f"-- for each name of: {S.SUBSCRIPTIONS_NAMED}\n{S.SUBSCRIPTION_DROP};\n{truncate};\n")


def _create_subscriptions(ctx, names):
    for name in names:
        ctx.sql(S.SUBSCRIPTION_CREATE, {"name": name})


def s1_publish(ctx):  # noqa: C901
    p = ctx.p
    top = max(p["s1_clients"])
    # Every publish writes the log ring from 0.9.0: every outbox run empties it
    # with the queue (a build before 0.8.0 has none). Named subscriptions came
    # with 0.9.0: without them (an older build) the subscriptions cell is left out.
    has_ring = bool(ctx.one(S.HAS_LOG_RING))
    has_subs = bool(ctx.one(S.HAS_SUBSCRIPTIONS))
    sub_counts = sorted(set(p["s1_subscriptions"] or [])) if has_subs else []
    if not has_subs and p["s1_subscriptions"]:
        ctx.say("  s1: this build has no outbox.create_subscription (named subscriptions came with 0.9.0): "
                "the publish-with-subscriptions cell is left out")
    if len(sub_counts) == 1:
        ctx.say(f"  s1: s1_subscriptions={p['s1_subscriptions']!r} names one count, the cell compares two: left out")
        sub_counts = []
    sub_systems = [_s1_sub_system(k) for k in sub_counts]
    systems = [s + (None,) for s in S1_SYSTEMS]
    tmp = tempfile.mkdtemp(prefix="obench-pgbench-")
    scripts = {}
    for name, text in S.PUB1.items():
        path = os.path.join(tmp, f"{name}.sql")
        with open(path, "w") as f:
            f.write(text)
        scripts[name] = path
    stop = threading.Event()
    heard = []
    log_mismatch = []  # subscription runs whose log rows differ from their queued events
    lt = threading.Thread(target=lambda: heard.append(_listener(ctx, stop)), daemon=True)
    lt.start()
    try:
        for clients in p["s1_clients"]:
            for rep in range(p["reps"]):
                ctx.checkpoint()
                # Systems interleaved within a repetition: drift hits all alike. The
                # subscription runs come right after outbox_background, in turns 1, 10
                # and 10, 1 (drift within a repetition hits neither side alone).
                runs = list(systems)
                if clients == top and sub_systems:
                    pair = sub_systems[::-1] if rep % 2 else list(sub_systems)
                    at = [s[0] for s in runs].index("outbox_background") + 1
                    runs[at:at] = pair
                for name, script, notify, gucs, table, nsubs in runs:
                    if table == "outbox":
                        if has_subs:
                            _drop_subscriptions(ctx)
                        ctx.reset_outbox(log=has_ring)
                        if nsubs:
                            _create_subscriptions(ctx, [f"{S1_SUB_PREFIX}{i}" for i in range(nsubs)])
                    else:
                        ctx.reset(table)
                    tps = ctx.pgbench(scripts[script], clients, p["s1_seconds"], notify, gucs)
                    ctx.rec("s1_publish", name, {"clients": clients}, rep, "events_per_s", tps, "ev/s")
                    if nsubs:
                        # The subscriptions existed throughout, and the log got every event.
                        have = len(_named_subscriptions(ctx))
                        logged = ctx.one(S.LOG_ROWS)
                        queued = ctx.one("SELECT count(*) FROM outbox.events")
                        ctx.rec("s1_publish", name, {"clients": clients}, rep, "log_rows", logged, "rows")
                        ctx.rec("s1_publish", name, {"clients": clients}, rep, "queued_events", queued, "events")
                        if have != nsubs:
                            raise HarnessError(f"{name}: {have} named subscriptions after the run, {nsubs} created")
                        if not logged:
                            raise HarnessError(f"{name}: {queued} events published with {nsubs} subscriptions "
                                               "and no log row written")
                        if logged != queued:
                            log_mismatch.append((name, rep, logged, queued))
                            ctx.say(f"  s1 {name} clients={clients} rep={rep}: {logged} log rows "
                                    f"for {queued} queued events")
                ctx.say(f"  s1 clients={clients} rep={rep}: " + ", ".join(
                    f"{n}={ctx.values('s1_publish', n, {'clients': clients}, 'events_per_s')[-1]:.0f}"
                    for n, *_ in runs))
    finally:
        stop.set()
        lt.join(5)
        shutil.rmtree(tmp, ignore_errors=True)
        if has_subs:
            _drop_subscriptions(ctx, quiet=True)  # the scenarios after this one start without any

    def med(name, c):
        return ctx.med("s1_publish", name, {"clients": c}, "events_per_s")

    rows = []
    for name, *_ in systems:
        cells = []
        for c in p["s1_clients"]:
            m = med(name, c)
            vals = ctx.values("s1_publish", name, {"clients": c}, "events_per_s")
            cells.append(f"{_fmt(m)} ({_fmt(_ratio(m, med('plain', c)), 2)}x; {_fmt(min(vals))}–{_fmt(max(vals))})")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    md = ("Events/s (pgbench TPS, one event per transaction), median of "
          f"{p['reps']} runs of {p['s1_seconds']} s; in brackets the ratio to `plain` at the same "
          "client count and the min–max of the runs. An idle session LISTENs on `outbox` "
          f"throughout (it received {heard[0] if heard else 'n/a'} notifications)."
          + (" Every outbox run empties the log ring (`outbox.log_0`..`log_3`, `outbox.log_state`) and its "
             "readers' tables first." if has_ring else "")
          + (" The outbox runs other than the subscription cell below have no named subscription." if has_subs else "")
          + "\n\n")
    md += "| system | " + " | ".join(f"{c} clients" for c in p["s1_clients"]) + " |\n"
    md += "|---" * (len(p["s1_clients"]) + 1) + "|\n" + "\n".join(rows) + "\n\n"

    # -- publish with named subscriptions
    r_subs = None
    if sub_systems:
        lo, hi = sub_counts[0], sub_counts[-1]
        lo_name, hi_name = f"outbox_subs{lo}", f"outbox_subs{hi}"
        md += (f"**Publish with named subscriptions** (0.9.0), at {top} clients: the `outbox` script in `background` "
               "mode as `outbox_background`, with " + " and with ".join(str(k) for k in sub_counts)
               + f" named subscriptions (`{S1_SUB_PREFIX}0`, ... created with `outbox.create_subscription` after the "
               "reset, dropped before the next outbox run) existing throughout the run; nobody claims from them. "
               "They run right after `outbox_background` in every repetition, in turns "
               f"({lo} then {hi}, then {hi} then {lo}).\n\n"
               f"| system | named subscriptions | events/s at {top} clients | min–max | / outbox_background | / plain |\n"
               "|---|---|---|---|---|---|\n")
        for name, *_, k in sub_systems:
            m = med(name, top)
            vals = ctx.values("s1_publish", name, {"clients": top}, "events_per_s")
            md += (f"| {name} | {k} | {_fmt(m)} | {_fmt(min(vals))}–{_fmt(max(vals))} | "
                   f"{_fmt(_ratio(m, med('outbox_background', top)), 2)}x | {_fmt(_ratio(m, med('plain', top)), 2)}x |\n")
        # per repetition: the two ran one after the other
        paired = [_ratio(a, b) for a, b in zip(ctx.values("s1_publish", hi_name, {"clients": top}, "events_per_s"),
                                                ctx.values("s1_publish", lo_name, {"clients": top}, "events_per_s"))]
        paired = [r for r in paired if r is not None]
        r_subs = _ratio(med(hi_name, top), med(lo_name, top))
        md += (f"\nPublish with {hi} subscriptions / with {lo} at {top} clients: **{_fmt(r_subs, 2)}x**"
               + (f" (per repetition {min(paired):.2f}–{max(paired):.2f}x)" if len(paired) > 1 else "")
               + "; target >= 0.95x (publish writes nothing per subscription). After each of these runs the log "
               "ring held ")
        if log_mismatch:
            md += ("**not** one row per queued event in " + ", ".join(
                f"{n} rep {r} ({lg:,} log rows, {q:,} events)" for n, r, lg, q in log_mismatch) + ".\n\n")
        else:
            md += "exactly one row per queued event.\n\n"
    elif p["s1_subscriptions"] and not has_subs:
        md += (f"Publish with named subscriptions ({' / '.join(str(k) for k in sorted(p['s1_subscriptions'])[::-1])} "
               f"at {top} clients) was left out: this build has no `outbox.create_subscription` (named "
               "subscriptions came with 0.9.0).\n\n")
    md += (f"pgbench: `pgbench -n -M prepared -c C -j min(C,2) -T {p['s1_seconds']} -f SCRIPT`; "
           "the outbox modes set `PGOPTIONS='-c outbox.notify=MODE'`"
           + "".join(f", `{n}` `PGOPTIONS='{pgoptions(nt, g)}'`" for n, _, nt, g, *_ in systems + sub_systems if g)
           + ". Tables are truncated before every run.\n\n")
    for name in ("outbox", "plain", "plain_notify", "pgq"):
        md += f"**{name}**\n\n" + _code(S.PUB1[name])
    if sub_systems:
        md += (f"**outbox_subs{sub_counts[0]}** .. **outbox_subs{sub_counts[-1]}**: the `outbox` script; before each "
               "run (every named subscription dropped, the tables emptied, then N subscriptions created)\n\n"
               + _code(_subscriptions_reset_sql(S.LOG_RESET) + f"-- for i = 0 .. N - 1: name = '{S1_SUB_PREFIX}<i>'\n"
                       + S.SUBSCRIPTION_CREATE + ";"))
    ctx.section("1. Publish, one event per transaction", md)
    ctx.series["s1"] = {name: [med(name, c) for c in p["s1_clients"]] for name, *_ in systems}
    ctx.target("1", f"publish outbox(background) / plain INSERT at {top} clients",
               _ratio(med("outbox_background", top), med("plain", top)), ">=", 0.85)
    ctx.target("1-off", f"publish outbox(off) / plain INSERT at {top} clients",
               _ratio(med("outbox_off", top), med("plain", top)), ">=", 0.90)
    if sub_systems:
        ctx.target("1-subs", f"publish with {sub_counts[-1]} named subscriptions / with {sub_counts[0]} at {top} "
                   "clients (outbox background)", r_subs, ">=", 0.95)


# ---------------------------------------------------------------------------
# 2. Publish 1,000 events per transaction
# ---------------------------------------------------------------------------
def s2_batch(ctx):
    p = ctx.p
    arr = S.jsonb_array_literal(1000)
    systems = list(S.PUB_BATCH)
    for rep in range(p["reps"]):
        ctx.checkpoint()
        for name in systems:
            ctx.reset("plain" if name.startswith("plain") else "outbox")
            conn = agents.connect(ctx.cluster.dsn())
            stmt = S.PUB_BATCH[name]
            if name == "outbox_client_loop":
                def one_tx():
                    with conn.transaction():
                        for _ in range(1000):
                            conn.execute(stmt, (S.PAYLOAD,))
            else:
                def one_tx():
                    conn.execute(stmt, (arr,))
            one_tx()  # prepares the statement
            n = 0
            t0 = time.monotonic()
            while True:
                one_tx()
                n += 1
                el = time.monotonic() - t0
                if el >= p["s2_seconds"] and n >= 3:
                    break
            conn.close()
            ctx.rec("s2_batch", name, {"batch": 1000}, rep, "events_per_s", n * 1000 / el, "ev/s")
        ctx.say(f"  s2 rep={rep}: " + ", ".join(
            f"{n}={ctx.values('s2_batch', n, {'batch': 1000}, 'events_per_s')[-1]:.0f}" for n in systems))
    m = {n: ctx.med("s2_batch", n, {"batch": 1000}, "events_per_s") for n in systems}
    md = (f"One client, one transaction (autocommit statement) per 1,000 events, back to back for "
          f"{p['s2_seconds']} s; median of {p['reps']} runs. The 1,000 payloads travel as one `jsonb[]` "
          "parameter for the set-based statements. `outbox_loop` calls `outbox.publish` 1,000 times inside one "
          "statement (a server-side loop: no extra round trips, so it isolates the per-call cost); "
          "`outbox_client_loop` is the application pattern: BEGIN, 1,000 `outbox.publish` statements "
          "(one round trip each), COMMIT. "
          "outbox.notify is the session default ('background').\n\n")
    md += "| system | events/s | runs |\n|---|---|---|\n"
    for n in systems:
        vals = ctx.values("s2_batch", n, {"batch": 1000}, "events_per_s")
        md += f"| {n} | {_fmt(m[n])} | {', '.join(_fmt(v) for v in vals)} |\n"
    r1 = _ratio(m["outbox_batch"], m["plain_multirow"])
    r2 = _ratio(m["outbox_batch"], m["outbox_client_loop"])
    r3 = _ratio(m["outbox_batch"], m["outbox_loop"])
    md += (f"\npublish_batch / plain multi-row INSERT = **{_fmt(r1, 2)}x**; publish_batch / client-side loop of publish "
           f"= **{_fmt(r2, 2)}x**; publish_batch / server-side loop of publish = **{_fmt(r3, 2)}x**\n\n")
    for n in systems:
        md += f"**{n}**\n\n" + _code(S.PUB_BATCH[n])
    ctx.section("2. Publish in batches of 1,000", md)
    ctx.target("2a", "publish_batch(1000) / plain multi-row INSERT", r1, ">=", 0.7)
    ctx.target("2b", "publish_batch(1000) / client-side loop of 1000 publish() in one transaction", r2, ">=", 5.0)
    ctx.target("2b-server", "publish_batch(1000) / server-side loop of 1000 publish() in one statement", r3, ">=", 5.0,
               note="stricter reading of 2b: no round trips in the loop")


# ---------------------------------------------------------------------------
# 3. Drain a backlog
# ---------------------------------------------------------------------------
# Drain variants: name -> (SQL of DRAIN used, session settings of the workers)
DRAIN_VARIANTS = {
    "outbox": ("outbox", None),
    "plain": ("plain", None),
    # scenario 10: outbox.claim selecting payload::text (as the log drain does)
    "outbox_text": ("outbox_text", None),
}


def _drain_once(ctx, variant, workers, batch, n, subjects=0, info=None):
    """One drain; returns (events/s, empty claims). info (a dict), when given,
    receives the workers' statement counts: claims (empty ones included) and acks."""
    system, gucs = DRAIN_VARIANTS[variant]
    outbox = system.startswith("outbox")
    ctx.reset(system)
    if outbox:
        ctx.load_outbox(n, subjects=subjects)
        ctx.sql(S.LOG_VACUUM)
    else:
        ctx.load_plain(n)
        ctx.sql("VACUUM ANALYZE bench_plain")
    ctx.checkpoint()
    counter = ctx.mp.Value("q", 0)
    g = ctx.agents([("drain_worker", dict(dsn=ctx.cluster.dsn(), system=system, wid=w, batch=batch, total=n,
                                          counter=counter, deadline_s=ctx.p["drain_deadline"], gucs=gucs))
                    for w in range(workers)])
    g.start()
    res = g.collect(workers, ctx.p["drain_deadline"] + 30)
    g.join()
    done = sum(r["n"] for r in res)
    left = ctx.one(S.DEFAULT_LEFT if outbox else "SELECT count(*) FROM bench_plain")
    if done != n or left != 0:
        raise HarnessError(f"{system} drain acked {done} of {n}, {left} left in the table")
    secs = (max(r["t1"] for r in res) - min(r["t0"] for r in res)) / ns
    empty = sum(r["empty"] for r in res)
    if info is not None:
        claims = sum(r["claims"] for r in res)
        info.update(claims=claims, acks=claims - empty, empty=empty)
    return n / secs, empty


def _drain_pgq(ctx, batch, n, info=None):
    """PgQ, one consumer; info (a dict), when given, receives its batch count."""
    ctx.reset_pgq()
    ctx.load_pgq(n, batch)
    ctx.checkpoint()
    g = ctx.agents([("pgq_consumer", dict(dsn=ctx.cluster.dsn(), deadline_s=ctx.p["drain_deadline"]))])
    g.start()
    r = g.collect(1, ctx.p["drain_deadline"] + 30)[0]
    g.join()
    if r["n"] != n:
        raise HarnessError(f"pgq drain read {r['n']} of {n} events")
    if info is not None:
        info.update(batches=r["batches"])
    return n / ((r["t1"] - r["t0"]) / ns)


def _cell(p, workers, batch):
    return p["drain_cells"] is None or (workers, batch) in [tuple(c) for c in p["drain_cells"]]


def s3_drain(ctx):
    p = ctx.p
    n = p["drain_n"]
    for batch in p["drain_batches"]:
        for workers in p["drain_workers"]:
            if not _cell(p, workers, batch):
                continue
            prm = {"workers": workers, "batch": batch}
            variants = ["outbox", "plain"]
            for rep in range(p["reps"]):
                for system in variants:
                    eps, empty = _drain_once(ctx, system, workers, batch, n)
                    ctx.rec("s3_drain", system, prm, rep, "events_per_s", eps, "ev/s")
                ctx.say(f"  s3 workers={workers} batch={batch} rep={rep}: outbox="
                        f"{ctx.values('s3_drain', 'outbox', prm, 'events_per_s')[-1]:.0f} plain="
                        f"{ctx.values('s3_drain', 'plain', prm, 'events_per_s')[-1]:.0f}")
        for rep in range(p["reps"]):
            eps = _drain_pgq(ctx, batch, n)
            ctx.rec("s3_drain", "pgq", {"workers": 1, "batch": batch}, rep, "events_per_s", eps, "ev/s")
        ctx.say(f"  s3 pgq batch={batch}: {ctx.med('s3_drain', 'pgq', {'workers': 1, 'batch': batch}, 'events_per_s'):.0f}")

    md = (f"Drain a backlog of {n:,} events, claim and ack as separate autocommit statements "
          f"(two round trips per batch); events/s from the first claim to the last ack; median of "
          f"{p['reps']} runs (backlog loaded, `VACUUM ANALYZE`d and checkpointed before each run). "
          "Target: outbox >= 1.0x plain in every cell.\n\n")
    md += "| workers | batch | outbox | plain | outbox/plain | PgQ (1 consumer) |\n|---|---|---|---|---|---|\n"
    worst = None
    ctx.series["s3"] = {}
    for batch in p["drain_batches"]:
        q = ctx.med("s3_drain", "pgq", {"workers": 1, "batch": batch}, "events_per_s")
        for workers in p["drain_workers"]:
            if not _cell(p, workers, batch):
                continue
            prm = {"workers": workers, "batch": batch}
            o = ctx.med("s3_drain", "outbox", prm, "events_per_s")
            pl = ctx.med("s3_drain", "plain", prm, "events_per_s")
            r = _ratio(o, pl)
            worst = r if worst is None or (r is not None and r < worst) else worst
            md += f"| {workers} | {batch} | {_fmt(o)} | {_fmt(pl)} | {_fmt(r, 2)}x{'' if (r or 0) >= 1.0 else ' MISSED'} | {_fmt(q)} |"
            md += "\n"
            ctx.series["s3"][(workers, batch)] = {"outbox": o, "plain": pl, "pgq": q}
            ctx.target(f"3 w{workers} b{batch}", f"drain outbox / plain SKIP LOCKED, {workers} workers, batch {batch}",
                       r, ">=", 1.0)
    md += ("\nPgQ is a log: one consumer reads each batch between two ticks (ticks made every `batch` events "
           "while loading) and nothing is deleted per event, so it is the upper reference, not a like-for-like "
           "competing-consumer queue. It runs with one consumer per batch size.\n\n")
    md += "**outbox** (claim, then ack)\n\n" + _code(S.DRAIN["outbox"]["claim"] + ";\n" + S.DRAIN["outbox"]["ack"] + ";")
    md += "**plain** (claim, then ack)\n\n" + _code(S.DRAIN["plain"]["claim"] + ";\n" + S.DRAIN["plain"]["ack"] + ";")
    md += "**pgq** (per batch)\n\n" + _code(";\n".join(S.DRAIN["pgq"].values()) + ";")
    md += "Backlog loading (not timed):\n\n" + _code(S.LOAD["outbox"] + ";\n" + S.LOAD["plain"] + ";\n" + S.LOAD["pgq"])
    ctx.section("3. Drain a backlog", md)


# ---------------------------------------------------------------------------
# 4. End to end: fixed-rate publishers, LISTEN + claim workers
# ---------------------------------------------------------------------------
def _e2e_once(ctx, system, notify, rate, seconds):
    ctx.reset("outbox" if system == "outbox" else "plain")
    ctx.checkpoint()
    # Every commit waits for a WAL flush (~1-3 ms here): enough connections that
    # each needs at most ~250 commits/s.
    conns = min(24, max(2, -(-rate // 250)))
    procs = 1 if conns <= 2 else 2
    per = [conns // procs + (1 if i < conns % procs else 0) for i in range(procs)]
    counter = ctx.mp.Value("q", 0)
    stop = ctx.mp.Event()
    dsn = ctx.cluster.dsn()
    specs = [("publisher", dict(dsn=dsn, system=system, rate=rate * per[i] / conns, nconns=per[i],
                                duration_s=seconds, stop_evt=stop, notify=notify, record=True, pid=i))
             for i in range(procs)]
    specs += [("e2e_worker", dict(dsn=dsn, system="outbox" if system == "outbox" else "plain", wid=w,
                                  batch=ctx.p["e2e_batch"], stop_evt=stop, counter=counter,
                                  poll_s=ctx.p["e2e_poll"]))
              for w in range(ctx.p["e2e_workers"])]
    g = ctx.agents(specs)
    t0 = g.start()
    pubs = g.collect(procs, seconds + 60)
    total = sum(r["n"] for r in pubs)
    deadline = time.monotonic() + 60
    while counter.value < total and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    works = g.collect(ctx.p["e2e_workers"], 30)
    g.join()
    commit = {}
    for r in pubs:
        commit.update(dict(r["recs"]))
    done = {}
    for r in works:
        for i, tc, ta in r["recs"]:
            done[i] = (tc, ta)
    if len(done) != total or set(done) != set(commit):
        raise HarnessError(f"e2e {system}: published {total}, acked {len(done)}")
    e2e = [(done[i][1] - commit[i]) / 1e6 for i in commit]
    wake = [(done[i][0] - commit[i]) / 1e6 for i in commit]
    pub_secs = (max(r["t1"] for r in pubs) - min(r["t0"] for r in pubs)) / ns
    # Backlog over time: committed but not yet acked, sampled every 100 ms.
    step = 100_000_000
    tc_sorted = sorted(commit.values())
    ta_sorted = sorted(v[1] for v in done.values())
    series = []
    i = j = 0
    t = t0
    end = max(ta_sorted[-1], tc_sorted[-1]) + step
    while t <= end:
        while i < len(tc_sorted) and tc_sorted[i] <= t:
            i += 1
        while j < len(ta_sorted) and ta_sorted[j] <= t:
            j += 1
        series.append(((t - t0) / ns, i - j))
        t += step
    return {
        "achieved": total / pub_secs, "n": total,
        "e2e": e2e, "wake": wake, "series": series,
        "late": sum(r["late"] for r in pubs),
        "timeouts": sum(r["timeouts"] for r in works), "wakeups": sum(r["wakeups"] for r in works),
    }


def s4_e2e(ctx):
    p = ctx.p
    keep = {}
    for rate in p["e2e_rates"]:
        for rep in range(p["reps"]):
            for name, system, notify in p["e2e_systems"]:
                if rate not in p["e2e_system_rates"].get(name, p["e2e_rates"]):
                    continue
                r = _e2e_once(ctx, system, notify, rate, p["e2e_seconds"])
                prm = {"rate": rate}
                ctx.rec("s4_e2e", name, prm, rep, "achieved_rate", r["achieved"], "ev/s")
                for metric, xs in (("e2e", r["e2e"]), ("wake", r["wake"])):
                    for q in (50, 95, 99):
                        ctx.rec("s4_e2e", name, prm, rep, f"{metric}_p{q}", pct(xs, q), "ms")
                ctx.rec("s4_e2e", name, prm, rep, "max_backlog", max(b for _, b in r["series"]), "events")
                ctx.rec("s4_e2e", name, prm, rep, "poll_timeouts", r["timeouts"], "waits")
                keep.setdefault((name, rate), []).append(r["series"])
                ctx.say(f"  s4 {name} rate={rate} rep={rep}: achieved {r['achieved']:.0f}/s, e2e p50/p99 "
                        f"{pct(r['e2e'], 50):.1f}/{pct(r['e2e'], 99):.1f} ms, wake p50/p99 "
                        f"{pct(r['wake'], 50):.1f}/{pct(r['wake'], 99):.1f} ms, late {r['late']}, "
                        f"poll timeouts {r['timeouts']}")
    ctx.series["s4"] = {k: v[len(v) // 2] for k, v in keep.items()}
    md = (f"Publishers commit one event per autocommit statement on a fixed schedule for {p['e2e_seconds']} s "
          f"(rate/250 connections, at least 2, in 1-2 processes); {p['e2e_workers']} workers `LISTEN outbox`, claim up to "
          f"{p['e2e_batch']} events, ack them, and wait for a notification (poll fallback {p['e2e_poll']} s) "
          "whenever a claim returns less than a full batch. Latencies are taken on the client with one "
          "system-wide monotonic clock: **publish → ack** = from the publisher's commit returning to the ack "
          "returning; **wake-up** = from the publisher's commit returning to the worker's claim returning "
          f"the event. Medians over {p['reps']} runs of each percentile.\n\n")
    md += ("| system | rate (ev/s) | achieved | publish→ack p50 / p95 / p99 (ms) | wake-up p50 / p95 / p99 (ms) "
           "| max backlog | poll timeouts |\n|---|---|---|---|---|---|---|\n")
    for rate in p["e2e_rates"]:
        for name, *_ in p["e2e_systems"]:
            prm = {"rate": rate}
            if not ctx.values("s4_e2e", name, prm, "achieved_rate"):
                continue
            m = lambda k: ctx.med("s4_e2e", name, prm, k)  # noqa: E731
            md += (f"| {name} | {rate:,} | {_fmt(m('achieved_rate'))} | "
                   f"{m('e2e_p50'):.1f} / {m('e2e_p95'):.1f} / {m('e2e_p99'):.1f} | "
                   f"{m('wake_p50'):.1f} / {m('wake_p95'):.1f} / {m('wake_p99'):.1f} | "
                   f"{_fmt(m('max_backlog'))} | {_fmt(m('poll_timeouts'))} |\n")
    md += "\nBacklog over time: see `e2e_backlog.png`.\n\n"
    md += "**publish (outbox)**\n\n" + _code(S.E2E_PUBLISH["outbox"])
    md += "**publish (plain_notify)**\n\n" + _code(S.E2E_PUBLISH["plain_notify"])
    md += "Workers: `LISTEN outbox`, then the claim and ack statements of scenario 3.\n"
    ctx.section("4. End to end and wake-up latency", md)
    wr = p["wake_rate"]
    b50 = ctx.med("s4_e2e", "outbox_background", {"rate": wr}, "wake_p50")
    b99 = ctx.med("s4_e2e", "outbox_background", {"rate": wr}, "wake_p99")
    ctx.target("4a", f"wake-up p50, 'background' at {wr} ev/s", b50, "<=", 2.0, " ms")
    ctx.target("4b", f"wake-up p99, 'background' at {wr} ev/s", b99, "<=", 10.0, " ms")


# ---------------------------------------------------------------------------
# 6. History, held snapshot, ring TRUNCATE (the install's `default`, on the log)
# ---------------------------------------------------------------------------
def _claim_ack_latencies(ctx, iters, dsn=None, sizes=None):
    """iters timed claims of 100 from `default` plus their batch ack (after 3
    untimed ones). sizes (a list), when given, receives each timed claim's row
    count. A claim that returns fewer than 100 (its lanes' windows) is counted,
    not an error, unless it returns nothing."""
    conn = agents.connect(dsn or ctx.cluster.dsn())
    q = S.DRAIN["outbox"]
    lat = []
    for i in range(iters + 3):
        t = time.monotonic_ns()
        rows = conn.execute(q["claim"], {"worker": "lat", "batch": 100}).fetchall()
        if not rows:
            raise HarnessError("latency probe claimed nothing")
        acked = conn.execute(q["ack"], {"ids": [r[0] for r in rows], "tokens": [r[1] for r in rows]}).fetchone()[0]
        if acked != len(rows):
            raise HarnessError(f"latency probe claimed {len(rows)} rows, outbox.ack acked {acked}")
        if i >= 3:
            lat.append((time.monotonic_ns() - t) / 1e6)
            if sizes is not None:
                sizes.append(len(rows))
    conn.close()
    return lat


def _record_latency(ctx, variant, rep, iters, dsn=None):
    sizes = []
    lat = _claim_ack_latencies(ctx, iters, dsn, sizes)
    ctx.rec("s6_history", variant, {"batch": 100}, rep, "claim_ack_p50", pct(lat, 50), "ms")
    ctx.rec("s6_history", variant, {"batch": 100}, rep, "claim_ack_p95", pct(lat, 95), "ms")
    ctx.rec("s6_history", variant, {"batch": 100}, rep, "events_per_claim", sum(sizes) / len(sizes), "events")


def _rel_stats(conn, rels):
    """{relation: (n_dead_tup, n_live_tup, autovacuum_count)} now (backends flush
    their statistics at most once a second: they lag by up to that)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    got = {r[0]: tuple(r[1:]) for r in conn.execute(S.REL_STATS, (rels,)).fetchall()}
    return {rel: got.get(rel, (None, None, None)) for rel in rels}


def _rec_log_dead(ctx, scenario, system, prm, rep, stats, suffix=""):
    """n_dead_tup of each hot relation of the log (and of the ring in all)."""
    for rel, short in zip(S.LOG_HOT, S.LOG_HOT_SHORT):
        ctx.rec(scenario, system, prm, rep, f"n_dead_tup_{short}{suffix}", stats[rel][0], "tuples")
    ring = [stats[t][0] for t in S.LOG_RING]
    ctx.rec(scenario, system, prm, rep, f"n_dead_tup_log_ring{suffix}",
            sum(ring) if None not in ring else None, "tuples")


def _log_dead_cells(ctx, scenario, system, prm, suffix=""):
    """The report's cells: n_dead_tup of log_lanes, log_batches, log_exceptions and
    the ring (log_0..3 in all), medians."""
    return " | ".join(_fmt(ctx.med(scenario, system, prm, f"n_dead_tup_{k}{suffix}"))
                      for k in ("log_lanes", "log_batches", "log_exceptions", "log_ring"))


LOG_DEAD_HEAD = "n_dead_tup: log_lanes | log_batches | log_exceptions | log_0..3"


def _fresh_outbox(ctx):
    """Every named subscription dropped, then the outbox emptied (S.LOG_RESET:
    the ring, readers' batches, rows of their own, delivery records, dispatch
    keys; `default`'s lanes read up to a cursor taken now)."""
    _drop_subscriptions(ctx)
    ctx.reset_outbox()


def s6_history(ctx):  # noqa: C901
    """6a: claim+ack latency of `default` on a fresh log (bench_fresh: only the
    ready events) against a log that holds hist_delivered events `default` has
    acked, hist_log_dead dead letters of `default` (rows in
    outbox.log_exceptions) and the dead tuples of making them (autovacuum off
    for log_lanes, log_batches, log_exceptions meanwhile), older than the ready
    ones."""
    p = ctx.p
    iters = p["hist_iters"]
    ready = p["reps"] * (iters + 3) * 100 + 1000
    hist, dead = p["hist_delivered"], p["hist_log_dead"]
    analyze = "ANALYZE " + ", ".join(S.LOG_RING + S.LOG_WRITTEN)
    t_setup = time.monotonic()
    # The fresh log lives in a second database of the same cluster, so that the
    # fresh and history runs can alternate (drift on a shared machine hits both).
    if not ctx.one("SELECT count(*) FROM pg_database WHERE datname = 'bench_fresh'"):
        ctx.sql("CREATE DATABASE bench_fresh")
    fresh_dsn = ctx.cluster.dsn("bench_fresh")
    fa = agents.connect(fresh_dsn)
    try:
        fa.execute("CREATE EXTENSION IF NOT EXISTS outbox_ext")
        for name in [r[0] for r in fa.execute(S.SUBSCRIPTIONS_NAMED).fetchall()]:
            fa.execute(S.SUBSCRIPTION_DROP, {"name": name})
        fa.execute(S.LOG_RESET)
        ctx.load_outbox(ready, topic="bench.ready", conn=fa)
        fa.execute(analyze)
    finally:
        fa.close()
    _fresh_outbox(ctx)
    sizes = {}
    dead_tup = {}
    off = "ALTER TABLE {} SET (autovacuum_enabled = off)"
    try:
        for t in S.LOG_WRITTEN:
            ctx.sql(off.format(t))
        ctx.load_outbox(hist, topic="bench.hist")
        # `default` consumes the history as workers do: 2 workers, claim 100 + batch ack
        counter = ctx.mp.Value("q", 0)
        deadline = max(p["drain_deadline"], 900)
        specs = [("drain_worker", dict(dsn=ctx.cluster.dsn(), system="outbox", wid=w, batch=100, total=hist,
                                       counter=counter, deadline_s=deadline)) for w in range(2)]
        g = ctx.agents(specs)
        g.start()
        res = g.collect(len(specs), deadline + 30)
        g.join()
        acked = sum(x["n"] for x in res)
        if acked != hist:
            raise HarnessError(f"6a history: default acked {acked} of {hist} events")
        hist_eps = hist / ((max(x["t1"] for x in res) - min(x["t0"] for x in res)) / ns)
        ctx.load_outbox(dead, topic="bench.dead-letter")
        left = dead
        t_dead = time.monotonic()
        while left > 0:
            k = ctx.one(S.LOG_HIST_DEADLETTER, {"n": min(1000, left)})
            if not k:
                raise HarnessError(f"6a history: could not dead-letter the events ({dead - left} of {dead})")
            left -= k
        dead_s = time.monotonic() - t_dead
        ctx.load_outbox(2 * ready, topic="bench.ready")  # enough for both measurements below
        lag, leases, dl = ctx.sql(S.DEFAULT_STATE).fetchone()
        in_log = ctx.one(S.LOG_ROWS)
        if lag != 2 * ready or dl != dead or leases:
            raise HarnessError(f"6a history: default has {lag} events to read (want {2 * ready}), "
                               f"{dl} dead letters (want {dead}), {leases} leases in flight")
        if in_log != hist + dead + 2 * ready:
            raise HarnessError(f"6a history: the log ring holds {in_log} events, published "
                               f"{hist + dead + 2 * ready} (retention removed some?)")
        ctx.sql(analyze)
        ctx.checkpoint()
        ctx.say(f"  s6 history: {hist:,} events acked by default ({hist_eps:,.0f} ev/s), {dead:,} dead "
                f"letters in {dead_s:.1f}s, {in_log:,} events in the log; setup {time.monotonic() - t_setup:.0f}s")
        time.sleep(1.0)
        dead_tup["history"] = _rel_stats(ctx.admin, S.LOG_WRITTEN)
        for rep in range(p["reps"]):
            _record_latency(ctx, "fresh", rep, iters, fresh_dsn)
            _record_latency(ctx, "history", rep, iters)
        fc = agents.connect(fresh_dsn)
        try:
            sizes["fresh"] = _log_sizes(fc)
            time.sleep(1.0)
            dead_tup["fresh"] = _rel_stats(fc, S.LOG_WRITTEN)
        finally:
            fc.close()
        sizes["history"] = _log_sizes(ctx.admin)
        # Informational: the same history once VACUUM has removed the dead tuples.
        ctx.sql("VACUUM ANALYZE " + ", ".join(S.LOG_WRITTEN))
        time.sleep(1.0)
        dead_tup["history_vacuumed"] = _rel_stats(ctx.admin, S.LOG_WRITTEN)
        for rep in range(p["reps"]):
            _record_latency(ctx, "history_vacuumed", rep, iters)
        sizes["history_vacuumed"] = _log_sizes(ctx.admin)
        in_log_end = ctx.one(S.LOG_ROWS)
    finally:
        for t in S.LOG_WRITTEN:
            ctx.sql(f"ALTER TABLE {t} RESET (autovacuum_enabled)")
    prm = {"batch": 100}
    order = ["fresh", "history", "history_vacuumed"]
    m = {v: (ctx.med("s6_history", v, prm, "claim_ack_p50"), ctx.med("s6_history", v, prm, "claim_ack_p95"),
             ctx.med("s6_history", v, prm, "events_per_claim")) for v in order}
    for v in order:
        ctx.say(f"  s6 history {v}: p50 {_fmt(m[v][0], 2)} ms")
        for rel in S.LOG_WRITTEN:
            ctx.rec("s6_history", v, prm, 0, f"n_dead_tup_{rel.split('.', 1)[1]}", dead_tup[v][rel][0], "tuples")
    r = _ratio(m["history"][0], m["fresh"][0])
    md = (f"Latency of one claim of 100 from the install's `default` subscription plus its batch ack (two round "
          f"trips), {iters} iterations per run, median of {p['reps']} runs (fresh and history alternate; the "
          "fresh log is in a second database, `bench_fresh`, of the same cluster), with ready events waiting. "
          "Each database starts from an empty log (every named subscription dropped; the ring, "
          "`outbox.log_state`, `log_batches`, `log_exceptions`, `log_delivered` and the dispatch keys truncated; "
          "`default`'s lanes moved to a cursor taken then). "
          "**fresh**: the log holds the ready events only. **history**: before the ready events, "
          f"{hist:,} events (`bench.hist`) published with `publish_batch` and consumed by `default` (2 workers, "
          f"claim 100 + batch ack, {_fmt(hist_eps)} events/s), then {dead:,} events (`bench.dead-letter`) claimed "
          "and failed permanently (dead letters of `default`: rows in `outbox.log_exceptions`; "
          f"{dead_s:.0f} s), with autovacuum off for `outbox.log_lanes`, `log_batches` and `log_exceptions` from "
          "before the history until the end of the measurement, so the dead tuples of those claims, acks and "
          "fails stay. The log keeps acked events for `outbox.retention_delivered` (7 days; not lowered here): "
          f"the ring held {in_log:,} events when the measurement started and {in_log_end:,} at its end, of which "
          f"{hist:,} + {dead:,} were finished. "
          "**history_vacuumed** (informational): the same after `VACUUM` of those three tables. "
          "Events per claim: the mean rows a claim of 100 returned.\n\n"
          "| log | claim+ack p50 (ms) | p95 (ms) | ratio to fresh (p50) | events per claim | "
          "ring log_0..3 size | log_exceptions size | log_delivered size | "
          "n_dead_tup: log_lanes | log_batches | log_exceptions |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|\n")
    for v in order:
        d = dead_tup[v]
        md += (f"| {v} | {_fmt(m[v][0], 2)} | {_fmt(m[v][1], 2)} | {_fmt(_ratio(m[v][0], m['fresh'][0]), 2)}x | "
               f"{_fmt(m[v][2], 1)} | {sizes[v][0]} | {sizes[v][1]} | {sizes[v][2]} | "
               + " | ".join(_fmt(d[t][0]) for t in S.LOG_WRITTEN) + " |\n")
    md += ("\n(`n_dead_tup` read before each row's runs; fresh's in `bench_fresh` after its runs.)\n\n"
           f"history / fresh (p50) = **{_fmt(r, 2)}x** (target <= 1.1x)\n\n"
           "History setup (then the workers' claim and ack of scenario 3 until `default` has acked every "
           "`bench.hist` event):\n\n"
           + _code(S.LOAD["outbox"] + ";  -- bench.hist, bench.dead-letter, bench.ready\n"
                   + S.LOG_HIST_DEADLETTER + ";  -- until every bench.dead-letter event is dead")
           + "**probe** (claim, then ack)\n\n" + _code(S.DRAIN["outbox"]["claim"] + ";\n"
                                                        + S.DRAIN["outbox"]["ack"] + ";"))
    ctx.section("6a. Claim latency with history", md)
    ctx.target("6a", f"claim+ack latency of default with {hist:,} acked events retained / fresh (p50)",
               r, "<=", 1.1)


def _log_sizes(conn):
    """Sizes of the ring (log_0..3), outbox.log_exceptions and outbox.log_delivered."""
    def size(rels):
        b = conn.execute(S.REL_SIZE, (rels,)).fetchone()[0]
        return conn.execute("SELECT pg_size_pretty(%s::bigint)", (b,)).fetchone()[0]
    return (size(S.LOG_RING), size(["outbox.log_exceptions"]), size(["outbox.log_delivered"]))


def _load_spread(ctx, backlog, tables):
    """Publish the backlog into `tables` ring tables in turn (log_0, log_1, ...):
    a part, then the log step (S.ROTATE) with outbox.retention_delivered = 0 in
    this session, which seals the open table and opens the next."""
    c = agents.connect(ctx.cluster.dsn())
    try:
        c.execute(S.ROTATE_SET, ("0",))
        c.execute(S.ROTATE)  # an empty log: its first call opens log_0
        done = 0
        for i in range(tables):
            k = (backlog - done) // (tables - i)
            ctx.load_outbox(k, conn=c)
            done += k
            if i < tables - 1:
                c.execute(S.ROTATE)
        return c.execute(S.RING_STATE).fetchone()
    finally:
        c.close()


def _steady_drain(ctx, backlog, hold=False, rotate=None, spread=0):  # noqa: C901
    """Backlog + a 1,000 ev/s publisher + 2 workers (batch 100, `default`) until
    the workers catch up, from an empty log. Optionally a REPEATABLE READ
    transaction held open (hold), or another session calling the log step of
    maintenance (S.ROTATE) in a loop every 0.1 s with outbox.retention_delivered
    set to `rotate` (seconds) for the session. spread: the backlog is published
    over that many ring tables (_load_spread)."""
    p = ctx.p
    _fresh_outbox(ctx)
    if spread:
        ring_at_start = _load_spread(ctx, backlog, spread)
    else:
        ctx.load_outbox(backlog)
    ctx.sql(S.LOG_VACUUM)
    ctx.checkpoint()
    holder = None
    if hold:
        holder = psycopg.connect(ctx.cluster.dsn())
        holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        holder.execute("SELECT count(*) FROM outbox.topics")  # snapshot taken, kept
    dsn = ctx.cluster.dsn()
    counter = ctx.mp.Value("q", 0)
    stop = ctx.mp.Event()
    workers = 2
    specs = [("drain_worker", dict(dsn=dsn, system="outbox", wid=w, batch=100, total=backlog, counter=counter,
                                   deadline_s=p["drain_deadline"])) for w in range(workers)]
    specs.append(("publisher", dict(dsn=dsn, system="outbox", rate=p["steady_rate"], nconns=4, duration_s=None,
                                    stop_evt=stop, notify=None, record=False, pid=0)))
    g = ctx.agents(specs)
    rot = {"calls": 0, "truncated": 0, "ms": [], "errors": 0, "after": 0}
    rot_stop = threading.Event()

    def do_rotate():
        c = agents.connect(dsn)
        c.execute(S.ROTATE_SET, (str(rotate),))
        rot["t0"] = time.monotonic_ns()
        while not rot_stop.is_set():
            t = time.monotonic_ns()
            try:
                rot["truncated"] += c.execute(S.ROTATE).fetchone()[0]
            except psycopg.Error:
                rot["errors"] += 1
            rot["ms"].append((time.monotonic_ns() - t) / 1e6)
            rot["calls"] += 1
            rot_stop.wait(0.1)
        rot["t1"] = time.monotonic_ns()
        # Informational: 1 s more of the same calls once the workers caught up
        # (did the ring tables wait for the readers or for their lock?)
        rot["after"] = 0
        for _ in range(10):
            try:
                rot["after"] += c.execute(S.ROTATE).fetchone()[0]
            except psycopg.Error:
                rot["errors"] += 1
            time.sleep(0.1)
        c.close()

    rt = None
    try:
        g.start()
        if rotate is not None:
            rt = threading.Thread(target=do_rotate)
            rt.start()
        ws = g.collect(workers, p["drain_deadline"] + 30)
        if rt:
            rot_stop.set()
            rt.join()
            rt = None
        stop.set()
        pub = g.collect(1, 30)[0]
        g.join()
        # Read n_dead_tup while the snapshot is still held (autovacuum could clean
        # up right after); backends flush table statistics at most once a second.
        time.sleep(1.0)
        log_stats = _rel_stats(ctx.admin, S.LOG_HOT)
    finally:
        stop.set()
        rot_stop.set()
        if rt:
            rt.join()
        if holder:
            holder.rollback()
            holder.close()
    t0 = min(r["t0"] for r in ws)
    t1 = max(r["t1"] for r in ws)
    acked = sum(r["n"] for r in ws)
    out = {"eps": acked / ((t1 - t0) / ns), "acked": acked, "secs": (t1 - t0) / ns,
           "published": pub["n"], "pub_rate": pub["n"] / ((pub["t1"] - pub["t0"]) / ns), "log_stats": log_stats}
    if spread:
        out["ring_at_start"] = ring_at_start
    if rotate is not None:
        out.update(rot_calls=rot["calls"], truncated=rot["truncated"], rot_errors=rot["errors"],
                   truncated_after=rot["after"],
                   rot_p50=pct(rot["ms"], 50), rot_max=max(rot["ms"]) if rot["ms"] else None,
                   ring_state=ctx.sql(S.RING_STATE).fetchone())
    return out


def s6_xmin(ctx):
    p = ctx.p
    b = p["steady_backlog"]
    prm = {"backlog": b}
    for rep in range(p["reps"]):
        for variant, hold in (("no_hold", False), ("held_xmin", True)):
            r = _steady_drain(ctx, b, hold=hold)
            ctx.rec("s6_xmin", variant, prm, rep, "events_per_s", r["eps"], "ev/s")
            ctx.rec("s6_xmin", variant, prm, rep, "publisher_rate", r["pub_rate"], "ev/s")
            _rec_log_dead(ctx, "s6_xmin", variant, prm, rep, r["log_stats"])
            ctx.rec("s6_xmin", variant, prm, rep, "log_exceptions_rows",
                    r["log_stats"]["outbox.log_exceptions"][1], "rows")
            ctx.say(f"  s6 xmin {variant} rep={rep}: {r['eps']:.0f} ev/s over {r['secs']:.1f}s, n_dead_tup "
                    + ", ".join(f"{k} {r['log_stats'][t][0]}" for t, k in zip(S.LOG_HOT, S.LOG_HOT_SHORT))
                    + f", publisher {r['pub_rate']:.0f}/s")
    a = ctx.med("s6_xmin", "no_hold", prm, "events_per_s")
    h = ctx.med("s6_xmin", "held_xmin", prm, "events_per_s")
    r = _ratio(h, a)
    md = (f"Backlog of {b:,} events, a publisher at ~{p['steady_rate']:,} events/s (4 connections), 2 workers "
          "claiming 100 from the install's `default` subscription and acking, until the workers catch up (a claim "
          "returns less than a full batch after the backlog is acked). Throughput = events acked / time. "
          "**held_xmin**: another session holds a REPEATABLE READ transaction (with its snapshot taken) open for "
          f"the whole run; **no_hold** (the baseline, interleaved with it in each repetition): none. Median of "
          f"{p['reps']} runs. Before each run every named subscription is dropped, the log is emptied "
          "(`LOG_RESET` of bench/obench/sql.py), the backlog published, the ring and `log_lanes` `VACUUM "
          "ANALYZE`d and a checkpoint taken. `n_dead_tup` of the log's hot relations from `pg_stat_user_tables` "
          "1 s after the drain, the snapshot still held; log_0..3 is the ring's four tables together "
          "(append-only: publish writes each event once); `log_exceptions` rows = its `n_live_tup` (events that "
          "left their batch, e.g. on an expired lease).\n\n"
          f"| variant | events/s | {LOG_DEAD_HEAD} | log_exceptions rows | publisher achieved |\n"
          "|---|---|---|---|---|---|---|---|\n")
    for v in ("no_hold", "held_xmin"):
        md += (f"| {v} | {_fmt(ctx.med('s6_xmin', v, prm, 'events_per_s'))} | "
               f"{_log_dead_cells(ctx, 's6_xmin', v, prm)} | "
               f"{_fmt(ctx.med('s6_xmin', v, prm, 'log_exceptions_rows'))} | "
               f"{_fmt(ctx.med('s6_xmin', v, prm, 'publisher_rate'))} |\n")
    md += (f"\nheld / not held = **{_fmt(r, 2)}x** (target >= 0.9x)\n\nThe holding session:\n\n" + _code(S.HOLD_XMIN)
           + "Workers (claim, then ack):\n\n" + _code(S.DRAIN["outbox"]["claim"] + ";\n" + S.DRAIN["outbox"]["ack"]
                                                     + ";")
           + "The publisher runs the publish of scenario 4.\n")
    ctx.section("6b. Drain while a snapshot is held", md)
    ctx.target("6b", "drain throughput of default with a held REPEATABLE READ snapshot / without", r, ">=", 0.9)


def s6_rotate(ctx):  # noqa: C901
    """6c: the drain of 6b while another session runs the log step of
    maintenance in a loop with a short outbox.retention_delivered, so that the
    ring tables are sealed and TRUNCATEd under the workers; against the same
    drain without it, interleaved."""
    p = ctx.p
    b = p["rotate_backlog"]
    keep = p["rotate_retention"]
    prm = {"backlog": b, "retention_s": keep}
    for rep in range(p["reps"]):
        for variant, rotate in (("no_rotate", None), ("rotate", keep)):
            r = _steady_drain(ctx, b, rotate=rotate, spread=3)
            ctx.rec("s6_rotate", variant, prm, rep, "events_per_s", r["eps"], "ev/s")
            ctx.rec("s6_rotate", variant, prm, rep, "publisher_rate", r["pub_rate"], "ev/s")
            ctx.rec("s6_rotate", variant, prm, rep, "drain_seconds", r["secs"], "s")
            if rotate is not None:
                ctx.rec("s6_rotate", variant, prm, rep, "rotate_calls", r["rot_calls"], "calls")
                ctx.rec("s6_rotate", variant, prm, rep, "tables_truncated", r["truncated"], "tables")
                ctx.rec("s6_rotate", variant, prm, rep, "rotate_errors", r["rot_errors"], "calls")
                ctx.rec("s6_rotate", variant, prm, rep, "tables_truncated_after", r["truncated_after"], "tables")
                ctx.rec("s6_rotate", variant, prm, rep, "rotate_p50", r["rot_p50"], "ms")
                ctx.rec("s6_rotate", variant, prm, rep, "rotate_max", r["rot_max"], "ms")
            ctx.say(f"  s6 rotate {variant} rep={rep}: {r['eps']:.0f} ev/s over {r['secs']:.1f}s, publisher "
                    f"{r['pub_rate']:.0f}/s"
                    + (f"; {r['rot_calls']} rotations, {r['truncated']} ring tables truncated (+{r['truncated_after']} "
                       f"in the 1 s after), {r['rot_errors']} "
                       f"errors, p50 {_fmt(r['rot_p50'], 1)} ms max {_fmt(r['rot_max'], 1)} ms, log_state "
                       f"(sealed, rows) {r['ring_state']}" if rotate is not None else ""))
    a = ctx.med("s6_rotate", "no_rotate", prm, "events_per_s")
    w = ctx.med("s6_rotate", "rotate", prm, "events_per_s")
    r = _ratio(w, a)
    trunc = ctx.values("s6_rotate", "rotate", prm, "tables_truncated")
    after = ctx.values("s6_rotate", "rotate", prm, "tables_truncated_after")
    md = (f"As 6b (publisher ~{p['steady_rate']:,}/s, 2 workers claiming 100 from `default`, until they catch "
          f"up), without a held snapshot, with a backlog of {b:,} events published over three ring tables "
          "(`log_0`, `log_1`, `log_2`: a third, then the log step with `outbox.retention_delivered = 0`, which "
          "seals the open table and opens the next, and so on; `log_2` stays open) in both variants. "
          "**rotate**: from the workers' start until they caught up, another session calls the log step of "
          "maintenance (`outbox._log_rotate()`, which the background worker and `run_maintenance()` run) every "
          f"0.1 s with `outbox.retention_delivered = {keep}` s for the session: it seals the open ring table once "
          f"it has been open for {keep / 2:g} s (if the next table is free) and `TRUNCATE`s a sealed table "
          f"{keep} s after its seal once every reader has read past it (`lock_timeout` 20 ms; a table in use is "
          "left for the next call), so the tables of the backlog are truncated behind the workers as they pass "
          "them. **no_rotate** (the baseline, interleaved with it in each repetition): the background worker's "
          f"own maintenance only (7-day retention: it truncates nothing). Median of {p['reps']} runs.\n\n"
          "| variant | drain events/s | drain time (s) | publisher achieved | rotation calls | ring tables "
          "truncated during the drain (per run) | in the 1 s after it (per run) | failed calls | "
          "rotation p50 / max (ms) |\n"
          "|---|---|---|---|---|---|---|---|---|\n"
          f"| no_rotate | {_fmt(a)} | {_fmt(ctx.med('s6_rotate', 'no_rotate', prm, 'drain_seconds'), 1)} | "
          f"{_fmt(ctx.med('s6_rotate', 'no_rotate', prm, 'publisher_rate'))} | | | | | |\n"
          f"| rotate | {_fmt(w)} | {_fmt(ctx.med('s6_rotate', 'rotate', prm, 'drain_seconds'), 1)} | "
          f"{_fmt(ctx.med('s6_rotate', 'rotate', prm, 'publisher_rate'))} | "
          f"{_fmt(ctx.med('s6_rotate', 'rotate', prm, 'rotate_calls'))} | "
          f"{', '.join(str(x) for x in trunc)} | {', '.join(str(x) for x in after)} | "
          f"{_fmt(ctx.med('s6_rotate', 'rotate', prm, 'rotate_errors'))} | "
          f"{_fmt(ctx.med('s6_rotate', 'rotate', prm, 'rotate_p50'), 1)} / "
          f"{_fmt(ctx.med('s6_rotate', 'rotate', prm, 'rotate_max'), 1)} |\n\n"
          f"with rotation / without = **{_fmt(r, 2)}x** (target >= 0.9x)\n\n"
          "The rotating session:\n\n" + _code(S.ROTATE_SET.replace("%s", f"'{keep}'") + ";\n" + S.ROTATE
                                             + ";  -- every 0.1 s")
          + "Workers and publisher as in 6b.\n")
    if not any(trunc):
        md += ("\n**No ring table was truncated during the drains**, so the ratio measures sealing and "
               "failed truncation attempts only (a `TRUNCATE` waits 20 ms for its lock, then the table is left; "
               "the tables truncated in the 1 s after the drain say whether the readers had passed them). "
               "Raise `rotate_backlog` (`--set`) for longer drains.\n")
    ctx.section("6c. Drain during a ring TRUNCATE", md)
    ctx.target("6c", "drain throughput of default while the log step seals and truncates ring tables / without",
               r, ">=", 0.9)
    ctx.check("6c-truncated", "the log step truncated at least one ring table during the drains", any(trunc),
              f"ring tables truncated per run: {trunc}")


def _held_claim_drain(ctx, backlog, hold):
    """6d: 2 workers (batch 100, autocommit claim and ack) drain a backlog of
    `default`, no publisher, from an empty log; with hold, another session has
    claimed one event in a transaction it keeps open (idle) until the drain
    ends, then rolls back. The drain ends when every event but the held one is
    acked (all of them without hold). If the workers ack nothing for s6d_stall
    seconds before that, the holder rolls back then (so the drain ends; its
    time includes the wait) and the run counts as stalled."""
    p = ctx.p
    _fresh_outbox(ctx)
    ctx.load_outbox(backlog)
    ctx.sql(S.LOG_VACUUM)
    ctx.checkpoint()
    dsn = ctx.cluster.dsn()
    holder = state = stalled = None
    if hold:
        holder = agents.connect(dsn)  # autocommit: BEGIN ... ROLLBACK explicitly
        holder.execute(S.HOLD_CLAIM_STMTS[0])
        if len(holder.execute(S.HOLD_CLAIM_STMTS[1]).fetchall()) != 1:
            holder.close()
            raise HarnessError("6d: the holder's outbox.claim(..., 1) did not return one event")
    total = backlog - (1 if hold else 0)
    counter = ctx.mp.Value("q", 0)
    g = ctx.agents([("drain_worker", dict(dsn=dsn, system="outbox", wid=w, batch=100, total=total, counter=counter,
                                          deadline_s=p["drain_deadline"])) for w in range(2)])
    try:
        g.start()
        last, t_last = -1, time.monotonic()
        while counter.value < total and any(pr.is_alive() for pr in g.procs):
            if counter.value != last:
                last, t_last = counter.value, time.monotonic()
            elif holder is not None and stalled is None and time.monotonic() - t_last > p["s6d_stall"]:
                state = ctx.sql(S.HOLDER_STATE, (holder.info.backend_pid,)).fetchone()
                holder.execute("ROLLBACK")
                stalled = total - last
            time.sleep(0.05)
        ws = g.collect(2, p["drain_deadline"] + 30)
        g.join()
        if holder is not None and stalled is None:
            state = ctx.sql(S.HOLDER_STATE, (holder.info.backend_pid,)).fetchone()
    finally:
        g.kill()
        if holder is not None:
            try:
                holder.execute("ROLLBACK")  # a no-op (a warning) after the stall's
            finally:
                holder.close()
    if hold and (state is None or state[0] != "idle in transaction"):
        raise HarnessError(f"6d: the holder was not idle in its transaction (pg_stat_activity: {state})")
    acked = sum(r["n"] for r in ws)
    left = ctx.one(S.DEFAULT_LEFT)
    # after a stall the drain may end before or after the held event came back
    want = [(backlog - 1, 1)] if hold and stalled is None else [(backlog, 0)] + ([(backlog - 1, 1)] if hold else [])
    if (acked, left) not in want:
        raise HarnessError(f"6d: backlog {backlog}, acked {acked} and {left} left for default after the holder "
                           f"ended; expected (acked, left) in {want}")
    secs = (max(r["t1"] for r in ws) - min(r["t0"] for r in ws)) / ns
    return {"eps": acked / secs, "secs": secs, "acked": acked, "stalled": stalled}


def s6_held_claim(ctx):
    p = ctx.p
    b = p["steady_backlog"]
    prm = {"backlog": b}
    for rep in range(p["reps"]):
        for variant, hold in (("no_holder", False), ("held_claim", True)):
            r = _held_claim_drain(ctx, b, hold)
            ctx.rec("s6_held_claim", variant, prm, rep, "events_per_s", r["eps"], "ev/s")
            ctx.rec("s6_held_claim", variant, prm, rep, "drain_seconds", r["secs"], "s")
            if hold:
                ctx.rec("s6_held_claim", variant, prm, rep, "stalled_left", r["stalled"] or 0, "events")
            ctx.say(f"  s6d {variant} rep={rep}: {r['eps']:.0f} ev/s, {r['acked']} acked in {r['secs']:.1f}s"
                    + (f"; STALLED with {r['stalled']} events left until the holder rolled back" if r["stalled"]
                       else ""))
    a = ctx.med("s6_held_claim", "no_holder", prm, "events_per_s")
    h = ctx.med("s6_held_claim", "held_claim", prm, "events_per_s")
    r = _ratio(h, a)
    stalls = ctx.values("s6_held_claim", "held_claim", prm, "stalled_left")
    md = (f"A backlog of {b:,} events (no subject, scenario 3's payload) published on an empty log, the ring and "
          "`log_lanes` `VACUUM ANALYZE`d and a checkpoint taken; then 2 workers claim 100 from the install's "
          "`default` subscription and ack each claim with the batch `outbox.ack` (autocommit, two round trips per "
          "batch), with no publisher (unlike 6b), so that every event acked is one of the backlog and the end of the "
          "drain is exact. **held_claim**: before the workers start, another session runs `BEGIN` and "
          "`outbox.claim('bench-holder', 1)` and stays idle in that transaction until the drain ends, then rolls "
          "back (the harness checks in `pg_stat_activity` that it is `idle in transaction`). The held event comes "
          "back only when the holder ends, so the drain is done when **every event but the held one** is acked; "
          "afterwards the harness checks that `default` has exactly that one event left (none without the holder). "
          f"If the workers ack nothing for {p['s6d_stall']} s (`s6d_stall`) before that, the holder rolls back "
          "there and then, the drain finishes (the held event included) and the run counts as **stalled**: its "
          "time includes the wait. **no_holder** (the baseline, interleaved with it in each repetition): the same "
          f"drain of all {b:,} events. Throughput = events acked / (last ack - first claim); median of "
          f"{p['reps']} runs.\n\n"
          "| variant | events/s | drain time (s) | stalled runs (events left when it stalled) |\n|---|---|---|---|\n"
          f"| no_holder | {_fmt(a)} | {_fmt(ctx.med('s6_held_claim', 'no_holder', prm, 'drain_seconds'), 2)} | |\n"
          f"| held_claim | {_fmt(h)} | {_fmt(ctx.med('s6_held_claim', 'held_claim', prm, 'drain_seconds'), 2)} | "
          f"{sum(1 for x in stalls if x)} of {len(stalls)}"
          + (f" ({', '.join(str(int(x)) for x in stalls if x)})" if any(stalls) else "") + " |\n\n"
          f"with the holder / without = **{_fmt(r, 2)}x** (target >= 0.9x)\n\n"
          "The holding session:\n\n" + _code(S.HOLD_CLAIM)
          + "Workers (claim, then ack):\n\n" + _code(S.DRAIN["outbox"]["claim"] + ";\n" + S.DRAIN["outbox"]["ack"]
                                                      + ";"))
    ctx.section("6d. Drain while a claim is held in an open transaction", md)
    ctx.target("6d", "drain throughput of default while another session holds one claimed event in an open "
               "transaction / without", r, ">=", 0.9)


# ---------------------------------------------------------------------------
# 13. Empty poll: what an idle worker's claim costs
# ---------------------------------------------------------------------------
def _empty_polls(ctx, system, n):
    """n claims of 100 that find nothing, from one connection (prepared after
    psycopg's threshold; 20 untimed first); returns the per-call times (ms)."""
    conn = agents.connect(ctx.cluster.dsn())
    q = S.DRAIN[system]["claim"]
    lat = []
    for i in range(n + 20):
        t = time.monotonic_ns()
        rows = conn.execute(q, {"worker": "idle", "batch": 100}).fetchall()
        dt = (time.monotonic_ns() - t) / 1e6
        if rows:
            raise HarnessError(f"s13: an empty poll of {system} returned {len(rows)} rows")
        if i >= 20:
            lat.append(dt)
    conn.close()
    return lat


def s13_empty_poll(ctx):
    p = ctx.p
    n = p["s13_polls"]
    prm = {"polls": n}
    _fresh_outbox(ctx)
    ctx.reset_plain()
    ctx.sql("CHECKPOINT")
    for rep in range(p["reps"]):
        # Interleaved, in turns, so that drift hits neither system alone.
        for system in (("plain", "outbox") if rep % 2 == 0 else ("outbox", "plain")):
            lat = _empty_polls(ctx, system, n)
            ctx.rec("s13_empty_poll", system, prm, rep, "p50", pct(lat, 50), "ms")
            ctx.rec("s13_empty_poll", system, prm, rep, "p99", pct(lat, 99), "ms")
            ctx.say(f"  s13 {system} rep={rep}: p50 {pct(lat, 50):.3f} ms, p99 {pct(lat, 99):.3f} ms")
    med = {s: (ctx.med("s13_empty_poll", s, prm, "p50"), ctx.med("s13_empty_poll", s, prm, "p99"))
           for s in ("plain", "outbox")}
    r = _ratio(med["outbox"][0], med["plain"][0])
    md = (f"An idle worker's poll: {n:,} claims of up to 100 that find nothing, one after another from one "
          "connection (the statement prepared; 20 untimed first), on an empty log (`default` only, its lanes "
          "read up to now) and an empty `bench_plain`, the two systems in turns, "
          f"{p['reps']} repetitions. Time per call as the client sees it (the round trip included, the same "
          "for both); medians of the repetitions.\n\n"
          "| system | p50 (ms) | p99 (ms) |\n|---|---|---|\n"
          + "".join(f"| {s} | {_fmt(med[s][0], 3)} | {_fmt(med[s][1], 3)} |\n" for s in ("plain", "outbox"))
          + f"\noutbox / plain SKIP LOCKED, p50: **{_fmt(r, 2)}x** (target <= 2x)\n\n"
          + "outbox:\n\n" + _code(S.DRAIN["outbox"]["claim"]) + "plain:\n\n" + _code(S.DRAIN["plain"]["claim"]))
    ctx.section("13. Empty poll", md)
    ctx.target("13", "an empty claim of default / the empty poll of plain SKIP LOCKED (p50)", r, "<=", 2.0)


# ---------------------------------------------------------------------------
# Claim plans: auto_explain of the log claim's statements (src/sql/log.rs)
# ---------------------------------------------------------------------------
_LOG_ENTRY = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", re.M)


def _capture_claim_plans(ctx):
    """Every statement a claim of 100 from `default` runs through SPI, with its
    plan, from auto_explain in the server log (a rolled-back transaction).
    Returns (rows claimed, [plan entries])."""
    conn = agents.connect(ctx.cluster.dsn())
    for s in S.AUTO_EXPLAIN:
        conn.execute(s)
    off = ctx.cluster.log_size()
    conn.execute("BEGIN")
    n = conn.execute(S.EXPLAIN_CLAIM).fetchone()[0]
    conn.execute("ROLLBACK")
    conn.close()
    time.sleep(0.2)
    text = ctx.cluster.log_since(off)
    starts = [m.start() for m in _LOG_ENTRY.finditer(text)] + [len(text)]
    plans = []
    for a, b in zip(starts, starts[1:]):
        entry = text[a:b]
        if "plan:" in entry and "outbox.claim('explain-worker'" not in entry:
            plans.append(entry.rstrip())
    if not plans:
        raise HarnessError("auto_explain did not log the claim's statements:\n" + text[-3000:])
    return n, plans


def _claim_ms(ctx, reps=25):
    """Median time of claim(100) in a rolled-back transaction (state unchanged)."""
    conn = agents.connect(ctx.cluster.dsn())
    xs = []
    for i in range(reps + 2):
        conn.execute("BEGIN")
        t = time.monotonic_ns()
        conn.execute(S.EXPLAIN_CLAIM).fetchone()
        xs.append((time.monotonic_ns() - t) / 1e6)
        conn.execute("ROLLBACK")
    conn.close()
    return median(xs[2:])


def _plan_summary(plans):
    text = "\n".join(plans)
    idx = sorted(set(re.findall(r"Index (?:Only )?Scan(?: Backward)? using (\w+)", text)))
    seq = sorted(set(re.findall(r"Seq Scan on ([\w.]+)", text)))
    removed = sum(int(x) for x in re.findall(r"Rows Removed by Filter: (\d+)", text))
    return idx, seq, removed


def _plans_md(plans, limit=40):
    md = ""
    for entry in plans[:limit]:
        md += _code(entry, "text")
    if len(plans) > limit:
        md += f"({len(plans) - limit} more plan entries left out)\n\n"
    return md


def explain_claims(ctx):
    p = ctx.p
    md = ("claim() runs its statements (src/sql/log.rs) through SPI, so the plans come from `auto_explain` in "
          "the server log (`log_nested_statements`, `log_analyze`, `log_buffers`): every statement of "
          "`claim('explain-worker', 100)` from the install's `default` subscription, inside a rolled-back "
          "transaction. Claim time = median of 25 such calls (client-side, includes the round trip); each case "
          "against a baseline measured just before it in the same run.\n\n"
          + _code(";\n".join(S.AUTO_EXPLAIN) + ";"))

    blocked, active = p["explain_blocked"], p["explain_active"]

    def active_subjects():
        for lo in range(1, active + 1, 1000):
            ctx.sql(S.SETUP_BLOCKED_STMTS[-1], {"payload": S.PAYLOAD, "lo": lo, "hi": min(active, lo + 999)})

    _fresh_outbox(ctx)
    active_subjects()
    ctx.sql(S.LOG_VACUUM)
    base_ms = _claim_ms(ctx)
    _fresh_outbox(ctx)
    for stmt in S.SETUP_BLOCKED_STMTS[:-1]:
        ctx.sql(stmt, {"payload": S.PAYLOAD, "blocked": blocked})
    active_subjects()
    ctx.sql(S.LOG_VACUUM)
    n, plans = _capture_claim_plans(ctx)
    ms = _claim_ms(ctx)
    idx, seq, removed = _plan_summary(plans)
    # ring tables holding events (a seq scan of an empty one is the planner's
    # cheapest choice, not a finding)
    full = {t.split(".", 1)[1] for t in S.LOG_RING if ctx.one(f"SELECT EXISTS (SELECT 1 FROM {t})")}
    ctx.rec("explain", "blocked_subject", {"active": active, "blocked": blocked}, 0, "claim_ms", ms, "ms")
    ctx.rec("explain", "active_only", {"active": active}, 0, "claim_ms", base_ms, "ms")
    ctx.rec("explain", "blocked_subject", {"active": active, "blocked": blocked}, 0, "statements", len(plans),
            "statements")
    md += (f"\n**{active:,} active subjects + one blocked subject holding {blocked:,} events** "
           f"(its first event is leased by a slow handler; its events are older than the active ones):\n\n"
           f"- claim returned {n} rows; claim time {ms:.1f} ms vs {base_ms:.1f} ms with the {active:,} active "
           f"subjects only ({_fmt(_ratio(ms, base_ms), 2)}x)\n"
           f"- {len(plans)} statements logged; index scans: {', '.join(idx) or 'none'}; seq scans: "
           f"{', '.join(seq) or 'none'}; rows removed by filter: {removed:,}\n\n"
           + _code(S.SETUP_BLOCKED) + _plans_md(plans))
    ctx.check("3-plan-seq", "claim plans with a blocked subject scan no ring table holding events sequentially",
              not any(s in full or s in {"outbox." + f for f in full} for s in seq),
              f"ring tables holding events: {', '.join(sorted(full)) or 'none'}; seq scans: {', '.join(seq) or 'none'}; "
              f"rows removed by filter {removed:,}")
    ctx.target("3-plan-a", f"claim time with a blocked subject of {blocked:,} events / active subjects only",
               _ratio(ms, base_ms), "<=", 1.5)
    ctx.series["explain_blocked"] = (ms, base_ms)

    # The same active subjects, with a dead letter under 'block' and a pile
    # parked behind it, against the dead letter alone (issue 40, contract item 4).
    pile = p["explain_dead_pile"]

    def dead_letter(n):
        _fresh_outbox(ctx)
        for stmt in S.SETUP_DEAD_STMTS[:2]:
            ctx.sql(stmt, {"payload": S.PAYLOAD})
        if n:
            ctx.sql(S.SETUP_DEAD_STMTS[2], {"payload": S.PAYLOAD, "pile": n})
            for _ in range(n // 100 + 50):
                if ctx.one(S.DEAD_PARKED) >= n:
                    break
                ctx.sql(S.SETUP_DEAD_STMTS[3])
            if ctx.one(S.DEAD_PARKED) != n:
                raise HarnessError(f"{ctx.one(S.DEAD_PARKED)} of {n} events behind the dead letter were parked")
        active_subjects()
        ctx.sql(S.LOG_VACUUM)
        return _claim_ms(ctx)

    base3 = dead_letter(0)
    ms3 = dead_letter(pile)
    ctx.rec("explain", "dead_letter_pile", {"active": active, "pile": pile}, 0, "claim_ms", ms3, "ms")
    ctx.rec("explain", "dead_letter_only", {"active": active}, 0, "claim_ms", base3, "ms")
    md += (f"\n**{active:,} active subjects + one dead letter under `block` with {pile:,} events of its subject "
           f"parked behind it**: claim time {ms3:.1f} ms vs {base3:.1f} ms with the dead letter alone "
           f"({_fmt(_ratio(ms3, base3), 2)}x)\n\n" + _code(S.SETUP_DEAD))
    ctx.target("3-plan-c", f"claim time with {pile:,} events behind a dead letter / the dead letter alone",
               _ratio(ms3, base3), "<=", 1.2)

    future, ready = p["explain_future"], p["explain_ready"]
    # Same ready events measured before and after the future ones are added.
    _fresh_outbox(ctx)
    ctx.sql(S.SETUP_FUTURE_STMTS[1], {"payload": S.PAYLOAD, "ready": ready})
    ctx.sql(S.LOG_VACUUM)
    base2 = _claim_ms(ctx)
    ctx.sql(S.SETUP_FUTURE_STMTS[0], {"payload": S.PAYLOAD, "future": future})
    ctx.sql(S.LOG_VACUUM)
    n, plans = _capture_claim_plans(ctx)
    ms2 = _claim_ms(ctx)
    idx, seq, removed = _plan_summary(plans)
    ctx.rec("explain", "future_events", {"future": future, "ready": ready}, 0, "claim_ms", ms2, "ms")
    ctx.rec("explain", "ready_only", {"ready": ready}, 0, "claim_ms", base2, "ms")
    md += (f"\n**{future:,} future events (deliver_at = now + 1 day) published after {ready:,} ready ones**:\n\n"
           f"- claim returned {n} rows; claim time {ms2:.1f} ms vs {base2:.1f} ms with the ready events only "
           f"({_fmt(_ratio(ms2, base2), 2)}x)\n"
           f"- {len(plans)} statements logged; index scans: {', '.join(idx) or 'none'}; seq scans: "
           f"{', '.join(seq) or 'none'}; rows removed by filter: {removed:,}\n\n"
           + _code(S.SETUP_FUTURE) + _plans_md(plans))
    ctx.target("3-plan-b", f"claim time with {future:,} future events / without", _ratio(ms2, base2), "<=", 1.2)
    ctx.section("Claim plans (auto_explain of the log claim)", md)


# ---------------------------------------------------------------------------
# 7. Many databases: publish in several databases at once, wake-ups in each
# ---------------------------------------------------------------------------
S7_SYSTEMS = [
    # (name, pgbench script, outbox.notify)
    ("outbox_background", "outbox", "background"),
    ("plain", "plain", None),
]
S7_PROBE_PREFIX = "bench.probe."


def _s7_dbs(ctx):
    return [f"bench_db{i}" for i in range(1, ctx.p["s7_dbs"] + 1)]


def _s7_drop(ctx, dbs):
    # FORCE: a background worker serving the database is connected to it.
    for db in dbs:
        ctx.sql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


def _s7_worker(conn):
    """The pid of the outbox_ext worker serving conn's database per
    outbox.wakeup_status(), 0 when none does (yet), None when none will: 0.5.0 and
    earlier serve only the database named by outbox.database, 0.6.0 those listed
    in outbox.databases (empty: every database with the extension)."""
    one, many, db, oid = conn.execute(
        "SELECT current_setting('outbox.database', true), current_setting('outbox.databases', true), "
        "current_database(), (SELECT oid FROM pg_database WHERE datname = current_database())").fetchone()
    if one and one != db:
        return None
    listed = [n.strip() for n in (many or "").split(",") if n.strip()]
    if listed and db not in listed:
        return None
    cur = conn.cursor(row_factory=dict_row)
    for r in cur.execute("SELECT * FROM outbox.wakeup_status()").fetchall():
        # 0.6.0 has a state column ('serving' once the worker is attached)
        if r.get("worker_pid") and r.get("database", oid) == oid and r.get("state", "serving") == "serving":
            return r["worker_pid"]
    return 0


def _s7_setup(ctx, dbs):
    """Fresh databases (leftovers of an earlier attempt are dropped), each with the
    extension and the plain table; waits for their workers to attach."""
    _s7_drop(ctx, dbs)
    conns = {}
    for db in dbs:
        ctx.sql(f"CREATE DATABASE {db}")
        c = agents.connect(ctx.cluster.dsn(db))
        c.execute(S.OUTBOX_SCHEMA)
        for stmt in S.PLAIN_SCHEMA.split(";\n"):
            c.execute(stmt.rstrip(";"))
        conns[db] = c
    t0 = time.monotonic()
    workers = {db: _s7_worker(c) for db, c in conns.items()}
    while any(w == 0 for w in workers.values()) and time.monotonic() - t0 < ctx.p["s7_attach_wait"]:
        time.sleep(0.2)
        workers = {db: (_s7_worker(conns[db]) if w == 0 else w) for db, w in workers.items()}
    return conns, workers, time.monotonic() - t0


def _s7_reset(conns, system):
    for c in conns.values():
        if system.startswith("outbox"):
            c.execute(S.LOG_RESET)
        else:
            c.execute("TRUNCATE bench_plain")


def _s7_run(ctx, dbs, script, notify, rep, probe):
    """One timed run: a pgbench process per database, all at once. With probe, a
    listener and a prober per database (agent processes). Returns ({db: tps},
    {db: probe figures} or None)."""
    p = ctx.p
    per_db = p["s7_clients"] // len(dbs)
    runs = [(db, per_db) for db in dbs]
    if not probe:
        return ctx.pgbench_many(script, runs, p["s7_seconds"], notify), None
    secs = p["s7_seconds"]
    warmup = min(0.5, secs * 0.2)
    span = secs - warmup - min(0.3, secs * 0.1)
    n = p["s7_probes"]
    got = ctx.mp.Value("q", 0)
    stop = ctx.mp.Event()
    specs = [("wake_listener", dict(dsn=ctx.cluster.dsn(db), prefix=S7_PROBE_PREFIX, stop_evt=stop, counter=got))
             for db in dbs]
    specs += [("wake_prober", dict(dsn=ctx.cluster.dsn(db), tag=f"db{i + 1}-r{rep}", n=n, warmup_s=warmup,
                                   span_s=span, offset=i / len(dbs)))
              for i, db in enumerate(dbs)]
    g = ctx.agents(specs)
    try:
        g.start()
        tps = ctx.pgbench_many(script, runs, secs, notify)
        probers = g.collect(len(dbs), 30)  # listeners only report once stopped
        # Let the last notifications arrive (a worker sleeps at most 1 s between passes).
        deadline = time.monotonic() + p["s7_probe_grace"]
        while got.value < n * len(dbs) and time.monotonic() < deadline:
            time.sleep(0.02)
        stop.set()
        listeners = g.collect(len(dbs), 30)
        g.join()
    finally:
        stop.set()
        g.kill()
    by_dsn = {ctx.cluster.dsn(db): db for db in dbs}
    heard = {by_dsn[r["dsn"]]: r for r in listeners}
    out = {}
    for r in probers:
        db = by_dsn[r["dsn"]]
        arrived = {}
        for topic, t, pid in heard[db]["recs"]:
            arrived.setdefault(topic, (t, pid))  # the first notification of a probe counts
        lat, by_worker, lost = [], 0, 0
        for topic, t_commit in r["recs"]:
            if topic not in arrived:
                lost += 1
                continue
            t, pid = arrived[topic]
            lat.append((t - t_commit) / 1e6)
            by_worker += pid != r["pid"]
        out[db] = {"lat": lat, "by_worker": by_worker, "lost": lost, "probes": len(r["recs"]),
                   "other": heard[db]["other"]}
    return tps, out


def s7_multidb(ctx):  # noqa: C901
    p = ctx.p
    dbs = _s7_dbs(ctx)
    clients = p["s7_clients"]
    per_db = clients // len(dbs)
    prm = {"dbs": len(dbs), "clients": clients}
    tmp = tempfile.mkdtemp(prefix="obench-pgbench-")
    scripts = {}
    for _, script, _ in S7_SYSTEMS:
        path = os.path.join(tmp, f"{script}.sql")
        with open(path, "w") as f:
            f.write(S.PUB1[script])
        scripts[script] = path
    conns = {}
    lat_all = {db: [] for db in dbs}
    wake = {db: {"by_worker": 0, "lost": 0, "probes": 0, "other": []} for db in dbs}
    try:
        conns, workers, waited = _s7_setup(ctx, dbs)
        ctx.say(f"  s7 databases {', '.join(dbs)} created; outbox_ext workers (wakeup_status) "
                + ", ".join(f"{db}={'none (not in outbox.database(s))' if w is None else w or 'none'}"
                            for db, w in workers.items()) + f" after {waited:.1f}s")
        # Throughput runs carry no listeners: a LISTEN session in each database
        # receives every notification the load causes, which would tax the outbox
        # side only. The wake-up probes run afterwards, under the same load, in runs
        # of their own whose throughput is reported but not in the ratio.
        for rep in range(p["reps"]):
            ctx.checkpoint()
            line = []
            for name, script, notify in S7_SYSTEMS:
                _s7_reset(conns, name)
                tps, _ = _s7_run(ctx, dbs, scripts[script], notify, rep, probe=False)
                ctx.rec("s7_multidb", name, prm, rep, "events_per_s", sum(tps.values()), "ev/s")
                for db in dbs:
                    ctx.rec("s7_multidb", name, dict(prm, db=db), rep, "events_per_s", tps[db], "ev/s")
                line.append(f"{name}={sum(tps.values()):.0f} (" + "/".join(f"{tps[db]:.0f}" for db in dbs) + ")")
            ctx.say(f"  s7 rep={rep}: " + "; ".join(line))
        for rep in range(p["reps"]):
            ctx.checkpoint()
            name, script, notify = S7_SYSTEMS[0]
            _s7_reset(conns, name)
            tps, probes = _s7_run(ctx, dbs, scripts[script], notify, rep, probe=True)
            ctx.rec("s7_multidb", "outbox_background_probed", prm, rep, "events_per_s", sum(tps.values()), "ev/s")
            for db in dbs:
                r = probes[db]
                dp = dict(prm, db=db)
                ctx.rec("s7_multidb", name, dp, rep, "wake_p50", pct(r["lat"], 50), "ms")
                ctx.rec("s7_multidb", name, dp, rep, "wake_p99", pct(r["lat"], 99), "ms")
                ctx.rec("s7_multidb", name, dp, rep, "probes", r["probes"], "probes")
                ctx.rec("s7_multidb", name, dp, rep, "probes_not_notified", r["lost"], "probes")
                ctx.rec("s7_multidb", name, dp, rep, "probes_notified_by_worker", r["by_worker"], "probes")
                ctx.rec("s7_multidb", name, dp, rep, "other_notifications", r["other"], "notifications")
                lat_all[db].extend(r["lat"])
                w = wake[db]
                w["by_worker"] += r["by_worker"]
                w["lost"] += r["lost"]
                w["probes"] += r["probes"]
                w["other"].append(r["other"])
            ctx.say(f"  s7 probe run {rep}: {name}={sum(tps.values()):.0f}; wake p50/p99 ms " + ", ".join(
                f"{_fmt(pct(probes[db]['lat'], 50), 1)}/{_fmt(pct(probes[db]['lat'], 99), 1)}"
                f"{'' if probes[db]['by_worker'] == probes[db]['probes'] else ' (' + str(probes[db]['probes'] - probes[db]['by_worker']) + ' by the publisher)'}"
                for db in dbs))
    finally:
        for c in conns.values():
            c.close()
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _s7_drop(ctx, dbs)
        except Exception as e:  # noqa: BLE001 - the next attempt drops them first
            ctx.say(f"  s7: dropping {', '.join(dbs)} failed: {e}")

    for db in dbs:
        dp = dict(prm, db=db)
        ctx.rec("s7_multidb", "outbox_background", dp, "all", "wake_p50_all_runs", pct(lat_all[db], 50), "ms")
        ctx.rec("s7_multidb", "outbox_background", dp, "all", "wake_p99_all_runs", pct(lat_all[db], 99), "ms")
    tot = {name: ctx.med("s7_multidb", name, prm, "events_per_s") for name, *_ in S7_SYSTEMS}
    r = _ratio(tot["outbox_background"], tot["plain"])
    md = (f"{clients} clients spread over {len(dbs)} databases ({', '.join(dbs)}, created by the scenario with "
          f"`CREATE EXTENSION outbox_ext` and the plain table, dropped at the end): one pgbench process per "
          f"database with {per_db} clients, all {len(dbs)} running at once for {p['s7_seconds']} s, one event per "
          "transaction with the scripts of scenario 1 (outbox in `background` mode; plain INSERT). Events/s is "
          f"each pgbench's TPS, summed over the databases; median of {p['reps']} runs (systems interleaved "
          "within a repetition, tables truncated before every run). Target: outbox_background >= 0.85x plain "
          "(the total).\n\n")
    md += "| system | total events/s | " + " | ".join(dbs) + " | runs (total) |\n" + "|---" * (len(dbs) + 3) + "|\n"
    for name, *_ in S7_SYSTEMS:
        vals = ctx.values("s7_multidb", name, prm, "events_per_s")
        cells = []
        for db in dbs:
            m = ctx.med("s7_multidb", name, dict(prm, db=db), "events_per_s")
            pl = ctx.med("s7_multidb", "plain", dict(prm, db=db), "events_per_s")
            cells.append(f"{_fmt(m)} ({_fmt(_ratio(m, pl), 2)}x)")
        md += (f"| {name} | {_fmt(tot[name])} ({_fmt(_ratio(tot[name], tot['plain']), 2)}x) | " + " | ".join(cells)
               + f" | {', '.join(_fmt(v) for v in vals)} |\n")
    md += f"\noutbox_background / plain INSERT = **{_fmt(r, 2)}x** (target >= 0.85x)\n\n"
    probed = ctx.med("s7_multidb", "outbox_background_probed", prm, "events_per_s")
    md += (f"**Wake-ups under that load**, measured in {p['reps']} further outbox_background runs "
           f"(their throughput, {_fmt(probed)} events/s median, is not in the ratio: the listeners receive every "
           "notification of the load and take CPU from the publishers): in each database a session "
           f"`LISTEN outbox` and another publishes {p['s7_probes']} probe events per run, each to its own topic "
           f"(`{S7_PROBE_PREFIX}<db>-<run>-<i>`; the notification's payload is the topic), evenly spaced over the "
           "run and staggered between databases. Wake-up = from the probe's COMMIT returning to the listener "
           "receiving the probe's notification, on one system-wide monotonic clock; percentiles over the probes of "
           f"all {p['reps']} runs. **by a worker**: probe notifications sent by another backend than the "
           "publisher (a background worker); the others were sent by the publisher at its commit, i.e. "
           "`background` degraded to `transaction` because no worker serves the database. Either way the "
           "publisher's backend acts at commit (hands its topics to the worker, or sends its NOTIFY) before it "
           "replies, so a notification can reach the listener before the publisher's COMMIT returns: figures "
           "near or below zero are possible, more so on an overloaded machine. "
           f"Not notified: no notification within {p['s7_probe_grace']} s after the load ended. Other "
           "notifications: the median per run of the listener's notifications for the load's topic.\n\n")
    md += ("| database | worker pid (wakeup_status) | probes | wake-up p50 (ms) | p99 (ms) | max (ms) | by a worker "
           "| not notified | other notifications |\n|---|---|---|---|---|---|---|---|---|\n")
    for db in dbs:
        w = wake[db]
        pid = workers.get(db)
        md += (f"| {db} | {'none' if not pid else pid} | {w['probes']} | {_fmt(pct(lat_all[db], 50), 2)} | "
               f"{_fmt(pct(lat_all[db], 99), 2)} | {_fmt(max(lat_all[db]) if lat_all[db] else None, 2)} | "
               f"{w['by_worker']} of {w['probes']} | {w['lost']} | {_fmt(median(w['other']))} |\n")
    md += (f"\npgbench: `pgbench -n -M prepared -c {per_db} -j 1 -T {p['s7_seconds']} -f SCRIPT DB`, one per "
           "database, started together; outbox runs set `PGOPTIONS='-c outbox.notify=background'`.\n\n")
    md += "**outbox**\n\n" + _code(S.PUB1["outbox"]) + "**plain**\n\n" + _code(S.PUB1["plain"])
    md += ("**probe** (autocommit, `outbox.notify = background`), and the listener\n\n"
           + _code(S.MULTIDB_PROBE + ";\n" + S.MULTIDB_LISTEN + ";"))
    ctx.section("7. Many databases", md)
    ctx.target("7", f"publish outbox(background) / plain INSERT, {clients} clients over {len(dbs)} databases",
               r, ">=", 0.85)


# ---------------------------------------------------------------------------
# 8. Held transaction id: wake-up latency before, while and after a session
#    idles in a transaction that holds a transaction id
# ---------------------------------------------------------------------------
S8_PHASES = ("clean", "held", "after")


def _s8_sleep_until(t_ns):
    while True:
        left = t_ns - time.monotonic_ns()
        if left <= 0:
            return
        time.sleep(min(left / ns, 0.2))


def _s8_log_stats(ctx):
    """The log's hot relations' statistics now (see _rel_stats)."""
    return _rel_stats(ctx.admin, S.LOG_HOT)


def _s8_once(ctx):  # noqa: C901
    """One run: publishers at s8_rate from the start to the end; warm-up, clean
    phase, then a session BEGINs, takes a transaction id and idles for s8_held
    seconds, commits, and the after phase runs. Returns per-phase latencies
    (publish commit returned -> the claim returning the event, ms, phase by the
    event's commit time), the statistics of the log's hot relations at the end
    of each phase and a timeline. The workers claim from `default`, on an empty
    log (every named subscription dropped) before the publishers start."""
    p = ctx.p
    rate, nworkers = p["s8_rate"], p["s8_workers"]
    _fresh_outbox(ctx)
    stats_fn = _s8_log_stats
    ctx.checkpoint()
    # As in scenario 4: every commit waits for a WAL flush, so enough connections
    # that each needs at most ~250 commits/s (unless s8_pub_conns says otherwise).
    conns = p["s8_pub_conns"] or min(24, max(2, -(-rate // 250)))
    procs = 1 if conns <= 2 else 2
    per = [conns // procs + (1 if i < conns % procs else 0) for i in range(procs)]
    counter = ctx.mp.Value("q", 0)
    pub_stop = ctx.mp.Event()
    work_stop = ctx.mp.Event()
    dsn = ctx.cluster.dsn()
    specs = [("publisher", dict(dsn=dsn, system="outbox", rate=rate * per[i] / conns, nconns=per[i],
                                duration_s=None, stop_evt=pub_stop, notify="background", record=True, pid=i))
             for i in range(procs)]
    specs += [("e2e_worker", dict(dsn=dsn, system="outbox", wid=w, batch=p["s8_batch"],
                                  stop_evt=work_stop,
                                  counter=counter, poll_s=p["s8_poll"], warm=True))
              for w in range(nworkers)]
    g = ctx.agents(specs)
    holder = agents.connect(dsn)  # autocommit: BEGIN ... COMMIT explicitly
    holder_pid = holder.info.backend_pid
    open_tx = False
    stats, marks = {}, {}
    try:
        t0 = g.start()
        marks["clean"] = t0 + int(p["s8_warmup"] * ns)
        _s8_sleep_until(marks["clean"] + int(p["s8_clean"] * ns))
        stats["clean"] = stats_fn(ctx)
        holder.execute(S.HOLD_XID_STMTS[0])
        open_tx = True
        xid = holder.execute(S.HOLD_XID_STMTS[1]).fetchone()[0]
        marks["held"] = time.monotonic_ns()
        _s8_sleep_until(marks["held"] + int(p["s8_held"] * ns))
        state = ctx.sql(S.HOLDER_STATE, (holder_pid,)).fetchone()
        stats["held"] = stats_fn(ctx)
        holder.execute("COMMIT")
        open_tx = False
        marks["after"] = time.monotonic_ns()
        _s8_sleep_until(marks["after"] + int(p["s8_after"] * ns))
        stats["after"] = stats_fn(ctx)
        marks["end"] = time.monotonic_ns()
        pub_stop.set()
        pubs = g.collect(procs, 60)
        total = sum(r["n"] for r in pubs)
        deadline = time.monotonic() + p["s8_drain_wait"]
        while counter.value < total and time.monotonic() < deadline:
            time.sleep(0.05)
        drain_s = (time.monotonic_ns() - marks["end"]) / ns
        work_stop.set()
        works = g.collect(nworkers, 30)
        g.join()
    finally:
        pub_stop.set()
        work_stop.set()
        if open_tx:
            try:
                holder.execute("ROLLBACK")
            except psycopg.Error:
                pass
        holder.close()
        g.kill()
    if state is None or state[1] is None:
        raise HarnessError(f"the holding session held no transaction id (pg_stat_activity: {state})")
    commit = {}
    for r in pubs:
        commit.update(dict(r["recs"]))
    claimed = {}
    for r in works:
        for i, tc, _ta in r["recs"]:
            claimed.setdefault(i, tc)
    if len(claimed) != len(commit) or set(claimed) != set(commit):
        raise HarnessError(f"s8: published {len(commit)}, claimed and acked {len(claimed)} "
                           f"({p['s8_drain_wait']} s after the publishers stopped)")
    lat = {ph: [] for ph in S8_PHASES}
    # Timeline: each phase in windows of s8_window seconds from its start.
    step = int(p["s8_window"] * ns)
    windows = {}
    bounds = [("clean", marks["clean"], marks["held"]), ("held", marks["held"], marks["after"]),
              ("after", marks["after"], None)]
    for i, tcommit in commit.items():
        for k, (ph, lo, hi) in enumerate(bounds):
            if tcommit >= lo and (hi is None or tcommit < hi):
                ms = (claimed[i] - tcommit) / 1e6
                lat[ph].append(ms)
                windows.setdefault((k, (tcommit - lo) // step), []).append(ms)
                break
    rel = lambda t: (t - marks["clean"]) / ns  # noqa: E731
    timeline = [(bounds[k][0], rel(bounds[k][1]) + w * p["s8_window"], len(v), pct(v, 50), pct(v, 99), max(v))
                for (k, w), v in sorted(windows.items())]
    pub_secs = (max(r["t1"] for r in pubs) - min(r["t0"] for r in pubs)) / ns
    return {
        "lat": lat, "stats": stats, "xid": xid, "holder_state": state,
        "timeline": timeline,
        "held_from": rel(marks["held"]), "held_to": rel(marks["after"]),
        "secs": {"clean": (marks["held"] - marks["clean"]) / ns, "held": (marks["after"] - marks["held"]) / ns,
                 "after": (marks["end"] - marks["after"]) / ns},
        "pub_conns": conns, "pub_procs": procs,
        "achieved": len(commit) / pub_secs, "late": sum(r["late"] for r in pubs), "published": len(commit),
        "warmup_events": len(commit) - sum(len(v) for v in lat.values()),
        "claims": sum(r["claims"] for r in works), "wakeups": sum(r["wakeups"] for r in works),
        "timeouts": sum(r["timeouts"] for r in works), "drain_s": drain_s,
    }


S8_LOG = "default"  # the install's default subscription, on the log


def _s8_rec(ctx, system, prm, rep, r):
    for ph in S8_PHASES:
        xs = r["lat"][ph]
        pp = dict(prm, phase=ph)
        ctx.rec("s8_held_xid", system, pp, rep, "events", len(xs), "events")
        ctx.rec("s8_held_xid", system, pp, rep, "published_per_s", len(xs) / r["secs"][ph], "ev/s")
        for q in (50, 99):
            ctx.rec("s8_held_xid", system, pp, rep, f"wake_p{q}", pct(xs, q), "ms")
        ctx.rec("s8_held_xid", system, pp, rep, "wake_max", max(xs) if xs else None, "ms")
        st = r["stats"][ph]
        _rec_log_dead(ctx, "s8_held_xid", system, pp, rep, st, "_at_end")
        ctx.rec("s8_held_xid", system, pp, rep, "log_exceptions_rows_at_end", st["outbox.log_exceptions"][1], "rows")
        ctx.rec("s8_held_xid", system, pp, rep, "log_batches_rows_at_end", st["outbox.log_batches"][1], "rows")
        av = [st[t][2] for t in ("outbox.log_lanes", "outbox.log_batches")]
        ctx.rec("s8_held_xid", system, pp, rep, "autovacuum_count_at_end",
                sum(av) if None not in av else None, "runs")
    ctx.rec("s8_held_xid", system, prm, rep, "achieved_rate", r["achieved"], "ev/s")
    ctx.rec("s8_held_xid", system, prm, rep, "publisher_late", r["late"], "events")
    ctx.rec("s8_held_xid", system, prm, rep, "claims", r["claims"], "claims")
    ctx.rec("s8_held_xid", system, prm, rep, "poll_timeouts", r["timeouts"], "waits")
    dead = lambda st: "/".join(str(st[t][0]) for t in S.LOG_HOT[:3]) + "/" + str(  # noqa: E731
        sum(st[t][0] or 0 for t in S.LOG_RING))
    dead_txt = "n_dead_tup lanes/batches/exceptions/ring at the end"
    ctx.say(f"  s8 {system} rep={rep}: achieved {r['achieved']:.0f}/s (late {r['late']}), holder xid {r['xid']} "
            f"({r['holder_state'][0]}); wake p50/p99/max ms, {dead_txt}: " + "; ".join(
                f"{ph} {_fmt(pct(r['lat'][ph], 50), 1)}/{_fmt(pct(r['lat'][ph], 99), 1)}/"
                f"{_fmt(max(r['lat'][ph]) if r['lat'][ph] else None, 1)} dead {dead(r['stats'][ph])}"
                for ph in S8_PHASES) + f"; {r['claims']} claims, drained {r['drain_s']:.1f}s after the end")


def _s8_medians(ctx, system, prm, keys):
    m = {ph: {k: ctx.med("s8_held_xid", system, dict(prm, phase=ph), k) for k in keys} for ph in S8_PHASES}
    for ph in S8_PHASES:  # max over every run, not a median
        vals = [v for v in ctx.values("s8_held_xid", system, dict(prm, phase=ph), "wake_max") if v is not None]
        m[ph]["wake_max"] = max(vals) if vals else None
    return m


def _s8_runs_md(runs):
    md = "| run | publishers achieved (ev/s) | late publishes | holder xid | holder state at the end of held | " \
         "claims (all workers) | poll timeouts | drained after the publishers stopped (s) |\n" \
         "|---|---|---|---|---|---|---|---|\n"
    for i, r in enumerate(runs):
        md += (f"| {i} | {_fmt(r['achieved'])} | {r['late']} | {r['xid']} | {r['holder_state'][0]} "
               f"(backend_xid {r['holder_state'][1]}) | {_fmt(r['claims'])} | {_fmt(r['timeouts'])} | "
               f"{r['drain_s']:.1f} |\n")
    return md


def _s8_timeline_md(p, runs, what="the run"):
    nrep = len(runs)
    mid = sorted(runs, key=lambda r: pct(r["lat"]["held"], 99) or 0)[len(runs) // 2]
    md = (f"\nTimeline of {what if nrep == 1 else what + ' with the median held p99'}: wake-up latency by "
          f"publish time, each phase in windows of {p['s8_window']} s from its start (the last window of a phase "
          "may be shorter); time in seconds from the end of the warm-up (the holder held its transaction id "
          f"from {mid['held_from']:.1f} s to {mid['held_to']:.1f} s).\n\n"
          "| from (s) | phase | events | p50 (ms) | p99 (ms) | max (ms) |\n|---|---|---|---|---|---|\n")
    for ph, start, n, p50, p99, mx in mid["timeline"]:
        md += f"| {start:.1f} | {ph} | {n} | {_fmt(p50, 1)} | {_fmt(p99, 1)} | {_fmt(mx, 1)} |\n"
    return md


def _s8_short_md(p, m):
    short = [ph for ph in S8_PHASES if (m[ph]["published_per_s"] or 0) < 0.95 * p["s8_rate"]]
    if not short:
        return ""
    return (f"\n**The publishers fell behind {p['s8_rate']:,} events/s in the {', '.join(short)} phase"
            f"{'s' if len(short) > 1 else ''}**: the machine did not sustain the load. Latency counts from "
            "the commit, so the time a late publish waited for its turn is not in it.\n")


def s8_held_xid(ctx):  # noqa: C901
    p = ctx.p
    prm = {"rate": p["s8_rate"], "workers": p["s8_workers"]}
    runs = []
    for rep in range(p["s8_reps"]):
        r = _s8_once(ctx)
        runs.append(r)
        _s8_rec(ctx, S8_LOG, prm, rep, r)
    lm = _s8_medians(ctx, S8_LOG, prm, ("events", "published_per_s", "wake_p50", "wake_p99",
                                        "log_exceptions_rows_at_end", "log_batches_rows_at_end",
                                        "autovacuum_count_at_end"))
    r_held = _ratio(lm["held"]["wake_p99"], lm["clean"]["wake_p99"])
    r_after = _ratio(lm["after"]["wake_p99"], lm["clean"]["wake_p99"])
    nrep = p["s8_reps"]
    conns = runs[0]["pub_conns"]
    md = (f"Publishers commit one event per autocommit statement at a steady {p['s8_rate']:,} events/s in total "
          f"(`outbox.notify = background`; {conns} connections in {runs[0]['pub_procs']} processes; a publisher "
          "that falls behind its schedule publishes back to back until it has caught up) while "
          f"{p['s8_workers']} workers `LISTEN outbox`, claim up to {p['s8_batch']} events from the install's "
          "`default` subscription, ack them, and wait for a notification "
          f"(poll fallback {p['s8_poll']} s) whenever a claim returns less than a full batch. The run starts "
          "from an empty log (every named subscription dropped, the log emptied). After a "
          f"{p['s8_warmup']} s warm-up (not counted), three phases: **clean** ({p['s8_clean']} s; the baseline), "
          f"**held** ({p['s8_held']} s: another session runs `BEGIN; SELECT txid_current();` and then idles in its "
          f"transaction, holding a transaction id, until it commits) and **after** ({p['s8_after']} s after the "
          "holder's COMMIT returned). Latency = from the publisher's commit returning to a worker's claim returning "
          "the event, on one system-wide monotonic clock (a claim can return an event before its publisher has "
          "processed its COMMIT's reply, so figures near or below zero are possible on a loaded machine); each "
          "event counts in the phase its publish committed in (an event published late in the held phase and "
          "claimed after the commit counts as held). `n_dead_tup` of the log's hot relations from "
          "`pg_stat_user_tables` at the end of each phase (backends flush their statistics at most once a "
          "second, so they may lag by that; log_0..3: the ring's four tables together, append-only); rows = "
          "`n_live_tup` of `log_batches` (batches in flight) and `log_exceptions` (events that left their "
          "batch); autovacuum runs of `log_lanes` and `log_batches` together. "
          + ("One run of the whole sequence (`--set s8_reps=N` for more)" if nrep == 1 else
             f"Medians over {nrep} runs of each percentile; max over all runs") + ". "
          "Targets: held p99 / clean p99 <= 2x and after p99 / clean p99 <= 2x.\n\n"
          f"| phase | events | published (ev/s) | wake-up p50 (ms) | p99 (ms) | max (ms) | p99 / clean p99 | "
          f"{LOG_DEAD_HEAD} | log_batches rows | log_exceptions rows | autovacuum runs (cumulative) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    for ph in S8_PHASES:
        x = lm[ph]
        md += (f"| {ph} | {_fmt(x['events'])} | {_fmt(x['published_per_s'])} | {_fmt(x['wake_p50'], 1)} | "
               f"{_fmt(x['wake_p99'], 1)} | {_fmt(x['wake_max'], 1)} | "
               f"{_fmt(_ratio(x['wake_p99'], lm['clean']['wake_p99']), 2)}x | "
               f"{_log_dead_cells(ctx, 's8_held_xid', S8_LOG, dict(prm, phase=ph), '_at_end')} | "
               f"{_fmt(x['log_batches_rows_at_end'])} | {_fmt(x['log_exceptions_rows_at_end'])} | "
               f"{_fmt(x['autovacuum_count_at_end'])} |\n")
    md += _s8_short_md(p, lm)
    md += (f"\nheld p99 / clean p99 = **{_fmt(r_held, 2)}x**, after p99 / clean p99 = **{_fmt(r_after, 2)}x** "
           "(target <= 2x for both)\n\n")
    md += _s8_runs_md(runs)
    md += _s8_timeline_md(p, runs)
    md += ("\n**holding session**\n\n" + _code(S.HOLD_XID) + "**publish**\n\n" + _code(S.E2E_PUBLISH["outbox"])
           + "Workers: `LISTEN outbox`, then the claim and ack statements of scenario 3.\n")
    ctx.section("8. Held transaction id", md)
    ctx.target("8a", "default: publish-to-claim p99 while a session idles holding a transaction id / clean p99",
               r_held, "<=", 2.0)
    ctx.target("8b", "default: publish-to-claim p99 after the holder committed / clean p99", r_after, "<=", 2.0)


# ---------------------------------------------------------------------------
# 9. Payload output: what reading a payload costs by its column type
# ---------------------------------------------------------------------------
def _s9_read(conn, stmt, n, batch):
    """Read every payload of a table in keyset batches (one round trip each).
    Returns microseconds per event."""
    after = 0
    t0 = time.monotonic_ns()
    while True:
        rows = conn.execute(stmt, {"after": after}).fetchall()
        after += len(rows)  # ids are 1..n without gaps
        if len(rows) < batch:
            break
    el = time.monotonic_ns() - t0
    if after != n:
        raise HarnessError(f"s9: read {after} of {n} payloads ({stmt})")
    return el / 1e3 / n


def _s9_convert(conn, stmt, n):
    """The server-side conversion alone: one statement, one number back."""
    t0 = time.monotonic_ns()
    total = conn.execute(stmt).fetchone()[0]
    return (time.monotonic_ns() - t0) / 1e3 / n, total


def s9_payload(ctx):  # noqa: C901
    p = ctx.p
    n, batch = p["s9_n"], p["s9_batch"]
    prm = {"n": n, "batch": batch}
    types = S.PAYLOAD_TYPES
    tables = {t: S.PAYLOAD_TABLE.format(type=t) for t in types}
    read = {t: S.PAYLOAD_READ.format(table=tables[t], batch=batch) for t in types}
    convert = {t: S.PAYLOAD_CONVERT.format(table=tables[t]) for t in types}
    size = {}
    conn = None
    try:
        for t in types:
            ctx.sql(f"DROP TABLE IF EXISTS {tables[t]}")
            ctx.sql(S.PAYLOAD_SCHEMA.format(table=tables[t], type=t))
            ctx.sql(S.PAYLOAD_LOAD.format(table=tables[t], type=t), {"payload": S.PAYLOAD, "first": 1, "last": n})
            # all-visible and hinted: the reads write nothing
            ctx.sql(f"VACUUM ANALYZE {tables[t]}")
            size[t], rows = ctx.sql(S.PAYLOAD_BYTES.format(table=tables[t])).fetchone()
            if rows != n:
                raise HarnessError(f"s9: {tables[t]} holds {rows} rows, expected {n}")
        ctx.checkpoint()
        # One client as a worker's (agents.connect: autocommit, every statement
        # prepared, results in text format, payloads kept as strings on the client).
        conn = agents.connect(ctx.cluster.dsn())
        sums = {}
        for t in types:  # untimed: prepares the statements, warms shared buffers
            _s9_read(conn, read[t], n, batch)
            sums[t] = _s9_convert(conn, convert[t], n)[1]
        if len(set(sums.values())) != 1:
            raise HarnessError(f"s9: the payloads' text forms differ between the types: {sums}")
        for rep in range(p["reps"]):
            # Types interleaved within a repetition: drift hits all alike.
            for t in types:
                ctx.rec("s9_payload", t, prm, rep, "read_us_per_event", _s9_read(conn, read[t], n, batch), "us")
            for t in types:
                ctx.rec("s9_payload", t, prm, rep, "convert_us_per_event", _s9_convert(conn, convert[t], n)[0], "us")
            ctx.say(f"  s9 rep={rep}: µs/event read " + ", ".join(
                f"{t}={ctx.values('s9_payload', t, prm, 'read_us_per_event')[-1]:.2f}" for t in types)
                + "; server-side ::text " + ", ".join(
                f"{t}={ctx.values('s9_payload', t, prm, 'convert_us_per_event')[-1]:.2f}" for t in types))
    finally:
        if conn is not None:
            conn.close()
        for t in types:
            ctx.sql(f"DROP TABLE IF EXISTS {tables[t]}")

    m = {t: {k: ctx.med("s9_payload", t, prm, k) for k in ("read_us_per_event", "convert_us_per_event")}
         for t in types}
    for t in types:
        ctx.rec("s9_payload", t, prm, "all", "bytes_per_payload", size[t], "bytes")
    rd = {t: m[t]["read_us_per_event"] for t in types}
    cv = {t: m[t]["convert_us_per_event"] for t in types}
    md = (f"{n:,} events, each the payload of the drain scenarios, in three scratch tables (`id bigint PRIMARY KEY`, "
          "`payload` of type jsonb, json and text; created, `VACUUM ANALYZE`d and dropped by the scenario). The json "
          "and text columns hold jsonb's text form of the payload, what a log storing text would keep of publish's "
          f"`jsonb` argument, so every type sends the same {size['jsonb']:.0f} bytes per payload. **Read**: one "
          "client (psycopg, autocommit, the statement prepared, results in text format, payloads kept as strings "
          f"on the client) reads every payload in keyset batches of {batch}, one round trip each, until a batch "
          f"comes back short; µs per event = elapsed / {n:,}. **Server-side** `::text` alone: one statement "
          "converts every payload to text and returns one number; µs per event = its round trip / "
          f"{n:,}. Each table is read once untimed first (shared buffers warm, statements prepared); types "
          f"interleaved within a repetition; median of {p['reps']} runs. No target: this is the evidence for the "
          "payload decision of the log (docs/design/subscriptions.md, Prototype and Slices).\n\n")
    md += ("| type | bytes per payload | read (µs/event) | / jsonb | runs | server-side `::text` (µs/event) | / jsonb "
           "| runs |\n|---|---|---|---|---|---|---|---|\n")
    for t in types:
        rv = ctx.values("s9_payload", t, prm, "read_us_per_event")
        cvv = ctx.values("s9_payload", t, prm, "convert_us_per_event")
        md += (f"| {t} | {size[t]:.0f} | {_fmt(rd[t], 2)} | {_fmt(_ratio(rd[t], rd['jsonb']), 2)}x | "
               f"{', '.join(_fmt(v, 2) for v in rv)} | {_fmt(cv[t], 2)} | {_fmt(_ratio(cv[t], cv['jsonb']), 2)}x | "
               f"{', '.join(_fmt(v, 2) for v in cvv)} |\n")
    md += (f"\nRead over the wire: json / jsonb = **{_fmt(_ratio(rd['json'], rd['jsonb']), 2)}x**, text / jsonb = "
           f"**{_fmt(_ratio(rd['text'], rd['jsonb']), 2)}x**; jsonb costs "
           f"{_fmt(_diff(rd['jsonb'], rd['text']), 2)} µs "
           "per event more than text. Server-side conversion alone: json / jsonb = "
           f"**{_fmt(_ratio(cv['json'], cv['jsonb']), 2)}x**, text / jsonb = **{_fmt(_ratio(cv['text'], cv['jsonb']), 2)}x** "
           f"(jsonb {_fmt(_diff(cv['jsonb'], cv['text']), 2)} µs per event more than text"
           "). Informational, not a target.\n\n"
           "Context (the design's prototype, not this run): `sum(length(payload::text))` over 20,000 payloads "
           "took about 5.7 µs per payload from jsonb and 1.5 µs from text.\n\n")
    per_type = {"table": S.PAYLOAD_TABLE, "type": "{type}", "batch": batch}  # {type}: jsonb, json, text
    md += ("**schema and load** (per `{type}`: " + ", ".join(types) + ")\n\n"
           + _code(S.PAYLOAD_SCHEMA.format(**per_type) + ";\n" + S.PAYLOAD_LOAD.format(**per_type) + ";")
           + "**read** (from `after` = 0, until a batch comes back short)\n\n"
           + _code(S.PAYLOAD_READ.format(**per_type) + ";")
           + "**server-side conversion**\n\n" + _code(S.PAYLOAD_CONVERT.format(**per_type) + ";"))
    ctx.section("9. Payload output", md)


# ---------------------------------------------------------------------------
# 10. Drain the log through named subscriptions (0.9.0: create_subscription,
#     claim(..., subscription => name), ack) against PgQ, plain SKIP LOCKED
#     and today's outbox.claim; with 1,000 subjects; fan-out over 10 subscriptions
# ---------------------------------------------------------------------------
S10 = "s10_log_drain"


def _log_reset(ctx):
    """Drop every named subscription, then empty the log ring, its state, the
    lanes, batches and exception rows."""
    _drop_subscriptions(ctx)
    ctx.sql(S.LOG_DRAIN_RESET)


def _log_load(ctx, readers, n, subjects=0):
    """Start from an empty log without subscriptions, create the subscriptions
    `readers` (cursors taken now: the backlog published next is theirs), then
    publish n events. Returns their ids in publish order (with subjects, the
    event at position g has subject 'acct:<g % subjects>')."""
    _log_reset(ctx)
    _create_subscriptions(ctx, readers)
    have = _named_subscriptions(ctx)
    if have != sorted(readers):
        raise HarnessError(f"log drain: subscriptions {have} after creating {sorted(readers)}")
    conn = agents.connect(ctx.cluster.dsn())
    ids = []
    try:
        while len(ids) < n:
            k = min(10000, n - len(ids))
            prm = {"topic": "bench.drain", "payload": S.PAYLOAD, "n": k, "first": len(ids), "subjects": subjects}
            got = conn.execute(S.LOG_LOAD_SUBJECTS if subjects else S.LOG_LOAD, prm).fetchone()[0]
            if not got or len(got) != k:
                raise HarnessError(f"log drain: publish_batch of {k} events returned {len(got or [])} ids")
            ids.extend(got)
    finally:
        conn.close()
    logged = ctx.one(S.LOG_ROWS)
    if logged != n or len(set(ids)) != n:
        raise HarnessError(f"log drain: published {n} events ({len(set(ids))} distinct ids), "
                           f"the log ring holds {logged} rows")
    ctx.sql(S.LOG_VACUUM)
    ctx.checkpoint()
    return ids


def _check_subject_order(reader, results, ids, subjects):
    """No claim hands out two events of one subject, and each event of a subject
    is claimed only after the ack of the subject's previous event was sent (its
    claim returned later than that ack left the worker, on one system-wide
    monotonic clock: a sound test, if a weaker one than "after the ack
    committed")."""
    subj = {i: pos % subjects for pos, i in enumerate(ids)}
    when = {}
    for x in results:
        for t_claim, t_ack, claimed in x["log"]:
            ss = [subj[i] for i in claimed]
            if len(set(ss)) != len(ss):
                raise HarnessError(f"subscription {reader}: a claim returned two events of one subject")
            for i in claimed:
                when[i] = (t_claim, t_ack)
    prev = {}
    for i in ids:  # publish order: each subject's commit order
        s = subj[i]
        if s in prev and when[i][0] <= when[prev[s]][1]:
            raise HarnessError(f"subscription {reader}: event {i} of subject acct:{s} was claimed before the ack "
                               f"of its predecessor {prev[s]} was sent")
        prev[s] = i


def _log_drain(ctx, readers, workers, batch, n, subjects=0):
    """Load n events for the subscriptions `readers`, then drain every one with
    `workers` workers of its own, all at once. Every subscription must ack each
    published event exactly once, and each ack must report every event it was
    sent as acked. Returns (events/s summed over the subscriptions, statement
    counts, per-subscription rates and what the drain left in the log's tables)."""
    ids = _log_load(ctx, readers, n, subjects)
    dsn = ctx.cluster.dsn()
    counters = {r: ctx.mp.Value("q", 0) for r in readers}
    specs = [("log_drain_worker", dict(dsn=dsn, reader=r, wid=w, batch=batch, total=n, counter=counters[r],
                                       deadline_s=ctx.p["drain_deadline"]))
             for r in readers for w in range(workers)]
    g = ctx.agents(specs)
    g.start()
    res = g.collect(len(specs), ctx.p["drain_deadline"] + 30)
    g.join()
    want = set(ids)
    rates = []
    for r in readers:
        mine = [x for x in res if x["reader"] == r]
        got = [i for x in mine for _, _, claimed in x["log"] for i in claimed]
        acked = sum(x["acked"] for x in mine)
        seen = set(got)
        if len(got) != n or seen != want or acked != n:
            raise HarnessError(
                f"subscription {r}: {n} events published, {len(got)} acked ({len(got) - len(seen)} more than once, "
                f"{len(want - seen)} never, {len(seen - want)} not published); outbox.ack returned {acked} in all")
        if subjects:
            _check_subject_order(r, mine, ids, subjects)
        rates.append(n / ((max(x["t1"] for x in mine) - min(x["t0"] for x in mine)) / ns))
    secs = (max(x["t1"] for x in res) - min(x["t0"] for x in res)) / ns
    claims = sum(x["claims"] for x in res)
    empty = sum(x["empty"] for x in res)
    batches_left, exceptions_left = ctx.sql(S.LOG_LEFT).fetchone()
    info = {"claims": claims, "acks": claims - empty, "empty": empty, "reader_rates": rates,
            "batches_left": batches_left, "exceptions_left": exceptions_left}
    return len(readers) * n / secs, info


def _s10_rec(ctx, system, prm, rep, eps, n, batch, round_trips, claims_served):
    """events/s, round trips per batch (statements sent / (n / batch)) and
    events per non-empty claim (PgQ: per batch)."""
    ctx.rec(S10, system, prm, rep, "events_per_s", eps, "ev/s")
    ctx.rec(S10, system, prm, rep, "round_trips_per_batch", round_trips * batch / n, "round trips")
    ctx.rec(S10, system, prm, rep, "events_per_claim", n / claims_served if claims_served else None, "events")


def _s10_cells(p):
    log = [tuple(c) for c in p["s10_log_cells"]]
    subj = [tuple(c) for c in (p["s10_subject_cells"] or log)]
    batches = sorted({b for _, b in log} | {b for _, b in p["s10_outbox_cells"]} | set(p["s10_pgq_batches"])
                     | ({p["s10_plain_batch"]} if p["s10_plain_workers"] else set()))
    return log, [tuple(c) for c in p["s10_outbox_cells"]], subj, batches


def _s10_workers(counts, chosen):
    """'2 workers, the best of 1/2/4' or '1 worker' (one count measured)."""
    txt = f"{chosen} worker{'s' if chosen != 1 else ''}"
    return txt + (f", the best of {'/'.join(str(w) for w in sorted(counts))}" if len(counts) > 1 else "")


def s10_log_drain(ctx):  # noqa: C901
    p = ctx.p
    n = p["s10_n"]
    reps = p["s10_reps"] or p["reps"]
    if not ctx.one(S.HAS_SUBSCRIPTIONS):
        ctx.say("  s10: this build has no outbox.create_subscription / drop_subscription (named subscriptions "
                "came with 0.9.0): left out")
        ctx.section("10. Drain the log", "Left out: this build has no named subscriptions "
                    "(`outbox.create_subscription`, `outbox.drop_subscription`; they came with 0.9.0).\n")
        return
    log_cells, outbox_cells, subj_cells, batches = _s10_cells(p)
    fb = p["s10_fanout_batch"]
    fn = p["s10_fanout_n"] or n
    # The fan-out's "one reader alone" is the log cell of 1 worker at the fan-out's
    # batch size when that cell drains the same backlog; otherwise it runs apart.
    alone_in_log = fn == n and (1, fb) in log_cells
    reader = S.LOG_READER
    try:
        _s10_runs(ctx, n, reps, log_cells, outbox_cells, subj_cells, batches, alone_in_log, reader)
    finally:
        _drop_subscriptions(ctx, quiet=True)  # the scenarios after this one start without any
    _s10_report(ctx, n, reps, log_cells, outbox_cells, subj_cells, batches, alone_in_log)


def _s10_left(ctx, system, prm, rep, info):
    """What a log drain left in outbox.log_batches and outbox.log_exceptions."""
    ctx.rec(S10, system, prm, rep, "batches_left", info["batches_left"], "rows")
    ctx.rec(S10, system, prm, rep, "exceptions_left", info["exceptions_left"], "rows")


def _s10_runs(ctx, n, reps, log_cells, outbox_cells, subj_cells, batches, alone_in_log, reader):  # noqa: C901
    p = ctx.p
    k = p["s10_subjects"]
    pb, plain_workers = p["s10_plain_batch"], p["s10_plain_workers"]
    fan, fb = p["s10_fanout"], p["s10_fanout_batch"]
    fn = p["s10_fanout_n"] or n
    for rep in range(reps):
        line = []
        # Systems interleaved within a repetition (drift hits all alike): at each
        # batch size, worker count by worker count, then PgQ, then the subjects,
        # then the fan-out.
        for b in batches:
            for w in sorted({w for w, bb in log_cells + outbox_cells if bb == b}
                            | (set(plain_workers) if b == pb else set())):
                prm = {"workers": w, "batch": b}
                if (w, b) in log_cells:
                    eps, info = _log_drain(ctx, [reader], w, b, n)
                    _s10_rec(ctx, "log", prm, rep, eps, n, b, info["claims"] + info["acks"], info["acks"])
                    _s10_left(ctx, "log", prm, rep, info)
                    line.append(f"log {w}w b{b}={eps:.0f}")
                if (w, b) in outbox_cells:
                    # no subscriptions, an empty log (every publish of the load appends to it)
                    _log_reset(ctx)
                    info = {}
                    eps, _ = _drain_once(ctx, "outbox_text", w, b, n, info=info)
                    _s10_rec(ctx, "outbox_claim", prm, rep, eps, n, b, info["claims"] + info["acks"], info["acks"])
                    line.append(f"outbox.claim {w}w b{b}={eps:.0f}")
                if b == pb and w in plain_workers:
                    info = {}
                    eps, _ = _drain_once(ctx, "plain", w, b, n, info=info)
                    _s10_rec(ctx, "plain", prm, rep, eps, n, b, info["claims"] + info["acks"], info["acks"])
                    line.append(f"plain {w}w b{b}={eps:.0f}")
            if b in p["s10_pgq_batches"]:
                info = {}
                eps = _drain_pgq(ctx, b, n, info=info)
                # next_batch, get_batch_events, finish_batch per batch; one more
                # next_batch finds no batch left
                _s10_rec(ctx, "pgq", {"workers": 1, "batch": b}, rep, eps, n, b, 3 * info["batches"] + 1,
                         info["batches"])
                line.append(f"pgq b{b}={eps:.0f}")
        for w, b in subj_cells:
            prm = {"workers": w, "batch": b}
            eps, info = _log_drain(ctx, [reader], w, b, n, subjects=k)
            _s10_rec(ctx, "log_subjects", prm, rep, eps, n, b, info["claims"] + info["acks"], info["acks"])
            _s10_left(ctx, "log_subjects", prm, rep, info)
            line.append(f"log {k} subjects {w}w b{b}={eps:.0f}")
        if fan:
            if not alone_in_log:
                eps, info = _log_drain(ctx, [reader], 1, fb, fn)
                _s10_rec(ctx, "log_alone", {"workers": 1, "batch": fb}, rep, eps, fn, fb,
                         info["claims"] + info["acks"], info["acks"])
                _s10_left(ctx, "log_alone", {"workers": 1, "batch": fb}, rep, info)
                line.append(f"log alone 1w b{fb} ({fn} events)={eps:.0f}")
            fprm = {"readers": fan, "workers": 1, "batch": fb}
            eps, info = _log_drain(ctx, [f"f{i}" for i in range(fan)], 1, fb, fn)
            _s10_rec(ctx, "log_fanout", fprm, rep, eps, fn * fan, fb, info["claims"] + info["acks"], info["acks"])
            ctx.rec(S10, "log_fanout", fprm, rep, "reader_eps_min", min(info["reader_rates"]), "ev/s")
            ctx.rec(S10, "log_fanout", fprm, rep, "reader_eps_max", max(info["reader_rates"]), "ev/s")
            _s10_left(ctx, "log_fanout", fprm, rep, info)
            line.append(f"fan-out {fan} subscriptions b{fb}={eps:.0f} in all")
        ctx.say(f"  s10 rep={rep}: " + ", ".join(line))


def _s10_report(ctx, n, reps, log_cells, outbox_cells, subj_cells, batches, alone_in_log):  # noqa: C901
    p = ctx.p
    k = p["s10_subjects"]
    pb, plain_workers = p["s10_plain_batch"], p["s10_plain_workers"]
    fan, fb = p["s10_fanout"], p["s10_fanout_batch"]
    fn = p["s10_fanout_n"] or n

    def prm(w, b):
        return {"workers": w, "batch": b}

    def med(system, w, b, metric="events_per_s"):
        return ctx.med(S10, system, prm(w, b), metric)

    def vals(system, w, b, metric="events_per_s"):
        return [v for v in ctx.values(S10, system, prm(w, b), metric) if v is not None]

    def best(system, cells, b):
        """(events/s, workers) of the system's best worker count at batch b, by median."""
        got = [(med(system, w, bb), w) for w, bb in cells if bb == b and med(system, w, bb) is not None]
        return max(got) if got else (None, None)

    def per_rep(a, b):
        """The range of per-repetition ratios of two series measured in the same repetitions."""
        rs = [x / y for x, y in zip(a, b) if x is not None and y]
        if len(rs) < 2:
            return "one run" if rs else "n/a"
        return f"{min(rs):.2f}–{max(rs):.2f}x"

    def spread(xs):
        return f"{_fmt(min(xs))}–{_fmt(max(xs))}" if xs else "n/a"

    unstable = []

    def note_unstable(label, xs):
        if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) > 1.5:
            unstable.append(f"{label} ({spread(xs)} events/s)")

    pgq = {b: med("pgq", 1, b) for b in p["s10_pgq_batches"]}
    plain_best, plain_w = best("plain", [(w, pb) for w in plain_workers], pb)
    rt_pgq = {b: med("pgq", 1, b, "round_trips_per_batch") for b in p["s10_pgq_batches"]}

    md = (f"The log drained through a named subscription (0.9.0's public API: `outbox.create_subscription`, "
          f"`outbox.claim(..., subscription => '{S.LOG_READER}')`, `outbox.ack`; the subscription reads the log with "
          "16 lanes), against PgQ (one consumer), the plain SKIP LOCKED table and `outbox.claim` of the install's "
          f"`default` subscription (also the log), in one run: a backlog of {n:,} events (the "
          "payload of scenario 3), "
          + (f"every system and cell interleaved within each of {reps} repetitions; figures are medians, with the "
             "min–max of the runs. " if reps > 1 else
             "one repetition of every system and cell (a quick run: single runs, not medians). ")
          + "Events/s "
          "from the first claim to the last ack (PgQ: the first `next_batch` to the last `finish_batch`).\n\n"
          "- **log**: before each drain every named subscription is dropped (`drop_subscription(name, force => "
          "true)`), then `TRUNCATE` of the log ring, `outbox.log_state`, `outbox.log_lanes`, `outbox.log_batches`, "
          "`outbox.log_exceptions`; the subscription is created (`create_subscription`: "
          "its cursor taken now, so the backlog published next is in its view); then the backlog is published "
          "with `publish_batch` in transactions of 10,000 events (each event is written to the log once); then `VACUUM ANALYZE` of the ring tables and `outbox.log_lanes`, and a "
          "`CHECKPOINT`. Each worker claims with `outbox.claim(worker, batch, '30 seconds', subscription => ...)`, "
          "then acks the whole claim in one batch `outbox.ack(ids, tokens)` call, each event with its own lease "
          "token (fenced per event): two autocommit round trips per batch.\n"
          "- **outbox.claim**: scenario 3's outbox drain (no named subscription, the log emptied first, the "
          "backlog loaded, `VACUUM ANALYZE`d, checkpointed), its claim selecting `payload::text`.\n"
          f"- **plain**: scenario 3's plain SKIP LOCKED drain, at batch {pb}.\n"
          "- **pgq**: scenario 3's PgQ drain with one consumer: the batch size is set by the ticks (a tick after "
          "every `batch` events while loading, `ticker_max_count = batch`); a batch holds the events between two "
          "ticks, so its size is what the ticks made (the events per claim column).\n\n"
          "**Payloads are fetched as text by every client**: the log and `outbox.claim` drains select "
          "`payload::text`, PgQ's `ev_data` is text, and plain's `jsonb` column is sent in text format and kept "
          "as a string (every client keeps jsonb/json/uuid values as strings), so no client parses JSON.\n\n"
          "**Every drain is checked** (a failure is a harness error): log: the ids acked by all workers of a "
          "subscription are exactly the published ids, each once, and each `outbox.ack` returned the number of "
          "events it was sent; with subjects also no claim with two events of one subject, and each event of a "
          "subject claimed only after its predecessor's ack was sent. outbox.claim: every event acked, "
          "nothing left for `default`; plain: every event acked, the table empty afterwards; PgQ: every event read.\n\n"
          "**Round trips per batch** = statements the workers sent / (events / batch size): claims (empty ones "
          "included: a worker that finds nothing retries after 1 ms until the backlog is acked) plus acks; "
          "PgQ: `next_batch` + `get_batch_events` + `finish_batch` per batch, plus the last `next_batch` that "
          "finds none. Events per claim: per non-empty claim (PgQ: per batch).\n\n")

    # -- the drains
    md += ("| system | workers | batch | events/s | min–max | / PgQ | / plain b" + str(pb)
           + " (best) | round trips per batch | events per claim |\n|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for b in batches:
        for w, bb in log_cells:
            if bb == b:
                rows.append(("log", w, b))
        for w, bb in outbox_cells:
            if bb == b:
                rows.append(("outbox_claim", w, b))
        if b == pb:
            rows.extend(("plain", w, b) for w in plain_workers)
        if b in pgq:
            rows.append(("pgq", 1, b))
    for system, w, b in rows:
        xs = vals(system, w, b)
        m = med(system, w, b)
        note_unstable(f"{system} {w}w b{b}", xs)
        md += (f"| {system} | {w} | {b} | {_fmt(m)} | {spread(xs)} | {_fmt(_ratio(m, pgq.get(b)), 2)}x | "
               f"{_fmt(_ratio(m, plain_best), 2)}x | {_fmt(med(system, w, b, 'round_trips_per_batch'), 2)} | "
               f"{_fmt(med(system, w, b, 'events_per_claim'), 1)} |\n")
    md += "\n"

    # -- targets: log / PgQ per batch, log / plain at b100
    summary = []
    for b in batches:
        lb, lw = best("log", log_cells, b)
        ob, ow = best("outbox_claim", outbox_cells, b)
        if lb is None or b not in pgq:
            continue
        r = _ratio(lb, pgq[b])
        rt = med("log", lw, b, "round_trips_per_batch")
        summary.append(f"at batch {b}: log at its best ({lw} worker{'s' if lw != 1 else ''}) "
                       f"**{_fmt(r, 2)}x** PgQ (per repetition: {per_rep(vals('log', lw, b), vals('pgq', 1, b))}), "
                       f"{_fmt(rt, 2)} round trips per batch against PgQ's {_fmt(rt_pgq[b], 2)}"
                       + (f"; today's `outbox.claim` at its best ({ow} workers) {_fmt(_ratio(ob, pgq[b]), 2)}x PgQ"
                          if ob is not None else ""))
        ctx.target(f"10 log/pgq b{b}",
                   f"log drain (claim(subscription) + ack, {_s10_workers([w for w, bb in log_cells if bb == b], lw)}; "
                   f"{_fmt(rt, 2)} round trips per batch) / PgQ one consumer ({_fmt(rt_pgq[b], 2)}), "
                   f"batch {b}", r, ">=", 1.0)
    lb, lw = best("log", log_cells, pb)
    r_plain = _ratio(lb, plain_best)
    if lb is not None and plain_best is not None:
        summary.append(f"at batch {pb}: log at its best ({lw} worker{'s' if lw != 1 else ''}) "
                       f"**{_fmt(r_plain, 2)}x** plain SKIP LOCKED at its best ({plain_w} "
                       f"worker{'s' if plain_w != 1 else ''}; per repetition: "
                       f"{per_rep(vals('log', lw, pb), vals('plain', plain_w, pb))})")
        ctx.target(f"10 log/plain b{pb}",
                   f"log drain ({_s10_workers([w for w, bb in log_cells if bb == pb], lw)}) / plain SKIP LOCKED "
                   f"({_s10_workers(plain_workers, plain_w)}), batch {pb}", r_plain, ">=", 1.5)
    md += "".join(f"- {s}\n" for s in summary) + "\n"

    # -- subjects
    md += (f"**With {k:,} subjects**: the same log drain with every event carrying a subject, `acct:0` .. "
           f"`acct:{k - 1}` round robin over the backlog (publish_batch's `subjects` array), against the log "
           "drain without subjects of the same cell and run; the target compares them at the best worker count "
           "of the drain without subjects.\n\n"
           "| workers | batch | no subjects | with subjects | min–max | ratio | per repetition | round trips per "
           "batch | events per claim |\n|---|---|---|---|---|---|---|---|---|\n")
    for w, b in subj_cells:
        xs = vals("log_subjects", w, b)
        m = med("log_subjects", w, b)
        base = med("log", w, b)
        note_unstable(f"log with subjects {w}w b{b}", xs)
        md += (f"| {w} | {b} | {_fmt(base)} | {_fmt(m)} | {spread(xs)} | {_fmt(_ratio(m, base), 2)}x | "
               f"{per_rep(xs, vals('log', w, b))} | {_fmt(med('log_subjects', w, b, 'round_trips_per_batch'), 2)} | "
               f"{_fmt(med('log_subjects', w, b, 'events_per_claim'), 1)} |\n")
    md += "\n"
    for b in sorted({b for _, b in subj_cells}):
        lb, lw = best("log", log_cells, b)
        # at the best worker count of the drain without subjects, else at the
        # subject cell's own (a quick run measures one cell)
        ws = [w for w, bb in subj_cells if bb == b]
        w = lw if lw in ws else ws[0]
        r = _ratio(med("log_subjects", w, b), med("log", w, b))
        ctx.target(f"10 subjects b{b}", f"log drain with {k:,} subjects / without, {w} worker{'s' if w != 1 else ''}"
                   f"{' (the best without subjects)' if w == lw else ''}, batch {b}", r, ">=", 0.9)

    # -- fan-out
    if fan:
        fprm = {"readers": fan, "workers": 1, "batch": fb}
        fx = [v for v in ctx.values(S10, "log_fanout", fprm, "events_per_s") if v is not None]
        f = median(fx)
        alone_sys = "log" if alone_in_log else "log_alone"
        ax = vals(alone_sys, 1, fb)
        a = median(ax)
        note_unstable(f"fan-out {fan} subscriptions", fx)
        r = _ratio(f, a)
        md += (f"**Fan-out**: {fan} named subscriptions (`create_subscription('f0')` .. `('f{fan - 1}')` before "
               f"publishing) each drained by one worker process of its own, all {fan} at once, the same {fn:,} events "
               f"each, batch {fb}; against one subscription drained by one worker alone ("
               + ("the log cell of 1 worker at batch " + str(fb) + " above" if alone_in_log else
                  f"a drain of its own of {fn:,} events") + "). Events/s of the fan-out = "
               f"{fan} x {fn:,} / (last ack - first claim over all subscriptions).\n\n"
               "| | events/s | min–max | round trips per batch | slowest / fastest subscription (events/s, median) |\n"
               "|---|---|---|---|---|\n"
               f"| {fan} subscriptions together | {_fmt(f)} | {spread(fx)} | "
               f"{_fmt(ctx.med(S10, 'log_fanout', fprm, 'round_trips_per_batch'), 2)} | "
               f"{_fmt(ctx.med(S10, 'log_fanout', fprm, 'reader_eps_min'))} / "
               f"{_fmt(ctx.med(S10, 'log_fanout', fprm, 'reader_eps_max'))} |\n"
               f"| one subscription alone | {_fmt(a)} | {spread(ax)} | {_fmt(med(alone_sys, 1, fb, 'round_trips_per_batch'), 2)} "
               "| |\n\n"
               f"{fan} subscriptions together / one alone = **{_fmt(r, 2)}x** (per repetition: {per_rep(fx, ax)}; "
               "target >= 1.0x)\n\n")
        ctx.target(f"10 fan-out b{fb}", f"log fan-out: {fan} subscriptions with one worker each together / one "
                   f"alone, batch {fb}", r, ">=", 1.0)

    def left(metric):
        return [(s, v) for s in ("log", "log_subjects", "log_fanout", "log_alone")
                for r in ctx.rows if r["scenario"] == S10 and r["system"] == s and r["metric"] == metric
                for v in [r["value"]] if v]

    bl, el = left("batches_left"), left("exceptions_left")
    if bl:
        md += (f"After {len(bl)} log drain(s) `outbox.log_batches` still held rows (every batch's events were "
               "acked, and an ack deletes a finished batch): " + ", ".join(f"{s}: {v}" for s, v in bl) + ".\n\n")
    if el:
        md += (f"After {len(el)} log drain(s) `outbox.log_exceptions` held rows (events that left their batch, "
               "e.g. a lease that expired, and were delivered from there): "
               + ", ".join(f"{s}: {v}" for s, v in el) + ".\n\n")
    if unstable:
        md += ("**Unstable between repetitions** (slowest and fastest run more than 1.5x apart): "
               + "; ".join(unstable) + ".\n\n")
    elif reps > 1:
        md += "No cell's runs were more than 1.5x apart.\n\n"

    # -- the statements
    md += ("**log**, before each drain (`name`: the drain's subscription, `bench`, or `f0` .. `f9` for the "
           "fan-out; `first`: the chunk's position in the backlog)\n\n"
           + _code(_subscriptions_reset_sql(S.LOG_DRAIN_RESET) + S.SUBSCRIPTION_CREATE + ";\n" + S.LOG_LOAD
                   + ";\n-- with subjects:\n" + S.LOG_LOAD_SUBJECTS + ";\n" + S.LOG_VACUUM + ";\nCHECKPOINT;")
           + "**log** (per batch: claim, then ack)\n\n" + _code(S.LOG_DRAIN["claim"] + ";\n" + S.LOG_DRAIN["ack"] + ";")
           + "**outbox.claim** (per batch: claim, then ack)\n\n"
           + _code(S.DRAIN["outbox_text"]["claim"] + ";\n" + S.DRAIN["outbox_text"]["ack"] + ";")
           + "**plain** (per batch: claim, then ack)\n\n" + _code(S.DRAIN["plain"]["claim"] + ";\n" + S.DRAIN["plain"]["ack"] + ";")
           + "**pgq** (per batch)\n\n" + _code(";\n".join(S.DRAIN["pgq"].values()) + ";")
           + "Backlog loading of outbox.claim, plain and PgQ (not timed): scenario 3's; before outbox.claim's, "
           "the log reset above (no named subscription, an empty log).\n")
    ctx.section("10. Drain the log", md)


# ---------------------------------------------------------------------------
# 12. Streaming: events at a steady rate, LISTEN + claim workers with a 1 ms
#     handler; server CPU and rows written per event, pickup latency
# ---------------------------------------------------------------------------
S12 = "s12_streaming"
S12_SYSTEMS = [
    # (name, key of E2E_PUBLISH and ROWS_WRITTEN, outbox.notify, the workers' DRAIN)
    ("outbox_background", "outbox", "background", "outbox"),
    ("plain_notify", "plain_notify", None, "plain"),
    ("pgq", "pgq", None, "pgq"),
]


def _proc_stat(pid):
    """/proc/<pid>/stat after the command: [state, ppid, ..., utime (11), stime, cutime, cstime, ...]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _server_cpu(ctx):
    """CPU seconds used so far by the cluster: its postmaster's utime, stime,
    cutime and cstime (children that exited and were reaped) plus utime and
    stime of every live child of the postmaster (backends, background
    workers, autovacuum, ...). Returns (seconds, processes read): each
    process's figures are whole clock ticks."""
    pm = _proc_stat(ctx.admin.info.backend_pid)[1]
    ticks = sum(int(x) for x in _proc_stat(pm)[11:15])
    n = 1
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = _proc_stat(d)
            except OSError:  # exited meanwhile
                continue
            if f[1] == pm:
                ticks += int(f[11]) + int(f[12])
                n += 1
    return ticks / os.sysconf("SC_CLK_TCK"), n


def _s12_rows(ctx, key):
    """(rows written, rows inserted into outbox.log_exceptions) so far in the
    system's own tables, once the statistics were flushed: backends flush
    theirs at most once a second while busy, and when they exit."""
    time.sleep(1.1)
    ctx.sql("SELECT pg_stat_clear_snapshot()")
    return ctx.sql(S.ROWS_WRITTEN[key]).fetchone()


def _s12_once(ctx, name, key, notify, drain):  # noqa: C901
    """One phase: publishers at s12_rate for s12_seconds, s12_workers workers
    (PgQ: one consumer and the harness's ticker), until every published event
    is delivered. Returns the pickup latencies (publish commit returned -> the
    claim returning the event, ms), the server CPU and the rows written over the
    phase."""
    p = ctx.p
    if key == "outbox":
        _fresh_outbox(ctx)
    elif key == "pgq":
        ctx.reset_pgq()
        for q in S.PGQ_STREAM_CONFIG:
            ctx.sql(q)
    else:
        ctx.reset_plain()
    ctx.checkpoint()
    conns = p["s12_pub_conns"]
    procs = 1 if conns <= 2 else 2
    per = [conns // procs + (1 if i < conns % procs else 0) for i in range(procs)]
    counter = ctx.mp.Value("q", 0)
    stop = ctx.mp.Event()
    dsn = ctx.cluster.dsn()
    specs = [("publisher", dict(dsn=dsn, system=key, rate=p["s12_rate"] * per[i] / conns, nconns=per[i],
                                duration_s=p["s12_seconds"], stop_evt=stop, notify=notify, record=True, pid=i))
             for i in range(procs)]
    if key == "pgq":
        nworkers = 1
        specs.append(("pgq_stream_consumer", dict(dsn=dsn, handler_ms=p["s12_handler_ms"], poll_s=p["s12_poll"],
                                                  stop_evt=stop, counter=counter)))
    else:
        nworkers = p["s12_workers"]
        specs += [("e2e_worker", dict(dsn=dsn, system=drain, wid=w, batch=p["s12_batch"], stop_evt=stop,
                                      counter=counter, poll_s=p["s12_poll"], handler_ms=p["s12_handler_ms"],
                                      wait_empty=True, warm=True)) for w in range(nworkers)]
    g = ctx.agents(specs)
    tick_stop = threading.Event()
    ticks = [0]

    def ticker():
        c = agents.connect(dsn)
        while not tick_stop.is_set():
            if c.execute(S.PGQ_TICK).fetchone()[0] is not None:
                ticks[0] += 1
            tick_stop.wait(p["s12_pgq_tick"])
        c.close()

    tt = None
    rows0 = _s12_rows(ctx, key)
    try:
        g.start()
        cpu0, procs0 = _server_cpu(ctx)
        if key == "pgq":
            tt = threading.Thread(target=ticker)
            tt.start()
        pubs = g.collect(procs, p["s12_seconds"] + 60)
        total = sum(r["n"] for r in pubs)
        deadline = time.monotonic() + p["s12_drain_wait"]
        while counter.value < total and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        works = g.collect(nworkers, 30)
        g.join()
    finally:
        stop.set()
        tick_stop.set()
        if tt:
            tt.join()
        g.kill()
    rows1 = _s12_rows(ctx, key)  # the agents' backends have exited (and flushed) by then
    cpu1, procs1 = _server_cpu(ctx)
    commit = {}
    for r in pubs:
        commit.update(dict(r["recs"]))
    claimed = {}
    n_recs = 0
    for r in works:
        for rec in r["recs"]:
            n_recs += 1
            claimed[rec[0]] = min(rec[1], claimed.get(rec[0], rec[1]))
    if len(commit) != total or set(claimed) != set(commit):
        raise HarnessError(f"s12 {name}: published {total}, delivered {len(set(claimed) & set(commit))} of them "
                           f"({len(set(claimed) - set(commit))} unknown ids) {p['s12_drain_wait']} s after the "
                           "publishers stopped")
    if key != "pgq":
        left = ctx.one(S.DEFAULT_LEFT if key == "outbox" else "SELECT count(*) FROM bench_plain")
        if left:
            raise HarnessError(f"s12 {name}: every event was claimed and acked, but {left} are left")
    lat = [(claimed[i] - t) / 1e6 for i, t in commit.items()]
    # Claims that came back empty while an event waited: sent after its
    # commit returned and returned before the claim that got it.
    empty = sorted(e for r in works for e in r.get("empties", []))
    sent = [e[0] for e in empty]
    passed = []
    for i, t in commit.items():
        k = bisect.bisect_right(sent, t)
        passed.append(sum(1 for e in empty[k:bisect.bisect_left(sent, claimed[i], lo=k)] if e[1] < claimed[i]))
    pub_secs = (max(r["t1"] for r in pubs) - min(r["t0"] for r in pubs)) / ns
    return {
        "n": total, "lat": lat, "achieved": total / pub_secs, "late": sum(r["late"] for r in pubs),
        "cpu_us": (cpu1 - cpu0) * 1e6 / total, "cpu_s": cpu1 - cpu0,
        # each process read is truncated to whole ticks, at either end
        "cpu_res_us": (procs0 + procs1) * 1e6 / os.sysconf("SC_CLK_TCK") / total,
        "rows": (rows1[0] - rows0[0]) / total, "own_share": 100.0 * (rows1[1] - rows0[1]) / total,
        "redelivered": n_recs - len(claimed), "claims": sum(r["claims"] for r in works),
        "passed": passed,
        "timeouts": sum(r["timeouts"] for r in works), "ticks": ticks[0],
    }


S12_METRICS = [  # (metric, key of _s12_once's result or a function of it, unit)
    ("achieved_rate", "achieved", "ev/s"), ("delivered", "n", "events"),
    ("cpu_per_event", "cpu_us", "us"), ("cpu_seconds", "cpu_s", "s"), ("cpu_resolution", "cpu_res_us", "us"),
    ("rows_per_event", "rows", "rows"),
    ("pickup_p50", lambda r: pct(r["lat"], 50), "ms"), ("pickup_p99", lambda r: pct(r["lat"], 99), "ms"),
    ("pickup_max", lambda r: max(r["lat"]), "ms"),
    ("claims", "claims", "claims"), ("poll_timeouts", "timeouts", "waits"), ("redelivered", "redelivered", "events"),
    ("passed_over_share", lambda r: 100.0 * sum(1 for x in r["passed"] if x) / max(1, len(r["passed"])), "%"),
    ("passed_over_p90", lambda r: pct(r["passed"], 90), "claims"),
    ("publisher_late", "late", "events"),
]


def s12_streaming(ctx):  # noqa: C901
    p = ctx.p
    prm = {"rate": p["s12_rate"], "workers": p["s12_workers"]}
    nrep = p["s12_reps"] or p["reps"]
    for rep in range(nrep):
        for name, key, notify, drain in S12_SYSTEMS:
            r = _s12_once(ctx, name, key, notify, drain)
            for metric, k, unit in S12_METRICS:
                ctx.rec(S12, name, prm, rep, metric, k(r) if callable(k) else r[k], unit)
            if key == "outbox":
                ctx.rec(S12, name, prm, rep, "own_row_share", r["own_share"], "%")
            if key == "pgq":
                ctx.rec(S12, name, prm, rep, "ticks", r["ticks"], "ticks")
            ctx.say(f"  s12 {name} rep={rep}: {r['n']} events at {r['achieved']:.0f}/s (late {r['late']}); server "
                    f"CPU {r['cpu_us']:.0f} us/event ({r['cpu_s']:.1f} s, ± {r['cpu_res_us']:.1f}); rows written "
                    f"{r['rows']:.2f}/event"
                    + (f", {r['own_share']:.2f}% with a log_exceptions row" if key == "outbox" else "")
                    + f"; pickup p50/p99/max {pct(r['lat'], 50):.1f}/{pct(r['lat'], 99):.1f}/{max(r['lat']):.1f} ms; "
                    f"{r['claims']} claims, {r['timeouts']} poll timeouts; events passed over by an empty claim "
                    f"{100.0 * sum(1 for x in r['passed'] if x) / max(1, len(r['passed'])):.0f}%, "
                    f"empty claims per event p90 {pct(r['passed'], 90):.0f}"
                    + (f", {r['ticks']} ticks" if key == "pgq" else ""))
    m = {name: {k: ctx.med(S12, name, prm, k) for k in [x[0] for x in S12_METRICS] + ["own_row_share", "ticks"]}
         for name, *_ in S12_SYSTEMS}
    o, pl = m["outbox_background"], m["plain_notify"]
    r_cpu = _ratio(o["cpu_per_event"], pl["cpu_per_event"])
    r_rows = _ratio(o["rows_per_event"], pl["rows_per_event"])
    r_p99 = _ratio(o["pickup_p99"], pl["pickup_p99"])
    md = (f"Events arrive at a steady {p['s12_rate']:,} events/s for {p['s12_seconds']} s: publishers commit one "
          f"event per autocommit statement ({p['s12_pub_conns']} connections in 2 processes, the paced publisher "
          "of scenarios 4 and 8). Each system runs alone in its own phase, from an empty outbox, table or queue. "
          f"{p['s12_workers']} workers `LISTEN outbox`, claim up to {p['s12_batch']} events, run a handler of "
          f"{p['s12_handler_ms']:g} ms per event (one sleep of that times the events claimed), ack the batch in one "
          "statement and claim again; when a claim returns nothing they wait for a notification or "
          f"{p['s12_poll']:g} s, whichever comes first. The same for every system: **outbox_background** "
          "(`outbox.publish` with `outbox.notify = background`; `outbox.claim` from the install's `default` "
          "subscription and the batch `outbox.ack(ids[], tokens[])`) and **plain_notify** (plain SKIP LOCKED, "
          "`pg_notify` in the publishing transaction). **pgq**: PgQ has no competing consumers, so it runs with "
          "**one consumer** (`next_batch`, `get_batch_events`, the handler, `finish_batch`; when there is no batch "
          f"it waits {p['s12_poll']:g} s: PgQ sends no notification) and the harness as its ticker (pgqd's job; "
          "scenarios 3 and 10 tick from the harness too): a session of its own calls `pgq.ticker('bench_q')` "
          f"every {p['s12_pgq_tick']:g} s, the queue set to tick on every call that finds new events (a batch is "
          "the events between two ticks); no PgQ maintenance runs during the phase. Every published event must be "
          f"delivered (acked; PgQ: in a finished batch) within {p['s12_drain_wait']} s after the publishers stop, "
          "or the scenario fails.\n\n"
          "- **server CPU per event**: `/proc/<postmaster pid>/stat` (utime, stime, cutime, cstime: children that "
          "exited are in the last two) plus utime + stime of every live child of the postmaster, read right after "
          "the agents (connected, before their first statement) are released and again once every event was "
          "delivered, the agents disconnected and 1.1 s passed; the difference (clock ticks, `SC_CLK_TCK`) over "
          "the delivered events. Everything the server did counts: backends, the outbox background worker, "
          "autovacuum, checkpointer, WAL writer (and the ticker's session for PgQ); the clients' own CPU does "
          "not. Each process's figures are whole ticks: ± is (processes read at both ends) x one tick over the "
          "events, the most the rounding can move the figure.\n"
          "- **rows written per event**: `n_tup_ins + n_tup_upd + n_tup_del` summed over `pg_stat_user_tables` "
          "of the system's own tables (outbox: every table in schema `outbox`; plain: `bench_plain`; PgQ: every "
          "table in schema `pgq`, its event tables and ticks included), before the agents start and after they "
          "disconnected (backends flush their statistics when they exit; 1.1 s of sleep and "
          "`pg_stat_clear_snapshot()` before each read; PG 15's `pg_stat_force_next_flush()` flushes only the "
          "calling backend's), over the delivered events. **with a row of its own**: outbox only, rows inserted "
          "into `outbox.log_exceptions` over the delivered events.\n"
          "- **pickup latency**: from the publisher's commit returning to the claim (PgQ: `get_batch_events`) "
          "returning the event, on one system-wide monotonic clock, as in scenario 8.\n\n"
          + ("One run of each system (`--set s12_reps=N` for medians of N)" if nrep == 1 else
             f"Medians over {nrep} runs") + ".\n\n"
          "| system | consumers | published (ev/s) | delivered | server CPU (µs/event) | ± | rows written/event | "
          "with a row of its own | pickup p50 (ms) | p99 (ms) | max (ms) | claims | poll timeouts | redelivered |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    for name, key, *_ in S12_SYSTEMS:
        x = m[name]
        md += (f"| {name} | {1 if key == 'pgq' else p['s12_workers']} | {_fmt(x['achieved_rate'])} | "
               f"{_fmt(x['delivered'])} | {_fmt(x['cpu_per_event'])} | {_fmt(x['cpu_resolution'], 1)} | "
               f"{_fmt(x['rows_per_event'], 2)} | "
               + (f"{_fmt(x['own_row_share'], 2)}%" if key == "outbox" else "") + " | "
               f"{_fmt(x['pickup_p50'], 1)} | {_fmt(x['pickup_p99'], 1)} | {_fmt(x['pickup_max'], 1)} | "
               f"{_fmt(x['claims'])}{' batches (' + _fmt(x['ticks']) + ' ticks)' if key == 'pgq' else ''} | "
               f"{_fmt(x['poll_timeouts'])} | {_fmt(x['redelivered'])} |\n")
    md += ("\nEvents passed over: an event is passed over when a claim sent after its publish returned came back "
           "empty before the claim that returned it (a claim that skipped a lane or batch another session held, "
           "or that ran before the event was visible to it).\n\n| system | events passed over (%) | empty claims "
           "per event, p90 |\n|---|---|---|\n")
    for name, key, *_ in S12_SYSTEMS:
        if key != "pgq":
            md += (f"| {name} | {_fmt(m[name]['passed_over_share'], 1)} | "
                   f"{_fmt(m[name]['passed_over_p90'], 1)} |\n")
    short = [n for n, *_ in S12_SYSTEMS if (m[n]["achieved_rate"] or 0) < 0.95 * p["s12_rate"]]
    if short:
        md += (f"\n**The publishers fell behind {p['s12_rate']:,} events/s** for {', '.join(short)}: the machine "
               "did not sustain the load (latency counts from the commit).\n")
    md += (f"\noutbox / plain_notify: server CPU per event **{_fmt(r_cpu, 2)}x** (target <= 1.5x), rows written per "
           f"event **{_fmt(r_rows, 2)}x** (target <= 1.0x), pickup p99 **{_fmt(r_p99, 2)}x** (target <= 2x); "
           f"outbox events with a row of their own **{_fmt(o['own_row_share'], 2)}%** (target <= 5%). PgQ "
           "(one consumer, ticks by the harness) is a reference, not a target.\n\n")
    md += ("**publish** (outbox_background, plain_notify, pgq)\n\n"
           + _code(";\n".join(S.E2E_PUBLISH[k] for k in ("outbox", "plain_notify", "pgq")) + ";")
           + "**workers** (outbox_background: `LISTEN outbox`, then per batch claim, handler, ack)\n\n"
           + _code(S.DRAIN["outbox"]["claim"] + ";\n" + S.DRAIN["outbox"]["ack"] + ";")
           + "**workers** (plain_notify: `LISTEN outbox`, then per batch claim, handler, ack)\n\n"
           + _code(S.DRAIN["plain"]["claim"] + ";\n" + S.DRAIN["plain"]["ack"] + ";")
           + f"**pgq**: the queue's configuration, the ticker (every {p['s12_pgq_tick']:g} s) and the consumer "
           "(per batch)\n\n"
           + _code(";\n".join(S.PGQ_STREAM_CONFIG) + ";\n" + S.PGQ_TICK + ";\n" + ";\n".join(S.DRAIN["pgq"].values())
                   + ";")
           + "**rows written** (outbox_background, plain_notify, pgq)\n\n"
           + _code(";\n".join(S.ROWS_WRITTEN[k] for k in ("outbox", "plain_notify", "pgq")) + ";"))
    ctx.section("12. Streaming", md)
    ctx.target("12a", f"streaming: server CPU per event, outbox background / plain_notify "
               f"({_fmt(o['cpu_per_event'])} / {_fmt(pl['cpu_per_event'])} µs)", r_cpu, "<=", 1.5)
    ctx.target("12b", f"streaming: rows written per event, outbox / plain_notify ({_fmt(o['rows_per_event'], 2)} / "
               f"{_fmt(pl['rows_per_event'], 2)})", r_rows, "<=", 1.0)
    ctx.target("12c", "streaming: outbox events with a row of their own (outbox.log_exceptions)",
               o["own_row_share"], "<=", 5.0, "%")
    ctx.target("12d", f"streaming: pickup p99, outbox background / plain_notify ({_fmt(o['pickup_p99'], 1)} / "
               f"{_fmt(pl['pickup_p99'], 1)} ms)", r_p99, "<=", 2.0)
