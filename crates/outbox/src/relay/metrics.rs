//! Prometheus metrics and the `/metrics` + `/healthz` HTTP server.
//!
//! Invariants: metrics are observations only. Nothing here takes part in delivery decisions, and
//! the HTTP server failing (port taken) stops the relay at start rather than running blind. The
//! server binds to loopback by default; it serves no event data.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    /// The sink is reachable.
    pub sink: AtomicBool,
    /// Shutdown has begun.
    pub stopping: AtomicBool,
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

async fn health_handler(State(m): State<Arc<Metrics>>) -> impl IntoResponse {
    let db = m.health.db.load(Ordering::Relaxed);
    let sink = m.health.sink.load(Ordering::Relaxed);
    let stopping = m.health.stopping.load(Ordering::Relaxed);
    let ok = db && sink && !stopping;
    let body = format!(
        "{{\"status\":\"{}\",\"db\":{db},\"sink\":{sink},\"stopping\":{stopping}}}\n",
        if ok { "ok" } else { "unavailable" }
    );
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
