//! The log ring (src/log/mod.rs, sql/log.sql).

use crate::pg::plans::Stmt;
use pgrx::prelude::*;

/// The ring table publishers append to: the open one (opened, not sealed); none
/// before the first rotation, which means `log_0`.
pub const CURRENT: Stmt = Stmt {
    sql: "SELECT n FROM outbox.log_state WHERE opened_at IS NOT NULL AND sealed_at IS NULL \
          ORDER BY opened_at DESC LIMIT 1",
    types: &[],
};

/// One row into ring table `log_<n>`, for when the direct heap path is ruled out
/// (someone added a trigger, a rule, a column...): one statement per table, so
/// each is a saved plan.
macro_rules! append_one {
    ($n:literal) => {
        Stmt {
            sql: concat!(
                "INSERT INTO outbox.log_",
                $n,
                " (id, txid, lane, topic, subject, dispatch_key, payload, headers, max_attempts, published_at, deliver_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, now(), $10)"
            ),
            types: &[
                pg_sys::INT8OID,
                pg_sys::XID8OID,
                pg_sys::INT2OID,
                pg_sys::TEXTOID,
                pg_sys::TEXTOID,
                pg_sys::TEXTOID,
                pg_sys::JSONBOID,
                pg_sys::JSONBOID,
                pg_sys::INT4OID,
                pg_sys::TIMESTAMPTZOID,
            ],
        }
    };
}

/// [`append_one`] for each ring table, by number.
pub const APPEND_ONE: [Stmt; 4] = [append_one!("0"), append_one!("1"), append_one!("2"), append_one!("3")];

/// The maintenance step `log`: seal, rotate and truncate (sql/log.sql).
pub const ROTATE: Stmt = Stmt { sql: "SELECT outbox._log_rotate()", types: &[] };

/// A cursor's snapshot and `m`, under a snapshot taken now ([`plans::run_latest`]
/// pushes it as the active one, which `pg_current_snapshot()` returns); `m` is
/// read after the snapshot was taken.
///
/// [`plans::run_latest`]: crate::pg::plans::run_latest
pub const CURSOR: Stmt = Stmt {
    sql: "SELECT pg_current_snapshot()::text, COALESCE(pg_sequence_last_value('outbox.event_id_seq'), 0)",
    types: &[],
};

/// The window statement with select list `$cols` and tail `$tail` ([`WINDOW`]).
macro_rules! window_sql {
    ($cols:literal, $tail:literal) => {
        concat!(
            "/* generic plan */ SELECT ",
            $cols,
            " FROM ( \
               (SELECT e.id, e.subject, e.topic, e.deliver_at, e.published_at FROM outbox.log e \
                 WHERE e.lane = $1 AND e.id > greatest($3, $6) \
                   AND pg_visible_in_snapshot(e.txid, (SELECT $5::pg_snapshot)) \
                   AND NOT pg_visible_in_snapshot(e.txid, (SELECT $2::pg_snapshot)) \
                 ORDER BY e.id LIMIT $7) \
               UNION ALL \
               (SELECT e.id, e.subject, e.topic, e.deliver_at, e.published_at FROM outbox.log e \
                 WHERE e.txid = ANY (ARRAY(SELECT x FROM pg_snapshot_xip($2::pg_snapshot) AS x \
                                           WHERE pg_visible_in_snapshot(x, $5::pg_snapshot))) AND e.lane = $1 \
                   AND e.id + 0 > $6 AND e.id + 0 <= $3 \
                   AND pg_visible_in_snapshot(e.txid, (SELECT $5::pg_snapshot)) \
                   AND NOT pg_visible_in_snapshot(e.txid, (SELECT $2::pg_snapshot))) \
               UNION ALL \
               (SELECT e.id, e.subject, e.topic, e.deliver_at, e.published_at FROM outbox.log e \
                 WHERE e.txid = ANY (ARRAY(SELECT g::text::xid8 FROM generate_series( \
                         pg_snapshot_xmax($2::pg_snapshot)::text::int8, $4::xid8::text::int8 - 1) AS g \
                         WHERE pg_visible_in_snapshot(g::text::xid8, $5::pg_snapshot))) AND e.lane = $1 \
                   AND e.id + 0 > $6 AND e.id + 0 <= $3 \
                   AND pg_visible_in_snapshot(e.txid, (SELECT $5::pg_snapshot)) \
                   AND NOT pg_visible_in_snapshot(e.txid, (SELECT $2::pg_snapshot))) \
             ) w ",
            $tail
        )
    };
}

/// The events of lane $1 between the cursor ($2 snapshot, $3 m, $4 xn) and the
/// snapshot $5, ids above $6, at most $7 (NULL: all), in id order. The three
/// branches are the access paths: ids drawn after m (the `(lane, id)` index);
/// transactions running at the cursor, and those begun after it with an id
/// below xn (the `(txid, lane)` index: `id + 0` keeps the planner from reading
/// the lane's whole history through `(lane, id)` instead). Each branch applies
/// the definition (visible in $5, not in $2; the second probes only the
/// running transactions of $2 that $5 sees committed, the third only the ids
/// in `[xmax($2), xn)` that $5 sees committed (a handful: xn is read just
/// after the snapshot), so a transaction still open, however many events it
/// holds, costs them nothing); src/log/mod.rs proves the
/// branches find every event it accepts. The first branch, the one that grows
/// with a lane's backlog, is read in id order through the index and stops at
/// $7 rows (the first $7 of a union are among the first $7 of each branch);
/// the snapshots are cast once (InitPlans), not per row; and the plan is
/// generic (`/* generic plan */`, src/pg/plans.rs): a plan made for a
/// particular limit sorted the whole backlog instead.
pub const WINDOW: Stmt =
    Stmt { sql: window_sql!("w.id, w.subject, w.topic, w.deliver_at", "ORDER BY w.id LIMIT $7"), types: WINDOW_TYPES };

