//! `outbox serve`: a web dashboard over the extension's SQL API (server-rendered HTML, a few JSON
//! endpoints the pages poll, sparklines drawn on the server).
//!
//! Security invariants (each enforced in one place, named here so a change can be checked
//! against them):
//! - **Read-only unless `--allow-actions`.** Without the flag no page shows a button, the POST
//!   routes answer 403, and every database session runs with `default_transaction_read_only = on`
//!   ([`db::Pool`]), so even a bug in a handler cannot change the outbox.
//! - **Every POST carries the action token and a CSRF proof** ([`auth::check_post`]): the token from
//!   `OUTBOX_DASHBOARD_TOKEN` (required for `--allow-actions`; the server refuses to start without
//!   it), the per-process random CSRF token embedded in the page's form, and a same-origin
//!   `Origin`/`Sec-Fetch-Site` when the browser sends them. All comparisons are constant-time.
//! - **Optional basic auth on everything** (pages, API, assets) when `OUTBOX_DASHBOARD_USER` and
//!   `OUTBOX_DASHBOARD_PASSWORD` are set ([`auth::basic_auth`]).
//! - **Loopback by default**: `--listen` defaults to `127.0.0.1:8080`; another address is the
//!   operator's explicit choice (and is logged as a warning when basic auth is off). On loopback,
//!   requests for another host name are refused ([`auth::loopback_host_check`], DNS rebinding).
//! - **Everything user-supplied is escaped**: templates auto-escape HTML ([`templates`]); only the
//!   SVG that [`charts`] draws from numbers is inserted unescaped. Responses carry a strict
//!   Content-Security-Policy (scripts and styles from this server only; no inline script).
//! - **Only the SQL API**, with explicit column lists: a role with `outbox_monitor` sees counts,
//!   states and errors, and pages say "payload hidden" where PostgreSQL refuses payload columns
//!   (SQLSTATE 42501) instead of failing.
//! - **Bad input is a 400/404 page**, never a panic: handlers take raw strings and validate them
//!   ([`pages`], [`api`]).

pub mod api;
pub mod auth;
pub mod charts;
pub mod db;
pub mod pages;
pub mod queries;
pub mod templates;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context as _, Result};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;

use crate::cli::Common;

/// Arguments of `outbox serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on (loopback unless you say otherwise).
    #[arg(long, env = "OUTBOX_DASHBOARD_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    /// Show replay and cancel buttons, and accept their POSTs (needs OUTBOX_DASHBOARD_TOKEN).
    #[arg(long)]
    allow_actions: bool,
    /// The origin browsers use behind a reverse proxy, e.g. https://outbox.example.com: its host is
    /// served on a loopback listener and its Origin accepted on actions.
    #[arg(long, env = "OUTBOX_DASHBOARD_ORIGIN")]
    public_origin: Option<String>,
    /// The top-level global `--dsn` (or `OUTBOX_DSN`), handed over by `main` after parsing; without
    /// it libpq's PG* variables are used.
    #[arg(skip)]
    pub dsn: Option<String>,
    /// Refused (a usage error, see `main.rs`): this command prints no data.
    #[arg(long, hide = true)]
    pub json: bool,
    /// Database connections kept open (queries of concurrent requests run in parallel).
    #[arg(long, default_value = "4")]
    pool_size: String,
    /// Longest a dashboard query may run (PostgreSQL statement_timeout), e.g. 30s.
    #[arg(long, default_value = "30s")]
    statement_timeout: String,
}

/// Everything the handlers share.
pub struct AppState {
    /// The database connections.
    pub pool: db::Pool,
    /// The compiled templates.
    pub templates: templates::Templates,
    /// The action token; `Some` only with `--allow-actions`.
    pub action_token: Option<String>,
    /// Basic-auth credentials, when configured.
    pub basic: Option<auth::BasicCredentials>,
    /// The per-process CSRF token embedded in every action form.
    pub csrf: String,
    /// True when listening on a loopback address (then only loopback `Host` names are served).
    pub loopback: bool,
    /// `host[:port]` of `--public-origin`: served on loopback, and accepted as an action's Origin.
    pub public_host: Option<String>,
    /// The longest a request may take: `--statement-timeout` and a margin. PostgreSQL enforces the
    /// statement timeout only while it answers; a stalled server or network would otherwise hold a
    /// request (and the session it waits on) for ever.
    pub deadline: Duration,
}

impl AppState {
    /// True when replay and cancel are enabled.
    pub fn actions(&self) -> bool {
        self.action_token.is_some()
    }
}

/// Shared state handle.
pub type Shared = Arc<AppState>;

/// The validated configuration of a `serve` run (flags and environment), before any I/O.
#[derive(Debug)]
struct Settings {
    listen: SocketAddr,
    action_token: Option<String>,
    basic: Option<auth::BasicCredentials>,
    pool_size: usize,
    statement_timeout: Duration,
    public_host: Option<String>,
}

/// The shortest action token accepted: a guessable token would make `--allow-actions` an open door.
const MIN_TOKEN_LEN: usize = 16;

