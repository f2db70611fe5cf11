//! The two algorithms that move an adaptive admission limit.
//!
//! - [`QueueDelayLimit`], the default: additive-increase / multiplicative-decrease on the
//!   runtime's queueing delay ([`crate::overload`]). The core is the resource admission
//!   protects; its queue is the one signal that says "too much" without being fooled by a slow
//!   downstream (a slow dependency lengthens requests but leaves the core idle), so the limit
//!   settles where the core is just busy, whatever the pod size, with no number to tune.
//! - [`Gradient2`] (Netflix concurrency-limits): the limit follows request latency against its
//!   long-term baseline. It cannot tell a saturated core from a slow dependency, and under CPU
//!   overload the latency it measures includes the queueing it is meant to prevent; it stays
//!   for deployments that want latency-driven limits.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::AdaptiveSettings;

/// What the control loop saw over one control interval.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Interval {
    /// The runtime was saturated (queueing delay over target with busy workers) for two windows
    /// in a row ([`crate::overload::QueueDelay::stays_saturated`]): the verdict cuts are made on.
    pub(crate) core: bool,
    /// The last window alone was saturated ([`crate::overload::QueueDelay::is_saturated`]): a
    /// burst, or the first window of a saturation. It cuts nothing, but the limit does not grow
    /// through it, and a cut on trial is not yet judged to have worked.
    pub(crate) core_window: bool,
    /// An inner queue of admitted requests (the database pool's) stood over the target.
    pub(crate) inner: bool,
    /// The last window's minimum queueing delay.
    pub(crate) delay: Duration,
    /// The most permits held at once during the interval.
    pub(crate) peak_in_flight: usize,
    /// Whether the limit turned someone away or made someone wait during the interval.
    pub(crate) limited: bool,
}

/// AIMD on queueing delay.
///
/// - saturated, and the limit in use (at least half of it held): × 0.9, but at most once per
///   smoothed permit-hold time, so the effect of one cut is seen before the next is made;
/// - not saturated and the limit is what stopped requests, or nine tenths of it are in use: grow
///   (a limit that only tracks demand is under it after any cut), × 1.1 while the delay is under
///   half the target, by √limit (gently) closer to it, and by √limit too for
///   [`QueueDelayLimit::NEAR_KNEE_FOR`] after any cut: the cut found the knee, and growing back
///   by a tenth per interval overshot it again at once (the lab's `near-knee` experiment: the
///   limit sat ~20 % over the database pool's knee, requests waited 50–70 ms for a connection;
///   growing by √limit after a cut cut that wait by a quarter to a half at the same goodput);
/// - otherwise hold: an application-limited gateway learns nothing about its capacity.
///
/// **A cut made for the core's queue alone must shorten it** (`overload.check_core_cuts`). The
/// core's queue is not only admitted work: under a heavy overload the requests turned away at
/// the door (each a read, a decision and a write) keep it over the target whatever the limit
/// is, and every cut then removes admitted work, goodput with it, and shortens nothing (the
/// lab's `admission-knee` experiment: ~5,000 rejections a second walked the limit 20–40 %
/// under the knee). So when the next cut falls due, the last one is judged: if the queue did
/// not shrink by a tenth, it is undone and the core's queue is left out of the decision for
/// [`QueueDelayLimit::IGNORE_CORE_FOR`], after which a cut is tried again. Cuts for a standing
/// inner queue (the database pool's) are never judged: only admitted requests stand in it.
///
/// **While the core's queue is left out, the limit probes upward** (`overload.probe_past_core`,
/// [`CoreCuts::Probe`]): a queue the limit does not govern says nothing about how much admitted
/// work the core can carry, and holding the limit there is a ratchet (every trial cut that the
/// noise makes look useful is kept, and nothing ever raises the limit again while rejections
/// keep the queue over the target). So if the limit is what turns requests away, it grows by
/// √limit a second, and the next trial cut tells whether the admitted work has become part of
/// the queue; a standing inner queue (the pool's knee) stops it as it stops any growth.
pub(crate) struct QueueDelayLimit {
    min: f64,
    max: f64,
    target: Duration,
    limit: f64,
    last_decrease: Option<Instant>,
    /// EWMA of how long requests hold their permit.
    hold: Option<Duration>,
    /// How cuts for the core's queue alone are judged.
    core_cuts: CoreCuts,
    /// The last cut made for the core's queue alone, until it is judged.
    trial: Option<Trial>,
    /// Until then the core's queue does not move the limit (its last cut did not shorten it).
    ignore_core_until: Option<Instant>,
    /// `overload.settle_after_cut`: no growth until a cut has had one hold time to show.
    settle: bool,
}