/// For each of the lanes $1 (cursors: $2 snapshots, $3 m, $4 xn, one each):
/// whether it has an event in its window up to this statement's snapshot
/// (`pg_current_snapshot()` under [`plans::run_latest`]), with that
/// snapshot's xmin, and the largest event id drawn (read after it).
/// [`WINDOW`]'s three branches, with nothing read yet, as one EXISTS each;
/// the late committers' two only where $5 says so (a lane whose cursor's
/// late committers were all found settled, src/log/claim.rs `quiet_lanes`).
/// The first is not probed when no id above the cursor's `m` was drawn at
/// all (the sequence's last value, read after the snapshot: an id drawn
/// later belongs to a transaction this snapshot does not see), which is
/// every lane of an idle log. One statement for every lane a claim would
/// otherwise visit with a window of its own: the window's plan (twelve index scans over
/// the ring) costs more to start than to run on an empty lane, and sixteen of
/// those made a claim of a quiet subscription take 3 ms. The late committers'
/// branches compare `lane + 0` so that every ring table is read through its
/// txid index (a small table's statistics chose a scan of the whole lane).
/// The first branch is a scalar subquery in id order with LIMIT 1, not an
/// EXISTS: the planner drops an EXISTS's ORDER BY and LIMIT and chose a
/// bitmap scan, which reads every index entry of the lane above `m` before
/// its first row (a claim of 100 behind 100,000 delayed events read 491
/// buffers in this statement; in id order, 171).
///
/// [`plans::run_latest`]: crate::pg::plans::run_latest
pub const LANES_WITH_NEWS: Stmt = Stmt {
    sql: "/* generic plan */ SELECT l.lane, \
            (l.m < (SELECT COALESCE(pg_sequence_last_value('outbox.event_id_seq'), 0)) \
             AND (SELECT e.id FROM outbox.log e WHERE e.lane = l.lane AND e.id > l.m \
                  AND pg_visible_in_snapshot(e.txid, (SELECT pg_current_snapshot())) \
                  AND NOT pg_visible_in_snapshot(e.txid, c.lo) ORDER BY e.id LIMIT 1) IS NOT NULL) \
            OR (l.late AND (EXISTS (SELECT 1 FROM outbox.log e \
                  WHERE e.txid = ANY (ARRAY(SELECT x FROM pg_snapshot_xip(c.lo) AS x \
                                            WHERE pg_visible_in_snapshot(x, (SELECT pg_current_snapshot())))) \
                    AND e.lane + 0 = l.lane AND e.id + 0 <= l.m \
                  AND pg_visible_in_snapshot(e.txid, (SELECT pg_current_snapshot())) \
                  AND NOT pg_visible_in_snapshot(e.txid, c.lo)) \
             OR EXISTS (SELECT 1 FROM outbox.log e \
                  WHERE e.txid = ANY (ARRAY(SELECT g::text::xid8 FROM generate_series( \
                          pg_snapshot_xmax(c.lo)::text::int8, c.xn::text::int8 - 1) AS g \
                          WHERE pg_visible_in_snapshot(g::text::xid8, (SELECT pg_current_snapshot())))) \
                    AND e.lane + 0 = l.lane AND e.id + 0 <= l.m \
                  AND pg_visible_in_snapshot(e.txid, (SELECT pg_current_snapshot())) \
                  AND NOT pg_visible_in_snapshot(e.txid, c.lo)))), \
            pg_snapshot_xmin((SELECT pg_current_snapshot()))::text, \
            (SELECT COALESCE(pg_sequence_last_value('outbox.event_id_seq'), 0)) \
          FROM unnest($1::int2[], $2::text[], $3::int8[], $4::text[], $5::bool[]) AS l(lane, lo, m, xn, late) \
          CROSS JOIN LATERAL (SELECT l.lo::pg_snapshot AS lo, l.xn::xid8 AS xn) c",
    types: LANES_NEWS_TYPES,
};

/// Parameters of [`LANES_WITH_NEWS`] and [`LANES_WITH_NEWS_SETTLED`]: lanes,
/// cursor snapshots, m, xn, and whether each cursor's late committers may
/// still appear.
const LANES_NEWS_TYPES: &[pg_sys::Oid] =
    &[pg_sys::INT2ARRAYOID, pg_sys::TEXTARRAYOID, pg_sys::INT8ARRAYOID, pg_sys::TEXTARRAYOID, pg_sys::BOOLARRAYOID];

/// [`LANES_WITH_NEWS`] for cursors that are all settled (no late-committer
/// branches, `$5` unused): a third of its plan to start, which is most of an
/// idle worker's claim.
pub const LANES_WITH_NEWS_SETTLED: Stmt = Stmt {
    sql: "/* generic plan */ SELECT l.lane, \
            (l.m < (SELECT COALESCE(pg_sequence_last_value('outbox.event_id_seq'), 0)) \
             AND (SELECT e.id FROM outbox.log e WHERE e.lane = l.lane AND e.id > l.m \
                  AND pg_visible_in_snapshot(e.txid, (SELECT pg_current_snapshot())) \
                  AND NOT pg_visible_in_snapshot(e.txid, l.lo::pg_snapshot) ORDER BY e.id LIMIT 1) IS NOT NULL), \
            pg_snapshot_xmin((SELECT pg_current_snapshot()))::text, \
            (SELECT COALESCE(pg_sequence_last_value('outbox.event_id_seq'), 0)) \
          FROM unnest($1::int2[], $2::text[], $3::int8[], $4::text[], $5::bool[]) AS l(lane, lo, m, xn, late)",
    types: LANES_NEWS_TYPES,
};

/// The rows of their own that wait behind an earlier row of their subject
/// (`parked_behind`, src/log/exceptions.rs, invariant 5), as CTEs over
/// subscription $1 and time $2: `heads` walks the distinct rows they wait
/// behind (one index probe each, a loose index scan of
/// `log_exceptions_piles`), and `pile_first` is, for each head that no longer
/// holds its subject, the pile's first unfinished row if it is due. No other
/// row of a pile can be claimable (it follows that one).
macro_rules! piles_cte {
    () => {
        "heads(h) AS ( \
           SELECT (SELECT min(p.parked_behind) FROM outbox.log_exceptions p \
                    WHERE p.subscription = $1 AND p.parked_behind IS NOT NULL AND p.state IN ('pending', 'leased')) \
           UNION ALL \
           SELECT (SELECT min(p.parked_behind) FROM outbox.log_exceptions p \
                    WHERE p.subscription = $1 AND p.parked_behind > heads.h AND p.state IN ('pending', 'leased')) \
             FROM heads WHERE heads.h IS NOT NULL \
         ), pile_first AS ( \
           SELECT f.* FROM heads \
            CROSS JOIN LATERAL (SELECT f.id, f.ctid AS row, f.topic, f.lease_token, f.attempts, f.max_attempts, \
                                       f.visible_at, f.subject, f.lane \
                                  FROM outbox.log_exceptions f \
                                 WHERE f.subscription = $1 AND f.parked_behind = heads.h \
                                   AND f.state IN ('pending', 'leased') \
                                 ORDER BY f.id LIMIT 1) f \
            WHERE heads.h IS NOT NULL AND f.visible_at <= $2 \
              AND NOT EXISTS (SELECT 1 FROM outbox.log_exceptions x \
                               WHERE x.subscription = $1 AND x.id = heads.h \
                                 AND (x.state IN ('pending', 'leased') OR (x.state = 'dead' AND x.blocks))) \
         )"
    };
}

/// [`WINDOW`] counted, with $7 NULL: how many events, and the smallest id,
/// of those a subscription's topic filter passes ($8 exact topics, $9
/// prefixes; both NULL: every topic; the filter of src/log/claim.rs `passes`)
/// that were available (published, and due if delayed) at or before $10
/// (NULL: whenever).
pub const WINDOW_COUNT: Stmt = Stmt {
    sql: window_sql!(
        "count(*), min(w.id)",
        "WHERE (($8::text[] IS NULL AND $9::text[] IS NULL) OR w.topic = ANY ($8::text[]) \
         OR EXISTS (SELECT 1 FROM unnest($9::text[]) AS p(prefix) WHERE starts_with(w.topic, p.prefix))) \
         AND ($10::timestamptz IS NULL OR greatest(w.published_at, w.deliver_at) <= $10::timestamptz)"
    ),
    types: &[
        pg_sys::INT2OID,
        pg_sys::TEXTOID,
        pg_sys::INT8OID,
        pg_sys::TEXTOID,
        pg_sys::TEXTOID,
        pg_sys::INT8OID,
        pg_sys::INT4OID,
        pg_sys::TEXTARRAYOID,
        pg_sys::TEXTARRAYOID,
        pg_sys::TIMESTAMPTZOID,
    ],
};

const WINDOW_TYPES: &[pg_sys::Oid] = &[
    pg_sys::INT2OID,
    pg_sys::TEXTOID,
    pg_sys::INT8OID,
    pg_sys::TEXTOID,
    pg_sys::TEXTOID,
    pg_sys::INT8OID,
    pg_sys::INT4OID,
];

/// The insert of a subscription's 16 lanes at one cursor ($2 snapshot, $3 m,
/// $4 xn), with `$cols`/`$vals` more columns and a `$cond` on inserting.
macro_rules! subscribe_sql {
    ($cols:literal, $vals:literal, $cond:expr) => {
        concat!(
            "INSERT INTO outbox.log_lanes (subscription, lane, lo_snap, lo_m, lo_xn",
            $cols,
            ") SELECT $1, g, $2::pg_snapshot, $3, $4::xid8",
            $vals,
            " FROM generate_series(0, 15) AS g ",
            $cond,
            " ON CONFLICT DO NOTHING RETURNING lane"
        )
    };
}

