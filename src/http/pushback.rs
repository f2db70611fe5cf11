//! Pushback on the connection: a client that comes back before its `Retry-After` waits for
//! its next answer.
//!
//! A 503 with `Retry-After` is a request; a client that ignores it (wrk, a naive retry loop,
//! a tight SDK loop) sends its next request the instant the answer arrives. Each of those costs
//! the gateway a read, a parse, a decision and a write, ~10 µs of CPU; at 10,000 such
//! connections the rejections alone take the core, and the requests it admitted starve.
//!
//! So each HTTP/1 connection remembers until when its last 503 asked it to stay away
//! (`Retry-After`, at most `admission.pushback_max_hold`). A request that arrives within that time is still read
//! and decided at once, so if there is room it is admitted and answered without delay; only if
//! it is turned away again is its 503 **held** until the time the client was asked to wait for,
//! and the next stay-away counts from then. A client that ignores `Retry-After` therefore costs
//! one rejection per pause, and its next request waits on its own connection, in the kernel's
//! socket buffer and the client's, costing the gateway nothing. A client that waited as asked
//! is never held.
//!
//! **The pause doubles for a client that keeps coming back early**, as the exponential backoff
//! it should be doing would: its first held 503 waits out the `Retry-After`, the next stay-away
//! is twice that, then four times, up to `admission.pushback_max_hold`; each 503's
//! `Retry-After` says the stay-away it is given. A client that waits as asked starts again from
//! the plain `Retry-After`. Rejections are what an overload costs beyond the requests admitted,
//! and a held one is not cheap: it comes on a connection whose state went cold in the seconds
//! since its last answer, and its hold arms a timer (the lab's overload curve fits 40–50 µs of
//! CPU to each, a fifth of a served request, against 6 µs for a rejection answered on a warm
//! connection). With the `Retry-After` of a moderate backlog (1–3 s) 10,000 connections that
//! retry at once came back 3,000–5,000 times a second; with the pause doubling they come back
//! about once per `pushback_max_hold`.
//!
//! Holding the answer rather than pausing reads after every 503 (the first design) matters for
//! the requests that succeed: with reads paused, a retry that would have been admitted sat
//! unread for up to two seconds, and every success that followed a rejection on its connection
//! carried that pause in its latency (in an open-loop load, any request the client happened to
//! send on such a connection). Now the pause is paid only by a request that is rejected anyway.
//!
//! The edge ([`super::edge`]) applies it to its own 503s and to a 503 with `Retry-After` from
//! beneath it (a required part's open circuit), which a client that retries at once would
//! otherwise turn into a storm while the circuit is open.
//!
//! Only writes are held, and only while a held 503 is being written; HTTP/2 connections are not
//! held (one connection carries many clients' streams and its control frames), and an L7 proxy
//! in front multiplexes clients onto connections the same way: turn `admission.pushback` off
//! there. The server-side latency recorded for a held 503 is the decision's, not the hold's.

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::atomic::{AtomicU32, AtomicU64, Ordering},
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::{Instant, Sleep},
};

/// A connection's pushback state, shared by its IO wrapper and the requests it carries.
pub(crate) struct Pushback {
    epoch: Instant,
    /// The longest a client is asked to stay away after one rejection, and so the longest a held
    /// answer waits: `admission.pushback_max_hold`, at most half the connection's write timeout.
    max_pause: Duration,
    /// Nanoseconds after `epoch` until which the last 503 asked the client to stay away; 0 for
    /// none.
    away_until: AtomicU64,
    /// Nanoseconds after `epoch` until which writes wait (a held 503); 0 for none.
    hold_until: AtomicU64,
    /// Rejections in a row that came back before their stay-away: the pause is the
    /// `Retry-After` doubled this many times (capped by `max_pause`).
    early: AtomicU32,
}

/// What [`Pushback::rejected`] decided for one 503.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Turned {
    /// The answer waits until the last stay-away is over (the client came back early).
    pub(crate) held: bool,
    /// The stay-away this 503 asks for, counted from when the client gets it: its
    /// `Retry-After`.
    pub(crate) stay_away: Duration,
}

