//! PostgreSQL side: one reconnecting connection and the outbox SQL API calls the relay makes.
//!
//! Invariants:
//! - Only the public API is used: `outbox.claim`, `outbox.ack`, `outbox.fail`, `outbox.extend_lease`,
//!   `outbox.create_subscription`, `outbox.pause_subscription`, `outbox.outbox_id` and the
//!   `outbox.subscriptions` view. Every call runs in autocommit, so a claim never holds a lane or a
//!   batch open across a network round trip to the sink, and at READ COMMITTED whatever the
//!   database's default isolation (a claim at SERIALIZABLE is refused).
//! - Every ack, fail and heartbeat carries the lease token of the claim that handed the event out.
//!   The extension fences on it: after a lease expired and another worker took the event, our late
//!   ack returns `false`/`'stale'` and changes nothing. That is what makes SIGKILL, network
//!   partitions and reconnects safe: at worst an event is delivered again (and deduplicated by its
//!   message id downstream), never lost, because nothing is acked before the sink confirmed it.
//! - A broken connection is never reused: [`Db::client`] reconnects when the previous client is
//!   closed, and callers retry with backoff. No statement is retried blindly after an unknown
//!   outcome except ack/fail/extend_lease, which are idempotent under their fencing token.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};
use futures::StreamExt as _;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::sync::{Mutex, Notify};
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Client};
use uuid::Uuid;

/// One event handed out by `outbox.claim`, with the fields the sinks need.
#[derive(Debug, Clone)]
pub struct Event {
    /// The event id (global, from `outbox.event_id_seq`).
    pub id: i64,
    /// The event's topic, e.g. `billing.invoice.paid`.
    pub topic: String,
    /// The ordering key, when the publisher gave one.
    pub subject: Option<String>,
    /// The idempotency key, when the publisher gave one.
    pub dispatch_key: Option<String>,
    /// The payload exactly as `payload::text` returns it (the bytes sinks send).
    pub payload: String,
    /// The event's headers (string values only; other values are skipped).
    pub headers: Vec<(String, String)>,
    /// Delivery attempt number, 1 for the first.
    pub attempt: i32,
    /// Fencing token of this delivery.
    pub lease_token: Uuid,
}

/// TLS behaviour asked for by the DSN's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TlsMode {
    /// `disable`, `allow`, `prefer`, `require`: encrypt when asked, do not verify the certificate.
    NoVerify,
    /// `verify-ca`: verify the chain, not the host name.
    VerifyCa,
    /// `verify-full`: verify the chain and the host name.
    VerifyFull,
}

/// Splits the libpq options that tokio-postgres does not know (`sslrootcert`, the `verify-*`
/// sslmodes) out of a DSN, in key/value or URL form. Returns the cleaned DSN, the TLS mode and the
/// root certificate file.
fn split_tls_options(dsn: &str) -> Result<(String, TlsMode, Option<String>)> {
    let mut mode = TlsMode::NoVerify;
    let mut rootcert = None;
    let mut apply = |key: &str, value: &str| -> Option<String> {
        match (key, value) {
            ("sslmode", "verify-ca") => {
                mode = TlsMode::VerifyCa;
                Some("require".to_string())
            }
            ("sslmode", "verify-full") => {
                mode = TlsMode::VerifyFull;
                Some("require".to_string())
            }
            ("sslrootcert", v) => {
                rootcert = Some(v.to_string());
                Some(String::new())
            }
            _ => None,
        }
    };
    let trimmed = dsn.trim();
    let cleaned = if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        match trimmed.split_once('?') {
            None => trimmed.to_string(),
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    match apply(k, &percent_decode(v)) {
                        Some(new) if new.is_empty() => {}
                        Some(new) => kept.push(format!("{k}={new}")),
                        None => kept.push(pair.to_string()),
                    }
                }
                if kept.is_empty() {
                    base.to_string()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else {
        let mut out = Vec::new();
        for (k, v) in parse_key_values(trimmed)? {
            match apply(&k, &v) {
                Some(new) if new.is_empty() => {}
                Some(new) => out.push(format!("{k}={new}")),
                None => out.push(format!("{k}='{}'", v.replace('\\', "\\\\").replace('\'', "\\'"))),
            }
        }
        out.join(" ")
    };
    Ok((cleaned, mode, rootcert))
}

/// Decodes `%XX` escapes (URL DSN parameter values).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses a libpq key/value connection string (`host=x port=5432 password='a b\'c'`).
fn parse_key_values(s: &str) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            bail!("malformed connection string near '{key}' (expected key=value)");
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            let mut closed = false;
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '\'' => {
                        closed = true;
                        break;
                    }
                    c => value.push(c),
                }
            }
            if !closed {
                bail!("malformed connection string: unterminated quote in value of '{key}'");
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                if c == '\\' {
                    chars.next();
                    value.extend(chars.next());
                    continue;
                }
                value.push(c);
                chars.next();
            }
        }
        out.push((key, value));
    }
    Ok(out)
}

