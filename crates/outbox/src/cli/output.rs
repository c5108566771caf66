//! Rendering: tables (comfy-table) for people, JSON for programs.
//!
//! Rows come from [`super::json_rows`] as JSON objects, so both forms show the same values: the
//! table renders the chosen columns as text, `--json` prints the objects as they are.

use comfy_table::{presets, ContentArrangement, Table};
use serde_json::{Map, Value};

/// One column of a table: its heading and the key of the row object it shows.
pub type Column<'a> = (&'a str, &'a str);

/// A value as table text: strings bare, NULL empty, intervals and timestamps shortened to whole
/// seconds, arrays comma separated, objects as compact JSON.
pub fn cell(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => shorten_time(s),
        Value::Array(items) => items.iter().map(cell).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

/// Drops the fractional seconds of an interval (`00:01:02.345678` -> `00:01:02`) or a timestamp
/// (`2026-01-31T12:00:00.123+00:00` -> `2026-01-31 12:00:00+00:00`). Other text is unchanged.
fn shorten_time(s: &str) -> String {
    let looks_like_time = s.len() >= 8 && s.contains(':') && s.chars().next().is_some_and(|c| c.is_ascii_digit());
    if !looks_like_time {
        return s.to_string();
    }
    let s = if s.len() > 19 && s.as_bytes()[10] == b'T' { format!("{} {}", &s[..10], &s[11..]) } else { s.to_string() };
    match s.find('.') {
        Some(dot) if s[..dot].ends_with(|c: char| c.is_ascii_digit()) && s[..dot].contains(':') => {
            let rest = &s[dot + 1..];
            let frac_end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
            format!("{}{}", &s[..dot], &rest[frac_end..])
        }
        _ => s,
    }
}

/// Shortens long text for a table cell (the full value is in `--json` and `events show`).
pub fn truncate(s: &str, max: usize) -> String {
    let one_line = s.replace(['\n', '\r'], " ");
    if one_line.chars().count() <= max {
        one_line
    } else {
        let mut out: String = one_line.chars().take(max.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

/// An empty table with the house style and the given headings.
pub fn table(headers: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_style(presets::UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    t.set_header(headers.iter().map(|h| h.to_string()).collect::<Vec<_>>());
    t
}

/// A table of rows with the given columns (long text cells truncated to `max_cell` characters).
pub fn rows_table(rows: &[Map<String, Value>], columns: &[Column<'_>], max_cell: usize) -> Table {
    let mut t = table(&columns.iter().map(|c| c.0).collect::<Vec<_>>());
    for row in rows {
        t.add_row(columns.iter().map(|(_, key)| truncate(&cell(row.get(*key).unwrap_or(&Value::Null)), max_cell)));
    }
    t
}

/// Prints a JSON value, pretty, on stdout.
pub fn print_json(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string()));
}

/// Prints rows: a JSON array with `--json`, else a table (or `empty` when there is none).
pub fn print_rows(json: bool, rows: &[Map<String, Value>], columns: &[Column<'_>], empty: &str) {
    if json {
        print_json(&Value::Array(rows.iter().cloned().map(Value::Object).collect()));
    } else if rows.is_empty() {
        println!("{empty}");
    } else {
        println!("{}", rows_table(rows, columns, 60));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_lose_their_fraction() {
        assert_eq!(shorten_time("00:01:02.345678"), "00:01:02");
        assert_eq!(shorten_time("2026-01-31T12:00:00.123+00:00"), "2026-01-31 12:00:00+00:00");
        assert_eq!(shorten_time("2026-01-31 12:00:00+00"), "2026-01-31 12:00:00+00");
        assert_eq!(shorten_time("1 day 02:00:00.5"), "1 day 02:00:00");
        assert_eq!(shorten_time("cli.dead"), "cli.dead");
        assert_eq!(shorten_time("HTTP 400: x.y"), "HTTP 400: x.y");
    }

    #[test]
    fn cells_render_json() {
        assert_eq!(cell(&Value::Null), "");
        assert_eq!(cell(&serde_json::json!(["a.*", "b"])), "a.*,b");
        assert_eq!(cell(&serde_json::json!(3)), "3");
        assert_eq!(truncate("abcdef", 4), "abc…");
    }
}
