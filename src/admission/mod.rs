//! Admission control: a bounded number of requests in flight, a bounded wait for a slot, and a
//! fast, explicit "no" beyond that.
//!
//! Cheap concurrency removes the thread-pool cap that used to protect everything behind the
//! gateway; without a limit the gateway admits everything, queues it in the downstreams and the
//! database pool, and every request gets slow at once (an avalanche). The cure is a semaphore
//! with a short bounded wait in front. This is that semaphore, per route group, with what it
//! takes for it to hold under any overload, on any pod size, without a number to tune:
//!
//! - **the limit is learnt, not guessed** (`admission.mode = "adaptive"`, the default): it
//!   follows the runtime's queueing delay ([`crate::overload`], [`limit::QueueDelayLimit`]), so
//!   it settles where the core is just busy. A fixed 2,000 is ten times what one core carries,
//!   and past that every admitted request queues for the CPU. A cut for the core's queue that
//!   did not shorten it (a queue made of the rejections themselves) is undone
//!   (`overload.check_core_cuts`). `static` and `gradient2` remain;
//! - **a "no" costs almost nothing and comes at once when waiting cannot help**: while the
//!   runtime has been saturated for two windows in a row (one is a burst that a short wait
//!   rides out: a fresh pod's first second, clients coming back together), or more requests
//!   already wait than the recent release rate returns within `max_wait`, a
//!   request without a permit is turned away without arming a timer. The decision
//!   ([`Limiter::try_admit`]) is synchronous, and the edge (`http::edge`) takes it before any
//!   other work on the request;
//! - **a queue that never empties is kept short** (`admission.standing_wait`, 30 ms): when
//!   over a whole control interval requests found no permit free and none was admitted
//!   without waiting, waiting buys no throughput (a waiter is always there to take a returned
//!   permit) and only adds the queue's length to every admitted request's latency. The queue
//!   is then kept to what the release rate serves within half of 30 ms instead of half of
//!   `max_wait`, and the rest are turned away at once, until most requests find a permit free
//!   again (CoDel's test, and Facebook's "controlled delay" for server queues). The length is
//!   cut, not the timeout: a waiter timed out at 10 ms would be a 503 that took 10 ms (the
//!   lab's first version made 1–7 % of 503s so). Under overload on a whole core it cut the
//!   admitted requests' mean wait from 15–29 ms to 5–12 ms at the same goodput; a 10 ms
//!   setting went too far: clients that honour `Retry-After`, turned away at once more often,
//!   stayed away while permits went idle (12–19 % less goodput);
//! - `Retry-After` comes from the observed drain rate and the whole backlog, including the
//!   demand turned away in the last second, so clients back off about as long as it needs to
//!   clear, spread by ±50 % so that they do not all come back at once;
//! - readiness turns false while shedding stays heavy, and comes back only after it has stayed
//!   light for a while (hysteresis), so the load balancer and an autoscaler see a stable signal.
//!
//! Permits are RAII guards: a request that ends in any way — response, error, panic, client
//! disconnect — returns its permit, so in-flight counts always go back to zero.
//!
//! The limiter, its control loop and readiness stay in this file (over 500 lines, a fifth of
//! them tests): they share the limiter's counters, and the decision reads best beside the
//! bookkeeping that feeds it. The algorithms that move the limit are in [`limit`].

pub(crate) mod limit;

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
    config::{AdmissionMode, RouteGroup, Settings},
    overload::{QueueDelay, StandingQueue},
    telemetry::Family,
};
use limit::{CoreCuts, Gradient2, Interval, QueueDelayLimit, Step};

/// How often the adaptive limit is updated and the wait queue's state reconsidered.
pub(crate) const CONTROL_INTERVAL: Duration = Duration::from_millis(100);
/// Readiness and the drain rate are updated once per this many control intervals (1 s).
const TICKS_PER_SECOND: u32 = 10;
/// At most one "shedding" warning per this long; the counters have the rest.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// The share of the permits expected back within `max_wait` that may be waited for. At the
/// whole expected number the last waiter is due exactly at `max_wait`, so every dip in the
/// release rate times waiters out, each a 503 that cost `max_wait` instead of nothing (the
/// lab saw 1–3 % of 503s take 100 ms); at half, a waiter is due by `max_wait / 2`.
const WAIT_ROOM_SHARE: f64 = 0.5;