/// How a [`QueueDelayLimit`] treats cuts made for the core's queue alone
/// (`overload.check_core_cuts`, `overload.probe_past_core`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CoreCuts {
    /// Every window over the target cuts.
    Unchecked,
    /// A cut that did not shorten the queue is undone, and the queue is left out for a while;
    /// the limit holds meanwhile.
    Checked,
    /// As `Checked`, and the limit grows gently while the queue is left out.
    Probe,
}

impl CoreCuts {
    /// `probe` without `check` is refused at config load (`Settings::validate`).
    pub(crate) fn of(check: bool, probe: bool) -> Self {
        match (check, probe) {
            (false, _) => Self::Unchecked,
            (true, false) => Self::Checked,
            (true, true) => Self::Probe,
        }
    }
}

/// What one control interval did to a [`QueueDelayLimit`]: the limiter counts each kind
/// (a cut by the queue that called for it, an undone cut on its own counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// The limit stayed where it was (to the permit).
    Held,
    /// Cut to this limit.
    Cut(usize),
    /// A cut that did not shorten the core's queue was undone: back to this limit.
    Undone(usize),
    /// Grew to this limit.
    Grew(usize),
}

/// A cut on trial: the limit before it and the queueing delay that called for it.
#[derive(Debug, Clone, Copy)]
struct Trial {
    limit_before: f64,
    delay: Duration,
}

impl QueueDelayLimit {
    const DECREASE: f64 = 0.9;
    const FAST_INCREASE: f64 = 1.1;
    /// Before a hold time is known, decreases are this far apart.
    const DEFAULT_HOLD: Duration = Duration::from_millis(100);
    /// Decreases are never closer together than this, however short requests are.
    const MIN_DECREASE_GAP: Duration = Duration::from_millis(100);
    /// A cut for the core's queue is kept when the queue shrank to at most this share of the
    /// delay that called for it.
    const RELIEF: f64 = 0.9;
    /// For this long after a cut the limit grows by √limit an interval, not by a tenth: the cut
    /// found the knee, and the knee moves slowly.
    pub(crate) const NEAR_KNEE_FOR: Duration = Duration::from_secs(5);
    /// How long the core's queue is left out after a cut that did not shorten it.
    pub(crate) const IGNORE_CORE_FOR: Duration = Duration::from_secs(1);
    /// While calm, a limit this full grows as if it had turned someone away: it keeps a tenth
    /// of headroom over what demand holds, so that one cut (a burst on the database pool, say)
    /// does not put a limit that only tracked demand under it. Growing only once the limit had
    /// stopped requests, a closed loop of 250 connections on a core 46 % busy found the limit at
    /// its own concurrency: every cut made requests wait for a permit, and 0.1 % of them got 503s
    /// after 100 ms (`bench/run stack`, 2026-12-06 18:30 UTC).
    pub(crate) const NEARLY_FULL: f64 = 0.9;

    pub(crate) fn new(s: &AdaptiveSettings, target: Duration, core_cuts: CoreCuts) -> Self {
        let min = s.min_limit.get() as f64;
        let max = (s.max_limit as f64).max(min);
        Self {
            min,
            max,
            target,
            limit: (s.initial_limit as f64).clamp(min, max),
            last_decrease: None,
            hold: None,
            core_cuts,
            trial: None,
            ignore_core_until: None,
            settle: false,
        }
    }

    /// `overload.settle_after_cut`: after a cut the limit holds (does not grow back) until one
    /// smoothed permit-hold time has passed, so that the requests admitted before the cut have
    /// left and the cut's effect on the line that called for it is seen. Without it, the limit
    /// grows back by √limit an interval from the interval after the cut, and a line that stands
    /// in some windows and not in others meets as much growth as cutting.
    pub(crate) fn settling_after_cuts(mut self, settle: bool) -> Self {
        self.settle = settle;
        self
    }

    /// How far apart cuts are: one smoothed permit-hold time, at least [`Self::MIN_DECREASE_GAP`].
    fn gap(&self) -> Duration {
        self.hold
            .unwrap_or(Self::DEFAULT_HOLD)
            .max(Self::MIN_DECREASE_GAP)
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit.round() as usize
    }

