//! The webhook sink: signed HTTP POSTs following Standard Webhooks (<https://www.standardwebhooks.com/>).
//!
//! Invariants:
//! - The body is the payload exactly as `payload::text` returned it, byte for byte; the signature
//!   covers `<webhook-id>.<webhook-timestamp>.<body>` with HMAC-SHA256, once per configured
//!   `whsec_` secret (rotation), space separated as `v1,<base64>`.
//! - `webhook-id` is `<outbox id>:<event id>`, identical on every attempt and from every relay
//!   instance, so receivers deduplicate redeliveries (the outbox is at-least-once: an event is
//!   acked only after a 2xx, and a crash between the 2xx and the ack delivers it again).
//! - Outcome mapping: 2xx → ack; 410 → permanent failure and the endpoint is disabled by pausing
//!   its subscription (shared by every relay instance, kept across restarts; an operator
//!   re-enables it with `SELECT outbox.resume_subscription('<subscription>')`); other 4xx except
//!   408/429 → permanent failure with the status and a body excerpt; 408/429/5xx, timeouts and
//!   connection errors → `fail` with the outbox's backoff, or with `retry_in` = `Retry-After`.
//! - Only the 410 that disables the endpoint dead-letters its event. An event for an endpoint that
//!   is disabled already, in this process or by another instance (its subscription is paused), is
//!   failed with `retry_in = 0` and waits for the resume, whether it was about to be
//!   sent or its request was in flight when the disabling 410 came back: which of concurrent
//!   requests is answered first is a race, and a race must not make dead letters.
//! - Health (`/healthz`, `outbox_relay_sink_up`): an endpoint is down while disabled, or while its
//!   last request got no HTTP response (connection error, timeout); any HTTP status brings it up.
//! - Every endpoint has its own subscription, so one endpoint's dead letters, backlog or pause
//!   never hold back another's events, and per-subject order holds per endpoint.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use uuid::Uuid;

use super::config::EndpointConfig;
use super::metrics::SinkHealth;
use super::{Outcome, Shutdown};
use crate::db::{Db, Event};

/// Longest `Retry-After` honoured (longer values are capped).
const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);
/// Characters of a response body kept in a dead letter's error.
const BODY_EXCERPT: usize = 200;

/// One webhook endpoint with its HTTP client.
pub struct WebhookEndpoint {
    /// Settings.
    pub cfg: EndpointConfig,
    client: reqwest::Client,
    outbox_id: Uuid,
    disabled: AtomicBool,
    /// A 410 is pausing the subscription: until that commits, the subscription still reads as
    /// not paused, which must not enable the endpoint again.
    pausing: AtomicBool,
    /// The last request got no HTTP response.
    unreachable: AtomicBool,
    db: Arc<Db>,
    health: Arc<SinkHealth>,
    sink_up: prometheus::IntGauge,
}

/// The `webhook-signature` header value for one message.
pub fn sign(secrets: &[Vec<u8>], msg_id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut sigs = Vec::with_capacity(secrets.len());
    for key in secrets {
        // HMAC accepts keys of any length, so new_from_slice cannot fail here.
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else { continue };
        mac.update(msg_id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        sigs.push(format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())));
    }
    sigs.join(" ")
}

/// Parses `Retry-After`: delay seconds or an HTTP date.
fn retry_after(value: Option<&reqwest::header::HeaderValue>) -> Option<Duration> {
    let v = value?.to_str().ok()?.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(at.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO).min(MAX_RETRY_AFTER))
}

/// A short, single-line excerpt of a response body.
fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut s: String = text.chars().take(BODY_EXCERPT).map(|c| if c.is_control() { ' ' } else { c }).collect();
    if text.chars().count() > BODY_EXCERPT {
        s.push('…');
    }
    s
}