const SUBSCRIBE_TYPES: &[pg_sys::Oid] = &[pg_sys::TEXTOID, pg_sys::TEXTOID, pg_sys::INT8OID, pg_sys::TEXTOID];

/// A subscription's lanes, starting at one cursor (`_log_subscribe`), which
/// the lanes also keep as `start_snap`: events visible in it are not the
/// subscription's.
pub const SUBSCRIBE: Stmt =
    Stmt { sql: subscribe_sql!(", start_snap", ", $2::pg_snapshot", ""), types: SUBSCRIBE_TYPES };

/// The condition of [`SUBSCRIBE_LISTED`].
macro_rules! listed {
    () => {
        "WHERE EXISTS (SELECT 1 FROM outbox.subscription_catalog c WHERE c.name = $1 FOR KEY SHARE)"
    };
}

/// [`SUBSCRIBE`] for a subscription still in the catalog, whose row is
/// key-share locked (a drop_subscription in progress is waited for, and then
/// nothing is inserted).
pub const SUBSCRIBE_LISTED: Stmt =
    Stmt { sql: subscribe_sql!(", start_snap", ", $2::pg_snapshot", listed!()), types: SUBSCRIBE_TYPES };

/// The topics of events $2 of lane $1.
pub const TOPICS_OF: Stmt = Stmt {
    sql: "SELECT l.id, l.topic FROM outbox.log l WHERE l.lane = $1 AND l.id = ANY ($2)",
    types: &[pg_sys::INT2OID, pg_sys::INT8ARRAYOID],
};

/// A subscription's lanes, with each row's ctid for `_lock_row`, and the
/// events cancelled before the lane read them; with each lane's batch state
/// and whether deferred calls wait on it: a claim's look at a batch before it
/// tries the batch's lock (src/log/claim.rs, `Claim::serve`), read here in
/// the same statement, not in one more per lane.
pub const LANES: Stmt = Stmt {
    sql: "SELECT n.ctid, n.lane, n.lo_snap::text, n.lo_m, n.lo_xn::text, n.hi_snap::text, n.hi_m, n.hi_xn::text, \
                 n.pos, b.id, n.skips, b.state, \
                 b.id IS NOT NULL AND EXISTS (SELECT 1 FROM outbox.log_deferred d WHERE d.batch = b.id) \
            FROM outbox.log_lanes n LEFT JOIN outbox.log_batches b ON b.id = n.batch \
           WHERE n.subscription = $1",
    types: &[pg_sys::TEXTOID],
};

/// [`LANES`] for a claim at $2, each row with two values computed once: the
/// largest event id drawn (0 before the first; no event has a larger one,
/// committed or not: src/log/claim.rs `quiet_lanes`), and whether subscription
/// $1 has a row of its own that may be claimable (pending or leased, its time
/// come, and not waiting behind a row that holds its subject), without which
/// the claim does not run [`EXC_CLAIM`], whose plan costs more to start than
/// this probe. Three statements a claim made in turn are one: an idle
/// worker's claim made four in all, and each costs more to start than to run.
pub const CLAIM_LANES: Stmt = Stmt {
    sql: concat!(
        "WITH RECURSIVE ",
        piles_cte!(),
        " SELECT n.ctid, n.lane, n.lo_snap::text, n.lo_m, n.lo_xn::text, n.hi_snap::text, n.hi_m, n.hi_xn::text, \
                 n.pos, b.id, n.skips, b.state, \
                 b.id IS NOT NULL AND EXISTS (SELECT 1 FROM outbox.log_deferred d WHERE d.batch = b.id), \
                 (SELECT COALESCE(pg_sequence_last_value('outbox.event_id_seq'), 0)), \
                 (SELECT EXISTS (SELECT 1 FROM outbox.log_exceptions e \
                          WHERE e.subscription = $1 AND e.state IN ('pending', 'leased') AND e.parked_behind IS NULL \
                            AND e.visible_at <= $2) \
                     OR EXISTS (SELECT 1 FROM pile_first)) \
            FROM outbox.log_lanes n LEFT JOIN outbox.log_batches b ON b.id = n.batch \
           WHERE n.subscription = $1"
    ),
    types: &[pg_sys::TEXTOID, pg_sys::TIMESTAMPTZOID],
};

/// The UPDATE of a lane's cursor, window, skips and batch (`$batch`).
macro_rules! lane_put {
    ($batch:literal) => {
        concat!(
            "UPDATE outbox.log_lanes SET lo_snap = $3::pg_snapshot, lo_m = $4, lo_xn = $5::xid8, \
             hi_snap = $6::pg_snapshot, hi_m = $7, hi_xn = $8::xid8, pos = $9, batch = ",
            $batch,
            ", skips = $11 WHERE subscription = $1 AND lane = $2"
        )
    };
}

const LANE_PUT_TYPES: [pg_sys::Oid; 11] = [
    pg_sys::TEXTOID,
    pg_sys::INT2OID,
    pg_sys::TEXTOID,
    pg_sys::INT8OID,
    pg_sys::TEXTOID,
    pg_sys::TEXTOID,
    pg_sys::INT8OID,
    pg_sys::TEXTOID,
    pg_sys::INT8OID,
    pg_sys::INT8OID,
    pg_sys::INT8ARRAYOID,
];

/// Write a lane's cursor, window, batch and skips (the caller holds its row).
pub const LANE_PUT: Stmt = Stmt { sql: lane_put!("$10"), types: &LANE_PUT_TYPES };

/// [`LANE_PUT_TYPES`] with $10 the new batch's state and $12 its first worker.
const LANE_PUT_NEW_BATCH_TYPES: [pg_sys::Oid; 12] = {
    let mut t = [pg_sys::TEXTOID; 12];
    let mut i = 0;
    while i < LANE_PUT_TYPES.len() {
        t[i] = LANE_PUT_TYPES[i];
        i += 1;
    }
    t[9] = pg_sys::BYTEAOID;
    t
};

/// [`LANE_PUT`] of a lane whose new batch is inserted by the same statement:
/// state $10, its first round worker $12's, with a fresh id (returned). A
/// claim that starts a batch wrote it and then the lane in two statements;
/// in a steady stream that is most claims.
pub const LANE_PUT_NEW_BATCH: Stmt = Stmt {
    sql: concat!(
        "WITH b AS (INSERT INTO outbox.log_batches (id, subscription, lane, state, leased_by) \
                    VALUES (nextval('outbox.log_batch_seq'), $1, $2, $10, ARRAY[$12]) RETURNING id) ",
        lane_put!("(SELECT id FROM b)"),
        " RETURNING batch"
    ),
    types: &LANE_PUT_NEW_BATCH_TYPES,
};

/// A batch's state, lane, subscription and the workers of its rounds (read
/// under the batch's advisory lock).
pub const BATCH_GET: Stmt = Stmt {
    sql: "SELECT state, lane, subscription, leased_by, \
                 EXISTS (SELECT 1 FROM outbox.log_deferred d WHERE d.batch = $1) \
            FROM outbox.log_batches WHERE id = $1",
    types: &[pg_sys::INT8OID],
};

/// The states of batches $1 (those that still exist), for an ack of
/// events of several batches: one statement, not one per batch.
pub const BATCH_GET_MANY: Stmt = Stmt {
    sql: "SELECT b.id, b.state, EXISTS (SELECT 1 FROM outbox.log_deferred d WHERE d.batch = b.id) \
            FROM outbox.log_batches b WHERE b.id = ANY ($1)",
    types: &[pg_sys::INT8ARRAYOID],
};

