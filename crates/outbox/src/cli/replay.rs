//! `outbox replay ID...` and `outbox replay --dead [filters]`: dead (or, by id, cancelled) events
//! back to pending, through `outbox.replay(id, subscription)`.
//!
//! Guardrails:
//! - By id: every id's state is read first; if any is pending, leased, delivered or unknown, the
//!   command refuses and replays nothing. `outbox.replay` itself only moves dead or cancelled
//!   events (it returns false otherwise), so a state change between the check and the call is
//!   reported, never acted on.
//! - In bulk (`--dead`): only dead letters are selected. The command needs `--yes`, or a typed
//!   confirmation when stdin is a terminal; without either it refuses. `--dry-run` prints the count
//!   (`outbox.replay_dead(..., dry_run => true)`) and a sample, and changes nothing.
//! - Bulk work is a series of bounded calls: the matching ids are read from `outbox.deliveries` in
//!   id order, a page at a time (keyset pagination, `event_id > last`), and each page is replayed
//!   in one short transaction (`outbox.replay` per id), so the progress bar advances per page, no
//!   transaction holds more subject locks than a page, and an event dead again by the time its page
//!   comes is still visited once. The upper time bound defaults to the moment the command started,
//!   so events that die while it runs are left for the next run.

use anyhow::{bail, Result};
use clap::Args;
use serde_json::{json, Value};
use tokio_postgres::Client;

use super::output::{print_json, print_rows, Column};
use super::{
    confirm, conn, ensure_subscription, events, json_rows, progress_bar, sql_error, time, topic_match_sql, Common,
};

/// Arguments of `outbox replay`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["ids", "dead"])))]
pub struct ReplayArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Event ids to replay (each must be dead or cancelled).
    ids: Vec<i64>,
    /// Replay every dead letter matching the filters (bulk).
    #[arg(long)]
    dead: bool,
    /// Bulk: only topics matching this pattern (exact, `prefix.*` or `*`).
    #[arg(long, requires = "dead")]
    topic: Option<String>,
    /// Bulk: only events dead at or after this time (a timestamp, or a duration ago: 30m, 2h).
    #[arg(long, requires = "dead")]
    since: Option<String>,
    /// Bulk: only events dead before this time (default: when the command started).
    #[arg(long, requires = "dead")]
    until: Option<String>,
    /// Bulk: print how many would be replayed and a sample; change nothing.
    #[arg(long, requires = "dead")]
    dry_run: bool,
    /// Bulk: do not ask for confirmation.
    #[arg(long, short = 'y')]
    yes: bool,
    /// The subscription whose events to replay (default: `default`).
    #[arg(long)]
    subscription: Option<String>,
    /// Bulk: events per transaction (each page is one bounded call).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=500))]
    batch_size: i64,
    /// Bulk: how many matching events --dry-run shows.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i64).range(0..=1000))]
    sample: i64,
}

/// Runs `outbox replay`.
pub async fn run(args: ReplayArgs) -> Result<i32> {
    let c = conn::connect(&args.common).await?;
    if let Some(s) = &args.subscription {
        ensure_subscription(&c.client, s).await?;
    }
    if args.dead {
        if !args.ids.is_empty() {
            bail!("pass either event ids or --dead, not both");
        }
        bulk(&c.client, &args).await
    } else {
        by_id(&c.client, &args.common, &args.ids, args.subscription.as_deref(), Action::Replay).await
    }
}

/// What [`by_id`] does to each event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `outbox.replay`: dead or cancelled -> pending.
    Replay,
    /// `outbox.cancel`: pending or dead -> cancelled.
    Cancel,
}