impl WebhookEndpoint {
    /// Builds the endpoint's HTTP client (rustls, no redirects, per-request timeout).
    pub fn new(
        cfg: EndpointConfig,
        outbox_id: Uuid,
        db: Arc<Db>,
        health: Arc<SinkHealth>,
        sink_up: prometheus::IntGauge,
    ) -> Result<Self> {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(cfg.timeout)
            .connect_timeout(cfg.timeout.min(Duration::from_secs(10)))
            .pool_max_idle_per_host(cfg.concurrency)
            .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")))
            .build()
            .context("HTTP client")?;
        Ok(Self {
            cfg,
            client,
            outbox_id,
            disabled: AtomicBool::new(false),
            pausing: AtomicBool::new(false),
            unreachable: AtomicBool::new(false),
            db,
            health,
            sink_up,
        })
    }

    fn refresh_health(&self) {
        let (up, reason) = if self.is_disabled() {
            (false, "disabled (HTTP 410; subscription paused)")
        } else if self.unreachable.load(Ordering::Relaxed) {
            (false, "unreachable (no HTTP response to the last request)")
        } else {
            (true, "")
        };
        self.health.set(up, reason);
        self.sink_up.set(i64::from(up));
    }

    fn set_unreachable(&self, unreachable: bool) {
        if self.unreachable.swap(unreachable, Ordering::Relaxed) != unreachable {
            self.refresh_health();
        }
    }

    /// What an event for a disabled endpoint becomes: it waits for the resume.
    fn disabled_outcome(&self) -> Outcome {
        Outcome::Retry {
            error: format!("webhook endpoint '{}' is disabled (HTTP 410 earlier)", self.cfg.name),
            retry_in: Some(Duration::ZERO),
        }
    }

    /// True while the endpoint is disabled (its subscription paused).
    pub fn is_disabled(&self) -> bool {
        self.disabled.load(Ordering::Relaxed)
    }

    /// Records the subscription's paused flag (read by the lane from `outbox.subscriptions`).
    pub fn set_disabled(&self, paused: bool) {
        if !paused && self.pausing.load(Ordering::Acquire) {
            return;
        }
        let was = self.disabled.swap(paused, Ordering::Relaxed);
        if was && !paused {
            tracing::info!(endpoint = %self.cfg.name, "webhook endpoint enabled again (subscription resumed)");
        }
        if was != paused {
            self.refresh_health();
        }
    }