/// Whether batch $1 exists (an insert into the exception table that placed
/// nothing: its batch gone, or its events lost to `max_lag`).
pub const BATCH_EXISTS: Stmt =
    Stmt { sql: "SELECT 1 FROM outbox.log_batches WHERE id = $1", types: &[pg_sys::INT8OID] };

/// Whether subscription $1 has a `max_lag` (retention may pass it).
pub const SUB_HAS_MAX_LAG: Stmt = Stmt {
    sql: "SELECT 1 FROM outbox.subscription_catalog WHERE name = $1 AND max_lag IS NOT NULL",
    types: &[pg_sys::TEXTOID],
};

/// Add $2 events to subscription $1's `lost_events`.
pub const NOTE_LOST: Stmt = Stmt {
    sql: "UPDATE outbox.subscription_activity SET lost_events = lost_events + $2, lost_at = now() WHERE name = $1",
    types: &[pg_sys::TEXTOID, pg_sys::INT8OID],
};

/// A call deferred to its transaction's commit (src/log/deferred.rs): batch
/// $1, event $2, token $3, call $4 ('a', 'f', 'e'), made at $5, with $6
/// (microseconds), $7 (permanent) and $8 (error).
pub const DEFERRED_INSERT: Stmt = Stmt {
    sql: "INSERT INTO outbox.log_deferred (batch, id, token, call, at, us, permanent, error) \
          VALUES ($1, $2, $3, $4::\"char\", $5, $6, $7, $8)",
    types: &[
        pg_sys::INT8OID,
        pg_sys::INT8OID,
        pg_sys::UUIDOID,
        pg_sys::TEXTOID,
        pg_sys::TIMESTAMPTZOID,
        pg_sys::INT8OID,
        pg_sys::BOOLOID,
        pg_sys::TEXTOID,
    ],
};

/// The deferred calls on batch $1 this transaction sees (committed ones not
/// yet applied, and its own), in the order they were made.
pub const DEFERRED_OF: Stmt = Stmt {
    sql: "SELECT id, token, call::text, at, us, permanent, error FROM outbox.log_deferred \
           WHERE batch = $1 ORDER BY seq",
    types: &[pg_sys::INT8OID],
};

/// [`DEFERRED_OF`], deleting them: for the holder of the batch's lock, which
/// applies them.
pub const DEFERRED_TAKE: Stmt = Stmt {
    sql: "WITH d AS (DELETE FROM outbox.log_deferred WHERE batch = $1 \
                     RETURNING seq, id, token, call, at, us, permanent, error) \
          SELECT id, token, call::text, at, us, permanent, error FROM d ORDER BY seq",
    types: &[pg_sys::INT8OID],
};

/// Whether committed deferred calls on event $2 of batch $1 wait to be
/// applied or forwarded.
pub const DEFERRED_PENDING: Stmt = Stmt {
    sql: "SELECT EXISTS (SELECT 1 FROM outbox.log_deferred WHERE batch = $1 AND id = $2)",
    types: &[pg_sys::INT8OID, pg_sys::INT8OID],
};

/// Deferred calls whose batch is gone (finished, or its subscription
/// dropped), deleted, for the maintenance sweep that forwards them to the
/// events' rows of their own.
pub const DEFERRED_ORPHANS: Stmt = Stmt {
    sql: "WITH d AS (DELETE FROM outbox.log_deferred d \
                      WHERE NOT EXISTS (SELECT 1 FROM outbox.log_batches b WHERE b.id = d.batch) \
                     RETURNING seq, id, token, call, at, us, permanent, error) \
          SELECT id, token, call::text, at, us, permanent, error FROM d ORDER BY seq",
    types: &[],
};

/// Write the states $2 of batches $1 (in order) in one statement.
pub const BATCH_PUT_MANY: Stmt = Stmt {
    sql: "UPDATE outbox.log_batches b SET state = u.state FROM unnest($1::int8[], $2::bytea[]) AS u(id, state) \
           WHERE b.id = u.id RETURNING b.id",
    types: &[pg_sys::INT8ARRAYOID, pg_sys::BYTEAARRAYOID],
};

/// [`BATCH_PUT_MANY`] for the rounds one claim handed out: each batch's round
/// $3 (in order) is kept as worker $4's. Returns the ids written.
pub const BATCH_PUT_ROUNDS: Stmt = Stmt {
    sql: "UPDATE outbox.log_batches b SET state = u.state, leased_by[u.round] = $4 \
            FROM unnest($1::int8[], $2::bytea[], $3::int4[]) AS u(id, state, round) \
           WHERE b.id = u.id RETURNING b.id",
    types: &[pg_sys::INT8ARRAYOID, pg_sys::BYTEAARRAYOID, pg_sys::INT4ARRAYOID, pg_sys::TEXTOID],
};

/// Write batch $1's state $2 and its rounds' workers $3 (extend_lease of one
/// event of a shared round: its round of its own keeps its worker).
pub const BATCH_PUT_HOLDERS: Stmt = Stmt {
    sql: "UPDATE outbox.log_batches SET state = $2, leased_by = $3 WHERE id = $1 RETURNING id",
    types: &[pg_sys::INT8OID, pg_sys::BYTEAOID, pg_sys::TEXTARRAYOID],
};

/// The states of a subscription's batches with their rounds' workers
/// (`_log_batch_holders`).
pub const BATCH_HOLDERS: Stmt = Stmt {
    sql: "SELECT state, leased_by FROM outbox.log_batches WHERE subscription = $1 AND leased_by IS NOT NULL",
    types: &[pg_sys::TEXTOID],
};

/// A subscription's batch ids, ascending (`_log_in_flight` locks them in that order).
pub const BATCH_IDS: Stmt =
    Stmt { sql: "SELECT id FROM outbox.log_batches WHERE subscription = $1 ORDER BY id", types: &[pg_sys::TEXTOID] };

/// A subscription's exception rows, locked: waits for the transactions
/// changing them (`_log_in_flight`).
pub const EXC_LOCK_ALL: Stmt =
    Stmt { sql: "SELECT 1 FROM outbox.log_exceptions WHERE subscription = $1 FOR UPDATE", types: &[pg_sys::TEXTOID] };

/// The states of a subscription's batches (`_log_in_flight`).
pub const BATCH_STATES: Stmt =
    Stmt { sql: "SELECT state FROM outbox.log_batches WHERE subscription = $1", types: &[pg_sys::TEXTOID] };

pub const BATCH_PUT: Stmt = Stmt {
    sql: "UPDATE outbox.log_batches SET state = $2 WHERE id = $1 RETURNING id",
    types: &[pg_sys::INT8OID, pg_sys::BYTEAOID],
};

pub const BATCH_DELETE: Stmt =
    Stmt { sql: "DELETE FROM outbox.log_batches WHERE id = $1 RETURNING id", types: &[pg_sys::INT8OID] };

/// The lane's latest delivery record row, when it was opened in the last
/// ten seconds and no one else holds it: its time and encoding, locked, for a
/// record that joins it ([`DELIVERED_JOIN`]).
pub const DELIVERED_TAIL: Stmt = Stmt {
    sql: "SELECT finished_at, state FROM outbox.log_delivered \
           WHERE subscription = $1 AND lane = $2 AND finished_at > statement_timestamp() - interval '10 seconds' \
             AND opened_at > statement_timestamp() - interval '10 seconds' \
           ORDER BY finished_at DESC LIMIT 1 FOR UPDATE SKIP LOCKED",
    types: &[pg_sys::TEXTOID, pg_sys::INT2OID],
};

