//! Argument checks shared by the API functions. Each failure raises a documented
//! SQLSTATE before any row is touched, so an error never leaves partial effects.

use crate::errors::{self, INVALID_PARAMETER, TOO_LARGE};
use crate::gucs;
use crate::pg::fcall::Value;
use pgrx::prelude::*;

/// Longest topic, worker name or pattern: 255 bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Longest subject or dispatch key: 1024 bytes (they are index keys).
pub const MAX_KEY_LEN: usize = 1024;

/// True when `s` is `segment(.segment)*` with segments of `[a-z0-9_-]+`.
pub fn is_topic(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME_LEN
        && s.split('.').all(|seg| {
            !seg.is_empty()
                && seg.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        })
}

/// Validate a topic name (22023 when malformed).
pub fn topic(s: &str) {
    if !is_topic(s) {
        errors::raise_hint(
            INVALID_PARAMETER,
            format!("invalid topic {:?}", truncate_for_message(s)),
            "A topic is 1 to 255 characters of dot-separated segments of lowercase letters, digits, '_' and '-', e.g. 'billing.invoice.paid'.",
        );
    }
}

/// A claim topic filter element.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopicPattern {
    /// `*`: every topic.
    All,
    /// Exact topic name.
    Exact(String),
    /// `a.b.*`: topics starting with `a.b.` (stored with the trailing dot).
    Prefix(String),
}

/// Parse one claim/replay pattern (22023 when malformed).
pub fn pattern(s: &str) -> TopicPattern {
    if s == "*" {
        return TopicPattern::All;
    }
    if let Some(prefix) = s.strip_suffix(".*") {
        if is_topic(prefix) {
            return TopicPattern::Prefix(format!("{prefix}."));
        }
    } else if is_topic(s) {
        return TopicPattern::Exact(s.to_string());
    }
    errors::raise_hint(
        INVALID_PARAMETER,
        format!("invalid topic pattern {:?}", truncate_for_message(s)),
        "Use an exact topic (a.b.c), a prefix ending in .* (a.b.*), or *.",
    )
}

/// `outbox._pattern_kind(pattern text) -> text`: 'all' for `*`, 'prefix' for
/// `a.b.*`, 'exact' otherwise; 22004 for NULL, 22023 when malformed. The SQL
/// functions (replay_dead, the topic registry) check topics and patterns through
/// this and [`check_topic`], so the grammar has one definition: [`is_topic`].
#[pg_extern(name = "_pattern_kind", immutable, parallel_safe)]
fn pattern_kind(pattern: Option<&str>) -> &'static str {
    let Some(p) = pattern else {
        errors::raise(errors::NULL_VALUE, "topic pattern must not be NULL");
    };
    match self::pattern(p) {
        TopicPattern::All => "all",
        TopicPattern::Prefix(_) => "prefix",
        TopicPattern::Exact(_) => "exact",
    }
}

/// `outbox._check_topic(topic text)`: [`topic`] for the SQL functions; 22004 for NULL.
#[pg_extern(name = "_check_topic", immutable, parallel_safe)]
fn check_topic(topic: Option<&str>) {
    crate::handshake::check();
    let Some(t) = topic else {
        errors::raise(errors::NULL_VALUE, "topic must not be NULL");
    };
    self::topic(t);
}

/// Longest subscription name: 63 bytes (an identifier's length).
pub const MAX_SUBSCRIPTION_LEN: usize = 63;

/// The subscription every claim without a `subscription` argument uses.
pub const DEFAULT_SUBSCRIPTION: &str = "default";

/// True when `s` is 1..63 bytes of `[a-z0-9_.-]` starting with a letter or digit:
/// safe in a NATS subject, a URL path and a metric label without quoting.
pub fn is_subscription(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_SUBSCRIPTION_LEN
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'-' | b'.'))
}

/// Validate a subscription name (22023 when malformed).
pub fn subscription(s: &str) {
    if !is_subscription(s) {
        errors::raise_hint(
            INVALID_PARAMETER,
            format!("invalid subscription name {:?}", truncate_for_message(s)),
            "A subscription name is 1 to 63 characters of lowercase letters, digits, '_', '-' and '.', starting with a letter or digit, e.g. 'search-indexer'.",
        );
    }
}

