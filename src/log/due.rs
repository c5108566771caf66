//! What in the log becomes claimable by the clock or without a commit of its
//! own, for the background worker's wake-ups (src/worker.rs): the part of its
//! due-time pass.
//!
//! An immediate publish is announced by its own commit (src/wakeup.rs). Everything else a listener must hear about comes due
//! in one of four places, and each has an index-driven probe:
//! - a delayed event the lane has not read yet: its ring row's `deliver_at`
//!   (the partial index `log_<n>_deliver_at`, sql/log.sql);
//! - an exception row (src/log/exceptions.rs) that is `pending` from its
//!   `visible_at` (a retry, a delayed event a claim read, an event behind a
//!   failed one) or `leased` until then (its lease expires): the index
//!   `log_exceptions_ready`, one probe per subscription;
//! - an event out in a batch round whose lease expires (the round's expiry in
//!   the batch's encoding; a subscription has at most one batch per lane);
//! - on a sweep (a prepared transaction committed, the worker's topic list
//!   overflowed, a replay or cancel of unknown topics, a new worker): every
//!   event some lane has not read, found by the three branches of a window
//!   (src/log/mod.rs) from each lane's cursor.
//!
//! **Invariant: a topic with an event that became claimable by the clock in
//! (since, now] is in the pass's list, and the next due time is no later than
//! the earliest such moment after now.** Every way an event of the log becomes
//! claimable without a commit that announces it is in the list above: a claim
//! hands out an exception row once its `visible_at` has passed (pending) or
//! its lease expired (leased), a batch's event once its round expired, and a
//! lane's unread event once its `deliver_at` has passed. Each probe reads the
//! same column the claim compares with the clock. The list may hold more
//! (an event behind its subject's head, one another worker took meanwhile):
//! a wake-up is a hint, and a listener that finds nothing polls again later.
//! Paused subscriptions are left out: they hand out nothing.

use super::batch::{Batch, State};
use crate::pg;
use pgrx::datum::TimestampWithTimeZone;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

/// The subscriptions of the log that hand out events.
const ACTIVE: &str = "SELECT c.name FROM outbox.subscription_catalog c \
                      WHERE NOT c.paused AND EXISTS (SELECT 1 FROM outbox.log_lanes l WHERE l.subscription = c.name)";

/// Topics of exception rows that became claimable in ($1, $2]: a retry or a
/// delay ran out (`visible_at` after `published_at`, or a later attempt), a
/// lease expired. One probe of `log_exceptions_ready` per subscription.
const EXC_DUE_BY_CLOCK: &str = concat!(
    "SELECT DISTINCT x.topic FROM (",
    "SELECT c.name FROM outbox.subscription_catalog c WHERE NOT c.paused",
    ") c CROSS JOIN LATERAL (SELECT x.topic FROM outbox.log_exceptions x ",
    "WHERE x.subscription = c.name AND x.state IN ('pending', 'leased') ",
    "AND x.visible_at > $1 AND x.visible_at <= $2 ",
    "AND (x.visible_at > x.published_at OR x.attempts > 0 OR x.state = 'leased')) x"
);

/// Topics of exception rows claimable at $1 (a sweep).
const EXC_DUE_ALL: &str = concat!(
    "SELECT DISTINCT x.topic FROM (",
    "SELECT c.name FROM outbox.subscription_catalog c WHERE NOT c.paused",
    ") c CROSS JOIN LATERAL (SELECT x.topic FROM outbox.log_exceptions x ",
    "WHERE x.subscription = c.name AND x.state IN ('pending', 'leased') AND x.visible_at <= $1) x"
);

/// Topics of delayed events of the ring that came due in ($1, $2]. An event a
/// lane has read already is here too (its row is never changed): a spare hint.
const RING_DUE_BY_CLOCK: &str =
    "SELECT DISTINCT e.topic FROM outbox.log e WHERE e.deliver_at > $1 AND e.deliver_at <= $2";

/// Topics of the events some lane of an active subscription has not read: a
/// window's branches from the lane's cursor (src/log/mod.rs). Ids above the
/// cursor's `m` are probed once per lane, from the lowest `m` of its
/// subscriptions; `lane + 0` keeps the planner on the txid index for the late
/// committers (as `outbox._log_readers_passed` does).
const RING_UNREAD: &str = concat!(
    "WITH l AS (SELECT l.* FROM outbox.log_lanes l JOIN outbox.subscription_catalog c ",
    "ON c.name = l.subscription AND NOT c.paused) ",
    "SELECT e.topic FROM (SELECT lane, min(lo_m) AS m FROM l GROUP BY lane) l ",
    "CROSS JOIN LATERAL (SELECT e.topic FROM outbox.log e WHERE e.lane = l.lane AND e.id > l.m) e ",
    "UNION ",
    "SELECT e.topic FROM l CROSS JOIN LATERAL (",
    "SELECT e.topic FROM outbox.log e WHERE e.txid = ANY (ARRAY(SELECT pg_snapshot_xip(l.lo_snap))) ",
    "AND e.lane + 0 = l.lane ",
    "UNION ALL SELECT e.topic FROM outbox.log e WHERE e.txid >= pg_snapshot_xmax(l.lo_snap) ",
    "AND e.txid < l.lo_xn AND e.lane + 0 = l.lane AND e.id + 0 <= l.lo_m) e"
);

