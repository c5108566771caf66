//! `outbox.publish` and `outbox.publish_batch`: insert events in the caller's
//! transaction.
//!
//! Every event goes to the log (src/log/mod.rs), and nowhere else: publish
//! writes nothing per subscription.
//!
//! Ordering: events of one subject must be claimable in the commit order
//! of their publishers, but sequence ids are handed out before commit, so a
//! smaller id can commit later. publish() therefore covers the subject with
//! the library's subject locks *before* it draws the id (src/subject.rs, which
//! proves the invariant). A second publisher of the same subject waits until
//! the first commits or aborts, so per subject, id order is commit order, and a
//! lane reads a subject in id order. Different subjects wait on each other only
//! on a 32-bit hash collision, which only serialises, and while a transaction
//! past `outbox.max_subject_locks` subjects holds the coarse lock.
//!
//! Transaction id first: publish gives its transaction an id (after the subject
//! locks) before it draws any event id, so that every transaction that drew an
//! id had its id before the id was drawn (src/log/mod.rs, invariant 2).
//!
//! Idempotency: a dispatch key is inserted into `outbox.dispatch_keys` with
//! ON CONFLICT DO NOTHING. A concurrent publisher of the same key waits for the
//! first transaction; if it commits, the second gets the first id back, if it
//! aborts, the second inserts. No unique-violation ever reaches the caller.

use crate::errors::{self, INVALID_PARAMETER, NO_DATA_FOUND};
use crate::pg;
use crate::pg::fcall::{Array, Call, SetResult, Value};
use crate::pg::heap;
use crate::pg::plans;
use crate::sql::publish::{CHECK_HEADERS, KEY_CLAIM, KEY_LOOKUP, NEXT_IDS};
use crate::{gucs, log, subject, topics, validate, wakeup};
use pgrx::prelude::*;
use pgrx::JsonB;

/// Raise P0002 when strict topics are on and `topic` is not registered; return the
/// max_attempts new events of `topic` get.
fn topic_max_attempts(topic: &str) -> i32 {
    match topics::lookup(topic) {
        Some(max) => max.unwrap_or_else(gucs::max_attempts),
        None if gucs::strict_topics() => errors::raise_hint(
            NO_DATA_FOUND,
            format!("topic {topic:?} is not registered and outbox.strict_topics is on"),
            "Register it with outbox.create_topic() or fix the topic name.",
        ),
        None => gucs::max_attempts(),
    }
}

/// Validate headers (a JSON object of string values) and add the session's
/// traceparent when the caller gave none. Returns the jsonb to store.
fn prepare_headers(d: Option<Value>) -> Option<Value> {
    let tp = gucs::traceparent();
    let Some(d) = d else {
        return tp.map(|tp| {
            let mut m = serde_json::Map::new();
            m.insert("traceparent".into(), serde_json::Value::String(tp));
            Value::jsonb(JsonB(serde_json::Value::Object(m)))
        });
    };
    validate::payload_size("headers", &d);
    let (verdict, bad_key, headers) = plans::run(&CHECK_HEADERS, &[d.param(), tp.clone().into()], |t| {
        let t = t.first();
        let verdict: i32 = errors::spi(t.get(1)).unwrap_or(1);
        let bad_key: Option<String> = errors::spi(t.get(2));
        // Copy the (possibly new) jsonb out of SPI memory before SPI_finish.
        let h: Option<JsonB> = if tp.is_some() { errors::spi(t.get(3)) } else { None };
        (verdict, bad_key, h)
    });
    match verdict {
        0 => {}
        1 => errors::raise(INVALID_PARAMETER, "headers must be a JSON object"),
        _ => errors::raise(INVALID_PARAMETER, format!("header {:?} must be a string", bad_key.unwrap_or_default())),
    }
    match headers {
        Some(h) => Some(Value::jsonb(h)),
        None => Some(d),
    }
}

