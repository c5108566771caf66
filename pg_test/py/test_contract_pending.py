"""Contract tests of issue 40 whose fixes have not landed yet (slices 2 and 3
of docs/design/claims-1.0.md); moved into test_contract.py as each lands."""

import threading
import time

from conftest import connect
from test_contract import publish


# Rule 1: whatever other workers hold, and however, every ready event can be claimed.


def test_a_worker_holding_a_claim_in_a_transaction_does_not_starve_another(plain):
    a, b = plain.conn(), plain.conn()
    for trial in range(20):
        sub = f"s{trial}"
        b.execute("SELECT outbox.create_subscription(%s)", (sub,))
        publish(b, 20)
        a.execute("BEGIN")  # psycopg's default: a transaction from the first statement
        held = a.execute("SELECT id FROM outbox.claim('a', 1, '1 min', subscription => %s)", (sub,)).fetchall()
        assert len(held) == 1
        got = b.execute("SELECT id, lease_token FROM outbox.claim('b', 1, '1 min', subscription => %s)",
                        (sub,)).fetchall()
        assert len(got) == 1, f"trial {trial}: nothing for the second worker while the first holds one in a transaction"
        # And the rest of them, one claim each, while the first still holds its one.
        for _ in range(18):
            i, tok = got[0]
            assert b.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0] is True
            got = b.execute("SELECT id, lease_token FROM outbox.claim('b', 1, '1 min', subscription => %s)",
                            (sub,)).fetchall()
            assert len(got) == 1, f"trial {trial}: the second worker starved while the first holds one"
        a.execute("ROLLBACK")


def test_a_steady_stream_keeps_its_events_out_of_rows_of_their_own(plain):
    """Eight workers claim 16 at a time with a 1 ms handler while 5,000 events
    without a subject arrive in batches of 100 at about 1,250 a second: at most
    5 % of them get a row of their own (issue 40 measured 79 % on 0.16.0)."""
    import threading
    import time

    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('stream')")
    total, done = 5000, threading.Event()
    acked, errors = [], []

    def worker(n):
        try:
            with connect(plain.dsn) as w:
                while not done.is_set():
                    rows = w.execute("SELECT id, lease_token FROM outbox.claim(%s, 16, '30 s', subscription => 'stream')",
                                     (f"w{n}",)).fetchall()
                    if not rows:
                        time.sleep(0.002)
                        continue
                    for i, tok in rows:
                        time.sleep(0.001)
                        if w.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0]:
                            acked.append(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    with connect(plain.dsn) as p:
        start = time.monotonic()
        for k in range(total // 100):
            p.execute("SELECT count(outbox.publish('t', '{}'::jsonb)) FROM generate_series(1, 100)")
            time.sleep(max(0.0, start + (k + 1) * 0.08 - time.monotonic()))
    deadline = time.monotonic() + 60
    while len(acked) < total and time.monotonic() < deadline and not errors:
        time.sleep(0.05)
    done.set()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(acked) == total and len(set(acked)) == total
    # A row of its own stays (state 'delivered', its history) after the ack.
    own = c.execute("SELECT count(*) FROM outbox.log_exceptions WHERE subscription = 'stream'").fetchone()[0]
    print(f"{own} of {total} events got a row of their own")
    assert own <= total * 0.05, f"{own} of {total} events of a steady stream got a row of their own"


def test_a_late_committer_is_not_stranded_behind_a_heartbeating_slow_handler(plain):
    """The lane's next window holds only a late committer (its id below the
    events out): it goes out with the next claim, while the slow handler of
    an earlier event keeps extending its lease (0.16.0: not out within 8 s)."""
    c, late = plain.conn(), plain.conn()
    c.execute("SELECT outbox.create_subscription('s')")
    late.execute("BEGIN")
    late_id = late.execute("SELECT outbox.publish('t', '{}'::jsonb)").fetchone()[0]
    ids = publish(c, 3)  # the same run of 64 ids: the same lane
    assert all(i // 64 == late_id // 64 for i in ids)
    rows = c.execute("SELECT id, lease_token FROM outbox.claim('w', 10, '10 s', subscription => 's')").fetchall()
    assert sorted(r[0] for r in rows) == ids
    slow = rows[0]
    for i, tok in rows[1:]:
        assert c.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0] is True
    late.execute("COMMIT")
    for _ in range(3):
        assert c.execute("SELECT outbox.extend_lease(%s, %s, '10 s')", slow).fetchone()[0] is not None
        got = c.execute("SELECT id FROM outbox.claim('w', 10, '10 s', subscription => 's')").fetchall()
        if got:
            break
    assert [r[0] for r in got] == [late_id], "the late committer stayed behind the slow handler's batch"
