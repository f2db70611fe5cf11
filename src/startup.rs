//! Building the application from settings, and serving it until told to stop.
//!
//! [`Application::build`] binds its own listener (port 0 in tests) and reports the address, so
//! tests run the real server exactly as production does. [`Application::run_until_stopped`]
//! takes the shutdown signal as an argument and owns the connection loop: hyper's HTTP/1
//! limits (header count, head size, header read timeout) are only reachable there, and so is
//! an accurate connection cap that answers "503, full" instead of letting the kernel queue
//! connections unseen. hyper has no write timeout; [`write_timeout`] adds one around each
//! connection's I/O.

mod write_timeout;

use std::{
    future::Future,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::{Router, extract::ConnectInfo};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    sync::Semaphore,
};
use tokio_util::sync::{CancellationToken, DropGuard};
use tower::ServiceExt;
use write_timeout::WriteTimeout;

use crate::{
    admission::Admission,
    capacity,
    config::Settings,
    db::Db,
    downstream::{Client, Downstreams},
    http::{
        AppState, ops_router,
        pushback::{Pausable, Pushback},
        router,
    },
    overload::QueueDelay,
    ratelimit::RateLimiter,
    routing::Routing,
    telemetry::{self, Family, Telemetry},
};

/// Every metric family the gateway exports, each declared beside the code that records it.
pub const METRIC_FAMILIES: &[&[Family]] = &[
    telemetry::metrics::FAMILIES,
    telemetry::runtime::FAMILIES,
    telemetry::logs::FAMILIES,
    crate::overload::FAMILIES,
    crate::admission::FAMILIES,
    crate::ratelimit::FAMILIES,
    crate::downstream::FAMILIES,
    crate::downstream::cache::FAMILIES,
    crate::db::FAMILIES,
    crate::fanout::FAMILIES,
    crate::routing::FAMILIES,
];

pub struct Application {
    listener: TcpListener,
    router: Router,
    /// `server.ops_listen`, serving [`ops_router`].
    ops_listener: TcpListener,
    state: AppState,
    draining: Arc<AtomicBool>,
    /// Handed to every background task the application starts (the queueing-delay probe,
    /// admission control, the rate limiter's sweeper and Redis prober, the runtime and pool
    /// samplers): the one way they stop.
    tasks: CancellationToken,
    /// Cancels `tasks` when dropped: after `run_until_stopped`, or when the application is
    /// dropped without ever being run.
    stop_tasks: DropGuard,
}