/// Dispatch-key step of publish: Ok(id) to insert with, Err(id) when the key
/// already names an event (nothing to insert).
fn reserve_key(key: &str) -> Result<i64, i64> {
    if let Some(id) = plans::one::<i64>(&KEY_CLAIM, &[key.into()]) {
        return Ok(id);
    }
    match plans::one::<i64>(&KEY_LOOKUP, &[key.into()]) {
        Some(id) => Err(id),
        // The conflicting key vanished between the two statements (a purge of it
        // committed meanwhile): let the caller retry rather than guess.
        None => errors::raise(
            PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
            format!("dispatch key {key:?} changed concurrently; retry the transaction"),
        ),
    }
}

struct One<'a> {
    /// The transaction's full id ([`pg::xid_for_insert`]).
    txid: u64,
    topic: &'a str,
    max_attempts: i32,
    subject: Option<&'a str>,
    key: Option<&'a str>,
    payload: Value,
    headers: Option<Value>,
    deliver_at: Option<Value>,
}

/// Append new events to the log ring.
fn append_log<'a>(txid: u64, topic: &'a str, max_attempts: i32, events: impl Iterator<Item = LogEvent<'a>>) {
    let rows: Vec<heap::LogRow<'a>> = events
        .map(|e| heap::LogRow {
            id: e.id,
            txid,
            lane: log::lane(e.id, e.subject.map(pg::hashtext)),
            topic,
            subject: e.subject,
            dispatch_key: e.key,
            payload: e.payload,
            headers: e.headers,
            max_attempts,
            deliver_at: e.deliver_at,
        })
        .collect();
    log::append(&rows);
}

/// What the log keeps of one event beyond its topic and max_attempts.
struct LogEvent<'a> {
    id: i64,
    subject: Option<&'a str>,
    key: Option<&'a str>,
    payload: Value,
    headers: Option<Value>,
    deliver_at: Option<Value>,
}

/// A new event's id: drawn, or reserved with its dispatch key. Err(id) when the
/// key already names an event (nothing to insert).
fn new_id(key: Option<&str>) -> Result<i64, i64> {
    match key {
        Some(k) => reserve_key(k),
        None => Ok(heap::next_event_id()),
    }
}

/// Insert one validated event (subject lock already taken, transaction id
/// assigned) into the log. Returns its id and whether a row was inserted.
fn insert_one(e: &One<'_>) -> (i64, bool) {
    let (id, inserted) = new_id(e.key).map_or_else(|existing| (existing, false), |id| (id, true));
    if inserted {
        let event = LogEvent {
            id,
            subject: e.subject,
            key: e.key,
            payload: e.payload,
            headers: e.headers,
            deliver_at: e.deliver_at,
        };
        append_log(e.txid, e.topic, e.max_attempts, std::iter::once(event));
    }
    (id, inserted)
}

/// `outbox.publish(topic, payload, subject, dispatch_key, headers, deliver_at) -> bigint`.
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention.
pub unsafe fn publish(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox.publish(text, jsonb, text, text, jsonb, timestamptz) (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    let topic: String = call.required(0, "topic");
    validate::topic(&topic);
    let payload = call
        .value(1, pg_sys::JSONBOID)
        .unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "payload must not be NULL"));
    validate::payload_size("payload", &payload);
    let subject: Option<String> = call.arg(2);
    if let Some(s) = &subject {
        validate::key("subject", s);
    }
    let key: Option<String> = call.arg(3);
    if let Some(k) = &key {
        validate::key("dispatch_key", k);
    }
    let headers = prepare_headers(call.value(4, pg_sys::JSONBOID));
    let deliver_at = call.value(5, pg_sys::TIMESTAMPTZOID);
    if let Some(d) = deliver_at {
        if d.datum().value() as i64 == i64::MAX {
            errors::raise(INVALID_PARAMETER, "deliver_at must not be infinity");
        }
    }
    let max_attempts = topic_max_attempts(&topic);
    if let Some(s) = &subject {
        subject::lock(s);
    }
    let txid = pg::xid_for_insert();
    let (id, inserted) = insert_one(&One {
        txid,
        topic: &topic,
        max_attempts,
        subject: subject.as_deref(),
        key: key.as_deref(),
        payload,
        headers,
        deliver_at,
    });
    if inserted {
        wakeup::note_publish(&topic, deliver_at.map(|d| d.datum()));
    }
    id.into_datum().unwrap()
}

