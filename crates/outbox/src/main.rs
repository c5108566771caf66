//! `outbox`: the command-line companion of the outbox_ext PostgreSQL extension.
//!
//! Subcommands:
//! - `outbox relay`: move events into NATS JetStream or signed webhooks (see [`relay`]).
//! - `outbox stats|health|events|replay|cancel|topics|subscriptions|purge|tail`: operate the
//!   outbox from a terminal through its SQL API (see [`cli`]).
//! - `outbox serve`: the web dashboard (see [`serve`]): read-only unless `--allow-actions`, and
//!   then every POST needs the action token and the page's CSRF token.
//! - `outbox completions bash|zsh|fish|...`: shell completions (clap_complete).
//!
//! Errors are printed as one line on stderr with a non-zero exit status (2 for usage errors,
//! 1 otherwise); nothing here panics on bad input.

mod cli;
mod db;
mod relay;
mod serve;

use clap::{CommandFactory as _, Parser, Subcommand};

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

/// The subcommands. (Parsed once per process, so the size difference between variants does not
/// matter; clap's `flatten` of the operator commands cannot be boxed.)
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Relay events into NATS JetStream or signed webhooks (at-least-once, deduplicated by message id).
    Relay(Box<relay::config::RelayArgs>),
    #[command(flatten)]
    Cli(cli::CliCommand),
    /// Web dashboard: overview, dead letters, events, blocked subjects, health (read-only unless --allow-actions).
    Serve(serve::ServeArgs),
    /// Print a shell completion script (e.g. `outbox completions bash > /etc/bash_completion.d/outbox`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
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

/// Parses the command line; a usage error becomes one line on stderr and exit status 2 (clap's
/// own report spans several lines: the message, the usage, a hint), help and version print as
/// clap prints them.
fn parse_args() -> Cli {
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            let text = e.render().to_string();
            let parts: Vec<&str> = text
                .lines()
                .take_while(|l| !l.starts_with("Usage:"))
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with("For more information"))
                .collect();
            let line = parts.join(" ");
            let line = line.strip_prefix("error: ").unwrap_or(&line);
            eprintln!("outbox: error: {line} (see --help)");
            std::process::exit(2);
        }
    }
}

fn main() {
    let cli = parse_args();
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
            Command::Relay(args) => relay::run(*args).await.map(|()| 0),
            Command::Cli(cmd) => cli::run(cmd).await,
            Command::Serve(args) => serve::run(args).await,
            Command::Completions { shell } => {
                clap_complete::generate(shell, &mut Cli::command(), "outbox", &mut std::io::stdout());
                Ok(0)
            }
        }
    });
    // Stop the tasks still running (a connection being closed) before the error line, so that
    // their last log lines cannot follow it: the one-line error stays the last line on stderr.
    // Bounded: a task stuck outside an await point is left behind after half a second.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            let line = format!("{e:#}").replace('\n', " ");
            eprintln!("outbox: error: {line}");
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    /// clap's own consistency check of the whole command tree: argument groups name arguments
    /// that exist (the policy flags are flattened from one struct), no two flags collide.
    #[test]
    fn the_command_tree_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
