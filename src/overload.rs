//! Is the gateway's own CPU the bottleneck? The runtime's queueing delay answers it.
//!
//! When more arrives than a core can carry, the first thing that grows is not any latency a
//! handler measures but the time a ready task waits before a worker polls it. Everything
//! measured from inside a task then includes that wait: a downstream that answered in 100 ms
//! looks as if it took 600, its timeout fires, and a circuit breaker opens on the gateway's own
//! slowness. Admission by request latency (Gradient2) sees the same inflated number and cannot
//! tell a slow dependency from a saturated core. Queueing delay is the signal that separates
//! them; it is what Breakwater and Envoy's overload manager use.
//!
//! [`QueueDelay`] measures it with a probe: every 2 ms (every 25 ms while the workers are mostly
//! idle) a plain OS thread (outside the runtime, so a stuck runtime cannot stop it) spawns a
//! tiny task and times how long the task waits to be polled, then how long it waits once more
//! after waking itself (which puts it at the back of its worker's local queue, behind the
//! requests already there). A probe that gets no answer within a window counts as one that
//! waited the whole window.
//!
//! Like CoDel, the decision uses the *minimum* delay over a window of 100 ms: a burst that
//! drains quickly leaves some probe with a short wait, while a standing queue delays them all.
//! A window is **saturated** when that minimum is above `overload.queue_delay_target` and the
//! workers were busy for at least 90 % of it (a queue with idle workers is not CPU overload).
//! One saturated window keeps the breakers from blaming a downstream; the adaptive limit is cut,
//! and the door turns away at once a request that found no permit, only after two in a row
//! ([`QueueDelay::stays_saturated`]), as the pool's line is judged below.
//!
//! The core is not the only queue an admitted request can wait in. [`StandingQueue`] judges
//! a queue inside the gateway (the database pool's) the same way: over each control window,
//! was *every* wait that ended in it longer than the target, or did they average over twice
//! it? A pool that is merely busy hands some request a free connection at once and most
//! others one soon after; a pool with more requests admitted than it can serve makes them
//! wait, and admitting more only lengthens that wait until it eats the requests' deadlines
//! (the lab's caching spike: the limit grew to 2,500 while 2,400 requests waited for 20
//! connections, and most dashboards lost their orders part).
//!
//! Readers are cheap: a few relaxed atomic loads, no lock.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Weak,
        atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use metrics::{Gauge, Histogram};
use tokio::{runtime::Handle, time::Instant};
use tokio_util::sync::CancellationToken;

use crate::telemetry::Family;

/// How often the probe measures.
const PROBE_INTERVAL: Duration = Duration::from_millis(2);
/// How often it measures while the workers were mostly idle since its last probe: an idle
/// gateway has no queue to measure, and probing it every 2 ms woke the probe thread and a
/// worker 500 times a second each (an idle gateway used 2.4–3.0 % of a core, 1,041–1,150
/// context switches a second). Load that arrives is seen at the next sparse probe, and from
/// then on it probes every [`PROBE_INTERVAL`] again; a window is judged on the probes it has.
const IDLE_PROBE_INTERVAL: Duration = Duration::from_millis(25);
/// Below this share of busy worker time since the last probe, the next one waits
/// [`IDLE_PROBE_INTERVAL`]. Far under [`BUSY_FLOOR`]: a runtime this idle has no standing queue.
const IDLE_BUSY: f64 = 0.25;
/// The window over which the minimum delay is taken (CoDel's interval).
pub(crate) const WINDOW: Duration = Duration::from_millis(100);
/// Below this share of busy worker time a window is never saturated.
const BUSY_FLOOR: f64 = 0.9;

pub(crate) const QUEUE_DELAY: Family = Family::seconds(
    "tributary_runtime_queue_delay_seconds",
    "Smallest wait of a ready task for a worker over each 100 ms window (the probe's minimum).",
);
pub(crate) const SATURATED: Family = Family::gauge(
    "tributary_runtime_saturated",
    "1 while the runtime's queueing delay has been over overload.queue_delay_target with busy workers, else 0.",
);

/// The families this module records.
pub(crate) const FAMILIES: &[Family] = &[QUEUE_DELAY, SATURATED];