/// `outbox.publish_batch(topic, payloads jsonb[], subjects text[], dispatch_keys text[]) -> SETOF bigint`.
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention.
pub unsafe fn publish_batch(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox.publish_batch(text, jsonb[], text[], text[]) (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    let topic: String = call.required(0, "topic");
    validate::topic(&topic);
    let payloads_d = call
        .value(1, pg_sys::JSONBARRAYOID)
        .unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "payloads must not be NULL"));
    let payloads = Array::read(payloads_d, "payloads").elems();
    if payloads.is_empty() {
        errors::raise(INVALID_PARAMETER, "payloads must not be empty");
    }
    validate::batch_size(payloads.len() as i64);
    for (i, p) in payloads.iter().enumerate() {
        match p {
            None => errors::raise(errors::NULL_VALUE, format!("payloads[{}] must not be NULL", i + 1)),
            Some(d) => validate::payload_size(&format!("payloads[{}]", i + 1), d),
        }
    }
    let text_array = |n: usize, what: &str| -> Option<Vec<Option<String>>> {
        let d = call.value(n, pg_sys::TEXTARRAYOID)?;
        let elems = Array::read(d, what).elems();
        if elems.len() != payloads.len() {
            errors::raise(
                INVALID_PARAMETER,
                format!("{what} has {} elements but payloads has {}", elems.len(), payloads.len()),
            );
        }
        Some(elems.into_iter().map(|e| e.and_then(Value::text)).collect())
    };
    let subjects = text_array(2, "subjects");
    let keys = text_array(3, "dispatch_keys");
    for s in subjects.iter().flatten().flatten() {
        validate::key("subject", s);
    }
    for k in keys.iter().flatten().flatten() {
        validate::key("dispatch_key", k);
    }
    let max_attempts = topic_max_attempts(&topic);

    let out = SetResult::begin(&call);
    if let Some(subjects) = &subjects {
        let list: Vec<String> = subjects.iter().flatten().cloned().collect();
        subject::lock_many(&list);
    }
    let txid = pg::xid_for_insert();
    let any_key = keys.as_ref().is_some_and(|k| k.iter().any(|k| k.is_some()));
    let mut inserted = 0usize;
    if any_key {
        // Keys need per-event dedupe; take the single-event path for each.
        for (i, p) in payloads.iter().enumerate() {
            let (id, ins) = insert_one(&One {
                txid,
                topic: &topic,
                max_attempts,
                subject: subjects.as_ref().and_then(|s| s[i].as_deref()),
                key: keys.as_ref().and_then(|k| k[i].as_deref()),
                payload: p.unwrap(),
                headers: prepare_headers(None),
                deliver_at: None,
            });
            inserted += ins as usize;
            out.put_i64(id);
        }
    } else {
        let n = payloads.len() as i32;
        let ids: Vec<i64> =
            plans::run(&NEXT_IDS, &[n.into()], |t| errors::spi(t.first().get_one::<Vec<i64>>())).unwrap_or_default();
        let headers = prepare_headers(None);
        let events = ids.iter().zip(&payloads).enumerate().map(|(i, (id, p))| LogEvent {
            id: *id,
            subject: subjects.as_ref().and_then(|s| s[i].as_deref()),
            key: None,
            payload: p.unwrap(),
            headers,
            deliver_at: None,
        });
        append_log(txid, &topic, max_attempts, events);
        inserted = ids.len();
        for id in ids {
            out.put_i64(id);
        }
    }
    if inserted > 0 {
        wakeup::note_publish(&topic, None);
    }
    call.finish_set()
}