/// Accepts any server certificate (libpq's `sslmode=require`: encrypted, not authenticated), but
/// still checks the handshake signatures.
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `sslmode=verify-ca`: the chain must verify against the roots, the host name is not checked.
#[derive(Debug)]
struct VerifyCaOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for VerifyCaOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName | rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Loads PEM certificates from `path` into `roots`.
pub fn add_pem_roots(roots: &mut rustls::RootCertStore, path: &str) -> Result<()> {
    let pem = std::fs::read(path).with_context(|| format!("cannot read root certificate file {path}"))?;
    let mut n = 0;
    for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
        let cert = cert.with_context(|| format!("bad PEM in {path}"))?;
        roots.add(cert).with_context(|| format!("bad certificate in {path}"))?;
        n += 1;
    }
    if n == 0 {
        bail!("no certificate found in {path}");
    }
    Ok(())
}

/// Builds the rustls client configuration for a TLS mode.
fn tls_config(mode: TlsMode, rootcert: Option<&str>) -> Result<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("TLS setup")?;
    if mode == TlsMode::NoVerify {
        return Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
            .with_no_client_auth());
    }
    let mut roots = rustls::RootCertStore::empty();
    match rootcert {
        Some(path) => add_pem_roots(&mut roots, path)?,
        None => {
            let home_root = std::env::var("HOME").map(|h| format!("{h}/.postgresql/root.crt")).unwrap_or_default();
            if !home_root.is_empty() && std::path::Path::new(&home_root).exists() {
                add_pem_roots(&mut roots, &home_root)?;
            } else {
                for cert in rustls_native_certs::load_native_certs().certs {
                    let _ = roots.add(cert);
                }
            }
        }
    }
    if roots.is_empty() {
        bail!("sslmode=verify-*: no root certificate (set sslrootcert=FILE)");
    }
    let roots = Arc::new(roots);
    if mode == TlsMode::VerifyFull {
        return Ok(builder.with_root_certificates(roots).with_no_client_auth());
    }
    let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider)
        .build()
        .map_err(|e| anyhow!("TLS setup: {e}"))?;
    Ok(builder.dangerous().with_custom_certificate_verifier(Arc::new(VerifyCaOnly(inner))).with_no_client_auth())
}

/// The rustls connector for PostgreSQL connections, which also connects through a Unix socket:
/// there tokio-postgres passes no host name, which rustls refuses as a server name, although
/// PostgreSQL never negotiates TLS on a socket (it answers the SSL request with 'N', so with
/// `sslmode=require` the connection is refused as libpq refuses it). A placeholder name lets the
/// connector be built; it is never checked.
#[derive(Clone)]
pub struct PgTls(tokio_postgres_rustls::MakeRustlsConnect);

impl<S> tokio_postgres::tls::MakeTlsConnect<S> for PgTls
where
    tokio_postgres_rustls::MakeRustlsConnect: tokio_postgres::tls::MakeTlsConnect<S>,
{
    type Stream = <tokio_postgres_rustls::MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<S>>::Stream;
    type TlsConnect = <tokio_postgres_rustls::MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<S>>::TlsConnect;
    type Error = <tokio_postgres_rustls::MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<S>>::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Self::TlsConnect, Self::Error> {
        let domain = if domain.is_empty() { "localhost" } else { domain };
        tokio_postgres::tls::MakeTlsConnect::<S>::make_tls_connect(&mut self.0, domain)
    }
}

