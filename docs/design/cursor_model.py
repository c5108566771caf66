"""Model check of the snapshot-cursor window reader of docs/design/subscriptions.md,
before the storage is built: the WINDOW statement below is the predicate the
design proves, run against a plain table.

    python3 docs/design/cursor_model.py DSN [SECONDS]

DSN needs max_prepared_transactions >= 10. Six publishers insert into a scratch
table `mlog` with random commit orders (ids drawn before or after the xid, long
transactions, subjects serialised by an advisory lock), savepoint rollbacks,
aborts and 2PC (committed or rolled back later); one reader advances cursors
(S, m) -> (S', m') under READ COMMITTED or REPEATABLE READ and reads each window
in random batch sizes, continuing by id. Checks: the delivered ids are exactly
the committed ones, none twice, and each subject's ids in increasing order.
Exits 1 on a violation. Breaking the predicate is caught: without the
`txid >= xmax(S)` arm it misses events, with `id > m - 3` it duplicates them."""
import random, sys, threading, time, psycopg
DSN = sys.argv[1]  # e.g. "host=127.0.0.1 port=5477 user=postgres dbname=postgres"
DUR = float(sys.argv[2]) if len(sys.argv) > 2 else 20
adm = psycopg.connect(DSN, autocommit=True)
adm.execute("DROP TABLE IF EXISTS mlog; DROP SEQUENCE IF EXISTS mlog_seq")
adm.execute("CREATE SEQUENCE mlog_seq")
adm.execute("CREATE TABLE mlog (id bigint NOT NULL, txid xid8 NOT NULL DEFAULT pg_current_xact_id(), subject text)")
adm.execute("CREATE INDEX ON mlog (id); CREATE INDEX ON mlog (txid)")
for (g,) in adm.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'mdl-%'").fetchall():
    adm.execute(f"ROLLBACK PREPARED '{g}'")
committed, lock = set(), threading.Lock()
stop = time.monotonic() + DUR
def publisher(n):
    c = psycopg.connect(DSN, autocommit=True); r = random.Random(n); k = 0
    while time.monotonic() < stop:
        try:
            k = one_txn(c, r, n, k)
        except psycopg.errors.DeadlockDetected:
            c.execute("ROLLBACK")
def one_txn(c, r, n, k):
        k += 1
        mine = []
        c.execute("BEGIN")
        if r.random() < 0.3:
            time.sleep(r.random() * 0.05)  # draw ids late or early relative to the xid
        if r.random() < 0.5:
            c.execute("SELECT pg_current_xact_id()")  # xid first
        for _ in range(r.randint(1, 4)):
            sp = r.random() < 0.2
            if sp: c.execute("SAVEPOINT s")
            s = f"s{r.randint(0, 5)}"
            c.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (s,))
            (i,) = c.execute("INSERT INTO mlog (id, subject) VALUES (nextval('mlog_seq'), %s) RETURNING id", (s,)).fetchone()
            if sp and r.random() < 0.5:
                c.execute("ROLLBACK TO SAVEPOINT s")
            else:
                mine.append(i)
            time.sleep(r.random() * 0.01)
        x = r.random()
        if x < 0.15:
            c.execute("ROLLBACK")
        elif x < 0.25:
            gid = f"mdl-{n}-{k}"
            c.execute(f"PREPARE TRANSACTION '{gid}'")
            time.sleep(r.random() * 0.2)
            if r.random() < 0.7:
                c.execute(f"COMMIT PREPARED '{gid}'")
                with lock: committed.update(mine)
            else:
                c.execute(f"ROLLBACK PREPARED '{gid}'")
        else:
            if r.random() < 0.1: time.sleep(r.random() * 0.5)  # a long transaction
            c.execute("COMMIT")
            with lock: committed.update(mine)
        return k
WINDOW = """
SELECT id, subject FROM (
  SELECT l.id, l.subject FROM mlog l
   WHERE l.id > %(m)s AND pg_visible_in_snapshot(l.txid, %(s2)s::pg_snapshot)
  UNION ALL
  SELECT l.id, l.subject FROM mlog l
   WHERE l.id <= %(m)s
     AND (l.txid = ANY (ARRAY(SELECT pg_snapshot_xip(%(s)s::pg_snapshot))) OR l.txid >= pg_snapshot_xmax(%(s)s::pg_snapshot))
     AND pg_visible_in_snapshot(l.txid, %(s2)s::pg_snapshot)
) w WHERE id > %(after)s ORDER BY id LIMIT %(n)s"""
delivered = []
def reader():
    c = psycopg.connect(DSN, autocommit=True); r = random.Random(99)
    # the start cursor: before anything (S0 sees nothing of the run)
    s, m = c.execute("SELECT pg_current_snapshot()::text, (SELECT last_value FROM mlog_seq) * 0").fetchone()
    # mlog_seq.last_value is 1 before the first nextval: use 0 as m
    final = False
    while True:
        done = time.monotonic() >= stop + 3 and final_ok()
        iso = r.choice(["READ COMMITTED", "REPEATABLE READ"])
        c.execute(f"BEGIN ISOLATION LEVEL {iso}")
        s2, m2 = c.execute("SELECT pg_current_snapshot()::text, (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM mlog_seq)").fetchone()
        after = 0
        while True:
            rows = c.execute(WINDOW, dict(m=m, s=s, s2=s2, after=after, n=r.choice([1, 3, 50]))).fetchall()
            if not rows: break
            delivered.extend(rows); after = rows[-1][0]
        c.execute("COMMIT")
        s, m = s2, m2
        if done: return
        time.sleep(r.random() * 0.02)
def final_ok():
    return not adm.execute("SELECT 1 FROM pg_prepared_xacts WHERE gid LIKE 'mdl-%'").fetchone() and all(not t.is_alive() for t in pubs)
pubs = [threading.Thread(target=publisher, args=(i,)) for i in range(6)]
for t in pubs: t.start()
rt = threading.Thread(target=reader); rt.start()
for t in pubs: t.join()
rt.join()
ids = [d[0] for d in delivered]
dups = len(ids) - len(set(ids))
missing = committed - set(ids); extra = set(ids) - committed
last = {}; order_bad = 0
for i, s in delivered:
    if s in last and last[s] > i: order_bad += 1
    last[s] = i
print(f"committed {len(committed)} delivered {len(ids)} dups {dups} missing {len(missing)} extra {len(extra)} order_violations {order_bad}")
sys.exit(1 if dups or missing or extra or order_bad else 0)