/// The shared readings; written by the probe thread, read by everyone.
struct Shared {
    target: Duration,
    /// Reference point of the `*_nanos` instants below.
    epoch: Instant,
    /// The last closed window's minimum delay.
    current_nanos: AtomicU64,
    /// End of the last saturated window (0: never).
    saturated_until_nanos: AtomicU64,
    /// End of the last window, saturated or not.
    last_window_nanos: AtomicU64,
    /// Saturated windows in a row, up to the last one (0: the last one was not).
    saturated_run: AtomicU32,
    /// Probes sent up to the last window's end (for tests and debugging: how often the probe
    /// wakes).
    probes: AtomicU64,
}

impl Shared {
    fn nanos_at(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }
}

/// The queueing-delay signal. Cheap to clone; the probe stops when the shutdown token is
/// cancelled or the last clone is dropped.
#[derive(Clone)]
pub struct QueueDelay {
    shared: Arc<Shared>,
}

impl QueueDelay {
    /// Starts the probe on the current runtime.
    pub(crate) fn spawn(target: Duration, shutdown: CancellationToken) -> Self {
        let this = Self::manual(target);
        let weak = Arc::downgrade(&this.shared);
        let handle = Handle::current();
        let spawned = std::thread::Builder::new()
            .name("tributary-queue-probe".into())
            .spawn(move || probe(handle, weak, shutdown));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the queueing-delay probe; overload detection is off");
        }
        this
    }

    /// A signal with no probe: never saturated unless a test says so with
    /// [`QueueDelay::observe_window`].
    pub(crate) fn manual(target: Duration) -> Self {
        metrics::gauge!(SATURATED.name).set(0.0);
        Self {
            shared: Arc::new(Shared {
                target,
                epoch: Instant::now(),
                current_nanos: AtomicU64::new(0),
                saturated_until_nanos: AtomicU64::new(0),
                last_window_nanos: AtomicU64::new(0),
                saturated_run: AtomicU32::new(0),
                probes: AtomicU64::new(0),
            }),
        }
    }

    pub(crate) fn target(&self) -> Duration {
        self.shared.target
    }

    /// The last window's minimum queueing delay.
    pub(crate) fn current(&self) -> Duration {
        Duration::from_nanos(self.shared.current_nanos.load(Ordering::Relaxed))
    }

    /// Whether the last closed window was saturated (and it closed recently: a probe that
    /// stopped reporting is not evidence of anything).
    pub(crate) fn is_saturated(&self) -> bool {
        let s = &self.shared;
        let until = s.saturated_until_nanos.load(Ordering::Relaxed);
        until != 0
            && until == s.last_window_nanos.load(Ordering::Relaxed)
            && s.nanos_at(Instant::now()) <= until + 2 * WINDOW.as_nanos() as u64
    }

    /// Whether the last closed window was saturated and so was the one before it: the verdict
    /// the adaptive limit cuts on, and the door's (no wait for a permit while it holds). One
    /// window is not enough there, for the reason
    /// [`StandingQueue::close_window`] gives for the pool: a closed loop's connections come back
    /// in lockstep, and a burst of them can keep every probe of one 100 ms window waiting on a
    /// core that carries the load (`bench/run stack`, 250 connections, 2026-12-07: the bare stack
    /// served them all, tributary cut its limit under them and answered 46–96 of them with 503s
    /// in 15 s). A core that is really short stays saturated for many windows, and is cut for
    /// one window later; in a single saturated window a request without a permit may wait
    /// (bounded by `max_wait` and the wait room) instead of getting a 503. The breakers
    /// ([`QueueDelay::saturated_since`]) still read a single window: not blaming a downstream
    /// for a late answer costs nothing that a cut of the limit would.
    pub(crate) fn stays_saturated(&self) -> bool {
        self.is_saturated() && self.shared.saturated_run.load(Ordering::Relaxed) >= 2
    }

    /// Whether the runtime was saturated at some point since `t` (or in the window just
    /// before it): whatever was measured from inside a task over that span includes the
    /// gateway's own queueing.
    pub(crate) fn saturated_since(&self, t: Instant) -> bool {
        let until = self.shared.saturated_until_nanos.load(Ordering::Relaxed);
        until != 0 && until + WINDOW.as_nanos() as u64 >= self.shared.nanos_at(t)
    }

    /// Whether a timer due at `due` fired more than the target late: the task that armed it
    /// waited in the run queue, so whatever it timed out on was not the only thing slow.
    pub(crate) fn fired_late(&self, due: Instant) -> bool {
        Instant::now().saturating_duration_since(due) > self.shared.target
    }

    /// Closes a window with minimum delay `min_delay` and workers busy for `busy` of it.
    pub(crate) fn observe_window(&self, min_delay: Duration, busy: f64) -> bool {
        let s = &self.shared;
        let now = s.nanos_at(Instant::now()).max(1);
        s.current_nanos
            .store(min_delay.as_nanos() as u64, Ordering::Relaxed);
        let saturated = min_delay > s.target && busy >= BUSY_FLOOR;
        if saturated {
            s.saturated_until_nanos.store(now, Ordering::Relaxed);
            s.saturated_run.fetch_add(1, Ordering::Relaxed);
        } else {
            s.saturated_run.store(0, Ordering::Relaxed);
        }
        s.last_window_nanos.store(now, Ordering::Relaxed);
        saturated
    }
}

