//! Reference outbox_ext worker in Rust (sync `postgres` client, threads).
//!
//! Settings come from the environment (see examples/workers/README.md). A handler
//! is a function from an `Event` to `Result<(), HandlerError>`: `Ok` means
//! delivered, `Permanent` dead-letters the event at once, `Transient` lets the
//! extension retry it with backoff. Add your own in `load_handler`.
//!
//! A handler whose effect is a write to PostgreSQL applies it exactly once with
//! `process_once(&mut client, consumer, &ev.message_id, |tx| ...)`: see it and
//! the `inbox` handler.

use postgres::fallible_iterator::FallibleIterator;
use postgres::{Client, Config, NoTls};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use std::{env, process, thread};

pub enum HandlerError {
    Transient(String),
    Permanent(String),
}

pub type Handler = Box<dyn Fn(&Event) -> Result<(), HandlerError> + Send + Sync>;

pub struct Event {
    pub id: i64,
    pub topic: String,
    pub subject: Option<String>,
    pub dispatch_key: Option<String>,
    /// The payload exactly as stored (jsonb text); the webhook forwards it as is,
    /// so numbers keep their precision.
    pub payload_text: String,
    pub headers: Value,
    pub attempt: i32,
    /// The event's identity as a message, `<outbox_id>:<event id>`: the same on
    /// every delivery and across databases (what the relay sends as Nats-Msg-Id
    /// and webhook-id). Empty before outbox_ext 0.11.0.
    pub message_id: String,
    lease_token: String,
}

impl Event {
    pub fn payload(&self) -> Value {
        serde_json::from_str(&self.payload_text).unwrap_or(Value::Null)
    }
}

// ---------------------------------------------------------------- utilities

fn now_seconds() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// UTC "YYYY-MM-DDTHH:MM:SS" without a date crate (days-to-civil conversion).
fn utc_now() -> String {
    let secs = now_seconds() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

fn log(msg: &str) {
    eprintln!("{} {}", utc_now(), msg);
}

fn die(msg: &str) -> ! {
    log(msg);
    process::exit(2);
}

fn env_f64(name: &str, default: f64) -> f64 {
    match env::var(name).map(|v| v.trim().to_string()) {
        Ok(v) if !v.is_empty() => v.parse().unwrap_or_else(|_| die(&format!("{name} must be a number, got {v}"))),
        _ => default,
    }
}

fn first_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or("").to_string()
}

/// PostgreSQL text cannot hold NUL; the extension keeps 8 kB anyway.
fn clean_error(msg: &str) -> String {
    msg.replace('\0', "").chars().take(8000).collect()
}

/// postgres::Error displays only "db error" for server errors: show the message.
fn pg_error(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{}: {}", db.severity(), db.message()),
        None => match std::error::Error::source(e) {
            Some(src) => format!("{}: {}", first_line(e), first_line(&src)),
            None => first_line(e),
        },
    }
}

// ---------------------------------------------------------------- settings

pub struct Settings {
    dsn: Config,
    name: String,
    /// None (unset or empty): the 'default' subscription.
    subscription: Option<String>,
    topics: Option<Vec<String>>,
    batch_size: i32,
    lease: f64,
    concurrency: usize,
    poll: f64,
    retry_in: Option<f64>,
    reconnect_max: f64,
    handler: String,
    webhook_url: String,
    webhook_timeout: f64,
    delivery_log: Option<String>,
    inbox_dsn: Config,
    inbox_consumer: String,
    inbox_table: String,
}

