//! The HTML templates (minijinja) and static assets, compiled into the binary: the dashboard needs
//! no files and no network at run time.
//!
//! Every template name ends in `.html`, which turns minijinja's auto-escaping on for all of them:
//! payloads, headers, errors, topics and subjects are user data and are always escaped. Only
//! values made with [`Value::from_safe_string`] (the server-drawn sparklines) pass unescaped.

use anyhow::{Context as _, Result};
use minijinja::value::Value;
use minijinja::Environment;

/// The templates, by name.
const TEMPLATES: &[(&str, &str)] = &[
    ("base.html", include_str!("templates/base.html")),
    ("overview.html", include_str!("templates/overview.html")),
    ("dead.html", include_str!("templates/dead.html")),
    ("event.html", include_str!("templates/event.html")),
    ("subjects.html", include_str!("templates/subjects.html")),
    ("health.html", include_str!("templates/health.html")),
    ("error.html", include_str!("templates/error.html")),
    ("macros.html", include_str!("templates/macros.html")),
];

/// The static assets: (name, content type, body).
pub const ASSETS: &[(&str, &str, &str)] = &[
    ("app.css", "text/css; charset=utf-8", include_str!("assets/app.css")),
    ("app.js", "text/javascript; charset=utf-8", include_str!("assets/app.js")),
];

/// The compiled template environment.
pub struct Templates {
    env: Environment<'static>,
}

impl Templates {
    /// Compiles every template (a syntax error is a startup failure, not a page failure).
    pub fn new() -> Result<Self> {
        let mut env = Environment::new();
        for (name, source) in TEMPLATES {
            env.add_template(name, source).with_context(|| format!("template {name}"))?;
        }
        env.add_filter("age", age);
        env.add_filter("ts", ts);
        env.add_filter("num", num);
        env.add_filter("urlencode", |v: Value| super::pages::url_encode(v.as_str().unwrap_or_default()));
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Lenient);
        Ok(Templates { env })
    }

    /// Renders `name` with `ctx`.
    pub fn render(&self, name: &str, ctx: Value) -> Result<String, minijinja::Error> {
        self.env.get_template(name)?.render(ctx)
    }
}

/// Seconds as a short duration (`42s`, `3m 05s`, `2h 10m`, `3d 4h`); empty for none.
pub fn age(v: Value) -> String {
    let Some(secs) = f64::try_from(v.clone()).ok().or_else(|| v.as_str().and_then(|s| s.parse().ok())) else {
        return String::new();
    };
    if !secs.is_finite() || secs < 0.0 {
        return String::new();
    }
    let s = secs.round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {:02}s", s / 60, s % 60),
        3600..=86399 => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86400, (s % 86400) / 3600),
    }
}

/// A timestamp as PostgreSQL's JSON renders it, shortened to whole seconds
/// (`2026-01-31T12:00:00.123+00:00` -> `2026-01-31 12:00:00+00:00`); empty for none.
pub fn ts(v: Value) -> String {
    match v.as_str() {
        Some(s) => crate::cli::output::cell(&serde_json::Value::String(s.to_string())),
        None if v.is_none() || v.is_undefined() => String::new(),
        None => v.to_string(),
    }
}

/// An integer with thin-space thousands separators (`50 000`); other values as they are.
pub fn num(v: Value) -> String {
    match i64::try_from(v.clone()) {
        Ok(n) => {
            let digits = n.unsigned_abs().to_string();
            let mut out = String::new();
            for (i, c) in digits.chars().enumerate() {
                if i > 0 && (digits.len() - i) % 3 == 0 {
                    out.push('\u{202f}');
                }
                out.push(c);
            }
            if n < 0 {
                format!("-{out}")
            } else {
                out
            }
        }
        Err(_) if v.is_none() || v.is_undefined() => String::new(),
        Err(_) => v.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::context;

    #[test]
    fn templates_compile() {
        Templates::new().unwrap();
    }

    #[test]
    fn user_data_is_escaped() {
        let t = Templates::new().unwrap();
        let html = t
            .render(
                "error.html",
                context! { status => 404, title => "Not found", message => "<script>alert(1)</script>", actions => false },
            )
            .unwrap();
        assert!(!html.contains("<script>alert"), "{html}");
        assert!(html.contains("&lt;script&gt;"), "{html}");
    }

    #[test]
    fn filters() {
        assert_eq!(age(Value::from(5.4)), "5s");
        assert_eq!(age(Value::from(125)), "2m 05s");
        assert_eq!(age(Value::from(7260)), "2h 01m");
        assert_eq!(age(Value::from(90000)), "1d 1h");
        assert_eq!(age(Value::from(())), "");
        assert_eq!(num(Value::from(50000)), "50\u{202f}000");
        assert_eq!(num(Value::from(-1234)), "-1\u{202f}234");
        assert_eq!(num(Value::from(12)), "12");
        assert_eq!(ts(Value::from("2026-01-31T12:00:00.123+00:00")), "2026-01-31 12:00:00+00:00");
    }
}
