//! Admission control: a bounded number of requests in flight, a bounded wait for a slot, and a
//! fast, explicit "no" beyond that.
//!
//! Cheap concurrency removes the thread-pool cap that used to protect everything behind the
//! gateway; without a limit the gateway admits everything, queues it in the downstreams and the
//! database pool, and every request gets slow at once (an avalanche). The cure is a semaphore
//! with a short bounded wait in front (2,000 permits and 100 ms by default). This is that
//! semaphore, per route group, with three things added:
//!
//! - `Retry-After` comes from the observed drain rate (how fast permits are being returned),
//!   not a constant, so clients back off about as long as the backlog needs to clear;
//! - readiness turns false while shedding stays heavy, and comes back only after it has stayed
//!   light for a while (hysteresis), so the load balancer and an autoscaler see a stable signal;
//! - an adaptive mode (Gradient2, from Netflix's concurrency-limits) moves the limit with the
//!   latency it measures, for when per-pod capacity has not been measured or changes.
//!
//! Permits are RAII guards: a request that ends in any way — response, error, panic, client
//! disconnect — returns its permit, so in-flight counts always go back to zero.
//!
//! The limiter, its bookkeeping and Gradient2 stay in one file (a little over 600 lines with
//! the tests): they are one mechanism, and the adaptive algorithm reads best beside the
//! semaphore whose size it moves.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use metrics::{Counter, Gauge, Histogram};
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};
use tokio_util::sync::CancellationToken;

use crate::{
    config::{AdaptiveSettings, AdmissionMode, RouteGroup, Settings},
    telemetry::Family,
};

/// The limiters of all groups plus the shared readiness signal.
pub struct Admission {
    /// One per route group, indexed by it.
    limiters: [Arc<Limiter>; 2],
    shedding: Arc<AtomicBool>,
}

impl Admission {
    /// Builds one limiter per group and starts the once-a-second bookkeeping task, which stops
    /// when `shutdown` is cancelled.
    pub(crate) fn new(settings: &Settings, shutdown: CancellationToken) -> Arc<Self> {
        let shedding = Arc::new(AtomicBool::new(false));
        let shedding_gauge = metrics::gauge!(SHEDDING.name);
        shedding_gauge.set(0.0);
        let limiters = RouteGroup::ALL.map(|group| {
            let (limit, max_wait) = settings.admission_for(group);
            Arc::new(Limiter::new(
                group,
                settings.admission.mode,
                limit.get(),
                max_wait,
                &settings.admission.adaptive,
            ))
        });
        let this = Arc::new(Self { limiters, shedding });
        let hysteresis = Hysteresis::new(settings);
        tokio::spawn(bookkeeping(
            Arc::clone(&this),
            hysteresis,
            shedding_gauge,
            shutdown,
        ));
        this
    }

    pub fn limiter(&self, group: RouteGroup) -> Arc<Limiter> {
        Arc::clone(&self.limiters[group as usize])
    }

    /// True while shedding has been heavy (readiness reports not-ready).
    pub(crate) fn is_shedding(&self) -> bool {
        self.shedding.load(Ordering::Relaxed)
    }

    /// Requests holding a permit, across groups.
    pub fn in_flight(&self) -> usize {
        self.limiters.iter().map(|l| l.in_flight()).sum()
    }
}

/// Readiness hysteresis: how many consecutive seconds of heavy / light shedding flip it.
struct Hysteresis {
    unready_ratio: f64,
    unready_after: u32,
    ready_ratio: f64,
    ready_after: u32,
    heavy_secs: u32,
    light_secs: u32,
}

impl Hysteresis {
    fn new(settings: &Settings) -> Self {
        let a = &settings.admission;
        Self {
            unready_ratio: a.unready_shed_ratio.get(),
            unready_after: a.unready_after_secs.max(1),
            ready_ratio: a.ready_shed_ratio.get(),
            ready_after: a.ready_after_secs.max(1),
            heavy_secs: 0,
            light_secs: 0,
        }
    }

