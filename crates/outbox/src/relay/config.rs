//! Relay configuration: command-line flags, environment variables and an optional TOML file.
//!
//! Precedence: a flag, then its environment variable (clap reads both), then the `--config` file,
//! then the built-in default. The DSN follows the same order: `--dsn` (a global flag of the
//! top-level command, so `outbox --dsn X relay` and `outbox relay --dsn X` are the same), then
//! `OUTBOX_DSN`, then the file's `dsn`. Everything is validated here, before any connection is made, so a
//! bad value is one error line and a non-zero exit, never a panic or a half-started relay.
//!
//! Invariants checked here that the delivery guarantees rely on:
//! - the NATS retry horizon plus the lease is shorter than the stream's duplicate window (checked
//!   again against the live stream in `nats.rs`), so a message retried with the same
//!   `Nats-Msg-Id` is always deduplicated by JetStream;
//! - subscription and endpoint names follow the extension's rules, so a name typo fails at start;
//! - every webhook secret decodes (`whsec_` + base64), so no event is ever sent unsigned;
//! - every setting given is used: a flag, variable or file section of the other sink (e.g.
//!   `--webhook-url` with `--sink nats`, a `[nats]` table with `sink = "webhook"`) is an error, not
//!   silently ignored;
//! - a DSN without a host gets what libpq (and the operator commands, `cli/conn.rs`) would use:
//!   `PGHOST`, else the Unix socket directory `/var/run/postgresql` when it exists, else
//!   `localhost`; the port, database and password the DSN leaves out come from `PGPORT`,
//!   `PGDATABASE` and `PGPASSWORD` (the port then defaults to 5432).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use base64::Engine as _;
use clap::{Args, ValueEnum};
use serde::Deserialize;

/// Which sink the relay delivers into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SinkKind {
    /// NATS JetStream.
    Nats,
    /// HTTP endpoints, signed as Standard Webhooks.
    Webhook,
}

impl SinkKind {
    /// The sink's name in subscription names, metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            SinkKind::Nats => "nats",
            SinkKind::Webhook => "webhook",
        }
    }
}

/// `outbox relay`: move events from the outbox into NATS JetStream or signed webhooks.
#[derive(Debug, Args)]
#[command(after_help = "Every flag can also be set in the --config TOML file (same name, '-' → '_', \
    nats_*/webhook_* in [nats]/[webhook] tables) or with its environment variable.")]
pub struct RelayArgs {
    /// TOML configuration file (optional; flags and environment variables take precedence).
    #[arg(long, env = "OUTBOX_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Sink to deliver into.
    #[arg(long, env = "OUTBOX_SINK", value_enum)]
    pub sink: Option<SinkKind>,
    /// PostgreSQL connection string (libpq key/value or URL; sslmode=require/verify-ca/verify-full
    /// use TLS): the top-level global `--dsn`, or `OUTBOX_DSN` (clap reads both), handed over by
    /// `main` after parsing; it takes precedence over the config file's `dsn`.
    #[arg(skip)]
    pub dsn: Option<String>,
    /// Refused (a usage error, see `main.rs`): this command prints no data.
    #[arg(long, hide = true)]
    pub json: bool,
    /// Subscription to claim from (created when missing). Default: relay-<sink>.
    #[arg(long, env = "OUTBOX_SUBSCRIPTION")]
    pub subscription: Option<String>,
    /// Where a subscription the relay creates starts: now or earliest.
    #[arg(long, env = "OUTBOX_SUBSCRIPTION_START")]
    pub subscription_start: Option<String>,
    /// Topic patterns to relay (claim's syntax: exact, prefix.*, *); comma separated. Default: all.
    #[arg(long, env = "OUTBOX_TOPICS", value_delimiter = ',')]
    pub topics: Option<Vec<String>>,
    /// Worker name recorded with each claim. Default: outbox-relay@<host>:<pid>.
    #[arg(long, env = "OUTBOX_WORKER")]
    pub worker: Option<String>,
    /// Events per claim.
    #[arg(long, env = "OUTBOX_BATCH_SIZE")]
    pub batch_size: Option<u32>,
    /// Lease per claim (heartbeats extend it while a delivery is slow), e.g. 30s.
    #[arg(long, env = "OUTBOX_LEASE", value_parser = parse_duration)]
    pub lease: Option<Duration>,
    /// Claim again at least this often when no notification arrives.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", value_parser = parse_duration)]
    pub poll_interval: Option<Duration>,
    /// Events out at once (NATS: publishes awaiting their PubAck).
    #[arg(long, env = "OUTBOX_MAX_IN_FLIGHT")]
    pub max_in_flight: Option<u32>,
    /// Concurrent claim loops (each with its own connection) per subscription.
    #[arg(long, env = "OUTBOX_CLAIMERS")]
    pub claimers: Option<u32>,
    /// Address for /metrics and /healthz ("off" disables it).
    #[arg(long, env = "OUTBOX_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// How long SIGTERM waits for in-flight deliveries before leaving them to their leases.
    #[arg(long, env = "OUTBOX_SHUTDOWN_TIMEOUT", value_parser = parse_duration)]
    pub shutdown_timeout: Option<Duration>,
    /// Testing only: use this outbox id instead of outbox.outbox_id().
    #[arg(long, env = "OUTBOX_ID_OVERRIDE", hide = true)]
    pub outbox_id: Option<uuid::Uuid>,