/// Rewrite subscription $1's record row of lane $2 written at $3 with the
/// encoding $4 (its events and the ones joining it), delivered now.
pub const DELIVERED_JOIN: Stmt = Stmt {
    sql: "UPDATE outbox.log_delivered SET state = $4, finished_at = statement_timestamp() \
           WHERE subscription = $1 AND lane = $2 AND finished_at = $3 RETURNING 1",
    types: &[pg_sys::TEXTOID, pg_sys::INT2OID, pg_sys::TIMESTAMPTZOID, pg_sys::BYTEAOID],
};

/// The acked events $3 (an encoding of delivered events) of subscription $1's
/// lane $2, with the time: their delivery time, for the views.
pub const DELIVERED_INSERT: Stmt = Stmt {
    sql: "INSERT INTO outbox.log_delivered (subscription, lane, finished_at, state) \
          VALUES ($1, $2, statement_timestamp(), $3)",
    types: &[pg_sys::TEXTOID, pg_sys::INT2OID, pg_sys::BYTEAOID],
};

/// [`BATCH_DELETE`] for a finished batch: its subscription and lane, for
/// its delivery record.
pub const BATCH_FINISH: Stmt = Stmt {
    sql: "DELETE FROM outbox.log_batches WHERE id = $1 RETURNING subscription, lane",
    types: &[pg_sys::INT8OID],
};

/// [`BATCH_FINISH`] with the lane's [`DELIVERED_TAIL`] (time and encoding,
/// locked; NULL when there is none), for a finished batch whose acked events
/// are to be recorded: one statement where an ack that finished its batch
/// made two.
pub const BATCH_FINISH_TAIL: Stmt = Stmt {
    sql: "WITH d AS (DELETE FROM outbox.log_batches WHERE id = $1 RETURNING subscription, lane) \
          SELECT d.subscription, d.lane, t.finished_at, t.state FROM d \
            LEFT JOIN LATERAL (SELECT x.finished_at, x.state FROM outbox.log_delivered x \
                  WHERE x.subscription = d.subscription AND x.lane = d.lane \
                    AND x.finished_at > statement_timestamp() - interval '10 seconds' \
                    AND x.opened_at > statement_timestamp() - interval '10 seconds' \
                  ORDER BY x.finished_at DESC LIMIT 1 FOR UPDATE SKIP LOCKED) t ON true",
    types: &[pg_sys::INT8OID],
};

/// The finished batches of subscription $1 since $2 (NULL: all), for
/// delivery times (`outbox._log_delivered`).
pub const DELIVERED_BATCHES: Stmt = Stmt {
    sql: "SELECT finished_at, state FROM outbox.log_delivered \
           WHERE subscription = $1 AND ($2::timestamptz IS NULL OR finished_at >= $2)",
    types: &[pg_sys::TEXTOID, pg_sys::TIMESTAMPTZOID],
};

/// The claimed events' rows, with the round's token and lease expiry, as
/// `outbox.claim` returns them (attempt 1: an event goes out of a batch once).
pub const FETCH: Stmt = Stmt {
    sql: "SELECT l.id, l.topic, l.subject, l.dispatch_key, l.payload, l.headers, 1::int4, $3::uuid, $4::timestamptz, \
                 l.published_at \
          FROM outbox.log l WHERE l.lane = $1 AND l.id = ANY ($2) ORDER BY l.id",
    types: &[pg_sys::INT2OID, pg_sys::INT8ARRAYOID, pg_sys::UUIDOID, pg_sys::TIMESTAMPTZOID],
};

/// [`FETCH`] for a dense run of picks: every event of lane $1 with an id from
/// $2 to $3, in id order, read as one range of the `(lane, id)` index instead
/// of one descent per id; the caller keeps the picks among them. $6 is the
/// most rows the range can hold ($3 - $2 + 1): with it the generic plan reads
/// the ring tables' indexes in order (a merge), with no sort.
pub const FETCH_RANGE: Stmt = Stmt {
    sql: "/* generic plan */ SELECT l.id, l.topic, l.subject, l.dispatch_key, l.payload, l.headers, 1::int4, \
                 $4::uuid, $5::timestamptz, l.published_at \
          FROM outbox.log l WHERE l.lane = $1 AND l.id >= $2 AND l.id <= $3 ORDER BY l.id LIMIT $6",
    types: &[
        pg_sys::INT2OID,
        pg_sys::INT8OID,
        pg_sys::INT8OID,
        pg_sys::UUIDOID,
        pg_sys::TIMESTAMPTZOID,
        pg_sys::INT8OID,
    ],
};

/// [`FETCH`] for the sparse rounds of one claim in several lanes, in one
/// statement: the events ($1 lane, $2 id, $3 token, $4 lease expiry, one
/// element each), in the order given.
pub const FETCH_MANY: Stmt = Stmt {
    sql: "/* generic plan */ SELECT l.id, l.topic, l.subject, l.dispatch_key, l.payload, l.headers, 1::int4, \
                 p.token, p.expires, l.published_at \
          FROM unnest($1::int2[], $2::int8[], $3::uuid[], $4::timestamptz[]) WITH ORDINALITY \
               AS p(lane, id, token, expires, n) \
          JOIN outbox.log l ON l.lane = p.lane AND l.id = p.id ORDER BY p.n",
    types: &[pg_sys::INT2ARRAYOID, pg_sys::INT8ARRAYOID, pg_sys::UUIDARRAYOID, pg_sys::TIMESTAMPTZARRAYOID],
};

/// What fail() needs to decide a batch event's fate: its max_attempts and its
/// topic's backoff.
pub const FAIL_INFO: Stmt = Stmt {
    sql: "SELECT l.max_attempts, t.backoff_base, t.backoff_max \
          FROM outbox.log l LEFT JOIN outbox.topics t ON t.topic = l.topic WHERE l.lane = $1 AND l.id = $2",
    types: &[pg_sys::INT2OID, pg_sys::INT8OID],
};

/// SQL condition on a row `$r` of the log (`l`) or of the exception table
/// (`e`): a dead letter of it holds its subject, under the subscription's
/// dead-letter policy ($p, NULL: none), else the topic's, else 'block'.
macro_rules! dead_blocks {
    ($r:literal, $p:literal) => {
        concat!(
            $r,
            ".subject IS NOT NULL AND COALESCE(",
            $p,
            ", (SELECT t.dead_letter_policy FROM outbox.topics t WHERE t.topic = ",
            $r,
            ".topic), 'block') = 'block'"
        )
    };
}