/// A [`StandingQueue`] also stands when its waits averaged this many targets over a window.
pub(crate) const MEAN_OVER: u64 = 2;

/// A queue inside the gateway that admitted requests wait in (the database pool's), judged like
/// CoDel judges a link: **standing** over a window when every wait that ended in it was longer
/// than the target, or when requests waited through the whole window and none got through;
/// and, unlike CoDel, also when the waits that ended in it averaged over [`MEAN_OVER`] targets.
/// CoDel's minimum alone let the adaptive limit sit a fifth over the pool's knee with a 50–70 ms
/// line (the lab's `near-knee` experiment): under overload some request finds a free connection
/// in most windows, by chance, and each such window let the limit grow.
/// The waiter records its own waits ([`StandingQueue::enter`], [`StandingQueue::waited`]), and
/// the queue publishes how many wait right now;
/// the admission control loop closes a window every 100 ms ([`StandingQueue::close_window`])
/// and treats a standing inner queue as it treats a saturated core.
#[derive(Clone)]
pub(crate) struct StandingQueue {
    shared: Arc<QueueShared>,
}

struct QueueShared {
    /// The shortest wait that ended in the current window (`u64::MAX`: none ended yet).
    min_wait_nanos: AtomicU64,
    /// The waits that ended in the current window: their sum and how many.
    wait_sum_nanos: AtomicU64,
    waits: AtomicU64,
    /// Waiting right now, and at the last close.
    waiting: AtomicUsize,
    waiting_at_close: AtomicUsize,
    /// The last window's own verdict: a queue stands only when two windows in a row did.
    stood_last: AtomicBool,
    /// Servers of the queue being added right now (connections being opened), and whether
    /// one was added, or failed to be, since the last close (see [`StandingQueue::growing`]).
    growing: AtomicUsize,
    grew: AtomicBool,
    /// 1 while standing.
    standing: Gauge,
    /// How many wait right now.
    length: Gauge,
}

impl StandingQueue {
    /// A queue whose state is published in `standing` (1 while standing) and its current
    /// length in `length`.
    pub(crate) fn new(standing: Gauge, length: Gauge) -> Self {
        standing.set(0.0);
        length.set(0.0);
        Self {
            shared: Arc::new(QueueShared {
                min_wait_nanos: AtomicU64::new(u64::MAX),
                wait_sum_nanos: AtomicU64::new(0),
                waits: AtomicU64::new(0),
                waiting: AtomicUsize::new(0),
                waiting_at_close: AtomicUsize::new(0),
                stood_last: AtomicBool::new(false),
                growing: AtomicUsize::new(0),
                grew: AtomicBool::new(false),
                standing,
                length,
            }),
        }
    }