impl Settings {
    fn from_env() -> Settings {
        let dsn = env::var("OUTBOX_DSN").unwrap_or_else(|_| die("OUTBOX_DSN is required"));
        let inbox_dsn = env::var("OUTBOX_INBOX_DSN").ok().filter(|d| !d.is_empty()).unwrap_or_else(|| dsn.clone());
        let inbox_dsn = Config::from_str(&inbox_dsn).unwrap_or_else(|e| die(&format!("bad OUTBOX_INBOX_DSN: {e}")));
        let dsn = Config::from_str(&dsn).unwrap_or_else(|e| die(&format!("bad OUTBOX_DSN: {e}")));
        let host = env::var("HOSTNAME")
            .ok()
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|| "localhost".into());
        let topics: Vec<String> = env::var("OUTBOX_TOPICS")
            .unwrap_or_default()
            .split(',')
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .collect();
        let retry = env::var("OUTBOX_RETRY_IN").unwrap_or_default();
        Settings {
            dsn,
            name: env::var("OUTBOX_WORKER_NAME")
                .ok()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| format!("rust-{host}-{}", process::id())),
            subscription: env::var("OUTBOX_SUBSCRIPTION").ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()),
            topics: if topics.is_empty() { None } else { Some(topics) },
            batch_size: env_f64("OUTBOX_BATCH_SIZE", 10.0) as i32,
            lease: env_f64("OUTBOX_LEASE", 30.0),
            concurrency: (env_f64("OUTBOX_CONCURRENCY", 1.0) as usize).max(1),
            poll: env_f64("OUTBOX_POLL_INTERVAL", 5.0),
            retry_in: if retry.trim().is_empty() { None } else { Some(env_f64("OUTBOX_RETRY_IN", 0.0)) },
            reconnect_max: env_f64("OUTBOX_RECONNECT_MAX", 30.0),
            handler: env::var("OUTBOX_HANDLER").unwrap_or_else(|_| "stdout".into()),
            webhook_url: env::var("OUTBOX_WEBHOOK_URL").unwrap_or_default(),
            webhook_timeout: env_f64("OUTBOX_WEBHOOK_TIMEOUT", 10.0),
            delivery_log: env::var("OUTBOX_DELIVERY_LOG").ok().filter(|p| !p.is_empty()),
            inbox_dsn,
            inbox_consumer: env::var("OUTBOX_INBOX_CONSUMER")
                .ok()
                .filter(|c| !c.is_empty())
                .unwrap_or_else(|| "outbox-worker".into()),
            inbox_table: env::var("OUTBOX_INBOX_TABLE")
                .ok()
                .filter(|t| !t.is_empty())
                .unwrap_or_else(|| "outbox_effects".into()),
        }
    }
}

// ---------------------------------------------------------------- exactly-once effects (the inbox)

/// Any error: effects return database errors with `?` and their own with `.into()`.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An outbox event's message id: `<outbox_id>:<event id>`, where `outbox_id` is
/// `SELECT outbox.outbox_id()` in the outbox's database (read it once).
pub fn message_id(outbox_id: &str, event_id: i64) -> String {
    format!("{outbox_id}:{event_id}")
}

/// Apply a message's effect on PostgreSQL exactly once: `Ok(true)` if it was
/// applied now, `Ok(false)` if the message was a duplicate (`effect` did not run).
///
/// In one transaction on `client` (connected to the consumer's own database,
/// where the effect goes, which may not be the outbox's):
/// `outbox.inbox_receive(consumer, message_id)`, then `effect(&mut tx)` only when
/// that says it is the first time, then COMMIT. The receipt commits iff the
/// effect does, so the effect lives in the same database as the inbox: that
/// database needs outbox_ext installed (CREATE EXTENSION outbox_ext) and the role
/// EXECUTE on inbox_receive (outbox_worker has it).
///
/// The transaction has the session's isolation level. A concurrent duplicate
/// waits for the first and gets `false`; at REPEATABLE READ or SERIALIZABLE it
/// gets 40001 instead, and serialization failures (40001) and deadlocks (40P01),
/// from inbox_receive, the effect or COMMIT, retry the whole transaction up to 5
/// times, so `effect` may run more than once but only one run commits: its
/// writes go through `tx`, nothing else. Any other error rolls back (the message
/// can be received again) and is returned. The effect must return, not swallow,
/// database errors: COMMIT of an aborted transaction rolls back silently.
pub fn process_once<F>(client: &mut Client, consumer: &str, message_id: &str, mut effect: F) -> Result<bool, BoxError>
where
    F: FnMut(&mut postgres::Transaction<'_>) -> Result<(), BoxError>,
{
    const RETRIES: u32 = 5;
    let mut attempt = 0;
    loop {
        let result = (|| -> Result<bool, BoxError> {
            let mut tx = client.transaction()?;
            let received: bool =
                tx.query_one("SELECT outbox.inbox_receive($1::text, $2::text)", &[&consumer, &message_id])?.get(0);
            if received {
                effect(&mut tx)?;
            }
            tx.commit()?; // dropped without commit = rolled back
            Ok(received)
        })();
        let retry = match &result {
            Err(e) => e.downcast_ref::<postgres::Error>().and_then(|e| e.code()).is_some_and(|c| {
                *c == postgres::error::SqlState::T_R_SERIALIZATION_FAILURE
                    || *c == postgres::error::SqlState::T_R_DEADLOCK_DETECTED
            }),
            Ok(_) => false,
        };
        if !retry || attempt >= RETRIES {
            return result;
        }
        let jitter =
            f64::from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().subsec_nanos() % 1000) / 1000.0;
        thread::sleep(Duration::from_secs_f64((0.005 + 0.015 * jitter) * 2f64.powi(attempt as i32)));
        attempt += 1;
    }
}

