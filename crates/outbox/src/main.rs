//! `outbox`: the command-line companion of the outbox_ext PostgreSQL extension.
//!
//! Subcommands:
//! - `outbox relay`: move events into NATS JetStream or signed webhooks (see [`relay`]).
//!
//! Errors are printed as one line on stderr with a non-zero exit status (2 for usage errors,
//! 1 otherwise); nothing here panics on bad input.

mod db;
mod relay;

use clap::{Parser, Subcommand};

/// Command-line interface of `outbox`.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, about = "Tools for the outbox_ext PostgreSQL extension")]
struct Cli {
    /// Log filter (tracing syntax), e.g. info or outbox=debug.
    #[arg(long, env = "OUTBOX_LOG", default_value = "info", global = true)]
    log: String,
    /// Log format.
    #[arg(long, env = "OUTBOX_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"], global = true)]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Relay events into NATS JetStream or signed webhooks (at-least-once, deduplicated by message id).
    Relay(Box<relay::config::RelayArgs>),
}

fn init_logging(filter: &str, format: &str) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter).map_err(|e| format!("bad --log filter: {e}"))?;
    let ansi = std::env::var_os("NO_COLOR").is_none() && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(ansi);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = init_logging(&cli.log, &cli.log_format) {
        eprintln!("outbox: error: {e}");
        std::process::exit(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox: error: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Relay(args) => relay::run(*args).await,
        }
    });
    if let Err(e) = result {
        let line = format!("{e:#}").replace('\n', " ");
        eprintln!("outbox: error: {line}");
        std::process::exit(1);
    }
}