    /// Counts one waiter until the guard is dropped (also when its wait is cancelled, so the
    /// count and its gauge never drift).
    pub(crate) fn enter(&self) -> Waiting<'_> {
        let n = self.shared.waiting.fetch_add(1, Ordering::Relaxed) + 1;
        self.shared.length.set(n as f64);
        Waiting(&self.shared)
    }

    /// Marks a server of the queue being added (a connection being opened) until the guard is
    /// dropped. A window in which the queue was growing does not stand, and neither does the
    /// next, whatever its waits: a line that forms while connections are still being opened
    /// (a fresh pod's first burst, a pool grown back after idling) waits for connects that are
    /// on their way, not for a pool too small for what was admitted, and cutting the admission
    /// limit for it turns away requests a pool a moment older serves at once. (The lab's
    /// `pool-warm-up` experiment saw such cuts on fresh gateways; what removed them there was
    /// opening the pool before the load, the default since; this rule alone showed no gain at
    /// that load, and stays for the other times a pool grows under load.)
    pub(crate) fn growing(&self) -> Growing<'_> {
        self.shared.growing.fetch_add(1, Ordering::Relaxed);
        Growing(&self.shared)
    }

    /// A wait ended after `wait` (got through, or gave up).
    pub(crate) fn waited(&self, wait: Duration) {
        let nanos = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX - 1);
        let s = &self.shared;
        s.min_wait_nanos.fetch_min(nanos, Ordering::Relaxed);
        s.wait_sum_nanos.fetch_add(nanos, Ordering::Relaxed);
        s.waits.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends the current window: whether the queue stood over it and over the window before
    /// (also published in the gauge). One window is not enough: with Postgres on a busy core a
    /// stall of a few tens of milliseconds makes every wait in one window long now and then,
    /// and a cut for each left the limit under what the core carried (`bench/run stack`, 500
    /// connections, 2026-12-06: five or six cuts in 15 s, all for the pool, and 700–1,100 503s
    /// that the bare stack, queueing on the same pool, did not need). A line that stands
    /// stands for many windows, and is seen one window later.
    ///
    /// `core_queued`: the core was saturated during the window. Its waits then say nothing
    /// about the pool: a connection is held until its task is polled again after the answer,
    /// and a task that waits for the worker holds it that much longer, so every request
    /// behind it waits as well. The window is not judged either way (the window before and the
    /// one after still make two in a row), and the core's own verdict answers for it. Without
    /// this a fresh gateway's first burst (250 closed-loop connections, every request opening
    /// its downstream connections on one core) cut the limit "for the pool" with 1.3 of its
    /// 20 connections in use on average (`bench/run stack`, 2026-12-07, AMD EPYC VM: one cut
    /// a run, each for the pool once the core's verdict took two windows).
    pub(crate) fn close_window(&self, target: Duration, core_queued: bool) -> bool {
        let s = &self.shared;
        let min = s.min_wait_nanos.swap(u64::MAX, Ordering::Relaxed);
        let sum = s.wait_sum_nanos.swap(0, Ordering::Relaxed);
        let waits = s.waits.swap(0, Ordering::Relaxed);
        let waiting = s.waiting.load(Ordering::Relaxed);
        let waited_through = s.waiting_at_close.swap(waiting, Ordering::Relaxed) > 0;
        let grew = s.grew.swap(false, Ordering::Relaxed) | (s.growing.load(Ordering::Relaxed) > 0);
        if core_queued {
            // Neither standing nor calm: the gauge and the last verdict stay as they were.
            // A pool that grew in this window still keeps the next from standing.
            s.grew.fetch_or(grew, Ordering::Relaxed);
            return false;
        }
        let stood = if grew {
            false
        } else if min == u64::MAX {
            // Nobody got through: standing only if someone has been waiting since the last
            // close (a request that joined a moment ago says nothing yet).
            waiting > 0 && waited_through
        } else {
            let target = target.as_nanos() as u64;
            // CoDel's test (every wait over the target), or a line whose mean wait is over
            // MEAN_OVER targets: one request that finds a free connection at once does not
            // make a pool with a 60 ms line calm.
            min > target || sum / waits.max(1) > target.saturating_mul(MEAN_OVER)
        };
        let stood_before = s.stood_last.swap(stood, Ordering::Relaxed);
        let standing = stood && stood_before;
        s.standing.set(if standing { 1.0 } else { 0.0 });
        standing
    }
}

/// A server being added to a [`StandingQueue`] ([`StandingQueue::growing`]).
pub(crate) struct Growing<'a>(&'a QueueShared);

impl Drop for Growing<'_> {
    fn drop(&mut self) {
        self.0.grew.store(true, Ordering::Relaxed);
        self.0.growing.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One waiter in a [`StandingQueue`].
pub(crate) struct Waiting<'a>(&'a QueueShared);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let n = self.0.waiting.fetch_sub(1, Ordering::Relaxed) - 1;
        self.0.length.set(n as f64);
    }
}

