//! A circuit breaker per downstream: closed → open → half-open → closed.
//!
//! While a dependency is failing, calling it anyway costs a timeout per request and keeps its
//! bulkhead full; an open circuit answers "no" in nanoseconds instead, so optional parts degrade
//! at once and a required part fails fast with 503. After `open_for`, a few probes are let
//! through (half-open); if they all succeed the circuit closes, if one fails it opens again.
//!
//! The state sits behind a `std::sync::Mutex`: every critical section is a handful of integer
//! operations with no `.await` inside, which is cheaper than an async mutex and cannot block a
//! worker for longer than the bookkeeping itself (the mini-redis argument). The question asked
//! before every call, "is the circuit closed?", is answered from an atomic copy of the state
//! without the lock or a clock read: five times a dashboard, and nearly always "yes". A call
//! admitted in the instant the circuit opens is harmless: its report is ignored, as is that of
//! any call admitted before the circuit opened.

use std::sync::{
    Mutex,
    atomic::{AtomicBool, Ordering},
};

use metrics::{Counter, Gauge};
use tokio::time::Instant;

use crate::config::CircuitBreakerSettings;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    HalfOpen,
    Open,
}

impl State {
    const ALL: [State; 3] = [State::Closed, State::HalfOpen, State::Open];

    fn index(self) -> usize {
        match self {
            State::Closed => 0,
            State::HalfOpen => 1,
            State::Open => 2,
        }
    }

    fn label(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::HalfOpen => "half_open",
            State::Open => "open",
        }
    }

    fn gauge_value(self) -> f64 {
        match self {
            State::Closed => 0.0,
            State::HalfOpen => 1.0,
            State::Open => 2.0,
        }
    }
}

#[derive(Debug)]
struct Inner {
    state: State,
    window_started: Instant,
    calls: u32,
    failures: u32,
    opened_at: Instant,
    probes_in_flight: u32,
    probe_successes: u32,
}

/// Permission to make one call; report its outcome with [`Breaker::record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    Yes,
    /// Yes, as one of the half-open probes.
    Probe,
}

/// An admitted call that reports back exactly once: through [`Ticket::record`], or, when it is
/// dropped unreported, by giving its half-open probe slot back.
///
/// A call can be dropped mid-flight: the client went away, a sibling part failed and
/// `try_join!` dropped the rest, or the fan-out's safety-net timeout fired. A probe dropped
/// that way would otherwise keep its slot for good, and once `half_open_probes` of them were
/// lost the circuit would stay half-open forever, refusing every call to a healthy service.
pub struct Ticket<'a> {
    breaker: &'a Breaker,
    admit: Option<Admit>,
}

impl Ticket<'_> {
    /// Reports how the call ended.
    pub fn record(mut self, success: bool) {
        if let Some(admit) = self.admit.take() {
            self.breaker.record(admit, success);
        }
    }

    /// The call was not made, or its result says nothing about the dependency's health.
    pub fn release(mut self) {
        if let Some(admit) = self.admit.take() {
            self.breaker.release_unused(admit);
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if let Some(admit) = self.admit.take() {
            self.breaker.release_unused(admit);
        }
    }
}

pub struct Breaker {
    /// The downstream's name and variant (`stable` for its own deployment), for the
    /// state-change log line.
    name: &'static str,
    variant: std::sync::Arc<str>,
    settings: CircuitBreakerSettings,
    /// `inner.state == Closed`, or the breaker is disabled: read without the lock by
    /// [`Breaker::admit`], written under it by every transition.
    closed: AtomicBool,
    inner: Mutex<Inner>,
    gauge: Gauge,
    /// Transitions into each state: a gauge sampled every 15 s misses a circuit that opened and
    /// closed in between; a counter does not.
    transitions: [Counter; 3],
}

