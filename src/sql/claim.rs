//! The claim statement (src/claim.rs) and its parts.

use crate::pg::plans::Stmt;
use pgrx::prelude::*;

/// Candidates: ready heads in claim order whose subject has no earlier live event.
macro_rules! ready_sql {
    ($cols:literal, $filter:literal) => {
        concat!(
            "SELECT ",
            $cols,
            " FROM outbox.event_queue q",
            "   WHERE ",
            crate::in_claim_index!("q"),
            " AND q.visible_at <= $5 AND (q.visible_at, q.id) >= ($6, $7) ",
            $filter,
            "     AND (q.subject IS NULL OR NOT EXISTS (",
            "          SELECT 1 FROM outbox.event_queue p",
            "           WHERE p.subject = q.subject AND p.id < q.id",
            "             AND ",
            crate::holds_subject!("p"),
            "))",
            "   ORDER BY q.visible_at, q.id"
        )
    };
}

/// `cand`: the first $2 candidates this claim could lock. `lock_row` takes each
/// row with [`crate::pg::try_lock_row`], in claim order: OFFSET 0 keeps the
/// planner from pushing the lock down into the scan (it would lock every
/// candidate, before the subject check and the sort), so the lock is the last
/// test a row passes and the LIMIT stops it. `skip_locked` is the FOR UPDATE SKIP LOCKED of 0.4.0's SQL, used only
/// until `ALTER EXTENSION outbox_ext UPDATE` creates `outbox._lock_row`.
macro_rules! cand_sql {
    (lock_row, $filter:literal) => {
        concat!(
            "SELECT r.id FROM (",
            ready_sql!("q.id, q.ctid AS row", $filter),
            " OFFSET 0) r WHERE outbox._lock_row('outbox.event_queue'::regclass::oid, r.row) LIMIT $2"
        )
    };
    (skip_locked, $filter:literal) => {
        concat!(ready_sql!("q.id", $filter), " LIMIT $2 FOR UPDATE OF q SKIP LOCKED")
    };
}

/// SQL condition: the event has used its attempts and goes dead instead of
/// being leased again: a lease that expired on the last attempt, or a pending
/// event past a max_attempts the subscription lowered since its last failure.
/// (Without a lowered limit a pending event always has attempts left: fail()
/// turns the last failure dead, replay resets the count.)
macro_rules! last_attempt_expired {
    () => {
        "q.attempts >= COALESCE($8, q.max_attempts) AND (q.state = 'leased' OR q.attempts > 0)"
    };
}

macro_rules! claim_sql {
    ($how:ident, $filter:literal) => {
        concat!(
            "WITH cand AS (",
            cand_sql!($how, $filter),
            "), upd AS (",
            "  UPDATE outbox.event_queue q SET",
            "    state = CASE WHEN ", last_attempt_expired!(), " THEN 'dead' ELSE 'leased' END,",
            "    attempts = CASE WHEN ", last_attempt_expired!(), " THEN q.attempts ELSE q.attempts + 1 END,",
            "    lease_token = CASE WHEN ", last_attempt_expired!(), " THEN NULL ELSE gen_random_uuid() END,",
            "    visible_at = CASE WHEN ", last_attempt_expired!(), " THEN q.visible_at",
            // The lease: the call's, else the subscription's, the topic's, the GUC.
            "                      ELSE clock_timestamp() + COALESCE($3, $9,",
            // The uncorrelated EXISTS is an InitPlan run once per claim, so the
            // per-row topic lookup only happens when some topic sets a lease.
            "                        CASE WHEN (SELECT EXISTS (SELECT 1 FROM outbox.topics t0 WHERE t0.default_lease IS NOT NULL))",
            "                             THEN (SELECT t.default_lease FROM outbox.topics t WHERE t.topic = q.topic) END, $4) END,",
            "    leased_by = CASE WHEN ", last_attempt_expired!(), " THEN q.leased_by ELSE $1 END,",
            "    leased_at = CASE WHEN ", last_attempt_expired!(), " THEN q.leased_at ELSE clock_timestamp() END,",
            "    last_error = CASE WHEN q.state = 'leased' THEN 'lease expired' ELSE q.last_error END,",
            "    errors = CASE WHEN q.state = 'leased' THEN ",
            crate::history_append!("q.errors", "jsonb_build_object('attempt', q.attempts, 'at', clock_timestamp(), 'worker', q.leased_by, 'error', 'lease expired')"),
            "             ELSE q.errors END,",
            "    dead_at = CASE WHEN ", last_attempt_expired!(), " THEN clock_timestamp() ELSE q.dead_at END,",
            "    blocks_subject = ", last_attempt_expired!(), " AND q.subject IS NOT NULL",
            "                     AND COALESCE((SELECT t.dead_letter_policy FROM outbox.topics t WHERE t.topic = q.topic), 'block') = 'block'",
            // ANY(ARRAY(..)) pins the update to primary-key lookups; a join let the
            // planner hash-join against a sequential scan when statistics were stale.
            "  WHERE q.id = ANY (ARRAY(SELECT c.id FROM cand c))",
            "  RETURNING q.id, q.topic, q.subject, q.dispatch_key, q.payload, q.headers, q.attempts,",
            "            q.lease_token, q.visible_at, q.published_at, q.state, q.blocks_subject",
            ")",
            // Columns 1-10 are claim's result; 11-12 let the caller see leases that
            // expired into dead instead (they are not returned).
            "SELECT id, topic, subject, dispatch_key, payload, headers, attempts, lease_token, visible_at, published_at,",
            "       state = 'leased', blocks_subject",
            "  FROM upd ORDER BY id"
        )
    };
}

