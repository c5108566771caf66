"""Events parked behind an earlier event of their subject (a pile,
src/log/exceptions.rs invariant 5): every way the head stops holding its
subject delivers the whole pile, in order, and nothing else of the subject
is handed out while it holds.

A claim reads a pile only once its head no longer holds the subject, judged
in the claim's own snapshot; nothing rewrites the pile when the head changes.
So each path below is a different write to the head alone: replay, replay_dead,
cancel, the row's removal (purge_dead, retention), a topic's policy switched to 'skip', and a retry that
comes due and is acked."""

import time

import pytest

PILE = 30
CLAIM = "SELECT id, lease_token FROM outbox.claim('w', 100, subscription => 's')"


def pile_behind_a_failed_head(c, policy, retry_in=None):
    """Head `h` of subject 'S' fails (for good, or with `retry_in`), then PILE
    more events of 'S' are published and read past by claims. Returns (h, pile ids)."""
    c.execute("SELECT outbox.create_topic('t.pile', dead_letter_policy => %s)", (policy,))
    c.execute("SELECT outbox.create_subscription('s')")
    h = c.execute("SELECT outbox.publish('t.pile', '{}'::jsonb, subject => 'S')").fetchone()[0]
    (eid, tok), = c.execute(CLAIM).fetchall()
    assert eid == h
    if retry_in is None:
        assert c.execute("SELECT outbox.fail(%s, %s, 'boom', permanent => true)", (eid, tok)).fetchone()[0] == "dead"
    else:
        assert c.execute("SELECT outbox.fail(%s, %s, 'boom', %s::interval)",
                         (eid, tok, retry_in)).fetchone()[0] == "pending"
    ids = [c.execute("SELECT outbox.publish('t.pile', '{}'::jsonb, subject => 'S')").fetchone()[0]
           for _ in range(PILE)]
    # Claims read past them: none is handed out while the head holds 'S'.
    for _ in range(5):
        assert c.execute(CLAIM).fetchall() == []
    behind = c.execute("SELECT count(*) FROM outbox.log_exceptions WHERE subscription = 's' AND parked_behind = %s",
                       (h,)).fetchone()[0]
    assert behind == PILE, f"{behind} of {PILE} events parked behind the head"
    return h, ids


def drain(c, limit=PILE + 5):
    """Claim and ack until a claim is empty; returns the ids in hand-out order."""
    got = []
    for _ in range(limit):
        rows = c.execute(CLAIM).fetchall()
        if not rows:
            break
        assert len(rows) == 1, f"two events of one subject in one claim: {rows}"
        got.append(rows[0][0])
        assert c.execute("SELECT outbox.ack(%s, %s)", rows[0]).fetchone()[0]
    return got


@pytest.mark.parametrize("path", ["replay", "replay_dead", "cancel", "removed", "policy_skip"])
def test_every_unblock_of_a_dead_letter_delivers_its_pile_in_order(logdb, path):
    c = logdb.conn()
    h, ids = pile_behind_a_failed_head(c, "block")
    expect = ids
    if path == "replay":
        assert c.execute("SELECT outbox.replay(%s, 's')", (h,)).fetchone()[0]
        expect = [h] + ids
    elif path == "replay_dead":
        assert c.execute("SELECT outbox.replay_dead(subscription => 's')").fetchone()[0] == 1
        expect = [h] + ids
    elif path == "cancel":
        assert c.execute("SELECT outbox.cancel(%s, 's')", (h,)).fetchone()[0]
    elif path == "removed":
        # What purge_dead and retention do once the log has dropped the event
        # (they keep the row while the log holds it): the row goes.
        assert c.execute("DELETE FROM outbox.log_exceptions WHERE subscription = 's' AND id = %s",
                         (h,)).rowcount == 1
    else:
        c.execute("SELECT outbox.alter_topic('t.pile', dead_letter_policy => 'skip')")
    assert drain(c) == expect
    assert c.execute(CLAIM).fetchall() == []


def test_a_pile_behind_a_retry_follows_it_once_it_is_acked(logdb):
    c = logdb.conn()
    h, ids = pile_behind_a_failed_head(c, "block", retry_in="1 second")
    time.sleep(1.2)
    assert drain(c) == [h] + ids


def test_a_pile_whose_head_stays_dead_is_never_handed_out(logdb):
    """A dead letter that blocks keeps its pile, however many claims pass."""
    c = logdb.conn()
    h, ids = pile_behind_a_failed_head(c, "block")
    other = c.execute("SELECT outbox.publish('t.pile', '{}'::jsonb, subject => 'other')").fetchone()[0]
    assert drain(c) == [other]
    states = c.execute("SELECT state, count(*) FROM outbox.log_exceptions WHERE subscription = 's' AND subject = 'S' "
                       "GROUP BY 1 ORDER BY 1").fetchall()
    assert states == [("dead", 1), ("pending", PILE)]
