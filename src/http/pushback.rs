//! Pushback on the connection: after a rejection, stop reading from that client for a moment.
//!
//! A 503 with `Retry-After` is a request; a client that ignores it (wrk, a naive retry loop,
//! a tight SDK loop) sends its next request the instant the answer arrives. Each of those costs
//! the gateway a read, a parse, a decision and a write, ~10 µs of CPU; at 10,000 such
//! connections the rejections alone take the core, and the requests it admitted starve. The
//! answer is TCP's own flow control: while a connection is paused its next request waits in the
//! kernel's socket buffer (and then the client's), costing the gateway nothing. The pause ends
//! after `Retry-After` (at most [`MAX_PAUSE`]), so an honest client that waited as asked never
//! notices it.
//!
//! Only reads are paused; the answer already produced is written at once. HTTP/2 connections
//! are not paused (one connection carries many clients' streams and its control frames), and
//! an L7 proxy in front multiplexes clients onto connections the same way: turn
//! `admission.pushback` off there.

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::atomic::{AtomicU64, Ordering},
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::{Instant, Sleep},
};

/// The longest a connection is paused after one rejection.
pub(crate) const MAX_PAUSE: Duration = Duration::from_secs(2);

/// A connection's pause, shared by its IO wrapper and the requests it carries.
pub(crate) struct Pushback {
    epoch: Instant,
    /// Nanoseconds after `epoch` until which reads wait; 0 for none.
    until: AtomicU64,
}

impl Pushback {
    pub(crate) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            until: AtomicU64::new(0),
        }
    }

    /// Pauses reads for `pause` (at most [`MAX_PAUSE`]) from now.
    pub(crate) fn pause(&self, pause: Duration) {
        let until = (Instant::now() + pause.min(MAX_PAUSE)).saturating_duration_since(self.epoch);
        self.until
            .fetch_max(until.as_nanos() as u64, Ordering::Relaxed);
    }

    fn paused_until(&self) -> Option<Instant> {
        let until = self.until.load(Ordering::Relaxed);
        let until = self.epoch + Duration::from_nanos(until);
        (until > Instant::now()).then_some(until)
    }
}

/// An IO object whose reads wait while its [`Pushback`] says so.
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
}

impl<S> Pausable<S> {
    pub(crate) fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Pausable<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        // The common case: one relaxed load and a clock read.
        while let Some(until) = this.pushback.paused_until() {
            let sleep = this
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
            if sleep.deadline() != until {
                sleep.as_mut().reset(until);
            }
            ready!(sleep.as_mut().poll(cx));
        }
        this.sleep = None;
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Pausable<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
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

    #[tokio::test(start_paused = true)]
    async fn reads_wait_out_the_pause_and_writes_do_not() {
        let (client, server) = tokio::io::duplex(1024);
        let pushback = Arc::new(Pushback::new());
        let mut server = Pausable::new(server, Arc::clone(&pushback));
        let (mut client_rx, mut client_tx) = tokio::io::split(client);
        client_tx.write_all(b"next request").await.unwrap();

        pushback.pause(Duration::from_millis(500));
        let started = Instant::now();
        server.write_all(b"503").await.unwrap();
        let mut answer = [0u8; 3];
        client_rx.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"503");
        assert_eq!(started.elapsed(), Duration::ZERO, "writes are not paused");

        let mut buf = [0u8; 12];
        server.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"next request");
        assert!(
            started.elapsed() >= Duration::from_millis(500),
            "the read waited for the pause: {:?}",
            started.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_pause_is_capped_and_a_longer_one_extends_it() {
        let pushback = Pushback::new();
        pushback.pause(Duration::from_secs(30));
        let until = pushback.paused_until().unwrap();
        assert_eq!(until - Instant::now(), MAX_PAUSE);
        tokio::time::advance(MAX_PAUSE).await;
        assert!(pushback.paused_until().is_none());
        pushback.pause(Duration::from_millis(100));
        pushback.pause(Duration::from_millis(10));
        assert_eq!(
            pushback.paused_until().unwrap() - Instant::now(),
            Duration::from_millis(100),
            "a shorter pause does not cut a longer one short"
        );
    }
}