    /// Feeds one second's shed ratio; returns the new shedding state.
    fn observe(&mut self, ratio: f64, shedding: bool) -> bool {
        if ratio > self.unready_ratio {
            self.heavy_secs += 1;
            self.light_secs = 0;
        } else if ratio <= self.ready_ratio {
            self.light_secs += 1;
            self.heavy_secs = 0;
        } else {
            // In between: hold the current state, and restart both counts.
            self.heavy_secs = 0;
            self.light_secs = 0;
        }
        if !shedding && self.heavy_secs >= self.unready_after {
            true
        } else if shedding && self.light_secs >= self.ready_after {
            false
        } else {
            shedding
        }
    }
}

async fn bookkeeping(
    admission: Arc<Admission>,
    mut hysteresis: Hysteresis,
    gauge: Gauge,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let (mut admitted, mut rejected) = (0, 0);
        for l in &admission.limiters {
            let (a, r) = l.end_second();
            admitted += a;
            rejected += r;
        }
        let total = admitted + rejected;
        let ratio = if total == 0 {
            0.0
        } else {
            rejected as f64 / total as f64
        };
        let was = admission.shedding.load(Ordering::Relaxed);
        let now = hysteresis.observe(ratio, was);
        if now != was {
            tracing::warn!(
                shed_ratio = ratio,
                shedding = now,
                "admission readiness changed"
            );
            admission.shedding.store(now, Ordering::Relaxed);
            gauge.set(if now { 1.0 } else { 0.0 });
        }
    }
}

/// A request was not admitted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rejected {
    pub retry_after: Duration,
}