/// Validates the flags and the `OUTBOX_DASHBOARD_*` variables (`env` reads one), each failure
/// being one line.
fn settings(args: &ServeArgs, env: impl Fn(&str) -> Option<String>) -> Result<Settings> {
    let listen: SocketAddr =
        args.listen.trim().parse().map_err(|_| {
            anyhow!("bad --listen '{}': expected an IP address and port, e.g. 127.0.0.1:8080", args.listen)
        })?;
    let pool_size: usize = match args.pool_size.trim().parse() {
        Ok(n) if (1..=64).contains(&n) => n,
        _ => return Err(anyhow!("bad --pool-size '{}': expected a number from 1 to 64", args.pool_size)),
    };
    let statement_timeout = humantime::parse_duration(args.statement_timeout.trim())
        .ok()
        // PostgreSQL's statement_timeout is an int of milliseconds: a longer one would be accepted
        // here and then refused by every session.
        .filter(|d| *d >= Duration::from_millis(100) && d.as_millis() <= i32::MAX as u128)
        .ok_or_else(|| {
            anyhow!(
                "bad --statement-timeout '{}': expected a duration from 100ms to 24days, e.g. 30s",
                args.statement_timeout
            )
        })?;
    let token = env("OUTBOX_DASHBOARD_TOKEN").filter(|t| !t.is_empty());
    let action_token = if args.allow_actions {
        match token {
            None => {
                return Err(anyhow!(
                    "--allow-actions needs OUTBOX_DASHBOARD_TOKEN (the token every replay or cancel must carry)"
                ))
            }
            Some(t) if t.chars().count() < MIN_TOKEN_LEN => {
                return Err(anyhow!("OUTBOX_DASHBOARD_TOKEN is too short: use at least {MIN_TOKEN_LEN} characters"))
            }
            Some(t) => Some(t),
        }
    } else {
        None
    };
    let user = env("OUTBOX_DASHBOARD_USER").filter(|u| !u.is_empty());
    let password = env("OUTBOX_DASHBOARD_PASSWORD").filter(|p| !p.is_empty());
    let basic = match (user, password) {
        (Some(user), Some(password)) => {
            if user.contains(':') {
                return Err(anyhow!("OUTBOX_DASHBOARD_USER must not contain ':' (basic auth separates on it)"));
            }
            Some(auth::BasicCredentials { user, password })
        }
        (None, None) => None,
        _ => {
            return Err(anyhow!(
                "set both OUTBOX_DASHBOARD_USER and OUTBOX_DASHBOARD_PASSWORD for basic auth, or neither"
            ))
        }
    };
    let public_host = match args.public_origin.as_deref().map(str::trim).filter(|o| !o.is_empty()) {
        None => None,
        Some(o) => match auth::origin_host(o) {
            Some(h) if !h.is_empty() && !h.contains(['/', '?', '#', ' ']) => Some(h.to_string()),
            _ => {
                return Err(anyhow!(
                    "bad --public-origin '{o}': expected a scheme and host, e.g. https://outbox.example.com"
                ))
            }
        },
    };
    Ok(Settings { listen, action_token, basic, pool_size, statement_timeout, public_host })
}

/// Builds the router over the shared state (all routes, the auth layer, the security headers).
pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/", get(pages::overview))
        .route("/dead", get(pages::dead_letters))
        .route("/events", get(pages::event_jump))
        .route("/events/{id}", get(pages::event_detail))
        .route("/events/{id}/replay", post(pages::replay))
        .route("/events/{id}/cancel", post(pages::cancel))
        .route("/subjects", get(pages::subjects))
        .route("/health", get(pages::health))
        .route("/assets/{name}", get(pages::asset))
        .route("/api/stats", get(api::stats))
        .route("/api/health", get(api::health))
        .route("/api/dead", get(api::dead))
        .route("/api/events/{id}", get(api::event))
        .route("/api/subjects/blocked", get(api::blocked))
        .route("/api/throughput", get(api::throughput))
        .fallback(pages::not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), deadline))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth::basic_auth))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth::loopback_host_check))
        // Outermost, so that the 401 and 421 answers of the checks above carry the headers too.
        .layer(axum::middleware::from_fn(auth::security_headers))
        .with_state(state)
}

/// Bounds every request by [`AppState::deadline`]: past it the answer is 504, in JSON under
/// `/api/` as every API error is.
async fn deadline(
    axum::extract::State(state): axum::extract::State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let api = req.uri().path().starts_with("/api/");
    match tokio::time::timeout(state.deadline, next.run(req)).await {
        Ok(res) => res,
        Err(_) => {
            let message = format!("PostgreSQL did not answer within {}s", state.deadline.as_secs());
            let status = axum::http::StatusCode::GATEWAY_TIMEOUT;
            if api {
                (status, axum::Json(serde_json::json!({"error": message, "status": status.as_u16()}))).into_response()
            } else {
                (status, message).into_response()
            }
        }
    }
}

