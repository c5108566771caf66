//! The registry of every statement on the claim, ack and publish paths
//! (src/sql/claim.rs, log.rs, publish.rs), by name, for the plan test
//! (pg_test/py/test_plans.py): each is prepared with a generic plan over a
//! loaded log, and none may read a ring table or `outbox.log_exceptions`
//! with a sequential scan, since a generic plan is what a hot statement runs
//! once the plan cache settles on one, whatever the values it was planned
//! for. The test also checks that every `Stmt` of those files is listed
//! here.

use super::{claim, log, publish};
use crate::pg::plans::Stmt;
use pgrx::prelude::*;

/// (name, statement): `file::CONST`, `file::CONST[i]` for an array.
pub const STATEMENTS: &[(&str, &Stmt)] = &[
    ("log::CURRENT", &log::CURRENT),
    ("log::APPEND_ONE[0]", &log::APPEND_ONE[0]),
    ("log::APPEND_ONE[1]", &log::APPEND_ONE[1]),
    ("log::APPEND_ONE[2]", &log::APPEND_ONE[2]),
    ("log::APPEND_ONE[3]", &log::APPEND_ONE[3]),
    ("log::ROTATE", &log::ROTATE),
    ("log::CURSOR", &log::CURSOR),
    ("log::WINDOW", &log::WINDOW),
    ("log::LANES_WITH_NEWS", &log::LANES_WITH_NEWS),
    ("log::WINDOW_COUNT", &log::WINDOW_COUNT),
    ("log::SUBSCRIBE", &log::SUBSCRIBE),
    ("log::SUBSCRIBE_LISTED", &log::SUBSCRIBE_LISTED),
    ("log::TOPICS_OF", &log::TOPICS_OF),
    ("log::LANES", &log::LANES),
    ("log::CLAIM_LANES", &log::CLAIM_LANES),
    ("log::LANE_PUT", &log::LANE_PUT),
    ("log::LANE_PUT_NEW_BATCH", &log::LANE_PUT_NEW_BATCH),
    ("log::BATCH_GET", &log::BATCH_GET),
    ("log::BATCH_GET_MANY", &log::BATCH_GET_MANY),
    ("log::BATCH_PUT_MANY", &log::BATCH_PUT_MANY),
    ("log::BATCH_EXISTS", &log::BATCH_EXISTS),
    ("log::SUB_HAS_MAX_LAG", &log::SUB_HAS_MAX_LAG),
    ("log::NOTE_LOST", &log::NOTE_LOST),
    ("log::DEFERRED_INSERT", &log::DEFERRED_INSERT),
    ("log::DEFERRED_OF", &log::DEFERRED_OF),
    ("log::DEFERRED_TAKE", &log::DEFERRED_TAKE),
    ("log::DEFERRED_PENDING", &log::DEFERRED_PENDING),
    ("log::LANES_WITH_NEWS_SETTLED", &log::LANES_WITH_NEWS_SETTLED),
    ("log::DEFERRED_ORPHANS", &log::DEFERRED_ORPHANS),
    ("log::BATCH_PUT_ROUNDS", &log::BATCH_PUT_ROUNDS),
    ("log::BATCH_PUT_HOLDERS", &log::BATCH_PUT_HOLDERS),
    ("log::BATCH_HOLDERS", &log::BATCH_HOLDERS),
    ("log::BATCH_IDS", &log::BATCH_IDS),
    ("log::EXC_LOCK_ALL", &log::EXC_LOCK_ALL),
    ("log::BATCH_STATES", &log::BATCH_STATES),
    ("log::BATCH_PUT", &log::BATCH_PUT),
    ("log::BATCH_DELETE", &log::BATCH_DELETE),
    ("log::DELIVERED_INSERT", &log::DELIVERED_INSERT),
    ("log::DELIVERED_TAIL", &log::DELIVERED_TAIL),
    ("log::DELIVERED_JOIN", &log::DELIVERED_JOIN),
    ("log::BATCH_FINISH", &log::BATCH_FINISH),
    ("log::BATCH_FINISH_TAIL", &log::BATCH_FINISH_TAIL),
    ("log::DELIVERED_BATCHES", &log::DELIVERED_BATCHES),
    ("log::FETCH", &log::FETCH),
    ("log::FETCH_RANGE", &log::FETCH_RANGE),
    ("log::FETCH_MANY", &log::FETCH_MANY),
    ("log::FAIL_INFO", &log::FAIL_INFO),
    ("log::EXC_INSERT", &log::EXC_INSERT),
    ("log::EXC_OPEN_SUBJECTS", &log::EXC_OPEN_SUBJECTS),
    ("log::EXC_CLAIM", &log::EXC_CLAIM),
    ("log::EXC_DEAD_POLICY", &log::EXC_DEAD_POLICY),
    ("log::EXC_ACK", &log::EXC_ACK),
    ("log::EXC_FAIL_LOCK", &log::EXC_FAIL_LOCK),
    ("log::LOG_EVENT_TOPIC", &log::LOG_EVENT_TOPIC),
    ("log::EXC_EVENT_TOPIC", &log::EXC_EVENT_TOPIC),
    ("log::EXC_APPLY_POLICY", &log::EXC_APPLY_POLICY),
    ("log::EXC_FAIL_APPLY", &log::EXC_FAIL_APPLY),
    ("log::EXC_EXTEND", &log::EXC_EXTEND),
    ("log::EXC_IN_FLIGHT", &log::EXC_IN_FLIGHT),
    ("log::PUBLISHED_BY", &log::PUBLISHED_BY),
    ("log::EXC_READY_SINCE", &log::EXC_READY_SINCE),
    ("log::PUBLISHED_AT", &log::PUBLISHED_AT),
    ("log::EXC_STATS", &log::EXC_STATS),
    ("log::LANE_LOCK", &log::LANE_LOCK),
    ("log::OF_SUBJECT", &log::OF_SUBJECT),
    ("log::EVENT_BY_ID", &log::EVENT_BY_ID),
    ("log::LANE_FOR_CANCEL", &log::LANE_FOR_CANCEL),
    ("log::CANCEL_UNREAD", &log::CANCEL_UNREAD),
    ("log::CANCEL_ROW", &log::CANCEL_ROW),
    ("log::RESTORE_PENDING", &log::RESTORE_PENDING),
    ("log::REBASE", &log::REBASE),
    ("claim::SUBSCRIPTIONS", &claim::SUBSCRIPTIONS),
    ("claim::FORGET_LANES", &claim::FORGET_LANES),
    ("claim::FORGET_BATCHES", &claim::FORGET_BATCHES),
    ("claim::FORGET_REST", &claim::FORGET_REST),
    ("claim::NOTE_CLAIM", &claim::NOTE_CLAIM),
    ("publish::KEY_CLAIM", &publish::KEY_CLAIM),
    ("publish::KEY_LOOKUP", &publish::KEY_LOOKUP),
    ("publish::NEXT_IDS", &publish::NEXT_IDS),
    ("publish::CHECK_HEADERS", &publish::CHECK_HEADERS),
];

/// `outbox._statements()`: the registry, one row per statement: `name`, `sql`
/// and `types` (its parameter types, $1 first). Internal, for the plan test.
#[pg_extern(name = "_statements", immutable, parallel_safe)]
#[allow(clippy::type_complexity)] // pgrx reads the row's columns from this tuple
pub fn statements(
) -> TableIterator<'static, (name!(name, &'static str), name!(sql, &'static str), name!(types, Vec<pg_sys::Oid>))> {
    TableIterator::new(STATEMENTS.iter().map(|(n, s)| (*n, s.sql, s.types.to_vec())))
}