/// Parses a DSN (libpq key/value or URL form; `sslmode` and `sslrootcert` understood) into a
/// driver configuration and the matching rustls connector, without connecting. An empty DSN gives
/// an empty configuration (the caller fills it in). Sets a 5 s connect timeout, TCP keepalives,
/// `application_name` and the user (`PGUSER`, else `USER`) when the DSN has none.
pub fn parse_dsn(dsn: &str, application_name: &str) -> Result<(tokio_postgres::Config, PgTls)> {
    let (cleaned, mode, rootcert) = split_tls_options(dsn)?;
    let mut config = tokio_postgres::Config::from_str(&cleaned).map_err(|e| anyhow!("bad DSN: {e}"))?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(5));
    }
    if config.get_application_name().is_none() {
        config.application_name(application_name);
    }
    config.keepalives(true).keepalives_idle(Duration::from_secs(30));
    if config.get_user().is_none() {
        if let Ok(user) = std::env::var("PGUSER").or_else(|_| std::env::var("USER")) {
            config.user(user);
        }
    }
    if mode != TlsMode::NoVerify {
        config.ssl_mode(tokio_postgres::config::SslMode::Require);
    }
    let tls = PgTls(tokio_postgres_rustls::MakeRustlsConnect::new(tls_config(mode, rootcert.as_deref())?));
    Ok((config, tls))
}

/// A PostgreSQL connection that reconnects on demand, optionally LISTENing on `outbox`.
pub struct Db {
    config: tokio_postgres::Config,
    tls: PgTls,
    client: Mutex<Option<Arc<Client>>>,
    listen: bool,
    /// Signalled for every notification on the `outbox` channel (and after each reconnect, so a
    /// waiting claimer looks again at once).
    pub wakeup: Arc<Notify>,
}

impl Db {
    /// Parses the DSN (libpq key/value or URL form; `sslmode` and `sslrootcert` understood) without
    /// connecting. `listen` makes every connection run `LISTEN outbox`.
    pub fn new(dsn: &str, application_name: &str, listen: bool) -> Result<Self> {
        if dsn.trim().is_empty() {
            bail!("no PostgreSQL DSN: pass --dsn or set OUTBOX_DSN");
        }
        let (config, tls) = parse_dsn(dsn, application_name)?;
        Ok(Self { config, tls, client: Mutex::new(None), listen, wakeup: Arc::new(Notify::new()) })
    }

