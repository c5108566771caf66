//! The JSON endpoints the pages poll (and scripts may read): `/api/stats`, `/api/health`,
//! `/api/dead`, `/api/events/{id}`, `/api/subjects/blocked`, `/api/throughput`. All are GETs and
//! read-only; failures are `{"error": "...", "status": N}` with the same status a page would
//! have. Values are PostgreSQL's own JSON rendering of each column, as on the pages.

use std::collections::HashMap;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::queries::{self, Failure, Res};
use super::Shared;

/// A failure as a JSON body with its status.
pub fn failure_json(f: Failure) -> Response {
    if f.status.is_server_error() {
        tracing::warn!(status = f.status.as_u16(), "{}", f.message);
    }
    (f.status, Json(json!({"error": f.message, "status": f.status.as_u16()}))).into_response()
}

fn reply(r: Res<Value>) -> Response {
    match r {
        Ok(v) => (StatusCode::OK, Json(v)).into_response(),
        Err(f) => failure_json(f),
    }
}

fn query_map(q: Result<Query<HashMap<String, String>>, QueryRejection>) -> Res<HashMap<String, String>> {
    q.map(|Query(m)| m).map_err(|e| Failure::bad_request(format!("bad query string: {}", e.body_text())))
}

/// `GET /api/stats`: `{"stats": [outbox.stats rows], "subscriptions": [outbox.subscriptions rows]}`.
pub async fn stats(State(state): State<Shared>) -> Response {
    reply(
        async {
            let c = state.pool.client().await?;
            let (stats, subs) = tokio::join!(queries::stats(&c), queries::subscriptions(&c));
            Ok(json!({"stats": stats?, "subscriptions": subs?}))
        }
        .await,
    )
}

/// `GET /api/health`: `{"status", "checks", "wakeup", "tables", "xmin_holders"}`.
pub async fn health(State(state): State<Shared>) -> Response {
    reply(
        async {
            let c = state.pool.client().await?;
            let h = queries::health(&c).await?;
            Ok(serde_json::to_value(h).unwrap_or(Value::Null))
        }
        .await,
    )
}

/// `GET /api/dead?topic=&subscription=&since=&until=&page=&per_page=`: one page of dead letters.
pub async fn dead(State(state): State<Shared>, q: Result<Query<HashMap<String, String>>, QueryRejection>) -> Response {
    reply(
        async {
            let q = query_map(q)?;
            let c = state.pool.client().await?;
            let page = queries::dead_letters(&c, &q).await?;
            Ok(serde_json::to_value(page).unwrap_or(Value::Null))
        }
        .await,
    )
}

/// `GET /api/events/{id}`: one event with its deliveries (`payload` null and `payload_hidden`
/// true when the role may not read it).
pub async fn event(State(state): State<Shared>, id: Result<Path<String>, PathRejection>) -> Response {
    reply(
        async {
            let raw = id.map(|Path(s)| s).map_err(|e| Failure::bad_request(format!("bad path: {}", e.body_text())))?;
            let id = queries::event_id(&raw)?;
            let c = state.pool.client().await?;
            let d = queries::event(&c, id, None).await?;
            Ok(serde_json::to_value(d).unwrap_or(Value::Null))
        }
        .await,
    )
}

/// `GET /api/subjects/blocked?subscription=&max_rows=`: `outbox.blocked_subjects()` rows.
pub async fn blocked(
    State(state): State<Shared>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Response {
    reply(
        async {
            let q = query_map(q)?;
            let c = state.pool.client().await?;
            let sub = queries::subscription_param(&c, &q).await?;
            let max_rows = queries::int_param(&q, "max_rows", 100, 10_000)? as i32;
            match queries::blocked_subjects(&c, sub.as_deref(), max_rows).await? {
                Some(rows) => Ok(Value::Array(rows.into_iter().map(Value::Object).collect())),
                None => Err(Failure {
                    status: StatusCode::NOT_IMPLEMENTED,
                    message: "outbox.blocked_subjects() is missing: update outbox_ext".into(),
                }),
            }
        }
        .await,
    )
}

/// `GET /api/throughput?minutes=60&subscription=`: deliveries per minute, one series per
/// subscription and topic, plus each subscription's total.
pub async fn throughput(
    State(state): State<Shared>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Response {
    reply(
        async {
            let q = query_map(q)?;
            let minutes = queries::int_param(&q, "minutes", 60, 1440)? as i32;
            let c = state.pool.client().await?;
            let sub = queries::subscription_param(&c, &q).await?;
            match queries::throughput(&c, minutes, sub.as_deref()).await? {
                Some(series) => {
                    let totals = queries::totals_by_subscription(&series);
                    Ok(json!({"minutes": minutes, "series": series, "totals": totals}))
                }
                None => Err(Failure {
                    status: StatusCode::NOT_IMPLEMENTED,
                    message: "outbox.delivered_per_minute() is missing: update outbox_ext".into(),
                }),
            }
        }
        .await,
    )
}
