//! The `tributary` command: serve the gateway, or run one of its operational tasks.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};
#[cfg(not(feature = "system-allocator"))]
use mimalloc::MiMalloc;
use tributary::{
    Application, Settings, build_info,
    capacity::{self, CapacityInput},
    config::Sources,
    db::Db,
    startup::shutdown_signal,
    telemetry,
};

/// The hot path allocates small, short-lived buffers on every request (headers, bodies, log
/// lines); mimalloc's thread-local free lists serve them faster than glibc's malloc, which the
/// profile of `bench/run seed-baseline` showed at ~17 % of the worker's time. The
/// `system-allocator` feature keeps glibc's, for heap profilers that intercept `malloc`
/// (`bench/profile heap` runs heaptrack on such a build).
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

#[derive(Parser)]
#[command(
    name = "tributary",
    version = build_info::version_line(),
    about = "A gateway-aggregation service"
)]
struct Cli {
    /// Configuration file (TOML); else TRIBUTARY_CONFIG, else config/default.toml when it exists.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (the default).
    Serve,
    /// Apply database migrations and exit.
    Migrate,
    /// Insert demo orders for users 1..=N (idempotent).
    Seed {
        /// Users 1..=N get orders.
        #[arg(long, default_value_t = 10_000)]
        users: i64,
        /// Orders per user.
        #[arg(long, default_value_t = 5)]
        orders_per_user: i32,
    },
    /// Recommend an admission limit and pool size from a target rate and latencies.
    Capacity {
        /// Target request rate for the whole fleet, requests per second.
        #[arg(long, value_parser = positive)]
        target_rps: f64,
        /// Mean request latency in milliseconds at that rate.
        #[arg(long, value_parser = millis)]
        latency_ms: f64,
        /// Mean query latency in milliseconds.
        #[arg(long, default_value_t = 2.0, value_parser = millis)]
        db_latency_ms: f64,
        /// Queries per request (may be fractional: a mean).
        #[arg(long, default_value_t = 1.0, value_parser = non_negative)]
        db_queries_per_request: f64,
        /// Multiplier for latency variance and bursts; at least 1.
        #[arg(long, default_value_t = 1.5, value_parser = headroom)]
        headroom: f64,
        /// Replicas the rate is split across.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        replicas: u32,
        /// The Postgres server's max_connections; default: database.server_max_connections.
        #[arg(long)]
        pg_max_connections: Option<u32>,
        /// Connections kept for admins and jobs; default: database.reserved_connections.
        #[arg(long)]
        reserve: Option<u32>,
    },
    /// Load and validate the configuration, print it (secrets masked) and exit.
    CheckConfig,
    /// Print the API's OpenAPI 3.1 document (what GET /openapi.json serves) and exit.
    Openapi,
}

/// A finite number above zero.
fn positive(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a finite number above 0, not {s}"))
    }
}

/// A finite number, zero or more.
fn non_negative(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a finite number, 0 or more, not {s}"))
    }
}

/// A latency in milliseconds: above zero and at most an hour.
fn millis(s: &str) -> Result<f64, String> {
    let v = positive(s)?;
    if v <= 3_600_000.0 {
        Ok(v)
    } else {
        Err(format!("must be at most 3600000 ms (an hour), not {s}"))
    }
}

fn headroom(s: &str) -> Result<f64, String> {
    let v = positive(s)?;
    if v >= 1.0 {
        Ok(v)
    } else {
        Err(format!("must be at least 1.0, not {s}"))
    }
}

fn main() -> ExitCode {
    // First: the pages faulted in from here on are 4 KiB ones (src/allocator.rs says why).
    tributary::allocator::apply_huge_page_policy();
    let cli = Cli::parse();
    let sources = Sources::from_process(cli.config.as_deref());
    let settings = match Settings::load(&sources) {
        Ok(s) => s,
        // The document is the code's: the configuration does not change it.
        Err(_) if matches!(cli.command, Some(Command::Openapi)) => Settings::default(),
        // The arithmetic needs no configuration: an unrelated bad setting must not stop it.
        Err(e) if matches!(cli.command, Some(Command::Capacity { .. })) => {
            eprintln!(
                "tributary: note: the configuration does not load ({e}); using the built-in defaults"
            );
            Settings::default()
        }
        Err(e) => {
            eprintln!("tributary: {e}");
            return ExitCode::from(2);
        }
    };
    match run(cli.command.unwrap_or(Command::Serve), settings, sources) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tributary: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command, settings: Settings, sources: Sources) -> anyhow::Result<()> {
    match command {
        Command::Openapi => {
            print!("{}", tributary::http::openapi::render());
            Ok(())
        }
        Command::CheckConfig => {
            // Secrets print as *** and URL passwords are masked by their types.
            println!("{}", serde_json::to_string_pretty(&settings.printable()?)?);
            Ok(())
        }
        Command::Capacity {
            target_rps,
            latency_ms,
            db_latency_ms,
            db_queries_per_request,
            headroom,
            replicas,
            pg_max_connections,
            reserve,
        } => {
            let db = &settings.database;
            let input = CapacityInput {
                target_rps,
                request_latency: Duration::from_secs_f64(latency_ms / 1000.0),
                db_queries_per_request,
                db_latency: Duration::from_secs_f64(db_latency_ms / 1000.0),
                headroom,
                replicas,
                server_max_connections: pg_max_connections.unwrap_or(db.server_max_connections),
                reserved_connections: reserve.unwrap_or(db.reserved_connections),
            };
            let recommendation = capacity::recommend(&input);
            print!("{}", capacity::Report::new(&input, &recommendation));
            println!("{}", serde_json::to_string(&recommendation)?);
            Ok(())
        }
        Command::Serve | Command::Migrate | Command::Seed { .. } => {
            // Before the runtime exists: the OTLP exporter's blocking HTTP client must be built
            // (and later dropped) outside async context.
            let _tracing = telemetry::init_tracing(&settings.telemetry)?;
            let mut runtime = tokio::runtime::Builder::new_multi_thread();
            runtime.enable_all();
            if let Some(n) = settings.server.worker_threads {
                runtime.worker_threads(n.get());
            }
            runtime
                .build()?
                .block_on(async_main(command, settings, sources))
        }
    }
}

async fn async_main(command: Command, settings: Settings, sources: Sources) -> anyhow::Result<()> {
    match command {
        Command::Migrate => {
            let db = Db::connect_lazy(&settings.database)?;
            db.migrate().await?;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::Seed {
            users,
            orders_per_user,
        } => {
            let db = Db::connect_lazy(&settings.database)?;
            db.migrate().await?;
            let inserted = db.seed(users, orders_per_user).await?;
            tracing::info!(users, orders_per_user, inserted, "seed complete");
            Ok(())
        }
        _ => {
            // The routing (grey releases) reloads from the same sources on SIGHUP.
            let app = Application::build(settings).await?.reload_from(sources);
            app.run_until_stopped(shutdown_signal()).await
        }
    }
}