/// The limiters of all groups plus the shared readiness signal.
pub struct Admission {
    /// One per route group, indexed by it.
    limiters: [Arc<Limiter>; 2],
    shedding: Arc<AtomicBool>,
    /// Queues inside the gateway that admitted requests wait in (the database pool's): while
    /// one stands, the adaptive limit treats it as it treats a saturated core.
    inner: Vec<StandingQueue>,
    /// The core's queueing delay: an inner queue's window in which the core was saturated is
    /// not judged (see [`StandingQueue::close_window`]).
    queue_delay: QueueDelay,
    /// The target both are judged against (`overload.queue_delay_target`).
    target: Duration,
}

impl Admission {
    /// Builds one limiter per group and starts the control task (every 100 ms: the adaptive
    /// limit; every second: drain rate and readiness), which stops when `shutdown` is
    /// cancelled.
    pub(crate) fn new(
        settings: &Settings,
        queue_delay: &QueueDelay,
        inner: Vec<StandingQueue>,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let this = Self::build(settings, queue_delay, inner);
        let hysteresis = Hysteresis::new(settings);
        tokio::spawn(control(Arc::clone(&this), hysteresis, shutdown));
        this
    }

    fn build(
        settings: &Settings,
        queue_delay: &QueueDelay,
        inner: Vec<StandingQueue>,
    ) -> Arc<Self> {
        metrics::gauge!(SHEDDING.name).set(0.0);
        let limiters = RouteGroup::ALL.map(|group| {
            let (limit, max_wait) = settings.admission_for(group);
            let controller = match settings.admission.mode {
                AdmissionMode::Static => Controller::Static(limit.get()),
                AdmissionMode::Adaptive => Controller::QueueDelay(Mutex::new(
                    QueueDelayLimit::new(
                        &settings.admission.adaptive,
                        queue_delay.target(),
                        CoreCuts::of(
                            settings.overload.check_core_cuts,
                            settings.overload.probe_past_core,
                        ),
                    )
                    .settling_after_cuts(settings.overload.settle_after_cut),
                )),
                AdmissionMode::Gradient2 => {
                    Controller::Gradient2(Mutex::new(Gradient2::new(&settings.admission.adaptive)))
                }
            };
            Arc::new(Limiter::new(
                group,
                controller,
                Waits {
                    max: max_wait,
                    standing: settings
                        .admission
                        .standing_wait
                        .map_or(max_wait, |w| w.min(max_wait)),
                },
                queue_delay.clone(),
            ))
        });
        Arc::new(Self {
            limiters,
            shedding: Arc::new(AtomicBool::new(false)),
            inner,
            queue_delay: queue_delay.clone(),
            target: queue_delay.target(),
        })
    }

    pub fn limiter(&self, group: RouteGroup) -> Arc<Limiter> {
        Arc::clone(&self.limiters[group as usize])
    }

    /// True while shedding has been heavy (readiness reports not-ready).
    pub fn is_shedding(&self) -> bool {
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

async fn control(
    admission: Arc<Admission>,
    mut hysteresis: Hysteresis,
    shutdown: CancellationToken,
) {
    let gauge = metrics::gauge!(SHEDDING.name);
    let mut tick = tokio::time::interval(CONTROL_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut ticks = 0u32;
    let mut last_warning: Option<Instant> = None;
    let mut window_started = Instant::now();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        // The waits that ended in this window were slowed by the core's own queue if it was
        // saturated during the window (or just before: such a wait may have begun then).
        let core_queued = admission.queue_delay.saturated_since(window_started);
        window_started = now;
        // Every queue's window is closed, not just the first standing one.
        let inner_standing = admission.inner.iter().fold(false, |any, q| {
            q.close_window(admission.target, core_queued) | any
        });
        for l in &admission.limiters {
            l.end_interval(now, inner_standing);
        }
        ticks += 1;
        if ticks < TICKS_PER_SECOND {
            continue;
        }
        ticks = 0;
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
        if rejected > 0 && last_warning.is_none_or(|t| now.duration_since(t) >= WARN_EVERY) {
            last_warning = Some(now);
            let [dashboard, orders] = admission.limiters.each_ref().map(|l| l.limit());
            tracing::warn!(
                rejected_per_sec = rejected,
                shed_ratio = ratio,
                dashboard_limit = dashboard,
                orders_limit = orders,
                "admission is shedding load"
            );
        }
        let was = admission.shedding.load(Ordering::Relaxed);
        let now_shedding = hysteresis.observe(ratio, was);
        if now_shedding != was {
            tracing::warn!(
                shed_ratio = ratio,
                shedding = now_shedding,
                "admission heavy-shedding state changed"
            );
            admission.shedding.store(now_shedding, Ordering::Relaxed);
            gauge.set(if now_shedding { 1.0 } else { 0.0 });
        }
    }
}

/// A request was not admitted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rejected {
    pub(crate) retry_after: Duration,
}

/// Why a request was turned away; also the `reason` metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// No permit, and waiting could not help: no wait is configured, the runtime has been
    /// saturated for two windows, or more already wait than the recent release rate returns within `max_wait`.
    Overloaded = 0,
    /// Waited `max_wait` for a permit without getting one.
    QueueTimeout = 1,
}

