//! Prometheus metrics and the `/metrics` + `/healthz` HTTP server.
//!
//! Invariants: metrics are observations only. Nothing here takes part in delivery decisions, and
//! the HTTP server failing (port taken) stops the relay at start rather than running blind. The
//! server binds to loopback by default; it serves no event data.
//!
//! `/healthz` answers 200 while PostgreSQL answered the last call, the relay is not stopping, and
//! at least one sink lane can deliver: the NATS sink while its broker is connected and its stream
//! accepts publishes; a webhook endpoint while it is neither disabled (410, subscription paused)
//! nor unreachable (its last request got no HTTP response: connection error or timeout). Else 503,
//! with the reason in the JSON body (`"reason"`). A lane counts as up until it has been seen down,
//! except the NATS sink, which is down until its stream has been created or validated.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context as _, Result};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus::{Encoder as _, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

/// All relay metrics, labelled by `sink` (`nats`, `webhook`) and `subscription`.
pub struct Metrics {
    registry: Registry,
    /// Events delivered and acked.
    pub relayed: IntCounterVec,
    /// Events failed with retries left (`fail` returned `pending`).
    pub failed: IntCounterVec,
    /// Events dead-lettered (`fail` returned `dead`).
    pub dead: IntCounterVec,
    /// Acks or fails that found the lease gone (another worker owns the event now).
    pub stale: IntCounterVec,
    /// Sink-level retries of one event (NATS: re-publish with the same Nats-Msg-Id).
    pub retries: IntCounterVec,
    /// PubAcks flagged duplicate by JetStream (a retry that had been stored already).
    pub duplicates: IntCounterVec,
    /// Claim-to-last-outcome time per batch.
    pub batch_seconds: HistogramVec,
    /// Events claimed and not finished yet.
    pub in_flight: IntGaugeVec,
    /// `outbox.subscriptions.lag_events`.
    pub lag_events: IntGaugeVec,
    /// `outbox.subscriptions.lag` in seconds.
    pub lag_seconds: prometheus::GaugeVec,
    /// 1 when a webhook endpoint is disabled (its subscription paused after a 410).
    pub endpoint_disabled: IntGaugeVec,
    /// 1 while the sink is reachable.
    pub sink_up: IntGaugeVec,
    /// 1 while PostgreSQL is reachable.
    pub db_up: prometheus::IntGauge,
    /// Health flags behind /healthz.
    pub health: Health,
}

/// Liveness flags read by `/healthz`.
#[derive(Default)]
pub struct Health {
    /// PostgreSQL answered the last call.
    pub db: AtomicBool,
    /// Shutdown has begun.
    pub stopping: AtomicBool,
    /// One entry per lane (the NATS sink, or each webhook endpoint).
    sinks: Mutex<Vec<Arc<SinkHealth>>>,
}

/// Whether one lane's sink can deliver, and why not.
pub struct SinkHealth {
    name: String,
    up: AtomicBool,
    reason: Mutex<String>,
}

impl SinkHealth {
    /// Records the state; `reason` says why it is down (ignored when up).
    pub fn set(&self, up: bool, reason: &str) {
        if !up {
            *self.reason.lock().unwrap_or_else(|p| p.into_inner()) = reason.to_string();
        }
        self.up.store(up, Ordering::Relaxed);
    }

    /// True while the lane can deliver.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }
}

impl Health {
    /// Adds a lane's sink, initially `up`.
    pub fn register_sink(&self, name: &str, up: bool, reason: &str) -> Arc<SinkHealth> {
        let s =
            Arc::new(SinkHealth { name: name.to_string(), up: AtomicBool::new(up), reason: Mutex::new(reason.into()) });
        self.sinks.lock().unwrap_or_else(|p| p.into_inner()).push(s.clone());
        s
    }

