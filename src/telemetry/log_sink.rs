//! Where log lines go between the worker that formats them and stdout.
//!
//! A worker must never block on a write to stdout (a full pipe, a stalled log shipper), so a
//! line is appended to a bounded in-memory buffer and a dedicated thread writes the buffer out.
//! That thread wakes on a timer, every [`FLUSH_EVERY`], not once per line: a channel-based
//! writer (`tracing-appender`'s, which this replaced) wakes its thread for nearly every line
//! under load, and on the bench machine that wake-up cost the process about 9 µs of CPU per
//! request line, more than formatting the line did. Here a line costs one short lock and a
//! copy, and the thread writes a whole batch with one `write(2)`.
//!
//! When the buffer is full, lines are dropped whole and counted
//! (`tributary_log_lines_dropped_total`), never waited for. Dropping the guard writes out what
//! is left, so nothing logged before shutdown is lost.

use std::{
    io::{self, Write},
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use tracing_subscriber::fmt::MakeWriter;

/// How long a line may wait in memory before it is written.
pub(super) const FLUSH_EVERY: Duration = Duration::from_millis(50);

struct Shared {
    pending: Mutex<Vec<u8>>,
    capacity: usize,
    dropped: AtomicU64,
    stopping: AtomicBool,
    stop: Condvar,
}

impl Shared {
    /// Neither lock holder can leave the buffer half-written (a line is appended whole), so a
    /// poisoned lock still guards valid data.
    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends a whole line, or drops and counts it if the buffer cannot take it.
    fn append(&self, line: &[u8]) {
        let mut pending = self.lock();
        if pending.len() + line.len() > self.capacity {
            drop(pending);
            self.dropped.fetch_add(1, Ordering::Relaxed);
        } else {
            pending.extend_from_slice(line);
        }
    }
}

/// The `MakeWriter` handed to the log layer. Cheap to clone.
#[derive(Clone)]
pub(super) struct LogSink(Arc<Shared>);

/// Stops the writer thread and writes out every buffered line when dropped.
pub(super) struct LogSinkGuard {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl LogSink {
    /// Starts the writer thread for `out`; at most `capacity` bytes wait in memory.
    pub(super) fn spawn<W: Write + Send + 'static>(
        out: W,
        capacity: usize,
    ) -> io::Result<(Self, LogSinkGuard)> {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Vec::with_capacity(capacity.min(1 << 20))),
            capacity,
            dropped: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
            stop: Condvar::new(),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("log-writer".into())
                .spawn(move || write_forever(&shared, out))?
        };
        Ok((
            Self(Arc::clone(&shared)),
            LogSinkGuard {
                shared,
                thread: Some(thread),
            },
        ))
    }

    /// Lines dropped so far because the buffer was full.
    pub(super) fn dropped_lines(&self) -> u64 {
        self.0.dropped.load(Ordering::Relaxed)
    }
}

fn write_forever<W: Write>(shared: &Shared, mut out: W) {
    let mut batch = Vec::new();
    loop {
        let stopping = {
            let mut pending = shared.lock();
            if !shared.stopping.load(Ordering::Acquire) {
                // Sleeps a full interval (the guard's notify cuts it short): lines gather
                // meanwhile, and each wake-up writes all of them at once.
                pending = shared
                    .stop
                    .wait_timeout(pending, FLUSH_EVERY)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            // Swap rather than copy: the lock is held for a pointer exchange, and both buffers
            // keep their capacity from batch to batch.
            std::mem::swap(&mut *pending, &mut batch);
            shared.stopping.load(Ordering::Acquire)
        };
        write_batch(&mut out, &mut batch);
        if stopping {
            // Lines appended while the last batch was being written.
            std::mem::swap(&mut *shared.lock(), &mut batch);
            write_batch(&mut out, &mut batch);
            return;
        }
    }
}

fn write_batch<W: Write>(out: &mut W, batch: &mut Vec<u8>) {
    if !batch.is_empty() {
        // A failed write cannot be logged (this is the log); the lines are lost, as they would
        // be on a closed stdout anyway.
        let _ = out.write_all(batch).and_then(|()| out.flush());
        batch.clear();
    }
}

impl Drop for LogSinkGuard {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.stop.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One line being formatted: collected here and appended whole when dropped, so lines from
/// different workers never interleave and a line that does not fit is dropped entirely.
pub(super) struct Line<'a> {
    shared: &'a Shared,
    buf: Vec<u8>,
}

impl Write for Line<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.is_empty() && data.ends_with(b"\n") {
            // A whole line in one write (the JSON layer writes each line so): appended as it
            // is, with no copy into a buffer of its own first.
            self.shared.append(data);
        } else {
            self.buf.extend_from_slice(data);
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for Line<'_> {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            self.shared.append(&self.buf);
        }
    }
}

