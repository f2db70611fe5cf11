//! A bound on how long a response write may make no progress.
//!
//! hyper has a timer for reading a request head but none for writing a response: a client
//! that stops reading fills the socket's send buffer, hyper's write returns `Pending`, and the
//! connection, with the whole response it holds, waits for as long as the client stays
//! connected. [`WriteTimeout`] wraps the connection's I/O and fails a write (or flush) that
//! has stayed pending for the configured time; hyper then ends the connection and frees its
//! buffers. Any progress re-arms the timer, so a slow reader that keeps reading is served.

use std::{
    future::Future,
    io,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::{Instant, Sleep},
};

/// `io` with writes that fail once they have made no progress for `timeout`.
pub(super) struct WriteTimeout<T> {
    io: T,
    timeout: Duration,
    /// Allocated on the first stalled write and reused after it.
    timer: Option<Pin<Box<Sleep>>>,
    /// Whether `timer` measures the current stall.
    armed: bool,
}

impl<T> WriteTimeout<T> {
    pub(super) fn new(io: T, timeout: Duration) -> Self {
        Self {
            io,
            timeout,
            timer: None,
            armed: false,
        }
    }

    /// Passes a ready result through (progress: the timer is disarmed) and turns a pending one
    /// into an error once the stall has lasted `timeout`.
    fn watch<R>(
        &mut self,
        cx: &mut Context<'_>,
        result: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        if result.is_ready() {
            self.armed = false;
            return result;
        }
        let deadline = Instant::now() + self.timeout;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            timer.as_mut().reset(deadline);
            self.armed = true;
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.armed = false;
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client read nothing for the write timeout",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteTimeout<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteTimeout<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write(cx, buf);
        this.watch(cx, result)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.watch(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_flush(cx);
        this.watch(cx, result)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_shutdown(cx);
        this.watch(cx, result)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_write_nobody_reads_fails_after_the_timeout_and_progress_rearms_it() {
        // A pipe with room for 64 bytes, standing in for a full socket buffer.
        let (client, server) = tokio::io::duplex(64);
        let mut server = WriteTimeout::new(server, Duration::from_secs(5));
        let (mut client_read, _client_write) = tokio::io::split(client);

        // The client keeps reading, slowly: every write makes progress within the timeout.
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            for _ in 0..8 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                client_read.read_exact(&mut buf).await.unwrap();
            }
            client_read
        });
        server
            .write_all(&[7u8; 64 * 8])
            .await
            .expect("a slow reader is served");
        let _client_read = reader.await.unwrap();

        // Nobody reads any more: the first write fills the pipe, the second stalls and fails.
        server.write_all(&[7u8; 64]).await.unwrap();
        let started = Instant::now();
        let err = server.write_all(&[7u8; 64]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_secs(5));
    }
}
