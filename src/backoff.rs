//! Retry delays: capped exponential backoff with equal jitter.
//!
//! delay(attempt) = min(max, base * 2^(attempt-1)); with jitter the result is drawn
//! uniformly from [delay/2, delay]. Equal jitter (rather than full jitter) keeps a
//! floor, so a retry is never immediate, while still spreading a thundering herd of
//! failures (River and Oban use the same shape).
//!
//! All arithmetic is in i64 microseconds with saturation: no attempt count can
//! overflow, go negative or yield zero.

use std::cell::Cell;

/// Largest base or cap accepted anywhere: 365 days in microseconds.
pub const MAX_BACKOFF_US: i64 = 365 * 86_400 * 1_000_000;

/// Un-jittered delay in microseconds for a 1-based attempt.
///
/// `base_us` and `max_us` must be > 0 (callers validate). Attempts below 1 are
/// treated as 1. The result is `min(max_us, base_us << (attempt-1))`, at least 1 µs.
pub fn raw_delay_us(attempt: i32, base_us: i64, max_us: i64) -> i64 {
    let base = base_us.max(1);
    let cap = max_us.max(1);
    let shift = (attempt.max(1) - 1) as u32;
    // base < 2^45 (365 days in µs), so any shift above 62 is beyond every cap.
    let d = if shift >= 62 { i64::MAX } else { base.checked_mul(1i64 << shift).unwrap_or(i64::MAX) };
    d.min(cap).max(1)
}

/// Jittered delay in microseconds: uniform in `[d/2, d]` where `d = raw_delay_us(..)`,
/// never below 1 µs. `unit` is a random number in `[0, 1)`.
pub fn jittered_delay_us(attempt: i32, base_us: i64, max_us: i64, unit: f64) -> i64 {
    let d = raw_delay_us(attempt, base_us, max_us);
    let half = d / 2;
    let spread = d - half;
    let u = if unit.is_finite() { unit.clamp(0.0, 1.0) } else { 0.0 };
    (half + (spread as f64 * u) as i64).clamp(1, d)
}

thread_local! {
    static RNG: Cell<u64> = const { Cell::new(0) };
}

/// A random number in [0, 1) from a per-backend xorshift generator. Jitter needs
/// spread, not cryptographic quality, and must not touch PostgreSQL's own PRNG
/// state (setseed() users would otherwise see different sequences).
pub fn unit_random() -> f64 {
    RNG.with(|s| {
        let mut x = s.get();
        if x == 0 {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1);
            x = t ^ ((std::process::id() as u64) << 32) ^ 0x9E37_79B9_7F4A_7C15;
            if x == 0 {
                x = 1;
            }
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        (x >> 11) as f64 / (1u64 << 53) as f64
    })
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use pgrx::prelude::*;

    #[pg_test]
    fn doubles_then_caps() {
        let base = 1_000_000;
        let cap = 1_800_000_000;
        assert_eq!(raw_delay_us(1, base, cap), 1_000_000);
        assert_eq!(raw_delay_us(2, base, cap), 2_000_000);
        assert_eq!(raw_delay_us(5, base, cap), 16_000_000);
        assert_eq!(raw_delay_us(12, base, cap), cap);
        assert_eq!(raw_delay_us(1000, base, cap), cap);
    }

    #[pg_test]
    fn never_overflows_zero_or_negative() {
        for attempt in [i32::MIN, -1, 0, 1, 2, 30, 62, 63, 64, 100, i32::MAX] {
            for (base, cap) in [(1, 1), (1, MAX_BACKOFF_US), (MAX_BACKOFF_US, MAX_BACKOFF_US), (1000, 10)] {
                let d = raw_delay_us(attempt, base, cap);
                assert!(d >= 1 && d <= cap.max(1), "attempt {attempt} base {base} cap {cap} -> {d}");
                for u in [0.0, 0.5, 0.999_999, 1.0, f64::NAN] {
                    let j = jittered_delay_us(attempt, base, cap, u);
                    assert!(j >= 1 && j <= d, "jitter {j} outside [1, {d}]");
                    assert!(j >= d / 2, "jitter {j} below half of {d}");
                }
            }
        }
    }

    #[pg_test]
    fn jitter_spreads() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..100 {
            seen.insert(jittered_delay_us(10, 1_000_000, i64::MAX, unit_random()));
        }
        assert!(seen.len() > 50, "jitter produced only {} distinct delays", seen.len());
    }
}
