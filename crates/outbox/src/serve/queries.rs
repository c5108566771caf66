//! What the pages and the JSON API read, through the extension's SQL API only (views
//! `outbox.stats`, `outbox.subscriptions`, `outbox.events`, `outbox.deliveries`; functions
//! `outbox.health()`, `outbox.wakeup_status()`, `outbox.blocked_subjects()`,
//! `outbox.delivered_per_minute()`), plus PostgreSQL's own statistics views for the health page.
//!
//! Every query names its columns: `outbox_monitor` may read everything here but the payload and
//! headers of `outbox.events`, which are read on their own ([`event`]) so that a 42501 there
//! hides the payload instead of failing the page. Filters from the query string are validated
//! here ([`DeadFilter::parse`]) into 400s, so pages and API answer bad input the same way.

use std::collections::{BTreeMap, HashMap};

use axum::http::StatusCode;
use serde::Serialize;
use serde_json::{Map, Value};
use tokio_postgres::Client;

use super::db::{rows, scalar, DbError};

/// A request that cannot be answered: the HTTP status and one line for the page or JSON body.
#[derive(Debug, Clone)]
pub struct Failure {
    /// 400, 403, 404, 500, 503, ...
    pub status: StatusCode,
    /// One line, shown escaped.
    pub message: String,
}

impl Failure {
    /// A 400 Bad Request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Failure { status: StatusCode::BAD_REQUEST, message: message.into() }
    }
    /// A 404 Not Found.
    pub fn not_found(message: impl Into<String>) -> Self {
        Failure { status: StatusCode::NOT_FOUND, message: message.into() }
    }
    /// A 403 Forbidden.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Failure { status: StatusCode::FORBIDDEN, message: message.into() }
    }
}

impl From<DbError> for Failure {
    fn from(e: DbError) -> Self {
        if e.unavailable {
            return Failure { status: StatusCode::SERVICE_UNAVAILABLE, message: e.message };
        }
        let (status, hint) = match e.code.as_deref() {
            Some("42501") => (
                StatusCode::FORBIDDEN,
                " (the dashboard's role needs outbox_monitor to read, outbox_admin for payloads and actions)",
            ),
            Some("57014") => (StatusCode::GATEWAY_TIMEOUT, " (the query ran past --statement-timeout)"),
            // A value PostgreSQL cannot take (a NUL byte, bad encoding, an out-of-range argument)
            // is the request's fault.
            Some(c) if c.starts_with("22") => (StatusCode::BAD_REQUEST, ""),
            // The session was terminated or the server is shutting down: the next request reconnects.
            Some(c) if c.starts_with("57P") => (StatusCode::SERVICE_UNAVAILABLE, " (try again)"),
            _ if e.is_missing_api() => {
                (StatusCode::INTERNAL_SERVER_ERROR, " (is outbox_ext installed and up to date in this database?)")
            }
            _ => (StatusCode::INTERNAL_SERVER_ERROR, ""),
        };
        Failure { status, message: format!("{}{hint}", e.message) }
    }
}

/// Result of a dashboard read.
pub type Res<T> = Result<T, Failure>;

/// Longest accepted topic filter (the extension's own limit for a topic).
const MAX_TOPIC_LEN: usize = 255;
/// Highest page number accepted (far beyond any real list; keeps OFFSET bounded).
const MAX_PAGE: i64 = 1_000_000;
/// Rows per page of dead letters unless `per_page` says otherwise.
pub const DEFAULT_PER_PAGE: i64 = 50;

/// A query-string value, trimmed, with empty meaning absent (an empty filter field in a form).
fn param<'a>(q: &'a HashMap<String, String>, key: &str) -> Option<&'a str> {
    q.get(key).map(|v| v.trim()).filter(|v| !v.is_empty())
}

/// A positive integer parameter within `1..=max`, or `default` when absent.
pub fn int_param(q: &HashMap<String, String>, key: &str, default: i64, max: i64) -> Res<i64> {
    match param(q, key) {
        None => Ok(default),
        Some(v) => match v.parse::<i64>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(Failure::bad_request(format!("bad {key} '{v}': expected a whole number from 1 to {max}"))),
        },
    }
}