/// Move events of lane $2 from a batch of subscription $1 into the exception
/// table (src/log/exceptions.rs), copying them from the log. Per event ($3 ids)
/// a kind ($4): `parked` (behind another, delayed, or outside the claim's
/// topics: pending from its deliver_at, no attempt yet), `leased` (moved out
/// of a batch while out under a lease, expired or not: still leased, token $6,
/// expiry $5, one attempt; a claim that takes it again records 'lease expired'
/// and makes it dead when that was its last), `retry`
/// (failed: pending from $5 with error $7) and `dead` (failed for good). $8 is
/// the subscription's dead-letter policy (NULL: not set).
/// With $9, only while batch $9 exists (key-share locked: a drop_subscription
/// that removed it first makes this insert nothing). $10: per event, the worker
/// that held it in the batch (its row's leased_by and the history's worker).
/// A row with a subject waits behind (`parked_behind`) the subject's first row
/// that holds it here, else the subject's first event of this insert
/// (src/log/exceptions.rs, invariant 5).
pub const EXC_INSERT: Stmt = Stmt {
    sql: concat!(
        "INSERT INTO outbox.log_exceptions AS e (subscription, id, lane, topic, subject, dispatch_key, payload, headers, \
           max_attempts, published_at, state, attempts, visible_at, lease_token, last_error, errors, blocks, dead_at, \
           leased_by, parked_behind) \
         SELECT $1, l.id, l.lane, l.topic, l.subject, l.dispatch_key, l.payload, l.headers, l.max_attempts, l.published_at, \
                y.state, y.attempts, greatest(x.visible_at, l.deliver_at), \
                CASE WHEN x.kind = 'leased' THEN x.token END, \
                y.error, \
                CASE WHEN y.error IS NOT NULL THEN jsonb_build_array(jsonb_build_object( \
                  'attempt', 1, 'at', clock_timestamp(), 'worker', x.worker, 'error', y.error)) END, \
                CASE WHEN y.state = 'dead' THEN ",
        dead_blocks!("l", "$8"),
        " ELSE true END, \
                CASE WHEN y.state = 'dead' THEN clock_timestamp() END, \
                x.worker, \
                CASE WHEN l.subject IS NOT NULL THEN COALESCE( \
                  (SELECT min(p.id) FROM outbox.log_exceptions p \
                    WHERE p.subscription = $1 AND p.lane = $2 AND p.subject = l.subject AND p.id < l.id \
                      AND (p.state IN ('pending', 'leased') OR (p.state = 'dead' AND p.blocks))), \
                  NULLIF(min(l.id) OVER (PARTITION BY l.subject), l.id)) END \
           FROM unnest($3::int8[], $4::text[], $5::timestamptz[], $6::uuid[], $7::text[], $10::text[]) \
                  AS x(id, kind, visible_at, token, error, worker) \
           JOIN outbox.log l ON l.lane = $2 AND l.id = x.id \
          CROSS JOIN (SELECT $9::int8 IS NULL OR EXISTS ( \
                        SELECT 1 FROM outbox.log_batches b WHERE b.id = $9 FOR KEY SHARE) AS ok) g \
          CROSS JOIN LATERAL (SELECT \
                CASE x.kind WHEN 'parked' THEN 'pending' WHEN 'retry' THEN 'pending' WHEN 'dead' THEN 'dead' \
                            WHEN 'leased' THEN 'leased' \
                     END AS state, \
                CASE WHEN x.kind = 'parked' THEN 0 ELSE 1 END AS attempts, \
                x.error AS error) y \
          WHERE g.ok \
         RETURNING e.id"
    ),
    types: &[
        pg_sys::TEXTOID,
        pg_sys::INT2OID,
        pg_sys::INT8ARRAYOID,
        pg_sys::TEXTARRAYOID,
        pg_sys::TIMESTAMPTZARRAYOID,
        pg_sys::UUIDARRAYOID,
        pg_sys::TEXTARRAYOID,
        pg_sys::TEXTOID,
        pg_sys::INT8OID,
        pg_sys::TEXTARRAYOID,
    ],
};

/// Which of the subjects $3 have a row in subscription $1's lane $2 of the
/// exception table that holds them: their events continue there, in order.
pub const EXC_OPEN_SUBJECTS: Stmt = Stmt {
    sql: "SELECT DISTINCT e.subject FROM outbox.log_exceptions e \
           WHERE e.subscription = $1 AND e.lane = $2 AND e.subject = ANY ($3) \
             AND e.subject IS NOT NULL AND (e.state IN ('pending', 'leased') OR (e.state = 'dead' AND e.blocks))",
    types: &[pg_sys::TEXTOID, pg_sys::INT2OID, pg_sys::TEXTARRAYOID],
};

/// SQL condition on exception row `e`: it has used its attempts and goes dead
/// instead of being leased again ($9: the subscription's max_attempts). Rows
/// with a token are leases that expired (a claim's, or a batch's moved here);
/// a pending row past its attempts is one whose subscription lowered them.
macro_rules! exc_exhausted {
    () => {
        "e.attempts >= COALESCE($9, e.max_attempts) AND (e.lease_token IS NOT NULL OR e.attempts > 0)"
    };
}

/// Claim up to $3 rows of subscription $1's exception table: pending or
/// expired rows whose time ($2) has come and whose subject has no earlier row
/// that holds it and no other row leased now (a replayed event may sit before
/// a later one already out), in (visible_at, id) order, each taken with `_lock_row` (never
/// waits), narrowed to the topics $6 (exact) and $7 (prefixes) when $6 is not
/// NULL. Each gets a token of its own, derived from $4 and its id (version 8,
/// kind 1, as [`crate::log::batch::exception_token`] spells one), lease $5 (with $11 false, the lease of the row's
/// topic when it sets one, else $5) and worker $8; an expired lease on the
/// last attempt goes dead instead ($10: the subscription's dead-letter
/// policy). Rows that wait behind a row holding their subject are not read:
/// the candidates are the rows that wait behind none, and the first row of
/// each pile whose head has finished (`piles_cte`). Columns 1-10 are claim's result; 11 is false for a row that went
/// dead (not returned). A row it would turn dead under its topic's policy is
/// taken only with that topic's dead-letter policy lock (first key $12) in
/// share mode, tried without waiting (src/log/exceptions.rs, invariant 4);
/// [`EXC_DEAD_POLICY`] then reads the policy again under a newer snapshot.
/// A row whose expired lease a batch handed out is taken only with its
/// event's hold (`outbox._releasable`, src/log/deferred.rs): a deferred call
/// by that token may still be open, or committed and not yet forwarded.
///
/// The subject test is two probes, each bounded by an index
/// (`log_exceptions_open`; `log_exceptions_leased`), not one probe
/// with an OR: that one read every row of the subscription leased into the
/// future for each blocked row it passed, and after a consumer's crash had
/// parked thousands of rows a claim took seconds (found with the relay's
/// SIGKILL test).
pub const EXC_CLAIM: Stmt = Stmt {
    sql: concat!(
        "WITH RECURSIVE ",
        piles_cte!(),
        ", src AS ( \
           SELECT e.id, e.ctid AS row, e.topic, e.lease_token, e.attempts, e.max_attempts, e.visible_at, \
                  e.subject, e.lane \
             FROM outbox.log_exceptions e \
            WHERE e.subscription = $1 AND e.state IN ('pending', 'leased') AND e.parked_behind IS NULL \
              AND e.visible_at <= $2 \
           UNION ALL \
           SELECT * FROM pile_first \
         ), cand AS ( \
           SELECT r.id FROM ( \
             SELECT e.id, e.row, e.topic, e.lease_token AS tok, $10::text IS NULL AND ",
        exc_exhausted!(),
        " AS dies \
               FROM src e \
              WHERE ($6::text[] IS NULL OR e.topic = ANY ($6) OR e.topic ^@ ANY ($7)) \
                AND (e.subject IS NULL OR (NOT EXISTS ( \
                     SELECT 1 FROM outbox.log_exceptions p \
                      WHERE p.subscription = $1 AND p.lane = e.lane AND p.subject = e.subject AND p.id < e.id \
                        AND (p.state IN ('pending', 'leased') OR (p.state = 'dead' AND p.blocks))) \
                 AND NOT EXISTS ( \
                     SELECT 1 FROM outbox.log_exceptions p \
                      WHERE p.subscription = $1 AND p.lane = e.lane AND p.subject = e.subject \
                        AND p.state = 'leased' AND p.visible_at > $2 AND p.id <> e.id))) \
              ORDER BY e.visible_at, e.id OFFSET 0) r \
            WHERE (NOT r.dies OR outbox._try_policy_lock(r.topic)) \
              AND CASE WHEN outbox._lock_row('outbox.log_exceptions'::regclass::oid, r.row) \
                       THEN r.tok IS NULL OR outbox._releasable(r.tok, r.id) ELSE false END LIMIT $3 \
         ), upd AS ( \
           UPDATE outbox.log_exceptions e SET \
             state = CASE WHEN ",
        exc_exhausted!(),
        " THEN 'dead' ELSE 'leased' END, \
             attempts = CASE WHEN ",
        exc_exhausted!(),
        " THEN e.attempts ELSE e.attempts + 1 END, \
             lease_token = CASE WHEN ",
        exc_exhausted!(),
        " THEN NULL ELSE overlay(overlay(md5($4::text || e.id::text) PLACING '81' FROM 13 FOR 2) \
               PLACING '8' FROM 17 FOR 1)::uuid END, \
             visible_at = CASE WHEN ",
        exc_exhausted!(),
        " THEN e.visible_at ELSE clock_timestamp() + CASE WHEN $11 THEN $5 \
               ELSE LEAST(COALESCE((SELECT t.default_lease FROM outbox.topics t WHERE t.topic = e.topic), $5), $12) END END, \
             leased_by = CASE WHEN ",
        exc_exhausted!(),
        " THEN e.leased_by ELSE $8 END, \
             last_error = CASE WHEN e.lease_token IS NOT NULL THEN 'lease expired' ELSE e.last_error END, \
             errors = CASE WHEN e.lease_token IS NOT NULL THEN ",
        crate::history_append!(
            "e.errors",
            "jsonb_build_object('attempt', e.attempts, 'at', clock_timestamp(), 'worker', e.leased_by, 'error', 'lease expired')"
        ),
        " ELSE e.errors END, \
             dead_at = CASE WHEN ",
        exc_exhausted!(),
        " THEN clock_timestamp() END, \
             blocks = CASE WHEN ",
        exc_exhausted!(),
        " THEN ",
        dead_blocks!("e", "$10"),
        " ELSE e.blocks END \
           WHERE e.subscription = $1 AND e.id = ANY (ARRAY(SELECT c.id FROM cand c)) \
           RETURNING e.id, e.topic, e.subject, e.dispatch_key, e.payload, e.headers, e.attempts, e.lease_token, \
                     e.visible_at, e.published_at, e.state = 'leased' AS leased \
         ) SELECT * FROM upd ORDER BY id"
    ),
    types: &[
        pg_sys::TEXTOID,
        pg_sys::TIMESTAMPTZOID,
        pg_sys::INT4OID,
        pg_sys::UUIDOID,
        pg_sys::INTERVALOID,
        pg_sys::TEXTARRAYOID,
        pg_sys::TEXTARRAYOID,
        pg_sys::TEXTOID,
        pg_sys::INT4OID,
        pg_sys::TEXTOID,
        pg_sys::BOOLOID,
        pg_sys::INTERVALOID,
    ],
};