impl Action {
    /// The verb, as messages use it (`replay`, `cancel`).
    pub fn verb(self) -> &'static str {
        match self {
            Action::Replay => "replay",
            Action::Cancel => "cancel",
        }
    }
    /// The past participle, as messages use it (`replayed`, `cancelled`).
    pub fn done(self) -> &'static str {
        match self {
            Action::Replay => "replayed",
            Action::Cancel => "cancelled",
        }
    }
    /// Why an event in `state` is refused, or None when the action may take it.
    pub fn refusal(self, state: Option<&str>) -> Option<String> {
        match (self, state) {
            (Action::Replay, Some("dead" | "cancelled")) | (Action::Cancel, Some("pending" | "dead")) => None,
            (Action::Replay, Some("pending")) => Some("it is pending: it will be delivered, nothing to replay".into()),
            (Action::Replay, Some("leased")) => Some("it is leased: a worker has it in flight".into()),
            (Action::Replay, Some("delivered")) => {
                Some("it was delivered: replay never sends a delivered event again".into())
            }
            (Action::Cancel, Some("leased")) => {
                Some("it is leased: a worker has it in flight (fail it, or wait for the lease to expire)".into())
            }
            (Action::Cancel, Some("delivered")) => Some("it was already delivered".into()),
            (Action::Cancel, Some("cancelled")) => Some("it is already cancelled".into()),
            (_, Some(other)) => Some(format!("it is {other}")),
            (_, None) => Some("it has no state in this subscription (not received by it)".into()),
        }
    }
}

/// Replays or cancels the given ids, after checking all of them: one ineligible or unknown id
/// refuses the whole command, and nothing is changed. Exit status 0 when every event changed, 1
/// otherwise.
pub async fn by_id(
    c: &Client,
    common: &Common,
    ids: &[i64],
    subscription: Option<&str>,
    action: Action,
) -> Result<i32> {
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    let states = events::states(c, &ids, subscription).await?;
    let sub_name = subscription.unwrap_or("default");
    let mut refused = Vec::new();
    for id in &ids {
        let reason = match states.get(id) {
            None => Some(format!("no event with id {id} in subscription '{sub_name}'")),
            Some(state) => action.refusal(state.as_deref()).map(|r| format!("event {id}: {r}")),
        };
        if let Some(r) = reason {
            refused.push(json!({"id": id, "state": states.get(id).cloned().flatten(), "reason": r}));
        }
    }
    if !refused.is_empty() {
        let what = if ids.len() == 1 { "the event" } else { "any event" };
        if common.json {
            print_json(&json!({"changed": [], "refused": refused, "failed": []}));
        }
        let reasons: Vec<&str> = refused.iter().filter_map(|r| r["reason"].as_str()).collect();
        bail!("refusing to {} {what}: {}; nothing was changed", action.verb(), reasons.join("; "));
    }
    let func = match action {
        Action::Replay => "outbox.replay",
        Action::Cancel => "outbox.cancel",
    };
    let sql = format!("SELECT {func}($1::bigint, $2::text)");
    let mut changed = Vec::new();
    let mut failed = Vec::new();
    for id in &ids {
        let row = c.query_one(&sql, &[id, &subscription]).await.map_err(|e| sql_error(func, &e))?;
        if row.get::<_, Option<bool>>(0).unwrap_or(false) {
            changed.push(*id);
        } else {
            failed.push(*id);
        }
    }
    if common.json {
        print_json(&json!({"changed": changed, "refused": [], "failed": failed}));
    } else {
        for id in &changed {
            println!("{} event {id}", action.done());
        }
        for id in &failed {
            println!("not {} event {id}: its state changed meanwhile", action.done());
        }
    }
    if failed.is_empty() {
        Ok(0)
    } else {
        bail!("{} of {} events could not be {} (their state changed meanwhile)", failed.len(), ids.len(), action.done())
    }
}

const SAMPLE_COLUMNS: &[Column<'static>] = &[
    ("ID", "id"),
    ("TOPIC", "topic"),
    ("SUBJECT", "subject"),
    ("ATTEMPTS", "attempts"),
    ("DEAD AT", "dead_at"),
    ("LAST ERROR", "last_error"),
];

/// The dead letters matching the filters, `event_id > after`, in id order, at most `limit`.
async fn page(
    c: &Client,
    args: &ReplayArgs,
    since: &Option<String>,
    until: &str,
    after: i64,
    limit: i64,
) -> Result<Vec<serde_json::Map<String, Value>>> {
    let sql = format!(
        "SELECT event_id AS id, topic, subject, attempts, dead_at, last_error FROM outbox.deliveries \
         WHERE subscription = coalesce($1::text, 'default') AND state = 'dead' AND {} \
         AND ($3::text IS NULL OR dead_at >= $3::text::timestamptz) AND dead_at < $4::text::timestamptz \
         AND event_id > $5::bigint ORDER BY event_id LIMIT $6::bigint",
        topic_match_sql("topic", 2)
    );
    json_rows(c, "listing dead letters", &sql, &[&args.subscription, &args.topic, since, &until, &after, &limit]).await
}