/// A topic filter: an exact topic, `prefix.*` or `*` (the characters topics allow, plus `*`).
pub fn topic_param(q: &HashMap<String, String>) -> Res<Option<String>> {
    match param(q, "topic") {
        None => Ok(None),
        Some(t) => {
            let ok = t.len() <= MAX_TOPIC_LEN
                && t.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-*".contains(c));
            if ok {
                Ok(Some(t.to_string()))
            } else {
                Err(Failure::bad_request(format!(
                    "bad topic filter '{t}': expected a topic, a prefix ending in .* or * (lowercase letters, digits, . _ -)"
                )))
            }
        }
    }
}

/// A subscription filter, which must name an existing subscription.
pub async fn subscription_param(c: &Client, q: &HashMap<String, String>) -> Res<Option<String>> {
    match param(q, "subscription") {
        None => Ok(None),
        Some(s) => {
            let found: Option<i32> =
                scalar(c, "SELECT 1 FROM outbox.subscriptions WHERE name = $1::text", &[&s]).await?;
            match found {
                Some(_) => Ok(Some(s.to_string())),
                None => Err(Failure::bad_request(format!("unknown subscription '{s}'"))),
            }
        }
    }
}

/// A time filter (a timestamp, or a duration ago such as `2h`), resolved by the server so it
/// agrees with `now()` there.
async fn time_param(c: &Client, q: &HashMap<String, String>, key: &str) -> Res<Option<String>> {
    match param(q, key) {
        None => Ok(None),
        // resolve() words its error for people ("bad since '...': expected a timestamp ...").
        Some(v) => crate::cli::time::resolve(c, key, v)
            .await
            .map(Some)
            .map_err(|e| Failure::bad_request(format!("{e:#}").replace('\n', " "))),
    }
}

/// `outbox.stats`, one row per subscription and topic, with `backlog` (ready + scheduled) and the
/// ages in seconds.
pub async fn stats(c: &Client) -> Res<Vec<Map<String, Value>>> {
    Ok(rows(
        c,
        "SELECT subscription, topic, ready + scheduled AS backlog, ready, scheduled, leased, expired_leases, dead, \
         delivered, cancelled, extract(epoch FROM oldest_ready_age)::float8 AS oldest_ready_s, \
         extract(epoch FROM oldest_lease_age)::float8 AS oldest_lease_s, dead_last_hour, delivered_last_minute, \
         delivered_last_hour FROM outbox.stats ORDER BY subscription, topic",
        &[],
    )
    .await?)
}

/// `outbox.subscriptions`, one row per subscription.
pub async fn subscriptions(c: &Client) -> Res<Vec<Map<String, Value>>> {
    Ok(rows(
        c,
        "SELECT name, topics, paused, lag_events, extract(epoch FROM lag)::float8 AS lag_s, \
         oldest_undelivered_id, ready, leases_in_flight, dead_letters, last_claim_at, lost_events \
         FROM outbox.subscriptions ORDER BY name",
        &[],
    )
    .await?)
}

/// Deliveries per minute of one subscription and topic, oldest minute first.
#[derive(Debug, Clone, Serialize)]
pub struct Series {
    /// The subscription.
    pub subscription: String,
    /// The topic.
    pub topic: String,
    /// The first minute of the window (RFC 3339).
    pub start: Option<String>,
    /// One count per minute.
    pub delivered: Vec<i64>,
}

/// `outbox.delivered_per_minute(minutes, subscription)`, grouped into one series per subscription
/// and topic. None when the installed extension does not have the function yet.
pub async fn throughput(c: &Client, minutes: i32, subscription: Option<&str>) -> Res<Option<Vec<Series>>> {
    let got = rows(
        c,
        "SELECT subscription, topic, min(minute) AS start, \
         array_agg(delivered ORDER BY minute) AS delivered \
         FROM outbox.delivered_per_minute($1::int, $2::text) GROUP BY subscription, topic \
         ORDER BY subscription, topic",
        &[&minutes, &subscription],
    )
    .await;
    let got = match got {
        Ok(r) => r,
        Err(e) if e.is_missing_api() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    Ok(Some(
        got.into_iter()
            .map(|r| Series {
                subscription: str_of(&r, "subscription"),
                topic: str_of(&r, "topic"),
                start: r.get("start").and_then(Value::as_str).map(str::to_string),
                delivered: r
                    .get("delivered")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().map(|v| v.as_i64().unwrap_or(0)).collect())
                    .unwrap_or_default(),
            })
            .collect(),
    ))
}

