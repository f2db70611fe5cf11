//! The async runtime's own health, and the process's.
//!
//! - per-worker busy ratio, alive tasks and the global queue depth, sampled from the runtime's
//!   metrics once a second; with `--cfg tokio_unstable` (set in `.cargo/config.toml`) also the
//!   poll count and the blocking pool's threads and queue, which tokio offers only under that
//!   cfg. A build without it (a `RUSTFLAGS` from the environment replaces the config file's)
//!   leaves those three families out, of the catalogue as well as of the exposition;
//! - scheduling lag, measured by a heartbeat task that asks to wake every 100 ms and records
//!   how late it actually ran (a saturated or blocked runtime wakes it late);
//! - long polls: [`PollTimer`] times every poll of a request's future, and a poll that holds a
//!   worker longer than `telemetry.long_poll_threshold` (a blocking call, a lock held around
//!   slow work, a CPU-heavy loop) is counted and logged *inside the request's span*, so the
//!   offending route and request can be found;
//! - process CPU, memory, threads and file descriptors, read from `/proc` on a plain thread, in
//!   the system's own units: the page size and clock tick come from the process's auxiliary
//!   vector (what `sysconf` reads), not assumed to be 4 KiB and 100 Hz.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use metrics::{Counter, Gauge, Unit};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Telemetry, metrics::Family};

pub(crate) const WORKERS: Family =
    Family::gauge("tributary_runtime_workers", "Tokio worker threads.");
pub(crate) const WORKER_BUSY_RATIO: Family = Family::gauge(
    "tributary_runtime_worker_busy_ratio",
    "Share of the last sampling interval each worker spent busy.",
);
#[cfg(tokio_unstable)]
pub(crate) const POLLS: Family = Family::counter(
    "tributary_runtime_polls_total",
    "Task polls across all workers.",
);
pub(crate) const LONG_POLLS: Family = Family::counter(
    "tributary_runtime_long_polls_total",
    "Polls of request futures that held a worker longer than telemetry.long_poll_threshold.",
);
#[cfg(tokio_unstable)]
pub(crate) const BLOCKING_THREADS: Family = Family::gauge(
    "tributary_runtime_blocking_threads",
    "Threads in the blocking pool.",
);
#[cfg(tokio_unstable)]
pub(crate) const BLOCKING_QUEUE_DEPTH: Family = Family::gauge(
    "tributary_runtime_blocking_queue_depth",
    "Tasks queued for the blocking pool.",
);
pub(crate) const ALIVE_TASKS: Family = Family::gauge(
    "tributary_runtime_alive_tasks",
    "Tasks alive in the runtime.",
);
pub(crate) const GLOBAL_QUEUE_DEPTH: Family = Family::gauge(
    "tributary_runtime_global_queue_depth",
    "Tasks waiting in the runtime's global (injection) queue.",
);
pub(crate) const SCHEDULING_LAG: Family = Family::seconds(
    "tributary_runtime_scheduling_lag_seconds",
    "How late a 100 ms heartbeat timer task actually ran.",
);
pub(crate) const RESIDENT_MEMORY: Family = Family::gauge(
    "process_resident_memory_bytes",
    "Resident memory size in bytes.",
)
.in_unit(Unit::Bytes);
pub(crate) const CPU_SECONDS: Family = Family::counter(
    "process_cpu_seconds_total",
    "Total user and system CPU time spent in seconds.",
)
.in_unit(Unit::Seconds);
pub(crate) const THREADS: Family =
    Family::gauge("process_threads", "Number of OS threads in the process.");
pub(crate) const OPEN_FDS: Family =
    Family::gauge("process_open_fds", "Number of open file descriptors.");
pub(crate) const MAX_FDS: Family = Family::gauge(
    "process_max_fds",
    "Maximum number of open file descriptors.",
);
pub(crate) const START_TIME: Family = Family::gauge(
    "process_start_time_seconds",
    "Start time of the process since unix epoch in seconds.",
)
.in_unit(Unit::Seconds);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[
    WORKERS,
    WORKER_BUSY_RATIO,
    #[cfg(tokio_unstable)]
    POLLS,
    LONG_POLLS,
    #[cfg(tokio_unstable)]
    BLOCKING_THREADS,
    #[cfg(tokio_unstable)]
    BLOCKING_QUEUE_DEPTH,
    ALIVE_TASKS,
    GLOBAL_QUEUE_DEPTH,
    SCHEDULING_LAG,
    RESIDENT_MEMORY,
    CPU_SECONDS,
    THREADS,
    OPEN_FDS,
    MAX_FDS,
    START_TIME,
];

