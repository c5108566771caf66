//! `outbox stats`: the `outbox.stats` view, one row per topic and subscription (counts by state,
//! the age of the oldest ready event and lease, dead letters and deliveries of the last hour).

use anyhow::Result;
use clap::Args;

use super::output::{print_rows, Column};
use super::{conn, json_rows, topic_match_sql, Common};

/// Arguments of `outbox stats`.
#[derive(Debug, Args)]
pub struct StatsArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Only this subscription.
    #[arg(long)]
    subscription: Option<String>,
    /// Only topics matching this pattern (exact, `prefix.*` or `*`).
    #[arg(long)]
    topic: Option<String>,
}

const COLUMNS: &[Column<'static>] = &[
    ("SUBSCRIPTION", "subscription"),
    ("TOPIC", "topic"),
    ("READY", "ready"),
    ("SCHEDULED", "scheduled"),
    ("LEASED", "leased"),
    ("EXPIRED", "expired_leases"),
    ("DEAD", "dead"),
    ("DELIVERED", "delivered"),
    ("CANCELLED", "cancelled"),
    ("OLDEST READY", "oldest_ready_age"),
    ("OLDEST LEASE", "oldest_lease_age"),
    ("DEAD/1H", "dead_last_hour"),
    ("DELIV/1M", "delivered_last_minute"),
    ("DELIV/1H", "delivered_last_hour"),
];

/// Prints `outbox.stats`, ordered by subscription and topic.
pub async fn run(args: StatsArgs) -> Result<i32> {
    let c = conn::connect(&args.common).await?;
    let sql = format!(
        "SELECT subscription, topic, ready, scheduled, leased, expired_leases, dead, delivered, cancelled, \
         oldest_ready_age, oldest_lease_age, dead_last_hour, delivered_last_minute, delivered_last_hour \
         FROM outbox.stats WHERE ($1::text IS NULL OR subscription = $1::text) AND {} \
         ORDER BY subscription, topic",
        topic_match_sql("topic", 2)
    );
    let rows = json_rows(&c.client, "outbox.stats", &sql, &[&args.subscription, &args.topic]).await?;
    print_rows(args.common.json, &rows, COLUMNS, "no events");
    Ok(0)
}