// ---------------------------------------------------------------- handlers

fn stdout_handler() -> Handler {
    let lock = Mutex::new(());
    Box::new(move |ev: &Event| {
        let head = json!({"id": ev.id, "topic": ev.topic, "subject": ev.subject, "attempt": ev.attempt}).to_string();
        // Splice the raw payload in so it prints exactly as stored.
        let line = format!("{},\"payload\":{}}}\n", &head[..head.len() - 1], ev.payload_text);
        let _g = lock.lock().unwrap();
        let mut out = std::io::stdout().lock();
        out.write_all(line.as_bytes()).and_then(|_| out.flush()).map_err(|e| HandlerError::Transient(e.to_string()))
    })
}

fn webhook_handler(cfg: &Settings) -> Handler {
    if cfg.webhook_url.is_empty() {
        die("OUTBOX_HANDLER=webhook needs OUTBOX_WEBHOOK_URL");
    }
    let url = cfg.webhook_url.clone();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs_f64(cfg.webhook_timeout)))
        .http_status_as_error(false)
        .build()
        .into();
    Box::new(move |ev: &Event| {
        let idem = ev.dispatch_key.clone().unwrap_or_else(|| format!("outbox-{}", ev.id));
        let mut req = agent
            .post(&url)
            .header("Content-Type", "application/json")
            .header("X-Outbox-Event-Id", ev.id.to_string())
            .header("X-Outbox-Topic", &ev.topic)
            .header("X-Outbox-Attempt", ev.attempt.to_string())
            // Receivers deduplicate on this: delivery is at least once.
            .header("Idempotency-Key", idem);
        if let Some(s) = &ev.subject {
            req = req.header("X-Outbox-Subject", s);
        }
        for h in ["traceparent", "tracestate"] {
            if let Some(v) = ev.headers.get(h).and_then(Value::as_str) {
                if !v.contains(['\r', '\n']) {
                    req = req.header(h, v);
                }
            }
        }
        match req.send(ev.payload_text.as_str()) {
            Ok(mut resp) => {
                let code = resp.status().as_u16();
                if (200..300).contains(&code) {
                    return Ok(());
                }
                let body: String = resp.body_mut().read_to_string().unwrap_or_default().chars().take(200).collect();
                let msg = format!("HTTP {code} from webhook: {body}");
                // 408/429/5xx may succeed later; other statuses will not.
                if code == 408 || code == 429 || code >= 500 {
                    Err(HandlerError::Transient(msg))
                } else {
                    Err(HandlerError::Permanent(msg))
                }
            }
            Err(e) => Err(HandlerError::Transient(format!("webhook unreachable: {e}"))),
        }
    })
}

/// Driven by the payload, for the end-to-end tests:
/// {"sleep_ms": N, "fail": "transient"|"permanent", "fail_attempts": k, "error": text}
fn test_handler() -> Handler {
    Box::new(|ev: &Event| {
        let p = ev.payload();
        if let Some(ms) = p.get("sleep_ms").and_then(Value::as_u64) {
            thread::sleep(Duration::from_millis(ms));
        }
        let error = |dflt: &str| p.get("error").and_then(Value::as_str).unwrap_or(dflt).to_string();
        match p.get("fail").and_then(Value::as_str) {
            Some("permanent") => Err(HandlerError::Permanent(error("permanent test failure"))),
            Some("transient") if i64::from(ev.attempt) <= p.get("fail_attempts").and_then(Value::as_i64).unwrap_or(1) => {
                Err(HandlerError::Transient(error("transient test failure")))
            }
            _ => Ok(()),
        }
    })
}