impl Application {
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        Self::build_with(settings, Router::new()).await
    }

    /// Builds the application with `extra` routes behind the same request layer (tests and
    /// diagnostics use this seam).
    pub async fn build_with(settings: Settings, extra: Router<AppState>) -> anyhow::Result<Self> {
        let settings = Arc::new(settings);
        let tasks = CancellationToken::new();
        // Until the application exists, a failed build stops what it started.
        let stop_tasks = tasks.clone().drop_guard();
        let telemetry = Telemetry::new(&settings.telemetry, METRIC_FAMILIES)?;
        for warning in capacity::check_pool_budget(&settings.database) {
            tracing::warn!("{warning}");
        }
        let db = Db::connect_lazy(&settings.database)?;
        if settings.database.run_migrations {
            migrate_with_retry(&db, Duration::from_secs(30)).await?;
        }
        let client = Client::new(&settings.http_client)?;
        // Whether the gateway's own CPU is the bottleneck: the admission limit follows it, and
        // the breakers do not blame the downstreams for it.
        let queue_delay = QueueDelay::spawn(settings.overload.queue_delay_target, tasks.clone());
        let downstreams = Arc::new(Downstreams::new(&settings, client, &queue_delay)?);
        let routing = Arc::new(Routing::new(
            Arc::clone(&settings),
            Arc::clone(&downstreams),
            queue_delay.clone(),
        )?);
        let admission = settings.admission.enabled.then(|| {
            // The core's queue and the database pool's: the limit follows whichever
            // admitted requests stand in line for.
            let inner = if settings.overload.follow_db_pool {
                vec![db.queue().clone()]
            } else {
                Vec::new()
            };
            Admission::new(&settings, &queue_delay, inner, tasks.clone())
        });
        let rate_limiter = if settings.rate_limit.enabled {
            Some(Arc::new(
                RateLimiter::new(&settings.rate_limit, tasks.clone()).await?,
            ))
        } else {
            None
        };
        let draining = Arc::new(AtomicBool::new(false));
        let state = AppState {
            settings: Arc::clone(&settings),
            db,
            downstreams,
            routing,
            admission,
            rate_limiter,
            telemetry,
            fanout_metrics: Arc::new(crate::fanout::FanoutMetrics::new()),
            draining: Arc::clone(&draining),
        };
        let listener = listen(settings.server.listen, settings.server.listen_backlog)
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", settings.server.listen))?;
        let ops_listener = listen(settings.server.ops_listen, OPS_BACKLOG)
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", settings.server.ops_listen))?;
        Ok(Self {
            router: router(state.clone(), extra),
            listener,
            ops_listener,
            state,
            draining,
            tasks,
            stop_tasks,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Where the operations endpoints (`/metrics`, `/healthz`, `/readyz`) are served.
    pub fn ops_addr(&self) -> SocketAddr {
        self.ops_listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Reload the routing (grey releases) from `sources` on SIGHUP, on the admin endpoint and,
    /// with `routing.watch_config`, when the file changes.
    pub fn reload_from(self, sources: crate::config::Sources) -> Self {
        self.state.routing.reload_from(sources);
        self
    }

    /// Serves until `shutdown` resolves, then stops accepting, lets in-flight requests finish
    /// within `server.drain_timeout`, and closes the database pool.
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let Self {
            listener,
            router,
            ops_listener,
            state,
            draining,
            tasks,
            stop_tasks,
        } = self;
        let settings = Arc::clone(&state.settings);
        let server = &settings.server;
        let max_hold = settings.admission.pushback_max_hold;
        telemetry::runtime::spawn_samplers(tasks.clone());
        // Until the API has drained: a scrape during the drain still sees it.
        let ops = tokio::spawn(serve_ops(
            ops_listener,
            crate::http::admin::with_routing_admin(ops_router(state.clone()), &state),
            tasks.clone(),
        ));
        state.routing.spawn_tasks(tasks.clone());
        state.db.spawn_pool_sampler(tasks);

        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(server.header_read_timeout)
            // Off by default: an end of file in the middle of a request then means the client
            // has gone, and its request is cancelled (recorded as 499) instead of running on.
            .half_close(server.half_close)
            // Hard bounds at twice the configured limits: up to them the request layer answers
            // 431 with a problem document; beyond them hyper refuses with its own bare 431.
            .max_headers(server.max_headers.get().saturating_mul(2))
            // hyper's read buffer bounds the request head; it cannot go below 8 KiB.
            .max_buf_size(server.max_header_bytes.get().saturating_mul(2).max(8192));
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_header_list_size(server.max_header_bytes.get().saturating_mul(2) as u32);
        let graceful = GracefulShutdown::new();
        let connections = Arc::new(Semaphore::new(server.max_connections.get()));
        let addr = listener.local_addr()?;
        tracing::info!(%addr, "listening");

        tokio::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
                tokio::spawn(refuse_connection(stream));
                continue;
            };
            // The connection's pushback (`admission.pushback`): the edge decides when a 503 is
            // held, the IO wrapper below holds it.
            let pushback = Arc::new(Pushback::new(max_hold, server.write_timeout));
            let io = Pausable::new(stream, Arc::clone(&pushback));
            let service = router.clone().map_request(
                move |mut req: axum::http::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(ConnectInfo(peer));
                    req.extensions_mut().insert(Arc::clone(&pushback));
                    req
                },
            );
            // Built inside the task (the builder is cheap to clone), after the first byte; the
            // watcher is taken now, so a drain also waits for connections still in that phase.
            let builder = builder.clone();
            let watcher = graceful.watcher();
            let first_byte_timeout = server.header_read_timeout;
            let write_timeout = server.write_timeout;
            tokio::spawn(async move {
                // hyper's header read timeout only starts once the auto builder has seen
                // enough bytes to pick HTTP/1 or HTTP/2: a client that connects and sends
                // nothing would hold its connection slot forever (with max_connections = N,
                // N silent sockets lock everyone out). Give it the same time to start.
                if !first_byte_within(io.get_ref(), first_byte_timeout).await {
                    drop(permit);
                    return;
                }
                let conn = builder
                    .serve_connection_with_upgrades(
                        TokioIo::new(WriteTimeout::new(io, write_timeout)),
                        TowerToHyperService::new(service),
                    )
                    .into_owned();
                if let Err(e) = watcher.watch(conn).await {
                    tracing::debug!(error = %e, %peer, "connection ended with an error");
                }
                drop(permit);
            });
        }

        draining.store(true, Ordering::Relaxed);
        drop(listener);
        tracing::info!(drain_timeout = ?server.drain_timeout, "shutting down: draining in-flight requests");
        match tokio::time::timeout(server.drain_timeout, graceful.shutdown()).await {
            Ok(()) => tracing::info!("all connections drained"),
            Err(_) => tracing::warn!("drain timeout elapsed; closing remaining connections"),
        }
        drop(stop_tasks);
        let _ = tokio::time::timeout(Duration::from_secs(1), ops).await;
        state.db.close().await;
        Ok(())
    }
}