/// The probe thread's loop; returns when shutdown is cancelled, every [`QueueDelay`] is gone,
/// or the runtime has shut down.
fn probe(handle: Handle, shared: Weak<Shared>, shutdown: CancellationToken) {
    let histogram: Histogram = metrics::histogram!(QUEUE_DELAY.name);
    let gauge: Gauge = metrics::gauge!(SATURATED.name);
    let mut busy = Busy::new(&handle);
    // The workers' busy share since the last probe, which sets the next probe's interval.
    let mut since_probe = Busy::new(&handle);
    let mut interval = PROBE_INTERVAL;
    let mut window_started = std::time::Instant::now();
    let mut window_min: Option<Duration> = None;
    // A probe with no answer in time: the workers are stuck in polls that do not return, and
    // their busy time is only accounted once those polls end.
    let mut window_stuck = false;
    // The probe task writes its wait here and then its sequence number; the thread reads
    // them when it wakes. No channel: a task that answered does not wake the thread, so each
    // probe costs the thread one wake-up (its timer), not two.
    let answer = Arc::new(Answer::default());
    let mut seq = 0u64;
    while !shutdown.is_cancelled() {
        seq += 1;
        let sent = std::time::Instant::now();
        let this = seq;
        let task = handle.spawn({
            let answer = Arc::clone(&answer);
            async move {
                let first_poll = sent.elapsed();
                let polled = std::time::Instant::now();
                BackOfTheQueue(false).await;
                answer.set(this, first_poll.max(polled.elapsed()));
            }
        });
        // One look per interval: the task times its own wait, so a probe that is slow to
        // answer is read at the next tick without losing precision.
        let mut tick = sent;
        let sample = loop {
            tick += interval;
            std::thread::sleep(tick.saturating_duration_since(std::time::Instant::now()));
            if let Some(sample) = answer.get(this) {
                break sample;
            }
            // Finished without answering: the runtime shut down and dropped the task.
            if task.is_finished() {
                match answer.get(this) {
                    Some(sample) => break sample,
                    None => return,
                }
            }
            if sent.elapsed() >= WINDOW {
                window_stuck = true;
                break sent.elapsed();
            }
        };
        interval = if since_probe.ratio(&handle) < IDLE_BUSY {
            IDLE_PROBE_INTERVAL
        } else {
            PROBE_INTERVAL
        };
        window_min = Some(window_min.map_or(sample, |m| m.min(sample)));
        if window_started.elapsed() >= WINDOW {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            shared.probes.store(seq, Ordering::Relaxed);
            let min = window_min.take().unwrap_or_default();
            let busy = if std::mem::take(&mut window_stuck) {
                busy.ratio(&handle).max(1.0)
            } else {
                busy.ratio(&handle)
            };
            let saturated = QueueDelay { shared }.observe_window(min, busy);
            histogram.record(min.as_secs_f64());
            gauge.set(if saturated { 1.0 } else { 0.0 });
            window_started = std::time::Instant::now();
        }
    }
}

/// The last probe's answer: its sequence number, written after its wait.
#[derive(Default)]
struct Answer {
    seq: AtomicU64,
    nanos: AtomicU64,
}

impl Answer {
    fn set(&self, seq: u64, wait: Duration) {
        self.nanos.store(
            u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        // Release: a reader that sees `seq` sees the wait written before it.
        self.seq.store(seq, Ordering::Release);
    }

    /// The wait of probe `seq`, once it has answered.
    fn get(&self, seq: u64) -> Option<Duration> {
        (self.seq.load(Ordering::Acquire) == seq)
            .then(|| Duration::from_nanos(self.nanos.load(Ordering::Relaxed)))
    }
}

/// Yields once by waking itself: the task goes to the back of its worker's local queue, so
/// the second wait measures the queue a request's continuation waits in.
struct BackOfTheQueue(bool);

impl Future for BackOfTheQueue {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

/// The workers' busy share since the last call.
struct Busy {
    last: Duration,
    at: std::time::Instant,
}

impl Busy {
    fn new(handle: &Handle) -> Self {
        Self {
            last: Self::total(handle),
            at: std::time::Instant::now(),
        }
    }

    fn total(handle: &Handle) -> Duration {
        let m = handle.metrics();
        (0..m.num_workers())
            .map(|w| m.worker_total_busy_duration(w))
            .sum()
    }

