//! The NATS JetStream sink.
//!
//! Invariants (why no event is lost or doubled in the stream):
//! - An event is acked in the outbox only after JetStream's PubAck for it: a stored message is the
//!   only proof of delivery we accept. A relay killed at any point leaves the event leased, and
//!   the lease expires and hands it out again: at-least-once.
//! - Every publish of an event carries `Nats-Msg-Id = <outbox id>:<event id>`, the same on every
//!   attempt, from every relay instance, after any restart. JetStream drops a message whose id it
//!   has seen within the stream's duplicate window, so a re-publish after a lost PubAck, a lost
//!   outbox ack or a crash stores nothing new. The outbox id is a UUID made at install and kept by
//!   pg_dump, so two databases never share ids and a restored database keeps its own.
//! - A broker error or a PubAck timeout does not `fail` the event: we keep its lease (the
//!   dispatcher's heartbeat extends it) and publish the same message again with backoff, until a
//!   PubAck or the retry horizon. The relay refuses to start unless retry horizon + lease is
//!   shorter than the stream's duplicate window, so every such retry is deduplicated.
//! - Per-subject order: the outbox hands out a subject's next event only after the previous one is
//!   acked, and we ack only after the PubAck, so an event is never published before the earlier
//!   events of its subject are stored. The dispatcher also serialises events of one subject inside
//!   this process, as a second line of defence.
//! - While the broker is unreachable, or the stream is missing or failing, the claim loop waits in
//!   [`NatsSink::ready`], so no lease is taken and no attempt is burnt. Recovery runs the same
//!   create-or-validate step as the start ([`NatsSink::ensure_stream`]): a stream deleted while the
//!   relay runs is created again (in-flight events are re-published into it with their message
//!   ids), and a stream replaced by one that breaks the guarantees stops the relay.
//!
//! Error classes (JetStream API errors carry an HTTP-like `code` and an `err_code`):
//! - publish, per event: a 4xx code other than 404/408/409/429, or `err_code` 10054 (message over
//!   the stream's `max_msg_size`) or 10097 (headers too large), can never succeed for this message:
//!   the event is a dead letter at once, with the code and description, and the broker is not
//!   marked down. "No responders" / stream not found means the stream is missing: it is recreated
//!   (above). Everything else (timeouts, disconnects, 5xx such as no quorum or a full stream) is a
//!   broker fault: the same message is published again until the retry horizon.
//!   Codes of passing conditions (cluster forming, peers or resources missing, stream offline,
//!   stream full) are broker faults whatever their class.
//! - stream create: a refused configuration (`err_code` 10052 invalid config, 10096 invalid
//!   stream, 10074 replicas unsupported, 10065 subject overlap, 10073, 10003 bad request, 10025,
//!   10023/10028/10047 resources, 10027 stream limit, 10039/10076 JetStream disabled) stops the
//!   relay with one line; anything else (10058 name exists: a concurrent create; 10005 no peers
//!   while a cluster forms; timeouts) is retried.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use async_nats::jetstream::context::{CreateStreamErrorKind, PublishError, PublishErrorKind};
use async_nats::jetstream::{self, stream, ErrorCode};
use async_nats::HeaderMap;
use bytes::Bytes;
use uuid::Uuid;

use super::config::NatsConfig;
use super::metrics::SinkHealth;
use super::{Outcome, Shutdown};
use crate::db::Event;

/// A connected JetStream publisher for one stream.
pub struct NatsSink {
    client: async_nats::Client,
    js: jetstream::Context,
    cfg: NatsConfig,
    outbox_id: Uuid,
    healthy: AtomicBool,
    metrics: Arc<super::metrics::Metrics>,
    health: Arc<SinkHealth>,
    labels: [String; 2],
    lease: Duration,
    /// One create-or-validate at a time (claim loops and deliveries may all want to recover).
    ensure_lock: tokio::sync::Mutex<()>,
}