/// An effect in PostgreSQL applied exactly once through `process_once`: one row
/// per message in OUTBOX_INBOX_TABLE (message_id, event_id, topic, subject,
/// attempt, payload) in the database OUTBOX_INBOX_DSN (default OUTBOX_DSN), as
/// consumer OUTBOX_INBOX_CONSUMER. The message id is the payload's "message_id"
/// when it is a string (an id the producer gave the message), else
/// `ev.message_id`. For the tests, also driven by the payload: "effect_sleep_ms"
/// and "effect_fail" act inside the transaction (a failure rolls the receipt back
/// too, while attempt <= "fail_attempts"), then the `test` handler's fields act
/// after the commit (a failure there means a redelivery, which is then a
/// duplicate).
fn inbox_handler(cfg: &Settings) -> Handler {
    let table: Vec<String> = cfg.inbox_table.split('.').map(|p| format!("\"{}\"", p.replace('"', "\"\""))).collect();
    let insert = format!(
        "INSERT INTO {} (message_id, event_id, topic, subject, attempt, payload) \
         VALUES ($1::text, $2::int8, $3::text, $4::text, $5::int4, $6::text::jsonb)",
        table.join(".")
    );
    let consumer = cfg.inbox_consumer.clone();
    let mut dsn = cfg.inbox_dsn.clone();
    dsn.application_name(&format!("{}-inbox", cfg.name));
    let after = test_handler();
    // Idle connections; a handler thread takes one (or connects) and puts it back.
    let idle: Mutex<Vec<Client>> = Mutex::new(Vec::new());
    Box::new(move |ev: &Event| {
        let p = ev.payload();
        let mid = p.get("message_id").and_then(Value::as_str).unwrap_or(&ev.message_id).to_string();
        if mid.is_empty() {
            return Err(HandlerError::Permanent("no message id (outbox.outbox_id() needs outbox_ext 0.11.0)".into()));
        }
        let taken = idle.lock().unwrap().pop();
        let mut client = match taken {
            Some(c) if !c.is_closed() => c,
            _ => dsn.connect(NoTls).map_err(|e| HandlerError::Transient(pg_error(&e)))?,
        };
        let res = process_once(&mut client, &consumer, &mid, |tx| {
            tx.execute(&insert, &[&mid, &ev.id, &ev.topic, &ev.subject, &ev.attempt, &ev.payload_text])?;
            if let Some(ms) = p.get("effect_sleep_ms").and_then(Value::as_u64) {
                thread::sleep(Duration::from_millis(ms));
            }
            let fail_attempts = p.get("fail_attempts").and_then(Value::as_i64).unwrap_or(1);
            if p.get("effect_fail").and_then(Value::as_bool) == Some(true) && i64::from(ev.attempt) <= fail_attempts {
                return Err("effect failed, rolled back".into());
            }
            Ok(())
        });
        if !client.is_closed() {
            idle.lock().unwrap().push(client);
        }
        res.map_err(|e| {
            HandlerError::Transient(match e.downcast_ref::<postgres::Error>() {
                Some(pg) => pg_error(pg),
                None => e.to_string(),
            })
        })?;
        after(ev)
    })
}

fn load_handler(cfg: &Settings) -> Handler {
    match cfg.handler.as_str() {
        "stdout" => stdout_handler(),
        "webhook" => webhook_handler(cfg),
        "test" => test_handler(),
        "inbox" => inbox_handler(cfg),
        other => die(&format!("unknown OUTBOX_HANDLER {other:?} (stdout, webhook, test or inbox)")),
    }
}

// ---------------------------------------------------------------- database

enum DbError {
    /// The connection dropped and the deadline to retry has passed.
    Lost(String),
    /// An SQL error on a healthy connection: a bug or a misconfiguration.
    Fatal(postgres::Error),
}

/// "The connection is gone", as opposed to an SQL error.
fn is_connection_error(e: &postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    if let Some(code) = e.code() {
        let c = code.code();
        return c.starts_with("08") || c.starts_with("57P");
    }
    std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
}