    /// NATS server URL(s), comma separated (nats://, tls://; user:pass@ allowed).
    #[arg(long, env = "OUTBOX_NATS_URL", value_delimiter = ',')]
    pub nats_url: Option<Vec<String>>,
    /// NATS subject prefix: events go to <prefix>.<topic>.
    #[arg(long, env = "OUTBOX_NATS_PREFIX")]
    pub nats_prefix: Option<String>,
    /// JetStream stream name (created when missing, validated otherwise).
    #[arg(long, env = "OUTBOX_NATS_STREAM")]
    pub nats_stream: Option<String>,
    /// Replicas of a stream the relay creates.
    #[arg(long, env = "OUTBOX_NATS_REPLICAS")]
    pub nats_replicas: Option<u32>,
    /// Duplicate window of a stream the relay creates.
    #[arg(long, env = "OUTBOX_NATS_DUPLICATE_WINDOW", value_parser = parse_duration)]
    pub nats_duplicate_window: Option<Duration>,
    /// Time to wait for one PubAck before publishing the same message again.
    #[arg(long, env = "OUTBOX_NATS_ACK_TIMEOUT", value_parser = parse_duration)]
    pub nats_ack_timeout: Option<Duration>,
    /// How long one event is retried against the broker before it is failed (outbox backoff).
    #[arg(long, env = "OUTBOX_NATS_RETRY_HORIZON", value_parser = parse_duration)]
    pub nats_retry_horizon: Option<Duration>,
    /// PEM file of CA certificates for NATS TLS.
    #[arg(long, env = "OUTBOX_NATS_CA_FILE")]
    pub nats_ca_file: Option<PathBuf>,
    /// Require TLS to NATS even for nats:// URLs.
    #[arg(long, env = "OUTBOX_NATS_TLS")]
    pub nats_tls: bool,

    /// Webhook URL of the single endpoint configured by flags (receives every relayed topic).
    #[arg(long, env = "OUTBOX_WEBHOOK_URL")]
    pub webhook_url: Option<String>,
    /// Signing secret(s), whsec_<base64>; comma separated or repeated (rotation: signs with each).
    #[arg(long, env = "OUTBOX_WEBHOOK_SECRET", value_delimiter = ',', hide_env_values = true)]
    pub webhook_secret: Option<Vec<String>>,
    /// Per-request timeout.
    #[arg(long, env = "OUTBOX_WEBHOOK_TIMEOUT", value_parser = parse_duration)]
    pub webhook_timeout: Option<Duration>,
    /// Requests in flight per endpoint.
    #[arg(long, env = "OUTBOX_WEBHOOK_CONCURRENCY")]
    pub webhook_concurrency: Option<u32>,
}

/// Parses `30s`, `500ms`, `2m`, `1h 30m` or plain seconds.
pub fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let s = s.trim();
    let d = match s.parse::<f64>() {
        Ok(secs) if (0.0..=MAX_DURATION.as_secs_f64()).contains(&secs) => Duration::from_secs_f64(secs),
        Ok(_) => return Err(format!("bad duration '{s}': must be between 0 and {} s", MAX_DURATION.as_secs())),
        Err(_) => humantime::parse_duration(s).map_err(|e| format!("bad duration '{s}': {e}"))?,
    };
    if d > MAX_DURATION {
        return Err(format!("bad duration '{s}': must be at most {} s (a year)", MAX_DURATION.as_secs()));
    }
    Ok(d)
}

/// The longest duration any setting accepts (a year): sums of settings and
/// deadlines computed from them cannot overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);

fn de_duration<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<Duration>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Text(String),
        Secs(f64),
    }
    match Option::<Raw>::deserialize(d)? {
        None => Ok(None),
        Some(Raw::Text(t)) => parse_duration(&t).map(Some).map_err(serde::de::Error::custom),
        Some(Raw::Secs(s)) => parse_duration(&s.to_string()).map(Some).map_err(serde::de::Error::custom),
    }
}

