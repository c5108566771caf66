//! `outbox relay`: moves events from the outbox into a sink (NATS JetStream or webhooks).
//!
//! Structure: one *lane* per subscription (the NATS sink has one; every webhook endpoint has its
//! own). A lane runs a claim loop, one task per claimed event (delivery plus lease heartbeat), and
//! an acker task that acks in batches and fails one by one.
//!
//! Invariants (why no event is lost or doubled):
//! - **Ack after confirmation only.** An event is acked after the sink confirmed it (JetStream
//!   PubAck, HTTP 2xx) and never before. Whatever dies (relay, broker, database, network), an
//!   unconfirmed event keeps its lease until it expires and is then handed out again.
//! - **Fenced outcomes.** ack/fail/extend_lease carry the claim's lease token, so a relay that lost
//!   its lease (expired, taken by another instance) changes nothing; several instances can share a
//!   subscription and each event is owned by one lease at a time.
//! - **Same message id on every delivery** (`<outbox id>:<event id>`), so the sink (JetStream's
//!   duplicate window, or the webhook receiver) drops the copies at-least-once produces.
//! - **Per-subject order.** The outbox hands out a subject's next event only after the previous
//!   one is acked; in addition the lane never runs two deliveries of one subject at once and
//!   starts them in claim order.
//! - **Leases outlive slow deliveries.** Each event has a lease (and token) of its own. A heartbeat
//!   extends an event's lease every lease/3 while its delivery runs, and while it waits for an
//!   earlier delivery of its subject; when the heartbeat finds the lease gone, the delivery is
//!   abandoned.
//! - **No attempts burnt while the sink is down.** The claim loop asks the sink whether it is
//!   ready before each claim; the NATS sink says no while the broker is unreachable.
//! - **Graceful stop.** SIGTERM/SIGINT stop claiming; in-flight deliveries finish (or fail with
//!   `retry_in = 0` so another instance takes them at once), their outcomes are written, and the
//!   process exits 0. Anything still out after `--shutdown-timeout` is left to its lease.
//! - **Fail fast on what retrying cannot fix.** A permanent error (see [`classify`]: bad DSN, TLS
//!   refused, authentication, missing privilege such as `42501` from `claim`, a stream config the
//!   server refuses) begins the same graceful stop and the process exits 1 with that error as one
//!   line. Transient errors (connection refused, server restarting) are retried with backoff.
//! - **The relay does what its flags say.** A subscription that already exists with another
//!   topic filter than `--topics` (or an endpoint's `topics`) stops the relay at start: claiming
//!   under a filter the operator did not ask for would silently skip or add events.

pub mod classify;
pub mod config;
pub mod metrics;
pub mod nats;
pub mod webhook;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use tokio::sync::{mpsc, watch, Notify, Semaphore};
use uuid::Uuid;

use crate::db::{Db, Event};
use classify::Class;
use config::{RelayArgs, RelayConfig, SinkKind};
use metrics::Metrics;
use nats::NatsSink;
use webhook::WebhookEndpoint;

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The sink confirmed it: ack.
    Delivered,
    /// Retry later: `fail` with the outbox's backoff, or with `retry_in` when set.
    Retry {
        /// The error recorded with the failure.
        error: String,
        /// Delay before the next attempt (`Retry-After`, or 0 at shutdown).
        retry_in: Option<Duration>,
    },
    /// The sink kept failing until the retry horizon: `fail` with the outbox's backoff. Separate
    /// from `Retry` so the batch, not every event, logs it.
    RetryHorizon {
        /// The last error, recorded with the failure.
        error: String,
    },
    /// Never deliverable: `fail(..., permanent => true)`.
    Dead {
        /// The error recorded with the dead letter.
        error: String,
    },
}

/// A cloneable shutdown signal; [`Shutdown::fatal`] also records why the relay must exit 1.
#[derive(Clone)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
    ctl: Arc<StopControl>,
}

struct StopControl {
    tx: watch::Sender<bool>,
    fatal: Mutex<Option<String>>,
    metrics: Arc<Metrics>,
}