    /// A request returned its permit after holding it for `held`.
    pub(crate) fn sample(&mut self, held: Duration) {
        self.hold = Some(match self.hold {
            None => held,
            Some(h) => h.mul_f64(0.9) + held.mul_f64(0.1),
        });
    }

    /// Closes one control interval at `now`; says what it did to the limit.
    pub(crate) fn update(&mut self, now: Instant, seen: Interval) -> Step {
        let before = self.limit();
        if !seen.core_window {
            // The core's queue fell under the target: whatever cut was on trial worked.
            self.trial = None;
        }
        let ignoring_core = self.ignore_core_until.is_some_and(|t| now < t);
        let core = seen.core && !ignoring_core;
        let since_cut = self.last_decrease.map(|t| now.saturating_duration_since(t));
        if core || seen.inner {
            let due = since_cut.is_none_or(|d| d >= self.gap());
            if due && seen.peak_in_flight as f64 >= self.limit * 0.5 {
                match self.trial.take() {
                    // The last cut was for the core's queue alone and it is still all that
                    // stands: it had a hold time to show, and it did not shorten the queue.
                    Some(t) if !seen.inner && seen.delay > t.delay.mul_f64(Self::RELIEF) => {
                        self.limit = t.limit_before.min(self.max);
                        self.ignore_core_until = Some(now + Self::IGNORE_CORE_FOR);
                        return Step::Undone(self.limit());
                    }
                    _ => {
                        if self.core_cuts != CoreCuts::Unchecked && !seen.inner {
                            self.trial = Some(Trial {
                                limit_before: self.limit,
                                delay: seen.delay,
                            });
                        }
                        self.limit = (self.limit * Self::DECREASE).max(self.min);
                        self.last_decrease = Some(now);
                    }
                }
            }
        } else if seen.core {
            // Saturated, but the core's queue is being ignored: its last cut did not shorten it.
            // Checked: hold. Probe: if the limit is what turns requests away, grow by √limit a
            // second (a tenth of it per interval), so that a limit walked under the knee by
            // kept cuts comes back; the next trial cut judges the grown limit.
            if self.core_cuts == CoreCuts::Probe && seen.limited {
                let per_interval = super::CONTROL_INTERVAL.as_secs_f64();
                self.limit = (self.limit + self.limit.sqrt() * per_interval).min(self.max);
            }
        } else if seen.core_window {
            // One saturated window: not yet a cut, but no room to grow into either.
        } else if self.settle && since_cut.is_some_and(|d| d < self.gap()) {
            // The last cut has not had a hold time to show yet: hold.
        } else if seen.limited || seen.peak_in_flight as f64 >= self.limit * Self::NEARLY_FULL {
            let near_knee = since_cut.is_some_and(|d| d < Self::NEAR_KNEE_FOR);
            // A cut in the last few seconds found the knee: come back to it by √limit an
            // interval, not by a tenth, so that the overshoot past it (and the line the
            // overshoot stands in) is smaller. √limit a second was tried and kept the limit
            // under the knee too long: the core went a fifth idle.
            self.limit = if !near_knee && seen.delay < self.target / 2 {
                self.limit * Self::FAST_INCREASE
            } else {
                self.limit + self.limit.sqrt()
            }
            .min(self.max);
        }
        let after = self.limit();
        match after.cmp(&before) {
            std::cmp::Ordering::Less => Step::Cut(after),
            std::cmp::Ordering::Equal => Step::Held,
            std::cmp::Ordering::Greater => Step::Grew(after),
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
    pub(crate) const WINDOW: Duration = Duration::from_millis(100);
    pub(crate) const MIN_SAMPLES: u32 = 10;
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

    pub(crate) fn limit(&self) -> usize {
        self.limit.round() as usize
    }

    /// Feeds one completed request; returns a new limit when a window closes.
    pub(crate) fn sample(&mut self, rtt: Duration, in_flight: usize) -> Option<usize> {
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

    const TARGET: Duration = Duration::from_millis(5);
    const TICK: Duration = Duration::from_millis(100);

    fn settings() -> AdaptiveSettings {
        AdaptiveSettings {
            initial_limit: 100,
            min_limit: std::num::NonZeroUsize::new(10).unwrap(),
            max_limit: 1000,
            tolerance: 1.5,
            smoothing: crate::config::Ratio::of(0.2),
        }
    }

    /// A gateway on one core under far more demand than it can carry: each request needs
    /// `cost` of CPU and waits `io` on its downstreams, so the core is saturated exactly when
    /// more than `io / cost` (Little's law) requests are in flight. The controller sees what the
    /// real one sees: saturation, a delay, a full limit and requests turned away.
    fn run(l: &mut QueueDelayLimit, now: &mut Instant, capacity_in_flight: f64, ticks: usize) {
        let io = Duration::from_millis(100);
        for _ in 0..ticks {
            let in_flight = l.limit() as f64;
            let load = in_flight / capacity_in_flight;
            let saturated = load > 1.0;
            // Past saturation every request also queues for the core.
            let delay = if saturated {
                io.mul_f64(load - 1.0)
            } else {
                Duration::from_micros(200)
            };
            l.sample(io + delay);
            l.update(
                *now,
                Interval {
                    core: saturated,
                    core_window: saturated,
                    inner: false,
                    delay,
                    peak_in_flight: l.limit(),
                    limited: true,
                },
            );
            *now += TICK;
        }
    }

    fn band(l: &mut QueueDelayLimit, now: &mut Instant, capacity: f64) -> (usize, usize) {
        let (mut lo, mut hi) = (usize::MAX, 0);
        for _ in 0..50 {
            run(l, now, capacity, 1);
            lo = lo.min(l.limit());
            hi = hi.max(l.limit());
        }
        (lo, hi)
    }

    #[test]
    fn the_limit_converges_on_the_cores_capacity_and_follows_a_step_change() {
        // Where the core's queue is the admitted work, a trial cut shortens it and is kept, so
        // probing (`Probe`) must not push the limit past the knee either.
        for cuts in [CoreCuts::Checked, CoreCuts::Probe] {
            let mut s = settings();
            s.max_limit = 5000;
            let mut l = QueueDelayLimit::new(&s, TARGET, cuts);
            let mut now = Instant::now();
            // 3,000 req/s of CPU at 100 ms of I/O each: 300 in flight keep the core busy.
            run(&mut l, &mut now, 300.0, 200);
            let (lo, hi) = band(&mut l, &mut now, 300.0);
            assert!(
                lo >= 240 && hi <= 360,
                "{cuts:?}: should oscillate around 300, got {lo}..{hi}"
            );
            // Half the CPU (a noisy neighbour, a smaller pod): the limit must follow.
            run(&mut l, &mut now, 150.0, 200);
            let (lo, hi) = band(&mut l, &mut now, 150.0);
            assert!(
                lo >= 120 && hi <= 180,
                "{cuts:?}: should follow to around 150, got {lo}..{hi}"
            );
        }
    }

    /// A calm interval in which the limit turned someone away: the limit may grow.
    const LIMITED_CALM: Interval = Interval {
        core: false,
        core_window: false,
        inner: false,
        delay: Duration::from_micros(200),
        peak_in_flight: 100,
        limited: true,
    };

    #[test]
    fn one_saturated_window_neither_cuts_nor_grows_the_limit() {
        let limited_calm = LIMITED_CALM;
        let burst = Interval {
            core_window: true,
            delay: Duration::from_millis(20),
            ..limited_calm
        };
        let mut l = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Checked);
        let now = Instant::now();
        assert_eq!(l.update(now, burst), Step::Held, "one window: a burst");
        assert!(
            matches!(l.update(now + TICK, limited_calm), Step::Grew(_)),
            "calm and limiting: grows"
        );
        let stays = Interval {
            core: true,
            ..burst
        };
        assert!(
            matches!(l.update(now + TICK * 2, stays), Step::Cut(_)),
            "two windows in a row: cut"
        );
    }

    #[test]
    fn settling_holds_the_limit_for_a_hold_time_after_a_cut() {
        let limited_calm = LIMITED_CALM;
        let pool_line = Interval {
            inner: true,
            ..limited_calm
        };
        for settle in [false, true] {
            let mut l = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Checked)
                .settling_after_cuts(settle);
            l.sample(Duration::from_millis(300));
            let mut now = Instant::now();
            assert_eq!(l.update(now, pool_line), Step::Cut(90));
            // The next interval is calm and the limit full: without settling it grows back
            // at once; settling, it holds until the 300 ms hold time has passed.
            now += TICK;
            let next = l.update(now, limited_calm);
            now += TICK;
            let after = l.update(now, limited_calm);
            if settle {
                assert_eq!(
                    (next, after),
                    (Step::Held, Step::Held),
                    "within the hold time"
                );
                now += TICK;
                assert!(
                    matches!(l.update(now, limited_calm), Step::Grew(_)),
                    "a hold time after the cut it grows again"
                );
            } else {
                assert!(
                    matches!(next, Step::Grew(_)),
                    "grows back at once: {next:?}"
                );
            }
        }
    }

    #[test]
    fn it_stays_within_its_bounds() {
        let mut l = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Checked);
        let mut now = Instant::now();
        run(&mut l, &mut now, 5.0, 3000);
        assert_eq!(l.limit(), 10, "never below min_limit");
        run(&mut l, &mut now, 1e9, 500);
        assert_eq!(l.limit(), 1000, "never above max_limit");
    }