/// The operations listener's accept queue: a few scrapers and probes, not a fleet of clients.
const OPS_BACKLOG: u32 = 128;

/// Serves the operations endpoints until `stop` is cancelled. A plain server: the port is for
/// Prometheus and probes, and keeping it apart from the API's connection loop is the point.
async fn serve_ops(listener: TcpListener, router: Router, stop: CancellationToken) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "operations endpoints listening");
    }
    if let Err(e) = axum::serve(listener, router)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
    {
        tracing::warn!(error = %e, "operations listener failed");
    }
}

/// True once the client has sent at least one byte; false on EOF, error or timeout.
async fn first_byte_within(stream: &tokio::net::TcpStream, timeout: Duration) -> bool {
    let mut probe = [0u8; 1];
    matches!(
        tokio::time::timeout(timeout, stream.peek(&mut probe)).await,
        Ok(Ok(n)) if n > 0
    )
}

/// Binds a listener with an explicit accept-queue length (tokio's `bind` fixes it at 1024).
pub fn listen(addr: std::net::SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // A restarted gateway must not wait for the old socket's TIME_WAIT to rebind its port.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Over the connection cap: a short, explicit answer instead of an unanswered SYN.
///
/// The request head is read before the answer is written: bytes that arrive before a client
/// has sent its request are not a response to it, and clients such as hyper (reqwest) reject
/// them as an unexpected message instead of showing the 503. After the answer, what is left
/// of the request is drained briefly before closing, because closing a socket with unread
/// data sends a reset, which can destroy the answer before the client reads it.
async fn refuse_connection(mut stream: tokio::net::TcpStream) {
    const BODY: &str = r#"{"type":"/problems/unavailable","title":"Service Unavailable","status":503,"detail":"the gateway is at its connection limit; retry later"}"#;
    /// A refused connection gets this long, and this many bytes, to deliver its request head.
    const HEAD_TIMEOUT: Duration = Duration::from_secs(1);
    const HEAD_LIMIT: usize = 16 * 1024;
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = tokio::time::timeout(HEAD_TIMEOUT, read_request_head(&mut stream, HEAD_LIMIT)).await;
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        stream.write_all(response.as_bytes()),
    )
    .await;
    let _ = stream.shutdown().await;
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        let mut sink = [0u8; 1024];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// Reads (and discards) up to the blank line that ends a request head, at most `limit` bytes.
async fn read_request_head(stream: &mut tokio::net::TcpStream, limit: usize) {
    let mut buf = [0u8; 1024];
    // The last three bytes of the previous read, so a terminator split across reads is found.
    let mut tail: Vec<u8> = Vec::with_capacity(1024 + 3);
    let mut total = 0;
    while total < limit {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        total += n;
        tail.extend_from_slice(&buf[..n]);
        if tail.windows(4).any(|w| w == b"\r\n\r\n") {
            return;
        }
        let keep = tail.len().saturating_sub(3);
        tail.drain(..keep);
    }
}

/// At start-up the database may still be coming up (compose, Kubernetes): retry for a
/// bounded time, then fail with the real cause.
async fn migrate_with_retry(db: &Db, patience: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + patience;
    let mut delay = Duration::from_millis(200);
    loop {
        match db.migrate().await {
            Ok(()) => return Ok(()),
            // It will not appear by itself: say so now, not after the whole patience.
            Err(e) if e.is::<crate::db::MissingDatabase>() => return Err(e),
            Err(e) if tokio::time::Instant::now() + delay < deadline => {
                tracing::warn!(error = %e, "migrations failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(3));
            }
            Err(e) => return Err(e.context("running database migrations")),
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received"),
        _ = terminate => tracing::info!("SIGTERM received"),
    }
}