impl Shutdown {
    fn new(metrics: Arc<Metrics>) -> Self {
        let (tx, rx) = watch::channel(false);
        Self { rx, ctl: Arc::new(StopControl { tx, fatal: Mutex::new(None), metrics }) }
    }

    /// Begins the graceful stop.
    fn begin(&self) {
        self.ctl.metrics.health.stopping.store(true, Ordering::Relaxed);
        let _ = self.ctl.tx.send(true);
    }

    /// Begins the graceful stop for an error that retrying cannot fix; the process then exits 1
    /// with `error` (the first one, when several tasks hit it).
    pub fn fatal(&self, error: String) {
        {
            let mut f = self.ctl.fatal.lock().unwrap_or_else(|p| p.into_inner());
            if f.is_none() {
                tracing::error!("{error}; stopping");
                *f = Some(error);
            }
        }
        self.begin();
    }

    fn fatal_error(&self) -> Option<String> {
        self.ctl.fatal.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// True once shutdown has begun.
    pub fn is_set(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves when shutdown begins.
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        let _ = rx.wait_for(|v| *v).await;
    }

    /// Sleeps for `d`; returns true (early) when shutdown began.
    pub async fn sleep(&self, d: Duration) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(d) => self.is_set(),
            _ = self.wait() => true,
        }
    }
}

/// Where a lane delivers.
#[derive(Clone)]
enum Sink {
    Nats(Arc<NatsSink>),
    Webhook(Arc<WebhookEndpoint>),
}

impl Sink {
    async fn ready(&self, shutdown: &Shutdown) -> bool {
        match self {
            Sink::Nats(n) => n.ready(shutdown).await,
            Sink::Webhook(_) => !shutdown.is_set(),
        }
    }

    async fn deliver(&self, ev: &Event, shutdown: &Shutdown) -> Outcome {
        match self {
            Sink::Nats(n) => n.deliver(ev, shutdown).await,
            Sink::Webhook(w) => w.deliver(ev, shutdown).await,
        }
    }
}

/// One subscription drained into one sink.
struct Lane {
    sink: Sink,
    /// None when the extension predates subscriptions: claim from `default` with `topics`.
    subscription: Option<String>,
    topics: Option<Vec<String>>,
    labels: [String; 2],
    max_in_flight: usize,
    claim_db: Arc<Db>,
    ack_db: Arc<Db>,
    metrics: Arc<Metrics>,
    cfg: Arc<RelayConfig>,
    /// Signalled by the acker after each flush: subjects may have become claimable.
    acked: Notify,
    batch_seq: AtomicU64,
}

/// Per-batch counters; the batch's log line and latency sample are emitted when the last event's
/// outcome has been written (when the last reference drops).
struct BatchStats {
    lane: Arc<Lane>,
    seq: u64,
    claimed: usize,
    started: Instant,
    relayed: AtomicUsize,
    retried: AtomicUsize,
    dead: AtomicUsize,
    stale: AtomicUsize,
    /// Events that reached the NATS retry horizon, and the last error of one of them.
    horizon: AtomicUsize,
    horizon_error: Mutex<Option<String>>,
}

impl BatchStats {
    fn new(lane: &Arc<Lane>, claimed: usize) -> Self {
        Self {
            lane: lane.clone(),
            seq: lane.batch_seq.fetch_add(1, Ordering::Relaxed) + 1,
            claimed,
            started: Instant::now(),
            relayed: AtomicUsize::new(0),
            retried: AtomicUsize::new(0),
            dead: AtomicUsize::new(0),
            stale: AtomicUsize::new(0),
            horizon: AtomicUsize::new(0),
            horizon_error: Mutex::new(None),
        }
    }
}