/// The per-minute totals of each subscription (its topics' series added up, aligned on the
/// latest minute).
pub fn totals_by_subscription(series: &[Series]) -> BTreeMap<String, Vec<i64>> {
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for s in series {
        let acc = out.entry(s.subscription.clone()).or_default();
        if acc.len() < s.delivered.len() {
            let pad = s.delivered.len() - acc.len();
            acc.splice(0..0, std::iter::repeat_n(0, pad));
        }
        let offset = acc.len() - s.delivered.len();
        for (i, v) in s.delivered.iter().enumerate() {
            acc[offset + i] += v;
        }
    }
    out
}

/// A string field of a row ("" when absent or not a string).
pub fn str_of(r: &Map<String, Value>, key: &str) -> String {
    r.get(key).and_then(Value::as_str).unwrap_or_default().to_string()
}

/// Filters and page of the dead-letter list.
#[derive(Debug, Clone, Serialize, Default)]
pub struct DeadFilter {
    /// Topic pattern (exact, `prefix.*`, `*`).
    pub topic: Option<String>,
    /// Only this subscription.
    pub subscription: Option<String>,
    /// Dead at or after (as typed; resolved on the server).
    pub since: Option<String>,
    /// Dead before (as typed).
    pub until: Option<String>,
    /// 1-based page number.
    pub page: i64,
    /// Rows per page.
    pub per_page: i64,
}

impl DeadFilter {
    /// Validates the query string (400 on anything malformed; unknown subscriptions included).
    pub async fn parse(c: &Client, q: &HashMap<String, String>) -> Res<Self> {
        Ok(DeadFilter {
            topic: topic_param(q)?,
            page: int_param(q, "page", 1, MAX_PAGE)?,
            per_page: int_param(q, "per_page", DEFAULT_PER_PAGE, 500)?,
            subscription: subscription_param(c, q).await?,
            since: param(q, "since").map(str::to_string),
            until: param(q, "until").map(str::to_string),
        })
    }
}

/// One page of dead letters.
#[derive(Debug, Clone, Serialize)]
pub struct DeadPage {
    /// The filters and page asked for.
    pub filter: DeadFilter,
    /// Dead letters matching the filters (every page).
    pub total: i64,
    /// Pages in all (at least 1).
    pub pages: i64,
    /// This page's dead letters, newest death first, each with its error history.
    pub items: Vec<Map<String, Value>>,
}

/// Dead letters of every subscription (or one), newest first, a page at a time.
pub async fn dead_letters(c: &Client, q: &HashMap<String, String>) -> Res<DeadPage> {
    let filter = DeadFilter::parse(c, q).await?;
    let since = time_param(c, q, "since").await?;
    let until = time_param(c, q, "until").await?;
    let cond = format!(
        "d.state = 'dead' AND {} AND ($2::text IS NULL OR d.subscription = $2::text) \
         AND ($3::text IS NULL OR d.dead_at >= $3::text::timestamptz) \
         AND ($4::text IS NULL OR d.dead_at < $4::text::timestamptz)",
        crate::cli::topic_match_sql("d.topic", 1)
    );
    let list_sql = format!(
        "SELECT d.event_id, d.subscription, d.topic, d.subject, d.attempts, d.max_attempts, d.dead_at, \
         d.last_error, d.errors FROM outbox.deliveries d WHERE {cond} \
         ORDER BY d.dead_at DESC NULLS LAST, d.event_id DESC, d.subscription LIMIT $5::bigint OFFSET $6::bigint"
    );
    let count_sql = format!("SELECT count(*) FROM outbox.deliveries d WHERE {cond}");
    let offset = (filter.page - 1) * filter.per_page;
    let list_params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
        [&filter.topic, &filter.subscription, &since, &until, &filter.per_page, &offset];
    let (items, total) =
        futures::try_join!(rows(c, &list_sql, &list_params), scalar::<i64>(c, &count_sql, &list_params[..4]),)?;
    let total = total.unwrap_or(0);
    let pages = ((total + filter.per_page - 1) / filter.per_page).max(1);
    let items = items
        .into_iter()
        .map(|mut r| {
            let errors = normalize_errors(r.shift_remove("errors"));
            r.insert("errors".into(), errors);
            r
        })
        .collect();
    Ok(DeadPage { filter, total, pages, items })
}

