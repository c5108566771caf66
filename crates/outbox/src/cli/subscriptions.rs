//! `outbox subscriptions ls|create|drop|pause|resume`: the `outbox.subscriptions` view (lag,
//! leases in flight, dead letters, last claim) and `outbox.create_subscription`,
//! `drop_subscription`, `pause_subscription`, `resume_subscription`. Dropping discards the
//! subscription's position, retries and dead letters, so it needs `--yes` or a typed confirmation.

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use serde_json::json;

use super::output::{print_json, print_rows, Column};
use super::{confirm, conn, json_rows, sql_error, Common, RetryPolicy};

/// Arguments of `outbox subscriptions`.
#[derive(Debug, Args)]
pub struct SubscriptionsArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(subcommand)]
    command: SubscriptionsCommand,
}

/// `outbox subscriptions` subcommands.
#[derive(Debug, Subcommand)]
enum SubscriptionsCommand {
    /// List subscriptions with their lag, leases in flight and dead letters.
    Ls,
    /// Create a subscription.
    Create(CreateArgs),
    /// Change a subscription's policy (flags left out stay as they are).
    Alter(AlterArgs),
    /// Drop a subscription with its position, retries and dead letters.
    Drop {
        /// The subscription.
        name: String,
        /// Drop it even while leases it handed out have not expired.
        #[arg(long)]
        force: bool,
        /// Do not ask for confirmation.
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Pause: claims for it return nothing from the commit on; its events are kept.
    Pause {
        /// The subscription.
        name: String,
    },
    /// Resume a paused subscription (its listeners are woken).
    Resume {
        /// The subscription.
        name: String,
    },
}

/// Arguments of `outbox subscriptions create`.
#[derive(Debug, Args)]
struct CreateArgs {
    /// The subscription's name (1-63 characters of a-z 0-9 _ . -).
    name: String,
    /// Topic patterns it receives, comma separated (default: every topic).
    #[arg(long, value_delimiter = ',')]
    topics: Option<Vec<String>>,
    /// `now` (events committed from now on) or `earliest` (also what the log still holds).
    #[arg(long, default_value = "now", value_parser = ["now", "earliest"])]
    start: String,
    #[command(flatten)]
    policy: RetryPolicy,
    /// What a dead event does to later events of its subject.
    #[arg(long, value_parser = ["block", "skip"])]
    dead_letter_policy: Option<String>,
    /// Age past which unread events may be dropped by retention (interval; default: never).
    #[arg(long)]
    max_lag: Option<String>,
}

/// Arguments of `outbox subscriptions alter`: `outbox.alter_subscription`, whose NULLs keep a
/// setting, so at least one flag is required (an alter that changes nothing is a mistake).
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("setting").required(true).multiple(true)
    .args(["max_attempts", "backoff_base", "backoff_max", "default_lease", "max_lag"])))]
struct AlterArgs {
    /// The subscription.
    name: String,
    #[command(flatten)]
    policy: RetryPolicy,
    /// Age past which unread events may be dropped by retention (interval).
    #[arg(long)]
    max_lag: Option<String>,
}

const COLUMNS: &[Column<'static>] = &[
    ("NAME", "name"),
    ("TOPICS", "topics"),
    ("PAUSED", "paused"),
    ("LAG EVENTS", "lag_events"),
    ("LAG", "lag"),
    ("READY", "ready"),
    ("LEASED", "leases_in_flight"),
    ("DEAD", "dead_letters"),
    ("LAST CLAIM", "last_claim_at"),
    ("LOST", "lost_events"),
];

/// The columns of `outbox.subscriptions` that `ls` shows (named, so that a column the view gains
/// or loses between versions changes nothing here until this list does).
const LS_SQL: &str = "SELECT name, topics, paused, paused_at, lag_events, lag, oldest_undelivered_id, \
     oldest_undelivered_at, ready, leases_in_flight, dead_letters, last_claim_at, max_attempts, backoff_base, \
     backoff_max, default_lease, created_at, updated_at, dead_letter_policy, max_lag, lost_events, lost_at \
     FROM outbox.subscriptions ORDER BY name";

/// Runs `outbox subscriptions ...`.
pub async fn run(args: SubscriptionsArgs) -> Result<i32> {
    let c = conn::connect(&args.common).await?;
    let json = args.common.json;
    match args.command {
        SubscriptionsCommand::Ls => {
            let rows = json_rows(&c.client, "outbox.subscriptions", LS_SQL, &[]).await?;
            print_rows(json, &rows, COLUMNS, "no subscriptions");
        }
        SubscriptionsCommand::Create(a) => {
            c.client
                .execute(
                    "SELECT outbox.create_subscription($1::text, $2::text[], $3::text, $4::int, $5::text::interval, \
                     $6::text::interval, $7::text::interval, $8::text, $9::text::interval)",
                    &[
                        &a.name,
                        &a.topics,
                        &a.start,
                        &a.policy.max_attempts,
                        &a.policy.backoff_base,
                        &a.policy.backoff_max,
                        &a.policy.default_lease,
                        &a.dead_letter_policy,
                        &a.max_lag,
                    ],
                )
                .await
                .map_err(|e| sql_error(&format!("create_subscription('{}')", a.name), &e))?;
            report(json, &a.name, "created", true);
        }
        SubscriptionsCommand::Alter(a) => {
            c.client
                .execute(
                    "SELECT outbox.alter_subscription($1::text, $2::int, $3::text::interval, $4::text::interval, \
                     $5::text::interval, $6::text::interval)",
                    &[
                        &a.name,
                        &a.policy.max_attempts,
                        &a.policy.backoff_base,
                        &a.policy.backoff_max,
                        &a.policy.default_lease,
                        &a.max_lag,
                    ],
                )
                .await
                .map_err(|e| sql_error(&format!("alter_subscription('{}')", a.name), &e))?;
            report(json, &a.name, "altered", true);
        }
        SubscriptionsCommand::Drop { name, force, yes } => {
            if !yes {
                let q = format!("Drop subscription '{name}' with its position, retries and dead letters?");
                if !confirm(&q, &name, &format!("drop subscription '{name}'"))? {
                    bail!("not confirmed; nothing was dropped");
                }
            }
            c.client
                .execute("SELECT outbox.drop_subscription($1::text, $2::boolean)", &[&name, &force])
                .await
                .map_err(|e| sql_error(&format!("drop_subscription('{name}')"), &e))?;
            report(json, &name, "dropped", true);
        }
        SubscriptionsCommand::Pause { name } => {
            let changed: Option<bool> = c
                .client
                .query_one("SELECT outbox.pause_subscription($1::text)", &[&name])
                .await
                .map_err(|e| sql_error(&format!("pause_subscription('{name}')"), &e))?
                .get(0);
            report(json, &name, "paused", changed == Some(true));
        }
        SubscriptionsCommand::Resume { name } => {
            let changed: Option<bool> = c
                .client
                .query_one("SELECT outbox.resume_subscription($1::text)", &[&name])
                .await
                .map_err(|e| sql_error(&format!("resume_subscription('{name}')"), &e))?
                .get(0);
            report(json, &name, "resumed", changed == Some(true));
        }
    }
    Ok(0)
}

fn report(json: bool, name: &str, what: &str, changed: bool) {
    if json {
        print_json(&json!({"subscription": name, "result": what, "changed": changed}));
    } else if changed {
        println!("{what} subscription '{name}'");
    } else {
        println!("subscription '{name}' was already {what}");
    }
}
