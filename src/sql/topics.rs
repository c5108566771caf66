//! The per-backend topic cache (src/topics.rs).

use crate::pg::plans::Stmt;

pub const LOAD: Stmt = Stmt { sql: "SELECT topic, max_attempts, default_lease FROM outbox.topics", types: &[] };