/// Parameter types of the claim statement: $1..$9 ($8 and $9 the
/// subscription's max_attempts and default_lease, NULL when it sets none or the
/// installed SQL predates subscriptions), then any the filter adds.
macro_rules! claim_types {
    ($($extra:expr),*) => {
        &[
            pg_sys::TEXTOID,
            pg_sys::INT4OID,
            pg_sys::INTERVALOID,
            pg_sys::INTERVALOID,
            pg_sys::TIMESTAMPTZOID,
            pg_sys::TIMESTAMPTZOID,
            pg_sys::INT8OID,
            pg_sys::INT4OID,
            pg_sys::INTERVALOID,
            $($extra),*
        ]
    };
}

pub const ALL_TYPES: &[pg_sys::Oid] = claim_types!();
pub const TOPIC_TYPES: &[pg_sys::Oid] = claim_types!(pg_sys::TEXTARRAYOID, pg_sys::TEXTARRAYOID);

pub const CLAIM_ALL: Stmt = Stmt { sql: claim_sql!(lock_row, ""), types: ALL_TYPES };
pub const CLAIM_TOPICS: Stmt =
    Stmt { sql: claim_sql!(lock_row, "AND (q.topic = ANY($10) OR q.topic ^@ ANY($11))"), types: TOPIC_TYPES };
/// For the SQL of 0.4.0: FOR UPDATE SKIP LOCKED.
pub const CLAIM_ALL_040: Stmt = Stmt { sql: claim_sql!(skip_locked, ""), types: ALL_TYPES };
pub const CLAIM_TOPICS_040: Stmt =
    Stmt { sql: claim_sql!(skip_locked, "AND (q.topic = ANY($10) OR q.topic ^@ ANY($11))"), types: TOPIC_TYPES };

/// Every subscription's settings, for the per-backend cache (src/subscriptions.rs).
pub const SUBSCRIPTIONS: Stmt = Stmt {
    sql: "SELECT c.name, c.paused, c.max_attempts, c.backoff_base, c.backoff_max, c.default_lease \
            FROM outbox.subscription_catalog c",
    types: &[],
};

/// [`SUBSCRIPTIONS`] with the topic filter and dead-letter policy of 0.9.0.
pub const SUBSCRIPTIONS_090: Stmt = Stmt {
    sql: "SELECT c.name, c.paused, c.max_attempts, c.backoff_base, c.backoff_max, c.default_lease, \
                 c.topics, c.dead_letter_policy \
            FROM outbox.subscription_catalog c",
    types: &[],
};

/// [`SUBSCRIPTIONS_090`] with the storage each subscription reads (0.10.0).
pub const SUBSCRIPTIONS_0100: Stmt = Stmt {
    sql: "SELECT c.name, c.paused, c.max_attempts, c.backoff_base, c.backoff_max, c.default_lease, \
                 c.topics, c.dead_letter_policy, c.storage = 'queue' \
            FROM outbox.subscription_catalog c",
    types: &[],
};

/// The queue's unexpired leases (drop_subscription of the install's `default`).
pub const QUEUE_LEASED: Stmt = Stmt {
    sql: "SELECT count(*) FROM outbox.event_queue q WHERE q.state = 'leased' AND q.visible_at > now()",
    types: &[],
};