impl NatsSink {
    /// Connects (retrying with backoff until connected or shutdown), then creates or validates the
    /// stream. A stream whose settings would break the guarantees is an error.
    pub async fn connect(
        cfg: NatsConfig,
        outbox_id: Uuid,
        lease: Duration,
        metrics: Arc<super::metrics::Metrics>,
        subscription: &str,
        shutdown: &Shutdown,
    ) -> Result<Option<Self>> {
        let addrs: Vec<async_nats::ServerAddr> = cfg
            .urls
            .iter()
            .map(|u| u.parse())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| anyhow!("bad NATS URL: {e}"))?;
        let mut delay = Duration::from_millis(200);
        let client = loop {
            let mut opts = async_nats::ConnectOptions::new()
                .name("outbox-relay")
                .max_reconnects(None)
                .connection_timeout(Duration::from_secs(5))
                .ping_interval(Duration::from_secs(10))
                .reconnect_delay_callback(|attempts| {
                    Duration::from_millis((100u64 << attempts.min(5) as u64).min(2000) + fastrand::u64(0..100))
                })
                .event_callback(|event| async move {
                    match event {
                        async_nats::Event::Connected => tracing::info!("nats: connected"),
                        async_nats::Event::Disconnected => tracing::warn!("nats: disconnected"),
                        other => tracing::debug!("nats: {other}"),
                    }
                });
            if cfg.tls {
                opts = opts.require_tls(true);
            }
            if let Some(ca) = &cfg.ca_file {
                opts = opts.add_root_certificates(ca.clone());
            }
            match opts.connect(addrs.as_slice()).await {
                Ok(c) => break c,
                Err(e) => {
                    let urls: Vec<String> = cfg.urls.iter().map(|u| redact_url(u)).collect();
                    tracing::warn!("nats: cannot connect to {}: {e}; retrying in {delay:?}", urls.join(","));
                    if shutdown.sleep(delay).await {
                        return Ok(None);
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        };
        let mut js = jetstream::new(client.clone());
        js.set_timeout(cfg.ack_timeout);
        let labels = ["nats".to_string(), subscription.to_string()];
        let health = metrics.health.register_sink("nats", false, "stream not validated yet");
        let sink = Self {
            client,
            js,
            cfg,
            outbox_id,
            healthy: AtomicBool::new(false),
            metrics,
            health,
            labels,
            lease,
            ensure_lock: tokio::sync::Mutex::new(()),
        };
        let mut delay = Duration::from_millis(200);
        loop {
            match sink.ensure_stream().await {
                Ok(()) => break,
                Err(StreamError::Fatal(e)) => return Err(e),
                Err(StreamError::Retry(e)) => {
                    tracing::warn!("nats: stream '{}' not ready: {e}; retrying in {delay:?}", sink.cfg.stream);
                    if shutdown.sleep(delay).await {
                        return Ok(None);
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
        sink.set_healthy(true, "");
        Ok(Some(sink))
    }

    /// Creates the stream (subjects `<prefix>.>`) or checks that the existing one captures our
    /// subjects and deduplicates long enough.
    async fn ensure_stream(&self) -> std::result::Result<(), StreamError> {
        let lease = self.lease;
        let wanted_subject = format!("{}.>", self.cfg.prefix);
        match self.js.get_stream(&self.cfg.stream).await {
            Ok(mut s) => {
                let info = s.info().await.map_err(|e| StreamError::Retry(anyhow!("stream info: {e}")))?;
                let c = &info.config;
                let covers =
                    c.subjects.iter().any(|s| s == &wanted_subject || s == ">" || covers_prefix(s, &self.cfg.prefix));
                if !covers {
                    return Err(StreamError::Fatal(anyhow!(
                        "stream '{}' exists with subjects {:?}, which do not capture '{wanted_subject}'",
                        self.cfg.stream,
                        c.subjects
                    )));
                }
                let window = c.duplicate_window;
                if self.cfg.retry_horizon + lease >= window {
                    return Err(StreamError::Fatal(anyhow!(
                        "stream '{}' has a duplicate window of {}; the retry horizon ({}) + lease ({}) must be shorter",
                        self.cfg.stream,
                        humantime::format_duration(window),
                        humantime::format_duration(self.cfg.retry_horizon),
                        humantime::format_duration(lease)
                    )));
                }
                tracing::info!(
                    stream = %self.cfg.stream,
                    replicas = c.num_replicas,
                    duplicate_window = %humantime::format_duration(window),
                    "nats: using existing stream"
                );
                Ok(())
            }
            Err(e)
                if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(ref je)
                    if je.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                let config = stream::Config {
                    name: self.cfg.stream.clone(),
                    subjects: vec![wanted_subject.clone()],
                    duplicate_window: self.cfg.duplicate_window,
                    num_replicas: self.cfg.replicas,
                    storage: stream::StorageType::File,
                    ..Default::default()
                };
                match self.js.create_stream(config).await {
                    Ok(_) => {
                        tracing::info!(
                            stream = %self.cfg.stream,
                            subjects = %wanted_subject,
                            replicas = self.cfg.replicas,
                            "nats: created stream"
                        );
                        Ok(())
                    }
                    Err(e) => match e.kind() {
                        CreateStreamErrorKind::JetStream(je) if create_refused(&je) => {
                            Err(StreamError::Fatal(anyhow!(
                            "JetStream refused to create stream '{}' (subjects {wanted_subject}, duplicate window {}, \
                             {} replica(s)): {}",
                            self.cfg.stream,
                            humantime::format_duration(self.cfg.duplicate_window),
                            self.cfg.replicas,
                            describe(&je)
                        )))
                        }
                        _ => Err(StreamError::Retry(anyhow!("create stream: {e}"))),
                    },
                }
            }
            Err(e) => Err(StreamError::Retry(anyhow!("{e}"))),
        }
    }

    fn set_healthy(&self, up: bool, reason: &str) {
        self.healthy.store(up, Ordering::Relaxed);
        self.health.set(up, reason);
        self.metrics.sink_up.with_label_values(&self.labels).set(i64::from(up));
    }

    /// Waits until the broker is connected and the last publish (or a recovery) succeeded. Returns
    /// false when shutdown began first. The claim loop calls this before every claim.
    pub async fn ready(&self, shutdown: &Shutdown) -> bool {
        let mut delay = Duration::from_millis(100);
        loop {
            if shutdown.is_set() {
                return false;
            }
            let connected = self.client.connection_state() == async_nats::connection::State::Connected;
            if connected && self.healthy.load(Ordering::Relaxed) {
                return true;
            }
            if connected {
                if self.recover(shutdown).await {
                    return true;
                }
            } else {
                self.set_healthy(false, "broker unreachable");
            }
            if shutdown.sleep(delay).await {
                return false;
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    /// Connected but publishes failed (stream deleted, no JetStream quorum, leader election): runs
    /// the start's create-or-validate again before new leases are taken. True when the stream is
    /// usable. A stream that now breaks the guarantees stops the relay.
    async fn recover(&self, shutdown: &Shutdown) -> bool {
        // Whoever holds the lock recovers for everyone; the others keep their own backoff rather
        // than lining up behind it.
        let Ok(_one) = self.ensure_lock.try_lock() else { return false };
        if self.healthy.load(Ordering::Relaxed) {
            return true;
        }
        match tokio::time::timeout(self.cfg.ack_timeout * 2, self.ensure_stream()).await {
            Ok(Ok(())) => {
                tracing::info!("nats: stream '{}' usable again", self.cfg.stream);
                self.set_healthy(true, "");
                true
            }
            Ok(Err(StreamError::Fatal(e))) => {
                self.set_healthy(false, "stream unusable");
                shutdown.fatal(format!("{e:#}"));
                false
            }
            Ok(Err(StreamError::Retry(e))) => {
                tracing::debug!("nats: stream '{}' not ready: {e:#}", self.cfg.stream);
                false
            }
            Err(_) => false,
        }
    }

    /// The headers of one event's message.
    fn headers(&self, ev: &Event) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in &ev.headers {
            if valid_header_name(k) && !v.contains(['\r', '\n']) && !reserved_header(k) {
                h.insert(k.as_str(), v.as_str());
            }
        }
        h.insert("Nats-Msg-Id", format!("{}:{}", self.outbox_id, ev.id).as_str());
        h.insert("Outbox-Topic", ev.topic.as_str());
        h.insert("Outbox-Event-Id", ev.id.to_string().as_str());
        if let Some(s) = ev.subject.as_deref().filter(|s| !s.contains(['\r', '\n'])) {
            h.insert("Outbox-Subject", s);
        }
        if let Some(k) = ev.dispatch_key.as_deref().filter(|s| !s.contains(['\r', '\n'])) {
            h.insert("Outbox-Dispatch-Key", k);
        }
        h.insert("Outbox-Attempt", ev.attempt.to_string().as_str());
        h
    }

    /// Publishes one event until JetStream stores it (PubAck), re-publishing the same message id
    /// after errors, until the retry horizon or shutdown.
    pub async fn deliver(&self, ev: &Event, shutdown: &Shutdown) -> Outcome {
        let subject = format!("{}.{}", self.cfg.prefix, ev.topic);
        let headers = self.headers(ev);
        let payload = Bytes::from(ev.payload.clone());
        // The server closes the connection on a message over its max_payload
        // (headers included), which would fail every publish in flight: such an
        // event can never be delivered, so it is a dead letter at once.
        let size = payload.len() + header_bytes(&headers);
        let limit = self.client.server_info().max_payload;
        if limit > 0 && size > limit {
            return Outcome::Dead {
                error: format!("message of {size} bytes (payload and headers) exceeds the NATS server's max_payload of {limit} bytes"),
            };
        }
        let started = Instant::now();
        let mut delay = Duration::from_millis(50);
        loop {
            let attempt = async {
                let fut = self.js.publish_with_headers(subject.clone(), headers.clone(), payload.clone()).await?;
                fut.await
            };
            let error = match tokio::time::timeout(self.cfg.ack_timeout + Duration::from_millis(500), attempt).await {
                Ok(Ok(ack)) => {
                    if ack.duplicate {
                        self.metrics.duplicates.with_label_values(&self.labels).inc();
                    }
                    if !self.healthy.load(Ordering::Relaxed) {
                        self.set_healthy(true, "");
                    }
                    return Outcome::Delivered;
                }
                Ok(Err(e)) => match classify_publish(&e) {
                    PublishFailure::Permanent(why) => {
                        return Outcome::Dead { error: format!("nats publish to {subject} refused: {why}") };
                    }
                    PublishFailure::StreamMissing => {
                        self.set_healthy(false, "stream missing");
                        self.recover(shutdown).await;
                        format!("nats publish: stream '{}' missing: {e}", self.cfg.stream)
                    }
                    PublishFailure::Transient => {
                        self.set_healthy(false, "publishes failing");
                        format!("nats publish: {e}")
                    }
                },
                Err(_) => {
                    self.set_healthy(false, "no PubAck in time");
                    "nats publish: no PubAck in time".to_string()
                }
            };
            self.metrics.retries.with_label_values(&self.labels).inc();
            if shutdown.is_set() {
                return Outcome::Retry {
                    error: format!("relay shutting down; last error: {error}"),
                    retry_in: Some(Duration::ZERO),
                };
            }
            if started.elapsed() + delay >= self.cfg.retry_horizon {
                // Logged once per batch (BatchStats), not per event: an outage reaches the horizon
                // for every event in flight at once.
                return Outcome::RetryHorizon { error };
            }
            tracing::debug!(event = ev.id, "{error}; publishing again in {delay:?}");
            if shutdown.sleep(delay).await {
                return Outcome::Retry {
                    error: format!("relay shutting down; last error: {error}"),
                    retry_in: Some(Duration::ZERO),
                };
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }
}

enum StreamError {
    Fatal(anyhow::Error),
    Retry(anyhow::Error),
}

/// What a failed publish means for the event.
#[derive(Debug, PartialEq, Eq)]
enum PublishFailure {
    /// This message can never be stored: dead letter (with why).
    Permanent(String),
    /// No stream captures the subject: recreate it, then publish again.
    StreamMissing,
    /// A broker fault: publish again.
    Transient,
}

/// A JetStream API error for logs and dead letters: `JetStream: <description> (code N, error code M)`.
fn describe(e: &jetstream::Error) -> String {
    format!("JetStream: {e}")
}

/// Error codes of conditions that pass (cluster forming or electing, peers missing, resources or
/// storage exhausted, stream offline) whatever HTTP-like code the server gives them.
fn passing_condition(e: &jetstream::Error) -> bool {
    const CODES: [ErrorCode; 18] = [
        ErrorCode::ACCOUNT_RESOURCES_EXCEEDED,
        ErrorCode::CLUSTER_INCOMPLETE,
        ErrorCode::CLUSTER_NO_PEERS,
        ErrorCode::CLUSTER_NOT_ACTIVE,
        ErrorCode::CLUSTER_NOT_ASSIGNED,
        ErrorCode::CLUSTER_NOT_AVAILABLE,
        ErrorCode::CLUSTER_NOT_LEADER,
        ErrorCode::CLUSTER_REQUIRED,
        ErrorCode::INSUFFICIENT_RESOURCES,
        ErrorCode::MEMORY_RESOURCES_EXCEEDED,
        ErrorCode::CLUSTER_PEER_NOT_MEMBER,
        ErrorCode::RAFT_GENERAL,
        ErrorCode::CLUSTER_SERVER_NOT_MEMBER,
        ErrorCode::STORAGE_RESOURCES_EXCEEDED,
        ErrorCode::STREAM_ASSIGNMENT,
        ErrorCode::PEER_REMAP,
        ErrorCode::STREAM_STORE_FAILED,
        ErrorCode::STREAM_OFFLINE,
    ];
    CODES.contains(&e.error_code())
}

/// Whether a JetStream API error answering a publish rejects this message for good.
fn publish_refused(e: &jetstream::Error) -> bool {
    let code = e.code();
    let per_message = [ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM, ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM];
    per_message.contains(&e.error_code())
        || ((400..500).contains(&code) && ![404, 408, 409, 429].contains(&code) && !passing_condition(e))
}

/// Whether a JetStream API error answering a stream create refuses our configuration. Only named
/// codes: while a cluster forms, creates fail with 4xx codes too ("no suitable peers").
fn create_refused(e: &jetstream::Error) -> bool {
    let config = [
        ErrorCode::STREAM_INVALID_CONFIG,
        ErrorCode::STREAM_INVALID,
        ErrorCode::STREAM_REPLICAS_NOT_SUPPORTED,
        ErrorCode::STREAM_SUBJECT_OVERLAP,
        ErrorCode::NAME_NOT_MATCH_SUBJECT,
        ErrorCode::BAD_REQUEST,
        ErrorCode::INVALID_JSON,
        ErrorCode::INSUFFICIENT_RESOURCES,
        ErrorCode::MEMORY_RESOURCES_EXCEEDED,
        ErrorCode::STORAGE_RESOURCES_EXCEEDED,
        ErrorCode::MAXIMUM_STREAMS_LIMIT,
        ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
        ErrorCode::JETSTREAM_NOT_ENABLED,
    ];
    config.contains(&e.error_code())
}

fn classify_publish(e: &PublishError) -> PublishFailure {
    match e.kind() {
        PublishErrorKind::StreamNotFound => PublishFailure::StreamMissing,
        PublishErrorKind::Other | PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            match std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>()) {
                Some(je) if je.error_code() == ErrorCode::STREAM_NOT_FOUND => PublishFailure::StreamMissing,
                Some(je) if publish_refused(je) => PublishFailure::Permanent(describe(je)),
                _ => PublishFailure::Transient,
            }
        }
        _ => PublishFailure::Transient,
    }
}

/// True when stream subject `s` (e.g. `outbox.>` or `a.>`) captures every `<prefix>.<topic>`.
fn covers_prefix(s: &str, prefix: &str) -> bool {
    let Some(base) = s.strip_suffix(".>") else { return false };
    prefix == base || prefix.starts_with(&format!("{base}."))
}

/// NATS header names: printable ASCII without `:` or spaces.
fn valid_header_name(k: &str) -> bool {
    !k.is_empty() && k.bytes().all(|b| b.is_ascii_graphic() && b != b':')
}

/// `url` with its user information (`user:password@`) replaced by `***@`, for logs.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let rest = &url[scheme_end..];
    let host_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..host_end].rfind('@') {
        Some(at) => format!("{}***{}", &url[..scheme_end], &rest[at..]),
        None => url.to_string(),
    }
}

/// The size of `headers` on the wire: the `NATS/1.0` line, each `name: value`
/// line, and the blank line that ends them.
fn header_bytes(headers: &HeaderMap) -> usize {
    let mut n = "NATS/1.0\r\n\r\n".len();
    for (name, values) in headers.iter() {
        for v in values {
            n += name.to_string().len() + 2 + v.as_str().len() + 2;
        }
    }
    n
}

/// Header names an event's own headers may not set (compared without case):
/// JetStream's control headers (`Nats-Expected-Stream`, `Nats-Rollup`,
/// `Nats-Msg-Id`, ...: a publisher must not steer the stream) and the
/// relay's `Outbox-*` headers, which describe the event and always win.
fn reserved_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower.starts_with("nats-") || lower.starts_with("outbox-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_not_logged() {
        assert_eq!(redact_url("nats://alice:s3cret@127.0.0.1:4222"), "nats://***@127.0.0.1:4222");
        assert_eq!(redact_url("tls://tok@h:1/x@y"), "tls://***@h:1/x@y");
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn header_size_counts_every_line() {
        let mut h = HeaderMap::new();
        assert_eq!(header_bytes(&h), 12);
        h.insert("a", "bc");
        h.insert("Nats-Msg-Id", "x:1");
        assert_eq!(header_bytes(&h), 12 + (1 + 2 + 2 + 2) + (11 + 2 + 3 + 2));
    }

    #[test]
    fn events_cannot_set_control_or_relay_headers() {
        for name in ["Nats-Expected-Stream", "nats-rollup", "NATS-MSG-ID", "outbox-topic", "OUTBOX-EVENT-ID"] {
            assert!(reserved_header(name), "{name}");
        }
        for name in ["traceparent", "tracestate", "x-tenant", "natsy"] {
            assert!(!reserved_header(name), "{name}");
        }
    }

    #[test]
    fn prefix_coverage() {
        assert!(covers_prefix("outbox.>", "outbox"));
        assert!(covers_prefix("a.>", "a.b"));
        assert!(!covers_prefix("a.b.>", "a"));
        assert!(!covers_prefix("outbox.*", "outbox"));
    }

    fn api_error(code: usize, err_code: u64) -> jetstream::Error {
        serde_json::from_value(serde_json::json!({"code": code, "err_code": err_code, "description": "d"})).unwrap()
    }

    #[test]
    fn publish_errors_that_no_retry_fixes() {
        assert!(publish_refused(&api_error(400, 10054)), "message over max_msg_size");
        assert!(publish_refused(&api_error(500, 10097)), "headers too large, whatever the code");
        assert!(publish_refused(&api_error(400, 10109)), "4xx");
        assert!(!publish_refused(&api_error(503, 10077)), "stream full: may drain");
        assert!(!publish_refused(&api_error(503, 10008)), "no quorum");
        assert!(!publish_refused(&api_error(404, 10059)), "stream missing: recreated");
        assert!(!publish_refused(&api_error(408, 10003)));
        assert!(!publish_refused(&api_error(400, 10002)), "account resources exceeded: may free up");
        assert_eq!(describe(&api_error(400, 10054)), "JetStream: d (code 400, error code 10054)");
    }

    #[test]
    fn stream_configs_the_server_refuses() {
        assert!(create_refused(&api_error(500, 10074)), "replicas > 1 without a cluster");
        assert!(create_refused(&api_error(500, 10052)), "invalid config, e.g. duplicate window over the limit");
        assert!(create_refused(&api_error(400, 10065)), "subject overlap");
        assert!(create_refused(&api_error(400, 10003)), "bad request");
        assert!(!create_refused(&api_error(400, 10058)), "name exists: a concurrent create, validate it");
        assert!(!create_refused(&api_error(503, 10008)), "cluster not available");
        assert!(!create_refused(&api_error(500, 10041)), "raft error");
        assert!(!create_refused(&api_error(400, 10005)), "no suitable peers: the cluster is forming");
    }

    #[test]
    fn header_names() {
        assert!(valid_header_name("traceparent"));
        assert!(!valid_header_name("a b"));
        assert!(!valid_header_name("a:b"));
        assert!(!valid_header_name(""));
    }
}