    /// The live client, connecting first when there is none or the last one is closed (one attempt;
    /// callers back off and retry).
    pub async fn client(&self) -> Result<Arc<Client>> {
        let mut guard = self.client.lock().await;
        if let Some(c) = guard.as_ref() {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        *guard = None;
        let (client, mut conn) = self.config.connect(self.tls.clone()).await.map_err(|e| {
            anyhow::Error::new(ConnectError { message: pg_error(&e), from_server: e.as_db_error().is_some() })
        })?;
        let wakeup = self.wakeup.clone();
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
            while let Some(msg) = messages.next().await {
                match msg {
                    Ok(AsyncMessage::Notification(_)) => wakeup.notify_one(),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!("postgres connection lost: {}", pg_error(&e));
                        break;
                    }
                }
            }
            wakeup.notify_one();
        });
        // outbox.claim refuses SERIALIZABLE (0A000): whatever the database's
        // default_transaction_isolation, the relay's sessions run at READ COMMITTED.
        let setup = if self.listen {
            "SET default_transaction_isolation = 'read committed'; LISTEN outbox"
        } else {
            "SET default_transaction_isolation = 'read committed'"
        };
        client.batch_execute(setup).await.map_err(|e| anyhow!("{}", pg_error(&e)))?;
        let client = Arc::new(client);
        *guard = Some(client.clone());
        self.wakeup.notify_one();
        Ok(client)
    }

    /// `outbox.outbox_id()`: the UUID of this outbox installation (extension 0.11.0 and later).
    pub async fn outbox_id(&self) -> Result<Uuid> {
        let c = self.client().await?;
        match c.query_one("SELECT outbox.outbox_id()", &[]).await {
            Ok(row) => Ok(row.get(0)),
            Err(e)
                if e.code() == Some(&SqlState::UNDEFINED_FUNCTION)
                    || e.code() == Some(&SqlState::INVALID_SCHEMA_NAME) =>
            {
                bail!(
                    "outbox.outbox_id() does not exist: the relay needs outbox_ext 0.11.0 or later \
                     (ALTER EXTENSION outbox_ext UPDATE)"
                )
            }
            Err(e) => Err(anyhow!("outbox.outbox_id(): {}", pg_error(&e))),
        }
    }

    /// Creates the subscription when it is missing (42710 = it exists: fine). Returns false when the
    /// extension has no subscriptions at all (before 0.9.0); the relay then claims from `default`
    /// with its topic filter.
    pub async fn ensure_subscription(&self, name: &str, topics: Option<&[String]>, start: &str) -> Result<bool> {
        let c = self.client().await?;
        let topics: Option<Vec<String>> = topics.map(<[String]>::to_vec);
        match c
            .execute(
                "SELECT outbox.create_subscription($1::text, $2::text[], start => $3::text)",
                &[&name, &topics, &start],
            )
            .await
        {
            Ok(_) => {
                tracing::info!(subscription = name, start, "created subscription");
                Ok(true)
            }
            Err(e) if e.code() == Some(&SqlState::DUPLICATE_OBJECT) => Ok(true),
            Err(e) if e.code() == Some(&SqlState::UNDEFINED_FUNCTION) => Ok(false),
            Err(e) => Err(anyhow!("create_subscription('{name}'): {}", pg_error(&e))),
        }
    }

    /// `outbox.claim(...)`: up to `batch` events, leased for `lease`.
    pub async fn claim(
        &self,
        worker: &str,
        batch: i32,
        lease: Duration,
        topics: Option<&[String]>,
        subscription: Option<&str>,
    ) -> Result<Vec<Event>> {
        let c = self.client().await?;
        let lease = interval_text(lease);
        let topics: Option<Vec<String>> = topics.map(<[String]>::to_vec);
        let rows = match subscription {
            Some(sub) => {
                c.query(
                    "SELECT id, topic, subject, dispatch_key, payload::text, headers::text, attempt, lease_token \
                     FROM outbox.claim($1::text, $2::int, $3::text::interval, $4::text[], $5::text)",
                    &[&worker, &batch, &lease, &topics, &sub],
                )
                .await
            }
            None => {
                c.query(
                    "SELECT id, topic, subject, dispatch_key, payload::text, headers::text, attempt, lease_token \
                     FROM outbox.claim($1::text, $2::int, $3::text::interval, $4::text[])",
                    &[&worker, &batch, &lease, &topics],
                )
                .await
            }
        }
        .map_err(|e| anyhow!("claim: {}", pg_error(&e)))?;
        let mut events = Vec::with_capacity(rows.len());
        for row in rows {
            let headers: Option<String> = row.get(5);
            events.push(Event {
                id: row.get(0),
                topic: row.get(1),
                subject: row.get(2),
                dispatch_key: row.get(3),
                payload: row.get::<_, Option<String>>(4).unwrap_or_else(|| "null".to_string()),
                headers: headers.as_deref().map(parse_headers).unwrap_or_default(),
                attempt: row.get(6),
                lease_token: row.get(7),
            });
        }
        Ok(events)
    }

    /// Batch `outbox.ack(ids[], tokens[])`: how many were still held by these tokens.
    pub async fn ack_many(&self, ids: &[i64], tokens: &[Uuid]) -> Result<i32> {
        let c = self.client().await?;
        let row = c
            .query_one("SELECT outbox.ack($1::bigint[], $2::uuid[])", &[&ids, &tokens])
            .await
            .map_err(|e| anyhow!("ack: {}", pg_error(&e)))?;
        Ok(row.get::<_, Option<i32>>(0).unwrap_or(0))
    }

    /// `outbox.fail(...)`: the event's new state (`pending`, `dead` or `stale`).
    pub async fn fail(
        &self,
        id: i64,
        token: Uuid,
        error: &str,
        retry_in: Option<Duration>,
        permanent: bool,
    ) -> Result<String> {
        let c = self.client().await?;
        let retry_in = retry_in.map(interval_text);
        let row = c
            .query_one(
                "SELECT outbox.fail($1::bigint, $2::uuid, $3::text, $4::text::interval, $5::boolean)",
                &[&id, &token, &error, &retry_in, &permanent],
            )
            .await
            .map_err(|e| anyhow!("fail: {}", pg_error(&e)))?;
        Ok(row.get::<_, Option<String>>(0).unwrap_or_else(|| "stale".to_string()))
    }

    /// `outbox.extend_lease(...)`: true while we still hold the lease.
    pub async fn extend_lease(&self, id: i64, token: Uuid, lease: Duration) -> Result<bool> {
        let c = self.client().await?;
        let lease = interval_text(lease);
        let row = c
            .query_one(
                "SELECT outbox.extend_lease($1::bigint, $2::uuid, $3::text::interval) IS NOT NULL",
                &[&id, &token, &lease],
            )
            .await
            .map_err(|e| anyhow!("extend_lease: {}", pg_error(&e)))?;
        Ok(row.get(0))
    }

    /// `outbox.pause_subscription(name)`.
    pub async fn pause_subscription(&self, name: &str) -> Result<bool> {
        let c = self.client().await?;
        let changed: Option<bool> = c
            .query_one("SELECT outbox.pause_subscription($1::text)", &[&name])
            .await
            .map_err(|e| anyhow!("pause_subscription: {}", pg_error(&e)))?
            .get(0);
        Ok(changed == Some(true))
    }

    /// The subscription's `(lag_events, lag seconds, paused)` from `outbox.subscriptions`.
    pub async fn subscription_status(&self, name: &str) -> Result<Option<(i64, f64, bool)>> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                "SELECT coalesce(lag_events, 0)::bigint, coalesce(extract(epoch FROM lag), 0)::float8, \
                 coalesce(paused, false) FROM outbox.subscriptions WHERE name = $1::text",
                &[&name],
            )
            .await
            .map_err(|e| anyhow!("subscriptions: {}", pg_error(&e)))?;
        Ok(row.map(|r| (r.get(0), r.get(1), r.get(2))))
    }
}

