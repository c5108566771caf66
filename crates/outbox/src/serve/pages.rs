//! The HTML pages: Overview, Dead letters, Event detail, Subjects, Health, the replay and cancel
//! actions, the static assets, and the 400/404/500 pages.
//!
//! Handlers take the query string and path as raw strings (axum's rejections would answer in
//! plain text) and validate them through [`super::queries`], so every bad input is an HTML page
//! with a status and one escaped line. The POST handlers change nothing before
//! [`super::auth::check_post`] passed.

use std::collections::{BTreeMap, HashMap};

use axum::extract::rejection::{FormRejection, PathRejection, QueryRejection};
use axum::extract::{Form, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{Html, IntoResponse, Redirect, Response};
use minijinja::context;
use minijinja::value::Value;
use serde_json::Map;

use super::auth::{check_post, ActionForm};
use super::charts::sparkline;
use super::queries::{self, Failure, Res};
use super::templates::ASSETS;
use super::Shared;
use crate::cli::replay::Action;

/// Minutes of history behind each sparkline.
const SPARK_MINUTES: i32 = 60;

/// Renders a page with the context every page gets (actions flag, CSRF token, active tab).
fn render(state: &Shared, status: StatusCode, name: &str, active: &str, ctx: Value) -> Response {
    let full = context! {
        actions => state.actions(),
        csrf => state.csrf.clone(),
        active => active,
        version => env!("CARGO_PKG_VERSION"),
        ..ctx
    };
    match state.templates.render(name, full) {
        Ok(html) => (status, Html(html)).into_response(),
        Err(e) => {
            tracing::error!("template {name}: {e:#}");
            (StatusCode::INTERNAL_SERVER_ERROR, "the page could not be rendered (see the server log)\n").into_response()
        }
    }
}

/// The error page for a failure.
pub fn failure_page(state: &Shared, f: Failure) -> Response {
    if f.status.is_server_error() {
        tracing::warn!(status = f.status.as_u16(), "{}", f.message);
    }
    let title = f.status.canonical_reason().unwrap_or("Error");
    render(
        state,
        f.status,
        "error.html",
        "",
        context! { status => f.status.as_u16(), title => title, message => f.message },
    )
}

/// The query string as a map, or a 400 when it does not decode.
fn query_map(q: Result<Query<HashMap<String, String>>, QueryRejection>) -> Res<HashMap<String, String>> {
    q.map(|Query(m)| m).map_err(|e| Failure::bad_request(format!("bad query string: {}", e.body_text())))
}

/// A path segment, or a 400 when it does not decode.
fn path_str(p: Result<Path<String>, PathRejection>) -> Res<String> {
    p.map(|Path(s)| s).map_err(|e| Failure::bad_request(format!("bad path: {}", e.body_text())))
}

/// A row as a template map, so computed values (sparklines) can be added beside the SQL ones.
fn mj(row: Map<String, serde_json::Value>) -> BTreeMap<String, Value> {
    row.into_iter().map(|(k, v)| (k, Value::from_serialize(&v))).collect()
}

/// Turns a handler's result into a response (the error page on failure).
fn respond(state: &Shared, r: Res<Response>) -> Response {
    r.unwrap_or_else(|f| failure_page(state, f))
}

/// `GET /`: per subscription and per topic: backlog, oldest ready event, deliveries per minute
/// with a sparkline of the last hour, dead letters, leases in flight.
pub async fn overview(State(state): State<Shared>) -> Response {
    let r = async {
        let c = state.pool.client().await?;
        let (stats, subs, series) =
            tokio::join!(queries::stats(&c), queries::subscriptions(&c), queries::throughput(&c, SPARK_MINUTES, None));
        let (stats, subs, series) = (stats?, subs?, series?);
        let by_key: HashMap<(String, String), &queries::Series> =
            series.iter().flatten().map(|s| ((s.subscription.clone(), s.topic.clone()), s)).collect();
        let totals = series.as_deref().map(queries::totals_by_subscription).unwrap_or_default();
        let mut per_sub: HashMap<String, (f64, i64, i64)> = HashMap::new();
        let topics: Vec<BTreeMap<String, Value>> = stats
            .into_iter()
            .map(|row| {
                let sub = queries::str_of(&row, "subscription");
                let topic = queries::str_of(&row, "topic");
                let agg = per_sub.entry(sub.clone()).or_insert((0.0, 0, 0));
                if let Some(age) = row.get("oldest_ready_s").and_then(serde_json::Value::as_f64) {
                    agg.0 = agg.0.max(age);
                }
                agg.1 += row.get("delivered_last_minute").and_then(serde_json::Value::as_i64).unwrap_or(0);
                agg.2 += row.get("delivered_last_hour").and_then(serde_json::Value::as_i64).unwrap_or(0);
                let mut m = mj(row);
                if let Some(s) = by_key.get(&(sub, topic)) {
                    m.insert("spark".into(), Value::from_safe_string(sparkline(&s.delivered)));
                }
                m
            })
            .collect();
        let subscriptions: Vec<BTreeMap<String, Value>> = subs
            .into_iter()
            .map(|row| {
                let name = queries::str_of(&row, "name");
                let (oldest, per_min, per_hour) = per_sub.get(&name).copied().unwrap_or((0.0, 0, 0));
                let mut m = mj(row);
                m.insert("oldest_ready_s".into(), Value::from(oldest));
                m.insert("delivered_last_minute".into(), Value::from(per_min));
                m.insert("delivered_last_hour".into(), Value::from(per_hour));
                if let Some(t) = totals.get(&name) {
                    m.insert("spark".into(), Value::from_safe_string(sparkline(t)));
                }
                m
            })
            .collect();
        Ok(render(
            &state,
            StatusCode::OK,
            "overview.html",
            "overview",
            context! {
                topics => topics,
                subscriptions => subscriptions,
                throughput_available => series.is_some(),
                spark_minutes => SPARK_MINUTES,
            },
        ))
    }
    .await;
    respond(&state, r)
}

/// The "done" banner after an action, from validated query parameters only (never echoed text).
fn done_banner(q: &HashMap<String, String>) -> Option<String> {
    let id = q.get("id").and_then(|v| v.parse::<i64>().ok())?;
    match q.get("done").map(String::as_str) {
        Some("replayed") => Some(format!("Event {id} replayed: it is pending again.")),
        Some("cancelled") => Some(format!("Event {id} cancelled.")),
        _ => None,
    }
}

/// `GET /dead`: dead letters, filtered by topic, subscription and time, a page at a time, each
/// with its error history.
pub async fn dead_letters(
    State(state): State<Shared>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Response {
    let r = async {
        let q = query_map(q)?;
        let c = state.pool.client().await?;
        let page = queries::dead_letters(&c, &q).await?;
        let subs = queries::subscriptions(&c).await?;
        let names: Vec<String> = subs.iter().map(|s| queries::str_of(s, "name")).collect();
        let base = filter_query(&page.filter);
        Ok(render(
            &state,
            StatusCode::OK,
            "dead.html",
            "dead",
            context! {
                page => Value::from_serialize(&page),
                subscriptions => names,
                base_query => base,
                done => done_banner(&q),
                back => back_path("/dead", &q),
            },
        ))
    }
    .await;
    respond(&state, r)
}

/// The filters of a dead-letter page as a query string (without `page`), for the pager links.
fn filter_query(f: &queries::DeadFilter) -> String {
    let mut parts = Vec::new();
    for (k, v) in [("topic", &f.topic), ("subscription", &f.subscription), ("since", &f.since), ("until", &f.until)] {
        if let Some(v) = v {
            parts.push(format!("{k}={}", url_encode(v)));
        }
    }
    if f.per_page != queries::DEFAULT_PER_PAGE {
        parts.push(format!("per_page={}", f.per_page));
    }
    parts.join("&")
}

/// Percent-encodes a query-string value.
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~*".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// This page's own path and query (minus the banner parameters), for an action's return trip.
fn back_path(path: &str, q: &HashMap<String, String>) -> String {
    let mut keys: Vec<&String> = q.keys().filter(|k| *k != "done" && *k != "id").collect();
    keys.sort();
    let qs: Vec<String> = keys.iter().map(|k| format!("{}={}", url_encode(k), url_encode(&q[*k]))).collect();
    if qs.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{}", qs.join("&"))
    }
}

/// `GET /events/{id}`: payload, headers, attempts, error history, and the state in every
/// subscription.
pub async fn event_detail(
    State(state): State<Shared>,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Response {
    let r = async {
        let id = queries::event_id(&path_str(id)?)?;
        let q = query_map(q)?;
        let c = state.pool.client().await?;
        let detail = queries::event(&c, id, Some(queries::PAGE_PAYLOAD_CAP)).await?;
        Ok(render(
            &state,
            StatusCode::OK,
            "event.html",
            "",
            context! {
                ev => Value::from_serialize(&detail),
                payload_cap => queries::PAGE_PAYLOAD_CAP,
                done => done_banner(&q),
                back => format!("/events/{id}"),
            },
        ))
    }
    .await;
    respond(&state, r)
}

/// `GET /events?id=N` (the header's jump box without script): a redirect to the event's page.
pub async fn event_jump(
    State(state): State<Shared>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Response {
    let r = async {
        let q = query_map(q)?;
        let id = queries::event_id(q.get("id").map(String::as_str).unwrap_or(""))?;
        Ok(Redirect::to(&format!("/events/{id}")).into_response())
    }
    .await;
    respond(&state, r)
}

/// `GET /subjects`: subjects whose earliest unfinished event holds back later ones, why, and by
/// which event.
pub async fn subjects(
    State(state): State<Shared>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Response {
    let r = async {
        let q = query_map(q)?;
        let c = state.pool.client().await?;
        let sub = queries::subscription_param(&c, &q).await?;
        let max_rows = queries::int_param(&q, "max_rows", 100, 10_000)? as i32;
        let blocked = queries::blocked_subjects(&c, sub.as_deref(), max_rows).await?;
        let subs = queries::subscriptions(&c).await?;
        let names: Vec<String> = subs.iter().map(|s| queries::str_of(s, "name")).collect();
        Ok(render(
            &state,
            StatusCode::OK,
            "subjects.html",
            "subjects",
            context! {
                available => blocked.is_some(),
                blocked => Value::from_serialize(blocked.unwrap_or_default()),
                subscription => sub,
                subscriptions => names,
                max_rows => max_rows,
            },
        ))
    }
    .await;
    respond(&state, r)
}

/// `GET /health`: `outbox.health()`, the background worker, the xmin holders and the dead tuples of
/// the outbox tables.
pub async fn health(State(state): State<Shared>) -> Response {
    let r = async {
        let c = state.pool.client().await?;
        let h = queries::health(&c).await?;
        Ok(render(&state, StatusCode::OK, "health.html", "health", context! { h => Value::from_serialize(&h) }))
    }
    .await;
    respond(&state, r)
}

/// A local path to return to after an action: only paths of this server (`/...`, never `//host`
/// or a scheme), else the event's page.
fn safe_back(back: &str, id: i64) -> String {
    let ok = back.starts_with('/')
        && !back.starts_with("//")
        && !back.contains('\\')
        && back.chars().all(|c| c.is_ascii_graphic());
    if ok {
        back.to_string()
    } else {
        format!("/events/{id}")
    }
}

/// `POST /events/{id}/replay`.
pub async fn replay(
    State(state): State<Shared>,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    act(state, id, headers, form, Action::Replay).await
}

/// `POST /events/{id}/cancel`.
pub async fn cancel(
    State(state): State<Shared>,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    act(state, id, headers, form, Action::Cancel).await
}

async fn act(
    state: Shared,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    form: Result<Form<ActionForm>, FormRejection>,
    action: Action,
) -> Response {
    let r = async {
        // A body that does not decode is treated as empty, so it fails the CSRF check (403)
        // like any other forged request.
        let form = form.map(|Form(f)| f).unwrap_or_default();
        check_post(&state, &headers, &form)?;
        let id = queries::event_id(&path_str(id)?)?;
        let sub = form.subscription.trim();
        let sub = if sub.is_empty() || sub == "default" { None } else { Some(sub) };
        let c = state.pool.client().await?;
        match queries::act(&c, id, sub, action).await? {
            Ok(()) => {
                tracing::info!(event = id, subscription = sub.unwrap_or("default"), "dashboard: {}", action.done());
                let back = safe_back(&form.back, id);
                let sep = if back.contains('?') { '&' } else { '?' };
                Ok(Redirect::to(&format!("{back}{sep}done={}&id={id}", action.done())).into_response())
            }
            Err(reason) => Err(Failure { status: StatusCode::CONFLICT, message: reason }),
        }
    }
    .await;
    respond(&state, r)
}

/// `GET /assets/{name}`: the embedded CSS and JS.
pub async fn asset(State(state): State<Shared>, name: Result<Path<String>, PathRejection>) -> Response {
    let name = name.map(|Path(n)| n).unwrap_or_default();
    match ASSETS.iter().find(|(n, _, _)| *n == name) {
        Some((_, ctype, body)) => {
            ([(header::CONTENT_TYPE, *ctype), (header::CACHE_CONTROL, "no-cache")], *body).into_response()
        }
        None => failure_page(&state, Failure::not_found(format!("no asset '{name}'"))),
    }
}

/// Every other path: a 404 page (JSON under `/api/`).
pub async fn not_found(State(state): State<Shared>, uri: Uri) -> Response {
    let f = Failure::not_found(format!("no page at {}", uri.path()));
    if uri.path().starts_with("/api/") {
        return super::api::failure_json(f);
    }
    failure_page(&state, f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn back_paths_stay_on_this_server() {
        assert_eq!(safe_back("/dead?page=2", 7), "/dead?page=2");
        assert_eq!(safe_back("//evil.example/x", 7), "/events/7");
        assert_eq!(safe_back("https://evil.example/", 7), "/events/7");
        assert_eq!(safe_back("/\\evil", 7), "/events/7");
        assert_eq!(safe_back("", 7), "/events/7");
    }

    #[test]
    fn banners_come_from_known_words_only() {
        let q = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert_eq!(
            done_banner(&q(&[("done", "replayed"), ("id", "5")])).unwrap(),
            "Event 5 replayed: it is pending again."
        );
        assert!(done_banner(&q(&[("done", "<b>"), ("id", "5")])).is_none());
        assert!(done_banner(&q(&[("done", "replayed"), ("id", "x")])).is_none());
    }

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(url_encode("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
        assert_eq!(url_encode("billing.*"), "billing.*");
    }
}