/// `outbox._check_subscription(name text) -> text`: the name to use, `default`
/// for NULL; 22023 when malformed. The SQL functions resolve their `subscription`
/// argument through this, so the grammar has one definition: [`is_subscription`].
#[pg_extern(name = "_check_subscription", immutable, parallel_safe)]
fn check_subscription(name: Option<&str>) -> String {
    crate::handshake::check();
    match name {
        None => DEFAULT_SUBSCRIPTION.to_string(),
        Some(n) => {
            subscription(n);
            n.to_string()
        }
    }
}

/// Validate a worker name: 1..255 bytes, no control characters.
pub fn worker(s: &str) {
    if s.is_empty() || s.len() > MAX_NAME_LEN || s.chars().any(|c| c.is_control()) {
        errors::raise(INVALID_PARAMETER, "worker must be 1 to 255 bytes with no control characters");
    }
}

/// Validate a subject or dispatch key: 1..1024 bytes.
pub fn key(what: &str, s: &str) {
    if s.is_empty() || s.len() > MAX_KEY_LEN {
        errors::raise(INVALID_PARAMETER, format!("{what} must be 1 to {MAX_KEY_LEN} bytes, got {}", s.len()));
    }
}

/// Validate a batch size against 1..outbox.max_batch_size (22023 below 1, 54000 above).
pub fn batch_size(n: i64) {
    if n < 1 {
        errors::raise(INVALID_PARAMETER, format!("batch_size must be at least 1, got {n}"));
    }
    let max = gucs::max_batch_size() as i64;
    if n > max {
        errors::raise_hint(
            TOO_LARGE,
            format!("batch size {n} exceeds outbox.max_batch_size ({max})"),
            "Claim or publish in smaller batches.",
        );
    }
}

/// Interval to microseconds with 30-day months (PostgreSQL's interval comparison
/// rule). None for PG 17+ infinite intervals.
pub fn interval_us(iv: &Interval) -> Option<i128> {
    let (m, d) = (iv.months(), iv.days());
    if (m == i32::MAX && d == i32::MAX && iv.micros() == i64::MAX)
        || (m == i32::MIN && d == i32::MIN && iv.micros() == i64::MIN)
    {
        return None;
    }
    Some(m as i128 * 30 * 86_400_000_000 + d as i128 * 86_400_000_000 + iv.micros() as i128)
}

/// Validate a lease: > 0 and <= outbox.max_lease. Returns microseconds.
pub fn lease_us(name: &str, iv: &Interval) -> i64 {
    let max = gucs::max_lease_us();
    match interval_us(iv) {
        Some(us) if us > 0 && us <= max as i128 => us as i64,
        Some(us) if us <= 0 => errors::raise(INVALID_PARAMETER, format!("{name} must be positive")),
        _ => errors::raise_hint(
            INVALID_PARAMETER,
            format!("{name} exceeds outbox.max_lease ({} s)", max / 1_000_000),
            "Use a shorter lease and extend it with outbox.extend_lease() while the handler runs.",
        ),
    }
}

/// `outbox.default_lease` as claim() uses it: at most outbox.max_lease, which
/// any session may not raise (SUSET) while it may SET the default (USERSET).
pub fn default_lease_us() -> i64 {
    let (us, max) = (gucs::default_lease_us(), gucs::max_lease_us());
    if us > max {
        errors::raise_hint(
            INVALID_PARAMETER,
            format!("outbox.default_lease ({} s) exceeds outbox.max_lease ({} s)", us / 1_000_000, max / 1_000_000),
            "Set outbox.default_lease to at most outbox.max_lease, or pass claim() a lease.",
        );
    }
    us
}

/// Validate a non-negative delay of at most 365 days. Returns microseconds.
pub fn delay_us(name: &str, iv: &Interval) -> i64 {
    match interval_us(iv) {
        Some(us) if (0..=crate::backoff::MAX_BACKOFF_US as i128).contains(&us) => us as i64,
        Some(us) if us < 0 => errors::raise(INVALID_PARAMETER, format!("{name} must not be negative")),
        _ => errors::raise(INVALID_PARAMETER, format!("{name} must be at most 365 days")),
    }
}

/// Validate a positive delay of at most 365 days (backoff base/cap). Returns µs.
pub fn positive_delay_us(name: &str, iv: &Interval) -> i64 {
    let us = delay_us(name, iv);
    if us == 0 {
        errors::raise(INVALID_PARAMETER, format!("{name} must be positive"));
    }
    us
}

