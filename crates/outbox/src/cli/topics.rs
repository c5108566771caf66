//! `outbox topics ls|create|alter|drop`: per-topic policy (`outbox.topics`,
//! `outbox.create_topic`, `outbox.alter_topic`, `outbox.drop_topic`). outbox_ext has no pause for
//! topics: pause a subscription instead (`outbox subscriptions pause`).

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use serde_json::json;

use super::output::{print_json, print_rows, Column};
use super::{conn, json_rows, sql_error, Common, RetryPolicy};

/// Arguments of `outbox topics`.
#[derive(Debug, Args)]
pub struct TopicsArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(subcommand)]
    command: TopicsCommand,
}

/// `outbox topics` subcommands.
#[derive(Debug, Subcommand)]
enum TopicsCommand {
    /// List registered topics with their policy, and topics that have events without a policy.
    Ls,
    /// Register a topic with its policy (unset settings fall back to the outbox.* settings).
    Create(TopicPolicy),
    /// Change a registered topic's policy (unset settings are left as they are).
    Alter(TopicPolicy),
    /// Unregister a topic (its events are kept).
    Drop {
        /// The topic.
        topic: String,
        /// Drop it even while it has pending, leased or dead events (only the policy goes).
        #[arg(long)]
        force: bool,
    },
}

/// A topic and the policy settings given on the command line.
#[derive(Debug, Args)]
struct TopicPolicy {
    /// The topic, e.g. billing.invoice.paid.
    topic: String,
    #[command(flatten)]
    policy: RetryPolicy,
    /// What a dead event does to later events of its subject.
    #[arg(long, value_parser = ["block", "skip"])]
    dead_letter_policy: Option<String>,
    /// How long delivered and cancelled events are kept (interval).
    #[arg(long)]
    retention_delivered: Option<String>,
    /// How long dead letters are kept (interval).
    #[arg(long)]
    retention_dead: Option<String>,
}

const COLUMNS: &[Column<'static>] = &[
    ("TOPIC", "topic"),
    ("REGISTERED", "registered"),
    ("BACKLOG", "backlog"),
    ("DEAD", "dead"),
    ("MAX ATTEMPTS", "max_attempts"),
    ("BACKOFF BASE", "backoff_base"),
    ("BACKOFF MAX", "backoff_max"),
    ("LEASE", "default_lease"),
    ("DLQ POLICY", "dead_letter_policy"),
    ("KEEP DELIVERED", "retention_delivered"),
    ("KEEP DEAD", "retention_dead"),
];

/// Runs `outbox topics ...`.
pub async fn run(args: TopicsArgs) -> Result<i32> {
    let c = conn::connect(&args.common).await?;
    let json = args.common.json;
    match args.command {
        TopicsCommand::Ls => {
            let rows = json_rows(
                &c.client,
                "listing topics",
                "WITH s AS (SELECT topic, sum(ready + scheduled)::bigint AS backlog, sum(dead)::bigint AS dead \
                   FROM outbox.stats WHERE subscription = 'default' GROUP BY topic) \
                 SELECT coalesce(t.topic, s.topic) AS topic, t.topic IS NOT NULL AS registered, \
                   coalesce(s.backlog, 0) AS backlog, coalesce(s.dead, 0) AS dead, t.max_attempts, t.backoff_base, \
                   t.backoff_max, t.default_lease, t.dead_letter_policy, t.retention_delivered, t.retention_dead, \
                   t.created_at, t.updated_at \
                 FROM outbox.topics t FULL JOIN s ON s.topic = t.topic ORDER BY 1",
                &[],
            )
            .await?;
            print_rows(json, &rows, COLUMNS, "no topics");
        }
        TopicsCommand::Create(p) => {
            c.client
                .execute(
                    "SELECT outbox.create_topic($1::text, $2::int, $3::text::interval, $4::text::interval, \
                     $5::text::interval, coalesce($6::text, 'block'), $7::text::interval, $8::text::interval)",
                    &[
                        &p.topic,
                        &p.policy.max_attempts,
                        &p.policy.backoff_base,
                        &p.policy.backoff_max,
                        &p.policy.default_lease,
                        &p.dead_letter_policy,
                        &p.retention_delivered,
                        &p.retention_dead,
                    ],
                )
                .await
                .map_err(|e| sql_error(&format!("create_topic('{}')", p.topic), &e))?;
            report(json, "created", &p.topic);
        }
        TopicsCommand::Alter(p) => {
            c.client
                .execute(
                    "SELECT outbox.alter_topic($1::text, $2::int, $3::text::interval, $4::text::interval, \
                     $5::text::interval, $6::text, $7::text::interval, $8::text::interval)",
                    &[
                        &p.topic,
                        &p.policy.max_attempts,
                        &p.policy.backoff_base,
                        &p.policy.backoff_max,
                        &p.policy.default_lease,
                        &p.dead_letter_policy,
                        &p.retention_delivered,
                        &p.retention_dead,
                    ],
                )
                .await
                .map_err(|e| sql_error(&format!("alter_topic('{}')", p.topic), &e))?;
            report(json, "altered", &p.topic);
        }
        TopicsCommand::Drop { topic, force } => {
            let dropped: Option<bool> = c
                .client
                .query_one("SELECT outbox.drop_topic($1::text, $2::boolean)", &[&topic, &force])
                .await
                .map_err(|e| sql_error(&format!("drop_topic('{topic}')"), &e))?
                .get(0);
            if dropped != Some(true) {
                bail!("topic '{topic}' is not registered (outbox topics ls)");
            }
            report(json, "dropped", &topic);
        }
    }
    Ok(0)
}

fn report(json: bool, what: &str, topic: &str) {
    if json {
        print_json(&json!({"topic": topic, "result": what}));
    } else {
        println!("{what} topic '{topic}'");
    }
}