impl Breaker {
    pub fn new(
        name: &'static str,
        variant: std::sync::Arc<str>,
        settings: CircuitBreakerSettings,
        gauge: Gauge,
    ) -> Self {
        let now = Instant::now();
        gauge.set(State::Closed.gauge_value());
        let transitions = State::ALL.map(|to| {
            let c = metrics::counter!(
                super::CIRCUIT_TRANSITIONS.name,
                "downstream" => name,
                "variant" => variant.to_string(),
                "to" => to.label()
            );
            c.increment(0);
            c
        });
        Self {
            name,
            variant,
            settings,
            closed: AtomicBool::new(true),
            inner: Mutex::new(Inner {
                state: State::Closed,
                window_started: now,
                calls: 0,
                failures: 0,
                opened_at: now,
                probes_in_flight: 0,
                probe_successes: 0,
            }),
            gauge,
            transitions,
        }
    }

    pub fn state(&self) -> State {
        self.lock().state
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave the counters in a state worse than
        // "slightly off"; keep serving rather than poisoning every later call.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// May a call be made now? `None` means the circuit is open: fail fast.
    pub fn admit(&self) -> Option<Admit> {
        // Acquire: pairs with the transition's Release, so that a call admitted after the
        // circuit closed sees the state the closing left.
        if self.closed.load(Ordering::Acquire) {
            return Some(Admit::Yes);
        }
        let mut s = self.lock();
        match s.state {
            State::Closed => Some(Admit::Yes),
            State::Open if s.opened_at.elapsed() >= self.settings.open_for => {
                self.transition(&mut s, State::HalfOpen, Instant::now());
                s.probes_in_flight = 1;
                Some(Admit::Probe)
            }
            State::Open => None,
            State::HalfOpen if s.probes_in_flight < self.settings.half_open_probes => {
                s.probes_in_flight += 1;
                Some(Admit::Probe)
            }
            State::HalfOpen => None,
        }
    }

    /// [`admit`](Self::admit) as a [`Ticket`], which cannot leak a probe slot.
    pub fn ticket(&self) -> Option<Ticket<'_>> {
        self.admit().map(|admit| Ticket {
            breaker: self,
            admit: Some(admit),
        })
    }

    /// Reports how an admitted call ended.
    pub fn record(&self, admit: Admit, success: bool) {
        if !self.settings.enabled {
            return;
        }
        let mut s = self.lock();
        let now = Instant::now();
        if admit == Admit::Probe {
            if s.state != State::HalfOpen {
                return; // a stale probe from an earlier half-open period
            }
            s.probes_in_flight = s.probes_in_flight.saturating_sub(1);
            if success {
                s.probe_successes += 1;
                if s.probe_successes >= self.settings.half_open_probes {
                    self.transition(&mut s, State::Closed, now);
                }
            } else {
                self.transition(&mut s, State::Open, now);
            }
            return;
        }
        if s.state != State::Closed {
            return; // a call admitted before the circuit opened
        }
        if now.duration_since(s.window_started) >= self.settings.window {
            s.window_started = now;
            s.calls = 0;
            s.failures = 0;
        }
        s.calls += 1;
        if !success {
            s.failures += 1;
        }
        if s.calls >= self.settings.min_calls
            && f64::from(s.failures) >= self.settings.failure_ratio.get() * f64::from(s.calls)
        {
            self.transition(&mut s, State::Open, now);
        }
    }

    /// Gives back a probe slot whose call never happened (e.g. shed by the bulkhead).
    pub fn release_unused(&self, admit: Admit) {
        if admit == Admit::Probe {
            let mut s = self.lock();
            if s.state == State::HalfOpen {
                s.probes_in_flight = s.probes_in_flight.saturating_sub(1);
            }
        }
    }