/// The `work` connection: claims, acks, heartbeats; shared by the handler threads.
struct Db {
    cfg: Arc<Settings>,
    work: Mutex<Option<Client>>,
    connected: AtomicBool,
    stop: Arc<AtomicBool>,
}

impl Db {
    fn connect(&self) -> Result<Client, postgres::Error> {
        let mut c = self.cfg.dsn.clone();
        c.application_name(&self.cfg.name);
        let mut client = c.connect(NoTls)?;
        // outbox.claim refuses SERIALIZABLE (0A000): whatever the database's
        // default_transaction_isolation, this session claims at READ COMMITTED.
        client.batch_execute("SET default_transaction_isolation = 'read committed'")?;
        Ok(client)
    }

    fn backoff(&self, attempt: u32) -> Duration {
        let d = (0.1 * 2f64.powi(attempt.min(30) as i32)).min(self.cfg.reconnect_max);
        let jitter = f64::from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().subsec_nanos() % 1000) / 1000.0;
        Duration::from_secs_f64(d / 2.0 + jitter * d / 2.0)
    }

    /// Sleep, cut short by SIGTERM when `interruptible`.
    fn pause(&self, d: Duration, interruptible: bool) {
        let end = Instant::now() + d;
        while Instant::now() < end && !(interruptible && self.stop.load(Ordering::SeqCst)) {
            thread::sleep((end - Instant::now()).min(Duration::from_millis(100)));
        }
    }

    /// Run `f` on `work`, reconnecting on connection loss. Gives up (Lost) after
    /// `deadline` or, with none, once the worker is stopping.
    fn call<T>(
        &self,
        deadline: Option<Instant>,
        f: impl Fn(&mut Client) -> Result<T, postgres::Error>,
    ) -> Result<T, DbError> {
        let mut attempt = 0;
        loop {
            let err = {
                let mut guard = self.work.lock().unwrap();
                if guard.is_none() {
                    match self.connect() {
                        Ok(c) => {
                            if self.connected.swap(true, Ordering::SeqCst) {
                                log(&format!("worker={} reconnected (work connection)", self.cfg.name));
                            }
                            *guard = Some(c);
                        }
                        Err(e) => {
                            // Connect errors are always retried: the server may be restarting.
                            attempt += 1;
                            drop(guard);
                            let delay = self.backoff(attempt - 1);
                            if self.give_up(deadline, delay) {
                                return Err(DbError::Lost(pg_error(&e)));
                            }
                            log(&format!("worker={} cannot connect ({}); retry in {:.2}s", self.cfg.name, pg_error(&e), delay.as_secs_f64()));
                            self.pause(delay, deadline.is_none());
                            continue;
                        }
                    }
                }
                let client = guard.as_mut().unwrap();
                match f(client) {
                    Ok(v) => return Ok(v),
                    Err(e) => {
                        if !is_connection_error(&e) && !client.is_closed() {
                            return Err(DbError::Fatal(e));
                        }
                        *guard = None;
                        e
                    }
                }
            };
            let delay = self.backoff(attempt);
            attempt += 1;
            if self.give_up(deadline, delay) {
                return Err(DbError::Lost(pg_error(&err)));
            }
            log(&format!("worker={} connection lost ({}); retry in {:.2}s", self.cfg.name, pg_error(&err), delay.as_secs_f64()));
            self.pause(delay, deadline.is_none());
        }
    }

    fn give_up(&self, deadline: Option<Instant>, delay: Duration) -> bool {
        match deadline {
            Some(d) => Instant::now() + delay > d,
            None => self.stop.load(Ordering::SeqCst),
        }
    }
}

/// Whether a notification for `topic` wakes the worker. A notification names a
/// topic, not a subscription: `patterns` is the claim's own filter
/// (OUTBOX_TOPICS; every topic when None), never the subscription's topics, so a
/// worker of a filtered subscription wakes for each of its topics, and a wake-up
/// for a topic its subscription does not take costs one empty claim.
fn topic_wanted(patterns: &Option<Vec<String>>, topic: &str) -> bool {
    match patterns {
        None => true,
        Some(ps) => ps.iter().any(|p| {
            p == "*" || p == topic || (p.ends_with(".*") && topic.starts_with(&p[..p.len() - 1]))
        }),
    }
}