pub(crate) const PERMITS_IN_USE: Family = Family::gauge(
    "tributary_admission_permits_in_use",
    "Admission permits held by in-flight requests, per route group.",
);
pub(crate) const LIMIT: Family = Family::gauge(
    "tributary_admission_limit",
    "Current admission limit per route group (static, or the adaptive limit).",
);
pub(crate) const WAIT: Family = Family::seconds(
    "tributary_admission_wait_seconds",
    "Time requests waited for an admission permit.",
);
pub(crate) const REJECTIONS: Family = Family::counter(
    "tributary_admission_rejections_total",
    "Requests rejected with 503 by admission control, by group and reason.",
);
pub(crate) const SHEDDING: Family = Family::gauge(
    "tributary_admission_shedding",
    "1 while admission has been shedding heavily (readiness is false), else 0.",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[PERMITS_IN_USE, LIMIT, WAIT, REJECTIONS, SHEDDING];

/// One route group's instruments.
struct Instruments {
    in_use: Gauge,
    limit: Gauge,
    wait: Histogram,
    rejected: Counter,
}

impl Instruments {
    fn register(group: RouteGroup) -> Self {
        let group = group.as_str();
        Self {
            in_use: metrics::gauge!(PERMITS_IN_USE.name, "group" => group),
            limit: metrics::gauge!(LIMIT.name, "group" => group),
            wait: metrics::histogram!(WAIT.name, "group" => group),
            rejected: metrics::counter!(REJECTIONS.name, "group" => group, "reason" => "queue_timeout"),
        }
    }
}

/// The limiter of one route group.
pub struct Limiter {
    semaphore: Arc<Semaphore>,
    limit: AtomicUsize,
    /// Permits to retire as they come back, after the adaptive limit went down by more than
    /// the number of idle permits.
    debt: AtomicUsize,
    in_flight: AtomicUsize,
    waiting: AtomicUsize,
    max_wait: Duration,
    adaptive: Option<Mutex<Gradient2>>,
    /// Completions since start, and an EWMA of completions per second, for `Retry-After`.
    completed: AtomicU64,
    drain_per_sec: Mutex<(u64, f64)>,
    admitted_this_second: AtomicU64,
    rejected_this_second: AtomicU64,
    metrics: Instruments,
}

impl Limiter {
    fn new(
        group: RouteGroup,
        mode: AdmissionMode,
        static_limit: usize,
        max_wait: Duration,
        adaptive: &AdaptiveSettings,
    ) -> Self {
        let (limit, adaptive) = match mode {
            AdmissionMode::Static => (static_limit, None),
            AdmissionMode::Adaptive => (
                adaptive.initial_limit,
                Some(Mutex::new(Gradient2::new(adaptive))),
            ),
        };
        let metrics = Instruments::register(group);
        metrics.limit.set(limit as f64);
        metrics.in_use.set(0.0);
        Self {
            semaphore: Arc::new(Semaphore::new(limit)),
            limit: AtomicUsize::new(limit),
            debt: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            max_wait,
            adaptive,
            completed: AtomicU64::new(0),
            drain_per_sec: Mutex::new((0, 0.0)),
            admitted_this_second: AtomicU64::new(0),
            rejected_this_second: AtomicU64::new(0),
            metrics,
        }
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests waiting for a permit right now (part of the backlog behind `Retry-After`).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Waits at most `max_wait` for a permit.
    pub(crate) async fn acquire(self: &Arc<Self>) -> Result<Permit, Rejected> {
        let started = Instant::now();
        let permit = match Arc::clone(&self.semaphore).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // A guard, not a decrement after the await: a client that disconnects while
                // queued drops this future mid-wait, and a count that only went up would
                // inflate every later Retry-After (backlog / drain rate) for good.
                let waiting = Waiting::new(&self.waiting);
                let waited = tokio::time::timeout(
                    self.max_wait,
                    Arc::clone(&self.semaphore).acquire_owned(),
                )
                .await;
                drop(waiting);
                match waited {
                    Ok(Ok(p)) => p,
                    // Timed out, or (never, the semaphore is not closed) closed.
                    _ => {
                        self.metrics.wait.record(started.elapsed().as_secs_f64());
                        self.metrics.rejected.increment(1);
                        self.rejected_this_second.fetch_add(1, Ordering::Relaxed);
                        return Err(Rejected {
                            retry_after: self.retry_after(),
                        });
                    }
                }
            }
        };
        self.metrics.wait.record(started.elapsed().as_secs_f64());
        self.admitted_this_second.fetch_add(1, Ordering::Relaxed);
        let n = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.metrics.in_use.set(n as f64);
        Ok(Permit {
            limiter: Arc::clone(self),
            permit: Some(permit),
            started: Instant::now(),
        })
    }

    /// How long the current backlog needs to drain at the observed completion rate.
    fn retry_after(&self) -> Duration {
        let rate = self
            .drain_per_sec
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1;
        let backlog = (self.in_flight() + self.waiting.load(Ordering::Relaxed)) as f64;
        let secs = if rate > 0.5 { backlog / rate } else { 5.0 };
        Duration::from_secs_f64(secs.clamp(1.0, 30.0))
    }

    /// Closes the current one-second window: updates the drain rate and returns the
    /// window's (admitted, rejected) counts.
    fn end_second(&self) -> (u64, u64) {
        let completed = self.completed.load(Ordering::Relaxed);
        let mut d = self.drain_per_sec.lock().unwrap_or_else(|p| p.into_inner());
        let this_second = completed.saturating_sub(d.0) as f64;
        d.1 = if d.1 == 0.0 {
            this_second
        } else {
            0.7 * d.1 + 0.3 * this_second
        };
        d.0 = completed;
        drop(d);
        (
            self.admitted_this_second.swap(0, Ordering::Relaxed),
            self.rejected_this_second.swap(0, Ordering::Relaxed),
        )
    }

    fn release(&self, permit: OwnedSemaphorePermit, latency: Duration) {
        let n = self.in_flight.fetch_sub(1, Ordering::Relaxed) - 1;
        self.metrics.in_use.set(n as f64);
        self.completed.fetch_add(1, Ordering::Relaxed);
        let retire = self
            .debt
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| d.checked_sub(1))
            .is_ok();
        if retire {
            permit.forget();
        } else {
            drop(permit);
        }
        if let Some(adaptive) = &self.adaptive {
            let new_limit = adaptive.lock().unwrap_or_else(|p| p.into_inner()).sample(
                latency,
                n + 1,
                self.limit(),
            );
            if let Some(new_limit) = new_limit {
                self.set_limit(new_limit);
            }
        }
    }

    fn set_limit(&self, new: usize) {
        let old = self.limit.swap(new, Ordering::Relaxed);
        if new > old {
            let mut grow = new - old;
            // Cancel outstanding debt first, then add real permits.
            let _ = self
                .debt
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                    let cancel = d.min(grow);
                    grow -= cancel;
                    Some(d - cancel)
                });
            self.semaphore.add_permits(grow);
        } else if new < old {
            let shrink = old - new;
            let forgotten = self.semaphore.forget_permits(shrink);
            self.debt.fetch_add(shrink - forgotten, Ordering::Relaxed);
        }
        self.metrics.limit.set(new as f64);
    }
}