impl Reason {
    const ALL: [Reason; 2] = [Reason::Overloaded, Reason::QueueTimeout];

    fn as_str(self) -> &'static str {
        match self {
            Reason::Overloaded => "overloaded",
            Reason::QueueTimeout => "queue_timeout",
        }
    }
}

/// Which queue made the adaptive limit go down; also the `cause` metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// The runtime's queueing delay was over target.
    Core = 0,
    /// Every wait for a database connection was over it.
    DbPool = 1,
    Both = 2,
}

impl Cause {
    const ALL: [Cause; 3] = [Cause::Core, Cause::DbPool, Cause::Both];

    fn of(core: bool, db_pool: bool) -> Self {
        match (core, db_pool) {
            (true, false) => Cause::Core,
            (false, true) => Cause::DbPool,
            _ => Cause::Both,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Cause::Core => "core",
            Cause::DbPool => "db_pool",
            Cause::Both => "both",
        }
    }
}

/// The synchronous half of admission.
pub(crate) enum Decision {
    Admitted(Permit),
    Rejected(Rejected),
    /// No permit now, but one may come within `max_wait`: call [`Limiter::wait`].
    Wait,
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
    "Requests rejected with 503 by admission control, by group and reason (overloaded: no permit and waiting could not help; queue_timeout: waited max_wait).",
);
pub(crate) const DECREASES: Family = Family::counter(
    "tributary_admission_limit_decreases_total",
    "Cuts of the adaptive limit, by group and cause (core: the runtime's queueing delay was over target; db_pool: every wait for a database connection was, or they averaged over twice it; both).",
);
pub(crate) const CUTS_UNDONE: Family = Family::counter(
    "tributary_admission_limit_cuts_undone_total",
    "Cuts of the adaptive limit for the core's queue alone that were undone because the queue did not shorten (overload.check_core_cuts).",
);
pub(crate) const QUEUE_STANDING: Family = Family::gauge(
    "tributary_admission_queue_standing",
    "1 while a group's wait queue has stood (requests found no permit and none was admitted without waiting) for a whole control interval and is kept to what returns within admission.standing_wait; always 0 while that is off (unset, or at least max_wait).",
);
pub(crate) const SHEDDING: Family = Family::gauge(
    "tributary_admission_shedding",
    "1 while admission has been shedding heavily (with admission.shedding_turns_unready, readiness is then false), else 0.",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[
    PERMITS_IN_USE,
    LIMIT,
    WAIT,
    REJECTIONS,
    DECREASES,
    CUTS_UNDONE,
    QUEUE_STANDING,
    SHEDDING,
];

/// One route group's instruments.
struct Instruments {
    in_use: Gauge,
    limit: Gauge,
    wait: Histogram,
    rejected: [Counter; 2],
    /// Indexed by [`Cause`].
    decreases: [Counter; 3],
    cuts_undone: Counter,
    standing: Gauge,
}

impl Instruments {
    fn register(group: RouteGroup) -> Self {
        let group = group.as_str();
        let rejected = Reason::ALL
            .map(|r| metrics::counter!(REJECTIONS.name, "group" => group, "reason" => r.as_str()));
        for c in &rejected {
            // Present from the start, so `rate()` sees the first increase.
            c.increment(0);
        }
        let decreases = Cause::ALL
            .map(|c| metrics::counter!(DECREASES.name, "group" => group, "cause" => c.as_str()));
        for c in &decreases {
            c.increment(0);
        }
        let cuts_undone = metrics::counter!(CUTS_UNDONE.name, "group" => group);
        cuts_undone.increment(0);
        let standing = metrics::gauge!(QUEUE_STANDING.name, "group" => group);
        standing.set(0.0);
        Self {
            in_use: metrics::gauge!(PERMITS_IN_USE.name, "group" => group),
            limit: metrics::gauge!(LIMIT.name, "group" => group),
            wait: metrics::histogram!(WAIT.name, "group" => group),
            rejected,
            decreases,
            cuts_undone,
            standing,
        }
    }
}

/// What moves the limit.
enum Controller {
    Static(usize),
    QueueDelay(Mutex<QueueDelayLimit>),
    Gradient2(Mutex<Gradient2>),
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
    waits: Waits,
    /// Requests admitted without waiting this control interval: the wait queue was empty at
    /// that moment (a returned permit goes to a waiter before anyone else).
    at_once: AtomicU64,
    /// The wait queue stands: over a whole control interval requests found no permit free and
    /// none was admitted without waiting. The wait room is then sized for `waits.standing`, until an
    /// interval in which more requests found a permit free than found none (a hysteresis: a
    /// queue capped this short empties now and then under any sustained overload, and lifting
    /// the cap at the first such moment let the next interval's waiters queue up to
    /// `max_wait` again; the lab's first version did, and halved the gain).
    standing: AtomicBool,
    controller: Controller,
    queue_delay: QueueDelay,
    /// How many may wait: [`WAIT_ROOM_SHARE`] of the permits expected back within the current
    /// longest wait at the recent release rate. A request that would queue behind more would likely time
    /// out anyway, so it is turned away at once, with no timer armed. `u64::MAX` until a permit was ever returned
    /// (nothing is known about the rate yet).
    wait_room: AtomicU64,
    /// Permits returned this control interval, and their EWMA per interval.
    released: AtomicU64,
    release_rate: Mutex<Option<f64>>,
    /// This control interval: the most permits held at once, and how many requests found no
    /// permit free.
    peak_in_flight: AtomicUsize,
    found_none: AtomicU64,
    /// Completions since start, and an EWMA of completions per second, for `Retry-After`.
    completed: AtomicU64,
    drain_per_sec: Mutex<(u64, f64)>,
    admitted_this_second: AtomicU64,
    rejected_this_second: AtomicU64,
    rejected_last_second: AtomicU64,
    rejected_total: AtomicU64,
    metrics: Instruments,
}

impl Limiter {
    fn new(
        group: RouteGroup,
        controller: Controller,
        waits: Waits,
        queue_delay: QueueDelay,
    ) -> Self {
        let limit = match &controller {
            Controller::Static(limit) => *limit,
            Controller::QueueDelay(c) => c.lock().unwrap_or_else(|p| p.into_inner()).limit(),
            Controller::Gradient2(c) => c.lock().unwrap_or_else(|p| p.into_inner()).limit(),
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
            waits,
            at_once: AtomicU64::new(0),
            standing: AtomicBool::new(false),
            controller,
            queue_delay,
            wait_room: AtomicU64::new(u64::MAX),
            peak_in_flight: AtomicUsize::new(0),
            released: AtomicU64::new(0),
            release_rate: Mutex::new(None),
            found_none: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            drain_per_sec: Mutex::new((0, 0.0)),
            admitted_this_second: AtomicU64::new(0),
            rejected_this_second: AtomicU64::new(0),
            rejected_last_second: AtomicU64::new(0),
            rejected_total: AtomicU64::new(0),
            metrics,
        }
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests this limiter turned away since it was built.
    pub fn rejected(&self) -> u64 {
        self.rejected_total.load(Ordering::Relaxed)
    }

    /// Requests waiting for a permit right now (part of the backlog behind `Retry-After`).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Whether the wait queue stands (see the field).
    #[cfg(test)]
    fn is_standing(&self) -> bool {
        self.standing.load(Ordering::Relaxed)
    }

    /// The decision without waiting: a permit, a rejection when waiting could not help, or
    /// [`Decision::Wait`]. No timer, no allocation beyond the permit's.
    pub(crate) fn try_admit(self: &Arc<Self>) -> Decision {
        if let Ok(permit) = Arc::clone(&self.semaphore).try_acquire_owned() {
            self.metrics.wait.record(0.0);
            if self.waits.cuts_standing() {
                self.at_once.fetch_add(1, Ordering::Relaxed);
            }
            return Decision::Admitted(self.admitted(permit));
        }
        self.found_none.fetch_add(1, Ordering::Relaxed);
        if self.waits.max.is_zero()
            || self.waiting() as u64 >= self.wait_room.load(Ordering::Relaxed)
            || self.queue_delay.stays_saturated()
        {
            return Decision::Rejected(self.reject(Reason::Overloaded));
        }
        Decision::Wait
    }

    /// [`Limiter::try_admit`] for the admission micro-benchmark in `benches/`, which cannot
    /// name the crate-private [`Decision`]: the permit when admitted (dropping it releases
    /// it), `None` when turned away or told to wait. Not an API.
    #[doc(hidden)]
    pub fn try_admit_for_bench(self: &Arc<Self>) -> Option<impl Sized + use<>> {
        match self.try_admit() {
            Decision::Admitted(permit) => Some(permit),
            Decision::Rejected(_) | Decision::Wait => None,
        }
    }

    /// Waits at most `max_wait` for a permit, after [`Limiter::try_admit`] said so.
    pub(crate) async fn wait(self: &Arc<Self>) -> Result<Permit, Rejected> {
        let started = Instant::now();
        // A guard, not a decrement after the await: a client that disconnects while queued
        // drops this future mid-wait, and a count that only went up would inflate every later
        // Retry-After (backlog / drain rate) for good.
        let waiting = Waiting::new(&self.waiting);
        let waited =
            tokio::time::timeout(self.waits.max, Arc::clone(&self.semaphore).acquire_owned()).await;
        drop(waiting);
        self.metrics.wait.record(started.elapsed().as_secs_f64());
        match waited {
            Ok(Ok(permit)) => Ok(self.admitted(permit)),
            // Timed out, or (never, the semaphore is not closed) closed.
            _ => Err(self.reject(Reason::QueueTimeout)),
        }
    }

    /// Both halves in one; for tests.
    #[cfg(test)]
    pub(crate) async fn acquire(self: &Arc<Self>) -> Result<Permit, Rejected> {
        match self.try_admit() {
            Decision::Admitted(p) => Ok(p),
            Decision::Rejected(r) => Err(r),
            Decision::Wait => self.wait().await,
        }
    }

    fn admitted(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Permit {
        self.admitted_this_second.fetch_add(1, Ordering::Relaxed);
        let n = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak_in_flight.fetch_max(n, Ordering::Relaxed);
        self.metrics.in_use.set(n as f64);
        Permit {
            limiter: Arc::clone(self),
            permit: Some(permit),
            started: Instant::now(),
        }
    }

    fn reject(&self, reason: Reason) -> Rejected {
        self.metrics.rejected[reason as usize].increment(1);
        self.rejected_this_second.fetch_add(1, Ordering::Relaxed);
        self.rejected_total.fetch_add(1, Ordering::Relaxed);
        Rejected {
            retry_after: self.retry_after(),
        }
    }

    /// How long the current backlog needs to drain at the observed completion rate. The
    /// backlog is everyone holding or waiting for a permit plus the demand turned away in the
    /// last second: those clients come back too, and a `Retry-After` that ignored them would
    /// send them all back into the same full limiter.
    fn retry_after(&self) -> Duration {
        let rate = self
            .drain_per_sec
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1;
        let backlog = (self.in_flight() + self.waiting()) as f64
            + self.rejected_last_second.load(Ordering::Relaxed) as f64;
        let secs = if rate > 0.5 { backlog / rate } else { 5.0 };
        // Spread over ±50 %: clients turned away in the same second must not all come back in
        // the same second (a herd that a full limiter turns away again).
        let spread = 0.5 + rand::random::<f64>();
        Duration::from_secs_f64((secs * spread).clamp(1.0, 30.0))
    }

    /// Closes one control interval: whether the wait queue can drain, and the adaptive limit
    /// (`inner_standing`: an inner queue, such as the database pool's, stood over it).
    fn end_interval(&self, now: Instant, inner_standing: bool) {
        let in_flight = self.in_flight();
        let peak = self.peak_in_flight.swap(in_flight, Ordering::Relaxed);
        let found_none = self.found_none.swap(0, Ordering::Relaxed);
        let at_once = self.at_once.swap(0, Ordering::Relaxed);
        let limited = found_none > 0;
        let was = self.standing.load(Ordering::Relaxed);
        // It starts to stand when requests found no permit and not one found it free (the
        // queue never emptied), and stops when most found one free. Not followed when
        // `standing_wait` is unset: nothing would change, and `at_once` is not counted.
        let standing = if !self.waits.cuts_standing() {
            false
        } else if was {
            at_once <= found_none
        } else {
            limited && at_once == 0
        };
        if standing != self.standing.swap(standing, Ordering::Relaxed) {
            self.metrics.standing.set(if standing { 1.0 } else { 0.0 });
        }
        let released = self.released.swap(0, Ordering::Relaxed) as f64;
        let mut rate = self.release_rate.lock().unwrap_or_else(|p| p.into_inner());
        let known = rate.is_some() || released > 0.0;
        let smoothed = rate.map_or(released, |r| 0.5 * r + 0.5 * released);
        if known {
            *rate = Some(smoothed);
            // A standing queue is kept to what returns within the standing wait.
            let wait = if standing {
                self.waits.standing
            } else {
                self.waits.max
            };
            let intervals = wait.as_secs_f64() / CONTROL_INTERVAL.as_secs_f64();
            self.wait_room.store(
                (smoothed * intervals * WAIT_ROOM_SHARE).floor() as u64,
                Ordering::Relaxed,
            );
        }
        drop(rate);
        if let Controller::QueueDelay(c) = &self.controller {
            let core = self.queue_delay.stays_saturated();
            let seen = Interval {
                core,
                core_window: self.queue_delay.is_saturated(),
                inner: inner_standing,
                delay: self.queue_delay.current(),
                peak_in_flight: peak,
                limited,
            };
            let step = c
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .update(now, seen);
            match step {
                Step::Held => {}
                Step::Cut(limit) => {
                    // Which queue said "too much": the answer to "why did the limit go down?".
                    self.metrics.decreases[Cause::of(core, inner_standing) as usize].increment(1);
                    self.set_limit(limit);
                }
                Step::Undone(limit) => {
                    self.metrics.cuts_undone.increment(1);
                    self.set_limit(limit);
                }
                Step::Grew(limit) => self.set_limit(limit),
            }
        }
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
        let rejected = self.rejected_this_second.swap(0, Ordering::Relaxed);
        self.rejected_last_second.store(rejected, Ordering::Relaxed);
        (
            self.admitted_this_second.swap(0, Ordering::Relaxed),
            rejected,
        )
    }

    fn release(&self, permit: OwnedSemaphorePermit, held: Duration) {
        let n = self.in_flight.fetch_sub(1, Ordering::Relaxed) - 1;
        self.metrics.in_use.set(n as f64);
        self.completed.fetch_add(1, Ordering::Relaxed);
        self.released.fetch_add(1, Ordering::Relaxed);
        let retire = self
            .debt
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| d.checked_sub(1))
            .is_ok();
        if retire {
            permit.forget();
        } else {
            drop(permit);
        }
        match &self.controller {
            Controller::Static(_) => {}
            Controller::QueueDelay(c) => c.lock().unwrap_or_else(|p| p.into_inner()).sample(held),
            Controller::Gradient2(c) => {
                let new_limit = c
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .sample(held, n + 1);
                if let Some(new_limit) = new_limit {
                    self.set_limit(new_limit);
                }
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

/// How long a request may wait for a permit.
#[derive(Debug, Clone, Copy)]
struct Waits {
    /// `admission.max_wait` (or the group's).
    max: Duration,
    /// `admission.standing_wait`, at most `max` (`max` when unset): the wait room's horizon
    /// while the queue stands.
    standing: Duration,
}

impl Waits {
    /// Whether a standing queue is kept shorter than `max_wait` allows (`standing_wait` set
    /// below it); if not, the standing state is not followed at all.
    fn cuts_standing(self) -> bool {
        self.standing < self.max
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

#[cfg(test)]
mod tests {
    use super::*;

    const TARGET: Duration = Duration::from_millis(5);

    fn limiter(
        mode: AdmissionMode,
        limit: usize,
        max_wait: Duration,
    ) -> (Arc<Limiter>, QueueDelay) {
        let mut s = Settings::default();
        s.admission.mode = mode;
        s.admission.max_in_flight = std::num::NonZeroUsize::new(limit).unwrap();
        s.admission.adaptive.initial_limit = limit;
        s.admission.adaptive.min_limit = std::num::NonZeroUsize::new(1).unwrap();
        s.admission.max_wait = max_wait;
        // `standing_wait` as shipped (30 ms): the tests below count with it.
        let q = QueueDelay::manual(TARGET);
        let a = Admission::build(&s, &q, Vec::new());
        (a.limiter(RouteGroup::Dashboard), q)
    }

    /// Takes `n` permits at once; each must be granted.
    async fn hold(l: &Arc<Limiter>, n: usize) -> Vec<Permit> {
        futures::future::join_all((0..n).map(|_| l.acquire()))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect()
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
        let (l, _q) = limiter(AdmissionMode::Static, 2, Duration::from_millis(5));
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
        let (l, _q) = limiter(AdmissionMode::Static, 3, Duration::from_millis(1));
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

    #[tokio::test(start_paused = true)]
    async fn a_saturated_runtime_turns_requests_away_without_a_wait() {
        let (l, q) = limiter(AdmissionMode::Static, 1, Duration::from_secs(1));
        let _held = l.acquire().await.unwrap();
        assert!(
            matches!(l.try_admit(), Decision::Wait),
            "calm: worth a wait"
        );
        q.observe_window(Duration::from_millis(50), 1.0);
        assert!(
            matches!(l.try_admit(), Decision::Wait),
            "one saturated window is a burst: a short wait still helps"
        );
        tokio::time::advance(crate::overload::WINDOW).await;
        q.observe_window(Duration::from_millis(50), 1.0);
        assert!(
            matches!(l.try_admit(), Decision::Rejected(_)),
            "saturated two windows in a row: no timer armed, an immediate no"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_queue_longer_than_max_wait_can_drain_turns_new_requests_away() {
        let (l, _q) = limiter(AdmissionMode::Static, 1, CONTROL_INTERVAL * 2);
        // Before any permit came back nothing is known: waiting is allowed.
        let held = l.acquire().await.unwrap();
        assert!(matches!(l.try_admit(), Decision::Wait));
        drop(held);
        // One permit returned per interval and max_wait two intervals: two are expected back
        // within max_wait, and half of that may be waited for (the second would be due at
        // max_wait itself, and any dip in the rate would time it out): one may wait.
        l.end_interval(Instant::now(), false);
        let held = l.acquire().await.unwrap();
        let waiter = {
            let l = Arc::clone(&l);
            tokio::spawn(async move { l.wait().await.is_ok() })
        };
        tokio::task::yield_now().await;
        assert_eq!(l.waiting(), 1);
        assert!(
            matches!(l.try_admit(), Decision::Rejected(_)),
            "a second waiter would not get a permit within max_wait"
        );
        drop(held);
        assert!(
            waiter.await.unwrap(),
            "the one already waiting still gets the permit"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_queue_that_never_empties_is_kept_short_until_a_permit_is_found_free() {
        let max_wait = Duration::from_secs(1);
        let (l, _q) = limiter(AdmissionMode::Static, 40, max_wait);
        let held = hold(&l, 40).await;
        l.end_interval(Instant::now(), false);
        // This interval: one request finds no permit and waits; the 40 come back, one to it
        // and 39 free; nobody is admitted without waiting. The queue stood.
        let first = {
            let l = Arc::clone(&l);
            tokio::spawn(async move {
                assert!(matches!(l.try_admit(), Decision::Wait));
                l.wait().await
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(l.waiting(), 1);
        drop(held);
        let first = first
            .await
            .unwrap()
            .expect("a returned permit goes to the waiter");
        l.end_interval(Instant::now(), false);
        assert!(l.is_standing());

        // Next interval, every permit held again. 40 permits come back per interval (100 ms):
        // over max_wait (1 s) that is 400, half of which may wait; within the shipped
        // standing_wait (30 ms) 12, so 6 may wait, and the seventh is turned away at once.
        let rest = hold(&l, 39).await;
        let waiters: Vec<_> = (0..6)
            .map(|_| {
                let l = Arc::clone(&l);
                assert!(matches!(l.try_admit(), Decision::Wait));
                tokio::spawn(async move { l.wait().await.map(|p| (p, Instant::now())) })
            })
            .collect();
        tokio::task::yield_now().await;
        assert_eq!(l.waiting(), 6);
        assert!(
            matches!(l.try_admit(), Decision::Rejected(_)),
            "a standing queue holds only what returns within standing_wait"
        );
        // The timeout is still max_wait: a waiter whose permit is late is not turned away
        // sooner (that would be a 503 that took the wait).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let returned_at = Instant::now();
        drop(first);
        let mut admitted = Vec::new();
        for w in waiters {
            if let Ok(done) = tokio::time::timeout(Duration::from_millis(1), w).await {
                let (permit, at) = done.unwrap().expect("waited 300 ms, within max_wait");
                assert_eq!(at, returned_at);
                admitted.push(permit);
            }
        }
        assert_eq!(
            admitted.len(),
            1,
            "one permit came back, to the first waiter"
        );

        // Those 39 were admitted without waiting: most requests found a permit free, so at
        // the end of this interval the queue may be as long as max_wait allows again.
        l.end_interval(Instant::now(), false);
        assert!(!l.is_standing());
        for _ in 0..3 {
            assert!(matches!(l.try_admit(), Decision::Wait));
        }
        drop(rest);
    }

    #[tokio::test(start_paused = true)]
    async fn a_standing_queue_stays_short_until_most_requests_find_a_permit_free() {
        let max_wait = Duration::from_secs(1);
        let (l, _q) = limiter(AdmissionMode::Static, 2, max_wait);
        let mut held = hold(&l, 2).await;
        l.end_interval(Instant::now(), false);
        assert!(!l.is_standing());
        // One request finds no permit and waits for one: the queue never emptied.
        assert!(matches!(l.try_admit(), Decision::Wait));
        let waiter = {
            let l = Arc::clone(&l);
            tokio::spawn(async move { l.wait().await })
        };
        tokio::task::yield_now().await;
        held.pop();
        held.push(waiter.await.unwrap().unwrap());
        l.end_interval(Instant::now(), false);
        assert!(l.is_standing(), "stood a whole interval");
        // One finds a permit free, two find none: a queue this short empties now and then
        // under overload, and it stays short.
        held.pop();
        let Decision::Admitted(p) = l.try_admit() else {
            panic!("a permit was free")
        };
        held.push(p);
        for _ in 0..2 {
            assert!(!matches!(l.try_admit(), Decision::Admitted(_)));
        }
        l.end_interval(Instant::now(), false);
        assert!(l.is_standing(), "most found no permit free");
        // Two find one free, one finds none: it no longer stands.
        held.clear();
        held.extend(hold(&l, 2).await);
        assert!(!matches!(l.try_admit(), Decision::Admitted(_)));
        l.end_interval(Instant::now(), false);
        assert!(!l.is_standing(), "most found a permit free");
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_counts_the_demand_turned_away_as_backlog() {
        let (l, _q) = limiter(AdmissionMode::Static, 10, Duration::ZERO);
        let held: Vec<_> = futures::future::join_all((0..10).map(|_| l.acquire())).await;
        // A drain of 10 per second.
        drop(held);
        l.end_second();
        let held: Vec<_> = futures::future::join_all((0..10).map(|_| l.acquire())).await;
        let Err(first) = l.acquire().await else {
            panic!("full")
        };
        assert!(
            (Duration::from_secs(1)..=Duration::from_millis(1500)).contains(&first.retry_after),
            "10 in flight at 10/s, spread by ±50 %: {:?}",
            first.retry_after
        );
        for _ in 0..40 {
            let _ = l.acquire().await;
        }
        l.end_second();
        let Err(later) = l.acquire().await else {
            panic!("full")
        };
        assert!(
            later.retry_after >= Duration::from_secs(3),
            "10 in flight and 41 turned away, at ~10/s: {:?}",
            later.retry_after
        );
        drop(held);
    }

    #[tokio::test(start_paused = true)]
    async fn the_adaptive_limit_shrinks_while_saturated_and_grows_when_it_limits_a_calm_runtime() {
        // At 900 growing by a tenth (990) and by √limit (930) differ, so the test tells them apart.
        let (l, q) = limiter(AdmissionMode::Adaptive, 1000, Duration::ZERO);
        let held = hold(&l, 1000).await;
        q.observe_window(Duration::from_millis(50), 1.0);
        l.end_interval(Instant::now(), false);
        assert_eq!(
            l.limit(),
            1000,
            "one saturated window (a closed loop's burst, say) is not a short core: held"
        );
        tokio::time::advance(crate::overload::WINDOW).await;
        q.observe_window(Duration::from_millis(50), 1.0);
        l.end_interval(Instant::now(), false);
        assert_eq!(
            l.limit(),
            900,
            "saturated two windows in a row, the limit in use: cut"
        );
        drop(held);
        tokio::time::advance(Duration::from_secs(1)).await;
        q.observe_window(Duration::from_micros(100), 1.0);
        let held: Vec<_> = futures::future::join_all((0..901).map(|_| l.acquire())).await;
        assert!(held.iter().any(Result::is_err), "the limit turned one away");
        l.end_interval(Instant::now(), false);
        assert_eq!(
            l.limit(),
            930,
            "calm and limiting a second after a cut: grow back by √limit, not by a tenth"
        );
        drop(held);
        tokio::time::advance(limit::QueueDelayLimit::NEAR_KNEE_FOR).await;
        q.observe_window(Duration::from_micros(100), 1.0);
        let held: Vec<_> = futures::future::join_all((0..931).map(|_| l.acquire())).await;
        assert!(held.iter().any(Result::is_err), "the limit turned one away");
        l.end_interval(Instant::now(), false);
        assert_eq!(
            l.limit(),
            1023,
            "calm and limiting long after the last cut: grow by a tenth"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_standing_inner_queue_shrinks_the_adaptive_limit_on_a_calm_core() {
        let (l, q) = limiter(AdmissionMode::Adaptive, 100, Duration::ZERO);
        let held = hold(&l, 100).await;
        assert!(
            matches!(l.try_admit(), Decision::Rejected(_)),
            "the limit turns the next one away"
        );
        // The core is calm: without the pool's signal the limit would grow (it limits).
        q.observe_window(Duration::from_micros(100), 1.0);
        l.end_interval(Instant::now(), true);
        assert_eq!(
            l.limit(),
            90,
            "everyone admitted waits for the pool: admitting more cannot help"
        );
        drop(held);
    }
}