impl<'a> MakeWriter<'a> for LogSink {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        // Empty until a line comes in pieces: a whole line in one write never needs it.
        Line {
            shared: &self.0,
            buf: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    /// An output that records what reached it, and can be made to stall like a full pipe.
    #[derive(Clone, Default)]
    struct Output {
        written: Arc<Mutex<Vec<u8>>>,
        gate: Arc<Mutex<Option<mpsc::Receiver<()>>>>,
    }

    impl Write for Output {
        fn write(&mut self, data: &[u8]) -> io::Result<usize> {
            if let Some(gate) = self.gate.lock().unwrap().as_ref() {
                let _ = gate.recv();
            }
            self.written.lock().unwrap().extend_from_slice(data);
            Ok(data.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn log(sink: &LogSink, line: &str) {
        let mut w = sink.make_writer();
        // Two writes per line, as a formatter may do: they must arrive together.
        w.write_all(line.as_bytes()).unwrap();
        w.write_all(b"\n").unwrap();
    }

    #[test]
    fn every_line_is_written_whole_and_in_order_by_shutdown() {
        let out = Output::default();
        let (sink, guard) = LogSink::spawn(out.clone(), 1 << 20).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let sink = sink.clone();
                std::thread::spawn(move || {
                    for i in 0..500 {
                        log(&sink, &format!("thread {t} line {i:04} {}", "x".repeat(40)));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(guard);
        let written = String::from_utf8(out.written.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = written.lines().collect();
        assert_eq!(lines.len(), 2000);
        for t in 0..4 {
            let mine: Vec<&str> = lines
                .iter()
                .copied()
                .filter(|l| l.starts_with(&format!("thread {t} ")))
                .collect();
            assert_eq!(mine.len(), 500, "thread {t}");
            for (i, l) in mine.iter().enumerate() {
                assert_eq!(*l, format!("thread {t} line {i:04} {}", "x".repeat(40)));
            }
        }
        assert_eq!(sink.dropped_lines(), 0);
    }

    #[test]
    fn a_line_in_one_write_is_appended_whole_and_counted_when_it_does_not_fit() {
        let (release, gate) = mpsc::channel();
        let out = Output::default();
        *out.gate.lock().unwrap() = Some(gate);
        let (sink, guard) = LogSink::spawn(out.clone(), 100).unwrap();
        // Stall the output on a first line, so that the ones after it wait in the buffer.
        sink.make_writer().write_all(b"first\n").unwrap();
        std::thread::sleep(FLUSH_EVERY * 3);
        for i in 0..3 {
            // 40 bytes each: two fit in 100, the third is dropped whole.
            sink.make_writer()
                .write_all(format!("whole line {i} {}\n", "z".repeat(26)).as_bytes())
                .unwrap();
        }
        // A line in pieces after a whole one on the same writer is still one line.
        let mut w = sink.make_writer();
        w.write_all(b"part").unwrap();
        w.write_all(b"s\n").unwrap();
        drop(w);
        drop(release);
        drop(guard);
        let written = String::from_utf8(out.written.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = written.lines().collect();
        assert_eq!(lines.len(), 4, "{written}");
        assert_eq!(lines[0], "first");
        assert!(lines[1].starts_with("whole line 0 ") && lines[2].starts_with("whole line 1 "));
        assert_eq!(lines[3], "parts");
        assert_eq!(sink.dropped_lines(), 1);
    }

    #[test]
    fn a_stalled_output_never_blocks_the_logger_and_overflow_is_counted() {
        let (release, gate) = mpsc::channel();
        let out = Output::default();
        *out.gate.lock().unwrap() = Some(gate);
        let (sink, guard) = LogSink::spawn(out.clone(), 1000).unwrap();
        // The first batch gets stuck in the stalled write; everything after it piles up.
        log(&sink, "first");
        std::thread::sleep(FLUSH_EVERY * 3);
        let started = std::time::Instant::now();
        for i in 0..100 {
            log(&sink, &format!("line {i:03} {}", "y".repeat(40)));
        }
        // Not a timing assertion on the machine's speed: a blocked logger would wait forever.
        assert!(started.elapsed() < Duration::from_secs(5));
        let dropped = sink.dropped_lines();
        // 1000 bytes hold 20 lines of 50 bytes; the rest are dropped, whole.
        assert_eq!(dropped, 80, "dropped {dropped}");
        // Unstall the output for good: every later `recv` returns at once.
        drop(release);
        drop(guard);
        let written = String::from_utf8(out.written.lock().unwrap().clone()).unwrap();
        assert_eq!(written.lines().count(), 21, "{written}");
        assert!(written.lines().all(|l| l == "first" || l.len() == 49));
    }
}