/// The `--config` file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    sink: Option<SinkKind>,
    dsn: Option<String>,
    subscription: Option<String>,
    subscription_start: Option<String>,
    topics: Option<Vec<String>>,
    worker: Option<String>,
    batch_size: Option<u32>,
    #[serde(default, deserialize_with = "de_duration")]
    lease: Option<Duration>,
    #[serde(default, deserialize_with = "de_duration")]
    poll_interval: Option<Duration>,
    max_in_flight: Option<u32>,
    claimers: Option<u32>,
    metrics_listen: Option<String>,
    #[serde(default, deserialize_with = "de_duration")]
    shutdown_timeout: Option<Duration>,
    nats: Option<FileNats>,
    webhook: Option<FileWebhook>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileNats {
    url: Option<Vec<String>>,
    prefix: Option<String>,
    stream: Option<String>,
    replicas: Option<u32>,
    #[serde(default, deserialize_with = "de_duration")]
    duplicate_window: Option<Duration>,
    #[serde(default, deserialize_with = "de_duration")]
    ack_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "de_duration")]
    retry_horizon: Option<Duration>,
    ca_file: Option<PathBuf>,
    tls: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileWebhook {
    url: Option<String>,
    secrets: Option<Vec<String>>,
    #[serde(default, deserialize_with = "de_duration")]
    timeout: Option<Duration>,
    concurrency: Option<u32>,
    #[serde(default)]
    endpoints: Vec<FileEndpoint>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEndpoint {
    name: String,
    url: String,
    topics: Option<Vec<String>>,
    secrets: Option<Vec<String>>,
    #[serde(default, deserialize_with = "de_duration")]
    timeout: Option<Duration>,
    concurrency: Option<u32>,
    subscription: Option<String>,
}

/// NATS sink settings.
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// Server URLs.
    pub urls: Vec<String>,
    /// Subject prefix.
    pub prefix: String,
    /// Stream name.
    pub stream: String,
    /// Replicas for a stream the relay creates.
    pub replicas: usize,
    /// Duplicate window for a stream the relay creates.
    pub duplicate_window: Duration,
    /// PubAck timeout per publish.
    pub ack_timeout: Duration,
    /// Retry horizon per event.
    pub retry_horizon: Duration,
    /// CA file for TLS.
    pub ca_file: Option<PathBuf>,
    /// Require TLS.
    pub tls: bool,
}

/// One webhook endpoint.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// Name (metrics, logs, default subscription suffix).
    pub name: String,
    /// Target URL.
    pub url: reqwest::Url,
    /// Topic patterns routed to it (None: every topic).
    pub topics: Option<Vec<String>>,
    /// Decoded signing keys.
    pub secrets: Vec<Vec<u8>>,
    /// Request timeout.
    pub timeout: Duration,
    /// Requests in flight.
    pub concurrency: usize,
    /// The subscription it claims from.
    pub subscription: String,
}

/// The resolved, validated relay configuration.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The sink.
    pub sink: SinkKind,
    /// PostgreSQL DSN.
    pub dsn: String,
    /// Subscription (NATS sink; webhook endpoints have their own).
    pub subscription: String,
    /// `start` for subscriptions the relay creates.
    pub subscription_start: String,
    /// `subscription_start` was set (flag, environment or file), not defaulted.
    pub subscription_start_explicit: bool,
    /// Topic filter (NATS sink).
    pub topics: Option<Vec<String>>,
    /// Worker name.
    pub worker: String,
    /// Claim batch size.
    pub batch_size: u32,
    /// Lease per claim.
    pub lease: Duration,
    /// Poll interval.
    pub poll_interval: Duration,
    /// Events in flight (NATS sink).
    pub max_in_flight: usize,
    /// Claim loops per subscription.
    pub claimers: usize,
    /// Metrics address, None when off.
    pub metrics_listen: Option<SocketAddr>,
    /// Shutdown grace period.
    pub shutdown_timeout: Duration,
    /// Outbox id override (testing).
    pub outbox_id: Option<uuid::Uuid>,
    /// NATS settings (sink = nats).
    pub nats: Option<NatsConfig>,
    /// Webhook endpoints (sink = webhook).
    pub endpoints: Vec<EndpointConfig>,
}

/// Subscription names: 1–63 characters of `[a-z0-9_.-]`, starting with a letter or digit.
pub fn valid_subscription_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.-".contains(&b))
        && s.as_bytes()[0].is_ascii_alphanumeric()
}

/// Claim patterns: `*`, `a.b`, `a.b.*` with segments of `[a-z0-9_-]`.
fn valid_topic_pattern(p: &str) -> bool {
    if p == "*" {
        return true;
    }
    let body = p.strip_suffix(".*").unwrap_or(p);
    !body.is_empty()
        && body.len() <= 255
        && body.split('.').all(|seg| {
            !seg.is_empty()
                && seg.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        })
}