/// A failed connection attempt. `from_server` is true when the server answered with an error
/// (authentication, unknown database): retrying will not help.
#[derive(Debug)]
pub struct ConnectError {
    /// The error on one line.
    pub message: String,
    /// The server refused us (as opposed to: could not reach it).
    pub from_server: bool,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot connect to PostgreSQL: {}", self.message)
    }
}

impl std::error::Error for ConnectError {}

/// An interval literal PostgreSQL accepts, in microseconds.
fn interval_text(d: Duration) -> String {
    format!("{} microseconds", d.as_micros())
}

/// Keeps the string-valued members of a headers object, in key order.
fn parse_headers(text: &str) -> Vec<(String, String)> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => {
            map.into_iter().filter_map(|(k, v)| v.as_str().map(|s| (k, s.to_string()))).collect()
        }
        _ => Vec::new(),
    }
}

/// One line for a driver error: the server's message and SQLSTATE when there is one.
pub fn pg_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => {
            let mut s = e.to_string();
            let mut src = std::error::Error::source(e);
            while let Some(inner) = src {
                s.push_str(": ");
                s.push_str(&inner.to_string());
                src = inner.source();
            }
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_value_dsn_tls_options_are_split() {
        let (dsn, mode, root) =
            split_tls_options("host=db port=5432 sslmode=verify-full sslrootcert=/etc/ca.pem password='a b\\'c'")
                .unwrap();
        assert_eq!(mode, TlsMode::VerifyFull);
        assert_eq!(root.as_deref(), Some("/etc/ca.pem"));
        assert_eq!(dsn, "host='db' port='5432' sslmode=require password='a b\\'c'");
        assert!(tokio_postgres::Config::from_str(&dsn).is_ok());
    }

    #[test]
    fn url_dsn_tls_options_are_split() {
        let (dsn, mode, root) =
            split_tls_options("postgresql://u@h/db?sslmode=verify-ca&sslrootcert=%2Ftmp%2Fca.pem&x=1").unwrap();
        assert_eq!(mode, TlsMode::VerifyCa);
        assert_eq!(root.as_deref(), Some("/tmp/ca.pem"));
        assert_eq!(dsn, "postgresql://u@h/db?sslmode=require&x=1");
    }

    #[test]
    fn malformed_dsn_is_an_error() {
        assert!(split_tls_options("host").is_err());
        assert!(split_tls_options("password='x").is_err());
    }

    #[test]
    fn headers_keep_strings_only() {
        assert_eq!(parse_headers(r#"{"a":"1","b":2}"#), vec![("a".to_string(), "1".to_string())]);
        assert!(parse_headers("null").is_empty());
    }
}