impl Drop for BatchStats {
    fn drop(&mut self) {
        let horizon = self.horizon.load(Ordering::Relaxed);
        if horizon > 0 {
            let last = self.horizon_error.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or_default();
            let limit = self.lane.cfg.nats.as_ref().map(|n| n.retry_horizon).unwrap_or_default();
            tracing::warn!(
                sink = %self.lane.labels[0],
                subscription = %self.lane.labels[1],
                batch = self.seq,
                "{horizon} of {} events reached the retry horizon ({}) and were failed with the outbox's \
                 backoff; last error: {last}",
                self.claimed,
                humantime::format_duration(limit)
            );
        }
        let secs = self.started.elapsed().as_secs_f64();
        self.lane.metrics.batch_seconds.with_label_values(&self.lane.labels).observe(secs);
        tracing::info!(
            sink = %self.lane.labels[0],
            subscription = %self.lane.labels[1],
            batch = self.seq,
            events = self.claimed,
            relayed = self.relayed.load(Ordering::Relaxed),
            retry = self.retried.load(Ordering::Relaxed),
            dead = self.dead.load(Ordering::Relaxed),
            stale = self.stale.load(Ordering::Relaxed),
            ms = (secs * 1000.0).round() as u64,
            "batch done"
        );
    }
}

/// An outcome waiting to be written.
struct Finish {
    id: i64,
    token: Uuid,
    outcome: Outcome,
    batch: Arc<BatchStats>,
}

/// Runs the relay until SIGTERM/SIGINT. Returns an error (one line, non-zero exit) for bad
/// configuration and for conditions that retrying cannot fix.
pub async fn run(args: RelayArgs) -> Result<()> {
    let cfg = Arc::new(args.resolve()?);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let metrics = Metrics::new()?;
    let shutdown = install_signals(metrics.clone())?;
    let result = run_with(cfg, metrics, &shutdown).await;
    match shutdown.fatal_error() {
        Some(e) => Err(anyhow!(e)),
        None => result,
    }
}

async fn run_with(cfg: Arc<RelayConfig>, metrics: Arc<Metrics>, shutdown: &Shutdown) -> Result<()> {
    let shutdown = shutdown.clone();
    if let Some(addr) = cfg.metrics_listen {
        let bound = metrics::serve(addr, metrics.clone()).await?;
        tracing::info!("metrics on http://{bound}/metrics and /healthz");
    }
    let app_name = format!("outbox-relay-{}", cfg.sink.name());
    let setup_db = Arc::new(Db::new(&cfg.dsn, &app_name, false)?);
    if !wait_for_db(&setup_db, &metrics, &shutdown).await? {
        return Ok(());
    }
    let outbox_id = match cfg.outbox_id {
        Some(id) => {
            tracing::warn!("using --outbox-id {id} instead of outbox.outbox_id() (testing only)");
            id
        }
        None => setup_db.outbox_id().await?,
    };
    tracing::info!(%outbox_id, worker = %cfg.worker, sink = cfg.sink.name(), "outbox relay starting");

    let mut lanes = Vec::new();
    match cfg.sink {
        SinkKind::Nats => {
            let Some(ncfg) = cfg.nats.clone() else { bail!("internal: NATS sink without settings") };
            check_subscription(&setup_db, &cfg.subscription, cfg.topics.as_deref(), &cfg).await?;
            let has_subs =
                setup_db.ensure_subscription(&cfg.subscription, cfg.topics.as_deref(), &cfg.subscription_start).await?;
            let subscription = has_subs.then(|| cfg.subscription.clone());
            if !has_subs {
                tracing::warn!("this outbox has no subscriptions: claiming from default with the topic filter");
            }
            let sink =
                match NatsSink::connect(ncfg, outbox_id, cfg.lease, metrics.clone(), &cfg.subscription, &shutdown)
                    .await?
                {
                    Some(s) => Arc::new(s),
                    None => return Ok(()),
                };
            lanes.push(Arc::new(Lane {
                sink: Sink::Nats(sink),
                subscription,
                topics: cfg.topics.clone(),
                labels: ["nats".into(), cfg.subscription.clone()],
                max_in_flight: cfg.max_in_flight,
                claim_db: Arc::new(Db::new(&cfg.dsn, &app_name, true)?),
                ack_db: setup_db.clone(),
                metrics: metrics.clone(),
                cfg: cfg.clone(),
                acked: Notify::new(),
                batch_seq: AtomicU64::new(0),
            }));
        }
        SinkKind::Webhook => {
            for ep in &cfg.endpoints {
                check_subscription(&setup_db, &ep.subscription, ep.topics.as_deref(), &cfg).await?;
                let has_subs = setup_db
                    .ensure_subscription(&ep.subscription, ep.topics.as_deref(), &cfg.subscription_start)
                    .await?;
                if !has_subs {
                    bail!("webhook endpoints need subscriptions (outbox_ext 0.9.0 or later)");
                }
                let ack_db = Arc::new(Db::new(&cfg.dsn, &app_name, false)?);
                let labels = ["webhook".to_string(), ep.subscription.clone()];
                let health = metrics.health.register_sink(&format!("webhook endpoint '{}'", ep.name), true, "");
                let sink_up = metrics.sink_up.with_label_values(&labels);
                sink_up.set(1);
                let endpoint = Arc::new(WebhookEndpoint::new(ep.clone(), outbox_id, ack_db.clone(), health, sink_up)?);
                lanes.push(Arc::new(Lane {
                    sink: Sink::Webhook(endpoint),
                    subscription: Some(ep.subscription.clone()),
                    topics: ep.topics.clone(),
                    labels,
                    max_in_flight: ep.concurrency,
                    claim_db: Arc::new(Db::new(&cfg.dsn, &app_name, true)?),
                    ack_db,
                    metrics: metrics.clone(),
                    cfg: cfg.clone(),
                    acked: Notify::new(),
                    batch_seq: AtomicU64::new(0),
                }));
            }
        }
    }

    let mut tasks = Vec::new();
    for lane in lanes {
        tasks.push(tokio::spawn(watch_subscription(lane.clone(), shutdown.clone())));
        tasks.push(tokio::spawn(run_lane(lane, shutdown.clone())));
    }
    // A task that panicked skipped its graceful stop: the exit status says so.
    let mut failed = 0;
    for t in tasks {
        if t.await.is_err() {
            failed += 1;
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} relay task(s) stopped abnormally");
    }
    tracing::info!("outbox relay stopped");
    Ok(())
}