    /// (some lane can deliver, the reasons of those that cannot, `; `-separated).
    fn sink_status(&self) -> (bool, String) {
        let sinks = self.sinks.lock().unwrap_or_else(|p| p.into_inner());
        let up = sinks.iter().any(|s| s.is_up());
        let down: Vec<String> = sinks
            .iter()
            .filter(|s| !s.is_up())
            .map(|s| format!("{}: {}", s.name, s.reason.lock().unwrap_or_else(|p| p.into_inner())))
            .collect();
        if sinks.is_empty() {
            return (false, "sink not started".into());
        }
        (up, down.join("; "))
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Result<Arc<Self>> {
        let registry = Registry::new();
        let labels = &["sink", "subscription"];
        let counter = |name: &str, help: &str| -> Result<IntCounterVec> {
            let c = IntCounterVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let gauge = |name: &str, help: &str| -> Result<IntGaugeVec> {
            let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let relayed = counter("outbox_relay_events_relayed_total", "Events delivered to the sink and acked")?;
        let failed = counter("outbox_relay_events_failed_total", "Events failed with retries left")?;
        let dead = counter("outbox_relay_events_dead_total", "Events dead-lettered")?;
        let stale = counter("outbox_relay_stale_total", "Acks/fails whose lease had been taken over")?;
        let retries = counter("outbox_relay_sink_retries_total", "Re-sends of one event inside its lease")?;
        let duplicates = counter("outbox_relay_nats_duplicates_total", "PubAcks marked duplicate by JetStream")?;
        let batch_seconds = HistogramVec::new(
            HistogramOpts::new("outbox_relay_batch_seconds", "Time from claim to the last outcome of a batch").buckets(
                vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0],
            ),
            labels,
        )?;
        registry.register(Box::new(batch_seconds.clone()))?;
        let in_flight = gauge("outbox_relay_in_flight", "Events claimed and not finished")?;
        let lag_events = gauge("outbox_relay_lag_events", "Events of the subscription not delivered yet")?;
        let lag_seconds = prometheus::GaugeVec::new(
            Opts::new("outbox_relay_lag_seconds", "Age of the oldest undelivered event of the subscription"),
            labels,
        )?;
        registry.register(Box::new(lag_seconds.clone()))?;
        let endpoint_disabled = gauge("outbox_relay_endpoint_disabled", "1 while a webhook endpoint is disabled")?;
        let sink_up = gauge("outbox_relay_sink_up", "1 while the sink is reachable")?;
        let db_up = prometheus::IntGauge::new("outbox_relay_db_up", "1 while PostgreSQL is reachable")?;
        registry.register(Box::new(db_up.clone()))?;
        Ok(Arc::new(Self {
            registry,
            relayed,
            failed,
            dead,
            stale,
            retries,
            duplicates,
            batch_seconds,
            in_flight,
            lag_events,
            lag_seconds,
            endpoint_disabled,
            sink_up,
            db_up,
            health: Health::default(),
        }))
    }

    /// Records PostgreSQL reachability.
    pub fn set_db_up(&self, up: bool) {
        self.health.db.store(up, Ordering::Relaxed);
        self.db_up.set(i64::from(up));
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

async fn metrics_handler(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], m.render())
}

/// The `/healthz` answer: (healthy, JSON body).
pub fn health_report(h: &Health) -> (bool, String) {
    let db = h.db.load(Ordering::Relaxed);
    let (sink, sink_reason) = h.sink_status();
    let stopping = h.stopping.load(Ordering::Relaxed);
    let ok = db && sink && !stopping;
    let mut reasons = Vec::new();
    if stopping {
        reasons.push("stopping".to_string());
    }
    if !db {
        reasons.push("PostgreSQL unreachable".to_string());
    }
    if !sink {
        reasons.push(sink_reason);
    }
    let reason = serde_json::Value::String(reasons.join("; "));
    let body = format!(
        "{{\"status\":\"{}\",\"db\":{db},\"sink\":{sink},\"stopping\":{stopping},\"reason\":{reason}}}\n",
        if ok { "ok" } else { "unavailable" }
    );
    (ok, body)
}

async fn health_handler(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    let (ok, body) = health_report(&m.health);
    let code = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, [(header::CONTENT_TYPE, "application/json")], body)
}

/// Binds `addr` and serves `/metrics` and `/healthz` until the process exits. Returns the bound
/// address (useful with port 0).
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<SocketAddr> {
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} for /metrics"))?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(health_handler))
        .with_state(metrics);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("metrics server stopped: {e}");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthz_needs_one_sink_lane_up() {
        let h = Health::default();
        h.db.store(true, Ordering::Relaxed);
        assert!(!health_report(&h).0, "no sink yet");
        let a = h.register_sink("webhook main", true, "");
        let b = h.register_sink("webhook crm", true, "");
        assert!(health_report(&h).0);
        a.set(false, "disabled (HTTP 410)");
        assert!(health_report(&h).0, "one endpoint is still up");
        b.set(false, "unreachable: connection refused");
        let (ok, body) = health_report(&h);
        assert!(!ok);
        assert!(body.contains("webhook main: disabled (HTTP 410); webhook crm: unreachable"), "{body}");
        b.set(true, "");
        assert!(health_report(&h).0);
        h.stopping.store(true, Ordering::Relaxed);
        assert!(health_report(&h).1.contains("\"reason\":\"stopping\""));
    }
}
