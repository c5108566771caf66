//! Statements of publish and publish_batch (src/publish.rs): ids, dispatch keys, headers.

use crate::pg::plans::Stmt;
use pgrx::prelude::*;

pub const KEY_CLAIM: Stmt = Stmt {
    sql: "INSERT INTO outbox.dispatch_keys (dispatch_key, event_id) VALUES ($1, nextval('outbox.event_id_seq')) \
          ON CONFLICT (dispatch_key) DO NOTHING RETURNING event_id",
    types: &[pg_sys::TEXTOID],
};

pub const KEY_LOOKUP: Stmt =
    Stmt { sql: "SELECT event_id FROM outbox.dispatch_keys WHERE dispatch_key = $1", types: &[pg_sys::TEXTOID] };

pub const NEXT_IDS: Stmt = Stmt {
    sql: "SELECT array_agg(nextval('outbox.event_id_seq') ORDER BY g) FROM generate_series(1, $1) AS g",
    types: &[pg_sys::INT4OID],
};

pub const CHECK_HEADERS: Stmt = Stmt {
    // jsonb_each never recurses, so hostile nesting cannot exhaust anything here
    // (the jsonb input function already bounded it).
    sql: "SELECT CASE WHEN jsonb_typeof($1) <> 'object' THEN 1 \
                      WHEN EXISTS (SELECT 1 FROM jsonb_each($1) AS e WHERE jsonb_typeof(e.value) <> 'string') THEN 2 \
                      ELSE 0 END, \
                 CASE WHEN jsonb_typeof($1) = 'object' THEN \
                      (SELECT e.key FROM jsonb_each($1) AS e WHERE jsonb_typeof(e.value) <> 'string' ORDER BY e.key LIMIT 1) END, \
                 CASE WHEN $2::text IS NOT NULL AND NOT $1 ? 'traceparent' \
                      THEN $1 || jsonb_build_object('traceparent', $2::text) ELSE $1 END",
    types: &[pg_sys::JSONBOID, pg_sys::TEXTOID],
};