/// Normalised topic filter: None for every topic, else the sorted, distinct patterns.
fn topic_set(topics: Option<&[String]>) -> Option<Vec<String>> {
    let t = topics?;
    if t.is_empty() || t.iter().any(|p| p == "*") {
        return None;
    }
    let mut v = t.to_vec();
    v.sort();
    v.dedup();
    Some(v)
}

fn show_topics(t: &Option<Vec<String>>) -> String {
    match t {
        None => "every topic".to_string(),
        Some(v) => format!("[{}]", v.join(",")),
    }
}

/// Before the relay creates or uses `name`: when it exists already, its topic filter must be the
/// one asked for (`topics`, when given), and a `--subscription-start` that cannot apply any more
/// is said so. Extensions without subscriptions (before 0.9.0) have nothing to check.
async fn check_subscription(db: &Db, name: &str, topics: Option<&[String]>, cfg: &RelayConfig) -> Result<()> {
    let c = db.client().await?;
    let row = match c.query_opt("SELECT topics FROM outbox.subscriptions WHERE name = $1::text", &[&name]).await {
        Ok(row) => row,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => return Ok(()),
        Err(e) => bail!("reading subscription '{name}' from outbox.subscriptions: {}", crate::db::pg_error(&e)),
    };
    let Some(row) = row else { return Ok(()) };
    let existing: Option<Vec<String>> = row.get(0);
    let existing = topic_set(existing.as_deref());
    if topics.is_some() {
        let wanted = topic_set(topics);
        if wanted != existing {
            bail!(
                "subscription '{name}' already exists with topics {}, but the relay is configured for {}: \
                 configure those topics (or none, to use the subscription's), use another subscription name, \
                 or drop it first with SELECT outbox.drop_subscription('{name}') (topics cannot be altered)",
                show_topics(&existing),
                show_topics(&wanted)
            );
        }
    } else {
        tracing::info!(subscription = name, topics = %show_topics(&existing), "using the subscription's topic filter");
    }
    if cfg.subscription_start_explicit {
        tracing::warn!(
            subscription = name,
            "subscription exists already: --subscription-start {} applies only to a subscription the relay \
             creates (drop it first to start it again)",
            cfg.subscription_start
        );
    }
    Ok(())
}