/// Counts one request as waiting for a permit for as long as it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An admitted request's slot; returned on drop, however the request ends.
pub(crate) struct Permit {
    limiter: Arc<Limiter>,
    permit: Option<OwnedSemaphorePermit>,
    started: Instant,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(p) = self.permit.take() {
            self.limiter.release(p, self.started.elapsed());
        }
    }
}

/// Netflix's Gradient2: compare the short-term latency with a long-term baseline; while they
/// agree (within `tolerance`) the limit grows by about √limit per window, when latency rises
/// the limit shrinks proportionally (never below half per step). Samples are averaged over
/// windows of at least 100 ms and 10 requests, so one slow request does not move it.
pub(crate) struct Gradient2 {
    min: f64,
    max: f64,
    tolerance: f64,
    smoothing: f64,
    limit: f64,
    long_rtt: Option<f64>,
    window_started: Instant,
    window_sum: f64,
    window_n: u32,
    window_max_in_flight: usize,
}

impl Gradient2 {
    const WINDOW: Duration = Duration::from_millis(100);
    const MIN_SAMPLES: u32 = 10;
    const LONG_WINDOW: f64 = 600.0;

    pub(crate) fn new(s: &AdaptiveSettings) -> Self {
        Self {
            min: s.min_limit.get() as f64,
            max: s.max_limit as f64,
            tolerance: s.tolerance,
            smoothing: s.smoothing.get(),
            limit: s.initial_limit as f64,
            long_rtt: None,
            window_started: Instant::now(),
            window_sum: 0.0,
            window_n: 0,
            window_max_in_flight: 0,
        }
    }