    fn ratio(&mut self, handle: &Handle) -> f64 {
        let total = Self::total(handle);
        let workers = handle.metrics().num_workers().max(1) as f64;
        let elapsed = self.at.elapsed().as_secs_f64() * workers;
        let ratio = if elapsed > 0.0 {
            total.saturating_sub(self.last).as_secs_f64() / elapsed
        } else {
            0.0
        };
        self.last = total;
        self.at = std::time::Instant::now();
        ratio
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TARGET: Duration = Duration::from_millis(5);

    #[tokio::test(start_paused = true)]
    async fn a_window_is_saturated_only_when_its_minimum_is_over_target_with_busy_workers() {
        let q = QueueDelay::manual(TARGET);
        assert!(!q.is_saturated(), "no window yet");
        assert!(
            !q.observe_window(Duration::from_millis(20), 0.5),
            "idle workers"
        );
        assert!(
            !q.observe_window(Duration::from_millis(4), 1.0),
            "under target"
        );
        assert!(q.observe_window(Duration::from_millis(6), 0.95));
        assert!(q.is_saturated());
        assert_eq!(q.current(), Duration::from_millis(6));
        tokio::time::advance(WINDOW).await;
        q.observe_window(Duration::from_millis(1), 1.0);
        assert!(!q.is_saturated(), "the next calm window ends it");
    }

    #[tokio::test(start_paused = true)]
    async fn saturation_stays_only_after_two_saturated_windows_in_a_row() {
        let q = QueueDelay::manual(TARGET);
        q.observe_window(Duration::from_millis(20), 1.0);
        assert!(q.is_saturated(), "the door and the breakers see one window");
        assert!(
            !q.stays_saturated(),
            "one window is a burst, not yet a short core"
        );
        tokio::time::advance(WINDOW).await;
        q.observe_window(Duration::from_millis(20), 1.0);
        assert!(q.stays_saturated(), "two in a row");
        tokio::time::advance(WINDOW).await;
        q.observe_window(Duration::from_millis(1), 1.0);
        assert!(!q.stays_saturated(), "a calm window ends it");
        tokio::time::advance(WINDOW).await;
        q.observe_window(Duration::from_millis(20), 1.0);
        assert!(!q.stays_saturated(), "and the count starts over");
        tokio::time::advance(WINDOW * 3).await;
        q.observe_window(Duration::from_millis(20), 1.0);
        tokio::time::advance(WINDOW * 3).await;
        assert!(
            !q.stays_saturated(),
            "a probe that stopped reporting says nothing"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn saturation_is_remembered_for_calls_that_spanned_it() {
        let q = QueueDelay::manual(TARGET);
        let call_started = Instant::now();
        tokio::time::advance(Duration::from_millis(50)).await;
        q.observe_window(Duration::from_millis(50), 1.0);
        tokio::time::advance(WINDOW).await;
        q.observe_window(Duration::from_micros(100), 1.0);
        assert!(!q.is_saturated());
        assert!(
            q.saturated_since(call_started),
            "a call that spanned the saturated window must know it"
        );
        tokio::time::advance(WINDOW * 5).await;
        assert!(
            !q.saturated_since(Instant::now()),
            "a call that started long after it must not"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_stale_saturated_window_does_not_count_as_saturation_now() {
        let q = QueueDelay::manual(TARGET);
        q.observe_window(Duration::from_millis(50), 1.0);
        tokio::time::advance(WINDOW * 3).await;
        assert!(!q.is_saturated(), "the probe stopped reporting");
    }

    #[tokio::test(start_paused = true)]
    async fn a_timer_that_fires_later_than_the_target_fired_late() {
        let q = QueueDelay::manual(TARGET);
        let due = Instant::now();
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(!q.fired_late(due));
        tokio::time::advance(Duration::from_millis(10)).await;
        assert!(q.fired_late(due));
    }

    #[test]
    fn an_inner_queue_stands_when_every_wait_in_the_window_was_over_target() {
        let q = StandingQueue::new(
            metrics::gauge!("test_standing"),
            metrics::gauge!("test_length"),
        );
        assert!(!q.close_window(TARGET, false), "nothing happened");
        // A busy pool: some waits over the target, but one request found a free connection at
        // once and the line is short on average.
        for _ in 0..2 {
            q.waited(Duration::from_millis(8));
            q.waited(Duration::from_micros(30));
            q.waited(Duration::from_millis(9));
            assert!(
                !q.close_window(TARGET, false),
                "one short wait: the queue drains"
            );
        }
        q.waited(Duration::from_millis(40));
        q.waited(Duration::from_millis(6));
        assert!(
            !q.close_window(TARGET, false),
            "every wait over the target, one window"
        );
        q.waited(Duration::from_millis(30));
        q.waited(Duration::from_millis(7));
        assert!(
            q.close_window(TARGET, false),
            "and the next one too: it stands"
        );
        q.waited(Duration::from_millis(1));
        assert!(
            !q.close_window(TARGET, false),
            "the next window with a short wait ends it"
        );
    }

    #[test]
    fn a_window_in_which_the_core_was_saturated_is_not_judged() {
        let q = StandingQueue::new(
            metrics::gauge!("test_standing"),
            metrics::gauge!("test_length"),
        );
        // Every wait long, in two windows in a row, both with the core saturated: the waits
        // include the worker's own queue (connections held by tasks waiting to be polled).
        for _ in 0..2 {
            q.waited(Duration::from_millis(40));
            q.waited(Duration::from_millis(30));
            assert!(
                !q.close_window(TARGET, true),
                "the core was saturated: its verdict answers for the window"
            );
        }
        // On a calm core the same waits are the pool's line: one window, then another.
        q.waited(Duration::from_millis(40));
        assert!(!q.close_window(TARGET, false), "one window of a line");
        // A window with the core saturated in between neither ends the line nor adds to it.
        q.waited(Duration::from_micros(10));
        assert!(!q.close_window(TARGET, true));
        q.waited(Duration::from_millis(40));
        assert!(
            q.close_window(TARGET, false),
            "two windows of a line on a calm core, around one that was not judged: it stands"
        );
    }

    #[test]
    fn one_window_of_long_waits_between_calm_ones_is_a_stall_not_a_line() {
        let q = StandingQueue::new(
            metrics::gauge!("test_stall"),
            metrics::gauge!("test_length"),
        );
        for round in 0..3 {
            q.waited(Duration::from_millis(20));
            q.waited(Duration::from_millis(30));
            assert!(!q.close_window(TARGET, false), "a stall, round {round}");
            q.waited(Duration::from_micros(30));
            assert!(!q.close_window(TARGET, false), "calm again, round {round}");
        }
    }

    #[test]
    fn an_inner_queue_stands_when_its_waits_average_over_twice_the_target_though_one_was_short() {
        let q = StandingQueue::new(metrics::gauge!("test_mean"), metrics::gauge!("test_length"));
        // The lab's overload: one request found a free connection at once, the others waited
        // 40 and 90 ms. CoDel's minimum calls it draining; the mean (43 ms) says it stands.
        for window in 0..2 {
            q.waited(Duration::from_millis(40));
            q.waited(Duration::from_micros(30));
            q.waited(Duration::from_millis(90));
            assert_eq!(
                q.close_window(TARGET, false),
                window == 1,
                "a long line on average"
            );
        }
        // Just under the mean's bar: not standing.
        q.waited(Duration::from_micros(30));
        q.waited(TARGET * MEAN_OVER as u32 * 2 - Duration::from_micros(100));
        assert!(
            !q.close_window(TARGET, false),
            "mean just under twice the target"
        );
    }

    #[test]
    fn an_inner_queue_where_nobody_gets_through_stands_once_someone_waited_a_whole_window() {
        let q = StandingQueue::new(
            metrics::gauge!("test_stuck"),
            metrics::gauge!("test_length"),
        );
        let first = q.enter();
        assert!(
            !q.close_window(TARGET, false),
            "a waiter that just joined says nothing yet"
        );
        assert!(
            !q.close_window(TARGET, false),
            "still waiting a window later, and nobody got through: one window"
        );
        assert!(q.close_window(TARGET, false), "and another: it stands");
        drop(first);
        assert!(
            !q.close_window(TARGET, false),
            "the waiter left: nothing stands"
        );
    }

    #[test]
    fn an_inner_queue_does_not_stand_while_it_is_still_growing() {
        let q = StandingQueue::new(
            metrics::gauge!("test_growing"),
            metrics::gauge!("test_length"),
        );
        let long_waits = |q: &StandingQueue| {
            q.waited(Duration::from_millis(40));
            q.waited(Duration::from_millis(60));
        };
        // A fresh pool's first burst: every wait long, while connections are being opened.
        let opening = q.growing();
        for window in 0..3 {
            long_waits(&q);
            assert!(
                !q.close_window(TARGET, false),
                "connects under way, window {window}"
            );
        }
        // The last connect ends in this window: it does not stand either.
        long_waits(&q);
        drop(opening);
        assert!(
            !q.close_window(TARGET, false),
            "a connect ended in the window"
        );
        // One window of long waits after it is one window: not yet a line.
        long_waits(&q);
        assert!(!q.close_window(TARGET, false), "one window of a full pool");
        // The same waits with the pool done growing: it stands.
        long_waits(&q);
        assert!(
            q.close_window(TARGET, false),
            "two windows of a full pool: it stands"
        );
        // A connect that failed ended too, and counts the same.
        drop(q.growing());
        long_waits(&q);
        assert!(
            !q.close_window(TARGET, false),
            "a connect (that failed) ended in the window"
        );
    }

    /// A real one-worker runtime with the probe started on it.
    fn probed_runtime(shutdown: &CancellationToken) -> (tokio::runtime::Runtime, QueueDelay) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let q = rt.block_on(async { QueueDelay::spawn(TARGET, shutdown.clone()) });
        (rt, q)
    }

    /// The probe itself, on a real one-worker runtime whose worker is taken by a task that
    /// blocks it: the probe's tasks cannot be polled, so the windows are saturated.
    #[test]
    fn the_probe_sees_a_worker_that_is_held() {
        let shutdown = CancellationToken::new();
        let (rt, q) = probed_runtime(&shutdown);
        // Calm first: some windows close unsaturated.
        std::thread::sleep(WINDOW * 3);
        assert!(!q.is_saturated(), "an idle runtime is not saturated");
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        rt.spawn(async move {
            // Blocks the only worker until the test has seen saturation (bounded).
            let _ = release_rx.recv_timeout(Duration::from_secs(10));
        });
        let mut seen = false;
        for _ in 0..100 {
            std::thread::sleep(WINDOW);
            if q.is_saturated() {
                seen = true;
                break;
            }
        }
        let _ = release_tx.send(());
        shutdown.cancel();
        assert!(seen, "a held worker must show as saturation");
        assert!(q.current() > TARGET);
    }

    /// An idle runtime is probed every 25 ms, not every 2 ms: over 600 ms at most 24 or so
    /// probes (300 at the busy rate). A slow machine only makes fewer.
    #[test]
    fn an_idle_runtime_is_probed_sparsely() {
        let shutdown = CancellationToken::new();
        let (_rt, q) = probed_runtime(&shutdown);
        // The first probes run at the busy rate until one finds the workers idle.
        std::thread::sleep(WINDOW);
        let before = q.shared.probes.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(600));
        let probes = q.shared.probes.load(Ordering::Relaxed) - before;
        shutdown.cancel();
        assert!(probes >= 1, "the probe must keep running while idle");
        assert!(
            probes <= 60,
            "{probes} probes in 600 ms of an idle runtime: it probes at the busy rate"
        );
    }

    /// The probe thread holds the signal weakly; once it has returned, nothing does.
    fn probe_ended(q: &QueueDelay) -> bool {
        (0..200).any(|_| {
            if Arc::weak_count(&q.shared) == 0 {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
            false
        })
    }

    #[test]
    fn the_probe_thread_ends_when_its_runtime_shuts_down() {
        let (rt, q) = probed_runtime(&CancellationToken::new());
        std::thread::sleep(WINDOW);
        assert_eq!(Arc::weak_count(&q.shared), 1, "the probe is running");
        // Neither the token nor the signal goes away: only the runtime, whose shutdown drops
        // the probe's task unanswered.
        drop(rt);
        assert!(
            probe_ended(&q),
            "the probe thread must end with its runtime"
        );
    }

    #[test]
    fn the_probe_thread_ends_on_shutdown() {
        let shutdown = CancellationToken::new();
        let (_rt, q) = probed_runtime(&shutdown);
        std::thread::sleep(WINDOW);
        shutdown.cancel();
        assert!(
            probe_ended(&q),
            "the probe thread must end when shutdown is cancelled"
        );
    }
}