    #[test]
    fn it_decreases_at_most_once_per_permit_hold_time() {
        let mut l = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Checked);
        l.sample(Duration::from_millis(400));
        let now = Instant::now();
        let saturated = Interval {
            core: true,
            core_window: true,
            inner: false,
            delay: Duration::from_millis(50),
            peak_in_flight: 100,
            limited: true,
        };
        assert_eq!(l.update(now, saturated), Step::Cut(90));
        assert_eq!(
            l.update(now + TICK, saturated),
            Step::Held,
            "the cut is not seen yet"
        );
        assert_eq!(l.update(now + TICK * 3, saturated), Step::Held);
        let shorter = Interval {
            delay: Duration::from_millis(40),
            ..saturated
        };
        assert_eq!(
            l.update(now + TICK * 4, shorter),
            Step::Cut(81),
            "the first cut shortened the queue: the next one is made"
        );
    }

    /// A core whose queue is made of something the limit does not govern (the rejections of a
    /// heavy overload): the queue stands at the same delay whatever the limit is, with the
    /// limit in use. `inner_over`: the database pool's line stands once more than this many
    /// are admitted.
    fn run_foreign_queue(
        l: &mut QueueDelayLimit,
        now: &mut Instant,
        inner_over: usize,
    ) -> (usize, usize) {
        let (mut lo, mut undone) = (usize::MAX, 0);
        for _ in 0..600 {
            l.sample(Duration::from_millis(150));
            let step = l.update(
                *now,
                Interval {
                    core: true,
                    core_window: true,
                    inner: l.limit() > inner_over,
                    delay: Duration::from_millis(30),
                    peak_in_flight: l.limit(),
                    limited: true,
                },
            );
            undone += usize::from(matches!(step, Step::Undone(_)));
            lo = lo.min(l.limit());
            *now += TICK;
        }
        (lo, undone)
    }

    #[test]
    fn a_cut_that_does_not_shorten_the_cores_queue_is_undone() {
        let mut now = Instant::now();
        let mut checked = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Checked);
        let (lo, undone) = run_foreign_queue(&mut checked, &mut now, usize::MAX);
        assert!(
            lo >= 90 && checked.limit() >= 90,
            "one trial cut at a time, each undone: got down to {lo}, ended at {}",
            checked.limit()
        );
        // One trial per second of being ignored plus a hold time to judge it: 60 s, ~50 trials.
        assert!((40..=60).contains(&undone), "{undone} cuts undone in 60 s");

        // Without the check every window over the target cuts, down to the floor.
        let mut unchecked = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Unchecked);
        let (lo, undone) = run_foreign_queue(&mut unchecked, &mut now, usize::MAX);
        assert_eq!((lo, undone), (10, 0), "unchecked: walked to min_limit");
    }

    #[test]
    fn cuts_for_a_standing_inner_queue_are_never_undone() {
        let mut now = Instant::now();
        let mut l = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Checked);
        // The pool's line stands above 50 admitted: its cuts take the limit under it and keep
        // it there, although the core's queue (not shortened by them) is as long as ever.
        let (lo, _) = run_foreign_queue(&mut l, &mut now, 50);
        assert!(lo <= 50, "got down to {lo}");
        assert!(
            (40..=55).contains(&l.limit()),
            "held near the pool's knee, got {}",
            l.limit()
        );
    }

    #[test]
    fn probing_past_a_foreign_queue_climbs_back_to_the_pools_knee() {
        // Rejections keep the core's queue over the target whatever the limit; the pool's line
        // stands past 300 admitted. Checked holds wherever the kept cuts left it (here the
        // initial 100, every trial cut undone); probing climbs to the pool's knee and stays.
        let mut now = Instant::now();
        let mut checked = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Checked);
        run_foreign_queue(&mut checked, &mut now, 300);
        assert!(
            checked.limit() <= 100,
            "checked never grows here, got {}",
            checked.limit()
        );
        let mut probing = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Probe);
        run_foreign_queue(&mut probing, &mut now, 300);
        let (mut lo, mut hi) = (usize::MAX, 0);
        for _ in 0..10 {
            run_foreign_queue(&mut probing, &mut now, 300);
            lo = lo.min(probing.limit());
            hi = hi.max(probing.limit());
        }
        assert!(
            lo >= 240 && hi <= 330,
            "should hold near the pool's knee of 300, got {lo}..{hi}"
        );
    }

    #[test]
    fn it_does_not_move_when_it_is_not_what_limits() {
        let mut l = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Checked);
        let now = Instant::now();
        // Saturated by something else while few permits are held: cutting would not help.
        let bystander = Interval {
            core: true,
            core_window: true,
            inner: false,
            delay: Duration::from_millis(50),
            peak_in_flight: 20,
            limited: false,
        };
        assert_eq!(l.update(now, bystander), Step::Held);
        // Calm and nobody turned away: nothing to learn.
        let idle = Interval {
            core: false,
            core_window: false,
            inner: false,
            delay: Duration::from_micros(100),
            peak_in_flight: 20,
            limited: false,
        };
        assert_eq!(l.update(now + TICK, idle), Step::Held);
        // Calm and limited: grow fast while the queue is short, gently near the target.
        let limited = Interval {
            limited: true,
            ..idle
        };
        assert_eq!(l.update(now + TICK * 2, limited), Step::Grew(110));
        let near = Interval {
            delay: Duration::from_millis(4),
            ..limited
        };
        assert_eq!(l.update(now + TICK * 3, near), Step::Grew(120));
    }

    #[test]
    fn a_calm_limit_keeps_a_tenth_of_headroom_over_what_demand_holds() {
        let mut l = QueueDelayLimit::new(&settings(), TARGET, CoreCuts::Checked);
        assert_eq!(l.limit(), 100);
        let mut now = Instant::now();
        // A closed loop that holds every one of the 100 permits on a calm core: nobody has been
        // turned away yet, but one cut would.
        let demand = Interval {
            core: false,
            core_window: false,
            inner: false,
            delay: Duration::from_micros(100),
            peak_in_flight: 100,
            limited: false,
        };
        for _ in 0..10 {
            now += TICK;
            l.update(now, demand);
        }
        assert_eq!(
            l.limit(),
            121,
            "grows until demand holds under nine tenths of it"
        );
        now += TICK;
        assert_eq!(l.update(now, demand), Step::Held, "and then holds");
        // A burst on the database pool's line cuts it: the cut leaves it over demand.
        now += TICK;
        let pool = Interval {
            inner: true,
            ..demand
        };
        assert_eq!(l.update(now, pool), Step::Cut(109));
    }

    /// Feeds `windows` windows of requests at a fixed latency with the limit saturated.
    async fn feed(g: &mut Gradient2, rtt_ms: u64, windows: usize) -> usize {
        let mut last = g.limit();
        for _ in 0..windows {
            for _ in 0..Gradient2::MIN_SAMPLES {
                if let Some(l) = g.sample(Duration::from_millis(rtt_ms), last) {
                    last = l;
                }
            }
            tokio::time::advance(Gradient2::WINDOW).await;
        }
        last
    }

    #[tokio::test(start_paused = true)]
    async fn gradient2_grows_under_steady_latency_and_shrinks_on_a_spike() {
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
    async fn gradient2_does_not_grow_an_idle_applications_limit() {
        let mut g = Gradient2::new(&settings());
        for _ in 0..30 {
            for _ in 0..Gradient2::MIN_SAMPLES {
                assert_eq!(g.sample(Duration::from_millis(5), 3), None);
            }
            tokio::time::advance(Gradient2::WINDOW).await;
        }
    }
}