/// Decodes a `whsec_<base64>` secret into its key bytes.
pub fn decode_secret(s: &str) -> Result<Vec<u8>> {
    let Some(b64) = s.trim().strip_prefix("whsec_") else {
        bail!("webhook secret must start with whsec_");
    };
    let key =
        base64::engine::general_purpose::STANDARD.decode(b64).context("webhook secret: bad base64 after whsec_")?;
    if key.is_empty() {
        bail!("webhook secret is empty");
    }
    Ok(key)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Parses the config file; an error is one line starting with `<line>:<column>: `.
fn parse_file(text: &str) -> std::result::Result<FileConfig, String> {
    toml::from_str(text).map_err(|e| {
        let message = e.message().replace(['\n', '\r'], " ");
        match e.span() {
            Some(span) => {
                let (line, column) = line_column(text, span.start);
                format!("{line}:{column}: {}", message.trim())
            }
            None => format!(" {}", message.trim()),
        }
    })
}

/// 1-based line and column (in characters) of byte offset `at`.
fn line_column(text: &str, at: usize) -> (usize, usize) {
    let before = &text[..text.floor_char_boundary(at.min(text.len()))];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    (line, column)
}

/// Adds to `dsn` what libpq would take from elsewhere when the DSN leaves it out (see the module
/// doc): the same rules as the operator commands, so one DSN reaches the same server from both.
/// `env` reads an environment variable (None when unset or empty); `is_dir` tests a directory.
pub fn with_libpq_defaults(
    dsn: &str,
    env: &dyn Fn(&str) -> Option<String>,
    is_dir: &dyn Fn(&str) -> bool,
) -> Result<String> {
    const SOCKET_DIR: &str = "/var/run/postgresql";
    let (cfg, _tls) = crate::db::parse_dsn(dsn, "outbox-relay")?;
    let mut add: Vec<(&str, String)> = Vec::new();
    if cfg.get_hosts().is_empty() && cfg.get_hostaddrs().is_empty() {
        let host = env("PGHOST").unwrap_or_else(|| {
            if is_dir(SOCKET_DIR) {
                SOCKET_DIR.to_string()
            } else {
                "localhost".to_string()
            }
        });
        add.push(("host", host));
    }
    if cfg.get_ports().is_empty() {
        if let Some(p) = env("PGPORT") {
            p.parse::<u16>().map_err(|_| anyhow::anyhow!("bad PGPORT '{p}'"))?;
            add.push(("port", p));
        }
    }
    if cfg.get_dbname().is_none() {
        if let Some(d) = env("PGDATABASE") {
            add.push(("dbname", d));
        }
    }
    if cfg.get_password().is_none() {
        if let Some(p) = env("PGPASSWORD") {
            add.push(("password", p));
        }
    }
    if add.is_empty() {
        return Ok(dsn.to_string());
    }
    let trimmed = dsn.trim();
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        let encode = |v: &str| -> String {
            v.bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect()
        };
        let params: Vec<String> = add.iter().map(|(k, v)| format!("{k}={}", encode(v))).collect();
        let sep = if trimmed.contains('?') { '&' } else { '?' };
        Ok(format!("{trimmed}{sep}{}", params.join("&")))
    } else {
        let params: Vec<String> =
            add.iter().map(|(k, v)| format!("{k}='{}'", v.replace('\\', "\\\\").replace('\'', "\\'"))).collect();
        Ok(format!("{trimmed} {}", params.join(" ")))
    }
}

impl RelayArgs {
    /// Settings of the sink not chosen are an error: they would be ignored.
    fn reject_other_sink(&self, sink: SinkKind, file: &FileConfig) -> Result<()> {
        let mut given: Vec<&str> = Vec::new();
        match sink {
            SinkKind::Nats => {
                let flags = [
                    (self.webhook_url.is_some(), "--webhook-url"),
                    (self.webhook_secret.is_some(), "--webhook-secret"),
                    (self.webhook_timeout.is_some(), "--webhook-timeout"),
                    (self.webhook_concurrency.is_some(), "--webhook-concurrency"),
                    (file.webhook.is_some(), "[webhook] in the config file"),
                ];
                given.extend(flags.iter().filter(|f| f.0).map(|f| f.1));
            }
            SinkKind::Webhook => {
                let flags = [
                    (self.nats_url.is_some(), "--nats-url"),
                    (self.nats_prefix.is_some(), "--nats-prefix"),
                    (self.nats_stream.is_some(), "--nats-stream"),
                    (self.nats_replicas.is_some(), "--nats-replicas"),
                    (self.nats_duplicate_window.is_some(), "--nats-duplicate-window"),
                    (self.nats_ack_timeout.is_some(), "--nats-ack-timeout"),
                    (self.nats_retry_horizon.is_some(), "--nats-retry-horizon"),
                    (self.nats_ca_file.is_some(), "--nats-ca-file"),
                    (self.nats_tls, "--nats-tls"),
                    (file.nats.is_some(), "[nats] in the config file"),
                    (
                        self.max_in_flight.is_some() || file.max_in_flight.is_some(),
                        "--max-in-flight (webhooks: --webhook-concurrency)",
                    ),
                ];
                given.extend(flags.iter().filter(|f| f.0).map(|f| f.1));
                let has_url = self.webhook_url.is_some() || file.webhook.as_ref().is_some_and(|w| w.url.is_some());
                if !has_url && (self.topics.is_some() || file.topics.is_some()) {
                    given.push("--topics without --webhook-url (each [[webhook.endpoints]] has its own topics)");
                }
            }
        }
        if !given.is_empty() {
            bail!(
                "{} {} not apply to --sink {}: remove {}",
                given.join(", "),
                if given.len() == 1 { "does" } else { "do" },
                sink.name(),
                if given.len() == 1 { "it" } else { "them" }
            );
        }
        Ok(())
    }