/// The rows $2 of subscription $1 that a claim has just turned dead (with the
/// topic's dead-letter policy lock held: src/log/exceptions.rs, invariant 4)
/// take their topic's policy as of now: [`EXC_CLAIM`] read it under the
/// snapshot its statement began with, which may predate a policy change that
/// committed before the claim took the lock. Only for subscriptions without a
/// policy of their own.
pub const EXC_DEAD_POLICY: Stmt = Stmt {
    sql: concat!(
        "UPDATE outbox.log_exceptions e SET blocks = ",
        dead_blocks!("e", "NULL::text"),
        " WHERE e.subscription = $1 AND e.id = ANY ($2) AND e.state = 'dead' \
            AND e.blocks IS DISTINCT FROM (",
        dead_blocks!("e", "NULL::text"),
        ")"
    ),
    types: &[pg_sys::TEXTOID, pg_sys::INT8ARRAYOID],
};

/// Ack exception rows: delivered, with their attempt history kept for
/// retention. A pair (id $1[i], token $2[i])
/// matches the row the token leases now, or the batch lease of a row moved
/// here that no claim has handed out again; each pair on its own (one id may
/// come with the tokens of several subscriptions).
pub const EXC_ACK: Stmt = Stmt {
    sql:
        "UPDATE outbox.log_exceptions e SET state = 'delivered', delivered_at = clock_timestamp(), lease_token = NULL \
            FROM unnest($1::int8[], $2::uuid[]) AS p(id, tok) \
           WHERE e.lease_token = p.tok AND e.id = p.id AND e.state IN ('pending', 'leased') \
          RETURNING e.id",
    types: &[pg_sys::INT8ARRAYOID, pg_sys::UUIDARRAYOID],
};

/// The exception row (id $1) token $2 holds, locked for fail(), with what
/// fail() needs to decide: attempts, max_attempts, the topic's backoff, the
/// subscription.
pub const EXC_FAIL_LOCK: Stmt = Stmt {
    sql: "SELECT e.attempts, e.max_attempts, t.backoff_base, t.backoff_max, e.subscription \
            FROM outbox.log_exceptions e LEFT JOIN outbox.topics t ON t.topic = e.topic \
           WHERE e.lease_token = $2 AND e.id = $1 AND e.state IN ('pending', 'leased') FOR UPDATE OF e",
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID],
};

/// The topic of the log event $2 (lane $1): fail() of a batch event takes
/// that topic's dead-letter policy lock before it decides the event's fate
/// (src/log/exceptions.rs, invariant 4).
pub const LOG_EVENT_TOPIC: Stmt = Stmt {
    sql: "SELECT l.topic FROM outbox.log l WHERE l.lane = $1 AND l.id = $2",
    types: &[pg_sys::INT2OID, pg_sys::INT8OID],
};

/// The topic of the exception row $1 that token $2 leases: [`LOG_EVENT_TOPIC`]
/// for fail() of an exception row, before the row is locked.
pub const EXC_EVENT_TOPIC: Stmt = Stmt {
    sql: "SELECT e.topic FROM outbox.log_exceptions e WHERE e.id = $1 AND e.lease_token = $2 LIMIT 1",
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID],
};

/// The log's part of a topic's dead-letter policy change (src/log/exceptions.rs,
/// `apply_dead_letter_policy`, with the topic's policy lock held exclusively):
/// the dead rows of topic $1 in subscriptions that follow the topic's policy
/// take policy $2. Runs under the latest snapshot, so that an alter_topic
/// inside a REPEATABLE READ transaction still sees a dead letter that
/// committed while it waited for the lock (test_liveness,
/// `test_policy_switch_racing_a_dead_transition[log-*]`). Returns how many
/// dead rows changed.
pub const EXC_APPLY_POLICY: Stmt = Stmt {
    sql: "WITH changed AS ( \
            UPDATE outbox.log_exceptions x SET blocks = ($2 = 'block') \
              FROM outbox.subscription_catalog c \
             WHERE c.name = x.subscription AND c.dead_letter_policy IS NULL \
               AND x.topic = $1 AND x.subject IS NOT NULL \
               AND x.state = 'dead' AND x.blocks IS DISTINCT FROM ($2 = 'block') \
            RETURNING 1) \
          SELECT count(*) FROM changed",
    types: &[pg_sys::TEXTOID, pg_sys::TEXTOID],
};