    /// Feeds one completed request; returns a new limit when a window closes.
    pub(crate) fn sample(
        &mut self,
        rtt: Duration,
        in_flight: usize,
        _current: usize,
    ) -> Option<usize> {
        self.window_sum += rtt.as_secs_f64();
        self.window_n += 1;
        self.window_max_in_flight = self.window_max_in_flight.max(in_flight);
        if self.window_n < Self::MIN_SAMPLES || self.window_started.elapsed() < Self::WINDOW {
            return None;
        }
        let short = self.window_sum / f64::from(self.window_n);
        let max_in_flight = self.window_max_in_flight;
        self.window_started = Instant::now();
        self.window_sum = 0.0;
        self.window_n = 0;
        self.window_max_in_flight = 0;

        let long = match self.long_rtt {
            None => short,
            Some(long) => long + (short - long) / Self::LONG_WINDOW,
        };
        // After a sustained shift the baseline decays towards the new normal faster.
        let long = if long / short > 2.0 {
            long * 0.95
        } else {
            long
        };
        self.long_rtt = Some(long);

        // Application-limited: too little traffic to learn anything about capacity.
        if (max_in_flight as f64) < self.limit / 2.0 {
            return None;
        }
        let gradient = (self.tolerance * long / short).clamp(0.5, 1.0);
        let queue = self.limit.sqrt();
        let target = self.limit * gradient + queue;
        let next = (self.limit * (1.0 - self.smoothing) + target * self.smoothing)
            .clamp(self.min, self.max);
        self.limit = next;
        Some(next.round() as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> AdaptiveSettings {
        AdaptiveSettings {
            initial_limit: 100,
            min_limit: std::num::NonZeroUsize::new(10).unwrap(),
            max_limit: 1000,
            tolerance: 1.5,
            smoothing: crate::config::Ratio::of(0.2),
        }
    }

    /// Feeds `windows` windows of requests at a fixed latency with the limit saturated.
    async fn feed(g: &mut Gradient2, rtt_ms: u64, windows: usize) -> usize {
        let mut last = g.limit as usize;
        for _ in 0..windows {
            for _ in 0..Gradient2::MIN_SAMPLES {
                if let Some(l) = g.sample(Duration::from_millis(rtt_ms), last, last) {
                    last = l;
                }
            }
            tokio::time::advance(Gradient2::WINDOW).await;
        }
        last
    }

    #[tokio::test(start_paused = true)]
    async fn steady_latency_grows_the_limit_and_a_latency_spike_shrinks_it() {
        let mut g = Gradient2::new(&settings());
        let grown = feed(&mut g, 20, 30).await;
        assert!(
            grown > 100,
            "limit should grow under steady latency, got {grown}"
        );
        let shrunk = feed(&mut g, 200, 30).await;
        assert!(
            shrunk < grown,
            "limit should shrink when latency rises: {grown} -> {shrunk}"
        );
        assert!(shrunk >= 10, "never below min_limit");
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_application_does_not_grow_the_limit() {
        let mut g = Gradient2::new(&settings());
        for _ in 0..30 {
            for _ in 0..Gradient2::MIN_SAMPLES {
                assert_eq!(g.sample(Duration::from_millis(5), 3, 100), None);
            }
            tokio::time::advance(Gradient2::WINDOW).await;
        }
    }

    #[test]
    fn hysteresis_needs_sustained_heavy_then_sustained_light_shedding() {
        let mut s = Settings::default();
        s.admission.unready_after_secs = 2;
        s.admission.ready_after_secs = 3;
        let mut h = Hysteresis::new(&s);
        let mut shedding = false;
        shedding = h.observe(0.9, shedding);
        assert!(!shedding, "one heavy second is not enough");
        shedding = h.observe(0.9, shedding);
        assert!(shedding);
        for _ in 0..2 {
            shedding = h.observe(0.0, shedding);
            assert!(shedding, "recovery needs ready_after_secs light seconds");
        }
        shedding = h.observe(0.2, shedding);
        assert!(
            shedding,
            "a moderate second holds the state and restarts the count"
        );
        for _ in 0..3 {
            shedding = h.observe(0.0, shedding);
        }
        assert!(!shedding);
    }

    #[tokio::test]
    async fn permits_are_returned_on_drop_and_excess_is_rejected() {
        let l = Arc::new(Limiter::new(
            RouteGroup::Dashboard,
            AdmissionMode::Static,
            2,
            Duration::from_millis(5),
            &settings(),
        ));
        let a = l.acquire().await.unwrap();
        let _b = l.acquire().await.unwrap();
        let Err(rejected) = l.acquire().await else {
            panic!("a third request must be rejected");
        };
        assert!(rejected.retry_after >= Duration::from_secs(1));
        drop(a);
        assert_eq!(l.in_flight(), 1);
        let _c = l.acquire().await.expect("a returned permit is reusable");
    }

    #[tokio::test]
    async fn shrinking_below_the_permits_in_use_retires_them_as_they_return() {
        let l = Arc::new(Limiter::new(
            RouteGroup::Dashboard,
            AdmissionMode::Static,
            3,
            Duration::from_millis(1),
            &settings(),
        ));
        let held: Vec<_> = futures::future::join_all((0..3).map(|_| l.acquire()))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        l.set_limit(1);
        drop(held);
        assert_eq!(l.semaphore.available_permits(), 1);
        l.set_limit(4);
        assert_eq!(l.semaphore.available_permits(), 4);
    }
}
