//! `downstream-sim`: the five downstream services with configurable latency, errors and size.

use std::{net::SocketAddr, time::Duration};

use clap::Parser;
use tributary_sim::{self as sim, Behaviour, Mode};

#[derive(Parser)]
#[command(
    name = "downstream-sim",
    version,
    about = "Simulated downstream services for tributary"
)]
struct Args {
    #[arg(long, env = "SIM_LISTEN", default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Base latency of every answer (e.g. 100ms).
    #[arg(long, env = "SIM_LATENCY", default_value = "20ms", value_parser = humantime::parse_duration)]
    latency: Duration,
    /// Uniform jitter around the latency (e.g. 10ms means ±10 ms).
    #[arg(long, env = "SIM_LATENCY_JITTER", default_value = "0ms", value_parser = humantime::parse_duration)]
    latency_jitter: Duration,
    /// Share of requests answered with 500, 0.0–1.0.
    #[arg(long, env = "SIM_ERROR_RATE", default_value_t = 0.0)]
    error_rate: f64,
    /// Approximate JSON body size in bytes.
    #[arg(long, env = "SIM_BODY_BYTES", default_value_t = 512)]
    body_bytes: usize,
    /// CPU time burnt per request on a blocking thread.
    #[arg(long, env = "SIM_CPU_WORK", default_value = "0ms", value_parser = humantime::parse_duration)]
    cpu_work: Duration,
    /// `Cache-Control` sent with every successful answer (e.g. `max-age=5`, `private`).
    #[arg(long, env = "SIM_CACHE_CONTROL")]
    cache_control: Option<String>,
    /// Tokio worker threads (default: one per core).
    #[arg(long, env = "SIM_WORKER_THREADS")]
    worker_threads: Option<usize>,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if !(0.0..=1.0).contains(&args.error_rate) {
        eprintln!("downstream-sim: --error-rate must be between 0 and 1");
        return std::process::ExitCode::from(2);
    }
    if args
        .cache_control
        .as_deref()
        .is_some_and(|v| axum::http::HeaderValue::from_str(v).is_err())
    {
        eprintln!("downstream-sim: --cache-control is not a valid header value");
        return std::process::ExitCode::from(2);
    }
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if let Some(n) = args.worker_threads {
        rt.worker_threads(n.max(1));
    }
    let rt = match rt.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("downstream-sim: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        let behaviour = Behaviour {
            latency: args.latency,
            jitter: args.latency_jitter,
            error_rate: args.error_rate,
            body_bytes: args.body_bytes,
            cpu_work: args.cpu_work,
            mode: Mode::Normal,
            cache_control: args.cache_control,
        };
        let handle = match sim::spawn(args.listen, behaviour).await {
            Ok(h) => h,
            Err(e) => {
                eprintln!("downstream-sim: cannot listen on {}: {e}", args.listen);
                return std::process::ExitCode::FAILURE;
            }
        };
        println!("downstream-sim listening on {}", handle.addr);
        // Containers are stopped with SIGTERM, terminals with SIGINT: either ends the process.
        tributary::startup::shutdown_signal().await;
        std::process::ExitCode::SUCCESS
    })
}