/// fail() on an exception row: state $3 ('pending' or 'dead'), retry at now +
/// $4, error $5 appended to the history; the lease ends ($6: the
/// subscription's dead-letter policy).
pub const EXC_FAIL_APPLY: Stmt = Stmt {
    sql: concat!(
        "UPDATE outbox.log_exceptions e SET state = $3, visible_at = clock_timestamp() + $4, lease_token = NULL, \
           attempts = greatest(e.attempts, 1), last_error = $5, \
           errors = ",
        crate::history_append!(
            "e.errors",
            "jsonb_build_object('attempt', greatest(e.attempts, 1), 'at', clock_timestamp(), 'worker', e.leased_by, 'error', $5)"
        ),
        ", dead_at = CASE WHEN $3 = 'dead' THEN clock_timestamp() END, \
           blocks = CASE WHEN $3 = 'dead' THEN ",
        dead_blocks!("e", "$6"),
        " ELSE e.blocks END \
         WHERE e.lease_token = $2 AND e.id = $1 AND e.state IN ('pending', 'leased')"
    ),
    types: &[
        pg_sys::INT8OID,
        pg_sys::UUIDOID,
        pg_sys::TEXTOID,
        pg_sys::INTERVALOID,
        pg_sys::TEXTOID,
        pg_sys::TEXTOID,
    ],
};

/// extend_lease on an exception row: leased until now + $3 (a row moved here
/// by an expired batch lease is leased again to its holder).
pub const EXC_EXTEND: Stmt = Stmt {
    sql: "UPDATE outbox.log_exceptions e SET state = 'leased', visible_at = clock_timestamp() + $3 \
           WHERE e.lease_token = $2 AND e.id = $1 AND e.state IN ('pending', 'leased') RETURNING e.visible_at",
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID, pg_sys::INTERVALOID],
};

/// Leases of subscription $1's exception rows that have not expired ($2: now).
pub const EXC_IN_FLIGHT: Stmt = Stmt {
    sql: "SELECT count(*) FROM outbox.log_exceptions e \
           WHERE e.subscription = $1 AND e.state = 'leased' AND e.visible_at > $2",
    types: &[pg_sys::TEXTOID, pg_sys::TIMESTAMPTZOID],
};

/// When event $2 of lane $1 was published.
/// How many of events $2 of lane $1 were available (published, and due if
/// delayed) at or before $3.
pub const PUBLISHED_BY: Stmt = Stmt {
    sql: "SELECT count(*) FROM outbox.log l WHERE l.lane = $1 AND l.id = ANY ($2) \
          AND greatest(l.published_at, l.deliver_at) <= $3",
    types: &[pg_sys::INT2OID, pg_sys::INT8ARRAYOID, pg_sys::TIMESTAMPTZOID],
};

/// Subscription $1's exception rows pending since $2 or earlier.
pub const EXC_READY_SINCE: Stmt = Stmt {
    sql: "SELECT count(*) FROM outbox.log_exceptions e \
           WHERE e.subscription = $1 AND e.state = 'pending' AND e.visible_at <= $2",
    types: &[pg_sys::TEXTOID, pg_sys::TIMESTAMPTZOID],
};

pub const PUBLISHED_AT: Stmt = Stmt {
    sql: "SELECT l.published_at FROM outbox.log l WHERE l.lane = $1 AND l.id = $2",
    types: &[pg_sys::INT2OID, pg_sys::INT8OID],
};

/// Subscription $1's exception rows in numbers ($2: now): undelivered, the
/// oldest of them (id, published_at), leases in flight, dead letters.
pub const EXC_STATS: Stmt = Stmt {
    sql: "SELECT count(*) FILTER (WHERE e.state IN ('pending', 'leased')), min(e.id) FILTER (WHERE e.state IN ('pending', 'leased')), \
                 min(e.published_at) FILTER (WHERE e.state IN ('pending', 'leased')), \
                 count(*) FILTER (WHERE e.state = 'leased' AND e.visible_at > $2), \
                 count(*) FILTER (WHERE e.state = 'dead') \
            FROM outbox.log_exceptions e WHERE e.subscription = $1",
    types: &[pg_sys::TEXTOID, pg_sys::TIMESTAMPTZOID],
};

/// Subscription $1's lane $2, locked (replay waits for a claim holding it):
/// its batch in flight.
pub const LANE_LOCK: Stmt = Stmt {
    sql: "SELECT batch FROM outbox.log_lanes WHERE subscription = $1 AND lane = $2 FOR UPDATE",
    types: &[pg_sys::TEXTOID, pg_sys::INT2OID],
};

/// Which of events $2 of lane $1 have subject $3.
pub const OF_SUBJECT: Stmt = Stmt {
    sql: "SELECT l.id FROM outbox.log l WHERE l.lane = $1 AND l.id = ANY ($2) AND l.subject = $3",
    types: &[pg_sys::INT2OID, pg_sys::INT8ARRAYOID, pg_sys::TEXTOID],
};

/// Event $1 in the log (its lane unknown: a subject's hash, or the run of
/// ids; one probe of each lane's (lane, id) index), for `outbox.cancel`.
pub const EVENT_BY_ID: Stmt = Stmt {
    sql: "SELECT l.lane, l.txid::text, l.topic, l.subject FROM outbox.log l \
           WHERE l.lane = ANY ('{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}'::smallint[]) AND l.id = $1",
    types: &[pg_sys::INT8OID],
};

/// Lock lane $2 of subscription $1 and say where transaction $3's event $4
/// stands in it: committed before the subscription (visible in its first
/// cursor), passed by the cursor, or in the window read so far; and the
/// lane's batch in flight.
pub const LANE_FOR_CANCEL: Stmt = Stmt {
    sql: "SELECT COALESCE(pg_visible_in_snapshot($3::xid8, n.start_snap), false), \
                 pg_visible_in_snapshot($3::xid8, n.lo_snap), \
                 COALESCE(pg_visible_in_snapshot($3::xid8, n.hi_snap) AND $4 <= n.pos, false), \
                 n.batch \
            FROM outbox.log_lanes n WHERE n.subscription = $1 AND n.lane = $2 FOR UPDATE",
    types: &[pg_sys::TEXTOID, pg_sys::INT2OID, pg_sys::TEXTOID, pg_sys::INT8OID],
};

/// A cancelled row for event $3 of lane $2, which subscription $1's lane has
/// not read, and its skip in the lane (whose row the caller holds).
pub const CANCEL_UNREAD: Stmt = Stmt {
    sql: "WITH x AS ( \
              INSERT INTO outbox.log_exceptions (subscription, id, lane, topic, subject, dispatch_key, payload, headers, \
                                                 max_attempts, published_at, state, attempts, visible_at, cancelled_at) \
              SELECT $1, l.id, l.lane, l.topic, l.subject, l.dispatch_key, l.payload, l.headers, l.max_attempts, \
                     l.published_at, 'cancelled', 0, clock_timestamp(), clock_timestamp() \
                FROM outbox.log l WHERE l.lane = $2 AND l.id = $3 \
              ON CONFLICT DO NOTHING RETURNING id) \
          UPDATE outbox.log_lanes n SET skips = array_append(COALESCE(n.skips, '{}'), x.id) \
            FROM x WHERE n.subscription = $1 AND n.lane = $2 RETURNING 1",
    types: &[pg_sys::TEXTOID, pg_sys::INT2OID, pg_sys::INT8OID],
};

/// Cancel subscription $1's row of event $2 when it is pending (a row just
/// detached from its batch).
pub const CANCEL_ROW: Stmt = Stmt {
    sql:
        "UPDATE outbox.log_exceptions x SET state = 'cancelled', cancelled_at = clock_timestamp(), lease_token = NULL \
           WHERE x.subscription = $1 AND x.id = $2 AND x.state = 'pending' RETURNING 1",
    types: &[pg_sys::TEXTOID, pg_sys::INT8OID],
};

/// Whether a restored log waits for its rebase (src/log/restore.rs).
pub const RESTORE_PENDING: Stmt = Stmt { sql: "SELECT EXISTS (SELECT 1 FROM outbox.log_restore)", types: &[] };

/// The rebase of a restored log (sql/restore.sql).
pub const REBASE: Stmt = Stmt { sql: "SELECT outbox._log_rebase()", types: &[] };
