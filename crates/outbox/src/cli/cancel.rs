//! `outbox cancel ID...`: pending or dead events to cancelled, through
//! `outbox.cancel(id, subscription)`. As for replay by id, every id is checked first and one
//! leased, delivered, cancelled or unknown event refuses the whole command (nothing changes).

use anyhow::Result;
use clap::Args;

use super::replay::{by_id, Action};
use super::{conn, ensure_subscription, Common};

/// Arguments of `outbox cancel`.
#[derive(Debug, Args)]
pub struct CancelArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Event ids to cancel (each must be pending or dead).
    #[arg(required = true)]
    ids: Vec<i64>,
    /// The subscription whose events to cancel (default: `default`).
    #[arg(long)]
    subscription: Option<String>,
}

/// Runs `outbox cancel`.
pub async fn run(args: CancelArgs) -> Result<i32> {
    let c = conn::connect(&args.common).await?;
    if let Some(s) = &args.subscription {
        ensure_subscription(&c.client, s).await?;
    }
    by_id(&c.client, &args.common, &args.ids, args.subscription.as_deref(), Action::Cancel).await
}
