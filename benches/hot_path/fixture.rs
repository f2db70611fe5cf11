//! What the benchmarks share: the downstream simulator, on a thread and runtime of its own (in
//! production the downstreams are other processes, so their work is not the gateway's), and
//! the gateway as `Application::build` makes it, on a current-thread runtime.

use std::{
    net::SocketAddr,
    num::NonZeroUsize,
    sync::{Arc, LazyLock},
    time::Duration,
};

use tokio::{runtime::Runtime, time::Instant};
use tributary::{
    Application, Settings,
    config::{
        AdmissionGroupSettings, AdmissionMode, LogFormat, RouteGroup, TelemetrySettings,
        TransportKind,
    },
    context::{RequestContext, TraceIds},
    http::AppState,
};
use tributary_sim::Behaviour;

/// The gateway, built three times: with static admission limits, with the adaptive one, and with
/// static limits and the hyper transport.
pub(crate) struct Gateway {
    /// Drives everything the gateway spawned; a benchmark that awaits runs on it.
    pub(crate) rt: Runtime,
    /// Static limits: 10,000 for the dashboard, and 1 with no wait for the orders group (the
    /// full limiter of the rejection benchmark).
    pub(crate) fixed: AppState,
    /// The shipped mode: the limit follows the runtime's queueing delay.
    pub(crate) adaptive: AppState,
    /// As `fixed`, with the downstream calls through hyper-util's client
    /// (`http_client.transport = "hyper"`).
    pub(crate) hyper: AppState,
}

/// Built on first use; the applications are kept alive (their background tasks with them) for
/// the whole run.
pub(crate) static GATEWAY: LazyLock<Gateway> = LazyLock::new(|| {
    let sim = spawn_simulator();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let build = |mode: AdmissionMode, transport: TransportKind| {
        let mut settings = settings(sim, mode);
        settings.http_client.transport = transport;
        let app = rt
            .block_on(Application::build(settings))
            .expect("the gateway builds");
        let state = app.state().clone();
        // Never run, never dropped: dropping it would stop the tasks its state relies on.
        std::mem::forget(app);
        state
    };
    let fixed = build(AdmissionMode::Static, TransportKind::Reqwest);
    let adaptive = build(AdmissionMode::Adaptive, TransportKind::Reqwest);
    let hyper = build(AdmissionMode::Static, TransportKind::Hyper);
    Gateway {
        rt,
        fixed,
        adaptive,
        hyper,
    }
});

/// The settings the benchmarks run with: the shipped defaults, on loopback, with the
/// downstreams at the simulator, a database that is never connected to, and `mode` admission.
fn settings(sim: SocketAddr, mode: AdmissionMode) -> Settings {
    let mut s = Settings::default();
    s.server.listen = "127.0.0.1:0".parse().expect("an address");
    s.server.ops_listen = "127.0.0.1:0".parse().expect("an address");
    s.database.run_migrations = false;
    s.database.min_connections = Some(0);
    for d in s.downstreams.iter_mut() {
        d.base_url = format!("http://{sim}")
            .parse()
            .expect("the simulator's URL");
    }
    s.admission.enabled = true;
    s.admission.mode = mode;
    s.admission.max_in_flight = NonZeroUsize::new(10_000).expect("non-zero");
    s.admission.groups.insert(
        RouteGroup::Orders,
        AdmissionGroupSettings {
            max_in_flight: NonZeroUsize::new(1),
            max_wait: Some(Duration::ZERO),
        },
    );
    s
}

/// The simulator with the lab's bodies (512 bytes) and no latency, so that a call costs what
/// the exchange costs.
fn spawn_simulator() -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("bench-simulator".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            rt.block_on(async move {
                let behaviour = Behaviour {
                    latency: Duration::ZERO,
                    ..Behaviour::default()
                };
                let sim =
                    tributary_sim::spawn("127.0.0.1:0".parse().expect("an address"), behaviour)
                        .await
                        .expect("the simulator starts");
                tx.send(sim.addr)
                    .expect("the benchmarks wait for the address");
                std::future::pending::<()>().await;
            });
        })
        .expect("a thread for the simulator");
    rx.recv().expect("the simulator's address")
}

/// The gateway's log subscriber as `main` installs it (JSON lines, `info`), writing into
/// `std::io::sink`: the formatting is paid, the output is thrown away.
pub(crate) fn install_log_subscriber() {
    let settings = TelemetrySettings {
        log_format: LogFormat::Json,
        log_level: "info".into(),
        ..TelemetrySettings::default()
    };
    // No trace pipeline comes back: no OTLP endpoint is configured.
    if let Err(e) = tributary::telemetry::install_subscriber(&settings, std::io::sink) {
        panic!("the log subscriber: {e}");
    }
}

/// A request's context as the request layer makes it, with an hour to go.
pub(crate) fn request_context() -> Arc<RequestContext> {
    Arc::new(RequestContext::new(
        "3f2b8c1e9d7a4b6f8e0c2d4a6b8f0e1c".into(),
        trace_ids(),
        Instant::now() + Duration::from_secs(3600),
    ))
}

/// Trace ids of the shape the request layer generates.
pub(crate) fn trace_ids() -> TraceIds {
    TraceIds {
        trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
        span_id: "b7ad6b7169203331".into(),
        sampled: true,
        tracestate: None,
    }
}
