"""Claims over the log (src/log/claim.rs): two named subscriptions with three
workers each, through the public API (claim, ack, extend_lease), against publishers committing in random orders
(savepoints, aborts, long transactions, 2PC resolved later). Workers claim at
READ COMMITTED, REPEATABLE READ or in autocommit, with batch sizes 1-20; one
claim in eight is abandoned with a 1 s lease and its tokens tried again later.

Every committed event must be acked exactly once in each subscription; a claim
never returns two events of one subject, a subject's next event is never handed
out before its predecessor was acked, and a token whose event was handed out
again acks nothing."""

import random
import threading
import time

import psycopg
import pytest

from conftest import connect
from test_log_reader import Traffic

CLAIM = "SELECT id, subject, lease_token FROM outbox.claim('w', %s, %s::interval, subscription => %s)"
ACK = "SELECT outbox.ack(%s::bigint, %s::uuid)::int"


def claim(c, sub, n, lease):
    return c.execute(CLAIM, (n, lease, sub)).fetchall()


class Journal:
    """What the workers saw, with a global clock (a counter under one lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.t = 0
        self.handed = []  # (sub, id, token, subject, claim_end)
        self.acks = []    # (sub, id, token, ack_start, ok)

    def tick(self):
        with self.lock:
            self.t += 1
            return self.t


def worker(dsn, sub, seed, stop, journal, errors):
    rnd = random.Random(seed)
    abandoned = []
    try:
        with connect(dsn) as c:
            idle_since = None
            while True:
                mode = rnd.choice(["auto", "READ COMMITTED", "REPEATABLE READ"])
                abandon = rnd.random() < 1 / 8
                lease = "1 second" if abandon else "30 seconds"
                if mode != "auto":
                    c.execute(f"BEGIN ISOLATION LEVEL {mode}")
                rows = claim(c, sub, rnd.randint(1, 20), lease)
                end = journal.tick()
                with journal.lock:
                    journal.handed += [(sub, i, tok, s, end) for i, s, tok in rows]
                subjects = [s for _, s, _ in rows if s is not None]
                assert len(subjects) == len(set(subjects)), f"one claim returned a subject twice: {rows}"
                if abandon:
                    abandoned += [(i, tok, time.monotonic() + 1.5) for i, _, tok in rows]
                else:
                    for i, _, tok in rows:
                        start = journal.tick()
                        ok = c.execute(ACK, (i, tok)).fetchone()[0]
                        assert ok in (0, 1)
                        journal.acks.append((sub, i, tok, start, ok))
                if mode != "auto":
                    c.execute("COMMIT")
                # Late acks of abandoned claims (after their lease expired).
                due = [a for a in abandoned if a[2] <= time.monotonic()]
                abandoned = [a for a in abandoned if a[2] > time.monotonic()]
                for i, tok, _ in due:
                    start = journal.tick()
                    ok = c.execute(ACK, (i, tok)).fetchone()[0]
                    journal.acks.append((sub, i, tok, start, ok))
                if not rows:
                    if stop.is_set():
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > 3 and not abandoned:
                            return
                    time.sleep(0.02)
                else:
                    idle_since = None
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_two_subscriptions_ack_every_committed_event_once_in_subject_order(logdb):
    logdb.one("SELECT outbox.create_subscription('alpha')")
    logdb.one("SELECT outbox.create_subscription('beta')")
    stop, errors, journal = threading.Event(), [], Journal()
    traffic = Traffic(logdb, 4, 200, errors)
    workers = [threading.Thread(target=worker, args=(logdb.dsn, sub, 300 + k, stop, journal, errors))
               for k, sub in enumerate(["alpha", "beta"] * 3)]
    for t in workers:
        t.start()
    time.sleep(12)
    traffic.finish()
    stop.set()
    for t in workers:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in workers), "workers did not drain"

    committed = dict(logdb.all("SELECT id, subject FROM outbox.log"))
    assert len(committed) > 200, "too little traffic to mean anything"
    for sub in ("alpha", "beta"):
        handed = [h for h in journal.handed if h[0] == sub]
        acks = [a for a in journal.acks if a[0] == sub and a[4] == 1]
        acked_ids = [a[1] for a in acks]
        assert len(acked_ids) == len(set(acked_ids)), f"{sub}: an event acked twice"
        missing = set(committed) - set(acked_ids)
        assert not missing, f"{sub}: {len(missing)} committed events never acked, e.g. {sorted(missing)[:5]}"
        assert set(acked_ids) <= set(committed)
        ack_of = {a[1]: a for a in acks}
        # Subject order: each next event handed out only after its predecessor's ack began.
        by_subject = {}
        for i in sorted(committed):
            if committed[i] is not None:
                by_subject.setdefault(committed[i], []).append(i)
        first_hand = {}
        for h in handed:
            first_hand.setdefault(h[1], h[4])
        for s, ids in by_subject.items():
            for prev, nxt in zip(ids, ids[1:]):
                assert first_hand[nxt] > ack_of[prev][3], (
                    f"{sub}: {nxt} of {s} handed out before {prev} was acked")
        # Fencing: a successful ack's token is the event's latest hand-out at the time.
        hand_outs = {}
        for h in handed:
            hand_outs.setdefault(h[1], []).append((h[4], h[2]))
        for _, i, tok, start, _ in acks:
            mine = next(at for at, t in hand_outs[i] if t == tok)
            again = [t for at, t in hand_outs[i] if t != tok and mine < at < start]
            assert not again, f"{sub}: event {i} acked with a stale token after it was handed out again"
    # Finished batches are gone; every lane's cursor moved.
    assert logdb.one("SELECT count(*) FROM outbox.log_batches")[0] == 0


def test_a_held_subject_waits_for_its_ack_and_other_subjects_do_not(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('s')")
    a1 = c.execute("SELECT outbox.publish('h.t', '{}', 'a')").fetchone()[0]
    a2 = c.execute("SELECT outbox.publish('h.t', '{}', 'a')").fetchone()[0]
    first = claim(c, "s", 10, "30 s")
    assert [r[0] for r in first] == [a1]
    assert claim(c, "s", 10, "30 s") == []
    assert c.execute(ACK, (a1, first[0][2])).fetchone()[0] == 1
    second = claim(c, "s", 10, "30 s")
    assert [r[0] for r in second] == [a2]


def test_an_expired_lease_redelivers_only_the_unacked_event_and_the_old_token_acks_nothing(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('s')")
    ids = [r[0] for r in c.execute("SELECT * FROM outbox.publish_batch('x.t', ARRAY['{}', '{}']::jsonb[])")]
    old = claim(c, "s", 10, "1 second")
    assert sorted(r[0] for r in old) == ids
    # One is acked in time; the other's lease runs out.
    assert c.execute(ACK, (old[0][0], old[0][2])).fetchone()[0] == 1
    time.sleep(1.1)
    again = c.execute("SELECT id, attempt, lease_token FROM outbox.claim('w', 10, '30 s', subscription => 's')").fetchall()
    assert [(r[0], r[1]) for r in again] == [(old[1][0], 2)]          # only the unacked one, second attempt
    assert again[0][2] != old[1][2]
    assert c.execute(ACK, (old[1][0], old[1][2])).fetchone()[0] == 0
    assert c.execute("SELECT outbox.fail(%s, %s, 'late')", (old[1][0], old[1][2])).fetchone()[0] == "stale"
    assert c.execute("SELECT outbox.extend_lease(%s, %s, '1 min')", (old[1][0], old[1][2])).fetchone()[0] is None
    assert c.execute(ACK, (again[0][0], again[0][2])).fetchone()[0] == 1
    assert logdb.one("SELECT count(*) FROM outbox.log_batches")[0] == 0
    # The redelivered event keeps its history: delivered on its second attempt.
    assert logdb.all("SELECT id, state, attempts, last_error FROM outbox.log_exceptions") == [
        (old[1][0], "delivered", 2, "lease expired")]


def test_an_expired_lease_not_yet_reclaimed_can_still_be_acked(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('s')")
    e = c.execute("SELECT outbox.publish('x.t', '{}', 'k')").fetchone()[0]
    f = c.execute("SELECT outbox.publish('x.t', '{}', 'k')").fetchone()[0]
    (row,) = claim(c, "s", 10, "1 second")
    time.sleep(1.1)
    # Another lane's claim moves nothing of this lane; a claim that visits it
    # moves the event (and its successor) to the exception table with its token.
    c.execute("SELECT count(*) FROM outbox.claim('w2', 1, '1 s', subscription => 's', topics => ARRAY['none'])")
    assert c.execute(ACK, (e, row[2])).fetchone()[0] == 1
    assert [r[0] for r in claim(c, "s", 10, "30 s")] == [f]


def test_bad_arguments_get_documented_errors_and_change_nothing(plain):
    logdb = plain  # 'default' exists
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('s')")
    cases = [
        ("SELECT * FROM outbox.claim('w', 1, subscription => 'nope')", "42704"),
        ("SELECT * FROM outbox.claim('w', 0, subscription => 's')", "22023"),
        ("SELECT * FROM outbox.claim('w', 100000, subscription => 's')", "54000"),
        ("SELECT * FROM outbox.claim('w', 1, '-1 s', subscription => 's')", "22023"),
        ("SELECT * FROM outbox.claim('w', 1, '100 days', subscription => 's')", "22023"),
        ("SELECT * FROM outbox.claim('w', 1, topics => ARRAY['Bad'], subscription => 's')", "22023"),
        ("SELECT outbox.create_subscription('s')", "42710"),
        ("SELECT outbox.create_subscription('default')", "42710"),
        ("SELECT outbox.create_subscription('Bad Name')", "22023"),
        ("SELECT outbox.create_subscription(NULL)", "22004"),
        ("SELECT outbox.create_subscription('t', start => 'tomorrow')", "22023"),
        ("SELECT outbox.create_subscription('t', start => NULL)", "22004"),
        ("SELECT outbox.create_subscription('t', topics => ARRAY[]::text[])", "22023"),
        ("SELECT outbox.create_subscription('t', topics => ARRAY['a.b', NULL])", "22004"),
        ("SELECT outbox.create_subscription('t', topics => ARRAY['A'])", "22023"),
        ("SELECT outbox.create_subscription('t', max_attempts => 0)", "22023"),
        ("SELECT outbox.create_subscription('t', default_lease => '-1 s')", "22023"),
        ("SELECT outbox.create_subscription('t', dead_letter_policy => 'drop')", "22023"),
        ("SELECT outbox.drop_subscription('nope')", "42704"),
        ("SELECT outbox.drop_subscription(NULL)", "22004"),
        ("SELECT outbox.drop_subscription('s', NULL)", "22004"),
    ]
    for sql, state in cases:
        with pytest.raises(psycopg.Error) as e:
            c.execute(sql)
        assert e.value.sqlstate == state, sql
    # Nothing half-made: 't' never exists.
    assert logdb.one("SELECT count(*) FROM outbox.subscription_catalog WHERE name = 't'")[0] == 0
    assert logdb.one("SELECT count(*) FROM outbox.log_lanes WHERE subscription = 't'")[0] == 0
    # An unknown log token acks nothing, and raises nothing.
    tok = "00000000-0001-8000-8001-000000000001"
    assert c.execute(ACK, (1, tok)).fetchone()[0] == 0
    assert c.execute("SELECT outbox.ack(ARRAY[1, 2]::bigint[], ARRAY[%s, gen_random_uuid()]::uuid[])",
                     (tok,)).fetchone()[0] == 0


def test_extend_keeps_one_event_out_past_its_first_lease_and_refuses_stale_tokens(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('s')")
    # Both ids in one run of 64, so in one lane and one round (src/log/mod.rs).
    c.execute("SELECT setval('outbox.event_id_seq', (nextval('outbox.event_id_seq') / 64 + 1) * 64)")
    ids = [r[0] for r in c.execute("SELECT * FROM outbox.publish_batch('x.e', ARRAY['{}', '{}']::jsonb[])")]
    rows = claim(c, "s", 10, "1 second")
    tok = {r[0]: r[2] for r in rows}
    assert sorted(tok) == ids and tok[ids[0]] != tok[ids[1]]
    until = c.execute("SELECT outbox.extend_lease(%s::bigint, %s, '10 seconds') - clock_timestamp()",
                      (ids[0], tok[ids[0]])).fetchone()[0]
    assert 9 < until.total_seconds() <= 10
    time.sleep(1.2)
    # The other event of the round was not extended: its lease expired, and it
    # goes out again; the extended one stays out.
    again = claim(c, "s", 10, "30 s")
    assert [r[0] for r in again] == [ids[1]]
    # Its first lease holds nothing any more.
    assert c.execute("SELECT outbox.extend_lease(%s::bigint, %s, '10 s')", (ids[1], tok[ids[1]])).fetchone()[0] is None
    assert c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])",
                     (ids, [tok[ids[0]], again[0][2]])).fetchone()[0] == 2
    # Acked: the token holds nothing any more.
    assert c.execute("SELECT outbox.extend_lease(%s::bigint, %s, '10 s')", (ids[0], tok[ids[0]])).fetchone()[0] is None
    with pytest.raises(psycopg.Error) as e:
        c.execute("SELECT outbox.extend_lease(%s::bigint, %s, '0 s')", (ids[0], tok[ids[0]]))
    assert e.value.sqlstate == "22023"


def test_later_rounds_of_many_lanes_come_back_whole_with_their_tokens_and_payloads(logdb):
    """Rounds whose picks are sparse in their batches (a subject with a run of
    events between two of another's), in two lanes at once: one claim returns
    each event once, with its own payload, its own token and its round's expiry, and
    every token acks its event (src/log/claim.rs, `Claim::flush`)."""
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('s')")
    by_lane = {}
    for i in range(2000):
        lane = c.execute("SELECT outbox._lane(0, %s)", (f"k{i}",)).fetchone()[0]
        by_lane.setdefault(lane, []).append(f"k{i}")
    lanes = [subs[:2] for subs in by_lane.values() if len(subs) >= 2][:2]
    assert len(lanes) == 2
    payload = {}
    # Per lane: a1 b1 a2 a3 a4 a5 a6 b2, so the second round (a2, b2) spans 6 positions.
    for a, b in lanes:
        for s, n in [(a, 1), (b, 1), (a, 2), (a, 3), (a, 4), (a, 5), (a, 6), (b, 2)]:
            i = c.execute("SELECT outbox.publish('m.t', %s::jsonb, %s)", (f'{{"s": "{s}", "n": {n}}}', s)).fetchone()[0]
            payload[i] = {"s": s, "n": n}
    q = ("SELECT id, payload, subject, attempt, lease_token, lease_expires_at > now() "
         "FROM outbox.claim('w', 100, '30 s', subscription => 's')")
    first = c.execute(q).fetchall()
    assert sorted(r[2] for r in first) == sorted(s for pair in lanes for s in pair)
    for r in first:
        assert c.execute(ACK, (r[0], r[4])).fetchone()[0] == 1
    second = c.execute(q).fetchall()
    # Each subject's second event, once, with its own payload.
    assert sorted((r[2], r[1]["n"]) for r in second) == sorted((s, 2) for pair in lanes for s in pair)
    for i, p, s, attempt, token, live in second:
        assert p == payload[i] and s == p["s"] and attempt == 1 and live
    assert len({r[4] for r in second}) == len(second)  # each event its own token
    for r in second:
        assert c.execute(ACK, (r[0], r[4])).fetchone()[0] == 1
    assert c.execute(ACK, (second[0][0], second[0][4])).fetchone()[0] == 0
    # The rest comes out in subject order, a round at a time.
    rest = []
    while True:
        got = c.execute(q).fetchall()
        if not got:
            break
        for r in got:
            assert c.execute(ACK, (r[0], r[4])).fetchone()[0] == 1
        rest += [(r[2], r[1]["n"]) for r in got]
    want = [(a, n) for a, _ in lanes for n in range(3, 7)]
    assert sorted(rest) == sorted(want)
    assert [n for s, n in rest if s == lanes[0][0]] == [3, 4, 5, 6]


def test_a_subscription_whose_lanes_are_gone_still_gets_its_due_rows_of_their_own(logdb):
    # A claim reads the lanes first, and with them whether a row of its own
    # may be claimable; a subscription with no lane rows (deleted by hand)
    # must still be handed its due retry by the claim that makes its lanes.
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('s')")
    e = c.execute("SELECT outbox.publish('x.t', '{}', 'k')").fetchone()[0]
    (row,) = claim(c, "s", 10, "30 s")
    assert c.execute("SELECT outbox.fail(%s, %s, 'boom', retry_in => '0 s')", (e, row[2])).fetchone()[0] == "pending"
    c.execute("DELETE FROM outbox.log_lanes WHERE subscription = 's'")
    again = claim(c, "s", 10, "30 s")
    assert [r[0] for r in again] == [e]
    assert c.execute("SELECT count(*) FROM outbox.log_lanes WHERE subscription = 's'").fetchone()[0] == 16
