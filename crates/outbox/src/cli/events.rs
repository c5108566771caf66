//! `outbox events ls` and `outbox events show ID`.
//!
//! Without `--subscription`, events and their states come from `outbox.events` (the state of the
//! `default` subscription); with it, from `outbox.deliveries` (that subscription's state, attempts
//! and errors), joined to `outbox.events` for the payload, headers and publication time.

use std::collections::HashMap;

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand};
use serde_json::{Map, Value};
use tokio_postgres::Client;

use super::output::{cell, print_json, print_rows, rows_table, table, Column};
use super::{conn, ensure_subscription, json_rows, sql_error, time, topic_match_sql, Common};

/// Arguments of `outbox events`.
#[derive(Debug, Args)]
pub struct EventsArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(subcommand)]
    command: EventsCommand,
}

/// `outbox events` subcommands.
#[derive(Debug, Subcommand)]
enum EventsCommand {
    /// List events, newest first.
    Ls(LsArgs),
    /// Show one event: payload, headers, attempts, the whole error history, and its state in every
    /// subscription.
    Show(ShowArgs),
}

/// Arguments of `outbox events ls`.
#[derive(Debug, Args)]
struct LsArgs {
    /// Only events in this state.
    #[arg(long, value_parser = ["pending", "leased", "delivered", "dead", "cancelled"])]
    state: Option<String>,
    /// Only topics matching this pattern (exact, `prefix.*` or `*`).
    #[arg(long)]
    topic: Option<String>,
    /// Only events of this subject (ordering key).
    #[arg(long)]
    subject: Option<String>,
    /// Only events published at or after this time (a timestamp, or a duration ago: 30m, 2h).
    #[arg(long)]
    since: Option<String>,
    /// Only events published before this time (a timestamp, or a duration ago: 30m, 2h).
    #[arg(long)]
    until: Option<String>,
    /// At most this many events.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    limit: i64,
    /// Only events listed before this id (the next page: pass the last id shown).
    #[arg(long)]
    before: Option<i64>,
    /// States of this subscription (default: `default`, through outbox.events).
    #[arg(long)]
    subscription: Option<String>,
}

/// Arguments of `outbox events show`.
#[derive(Debug, Args)]
struct ShowArgs {
    /// The event id.
    id: i64,
    /// Show the state, attempts and errors of this subscription (default: `default`).
    #[arg(long)]
    subscription: Option<String>,
}

/// Runs `outbox events ...`.
pub async fn run(args: EventsArgs) -> Result<i32> {
    let c = conn::connect(&args.common).await?;
    match args.command {
        EventsCommand::Ls(a) => ls(&c.client, args.common.json, a).await,
        EventsCommand::Show(a) => show(&c.client, args.common.json, a).await,
    }
}

const LS_COLUMNS: &[Column<'static>] = &[
    ("ID", "id"),
    ("TOPIC", "topic"),
    ("SUBJECT", "subject"),
    ("STATE", "state"),
    ("ATTEMPTS", "attempts"),
    ("PUBLISHED", "published_at"),
    ("LAST ERROR", "last_error"),
];

async fn ls(c: &Client, json: bool, a: LsArgs) -> Result<i32> {
    if let Some(s) = &a.subscription {
        ensure_subscription(c, s).await?;
    }
    let since = time::resolve_opt(c, "--since", a.since.as_deref()).await?;
    let until = time::resolve_opt(c, "--until", a.until.as_deref()).await?;
    let source = match a.subscription {
        None => "SELECT e.id, NULL::text AS subscription, e.topic, e.subject, e.dispatch_key, e.state, e.attempts, \
                 e.max_attempts, e.published_at, e.available_at, e.lease_expires_at, e.leased_by, e.delivered_at, \
                 e.dead_at, e.cancelled_at, e.last_error FROM outbox.events e WHERE $7::text IS NULL"
            .to_string(),
        Some(_) => "SELECT d.event_id AS id, d.subscription, d.topic, d.subject, e.dispatch_key, d.state, d.attempts, \
                    d.max_attempts, e.published_at, d.available_at, d.lease_expires_at, d.leased_by, d.delivered_at, \
                    d.dead_at, d.cancelled_at, d.last_error FROM outbox.deliveries d \
                    LEFT JOIN outbox.events e ON e.id = d.event_id WHERE d.subscription = $7::text"
            .to_string(),
    };
    let sql = format!(
        "SELECT * FROM ({source}) s WHERE ($1::text IS NULL OR s.state = $1::text) AND {} \
         AND ($3::text IS NULL OR s.subject = $3::text) \
         AND ($4::text IS NULL OR s.published_at >= $4::text::timestamptz) \
         AND ($6::bigint IS NULL OR s.id < $6::bigint) \
         AND ($8::text IS NULL OR s.published_at < $8::text::timestamptz) ORDER BY s.id DESC LIMIT $5::bigint",
        topic_match_sql("s.topic", 2)
    );
    let mut rows = json_rows(
        c,
        "listing events",
        &sql,
        &[&a.state, &a.topic, &a.subject, &since, &a.limit, &a.before, &a.subscription, &until],
    )
    .await?;
    if a.subscription.is_none() {
        for r in &mut rows {
            r.shift_remove("subscription");
        }
    }
    print_rows(json, &rows, LS_COLUMNS, "no events match");
    Ok(0)
}