// ---------------------------------------------------------------- worker

const CLAIM_SQL: &str = "
SELECT id, topic, subject, dispatch_key, payload::text, headers::text, attempt, lease_token::text
  FROM outbox.claim($1::text, $2::int4, make_interval(secs => $3::float8), $4::text[], $5::text)";

struct Worker {
    cfg: Arc<Settings>,
    db: Db,
    handler: Handler,
    stop: Arc<AtomicBool>,
    log_lock: Mutex<()>,
}

fn fatal(e: DbError) -> ! {
    match e {
        DbError::Fatal(e) => log(&format!("fatal: {}", pg_error(&e))),
        DbError::Lost(e) => log(&format!("fatal: connection lost: {e}")),
    }
    process::exit(1);
}

impl Worker {
    fn record(&self, ev: &Event, started: f64, acked: bool) {
        let Some(path) = &self.cfg.delivery_log else { return };
        let line = json!({"worker": self.cfg.name, "id": ev.id, "topic": ev.topic, "subject": ev.subject,
                          "attempt": ev.attempt, "started": started, "finished": now_seconds(), "acked": acked});
        let _g = self.log_lock.lock().unwrap();
        let res = OpenOptions::new().create(true).append(true).open(path).and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = res {
            log(&format!("fatal: cannot write {path}: {e}"));
            process::exit(1);
        }
    }

    /// Retrying past the lease is pointless: the event is anyone's again.
    fn settle<T: for<'a> postgres::types::FromSql<'a>>(
        &self,
        sql: &str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
    ) -> Result<T, DbError> {
        let deadline = Instant::now() + Duration::from_secs_f64(self.cfg.lease);
        self.db.call(Some(deadline), |c| c.query_one(sql, params).map(|r| r.get(0)))
    }

