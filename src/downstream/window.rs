//! A sliding window of one downstream instance's calls: how many, how many failed, and their
//! latencies, so that a canary can be compared with stable live (by the routing module, above this one).
//!
//! Kept only for a downstream that has variants (and for each variant): the window is set
//! when the routing first gives the downstream a variant, and a downstream without one pays
//! for nothing but the check that no window is set.
//!
//! The window is ten slots of a tenth of its length each; a slot older than the window is
//! cleared when it is reused, so the figures cover the last window, give or take a slot.
//! Latencies go into fixed buckets (those of the Prometheus histograms, refined), and the p99
//! is interpolated inside its bucket as `histogram_quantile` does, so the gateway's verdict
//! and the Grafana panel read the same kind of number.

use std::{sync::Mutex, time::Duration};

use serde::Serialize;
use tokio::time::Instant;

use super::Outcome;

const SLOTS: usize = 10;

/// Upper bounds of the latency buckets, in seconds; beyond the last one, the last one.
const BOUNDS: [f64; 20] = [
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0,
    1.5, 2.5, 5.0, 7.5, 10.0,
];

#[derive(Clone, Copy, Default)]
struct Slot {
    /// Which tenth of time this slot holds (`elapsed / width`); a stale one is cleared on use.
    epoch: u64,
    calls: u64,
    failures: u64,
    latency: [u64; BOUNDS.len()],
}

struct Inner {
    width: Duration,
    started: Instant,
    slots: [Slot; SLOTS],
}

/// The last `window` of calls of one instance.
pub struct Window {
    /// Held for a few additions or a sum over ten slots, never across an await.
    inner: Mutex<Inner>,
}

/// What a window saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Calls that were made or refused by the instance itself (a call the request's budget
    /// did not allow is not the instance's doing and is not counted).
    pub calls: u64,
    /// Errors, timeouts, a full bulkhead and an open circuit.
    pub failures: u64,
    /// `failures / calls`; 0 without calls.
    pub error_ratio: f64,
    /// 99th percentile of the calls that reached the instance, in milliseconds; 0 without any.
    pub p99_ms: f64,
}

impl Window {
    pub fn new(window: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner {
                width: (window / SLOTS as u32).max(Duration::from_millis(1)),
                started: Instant::now(),
                slots: [Slot::default(); SLOTS],
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Counters that may be one call off after a panic are still worth serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one call.
    pub(super) fn record(&self, outcome: Outcome, elapsed: Duration) {
        let (failed, reached) = match outcome {
            Outcome::Ok => (false, true),
            Outcome::Error | Outcome::Timeout => (true, true),
            Outcome::Shed | Outcome::CircuitOpen => (true, false),
            Outcome::BudgetExhausted => return,
        };
        let secs = elapsed.as_secs_f64();
        let bucket = BOUNDS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(BOUNDS.len() - 1);
        let mut inner = self.lock();
        let epoch = inner.epoch(Instant::now());
        let slot = &mut inner.slots[(epoch % SLOTS as u64) as usize];
        if slot.epoch != epoch {
            *slot = Slot {
                epoch,
                ..Slot::default()
            };
        }
        slot.calls += 1;
        slot.failures += u64::from(failed);
        if reached {
            slot.latency[bucket] += 1;
        }
    }

    /// The calls of the last window.
    pub fn stats(&self) -> Stats {
        let inner = self.lock();
        let now = inner.epoch(Instant::now());
        let mut calls = 0;
        let mut failures = 0;
        let mut latency = [0u64; BOUNDS.len()];
        for slot in inner
            .slots
            .iter()
            .filter(|s| s.epoch + (SLOTS as u64) > now)
        {
            calls += slot.calls;
            failures += slot.failures;
            for (sum, n) in latency.iter_mut().zip(slot.latency) {
                *sum += n;
            }
        }
        drop(inner);
        Stats {
            calls,
            failures,
            error_ratio: if calls == 0 {
                0.0
            } else {
                failures as f64 / calls as f64
            },
            p99_ms: quantile(&latency, 0.99) * 1000.0,
        }
    }

    /// Forgets every call (a resumed variant starts its comparison afresh).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.slots = [Slot::default(); SLOTS];
        inner.started = Instant::now();
    }
}

impl Inner {
    /// Epochs start at `SLOTS` so that an untouched slot (epoch 0) is always out of the window.
    fn epoch(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.started);
        (elapsed.as_nanos() / self.width.as_nanos().max(1)) as u64 + SLOTS as u64
    }
}

/// The `q` quantile of bucket counts, interpolated linearly inside its bucket; 0 when empty.
fn quantile(counts: &[u64; BOUNDS.len()], q: f64) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let rank = q * total as f64;
    let mut below = 0u64;
    for (i, n) in counts.iter().enumerate() {
        if *n > 0 && (below + n) as f64 >= rank {
            let lower = if i == 0 { 0.0 } else { BOUNDS[i - 1] };
            let within = (rank - below as f64) / *n as f64;
            return lower + (BOUNDS[i] - lower) * within.clamp(0.0, 1.0);
        }
        below += n;
    }
    BOUNDS[BOUNDS.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_counts_failures_and_takes_the_p99() {
        let w = Window::new(Duration::from_secs(60));
        for _ in 0..98 {
            w.record(Outcome::Ok, Duration::from_millis(8));
        }
        w.record(Outcome::Error, Duration::from_millis(8));
        w.record(Outcome::Timeout, Duration::from_millis(900));
        w.record(Outcome::Shed, Duration::ZERO);
        w.record(Outcome::BudgetExhausted, Duration::ZERO);
        let s = w.stats();
        assert_eq!((s.calls, s.failures), (101, 3));
        assert!((s.error_ratio - 3.0 / 101.0).abs() < 1e-9);
        // 100 calls reached it: the 99th is in the 5–10 ms bucket, the slow one above.
        assert!(s.p99_ms > 5.0 && s.p99_ms <= 10.0, "{s:?}");
        w.clear();
        assert_eq!(w.stats(), Stats::default());
    }

    #[tokio::test(start_paused = true)]
    async fn calls_older_than_the_window_no_longer_count() {
        let w = Window::new(Duration::from_secs(10));
        w.record(Outcome::Error, Duration::from_millis(1));
        tokio::time::advance(Duration::from_secs(5)).await;
        w.record(Outcome::Ok, Duration::from_millis(1));
        assert_eq!(w.stats().calls, 2);
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!((w.stats().calls, w.stats().failures), (1, 0));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(w.stats().calls, 0);
    }

    #[test]
    fn quantiles_interpolate_inside_the_bucket() {
        let mut counts = [0u64; BOUNDS.len()];
        counts[8] = 100; // 75–100 ms
        let p99 = quantile(&counts, 0.99);
        assert!((p99 - 0.09975).abs() < 1e-9, "{p99}");
        assert_eq!(quantile(&[0; BOUNDS.len()], 0.99), 0.0);
    }
}