pin_project_lite::pin_project! {
    /// Times each poll of the inner future; a poll longer than the threshold is a worker thread
    /// held hostage, and is reported from inside the request's span.
    pub struct PollTimer<F> {
        #[pin]
        inner: F,
        telemetry: Arc<Telemetry>,
    }
}

impl<F> PollTimer<F> {
    pub(crate) fn new(inner: F, telemetry: Arc<Telemetry>) -> Self {
        Self { inner, telemetry }
    }
}

impl<F: Future> Future for PollTimer<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let started = std::time::Instant::now();
        let result = this.inner.poll(cx);
        let took = started.elapsed();
        if took >= this.telemetry.settings.long_poll_threshold {
            this.telemetry.long_poll(took);
        }
        result
    }
}

/// Starts the heartbeat and the once-a-second runtime sampler on the current runtime; both
/// stop when `shutdown` is cancelled.
pub(crate) fn spawn_samplers(shutdown: CancellationToken) {
    tokio::spawn(heartbeat(shutdown.clone()));
    tokio::spawn(sample_runtime(shutdown));
}

async fn heartbeat(shutdown: CancellationToken) {
    let lag = metrics::histogram!(SCHEDULING_LAG.name);
    let period = Duration::from_millis(100);
    loop {
        let expected = Instant::now() + period;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep_until(expected) => {}
        }
        lag.record(
            Instant::now()
                .saturating_duration_since(expected)
                .as_secs_f64(),
        );
    }
}

async fn sample_runtime(shutdown: CancellationToken) {
    let handle = tokio::runtime::Handle::current();
    let rt = handle.metrics();
    let workers = rt.num_workers();
    let busy_gauges: Vec<Gauge> = (0..workers)
        .map(|w| metrics::gauge!(WORKER_BUSY_RATIO.name, "worker" => w.to_string()))
        .collect();
    let workers_gauge = metrics::gauge!(WORKERS.name);
    let alive = metrics::gauge!(ALIVE_TASKS.name);
    let global = metrics::gauge!(GLOBAL_QUEUE_DEPTH.name);
    #[cfg(tokio_unstable)]
    let mut unstable = Unstable::new(&rt);
    let mut last_busy: Vec<Duration> = (0..workers)
        .map(|w| rt.worker_total_busy_duration(w))
        .collect();
    let mut last = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let elapsed = last.elapsed().as_secs_f64().max(1e-3);
        last = Instant::now();
        workers_gauge.set(workers as f64);
        for (w, gauge) in busy_gauges.iter().enumerate() {
            let busy = rt.worker_total_busy_duration(w);
            let delta = busy.saturating_sub(last_busy[w]).as_secs_f64();
            last_busy[w] = busy;
            gauge.set((delta / elapsed).min(1.0));
        }
        alive.set(rt.num_alive_tasks() as f64);
        global.set(rt.global_queue_depth() as f64);
        #[cfg(tokio_unstable)]
        unstable.sample(&rt);
        super::logs::record_dropped_lines();
    }
}

/// The samples that need `--cfg tokio_unstable`.
#[cfg(tokio_unstable)]
struct Unstable {
    polls: Counter,
    last_polls: u64,
    blocking: Gauge,
    blocking_queue: Gauge,
}

#[cfg(tokio_unstable)]
impl Unstable {
    fn new(rt: &tokio::runtime::RuntimeMetrics) -> Self {
        Self {
            polls: metrics::counter!(POLLS.name),
            last_polls: Self::total_polls(rt),
            blocking: metrics::gauge!(BLOCKING_THREADS.name),
            blocking_queue: metrics::gauge!(BLOCKING_QUEUE_DEPTH.name),
        }
    }