impl Pushback {
    /// `write_timeout` is the connection's: a held write must not look like a stuck client.
    pub(crate) fn new(max_hold: Duration, write_timeout: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            max_pause: max_hold.min(write_timeout / 2),
            away_until: AtomicU64::new(0),
            hold_until: AtomicU64::new(0),
            early: AtomicU32::new(0),
        }
    }

    fn nanos(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    fn instant(&self, nanos: u64) -> Instant {
        self.epoch + Duration::from_nanos(nanos)
    }

    /// The request on this connection is being turned away with `retry_after`: is its answer
    /// held (the client came back before its last 503's stay-away), and what stay-away does it
    /// ask for?
    pub(crate) fn rejected(&self, retry_after: Duration) -> Turned {
        let now = Instant::now();
        let away = self.instant(self.away_until.load(Ordering::Relaxed));
        let held = away > now;
        // Relaxed is enough: a connection's requests are decided one at a time.
        let early = if held {
            self.early.load(Ordering::Relaxed).saturating_add(1)
        } else {
            0
        };
        self.early.store(early, Ordering::Relaxed);
        let stay_away = retry_after
            .saturating_mul(1 << early.min(16))
            .min(self.max_pause);
        if held {
            // Early: the answer waits for the time the client was asked to wait for, and the
            // next stay-away counts from when it gets the answer.
            self.hold_until.store(self.nanos(away), Ordering::Relaxed);
            self.away_until
                .store(self.nanos(away + stay_away), Ordering::Relaxed);
        } else {
            self.away_until
                .store(self.nanos(now + stay_away), Ordering::Relaxed);
        }
        Turned { held, stay_away }
    }

    fn held_until(&self) -> Option<Instant> {
        let until = self.hold_until.load(Ordering::Relaxed);
        if until == 0 {
            return None;
        }
        let until = self.instant(until);
        (until > Instant::now()).then_some(until)
    }
}