/// Connects the first time, retrying while the server is unreachable or starting. An error that
/// retrying cannot fix ([`classify`]: authentication, unknown database, bad DSN, TLS refused) is
/// returned. Returns false when shutdown came first.
async fn wait_for_db(db: &Db, metrics: &Metrics, shutdown: &Shutdown) -> Result<bool> {
    let mut delay = Duration::from_millis(200);
    loop {
        match db.client().await {
            Ok(_) => {
                metrics.set_db_up(true);
                return Ok(true);
            }
            Err(e) => {
                if classify::db_error(&e) == Class::Permanent {
                    return Err(e);
                }
                metrics.set_db_up(false);
                tracing::warn!("{e:#}; retrying in {delay:?}");
                if shutdown.sleep(delay).await {
                    return Ok(false);
                }
                delay = (delay * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// SIGTERM/SIGINT begin a graceful stop; a second signal exits at once.
fn install_signals(metrics: Arc<Metrics>) -> Result<Shutdown> {
    use tokio::signal::unix::{signal, SignalKind};
    let shutdown = Shutdown::new(metrics);
    let stopper = shutdown.clone();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        let mut count = 0;
        loop {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            count += 1;
            if count > 1 {
                tracing::warn!("{name} again: exiting now (leases left to expire)");
                std::process::exit(1);
            }
            tracing::info!("{name}: stopping claims, finishing in-flight events");
            stopper.begin();
        }
    });
    Ok(shutdown)
}

/// Refreshes lag gauges and, for webhook endpoints, the disabled flag (the paused state of the
/// endpoint's subscription), every 5 s.
async fn watch_subscription(lane: Arc<Lane>, shutdown: Shutdown) {
    let Some(sub) = lane.subscription.clone() else { return };
    loop {
        match lane.ack_db.subscription_status(&sub).await {
            Ok(Some((lag_events, lag_secs, paused))) => {
                lane.metrics.lag_events.with_label_values(&lane.labels).set(lag_events);
                lane.metrics.lag_seconds.with_label_values(&lane.labels).set(lag_secs);
                if let Sink::Webhook(ep) = &lane.sink {
                    if paused && !ep.is_disabled() {
                        tracing::warn!(
                            "webhook endpoint '{}' is disabled: subscription '{sub}' is paused \
                             (SELECT outbox.resume_subscription('{sub}') to enable it)",
                            ep.cfg.name
                        );
                    }
                    ep.set_disabled(paused);
                    lane.metrics.endpoint_disabled.with_label_values(&lane.labels).set(i64::from(paused));
                }
            }
            Ok(None) => tracing::warn!("subscription '{sub}' does not exist (dropped?)"),
            Err(e) => tracing::debug!("subscription status: {e:#}"),
        }
        if shutdown.sleep(Duration::from_secs(5)).await {
            return;
        }
    }
}

/// Runs one lane: `--claimers` claim loops sharing the in-flight budget, then a graceful drain.
async fn run_lane(lane: Arc<Lane>, shutdown: Shutdown) {
    let cfg = lane.cfg.clone();
    let sem = Arc::new(Semaphore::new(lane.max_in_flight));
    let (tx, rx) = mpsc::unbounded_channel::<Finish>();
    let acker = tokio::spawn(run_acker(lane.clone(), rx, shutdown.clone()));
    let subjects: SubjectLocks = Arc::default();
    let mut loops = Vec::new();
    for i in 0..cfg.claimers {
        // Each claim loop has its own connection: one backend runs one claim at a time.
        let db = if i == 0 {
            lane.claim_db.clone()
        } else {
            match Db::new(&cfg.dsn, &format!("outbox-relay-{}", cfg.sink.name()), true) {
                Ok(db) => Arc::new(db),
                Err(e) => {
                    tracing::error!("{e:#}");
                    continue;
                }
            }
        };
        loops.push(claim_loop(lane.clone(), db, sem.clone(), subjects.clone(), tx.clone(), shutdown.clone()));
    }
    futures::future::join_all(loops).await;
    // Graceful drain: wait for every in-flight delivery, then for the acker to write outcomes.
    let deadline = Instant::now() + cfg.shutdown_timeout;
    let all = lane.max_in_flight as u32;
    if tokio::time::timeout_at(deadline.into(), sem.acquire_many(all)).await.is_err() {
        tracing::warn!(
            subscription = %lane.labels[1],
            "shutdown timeout: {} deliveries still running are left to their leases",
            lane.max_in_flight - sem.available_permits()
        );
    }
    drop(tx);
    if tokio::time::timeout_at(deadline.into(), acker).await.is_err() {
        tracing::warn!("shutdown timeout: some outcomes were not written; their leases will expire");
    }
}

/// Per-subject locks of the deliveries running in this process.
type SubjectLocks = Arc<std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>;

/// One claim loop of a lane; returns when shutdown begins.
async fn claim_loop(
    lane: Arc<Lane>,
    claim_db: Arc<Db>,
    sem: Arc<Semaphore>,
    subjects: SubjectLocks,
    tx: mpsc::UnboundedSender<Finish>,
    shutdown: Shutdown,
) {
    let cfg = lane.cfg.clone();
    let mut delay = Duration::from_millis(100);
    loop {
        if shutdown.is_set() || !lane.sink.ready(&shutdown).await {
            break;
        }
        if let Sink::Webhook(ep) = &lane.sink {
            if ep.is_disabled() {
                if let Some(sub) = &lane.subscription {
                    if let Ok(Some((_, _, paused))) = lane.ack_db.subscription_status(sub).await {
                        ep.set_disabled(paused);
                    }
                }
                if ep.is_disabled() {
                    if shutdown.sleep(cfg.poll_interval.max(Duration::from_secs(1))).await {
                        break;
                    }
                    continue;
                }
            }
        }
        let available = sem.available_permits();
        if available == 0 {
            tokio::select! {
                p = sem.clone().acquire_owned() => drop(p),
                _ = shutdown.wait() => break,
            }
            continue;
        }
        let want = available.min(cfg.batch_size as usize);
        let Ok(reserved) = sem.clone().try_acquire_many_owned(want as u32) else { continue };
        let claimed = claim_db
            .claim(&cfg.worker, want as i32, cfg.lease, lane.topics.as_deref(), lane.subscription.as_deref())
            .await;
        let events = match claimed {
            Ok(evs) => {
                lane.metrics.set_db_up(true);
                delay = Duration::from_millis(100);
                evs
            }
            Err(e) => {
                if classify::db_error(&e) == Class::Permanent {
                    shutdown.fatal(format!("subscription '{}': {e:#}", lane.labels[1]));
                    break;
                }
                lane.metrics.set_db_up(false);
                tracing::warn!("{e:#}; retrying in {delay:?}");
                if shutdown.sleep(delay).await {
                    break;
                }
                delay = (delay * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if events.is_empty() {
            tokio::select! {
                _ = claim_db.wakeup.notified() => {}
                _ = lane.acked.notified() => {}
                _ = tokio::time::sleep(cfg.poll_interval) => {}
                _ = shutdown.wait() => break,
            }
            continue;
        }
        let batch = Arc::new(BatchStats::new(&lane, events.len()));
        lane.metrics.in_flight.with_label_values(&lane.labels).add(events.len() as i64);
        let mut reserved = reserved;
        // Events of this claim whose lease a heartbeat lost while they waited.
        let mut lost: std::collections::HashSet<i64> = std::collections::HashSet::new();
        for (k, ev) in events.iter().enumerate() {
            // One permit of the reservation per event; the unused rest is released below.
            let Some(permit) = reserved.split(1) else { break };
            if lost.contains(&ev.id) {
                lane.metrics.in_flight.with_label_values(&lane.labels).dec();
                batch.stale.fetch_add(1, Ordering::Relaxed);
                lane.metrics.stale.with_label_values(&lane.labels).inc();
                continue;
            }
            let guard = match &ev.subject {
                Some(s) => {
                    let m = {
                        let mut map = subjects.lock().unwrap_or_else(|p| p.into_inner());
                        if map.len() > 8192 {
                            map.retain(|_, v| Arc::strong_count(v) > 1);
                        }
                        map.entry(s.clone()).or_default().clone()
                    };
                    match m.clone().try_lock_owned() {
                        Ok(g) => Some(g),
                        // A delivery of this subject still runs (its earlier event's lease
                        // expired and it was handed out again): wait, keeping the leases of
                        // this event and of the claim's events after it alive, each its own.
                        Err(_) => Some(wait_with_heartbeat(&lane, m.lock_owned(), &events[k..], &mut lost).await),
                    }
                }
                None => None,
            };
            if lost.contains(&ev.id) {
                drop(guard);
                lane.metrics.in_flight.with_label_values(&lane.labels).dec();
                batch.stale.fetch_add(1, Ordering::Relaxed);
                lane.metrics.stale.with_label_values(&lane.labels).inc();
                continue;
            }
            let ev = ev.clone();
            let lane2 = lane.clone();
            let tx = tx.clone();
            let batch = batch.clone();
            let shutdown2 = shutdown.clone();
            tokio::spawn(async move {
                let outcome = deliver_with_heartbeat(&lane2, &ev, &shutdown2).await;
                drop(guard);
                lane2.metrics.in_flight.with_label_values(&lane2.labels).dec();
                match outcome {
                    Some(outcome) => {
                        if let Outcome::RetryHorizon { error } = &outcome {
                            batch.horizon.fetch_add(1, Ordering::Relaxed);
                            *batch.horizon_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.clone());
                        }
                        let _ = tx.send(Finish { id: ev.id, token: ev.lease_token, outcome, batch });
                    }
                    None => {
                        batch.stale.fetch_add(1, Ordering::Relaxed);
                        lane2.metrics.stale.with_label_values(&lane2.labels).inc();
                    }
                }
                drop(permit);
            });
        }
        drop(reserved);
    }
}

/// Waits for `lock` while extending, every lease/3, the lease of each event of `waiting` (each
/// event's lease is its own); events whose lease is gone are added to `lost`.
async fn wait_with_heartbeat<T>(
    lane: &Lane,
    lock: impl std::future::Future<Output = T>,
    waiting: &[Event],
    lost: &mut std::collections::HashSet<i64>,
) -> T {
    let lease = lane.cfg.lease;
    let period = lease / 3;
    tokio::pin!(lock);
    loop {
        tokio::select! {
            got = &mut lock => return got,
            _ = tokio::time::sleep(period) => {
                let live: Vec<&Event> = waiting.iter().filter(|e| !lost.contains(&e.id)).collect();
                for ev in live {
                    match lane.ack_db.extend_lease(ev.id, ev.lease_token, lease).await {
                        Ok(true) => {}
                        Ok(false) => {
                            tracing::warn!(event = ev.id, "lease lost while waiting for its subject's delivery");
                            lost.insert(ev.id);
                        }
                        Err(e) => tracing::warn!(event = ev.id, "extend_lease: {e:#}"),
                    }
                }
            }
        }
    }
}

/// Runs one delivery while extending its lease every lease/3. None when the lease was lost
/// (another worker holds the event now; whatever we do would be stale).
async fn deliver_with_heartbeat(lane: &Lane, ev: &Event, shutdown: &Shutdown) -> Option<Outcome> {
    let lease = lane.cfg.lease;
    let period = lease / 3;
    let deliver = lane.sink.deliver(ev, shutdown);
    tokio::pin!(deliver);
    let mut next = tokio::time::Instant::now() + period;
    loop {
        tokio::select! {
            outcome = &mut deliver => return Some(outcome),
            _ = tokio::time::sleep_until(next) => {
                match lane.ack_db.extend_lease(ev.id, ev.lease_token, lease).await {
                    Ok(true) => next += period,
                    Ok(false) => {
                        tracing::warn!(event = ev.id, "lease lost during delivery; leaving the event to its new holder");
                        return None;
                    }
                    Err(e) => {
                        if classify::db_error(&e) == Class::Permanent {
                            shutdown.fatal(format!("{e:#}"));
                        }
                        tracing::warn!(event = ev.id, "extend_lease: {e:#}");
                        next = tokio::time::Instant::now() + Duration::from_millis(500);
                    }
                }
            }
        }
    }
}

/// Writes outcomes: acks in batches (one round trip for many events), fails one by one. Retries
/// database errors with backoff for up to one lease; after that the leases have expired and the
/// events will be handed out again (and deduplicated by their message id).
async fn run_acker(lane: Arc<Lane>, mut rx: mpsc::UnboundedReceiver<Finish>, shutdown: Shutdown) {
    let lease = lane.cfg.lease;
    while let Some(first) = rx.recv().await {
        let mut items = vec![first];
        while items.len() < 1000 {
            match rx.try_recv() {
                Ok(i) => items.push(i),
                Err(_) => break,
            }
        }
        let (acks, fails): (Vec<Finish>, Vec<Finish>) =
            items.into_iter().partition(|f| f.outcome == Outcome::Delivered);
        if !acks.is_empty() {
            let ids: Vec<i64> = acks.iter().map(|f| f.id).collect();
            let tokens: Vec<Uuid> = acks.iter().map(|f| f.token).collect();
            let started = Instant::now();
            let mut delay = Duration::from_millis(50);
            loop {
                match lane.ack_db.ack_many(&ids, &tokens).await {
                    Ok(n) => {
                        lane.metrics.set_db_up(true);
                        let n = usize::try_from(n).unwrap_or(0).min(acks.len());
                        lane.metrics.relayed.with_label_values(&lane.labels).inc_by(n as u64);
                        if n < acks.len() {
                            let stale = acks.len() - n;
                            lane.metrics.stale.with_label_values(&lane.labels).inc_by(stale as u64);
                            tracing::warn!("{stale} of {} acks were stale (leases expired and taken over)", acks.len());
                        }
                        // Per-batch counters: attribute the stale ones to the last items.
                        for (i, f) in acks.iter().enumerate() {
                            let c = if i < n { &f.batch.relayed } else { &f.batch.stale };
                            c.fetch_add(1, Ordering::Relaxed);
                        }
                        break;
                    }
                    Err(e) => {
                        if classify::db_error(&e) == Class::Permanent {
                            shutdown.fatal(format!("{e:#}"));
                            break;
                        }
                        lane.metrics.set_db_up(false);
                        if started.elapsed() > lease {
                            tracing::error!("ack of {} events failed for longer than the lease: {e:#}", ids.len());
                            break;
                        }
                        tracing::warn!("ack: {e:#}; retrying in {delay:?}");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(2));
                    }
                }
            }
        }
        for f in fails {
            let (error, retry_in, permanent) = match &f.outcome {
                Outcome::Retry { error, retry_in } => (error.as_str(), *retry_in, false),
                Outcome::RetryHorizon { error } => (error.as_str(), None, false),
                Outcome::Dead { error } => (error.as_str(), None, true),
                Outcome::Delivered => continue,
            };
            let started = Instant::now();
            let mut delay = Duration::from_millis(50);
            loop {
                match lane.ack_db.fail(f.id, f.token, error, retry_in, permanent).await {
                    Ok(state) => {
                        lane.metrics.set_db_up(true);
                        let (metric, counter) = match state.as_str() {
                            "dead" => (&lane.metrics.dead, &f.batch.dead),
                            "stale" => (&lane.metrics.stale, &f.batch.stale),
                            _ => (&lane.metrics.failed, &f.batch.retried),
                        };
                        metric.with_label_values(&lane.labels).inc();
                        counter.fetch_add(1, Ordering::Relaxed);
                        if state == "dead" {
                            tracing::warn!(event = f.id, "dead letter: {error}");
                        } else {
                            tracing::debug!(event = f.id, state = %state, "failed: {error}");
                        }
                        break;
                    }
                    Err(e) => {
                        if classify::db_error(&e) == Class::Permanent {
                            shutdown.fatal(format!("{e:#}"));
                            break;
                        }
                        lane.metrics.set_db_up(false);
                        if started.elapsed() > lease {
                            tracing::error!(event = f.id, "fail() did not succeed within the lease: {e:#}");
                            break;
                        }
                        tracing::warn!("fail: {e:#}; retrying in {delay:?}");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(2));
                    }
                }
            }
        }
        lane.acked.notify_one();
    }
}