/// Fields of `events show`, in display order (payload, headers and errors follow separately).
const SHOW_FIELDS: &[&str] = &[
    "id",
    "subscription",
    "topic",
    "subject",
    "dispatch_key",
    "state",
    "attempts",
    "max_attempts",
    "published_at",
    "available_at",
    "lease_expires_at",
    "leased_by",
    "delivered_at",
    "dead_at",
    "cancelled_at",
    "last_error",
];

/// One event as a JSON object (None when there is no such event for the subscription).
pub async fn fetch(c: &Client, id: i64, subscription: Option<&str>) -> Result<Option<Map<String, Value>>> {
    let sql = match subscription {
        None => {
            "SELECT e.id, 'default'::text AS subscription, e.topic, e.subject, e.dispatch_key, e.state, \
                 e.attempts, e.max_attempts, e.published_at, e.available_at, e.lease_expires_at, e.leased_by, \
                 e.delivered_at, e.dead_at, e.cancelled_at, e.last_error, e.payload, e.headers, e.errors \
                 FROM outbox.events e WHERE e.id = $1::bigint AND $2::text IS NULL"
        }
        Some(_) => {
            "SELECT d.event_id AS id, d.subscription, d.topic, d.subject, e.dispatch_key, d.state, d.attempts, \
                 d.max_attempts, e.published_at, d.available_at, d.lease_expires_at, d.leased_by, d.delivered_at, \
                 d.dead_at, d.cancelled_at, d.last_error, e.payload, e.headers, d.errors \
                 FROM outbox.deliveries d LEFT JOIN outbox.events e ON e.id = d.event_id \
                 WHERE d.event_id = $1::bigint AND d.subscription = $2::text"
        }
    };
    let mut rows = json_rows(c, "reading the event", sql, &[&id, &subscription]).await?;
    Ok(rows.pop())
}

/// The state of each id (None when the event is unknown to that subscription, or has no state in
/// it), from `outbox.events` or, with a subscription, `outbox.deliveries`.
pub async fn states(c: &Client, ids: &[i64], subscription: Option<&str>) -> Result<HashMap<i64, Option<String>>> {
    let sql = match subscription {
        None => "SELECT id, state FROM outbox.events WHERE id = ANY($1::bigint[]) AND $2::text IS NULL",
        Some(_) => {
            "SELECT event_id, state FROM outbox.deliveries WHERE event_id = ANY($1::bigint[]) AND subscription = $2::text"
        }
    };
    let rows = c.query(sql, &[&ids, &subscription]).await.map_err(|e| sql_error("reading event states", &e))?;
    Ok(rows.into_iter().map(|r| (r.get::<_, i64>(0), r.get::<_, Option<String>>(1))).collect())
}

async fn show(c: &Client, json: bool, a: ShowArgs) -> Result<i32> {
    if let Some(s) = &a.subscription {
        ensure_subscription(c, s).await?;
    }
    let Some(mut ev) = fetch(c, a.id, a.subscription.as_deref()).await? else {
        return Err(match &a.subscription {
            None => anyhow!("no event with id {} (outbox events ls lists them)", a.id),
            Some(s) => anyhow!("no event with id {} in subscription '{s}'", a.id),
        });
    };
    let deliveries = json_rows(
        c,
        "outbox.deliveries",
        "SELECT subscription, state, attempts, leased_by, lease_expires_at, delivered_at, dead_at, cancelled_at, \
         last_error FROM outbox.deliveries WHERE event_id = $1::bigint ORDER BY subscription",
        &[&a.id],
    )
    .await?;
    if json {
        ev.insert("deliveries".into(), Value::Array(deliveries.into_iter().map(Value::Object).collect()));
        print_json(&Value::Object(ev));
        return Ok(0);
    }
    let mut t = table(&["FIELD", "VALUE"]);
    for f in SHOW_FIELDS {
        t.add_row(vec![f.to_string(), cell(ev.get(*f).unwrap_or(&Value::Null))]);
    }
    println!("{t}");
    let pretty = |v: Option<&Value>| match v {
        None | Some(Value::Null) => "(none)".to_string(),
        Some(v) => serde_json::to_string_pretty(v).unwrap_or_default(),
    };
    println!("payload:\n{}", pretty(ev.get("payload")));
    println!("headers:\n{}", pretty(ev.get("headers")));
    let errors: Vec<Map<String, Value>> = match ev.get("errors") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|e| match e {
                Value::Object(m) if m.contains_key("omitted") => {
                    let mut m2 = Map::new();
                    m2.insert("error".into(), Value::String(format!("({} entries omitted)", cell(&m["omitted"]))));
                    m2
                }
                Value::Object(m) => m.clone(),
                other => {
                    let mut m2 = Map::new();
                    m2.insert("error".into(), other.clone());
                    m2
                }
            })
            .collect(),
        _ => Vec::new(),
    };
    if errors.is_empty() {
        println!("errors: none");
    } else {
        println!("errors ({}):", errors.len());
        let cols = [("ATTEMPT", "attempt"), ("AT", "at"), ("WORKER", "worker"), ("ERROR", "error")];
        println!("{}", rows_table(&errors, &cols, 400));
    }
    if !deliveries.is_empty() {
        println!("deliveries:");
        let cols = [
            ("SUBSCRIPTION", "subscription"),
            ("STATE", "state"),
            ("ATTEMPTS", "attempts"),
            ("DELIVERED", "delivered_at"),
            ("DEAD", "dead_at"),
            ("LAST ERROR", "last_error"),
        ];
        println!("{}", rows_table(&deliveries, &cols, 60));
    }
    Ok(0)
}