/// The error history as a list of `{attempt, at, worker, error}` objects, the `{"omitted": n}`
/// marker becoming an entry that says so.
pub fn normalize_errors(v: Option<Value>) -> Value {
    let items = match v {
        Some(Value::Array(items)) => items,
        _ => return Value::Array(Vec::new()),
    };
    Value::Array(
        items
            .into_iter()
            .map(|e| match e {
                Value::Object(m) if m.contains_key("omitted") => {
                    let n = m.get("omitted").cloned().unwrap_or(Value::Null);
                    let mut o = Map::new();
                    o.insert("omitted".into(), n);
                    Value::Object(o)
                }
                Value::Object(m) => Value::Object(m),
                other => {
                    let mut o = Map::new();
                    o.insert("error".into(), Value::String(other.to_string()));
                    Value::Object(o)
                }
            })
            .collect(),
    )
}

/// One event: its fields, payload and headers (unless the role may not read them), error history
/// and state in every subscription.
#[derive(Debug, Clone, Serialize)]
pub struct EventDetail {
    /// The fields of `outbox.events` (the `default` subscription's state), without the payload.
    pub event: Map<String, Value>,
    /// The payload, pretty-printed JSON; None when hidden.
    pub payload: Option<String>,
    /// The headers, as (name, value) pairs in key order; None when hidden.
    pub headers: Option<Vec<(String, String)>>,
    /// True when PostgreSQL refused the payload columns (42501).
    pub payload_hidden: bool,
    /// The payload's size as JSON text, in bytes (None when hidden or absent).
    pub payload_bytes: Option<i64>,
    /// True when the payload is larger than the caller's cap and `payload` is None.
    pub payload_truncated: bool,
    /// One row per subscription that receives the event (`outbox.deliveries`), each with its
    /// error history.
    pub deliveries: Vec<Map<String, Value>>,
}

/// Parses an event id from a path segment (400 when it is not a positive integer).
pub fn event_id(raw: &str) -> Res<i64> {
    match raw.trim().parse::<i64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(Failure::bad_request(format!("bad event id '{raw}': expected a positive whole number"))),
    }
}

/// The largest payload (bytes of JSON text) the event page shows; a larger one is left out
/// of the HTML (a page of megabytes stalls the browser) and read whole from `/api/events/{id}`.
pub const PAGE_PAYLOAD_CAP: i64 = 256 * 1024;

/// Reads one event, with its payload when it has at most `payload_cap` bytes (None: any size);
/// 404 when no subscription knows it.
pub async fn event(c: &Client, id: i64, payload_cap: Option<i64>) -> Res<EventDetail> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&id];
    let secret_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&id, &payload_cap];
    let base = rows(
        c,
        "SELECT id, topic, subject, dispatch_key, state, attempts, max_attempts, available_at, lease_expires_at, \
         leased_by, published_at, delivered_at, dead_at, cancelled_at, last_error, errors \
         FROM outbox.events WHERE id = $1::bigint",
        &params,
    );
    let deliveries = rows(
        c,
        "SELECT subscription, topic, subject, state, attempts, max_attempts, leased_by, lease_expires_at, \
         available_at, delivered_at, dead_at, cancelled_at, last_error, errors \
         FROM outbox.deliveries WHERE event_id = $1::bigint ORDER BY subscription",
        &params,
    );
    let secret = c.query_opt(
        "SELECT CASE WHEN $2::bigint IS NULL OR octet_length(t.p) <= $2::bigint THEN t.p END, e.headers::text, \
         octet_length(t.p)::bigint FROM outbox.events e CROSS JOIN LATERAL (SELECT e.payload::text) AS t(p) \
         WHERE e.id = $1::bigint",
        &secret_params,
    );
    let (base, deliveries, secret) = tokio::join!(base, deliveries, secret);
    let mut deliveries = deliveries?;
    for d in &mut deliveries {
        let errors = normalize_errors(d.shift_remove("errors"));
        d.insert("errors".into(), errors);
    }
    let mut event = match base?.pop() {
        Some(e) => e,
        None => match deliveries.first() {
            // Known to named subscriptions only (`default` does not receive it): show what they have.
            Some(d) => {
                let mut e = Map::new();
                e.insert("id".into(), Value::from(id));
                for k in ["topic", "subject"] {
                    e.insert(k.into(), d.get(k).cloned().unwrap_or(Value::Null));
                }
                e
            }
            None => return Err(Failure::not_found(format!("no event with id {id}"))),
        },
    };
    let errors = normalize_errors(event.shift_remove("errors"));
    event.insert("errors".into(), errors);
    let (payload, headers, payload_hidden, payload_bytes, payload_truncated) = match secret {
        Ok(Some(row)) => {
            let payload: Option<String> = row.get(0);
            let headers: Option<String> = row.get(1);
            let bytes: Option<i64> = row.get(2);
            let truncated = payload.is_none() && bytes.is_some();
            let shown = if truncated { None } else { Some(pretty_json(payload.as_deref())) };
            (shown, Some(header_pairs(headers.as_deref())), false, bytes, truncated)
        }
        Ok(None) => (None, None, false, None, false),
        Err(e) => {
            let e = DbError::from_pg(&e);
            if !e.is_permission_denied() {
                return Err(e.into());
            }
            (None, None, true, None, false)
        }
    };
    Ok(EventDetail { event, payload, headers, payload_hidden, payload_bytes, payload_truncated, deliveries })
}