    /// Merges flags/env with the config file and defaults, and validates the result.
    pub fn resolve(self) -> Result<RelayConfig> {
        let file: FileConfig = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
                parse_file(&text).map_err(|e| anyhow::anyhow!("{}:{e}", path.display()))?
            }
            None => FileConfig::default(),
        };
        let Some(sink) = self.sink.or(file.sink) else {
            bail!("no sink: pass --sink nats|webhook (or OUTBOX_SINK, or sink = \"...\" in the config file)");
        };
        self.reject_other_sink(sink, &file)?;
        let dsn = self.dsn.or(file.dsn).unwrap_or_default();
        if dsn.trim().is_empty() {
            bail!("no PostgreSQL DSN: pass --dsn, set OUTBOX_DSN, or set dsn in the --config file");
        }
        let dsn = with_libpq_defaults(&dsn, &|k| std::env::var(k).ok().filter(|v| !v.is_empty()), &|d| {
            std::path::Path::new(d).is_dir()
        })?;
        let subscription = self.subscription.or(file.subscription).unwrap_or_else(|| format!("relay-{}", sink.name()));
        if !valid_subscription_name(&subscription) {
            bail!("bad subscription name '{subscription}': 1-63 characters of [a-z0-9_.-], starting with a letter or digit");
        }
        let subscription_start_explicit = self.subscription_start.is_some() || file.subscription_start.is_some();
        let subscription_start = self.subscription_start.or(file.subscription_start).unwrap_or_else(|| "now".into());
        if subscription_start != "now" && subscription_start != "earliest" {
            bail!("bad subscription start '{subscription_start}': now or earliest");
        }
        let topics = self.topics.or(file.topics).filter(|t| !t.is_empty());
        if let Some(ts) = &topics {
            for t in ts {
                if !valid_topic_pattern(t) {
                    bail!("bad topic pattern '{t}': exact topic, prefix ending in .*, or *");
                }
            }
        }
        let worker = self
            .worker
            .or(file.worker)
            .unwrap_or_else(|| format!("outbox-relay@{}:{}", hostname(), std::process::id()));
        let batch_size = self.batch_size.or(file.batch_size).unwrap_or(100);
        if !(1..=10_000).contains(&batch_size) {
            bail!("--batch-size must be 1..10000");
        }
        let lease = self.lease.or(file.lease).unwrap_or(Duration::from_secs(30));
        if lease < Duration::from_secs(1) {
            bail!("--lease must be at least 1s");
        }
        let poll_interval = self.poll_interval.or(file.poll_interval).unwrap_or(Duration::from_millis(500));
        if poll_interval < Duration::from_millis(10) {
            bail!("--poll-interval must be at least 10ms");
        }
        let max_in_flight = self.max_in_flight.or(file.max_in_flight).unwrap_or(2000) as usize;
        if max_in_flight == 0 {
            bail!("--max-in-flight must be positive");
        }
        let claimers = self.claimers.or(file.claimers).unwrap_or(2) as usize;
        if !(1..=16).contains(&claimers) {
            bail!("--claimers must be 1..16");
        }
        let listen = self.metrics_listen.or(file.metrics_listen).unwrap_or_else(|| "127.0.0.1:9187".into());
        let metrics_listen = if listen == "off" || listen.is_empty() {
            None
        } else {
            Some(
                listen
                    .parse::<SocketAddr>()
                    .with_context(|| format!("bad --metrics-listen '{listen}' (host:port or off)"))?,
            )
        };
        let shutdown_timeout = self.shutdown_timeout.or(file.shutdown_timeout).unwrap_or(Duration::from_secs(30));

        let mut nats = None;
        let mut endpoints = Vec::new();
        match sink {
            SinkKind::Nats => {
                let fnats = file.nats.unwrap_or_default();
                let urls = self.nats_url.or(fnats.url).unwrap_or_else(|| vec!["nats://127.0.0.1:4222".into()]);
                let urls: Vec<String> =
                    urls.into_iter().map(|u| u.trim().to_string()).filter(|u| !u.is_empty()).collect();
                if urls.is_empty() {
                    bail!("--nats-url is empty");
                }
                for u in &urls {
                    u.parse::<async_nats::ServerAddr>().map_err(|e| anyhow::anyhow!("bad NATS URL '{u}': {e}"))?;
                }
                let prefix = self.nats_prefix.or(fnats.prefix).unwrap_or_else(|| "outbox".into());
                if prefix.is_empty()
                    || prefix.split('.').any(|t| t.is_empty() || t == "*" || t == ">")
                    || prefix.chars().any(|c| c.is_whitespace())
                {
                    bail!("bad --nats-prefix '{prefix}': dot-separated tokens without wildcards or spaces");
                }
                let stream = self.nats_stream.or(fnats.stream).unwrap_or_else(|| "OUTBOX".into());
                if stream.is_empty() || stream.chars().any(|c| c.is_whitespace() || ".*>/\\".contains(c)) {
                    bail!("bad --nats-stream '{stream}'");
                }
                let replicas = self.nats_replicas.or(fnats.replicas).unwrap_or(1) as usize;
                if !(1..=5).contains(&replicas) {
                    bail!("--nats-replicas must be 1..5");
                }
                let duplicate_window =
                    self.nats_duplicate_window.or(fnats.duplicate_window).unwrap_or(Duration::from_secs(120));
                let ack_timeout = self.nats_ack_timeout.or(fnats.ack_timeout).unwrap_or(Duration::from_secs(5));
                if ack_timeout < Duration::from_millis(100) {
                    bail!("--nats-ack-timeout must be at least 100ms");
                }
                let retry_horizon = self.nats_retry_horizon.or(fnats.retry_horizon).unwrap_or(Duration::from_secs(60));
                if retry_horizon + lease >= duplicate_window {
                    bail!(
                        "--nats-retry-horizon ({}) + --lease ({}) must be shorter than the duplicate window ({}): \
                         a retried message would no longer be deduplicated",
                        humantime::format_duration(retry_horizon),
                        humantime::format_duration(lease),
                        humantime::format_duration(duplicate_window)
                    );
                }
                nats = Some(NatsConfig {
                    urls,
                    prefix,
                    stream,
                    replicas,
                    duplicate_window,
                    ack_timeout,
                    retry_horizon,
                    ca_file: self.nats_ca_file.or(fnats.ca_file),
                    tls: self.nats_tls || fnats.tls.unwrap_or(false),
                });
            }
            SinkKind::Webhook => {
                let fw = file.webhook.unwrap_or_default();
                let default_secrets = self.webhook_secret.or(fw.secrets).unwrap_or_default();
                let default_timeout = self.webhook_timeout.or(fw.timeout).unwrap_or(Duration::from_secs(10));
                let default_concurrency = self.webhook_concurrency.or(fw.concurrency).unwrap_or(16);
                let mut raw: Vec<FileEndpoint> = fw.endpoints;
                if let Some(url) = self.webhook_url.or(fw.url) {
                    raw.insert(
                        0,
                        FileEndpoint {
                            name: "default".into(),
                            url,
                            topics: topics.clone(),
                            secrets: None,
                            timeout: None,
                            concurrency: None,
                            subscription: Some(subscription.clone()),
                        },
                    );
                }
                if raw.is_empty() {
                    bail!("no webhook endpoint: pass --webhook-url or add [[webhook.endpoints]] to the config file");
                }
                let mut names = BTreeSet::new();
                let mut subs = BTreeSet::new();
                for e in raw {
                    if !valid_subscription_name(&e.name) {
                        bail!("bad endpoint name '{}': [a-z0-9_.-], starting with a letter or digit", e.name);
                    }
                    if !names.insert(e.name.clone()) {
                        bail!("endpoint '{}' is configured twice", e.name);
                    }
                    let url = reqwest::Url::parse(&e.url).with_context(|| format!("endpoint '{}': bad URL", e.name))?;
                    if url.scheme() != "http" && url.scheme() != "https" {
                        bail!("endpoint '{}': URL must be http:// or https://", e.name);
                    }
                    let secrets_raw = e.secrets.unwrap_or_else(|| default_secrets.clone());
                    if secrets_raw.is_empty() {
                        bail!("endpoint '{}': no signing secret (--webhook-secret whsec_...)", e.name);
                    }
                    let secrets = secrets_raw
                        .iter()
                        .map(|s| decode_secret(s))
                        .collect::<Result<Vec<_>>>()
                        .with_context(|| format!("endpoint '{}'", e.name))?;
                    let topics = e.topics.filter(|t| !t.is_empty() && !t.iter().any(|p| p == "*"));
                    for t in topics.iter().flatten() {
                        if !valid_topic_pattern(t) {
                            bail!("endpoint '{}': bad topic pattern '{t}'", e.name);
                        }
                    }
                    let sub = e.subscription.unwrap_or_else(|| format!("{subscription}.{}", e.name));
                    if !valid_subscription_name(&sub) {
                        bail!("endpoint '{}': bad subscription name '{sub}'", e.name);
                    }
                    if !subs.insert(sub.clone()) {
                        bail!("subscription '{sub}' is used by two endpoints");
                    }
                    let timeout = e.timeout.unwrap_or(default_timeout);
                    if timeout < Duration::from_millis(10) {
                        bail!("endpoint '{}': timeout must be at least 10ms", e.name);
                    }
                    let concurrency = e.concurrency.unwrap_or(default_concurrency) as usize;
                    if !(1..=10_000).contains(&concurrency) {
                        bail!("endpoint '{}': concurrency must be 1..10000", e.name);
                    }
                    endpoints.push(EndpointConfig {
                        name: e.name,
                        url,
                        topics,
                        secrets,
                        timeout,
                        concurrency,
                        subscription: sub,
                    });
                }
            }
        }
        Ok(RelayConfig {
            sink,
            dsn,
            subscription,
            subscription_start,
            subscription_start_explicit,
            topics,
            worker,
            batch_size,
            lease,
            poll_interval,
            max_in_flight,
            claimers,
            metrics_listen,
            shutdown_timeout,
            outbox_id: self.outbox_id,
            nats,
            endpoints,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_patterns() {
        assert!(valid_subscription_name("relay-nats"));
        assert!(!valid_subscription_name("-x"));
        assert!(!valid_subscription_name("Relay"));
        assert!(valid_topic_pattern("orders.*"));
        assert!(valid_topic_pattern("billing.invoice.paid"));
        assert!(!valid_topic_pattern("orders.*.x"));
        assert!(!valid_topic_pattern(""));
    }

    #[test]
    fn secrets_decode() {
        assert_eq!(decode_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap().len(), 24);
        assert!(decode_secret("MfKQ").is_err());
        assert!(decode_secret("whsec_!!").is_err());
    }

    fn parse(args: &[&str]) -> Result<RelayConfig> {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            relay: RelayArgs,
        }
        let mut argv = vec!["relay"];
        argv.extend_from_slice(args);
        let mut relay = Cli::try_parse_from(argv).map_err(|e| anyhow::anyhow!("{e}"))?.relay;
        relay.dsn = Some("host=h".into());
        relay.resolve()
    }

    fn file(text: &str) -> PathBuf {
        let path =
            std::env::temp_dir().join(format!("outbox-relay-test-{}-{}.toml", std::process::id(), fastrand::u64(..)));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn settings_of_the_other_sink_are_refused() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let e = parse(&["--sink", "nats", "--webhook-url", "http://h/x"]).unwrap_err().to_string();
        assert_eq!(e, "--webhook-url does not apply to --sink nats: remove it");
        let e = parse(&[
            "--sink",
            "webhook",
            "--webhook-url",
            "http://h/x",
            "--webhook-secret",
            secret,
            "--nats-stream",
            "S",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("--nats-stream does not apply to --sink webhook"), "{e}");
        let e = parse(&[
            "--sink",
            "webhook",
            "--webhook-url",
            "http://h/x",
            "--webhook-secret",
            secret,
            "--max-in-flight",
            "5",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("--max-in-flight"), "{e}");
        let f = file(
            "sink = \"webhook\"\n[nats]\nstream = \"S\"\n[[webhook.endpoints]]\nname = \"a\"\nurl = \"http://h/\"\n",
        );
        let e = parse(&["--config", f.to_str().unwrap(), "--webhook-secret", secret]).unwrap_err().to_string();
        assert!(e.starts_with("[nats] in the config file does not apply to --sink webhook"), "{e}");
        let f2 = file("[webhook]\ntimeout = \"1s\"\n");
        let e = parse(&["--sink", "nats", "--config", f2.to_str().unwrap()]).unwrap_err().to_string();
        assert!(e.starts_with("[webhook] in the config file does not apply to --sink nats"), "{e}");
        let _ = std::fs::remove_file(f);
        let _ = std::fs::remove_file(f2);
        assert!(parse(&["--sink", "nats", "--nats-stream", "S"]).is_ok());
        assert!(parse(&["--sink", "webhook", "--webhook-url", "http://h/x", "--webhook-secret", secret]).is_ok());
    }

    /// The DSN's precedence: the flag (or OUTBOX_DSN, which clap folds into it) over the file's
    /// `dsn`; the file's alone when there is no flag; none at all is an error.
    #[test]
    fn dsn_flag_beats_the_config_file() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            relay: RelayArgs,
        }
        let f = file("sink = \"nats\"\ndsn = \"host=from-file\"\n");
        let resolve = |dsn: Option<&str>, config: Option<&PathBuf>| {
            let mut argv = vec!["relay".to_string()];
            if let Some(p) = config {
                argv.extend(["--config".to_string(), p.display().to_string()]);
            } else {
                argv.extend(["--sink".to_string(), "nats".to_string()]);
            }
            let mut relay = Cli::try_parse_from(argv).unwrap().relay;
            relay.dsn = dsn.map(str::to_string);
            relay.resolve()
        };
        let host = |c: &RelayConfig| crate::db::parse_dsn(&c.dsn, "t").unwrap().0.get_hosts().to_vec();
        use tokio_postgres::config::Host;
        let c = resolve(Some("host=from-flag"), Some(&f)).unwrap();
        assert_eq!(host(&c), vec![Host::Tcp("from-flag".into())]);
        let c = resolve(None, Some(&f)).unwrap();
        assert_eq!(host(&c), vec![Host::Tcp("from-file".into())]);
        let e = resolve(None, None).unwrap_err().to_string();
        assert!(e.starts_with("no PostgreSQL DSN"), "{e}");
        let _ = std::fs::remove_file(f);
    }

    #[test]
    fn config_file_errors_say_where() {
        let f = file("sink = \"nats\"\nlease = \"5s\"\nbatch_size = \"many\"\n");
        let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err().to_string();
        assert!(e.contains(".toml:3:14: "), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let _ = std::fs::remove_file(f);
        let f = file("sink = \"nats\"\n\n  nope = 1\n");
        let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err().to_string();
        assert!(e.contains(".toml:3:3: unknown field `nope`"), "{e}");
        let _ = std::fs::remove_file(f);
        assert_eq!(line_column("ab\ncdé\nx", 7), (2, 4));
    }

    #[test]
    fn dsn_without_host_gets_the_libpq_defaults() {
        let none = |_: &str| None;
        let socket = |d: &str| d == "/var/run/postgresql";
        let no_socket = |_: &str| false;
        let host = |dsn: &str| {
            let (c, _) = crate::db::parse_dsn(dsn, "t").unwrap();
            (c.get_hosts().to_vec(), c.get_ports().to_vec())
        };
        use tokio_postgres::config::Host;
        let d = with_libpq_defaults("dbname=app port=5433", &none, &socket).unwrap();
        assert_eq!(host(&d), (vec![Host::Unix("/var/run/postgresql".into())], vec![5433]));
        let d = with_libpq_defaults("dbname=app", &none, &no_socket).unwrap();
        assert_eq!(host(&d).0, vec![Host::Tcp("localhost".into())]);
        let env = |k: &str| match k {
            "PGHOST" => Some("/tmp/sock dir".to_string()),
            "PGPORT" => Some("5472".to_string()),
            _ => None,
        };
        let d = with_libpq_defaults("user=x", &env, &socket).unwrap();
        assert_eq!(host(&d), (vec![Host::Unix("/tmp/sock dir".into())], vec![5472]));
        let d = with_libpq_defaults("postgresql:///app?user=x", &env, &socket).unwrap();
        assert_eq!(host(&d), (vec![Host::Unix("/tmp/sock dir".into())], vec![5472]));
        assert_eq!(with_libpq_defaults("host=db port=1", &env, &socket).unwrap(), "host=db port=1");
        let bad = |k: &str| (k == "PGPORT").then(|| "x".to_string());
        assert!(with_libpq_defaults("host=db", &bad, &socket).is_err());
    }

    #[test]
    fn the_relay_page_lists_every_environment_variable() {
        use clap::CommandFactory as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            relay: RelayArgs,
        }
        let page = include_str!("../../../../docs/src/tools/relay.md");
        let start = page.find("## Configuration").expect("relay configuration section");
        let section = &page[start..start + page[start..].find("## NATS JetStream").expect("next section")];
        let mut missing = Vec::new();
        for arg in Cli::command().get_arguments() {
            if arg.is_hide_set() {
                continue;
            }
            if let Some(env) = arg.get_env() {
                let env = env.to_string_lossy();
                if !section.contains(&format!("`{env}`")) {
                    missing.push(env.to_string());
                }
            }
        }
        for env in ["OUTBOX_DSN", "OUTBOX_LOG", "OUTBOX_LOG_FORMAT", "PGHOST", "PGPORT"] {
            if !section.contains(&format!("`{env}`")) {
                missing.push(env.to_string());
            }
        }
        assert!(missing.is_empty(), "docs/src/tools/relay.md's configuration table lacks {missing:?}");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("soon").is_err());
    }
}
