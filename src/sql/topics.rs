//! The per-backend topic cache (src/topics.rs).

use crate::pg::plans::Stmt;

pub const LOAD: Stmt = Stmt { sql: "SELECT topic, max_attempts FROM outbox.topics", types: &[] };