/// The earliest exception row or delayed ring event that comes due after $1.
const NEXT_DUE: &str = concat!(
    "SELECT least(",
    "(SELECT min(x.visible_at) FROM outbox.subscription_catalog c CROSS JOIN LATERAL (",
    "SELECT x.visible_at FROM outbox.log_exceptions x WHERE x.subscription = c.name ",
    "AND x.state IN ('pending', 'leased') AND x.visible_at > $1 ORDER BY x.visible_at LIMIT 1) x ",
    "WHERE NOT c.paused), ",
    "(SELECT min(e.deliver_at) FROM outbox.log e WHERE e.deliver_at > $1))"
);

/// Batches in flight of active subscriptions.
const BATCHES: &str = "SELECT b.lane, b.state FROM outbox.log_batches b \
                       JOIN outbox.subscription_catalog c ON c.name = b.subscription AND NOT c.paused";

/// Topics of events of lane $1 with ids in $2.
const TOPICS_OF: &str = "SELECT DISTINCT e.topic FROM outbox.log e WHERE e.lane = $1 AND e.id = ANY ($2)";

/// The timestamptz (µs) that `sql`, a query of one column and at most one
/// row, returns for `now` ($1), if any: when the next event comes due.
fn next_due(c: &SpiClient<'_>, sql: &str, now: i64) -> Result<Option<i64>, String> {
    Ok(c.select(sql, None, &[pg::timestamptz(now).into()])
        .map_err(|e| e.to_string())?
        .first()
        .get_one::<TimestampWithTimeZone>()
        .map_err(|e| e.to_string())?
        .and_then(|ts| ts.into_datum())
        .map(|d| d.value() as i64))
}

/// Add to `topics` the topics of the log that came due in (`since`, `now`]
/// (TimestampTz microseconds), or, on a sweep, every topic with an event some
/// subscription may claim now; return when the next event comes due after
/// `now`, if any.
pub fn pass(
    c: &SpiClient<'_>,
    since: i64,
    now: i64,
    sweep: bool,
    topics: &mut Vec<String>,
) -> Result<Option<i64>, String> {
    let (since_ts, now_ts) = (pg::timestamptz(since), pg::timestamptz(now));
    let mut add = |sql: &str, args: &[pgrx::datum::DatumWithOid<'_>]| -> Result<(), String> {
        for r in c.select(sql, None, args).map_err(|e| e.to_string())? {
            if let Ok(Some(t)) = r.get::<String>(1) {
                if !topics.contains(&t) {
                    topics.push(t);
                }
            }
        }
        Ok(())
    };
    let active = !c.select(ACTIVE, Some(1), &[]).map_err(|e| e.to_string())?.is_empty();
    if !active {
        return Ok(None);
    }
    if sweep {
        add(EXC_DUE_ALL, &[now_ts.into()])?;
        add(RING_UNREAD, &[])?;
    } else {
        add(EXC_DUE_BY_CLOCK, &[since_ts.into(), now_ts.into()])?;
        add(RING_DUE_BY_CLOCK, &[since_ts.into(), now_ts.into()])?;
    }
    let mut next = next_due(c, NEXT_DUE, now)?;
    // Batch rounds: an expiry in (since, now] wakes the topics of the events
    // still out in it (on a sweep they are unread, so listed already).
    let mut expired: Vec<(i16, Vec<i64>)> = Vec::new();
    for r in c.select(BATCHES, None, &[]).map_err(|e| e.to_string())? {
        let (Ok(Some(lane)), Ok(Some(bytes))) = (r.get::<i16>(1), r.get::<Vec<u8>>(2)) else { continue };
        let Ok(b) = Batch::decode(&bytes) else { continue };
        let mut ids = Vec::new();
        for (i, id) in b.ids().iter().enumerate() {
            let State::Out(round) = b.state(i) else { continue };
            let Some(at) = b.round_expiry(round) else { continue };
            if at > now {
                next = Some(next.map_or(at, |n| n.min(at)));
            } else if at > since && !sweep {
                ids.push(*id);
            }
        }
        if !ids.is_empty() {
            expired.push((lane, ids));
        }
    }
    for (lane, ids) in expired {
        add(TOPICS_OF, &[lane.into(), ids.into()])?;
    }
    Ok(next)
}