/// JSON text pretty-printed (as it came when it does not parse).
fn pretty_json(text: Option<&str>) -> String {
    match text {
        None => "null".to_string(),
        Some(t) => match serde_json::from_str::<Value>(t) {
            Ok(v) => serde_json::to_string_pretty(&v).unwrap_or_else(|_| t.to_string()),
            Err(_) => t.to_string(),
        },
    }
}

/// Header members in key order, non-string values shown as JSON.
fn header_pairs(text: Option<&str>) -> Vec<(String, String)> {
    match text.map(serde_json::from_str::<Value>) {
        Some(Ok(Value::Object(m))) => m
            .into_iter()
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                (k, v)
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// `outbox.blocked_subjects(subscription, max_rows)`; None when the extension lacks the function.
pub async fn blocked_subjects(
    c: &Client,
    subscription: Option<&str>,
    max_rows: i32,
) -> Res<Option<Vec<Map<String, Value>>>> {
    let got = rows(
        c,
        "SELECT subscription, subject, event_id, topic, state, reason, attempts, last_error, until, waiting \
         FROM outbox.blocked_subjects($1::text, $2::int)",
        &[&subscription, &max_rows],
    )
    .await;
    match got {
        Ok(r) => Ok(Some(r)),
        Err(e) if e.is_missing_api() => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// What the health page shows.
#[derive(Debug, Clone, Serialize)]
pub struct Health {
    /// `outbox.health()`, one row per check.
    pub checks: Vec<Map<String, Value>>,
    /// The worst status (`ok`, `warn`, `critical`).
    pub status: String,
    /// `outbox.wakeup_status()`: the background worker of this database.
    pub wakeup: Option<Map<String, Value>>,
    /// Live and dead tuples of the outbox tables (`pg_stat_all_tables`).
    pub tables: Vec<Map<String, Value>>,
    /// Sessions holding back the xmin horizon, oldest first (`pg_stat_activity`).
    pub xmin_holders: Vec<Map<String, Value>>,
}

/// Runs `outbox.health()` and reads the worker state, table statistics and xmin holders.
pub async fn health(c: &Client) -> Res<Health> {
    let checks = rows(c, "SELECT check_name, status, value, message FROM outbox.health()", &[]);
    let wakeup = rows(
        c,
        "SELECT worker_pid, database, passes, topics_waiting, prepared_waiting, preloaded, launcher_pid, state \
         FROM outbox.wakeup_status()",
        &[],
    );
    let tables = rows(
        c,
        "SELECT relname, n_live_tup, n_dead_tup, last_vacuum, last_autovacuum, autovacuum_count \
         FROM pg_catalog.pg_stat_all_tables WHERE schemaname = 'outbox' ORDER BY n_dead_tup DESC, relname",
        &[],
    );
    let holders = rows(
        c,
        "SELECT pid, usename, application_name, state, backend_xmin::text AS backend_xmin, \
         extract(epoch FROM now() - xact_start)::float8 AS xact_age_s, \
         pg_catalog.age(backend_xmin) AS xmin_age_xids \
         FROM pg_catalog.pg_stat_activity WHERE backend_xmin IS NOT NULL AND pid <> pg_catalog.pg_backend_pid() \
         ORDER BY pg_catalog.age(backend_xmin) DESC LIMIT 5",
        &[],
    );
    let (checks, wakeup, tables, holders) = tokio::join!(checks, wakeup, tables, holders);
    let checks = checks?;
    let rank = |s: &str| match s {
        "ok" => 0,
        "warn" => 1,
        "critical" => 2,
        _ => 3,
    };
    let status = checks.iter().map(|r| str_of(r, "status")).max_by_key(|s| rank(s)).unwrap_or_else(|| "ok".to_string());
    // The extras are PostgreSQL statistics a restricted role may not see in full: the checks are
    // what matters, so their failure only empties their table.
    Ok(Health {
        checks,
        status,
        wakeup: wakeup.ok().and_then(|mut w| w.pop()),
        tables: tables.unwrap_or_default(),
        xmin_holders: holders.unwrap_or_default(),
    })
}

/// The replay or cancel of one event for one subscription (`default` when None), after checking
/// its state like `outbox replay` does. Returns the refusal reason when the event is not eligible.
pub async fn act(
    c: &Client,
    id: i64,
    subscription: Option<&str>,
    action: crate::cli::replay::Action,
) -> Res<Result<(), String>> {
    let state: Option<Option<String>> = match subscription {
        None => scalar(c, "SELECT state FROM outbox.events WHERE id = $1::bigint", &[&id]).await?,
        Some(s) => {
            scalar(
                c,
                "SELECT state FROM outbox.deliveries WHERE event_id = $1::bigint AND subscription = $2::text",
                &[&id, &s],
            )
            .await?
        }
    };
    let Some(state) = state else {
        return Err(Failure::not_found(format!(
            "no event with id {id} in subscription '{}'",
            subscription.unwrap_or("default")
        )));
    };
    if let Some(reason) = action.refusal(state.as_deref()) {
        return Ok(Err(format!("cannot {} event {id}: {reason}", action.verb())));
    }
    let func = match action {
        crate::cli::replay::Action::Replay => "outbox.replay",
        crate::cli::replay::Action::Cancel => "outbox.cancel",
    };
    let changed: Option<Option<bool>> =
        scalar(c, &format!("SELECT {func}($1::bigint, $2::text)"), &[&id, &subscription]).await?;
    if changed.flatten().unwrap_or(false) {
        Ok(Ok(()))
    } else {
        Ok(Err(format!("event {id} changed state meanwhile; nothing was {}", action.done())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn page_numbers_are_validated() {
        assert_eq!(int_param(&q(&[]), "page", 1, 10).unwrap(), 1);
        assert_eq!(int_param(&q(&[("page", " 3 ")]), "page", 1, 10).unwrap(), 3);
        assert_eq!(int_param(&q(&[("page", "")]), "page", 1, 10).unwrap(), 1);
        for bad in ["0", "-1", "x", "11", "1e3", "99999999999999999999"] {
            let e = int_param(&q(&[("page", bad)]), "page", 1, 10).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }

    #[test]
    fn topic_filters_are_validated() {
        assert_eq!(topic_param(&q(&[("topic", "billing.*")])).unwrap().as_deref(), Some("billing.*"));
        assert!(topic_param(&q(&[("topic", "<script>")])).is_err());
        assert!(topic_param(&q(&[("topic", "a'; drop")])).is_err());
    }

    #[test]
    fn event_ids_are_validated() {
        assert_eq!(event_id("42").unwrap(), 42);
        for bad in ["0", "-3", "abc", "", "1.5"] {
            assert_eq!(event_id(bad).unwrap_err().status, StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn error_history_keeps_the_omitted_marker() {
        let v: Value = serde_json::from_str(r#"[{"attempt":1,"error":"x"},{"omitted":5},"odd"]"#).unwrap();
        let n = normalize_errors(Some(v));
        assert_eq!(n[1]["omitted"], 5);
        assert_eq!(n[2]["error"], "\"odd\"");
        assert_eq!(normalize_errors(None), Value::Array(vec![]));
    }

    #[test]
    fn totals_align_on_the_latest_minute() {
        let s =
            |sub: &str, v: Vec<i64>| Series { subscription: sub.into(), topic: "t".into(), start: None, delivered: v };
        let t = totals_by_subscription(&[s("a", vec![1, 2, 3]), s("a", vec![10, 20]), s("b", vec![5])]);
        assert_eq!(t["a"], vec![1, 12, 23]);
        assert_eq!(t["b"], vec![5]);
    }
}