/// Empty the queue and its subject repairs; the number of events removed.
pub const QUEUE_CLEAR: Stmt = Stmt {
    sql: "WITH r AS (DELETE FROM outbox.subject_repairs), q AS (DELETE FROM outbox.event_queue RETURNING 1) \
          SELECT count(*) FROM q",
    types: &[],
};

/// Move the queue's events into rows of their own of subscription $1 of the
/// log (`outbox._queue_to_log`, 0.12.0), each in its state: pending and dead
/// as they are, leased with its token and expiry (the token keeps acking, as
/// src/lease.rs routes it to the log once no subscription reads the queue),
/// attempts, error history and `visible_at` kept; a dead event holds its
/// subject as it did on the queue (`blocks_subject`). Cancelled events leave
/// the archive too, so that replay finds them; delivered ones stay there as
/// the history of `default` (outbox._log_deliveries). Subject repairs go with
/// the queue. Returns the events moved.
pub const QUEUE_TO_LOG: Stmt = Stmt {
    sql: "WITH r AS (DELETE FROM outbox.subject_repairs), \
          q AS (DELETE FROM outbox.event_queue q RETURNING q.*), \
          a AS (DELETE FROM outbox.event_archive a WHERE a.state = 'cancelled' RETURNING a.*), \
          moved AS ( \
            INSERT INTO outbox.log_exceptions (subscription, id, lane, topic, subject, dispatch_key, payload, headers, \
                   max_attempts, published_at, state, attempts, visible_at, lease_token, leased_by, last_error, errors, \
                   blocks, dead_at, cancelled_at) \
            SELECT $1, q.id, outbox._lane(q.id, q.subject), q.topic, q.subject, q.dispatch_key, q.payload, q.headers, \
                   q.max_attempts, q.published_at, \
                   CASE WHEN q.state IN ('leased', 'dead') THEN q.state ELSE 'pending' END, q.attempts, q.visible_at, \
                   CASE WHEN q.state = 'leased' THEN q.lease_token END, q.leased_by, q.last_error, q.errors, \
                   CASE WHEN q.state = 'dead' THEN q.blocks_subject ELSE true END, q.dead_at, NULL \
              FROM q \
            UNION ALL \
            SELECT $1, a.id, outbox._lane(a.id, a.subject), a.topic, a.subject, a.dispatch_key, a.payload, a.headers, \
                   a.max_attempts, a.published_at, 'cancelled', a.attempts, a.finished_at, NULL, a.leased_by, \
                   a.last_error, a.errors, true, NULL, a.finished_at \
              FROM a \
            RETURNING 1) \
          SELECT count(*) FROM moved",
    types: &[pg_sys::TEXTOID],
};

/// A dropped subscription's lanes (drop_subscription, first).
pub const FORGET_LANES: Stmt =
    Stmt { sql: "DELETE FROM outbox.log_lanes WHERE subscription = $1", types: &[pg_sys::TEXTOID] };

/// A dropped subscription's batches (drop_subscription, once its leases are
/// counted): before its exception rows, in a statement of its own, so that
/// the next one's snapshot sees what a fail() holding a batch row wrote.
pub const FORGET_BATCHES: Stmt =
    Stmt { sql: "DELETE FROM outbox.log_batches WHERE subscription = $1", types: &[pg_sys::TEXTOID] };

/// The rest of a dropped subscription's state: exception rows, delivery
/// record, activity.
pub const FORGET_REST: Stmt = Stmt {
    sql: "WITH x AS (DELETE FROM outbox.log_exceptions WHERE subscription = $1), \
               d AS (DELETE FROM outbox.log_delivered WHERE subscription = $1) \
          DELETE FROM outbox.subscription_activity WHERE name = $1",
    types: &[pg_sys::TEXTOID],
};

/// Note when the subscription was last claimed from, only if no other
/// transaction holds or changed its activity row (`_lock_row`): a claim never
/// waits for this, and under REPEATABLE READ a row changed since the snapshot is
/// skipped, not a serialization failure.
pub const NOTE_CLAIM: Stmt = Stmt {
    sql: "UPDATE outbox.subscription_activity a SET last_claim_at = $2 \
           WHERE a.name = $1 AND outbox._lock_row('outbox.subscription_activity'::regclass::oid, a.ctid)",
    types: &[pg_sys::TEXTOID, pg_sys::TIMESTAMPTZOID],
};

pub const RAISE_LEASE: Stmt = Stmt {
    sql: "UPDATE outbox.event_queue SET visible_at = $2 WHERE id = ANY ($1) AND visible_at < $2",
    types: &[pg_sys::INT8ARRAYOID, pg_sys::TIMESTAMPTZOID],
};