/// Runs `outbox serve` until SIGINT or SIGTERM. Returns the exit status.
pub async fn run(args: ServeArgs) -> Result<i32> {
    let s = settings(&args, |k| std::env::var(k).ok())?;
    let common = Common { dsn: args.dsn.clone(), json: false };
    // Fail at start, in one line, when the DSN is wrong or the extension is missing, rather than
    // on the first page view.
    let probe = crate::cli::conn::connect(&common).await?;
    drop(probe);
    let (mut cfg, tls) = crate::cli::conn::config(&common)?;
    if cfg.get_application_name() == Some("outbox-cli") {
        cfg.application_name("outbox-serve");
    }
    let deadline = s.statement_timeout + Duration::from_secs(5);
    // A connection attempt, or unacknowledged data, to a server that stopped answering gives up
    // instead of holding its pool slot; the request deadline bounds everything else.
    if cfg.get_connect_timeout().is_none() {
        cfg.connect_timeout(deadline.min(Duration::from_secs(10)));
    }
    cfg.tcp_user_timeout(deadline);
    cfg.keepalives_idle(Duration::from_secs(30));
    let pool = db::Pool::new(cfg, tls, s.pool_size, s.statement_timeout, s.action_token.is_none());
    let state = Arc::new(AppState {
        pool,
        templates: templates::Templates::new()?,
        action_token: s.action_token,
        basic: s.basic,
        csrf: auth::random_token()?,
        loopback: s.listen.ip().is_loopback(),
        public_host: s.public_host,
        deadline,
    });
    if !s.listen.ip().is_loopback() && state.basic.is_none() {
        tracing::warn!(
            listen = %s.listen,
            "the dashboard listens beyond loopback without basic auth (set OUTBOX_DASHBOARD_USER and OUTBOX_DASHBOARD_PASSWORD)"
        );
    }
    let listener =
        tokio::net::TcpListener::bind(s.listen).await.with_context(|| format!("cannot listen on {}", s.listen))?;
    let bound = listener.local_addr()?;
    tracing::info!(
        listen = %bound,
        actions = state.actions(),
        basic_auth = state.basic.is_some(),
        "dashboard at http://{bound}/"
    );
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown_signal()).await.context("dashboard server")?;
    Ok(0)
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
    tracing::info!("dashboard stopping");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> ServeArgs {
        #[derive(Debug, clap::Parser)]
        struct T {
            #[command(flatten)]
            a: ServeArgs,
        }
        let mut argv = vec!["t"];
        argv.extend_from_slice(extra);
        <T as clap::Parser>::try_parse_from(argv).expect("parse").a
    }

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn public_origin_is_a_scheme_and_host() {
        let s = settings(&args(&["--public-origin", "https://outbox.example.com/"]), env(&[])).unwrap();
        assert_eq!(s.public_host.as_deref(), Some("outbox.example.com"));
        for bad in ["outbox.example.com", "https://", "https://a.example/path", "ftp://a.example"] {
            let e = settings(&args(&["--public-origin", bad]), env(&[])).unwrap_err().to_string();
            assert!(e.contains("--public-origin") && !e.contains('\n'), "{bad}: {e}");
        }
    }

    #[test]
    fn defaults_are_loopback_and_read_only() {
        let s = settings(&args(&[]), env(&[])).unwrap();
        assert!(s.listen.ip().is_loopback());
        assert!(s.action_token.is_none() && s.basic.is_none());
    }

    #[test]
    fn actions_need_a_long_enough_token() {
        let e = settings(&args(&["--allow-actions"]), env(&[])).unwrap_err().to_string();
        assert!(e.contains("OUTBOX_DASHBOARD_TOKEN") && !e.contains('\n'), "{e}");
        assert!(settings(&args(&["--allow-actions"]), env(&[("OUTBOX_DASHBOARD_TOKEN", "short")])).is_err());
        let s = settings(&args(&["--allow-actions"]), env(&[("OUTBOX_DASHBOARD_TOKEN", "0123456789abcdef")])).unwrap();
        assert_eq!(s.action_token.as_deref(), Some("0123456789abcdef"));
        // The token alone does not enable actions.
        let s = settings(&args(&[]), env(&[("OUTBOX_DASHBOARD_TOKEN", "0123456789abcdef")])).unwrap();
        assert!(s.action_token.is_none());
    }

    #[test]
    fn bad_flags_are_one_line_errors() {
        for a in [
            &["--listen", "nowhere"][..],
            &["--pool-size", "0"][..],
            &["--pool-size", "x"][..],
            &["--statement-timeout", "soon"][..],
        ] {
            let e = settings(&args(a), env(&[])).unwrap_err().to_string();
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn basic_auth_needs_both_halves() {
        assert!(settings(&args(&[]), env(&[("OUTBOX_DASHBOARD_USER", "u")])).is_err());
        assert!(
            settings(&args(&[]), env(&[("OUTBOX_DASHBOARD_USER", "a:b"), ("OUTBOX_DASHBOARD_PASSWORD", "p")])).is_err()
        );
        let s =
            settings(&args(&[]), env(&[("OUTBOX_DASHBOARD_USER", "u"), ("OUTBOX_DASHBOARD_PASSWORD", "p")])).unwrap();
        assert!(s.basic.is_some());
    }
}
