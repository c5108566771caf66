//! Every SQL statement the Rust code runs, one submodule per concern, and the
//! fragments several statements share. A rule about rows (which events are in the
//! claim index, which hold back their subject) is written once here; the schema
//! (sql/schema.sql) and the PL/pgSQL functions spell the same predicates where
//! the planner must see them literally (the partial index and its matching quals).

pub mod claim;
pub mod lease;
pub mod log;
pub mod lowwater;
pub mod publish;
pub mod subject;
pub mod topics;
pub mod worker;

/// `$a` is in the claim index `event_queue_ready_idx` (sql/schema.sql): not dead,
/// and its subject's head. Queries that must use that index repeat its predicate.
#[macro_export]
macro_rules! in_claim_index {
    ($a:literal) => {
        concat!($a, ".state <> 'dead' AND ", $a, ".is_head")
    };
}

/// `$a` holds back the later events of its subject: pending or leased, or dead
/// under the 'block' policy (sql/retention.sql's heads repair says the same).
#[macro_export]
macro_rules! holds_subject {
    ($a:literal) => {
        concat!("(", $a, ".state <> 'dead' OR ", $a, ".blocks_subject)")
    };
}