async fn bulk(c: &Client, args: &ReplayArgs) -> Result<i32> {
    let json = args.common.json;
    let since = time::resolve_opt(c, "--since", args.since.as_deref()).await?;
    let until = match time::resolve_opt(c, "--until", args.until.as_deref()).await? {
        Some(u) => u,
        None => c.query_one("SELECT now()::text", &[]).await.map_err(|e| sql_error("now()", &e))?.get(0),
    };
    let count: i64 = c
        .query_one(
            "SELECT outbox.replay_dead($1::text, $2::text::timestamptz, $3::text::timestamptz, true, $4::text)",
            &[&args.topic, &since, &until, &args.subscription],
        )
        .await
        .map_err(|e| sql_error("outbox.replay_dead (dry run)", &e))?
        .get::<_, Option<i64>>(0)
        .unwrap_or(0);
    let sub_name = args.subscription.as_deref().unwrap_or("default");
    if args.dry_run {
        let sample = page(c, args, &since, &until, 0, args.sample).await?;
        if json {
            print_json(&json!({
                "dry_run": true, "subscription": sub_name, "matched": count,
                "sample": sample.into_iter().map(Value::Object).collect::<Vec<_>>(),
            }));
        } else {
            println!(
                "dry run: {count} dead events of subscription '{sub_name}' would be replayed; nothing was changed"
            );
            if count > 0 {
                print_rows(false, &sample, SAMPLE_COLUMNS, "");
            }
        }
        return Ok(0);
    }
    if count == 0 {
        if json {
            print_json(&json!({"dry_run": false, "subscription": sub_name, "matched": 0, "replayed": 0, "skipped": 0}));
        } else {
            println!("no dead events of subscription '{sub_name}' match; nothing to replay");
        }
        return Ok(0);
    }
    if !args.yes {
        let q = format!("Replay {count} dead events of subscription '{sub_name}'?");
        if !confirm(&q, &count.to_string(), &format!("replay {count} dead events"))? {
            bail!("not confirmed; nothing was replayed");
        }
    }
    let bar = progress_bar(count as u64, json, "replaying");
    let (mut replayed, mut skipped, mut after) = (0i64, 0i64, 0i64);
    loop {
        let rows = page(c, args, &since, &until, after, args.batch_size).await?;
        let ids: Vec<i64> = rows.iter().filter_map(|r| r.get("id").and_then(Value::as_i64)).collect();
        let Some(&last) = ids.last() else { break };
        after = last;
        let n: i64 = c
            .query_one(
                "SELECT count(*) FILTER (WHERE r) FROM (SELECT outbox.replay(i, $2::text) AS r \
                 FROM unnest($1::bigint[]) WITH ORDINALITY AS u(i, o) ORDER BY o) s",
                &[&ids, &args.subscription],
            )
            .await
            .map_err(|e| sql_error("outbox.replay", &e))?
            .get(0);
        replayed += n;
        skipped += ids.len() as i64 - n;
        if bar.length().is_some_and(|l| l < (replayed + skipped) as u64) {
            bar.set_length((replayed + skipped) as u64);
        }
        bar.set_position((replayed + skipped) as u64);
    }
    bar.finish_and_clear();
    if json {
        print_json(&json!({
            "dry_run": false, "subscription": sub_name, "matched": count, "replayed": replayed, "skipped": skipped,
        }));
    } else {
        println!("replayed {replayed} dead events of subscription '{sub_name}'");
        if skipped > 0 {
            println!("{skipped} were no longer dead when their turn came and were left alone");
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guardrails() {
        for s in ["pending", "leased", "delivered"] {
            assert!(Action::Replay.refusal(Some(s)).is_some(), "{s}");
        }
        assert!(Action::Replay.refusal(Some("dead")).is_none());
        assert!(Action::Replay.refusal(Some("cancelled")).is_none());
        assert!(Action::Replay.refusal(None).is_some());
        assert!(Action::Cancel.refusal(Some("leased")).is_some());
        assert!(Action::Cancel.refusal(Some("pending")).is_none());
        assert!(Action::Cancel.refusal(Some("dead")).is_none());
    }
}