    fn transition(&self, s: &mut Inner, to: State, now: Instant) {
        if s.state != to {
            tracing::warn!(downstream = self.name, variant = &*self.variant, from = ?s.state, to = ?to, "circuit breaker state change");
            self.transitions[to.index()].increment(1);
        }
        s.state = to;
        self.closed.store(to == State::Closed, Ordering::Release);
        s.window_started = now;
        s.calls = 0;
        s.failures = 0;
        s.probe_successes = 0;
        s.probes_in_flight = 0;
        if to == State::Open {
            s.opened_at = now;
        }
        self.gauge.set(to.gauge_value());
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(
            "test",
            "stable".into(),
            CircuitBreakerSettings {
                enabled: true,
                failure_ratio: crate::config::Ratio::of(0.5),
                min_calls: 4,
                window: Duration::from_secs(10),
                open_for: Duration::from_secs(5),
                half_open_probes: 2,
            },
            metrics::gauge!("test_breaker_state"),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_enough_failures_then_probes_and_closes() {
        let b = breaker();
        for ok in [true, false, false, true] {
            let a = b.admit().unwrap();
            b.record(a, ok);
        }
        assert_eq!(b.state(), State::Open);
        assert!(b.admit().is_none(), "open circuit must fail fast");

        tokio::time::advance(Duration::from_secs(5)).await;
        let p1 = b.admit().unwrap();
        let p2 = b.admit().unwrap();
        assert_eq!((p1, p2), (Admit::Probe, Admit::Probe));
        assert!(b.admit().is_none(), "only half_open_probes probes at once");
        b.record(p1, true);
        assert_eq!(b.state(), State::HalfOpen);
        b.record(p2, true);
        assert_eq!(b.state(), State::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_dropped_without_a_report_frees_its_slot() {
        let b = breaker();
        for _ in 0..4 {
            b.ticket().unwrap().record(false);
        }
        tokio::time::advance(Duration::from_secs(5)).await;
        // Two probes are cancelled mid-call: their tickets are dropped unreported.
        drop((b.ticket().unwrap(), b.ticket().unwrap()));
        assert_eq!(b.state(), State::HalfOpen);
        let (p1, p2) = (
            b.ticket().expect("slot freed"),
            b.ticket().expect("slot freed"),
        );
        p1.record(true);
        p2.record(true);
        assert_eq!(b.state(), State::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_probe_reopens_the_circuit() {
        let b = breaker();
        for _ in 0..4 {
            let a = b.admit().unwrap();
            b.record(a, false);
        }
        tokio::time::advance(Duration::from_secs(6)).await;
        let p = b.admit().unwrap();
        b.record(p, false);
        assert_eq!(b.state(), State::Open);
        assert!(b.admit().is_none());
    }

    /// The closed circuit's answer needs neither the lock nor the clock: it comes while another
    /// thread holds the lock (before, `admit` waited for it).
    #[test]
    fn a_closed_circuit_admits_without_taking_the_lock() {
        let b = breaker();
        let held = b.lock();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| tx.send(b.admit()).unwrap());
            // Not a timing assertion: the bound only stops a regression from hanging the
            // suite; the answer comes at once or never while the lock is held.
            let answer = rx.recv_timeout(std::time::Duration::from_secs(30));
            drop(held);
            assert_eq!(answer, Ok(Some(Admit::Yes)));
        });
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_circuit_takes_the_slow_path_and_its_probes_close_it_again() {
        let b = breaker();
        for _ in 0..4 {
            b.ticket().unwrap().record(false);
        }
        assert!(!b.closed.load(Ordering::Relaxed));
        assert!(b.admit().is_none());
        tokio::time::advance(Duration::from_secs(5)).await;
        b.ticket().unwrap().record(true);
        assert!(!b.closed.load(Ordering::Relaxed), "half-open is not closed");
        b.ticket().unwrap().record(true);
        assert_eq!(b.state(), State::Closed);
        assert!(b.closed.load(Ordering::Relaxed));
        assert_eq!(b.admit(), Some(Admit::Yes));
    }

    #[tokio::test(start_paused = true)]
    async fn failures_below_min_calls_or_spread_over_windows_do_not_open() {
        let b = breaker();
        for _ in 0..3 {
            let a = b.admit().unwrap();
            b.record(a, false);
        }
        assert_eq!(b.state(), State::Closed);
        tokio::time::advance(Duration::from_secs(11)).await;
        let a = b.admit().unwrap();
        b.record(a, false);
        assert_eq!(b.state(), State::Closed, "the window reset the count");
    }
}
