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
//! `--dsn` (or `OUTBOX_DSN`) is one global flag of the top-level command, so it goes before or
//! after the subcommand (`outbox --dsn X stats`, `outbox stats --dsn X`, `outbox relay --dsn X`,
//! `outbox serve --dsn X`). `--json` is taken by the commands that print data (the operator
//! commands), before or after the subcommand; anywhere else (`relay`, `serve`, `completions`) it
//! is a usage error.
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
    /// PostgreSQL DSN (libpq key/value or URL; sslmode=require/verify-ca/verify-full use TLS),
    /// before or after the subcommand. Without it the operator commands and `serve` use libpq's
    /// PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD, PGSSLMODE and PGSSLROOTCERT (which also fill
    /// in what a DSN leaves out); `relay` takes the `dsn` of its --config file.
    #[arg(long, env = "OUTBOX_DSN", value_name = "DSN", global = true, hide_env_values = true)]
    dsn: Option<String>,
    /// Print JSON instead of tables (the operator commands; also accepted after the subcommand).
    #[arg(long)]
    json: bool,
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
        /// Refused (a usage error): completions are no data.
        #[arg(long, hide = true)]
        json: bool,
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
            usage_error(line.strip_prefix("error: ").unwrap_or(&line));
        }
    }
}

/// Prints a usage error as `parse_args` does (one line, exit status 2).
fn usage_error(line: &str) -> ! {
    eprintln!("outbox: error: {line} (see --help)");
    std::process::exit(2);
}

/// Hands the top-level `--dsn` and `--json` to the subcommand, or refuses `--json` where it means
/// nothing (the subcommand prints no data).
fn distribute(cli: &mut Cli) -> Result<(), String> {
    let dsn = cli.dsn.clone();
    let refuse = |name: &str| {
        Err(format!("--json does not apply to 'outbox {name}' (only the commands that print data take it)"))
    };
    match &mut cli.command {
        Command::Relay(args) => {
            if cli.json || args.json {
                return refuse("relay");
            }
            args.dsn = dsn;
        }
        Command::Serve(args) => {
            if cli.json || args.json {
                return refuse("serve");
            }
            args.dsn = dsn;
        }
        Command::Completions { json, .. } => {
            if cli.json || *json {
                return refuse("completions");
            }
        }
        Command::Cli(cmd) => {
            let common = cmd.common_mut();
            common.dsn = dsn;
            common.json |= cli.json;
        }
    }
    Ok(())
}

fn main() {
    let mut cli = parse_args();
    if let Err(e) = distribute(&mut cli) {
        usage_error(&e);
    }
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
            Command::Completions { shell, .. } => {
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

    /// Parses `argv` (after the program name) and hands the top-level flags over, as `main` does.
    fn parse(argv: &[&str]) -> Result<super::Cli, String> {
        use clap::Parser as _;
        let mut all = vec!["outbox"];
        all.extend_from_slice(argv);
        let mut cli = super::Cli::try_parse_from(all).map_err(|e| e.kind().to_string())?;
        super::distribute(&mut cli)?;
        Ok(cli)
    }

    /// The DSN the parsed command ends up with.
    fn dsn_of(cli: &super::Cli) -> Option<String> {
        match &cli.command {
            super::Command::Relay(a) => a.dsn.clone(),
            super::Command::Serve(a) => a.dsn.clone(),
            super::Command::Cli(c) => match c {
                crate::cli::CliCommand::Stats(a) => a.common.dsn.clone(),
                crate::cli::CliCommand::Events(a) => a.common.dsn.clone(),
                _ => panic!("not in this test"),
            },
            super::Command::Completions { .. } => None,
        }
    }

    fn json_of(cli: &mut super::Cli) -> bool {
        match &mut cli.command {
            super::Command::Cli(c) => c.common_mut().json,
            _ => panic!("not an operator command"),
        }
    }

    /// Issue 39, item 9: one global --dsn, before or after the subcommand, for the operator
    /// commands, relay and serve alike.
    #[test]
    fn dsn_goes_before_or_after_the_subcommand() {
        for cmd in [&["stats"][..], &["events", "ls"][..], &["relay"][..], &["serve"][..]] {
            let mut before = vec!["--dsn", "host=a"];
            before.extend_from_slice(cmd);
            let mut after = cmd.to_vec();
            after.extend_from_slice(&["--dsn", "host=a"]);
            for argv in [before, after] {
                let cli = parse(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
                assert_eq!(dsn_of(&cli).as_deref(), Some("host=a"), "{argv:?}");
            }
        }
        // Given twice, the last one wins.
        let cli = parse(&["--dsn", "host=a", "stats", "--dsn", "host=b"]).unwrap();
        assert_eq!(dsn_of(&cli).as_deref(), Some("host=b"));
    }

    /// --json where the command prints data, before or after it; a usage error elsewhere.
    #[test]
    fn json_is_taken_where_it_means_something() {
        for argv in [
            &["--json", "stats"][..],
            &["stats", "--json"][..],
            &["events", "ls", "--json"][..],
            &["--json", "events", "ls"][..],
        ] {
            let mut cli = parse(argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
            assert!(json_of(&mut cli), "{argv:?}");
        }
        assert!(!json_of(&mut parse(&["stats"]).unwrap()));
        for argv in [
            &["--json", "relay"][..],
            &["relay", "--json"][..],
            &["--json", "serve"][..],
            &["serve", "--json"][..],
            &["--json", "completions", "bash"][..],
            &["completions", "bash", "--json"][..],
        ] {
            let e = parse(argv).err().unwrap_or_else(|| panic!("{argv:?} was accepted"));
            assert!(e.starts_with("--json does not apply to 'outbox ") && !e.contains('\n'), "{argv:?}: {e}");
        }
    }

    /// The hidden --json of relay, serve and completions stays out of their help.
    #[test]
    fn refused_json_is_not_in_the_help() {
        let mut cmd = super::Cli::command();
        cmd.build();
        for name in ["relay", "serve", "completions"] {
            let sub = cmd.find_subcommand_mut(name).unwrap();
            let help = sub.render_long_help().to_string();
            assert!(!help.contains("--json"), "{name}: {help}");
            assert!(help.contains("--dsn"), "{name}: {help}");
        }
        let stats = cmd.find_subcommand_mut("stats").unwrap().render_long_help().to_string();
        assert!(stats.contains("--json") && stats.contains("--dsn"), "{stats}");
    }
}