    fn total_polls(rt: &tokio::runtime::RuntimeMetrics) -> u64 {
        (0..rt.num_workers()).map(|w| rt.worker_poll_count(w)).sum()
    }

    fn sample(&mut self, rt: &tokio::runtime::RuntimeMetrics) {
        let total = Self::total_polls(rt);
        self.polls.increment(total.saturating_sub(self.last_polls));
        self.last_polls = total;
        self.blocking.set(rt.num_blocking_threads() as f64);
        self.blocking_queue.set(rt.blocking_queue_depth() as f64);
    }
}

/// The long-poll counter, registered once.
pub(super) fn long_polls() -> Counter {
    metrics::counter!(LONG_POLLS.name)
}

/// Starts the `/proc` sampler on a plain thread (file reads never touch a worker). It runs for
/// the life of the process, like the recorder it feeds.
pub(super) fn spawn_process_sampler() -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("process-metrics".into())
        .spawn(process::sample_forever)
        .map(drop)
}

mod process {
    use std::time::Duration;

    use super::{CPU_SECONDS, MAX_FDS, OPEN_FDS, RESIDENT_MEMORY, START_TIME, THREADS};

    pub(super) fn sample_forever() {
        let rss = metrics::gauge!(RESIDENT_MEMORY.name);
        let cpu = metrics::counter!(CPU_SECONDS.name);
        let threads = metrics::gauge!(THREADS.name);
        let fds = metrics::gauge!(OPEN_FDS.name);
        let max_fds = metrics::gauge!(MAX_FDS.name);
        let start = metrics::gauge!(START_TIME.name);
        let units = Units::of_this_system();
        let boot = boot_time();
        loop {
            if let Some(stat) = std::fs::read_to_string("/proc/self/stat")
                .ok()
                .and_then(|text| Stat::parse(&text, units))
            {
                // A Prometheus counter through the `metrics` facade is an integer: whole CPU
                // seconds, which is what rate() over minutes needs.
                cpu.absolute(stat.cpu_seconds as u64);
                rss.set(stat.resident_bytes);
                threads.set(stat.threads);
                if let Some(boot) = boot {
                    start.set(boot + stat.started_after_boot_seconds);
                }
            }
            if let Some(n) = open_fds() {
                fds.set(n as f64);
            }
            if let Ok(limits) = std::fs::read_to_string("/proc/self/limits")
                && let Some(line) = limits.lines().find(|l| l.starts_with("Max open files"))
                && let Some(v) = line
                    .split_whitespace()
                    .nth(3)
                    .and_then(|v| v.parse::<f64>().ok())
            {
                max_fds.set(v);
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// How many file descriptors the process has open.
    ///
    /// Linux 6.2 and later give the count as the size of `/proc/self/fd`, read from the fd
    /// table's bitmap in one `stat`. Listing the directory instead, as earlier kernels need,
    /// looks up every descriptor: at the overload curve's 10,000 connections that was 4 % of
    /// the gateway's samples in `bench/profile held` (`__d_lookup`, `proc_fill_cache`), about
    /// 7 ms of its core a second, on the core the sampler shares with the worker.
    pub(super) fn open_fds() -> Option<u64> {
        match std::fs::metadata("/proc/self/fd") {
            Ok(m) if m.len() > 0 => Some(m.len()),
            // An older kernel reports 0; the listing holds its own descriptor too.
            _ => std::fs::read_dir("/proc/self/fd")
                .ok()
                .map(|dir| (dir.count() as u64).saturating_sub(1)),
        }
    }

    /// The units `/proc/self/stat` counts in on this system.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub(super) struct Units {
        /// Bytes per page (4 KiB on most x86 kernels; 16 or 64 KiB on some arm64 ones).
        pub page_bytes: f64,
        /// Clock ticks per second (`USER_HZ`).
        pub ticks_per_second: f64,
    }

    /// `AT_PAGESZ` and `AT_CLKTCK` in the auxiliary vector.
    const AT_PAGESZ: usize = 6;
    const AT_CLKTCK: usize = 17;

    impl Units {
        /// Read from `/proc/self/auxv`, the values the kernel gave this process (the same that
        /// `sysconf(_SC_PAGESIZE)` and `sysconf(_SC_CLK_TCK)` return, without `unsafe`); the
        /// common values only if it cannot be read.
        pub(super) fn of_this_system() -> Self {
            let auxv = std::fs::read("/proc/self/auxv").unwrap_or_default();
            Self::from_auxv(&auxv)
        }

        pub(super) fn from_auxv(auxv: &[u8]) -> Self {
            let word = std::mem::size_of::<usize>();
            let mut units = Units {
                page_bytes: 4096.0,
                ticks_per_second: 100.0,
            };
            let words: Vec<usize> = auxv
                .chunks_exact(word)
                .map(|c| usize::from_ne_bytes(c.try_into().expect("chunks of one word")))
                .collect();
            for pair in words.chunks_exact(2) {
                match (pair[0], pair[1]) {
                    (0, _) => break,
                    (AT_PAGESZ, v) if v > 0 => units.page_bytes = v as f64,
                    (AT_CLKTCK, v) if v > 0 => units.ticks_per_second = v as f64,
                    _ => {}
                }
            }
            units
        }
    }

    /// What the sampler takes from `/proc/self/stat`.
    #[derive(Debug, PartialEq)]
    pub(super) struct Stat {
        pub cpu_seconds: f64,
        pub resident_bytes: f64,
        pub threads: f64,
        pub started_after_boot_seconds: f64,
    }

    impl Stat {
        pub(super) fn parse(stat: &str, units: Units) -> Option<Self> {
            // Fields after the command name, which is in parentheses and may contain spaces.
            let rest = stat.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            // rest starts at field 3 (state): utime=14, stime=15, num_threads=20,
            // starttime=22, rss=24 (proc(5)).
            Some(Self {
                cpu_seconds: (num(11) + num(12)) as f64 / units.ticks_per_second,
                resident_bytes: num(21) as f64 * units.page_bytes,
                threads: num(17) as f64,
                started_after_boot_seconds: num(19) as f64 / units.ticks_per_second,
            })
        }
    }

    fn boot_time() -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let btime = stat.lines().find_map(|l| l.strip_prefix("btime "))?;
        btime.trim().parse().ok()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Whichever way the kernel gives it, the count follows the descriptors opened. Other
        /// tests of this binary run on other threads and may hold a few sockets meanwhile:
        /// hence a margin, far below the 200 opened.
        #[test]
        fn the_open_descriptor_count_follows_the_descriptors_opened() {
            let before = open_fds().expect("a count on Linux");
            let files: Vec<_> = (0..200)
                .map(|_| std::fs::File::open("/proc/self/stat").expect("open"))
                .collect();
            let during = open_fds().expect("a count on Linux");
            drop(files);
            let grew = during as i64 - before as i64;
            assert!((180..=220).contains(&grew), "{before} then {during}");
        }

        fn getconf(name: &str) -> f64 {
            let out = std::process::Command::new("getconf")
                .arg(name)
                .output()
                .expect("getconf runs");
            String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
        }

        #[test]
        fn the_page_size_and_clock_tick_are_the_systems() {
            let units = Units::of_this_system();
            assert_eq!(units.page_bytes, getconf("PAGESIZE"));
            assert_eq!(units.ticks_per_second, getconf("CLK_TCK"));
        }

        #[test]
        fn a_64_kib_page_system_reports_its_resident_memory_and_threads() {
            let word = |v: usize| v.to_ne_bytes().to_vec();
            let auxv: Vec<u8> = [word(AT_PAGESZ), word(65536), word(AT_CLKTCK), word(250)]
                .concat()
                .into_iter()
                .chain(word(0))
                .chain(word(0))
                .collect();
            let units = Units::from_auxv(&auxv);
            // pid (comm with spaces) state ppid ... : utime 500, stime 250, 7 threads, rss 10.
            let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 500 250 0 0 20 0 7 0 \
                        1000 123456 10 18446744073709551615";
            assert_eq!(
                Stat::parse(stat, units),
                Some(Stat {
                    cpu_seconds: 3.0,
                    resident_bytes: 10.0 * 65536.0,
                    threads: 7.0,
                    started_after_boot_seconds: 4.0,
                })
            );
        }
    }
}
