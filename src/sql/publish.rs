//! Inserts of publish and publish_batch (src/publish.rs), dispatch keys, headers.

use crate::pg::plans::Stmt;
use pgrx::prelude::*;

// Two shapes, so the common case (no subject) starts no subquery at all.
pub const INSERT_ONE: Stmt = Stmt {
    sql: "INSERT INTO outbox.event_queue (id, topic, dispatch_key, payload, headers, max_attempts, visible_at) \
          VALUES ($7, $1, $2, $3, $4, $5, \
                  GREATEST(CASE WHEN $6 IS NULL OR $6 < now() THEN now() ELSE $6 END, $8)) \
          RETURNING id",
    types: &[
        pg_sys::TEXTOID,
        pg_sys::TEXTOID,
        pg_sys::JSONBOID,
        pg_sys::JSONBOID,
        pg_sys::INT4OID,
        pg_sys::TIMESTAMPTZOID,
        pg_sys::INT8OID,
        pg_sys::TIMESTAMPTZOID,
    ],
};

pub const INSERT_ONE_SUBJECT: Stmt = Stmt {
    sql: concat!("INSERT INTO outbox.event_queue (id, topic, subject, dispatch_key, payload, headers, max_attempts, visible_at, is_head) \
          VALUES ($8, $1, $2, $3, $4, $5, $6, \
                  GREATEST(CASE WHEN $7 IS NULL OR $7 < now() THEN now() ELSE $7 END, $9), \
                  NOT EXISTS (SELECT 1 FROM outbox.event_queue p \
                               WHERE p.subject = $2 AND ", crate::holds_subject!("p"), ")) \
          RETURNING id"),
    types: &[
        pg_sys::TEXTOID,
        pg_sys::TEXTOID,
        pg_sys::TEXTOID,
        pg_sys::JSONBOID,
        pg_sys::JSONBOID,
        pg_sys::INT4OID,
        pg_sys::TIMESTAMPTZOID,
        pg_sys::INT8OID,
        pg_sys::TIMESTAMPTZOID,
    ],
};

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

pub const INSERT_MANY: Stmt = Stmt {
    sql: concat!(
        "INSERT INTO outbox.event_queue (id, topic, subject, payload, headers, max_attempts, visible_at, is_head) \
          SELECT u.id, $1, u.s, u.p, $6, \
                 $5, GREATEST(now(), $7), \
                 u.s IS NULL OR (u.id = min(u.id) OVER (PARTITION BY u.s) \
                                 AND NOT EXISTS (SELECT 1 FROM outbox.event_queue p \
                                                  WHERE p.subject = u.s AND ",
        crate::holds_subject!("p"),
        ")) \
          FROM unnest($2::bigint[], $3::jsonb[], $4::text[]) AS u(id, p, s)"
    ),
    types: &[
        pg_sys::TEXTOID,
        pg_sys::INT8ARRAYOID,
        pg_sys::JSONBARRAYOID,
        pg_sys::TEXTARRAYOID,
        pg_sys::INT4OID,
        pg_sys::JSONBOID,
        pg_sys::TIMESTAMPTZOID,
    ],
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