    fn deliver(&self, ev: &Event) -> &'static str {
        let outcome = (|| -> Result<&'static str, DbError> {
            if self.stop.load(Ordering::SeqCst) {
                // Shutting down: give back events whose handler has not started.
                let _: String = self.settle(
                    "SELECT outbox.fail($1::bigint, $2::text::uuid, $3::text, interval '0')",
                    &[&ev.id, &ev.lease_token, &"worker stopping before delivery"],
                )?;
                return Ok("released");
            }
            let started = now_seconds();
            match (self.handler)(ev) {
                Ok(()) => {
                    let acked: bool = self.settle("SELECT outbox.ack($1::bigint, $2::text::uuid)", &[&ev.id, &ev.lease_token])?;
                    self.record(ev, started, acked);
                    Ok(if acked { "acked" } else { "stale" })
                }
                Err(HandlerError::Permanent(msg)) => {
                    let msg = clean_error(&msg);
                    let st: String = self.settle(
                        "SELECT outbox.fail($1::bigint, $2::text::uuid, $3::text, NULL, true)",
                        &[&ev.id, &ev.lease_token, &msg],
                    )?;
                    Ok(if st == "dead" { "dead" } else { "stale" })
                }
                Err(HandlerError::Transient(msg)) => {
                    let msg = clean_error(&msg);
                    let st: String = self.settle(
                        "SELECT outbox.fail($1::bigint, $2::text::uuid, $3::text, make_interval(secs => $4::float8))",
                        &[&ev.id, &ev.lease_token, &msg, &self.cfg.retry_in],
                    )?;
                    Ok(match st.as_str() {
                        "pending" => "retry",
                        "dead" => "dead",
                        _ => "stale",
                    })
                }
            }
        })();
        match outcome {
            Ok(o) => o,
            Err(DbError::Lost(_)) => "lost",
            Err(e) => fatal(e),
        }
    }

    /// Every lease/3 (two missed beats still leave the lease alive), extend the
    /// leases of the batch's unfinished events.
    fn heartbeat(&self, unfinished: &Mutex<HashMap<i64, String>>, done: mpsc::Receiver<()>) {
        let every = Duration::from_secs_f64(self.cfg.lease / 3.0);
        while let Err(mpsc::RecvTimeoutError::Timeout) = done.recv_timeout(every) {
            let (ids, toks): (Vec<i64>, Vec<String>) = unfinished.lock().unwrap().iter().map(|(i, t)| (*i, t.clone())).unzip();
            if ids.is_empty() {
                continue;
            }
            let res = self.db.call(Some(Instant::now() + every), |c| {
                c.query(
                    "SELECT t.id, outbox.extend_lease(t.id, t.tok, make_interval(secs => $1::float8)) IS NOT NULL
                       FROM unnest($2::bigint[], $3::text[]::uuid[]) AS t(id, tok)",
                    &[&self.cfg.lease, &ids, &toks],
                )
            });
            match res {
                Ok(rows) => {
                    for r in rows {
                        let (id, alive): (i64, bool) = (r.get(0), r.get(1));
                        if !alive && unfinished.lock().unwrap().remove(&id).is_some() {
                            log(&format!("worker={} lease lost for event {id}", self.cfg.name));
                        }
                    }
                }
                Err(DbError::Lost(_)) => {}
                Err(e) => fatal(e),
            }
        }
    }

    fn process(&self, events: Vec<Event>, batch_no: u64) {
        let t0 = Instant::now();
        let unfinished = Mutex::new(events.iter().map(|e| (e.id, e.lease_token.clone())).collect::<HashMap<_, _>>());
        let next = AtomicUsize::new(0);
        let outcomes = Mutex::new(Vec::with_capacity(events.len()));
        let (done_tx, done_rx) = mpsc::channel::<()>();
        thread::scope(|s| {
            s.spawn(|| self.heartbeat(&unfinished, done_rx));
            let runners: Vec<_> = (0..self.cfg.concurrency.min(events.len()))
                .map(|_| {
                    s.spawn(|| loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(ev) = events.get(i) else { break };
                        let o = self.deliver(ev);
                        unfinished.lock().unwrap().remove(&ev.id);
                        outcomes.lock().unwrap().push(o);
                    })
                })
                .collect();
            for r in runners {
                if r.join().is_err() {
                    log("fatal: a handler thread panicked");
                    process::exit(1);
                }
            }
            drop(done_tx);
        });
        let outcomes = outcomes.into_inner().unwrap();
        let counts: Vec<String> = ["acked", "retry", "dead", "stale", "released", "lost"]
            .iter()
            .map(|k| format!("{k}={}", outcomes.iter().filter(|o| *o == k).count()))
            .collect();
        log(&format!(
            "worker={} batch={batch_no} claimed={} {} ms={}",
            self.cfg.name,
            events.len(),
            counts.join(" "),
            t0.elapsed().as_millis()
        ));
    }

    /// (Re)open the LISTEN connection, with backoff. None only when stopping.
    fn listen(&self, listened_before: bool) -> Option<Client> {
        let mut attempt = 0;
        while !self.stop.load(Ordering::SeqCst) {
            match self.db.connect().and_then(|mut c| c.batch_execute("LISTEN outbox").map(|_| c)) {
                Ok(c) => {
                    if listened_before {
                        log(&format!("worker={} reconnected, LISTEN outbox again", self.cfg.name));
                    }
                    return Some(c);
                }
                Err(e) => {
                    let delay = self.db.backoff(attempt);
                    attempt += 1;
                    log(&format!("worker={} cannot connect ({}); retry in {:.2}s", self.cfg.name, pg_error(&e), delay.as_secs_f64()));
                    self.db.pause(delay, true);
                }
            }
        }
        None
    }

    /// Block until a wanted NOTIFY, the poll interval, or stop. False when the
    /// listen connection dropped.
    fn wait(&self, listen: &mut Client) -> bool {
        let end = Instant::now() + Duration::from_secs_f64(self.cfg.poll);
        while !self.stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            if now >= end {
                return true;
            }
            // Short slices: SIGTERM only sets a flag.
            let slice = (end - now).min(Duration::from_millis(250));
            let next = listen.notifications().timeout_iter(slice).next();
            match next {
                Ok(Some(n)) => {
                    if topic_wanted(&self.cfg.topics, n.payload()) {
                        // Several notifications may be queued; one claim covers them.
                        while let Ok(Some(_)) = listen.notifications().iter().next() {}
                        return true;
                    }
                }
                Err(e) => {
                    log(&format!("worker={} listen connection lost ({})", self.cfg.name, pg_error(&e)));
                    return false;
                }
                Ok(None) if listen.is_closed() => {
                    log(&format!("worker={} listen connection lost", self.cfg.name));
                    return false;
                }
                Ok(None) => {}
            }
        }
        true
    }

    /// outbox.outbox_id(), read once: it never changes. Empty before 0.11.0.
    fn read_outbox_id(&self) -> Result<String, DbError> {
        match self.db.call(None, |c| c.query_one("SELECT outbox.outbox_id()::text", &[]).map(|r| r.get(0))) {
            Err(DbError::Fatal(e)) if e.code() == Some(&postgres::error::SqlState::UNDEFINED_FUNCTION) => {
                log(&format!(
                    "worker={} outbox.outbox_id() missing (outbox_ext < 0.11.0): events have no message_id",
                    self.cfg.name
                ));
                Ok(String::new())
            }
            other => other,
        }
    }

    fn run(&self) {
        let cfg = &self.cfg;
        log(&format!(
            "worker={} starting: handler={} subscription={} topics={} batch={} lease={}s concurrency={} poll={}s",
            cfg.name,
            cfg.handler,
            cfg.subscription.as_deref().unwrap_or("default"),
            cfg.topics.as_ref().map(|t| t.join(",")).unwrap_or_else(|| "*".into()),
            cfg.batch_size,
            cfg.lease,
            cfg.concurrency,
            cfg.poll
        ));
        let mut listen: Option<Client> = None;
        let mut listened = false;
        let mut batches = 0u64;
        let mut outbox_id: Option<String> = None;
        while !self.stop.load(Ordering::SeqCst) {
            if listen.is_none() {
                // Claiming right after (re)connecting covers notifications missed meanwhile.
                listen = self.listen(listened);
                listened = true;
                if listen.is_none() {
                    break;
                }
            }
            if outbox_id.is_none() {
                outbox_id = match self.read_outbox_id() {
                    Ok(id) => Some(id),
                    Err(DbError::Lost(_)) => break,
                    Err(e) => fatal(e),
                };
            }
            let oid = outbox_id.as_deref().unwrap_or("");
            let rows = self.db.call(None, |c| {
                c.query(CLAIM_SQL, &[&cfg.name, &cfg.batch_size, &cfg.lease, &cfg.topics, &cfg.subscription])
            });
            let rows = match rows {
                Ok(r) => r,
                Err(DbError::Lost(_)) => break,
                Err(e) => fatal(e),
            };
            if !rows.is_empty() {
                let events = rows
                    .iter()
                    .map(|r| Event {
                        id: r.get(0),
                        topic: r.get(1),
                        subject: r.get(2),
                        dispatch_key: r.get(3),
                        payload_text: r.get(4),
                        headers: r.get::<_, Option<String>>(5).and_then(|h| serde_json::from_str(&h).ok()).unwrap_or(Value::Null),
                        attempt: r.get(6),
                        message_id: if oid.is_empty() { String::new() } else { message_id(oid, r.get(0)) },
                        lease_token: r.get(7),
                    })
                    .collect();
                batches += 1;
                // Acks may have unblocked later events of the same subjects, and no
                // NOTIFY announces that: claim again before sleeping.
                self.process(events, batches);
                continue;
            }
            if !self.wait(listen.as_mut().unwrap()) {
                listen = None;
            }
        }
        if self.stop.load(Ordering::SeqCst) {
            log(&format!("worker={} got a stop signal: in-flight events finished", cfg.name));
        }
        log(&format!("worker={} stopped", cfg.name));
    }
}

fn main() {
    let cfg = Arc::new(Settings::from_env());
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&stop)).unwrap_or_else(|e| die(&format!("signal setup: {e}")));
    }
    let worker = Worker {
        handler: load_handler(&cfg),
        db: Db { cfg: Arc::clone(&cfg), work: Mutex::new(None), connected: AtomicBool::new(false), stop: Arc::clone(&stop) },
        cfg,
        stop,
        log_lock: Mutex::new(()),
    };
    worker.run();
}