    /// POSTs one event and maps the response to an outcome.
    pub async fn deliver(&self, ev: &Event, _shutdown: &Shutdown) -> Outcome {
        if self.is_disabled() {
            return self.disabled_outcome();
        }
        let msg_id = format!("{}:{}", self.outbox_id, ev.id);
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        let body = ev.payload.clone().into_bytes();
        let signature = sign(&self.cfg.secrets, &msg_id, ts, &body);
        let mut req = self
            .client
            .post(self.cfg.url.clone())
            .header("content-type", "application/json")
            .header("webhook-id", &msg_id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", signature)
            .header("outbox-topic", &ev.topic)
            .header("outbox-attempt", ev.attempt.to_string());
        // A value no HTTP header can carry (a control character such as a newline,
        // which the outbox accepts in a subject or a header) is left out: the request
        // could never be built, and retrying it would only burn attempts.
        if let Some(s) = ev.subject.as_deref().filter(|s| header_value_ok(s)) {
            req = req.header("outbox-subject", s);
        }
        for (k, v) in &ev.headers {
            if (k == "traceparent" || k == "tracestate") && header_value_ok(v) {
                req = req.header(k.as_str(), v.as_str());
            }
        }
        let resp = match req.body(body).send().await {
            Ok(r) => r,
            Err(e) => {
                let what = if e.is_timeout() {
                    "timed out".to_string()
                } else {
                    format!("request failed: {}", error_chain(&e))
                };
                self.set_unreachable(true);
                return Outcome::Retry { error: format!("webhook {}: {what}", self.cfg.name), retry_in: None };
            }
        };
        self.set_unreachable(false);
        let status = resp.status();
        if status.is_success() {
            return Outcome::Delivered;
        }
        let after = retry_after(resp.headers().get(reqwest::header::RETRY_AFTER));
        let body =
            tokio::time::timeout(self.cfg.timeout, resp.bytes()).await.ok().and_then(|r| r.ok()).unwrap_or_default();
        let error = format!("webhook {}: HTTP {}: {}", self.cfg.name, status.as_u16(), excerpt(&body));
        match status.as_u16() {
            410 => {
                if self.disable().await {
                    Outcome::Dead { error: format!("{error} (endpoint disabled)") }
                } else {
                    self.disabled_outcome()
                }
            }
            408 | 429 => Outcome::Retry { error, retry_in: after },
            s if s >= 500 => Outcome::Retry { error, retry_in: after },
            _ => Outcome::Dead { error },
        }
    }

    /// Marks the endpoint disabled and pauses its subscription, so every relay instance stops
    /// claiming for it until an operator resumes the subscription. True when this call disabled it;
    /// false when it was disabled already (here, or by another instance that paused it first).
    async fn disable(&self) -> bool {
        if self.disabled.swap(true, Ordering::Relaxed) {
            return false;
        }
        self.pausing.store(true, Ordering::Release);
        self.refresh_health();
        let disabled_here = self.pause().await;
        self.pausing.store(false, Ordering::Release);
        disabled_here
    }

    /// Pauses the subscription (see [`Self::disable`]); false when another instance had paused it.
    async fn pause(&self) -> bool {
        let sub = &self.cfg.subscription;
        tracing::error!(
            endpoint = %self.cfg.name,
            url = %crate::relay::nats::redact_url(self.cfg.url.as_str()),
            "webhook endpoint answered 410 Gone: disabled; re-enable with SELECT outbox.resume_subscription('{sub}')"
        );
        // Another instance may have disabled it first: its 410 made the dead letter, ours waits.
        // pause_subscription says whether this call paused it (it locks the catalog row, so of two
        // instances racing exactly one gets true).
        let mut delay = Duration::from_millis(100);
        for _ in 0..10 {
            match self.db.pause_subscription(sub).await {
                Ok(true) => return true,
                Ok(false) => {
                    tracing::info!(endpoint = %self.cfg.name, "subscription '{sub}' was paused already");
                    return false;
                }
                Err(e) => {
                    tracing::warn!("cannot pause subscription '{sub}': {e:#}; retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
            }
        }
        true
    }
}

/// An error with its sources on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        let t = inner.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = inner.source();
    }
    s
}

/// Whether `v` can be an HTTP header value (no control character but tab).
fn header_value_ok(v: &str) -> bool {
    reqwest::header::HeaderValue::from_str(v).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_with_control_characters_are_not_headers() {
        assert!(header_value_ok("invoice:7"));
        assert!(!header_value_ok("line\nbreak"));
        assert!(!header_value_ok("a\rb"));
    }

    #[test]
    fn signature_matches_the_standard_webhooks_example() {
        // Test vector of the Standard Webhooks reference libraries.
        let key = crate::relay::config::decode_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let sig = sign(&[key], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#);
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn two_secrets_two_signatures() {
        let sig = sign(&[b"a".to_vec(), b"b".to_vec()], "i", 1, b"{}");
        assert_eq!(sig.split(' ').count(), 2);
        assert!(sig.split(' ').all(|s| s.starts_with("v1,")));
    }

    #[test]
    fn retry_after_forms() {
        let v = reqwest::header::HeaderValue::from_static("7");
        assert_eq!(retry_after(Some(&v)), Some(Duration::from_secs(7)));
        let past = reqwest::header::HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT");
        assert_eq!(retry_after(Some(&past)), Some(Duration::ZERO));
        let bad = reqwest::header::HeaderValue::from_static("soon");
        assert_eq!(retry_after(Some(&bad)), None);
        assert_eq!(retry_after(None), None);
    }

    #[test]
    fn excerpt_is_short_and_single_line() {
        let long = "x\n".repeat(300);
        let e = excerpt(long.as_bytes());
        assert!(!e.contains('\n'));
        assert!(e.chars().count() <= BODY_EXCERPT + 1);
    }
}