/// Check a jsonb value's size against outbox.max_payload_bytes (54000).
pub fn payload_size(what: &str, d: &Value) {
    // Reads the header only: no detoasting of large values.
    let size = d.raw_size();
    let max = gucs::max_payload_bytes();
    if size > max {
        errors::raise_hint(
            TOO_LARGE,
            format!("{what} is {size} bytes, over outbox.max_payload_bytes ({max})"),
            "Store large data elsewhere and publish a reference to it.",
        );
    }
}

fn truncate_for_message(s: &str) -> String {
    let mut out: String = s.chars().take(64).collect();
    if out.len() < s.len() {
        out.push_str("...");
    }
    out
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;

    #[pg_test]
    fn subscription_grammar() {
        assert!(is_subscription("default"));
        assert!(is_subscription("relay-nats.orders_1"));
        assert!(is_subscription("9lives"));
        assert!(!is_subscription(""));
        assert!(!is_subscription("-x"));
        assert!(!is_subscription(".x"));
        assert!(!is_subscription("Upper"));
        assert!(!is_subscription("a b"));
        assert!(!is_subscription(&"a".repeat(64)));
        assert!(is_subscription(&"a".repeat(63)));
    }

    #[pg_test]
    fn topic_grammar() {
        for ok in ["a", "billing.invoice.paid", "a-b_c.0", "x.y.z.w"] {
            assert!(is_topic(ok), "{ok} should be valid");
        }
        let long = "a".repeat(256);
        for bad in ["", ".a", "a.", "a..b", "A", "a b", "é", "a\0b", "a.*", "*", long.as_str()] {
            assert!(!is_topic(bad), "{bad:?} should be invalid");
        }
        assert!(is_topic(&"a".repeat(255)));
    }

    #[pg_test]
    fn patterns() {
        assert_eq!(pattern("*"), TopicPattern::All);
        assert_eq!(pattern("mail.*"), TopicPattern::Prefix("mail.".into()));
        assert_eq!(pattern("mail.sent"), TopicPattern::Exact("mail.sent".into()));
    }

    #[pg_test(error = "outbox: invalid topic pattern \"mail*\"")]
    fn bad_pattern() {
        pattern("mail*");
    }

    #[pg_test]
    fn interval_math() {
        let iv = Interval::new(1, 2, 3).unwrap();
        assert_eq!(interval_us(&iv), Some(30 * 86_400_000_000 + 2 * 86_400_000_000 + 3));
    }
}

/// Split claim's `topics` argument into exact names and prefixes; None means all.
pub fn topic_filter(topics: Option<Vec<Option<String>>>) -> Option<(Vec<String>, Vec<String>)> {
    let topics = topics?;
    if topics.is_empty() {
        errors::raise(INVALID_PARAMETER, "topics must not be an empty array; pass NULL for all topics");
    }
    let mut exact = Vec::new();
    let mut prefixes = Vec::new();
    let mut all = false;
    // Validate every element before deciding: errors must not depend on order.
    for t in topics {
        let Some(t) = t else {
            errors::raise(errors::NULL_VALUE, "topics must not contain NULL");
        };
        match pattern(&t) {
            TopicPattern::All => all = true,
            TopicPattern::Exact(e) => exact.push(e),
            TopicPattern::Prefix(p) => prefixes.push(p),
        }
    }
    if all {
        None
    } else {
        Some((exact, prefixes))
    }
}

/// `outbox._check_topic_patterns(topics text[]) -> text[]`: a subscription's
/// topic filter as stored: NULL for every topic (NULL, or a list with `*`),
/// else the patterns, checked with claim's grammar ([`pattern`]) and without
/// repeats. 22023 for an empty array or a malformed pattern, 22004 for a NULL
/// element.
#[pg_extern(name = "_check_topic_patterns", immutable, parallel_safe)]
fn check_topic_patterns(topics: Option<Vec<Option<String>>>) -> Option<Vec<String>> {
    let topics = topics?;
    topic_filter(Some(topics.clone()))?;
    let mut out: Vec<String> = topics.into_iter().flatten().collect();
    out.sort_unstable();
    out.dedup();
    Some(out)
}