/// An IO object whose writes wait while its [`Pushback`] holds an answer.
pub(crate) struct Pausable<S> {
    inner: S,
    pushback: std::sync::Arc<Pushback>,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl<S> Pausable<S> {
    pub(crate) fn new(inner: S, pushback: std::sync::Arc<Pushback>) -> Self {
        Self {
            inner,
            pushback,
            sleep: None,
        }
    }

    pub(crate) fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Ready once no answer is held. The common case: one relaxed load.
    fn poll_hold(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        while let Some(until) = self.pushback.held_until() {
            let sleep = self
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
            if sleep.deadline() != until {
                sleep.as_mut().reset(until);
            }
            ready!(sleep.as_mut().poll(cx));
        }
        Poll::Ready(())
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Pausable<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Pausable<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        ready!(self.poll_hold(cx));
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        ready!(self.poll_hold(cx));
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_hold(cx));
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
    const MAX_HOLD: Duration = Duration::from_secs(2);
    const RETRY_AFTER: Duration = Duration::from_millis(1500);

    #[tokio::test(start_paused = true)]
    async fn a_first_rejection_is_answered_at_once_and_reads_are_never_paused() {
        let (client, server) = tokio::io::duplex(1024);
        let pushback = Arc::new(Pushback::new(MAX_HOLD, WRITE_TIMEOUT));
        let mut server = Pausable::new(server, Arc::clone(&pushback));
        let (mut client_rx, mut client_tx) = tokio::io::split(client);

        let started = Instant::now();
        assert!(
            !pushback.rejected(RETRY_AFTER).held,
            "nothing asked it to stay away yet"
        );
        server.write_all(b"503").await.unwrap();
        let mut answer = [0u8; 3];
        client_rx.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"503");
        // The retry, at once: read at once, so it can be admitted if there is room.
        client_tx.write_all(b"retry").await.unwrap();
        let mut buf = [0u8; 5];
        server.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"retry");
        assert_eq!(started.elapsed(), Duration::ZERO, "neither was delayed");
        // Admitted: its answer is not held either.
        server.write_all(b"200").await.unwrap();
        server.flush().await.unwrap();
        client_rx.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"200");
        assert_eq!(started.elapsed(), Duration::ZERO, "a success is never held");
    }

    #[tokio::test(start_paused = true)]
    async fn a_rejection_of_a_client_back_too_early_is_held_until_its_retry_after() {
        let (client, server) = tokio::io::duplex(1024);
        let pushback = Arc::new(Pushback::new(MAX_HOLD, WRITE_TIMEOUT));
        let mut server = Pausable::new(server, Arc::clone(&pushback));
        let mut client = client;
        let first = Instant::now();
        assert!(!pushback.rejected(RETRY_AFTER).held);
        tokio::time::advance(Duration::from_millis(10)).await;

        let turned = pushback.rejected(RETRY_AFTER);
        assert!(turned.held, "back after 10 ms of 1.5 s");
        assert_eq!(
            turned.stay_away, MAX_HOLD,
            "back early: twice the Retry-After, capped at the max hold"
        );
        server.write_all(b"503").await.unwrap();
        server.flush().await.unwrap();
        let mut answer = [0u8; 3];
        client.read_exact(&mut answer).await.unwrap();
        assert_eq!(
            first.elapsed(),
            RETRY_AFTER,
            "held until the first 503's Retry-After"
        );
        // At once again: the next stay-away counts from the held answer.
        assert!(pushback.rejected(RETRY_AFTER).held);
        server.write_all(b"503").await.unwrap();
        client.read_exact(&mut answer).await.unwrap();
        assert_eq!(first.elapsed(), RETRY_AFTER + MAX_HOLD);
    }

    #[tokio::test(start_paused = true)]
    async fn the_stay_away_doubles_while_a_client_keeps_coming_back_early_and_resets_when_it_waits()
    {
        let max_hold = Duration::from_secs(10);
        let pushback = Pushback::new(max_hold, Duration::from_secs(60));
        let ra = Duration::from_secs(1);
        let first = pushback.rejected(ra);
        assert_eq!((first.held, first.stay_away), (false, ra));
        // A client that retries the moment each answer arrives: held, and asked (and made) to
        // stay away 2, 4, 8 s, then the max hold.
        let mut holds = Vec::new();
        for _ in 0..5 {
            let turned = pushback.rejected(ra);
            assert!(turned.held);
            let until = pushback.held_until().expect("held");
            holds.push(until - Instant::now());
            tokio::time::advance(until - Instant::now()).await;
            assert_eq!(
                turned.stay_away,
                (ra * 2u32.pow(holds.len() as u32)).min(max_hold)
            );
        }
        let secs: Vec<u64> = holds.iter().map(Duration::as_secs).collect();
        assert_eq!(
            secs,
            [1, 2, 4, 8, 10],
            "each hold is the stay-away the last 503 asked for"
        );
        // It waits as asked this time: answered at once, and back to the plain Retry-After.
        tokio::time::advance(max_hold).await;
        let turned = pushback.rejected(ra);
        assert_eq!((turned.held, turned.stay_away), (false, ra));
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(pushback.rejected(ra).stay_away, ra * 2, "starts over");
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_waited_as_asked_is_not_held() {
        let pushback = Pushback::new(MAX_HOLD, WRITE_TIMEOUT);
        assert!(!pushback.rejected(RETRY_AFTER).held);
        tokio::time::advance(RETRY_AFTER).await;
        let turned = pushback.rejected(RETRY_AFTER);
        assert!(!turned.held, "it waited the whole Retry-After");
        assert_eq!(turned.stay_away, RETRY_AFTER, "and is asked for no more");
        assert!(pushback.held_until().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn the_stay_away_is_capped_by_the_max_hold_and_the_write_timeout() {
        let cases = [
            (MAX_HOLD, WRITE_TIMEOUT, MAX_HOLD, "the default hold"),
            (
                Duration::from_secs(4),
                WRITE_TIMEOUT,
                Duration::from_secs(4),
                "the configured hold, not a fixed one",
            ),
            (
                MAX_HOLD,
                Duration::from_millis(600),
                Duration::from_millis(300),
                "half the write timeout, so a held answer is never taken for a stuck client",
            ),
        ];
        for (max_hold, write_timeout, held_for, why) in cases {
            let pushback = Pushback::new(max_hold, write_timeout);
            pushback.rejected(Duration::from_secs(30));
            assert!(pushback.rejected(Duration::from_secs(30)).held, "{why}");
            assert_eq!(
                pushback.held_until().unwrap() - Instant::now(),
                held_for,
                "{why}"
            );
        }
    }
}
