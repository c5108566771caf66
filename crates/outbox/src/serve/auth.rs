//! Who may see and who may change: optional HTTP basic auth in front of everything, and the checks
//! every POST passes (actions enabled, same origin, CSRF token, action token).
//!
//! Invariants:
//! - With credentials configured, no route answers without them (the layer wraps the whole
//!   router, fallback and assets included).
//! - A POST changes nothing unless [`check_post`] passed: `--allow-actions` given, the request is
//!   not cross-site by `Sec-Fetch-Site` or `Origin`, the form's CSRF token is this process's, and
//!   the action token matches `OUTBOX_DASHBOARD_TOKEN`. The CSRF token alone is not enough
//!   because any reader of a page has it; the action token alone is not enough because a browser
//!   may have it saved in a form another site could submit.
//! - On a loopback listener, a request whose `Host` is not a loopback name is refused (421), so a
//!   page elsewhere cannot read the dashboard through DNS rebinding.
//! - Secrets are compared in constant time.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use subtle::ConstantTimeEq as _;

use super::queries::Failure;
use super::Shared;

/// Basic-auth user and password (`OUTBOX_DASHBOARD_USER`, `OUTBOX_DASHBOARD_PASSWORD`).
#[derive(Clone)]
pub struct BasicCredentials {
    /// The user name.
    pub user: String,
    /// The password.
    pub password: String,
}

impl std::fmt::Debug for BasicCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BasicCredentials({}, ***)", self.user)
    }
}

/// Constant-time equality of two secrets (lengths may leak, contents do not).
pub fn secret_eq(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

/// 32 random bytes from the operating system, hex-encoded.
pub fn random_token() -> anyhow::Result<String> {
    let mut buf = [0u8; 32];
    getrandom::getrandom(&mut buf).map_err(|e| anyhow::anyhow!("cannot read random bytes for the CSRF token: {e}"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// True when the `Authorization` header carries these credentials.
fn basic_ok(headers: &HeaderMap, creds: &BasicCredentials) -> bool {
    let Some(value) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some(encoded) = value.strip_prefix("Basic ").or_else(|| value.strip_prefix("basic ")) else {
        return false;
    };
    let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded.trim()) else {
        return false;
    };
    let Ok(text) = String::from_utf8(decoded) else {
        return false;
    };
    let Some((user, password)) = text.split_once(':') else {
        return false;
    };
    // Both compared, always, so the time taken does not tell which half was wrong.
    let u = secret_eq(user, &creds.user);
    let p = secret_eq(password, &creds.password);
    u & p
}

/// Middleware: basic auth on every request when credentials are configured.
pub async fn basic_auth(State(state): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(creds) = &state.basic {
        if !basic_ok(req.headers(), creds) {
            return (
                StatusCode::UNAUTHORIZED,
                [
                    (header::WWW_AUTHENTICATE, "Basic realm=\"outbox dashboard\", charset=\"UTF-8\""),
                    (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
                ],
                "authentication required\n",
            )
                .into_response();
        }
    }
    next.run(req).await
}

/// True when a `Host` header value names a loopback address (`127.0.0.1:8080`, `localhost`,
/// `[::1]:8080`).
fn loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(h, port)| if port.chars().all(|c| c.is_ascii_digit()) { h } else { host })
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Middleware: on a loopback listener, only requests addressed to a loopback name are served.
/// A web page elsewhere can point its own host name at 127.0.0.1 (DNS rebinding) and then read
/// this server as if it were same-origin; the `Host` header it sends still carries its name.
pub async fn loopback_host_check(State(state): State<Shared>, req: Request, next: Next) -> Response {
    if state.loopback {
        let host = req.headers().get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
        if !loopback_host(host) && state.public_host.as_deref() != Some(host) {
            return (
                StatusCode::MISDIRECTED_REQUEST,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                "this dashboard listens on loopback and answers only to a loopback host name\n",
            )
                .into_response();
        }
    }
    next.run(req).await
}

/// Middleware: headers that confine what a page may load and who may frame it. Scripts and
/// styles come from this server only, never inline, so markup that escaped escaping still could
/// not run.
pub async fn security_headers(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // Not `no-referrer`: under it browsers send `Origin: null` with form POSTs, and the same-origin
    // check of [`check_post`] needs the real origin.
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    res
}

/// The fields every action form posts.
#[derive(Debug, Default, serde::Deserialize)]
pub struct ActionForm {
    /// The per-process CSRF token the page embedded.
    #[serde(default)]
    pub csrf: String,
    /// The action token the operator typed (or `X-Outbox-Token`).
    #[serde(default)]
    pub token: String,
    /// The subscription to act in (empty: `default`).
    #[serde(default)]
    pub subscription: String,
    /// Where to go afterwards (a path of this server).
    #[serde(default)]
    pub back: String,
}

/// The origin of a request as `host[:port]`, from an `Origin` header value (or `--public-origin`).
pub fn origin_host(origin: &str) -> Option<&str> {
    let rest = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://"))?;
    Some(rest.trim_end_matches('/'))
}

/// Every check a POST passes before it may change anything (see the module invariants).
pub fn check_post(state: &Shared, headers: &HeaderMap, form: &ActionForm) -> Result<(), Failure> {
    let Some(expected) = state.action_token.as_deref() else {
        return Err(Failure::forbidden("actions are disabled: start outbox serve with --allow-actions"));
    };
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        if site != "same-origin" && site != "none" {
            return Err(Failure::forbidden(format!("cross-site request refused (Sec-Fetch-Site: {site})")));
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
        // Behind a reverse proxy the browser's origin is the public one (--public-origin), whatever
        // Host the proxy forwards.
        let same = origin
            .to_str()
            .ok()
            .and_then(origin_host)
            .is_some_and(|o| (!host.is_empty() && o == host) || state.public_host.as_deref() == Some(o));
        if !same {
            return Err(Failure::forbidden("cross-origin request refused (Origin does not match Host)"));
        }
    }
    if form.csrf.is_empty() || !secret_eq(&form.csrf, &state.csrf) {
        return Err(Failure::forbidden("missing or stale CSRF token: reload the page and try again"));
    }
    let header_token = headers.get("x-outbox-token").and_then(|v| v.to_str().ok()).unwrap_or("");
    let given = if form.token.is_empty() { header_token } else { form.token.as_str() };
    if given.is_empty() {
        return Err(Failure::forbidden("this action needs the action token (OUTBOX_DASHBOARD_TOKEN)"));
    }
    if !secret_eq(given, expected) {
        return Err(Failure::forbidden("wrong action token"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_auth_header_is_checked() {
        let creds = BasicCredentials { user: "ops".into(), password: "s3cret:x".into() };
        let good = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode("ops:s3cret:x"));
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(&good).unwrap());
        assert!(basic_ok(&h, &creds));
        let bad = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode("ops:nope"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(&bad).unwrap());
        assert!(!basic_ok(&h, &creds));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic !!!"));
        assert!(!basic_ok(&h, &creds));
        assert!(!basic_ok(&HeaderMap::new(), &creds));
    }

    #[test]
    fn random_tokens_differ() {
        let a = random_token().unwrap();
        assert_eq!(a.len(), 64);
        assert_ne!(a, random_token().unwrap());
    }

    #[test]
    fn origins() {
        assert_eq!(origin_host("http://127.0.0.1:8080"), Some("127.0.0.1:8080"));
        assert_eq!(origin_host("null"), None);
    }

    #[test]
    fn loopback_hosts() {
        for h in ["127.0.0.1:8080", "127.0.0.1", "localhost:1", "LOCALHOST", "[::1]:8080", "127.3.4.5:9"] {
            assert!(loopback_host(h), "{h}");
        }
        for h in ["evil.example:8080", "10.0.0.1:8080", "", "[::2]:80", "localhost.evil.example"] {
            assert!(!loopback_host(h), "{h}");
        }
    }

    #[test]
    fn secrets_compare_exactly() {
        assert!(secret_eq("abc", "abc"));
        assert!(!secret_eq("abc", "abd"));
        assert!(!secret_eq("abc", "abcd"));
    }
}
