//! JSON log lines, written straight into a reused buffer.
//!
//! One line per event: `timestamp`, `level`, the event's fields (its `message` among them),
//! `target`, and `span`, the current span's name and fields, when the event is inside one (the
//! logs see the request span only, so that is the request's id, trace ids and route):
//!
//! ```json
//! {"timestamp":"2026-12-07T10:58:01.123456Z","level":"INFO","message":"request completed","status":200,"route":"/api/v1/dashboard/{user_id}","latency_ms":101.2,"target":"tributary::http::middleware","span":{"name":"http.request","request_id":"…","http.route":"/api/v1/dashboard/{user_id}"}}
//! ```
//!
//! Why not a crate: `json-subscriber`, which wrote these lines before, builds a
//! `serde_json::Value` for every field of every event and serialises it through an `io::Write`
//! adapter that validates each piece as UTF-8: about 14,000 instructions for the access line
//! alone, 3 % of a whole dashboard request (`bench/profile instructions`, docs/benchmarks.md).
//! Here a field is written once, as it is visited, into a per-thread buffer, and a span's
//! fields are rendered once, when they are recorded, and copied into each of its lines. The
//! format is the one `json-subscriber` wrote (the same keys and values; key order is not
//! significant in JSON, and `tests/api/observability.rs` reads the lines as JSON).

use std::{
    cell::RefCell,
    fmt::{self, Write as _},
    io::Write as _,
};

use serde_json::ser::Formatter as _;
use tracing::{
    Event, Subscriber,
    field::{Field, Visit},
    span::{Attributes, Id, Record},
};
use tracing_subscriber::{Layer, fmt::MakeWriter, layer::Context, registry::LookupSpan};

use super::logs::now_rfc3339;

/// The layer: every event it is given becomes one line on `writer`.
pub(super) struct JsonLines<W> {
    writer: W,
}

impl<W> JsonLines<W> {
    pub(super) fn new(writer: W) -> Self {
        Self { writer }
    }
}

/// A span's name and fields as the members of a JSON object, `"name":"…",` first and then
/// `,"key":value` for each field recorded, each field once.
struct SpanJson {
    members: Vec<u8>,
    /// Each recorded field and where its member is in `members`, so that recording it again
    /// replaces it instead of writing the key twice.
    fields: Vec<(&'static str, usize, usize)>,
}

impl<S, W> Layer<S> for JsonLines<W>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else {
            return;
        };
        let mut json = SpanJson {
            members: Vec::with_capacity(256),
            fields: Vec::with_capacity(8),
        };
        json.members.extend_from_slice(b"\"name\":");
        string(&mut json.members, span.name());
        attrs.record(&mut Members {
            out: &mut json.members,
            fields: Some(&mut json.fields),
        });
        span.extensions_mut().insert(json);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else {
            return;
        };
        let mut extensions = span.extensions_mut();
        if let Some(json) = extensions.get_mut::<SpanJson>() {
            values.record(&mut Members {
                out: &mut json.members,
                fields: Some(&mut json.fields),
            });
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        LINE.with(|cell| match cell.try_borrow_mut() {
            Ok(mut line) => {
                line.clear();
                self.write_line(&mut line, event, &ctx);
            }
            // An event raised while a line is being written on this thread (from a `Debug`
            // implementation, say): its own buffer.
            Err(_) => self.write_line(&mut Vec::with_capacity(512), event, &ctx),
        });
    }
}

thread_local! {
    /// The line being written, reused: its capacity stays from line to line.
    static LINE: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(1024));
}

impl<W> JsonLines<W>
where
    W: for<'w> MakeWriter<'w>,
{
    fn write_line<S>(&self, line: &mut Vec<u8>, event: &Event<'_>, ctx: &Context<'_, S>)
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
    {
        line.extend_from_slice(b"{\"timestamp\":\"");
        line.extend_from_slice(&now_rfc3339());
        line.extend_from_slice(b"\",\"level\":\"");
        line.extend_from_slice(event.metadata().level().as_str().as_bytes());
        line.push(b'"');
        event.record(&mut Members {
            out: line,
            fields: None,
        });
        line.extend_from_slice(b",\"target\":");
        string(line, event.metadata().target());
        if let Some(span) = ctx.event_span(event)
            && let Some(json) = span.extensions().get::<SpanJson>()
        {
            line.extend_from_slice(b",\"span\":{");
            line.extend_from_slice(&json.members);
            line.push(b'}');
        }
        line.extend_from_slice(b"}\n");
        // A write that fails has nowhere to be reported: this is the log.
        let _ = self
            .writer
            .make_writer_for(event.metadata())
            .write_all(line);
    }
}

/// Writes each field it visits as a `,"key":value` member onto `out`; with `fields`, a field
/// already there is taken out first.
struct Members<'a> {
    out: &'a mut Vec<u8>,
    fields: Option<&'a mut Vec<(&'static str, usize, usize)>>,
}

impl Members<'_> {
    /// Starts the member for `field`; `write` writes its value; the member is then indexed.
    fn member(&mut self, field: &Field, write: impl FnOnce(&mut Vec<u8>)) {
        let name = field.name();
        // Fields the way tracing names them (`r#type`), keys as they were meant.
        let key = name.strip_prefix("r#").unwrap_or(name);
        if let Some(fields) = self.fields.as_deref_mut()
            && let Some(i) = fields.iter().position(|(n, _, _)| *n == name)
        {
            let (_, start, end) = fields.remove(i);
            self.out.drain(start..end);
            for (_, s, e) in fields.iter_mut().filter(|(_, s, _)| *s >= end) {
                *s -= end - start;
                *e -= end - start;
            }
        }
        let start = self.out.len();
        self.out.push(b',');
        string(self.out, key);
        self.out.push(b':');
        write(self.out);
        if let Some(fields) = self.fields.as_deref_mut() {
            fields.push((name, start, self.out.len()));
        }
    }

    /// An integer field as a JSON number.
    fn integer(&mut self, field: &Field, value: impl itoa::Integer) {
        self.member(field, |out| {
            out.extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
        });
    }
}

impl Visit for Members<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.member(field, |out| string(out, value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.member(field, |out| {
            out.push(b'"');
            // Escaped as it is formatted: no intermediate `String`.
            let _ = write!(Escaped(out), "{value:?}");
            out.push(b'"');
        });
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.integer(field, value);
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.integer(field, value);
    }

    fn record_i128(&mut self, field: &Field, value: i128) {
        self.integer(field, value);
    }

    fn record_u128(&mut self, field: &Field, value: u128) {
        self.integer(field, value);
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.member(field, |out| {
            // As serde_json writes a float: shortest round-trip digits; NaN and the infinities,
            // which JSON has no numbers for, as `null`.
            if value.is_finite() {
                let _ = serde_json::ser::CompactFormatter.write_f64(out, value);
            } else {
                out.extend_from_slice(b"null");
            }
        });
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.member(field, |out| {
            out.extend_from_slice(if value { b"true" } else { b"false" });
        });
    }
}

/// `value` as a JSON string, quotes included.
fn string(out: &mut Vec<u8>, value: &str) {
    out.push(b'"');
    escape(out, value);
    out.push(b'"');
}

/// `value` escaped for the inside of a JSON string: the quote, the backslash and the control
/// characters, as serde_json escapes them; everything else, UTF-8 included, as it is.
fn escape(out: &mut Vec<u8>, value: &str) {
    let bytes = value.as_bytes();
    // Nearly every value needs no escape: one pass without early exit, which the compiler
    // vectorises, then a single copy.
    let plain = bytes.iter().fold(true, |plain, &b| {
        plain & (b >= 0x20 && b != b'"' && b != b'\\')
    });
    if plain {
        out.extend_from_slice(bytes);
        return;
    }
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escaped: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if escaped.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        } else {
            out.extend_from_slice(escaped);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
}

/// A `fmt::Write` that escapes what is written into it onto a line.
struct Escaped<'a>(&'a mut Vec<u8>);

impl fmt::Write for Escaped<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        escape(self.0, s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    #[test]
    fn strings_are_escaped_as_serde_json_escapes_them() {
        let cases = [
            "plain",
            "",
            "quote \" and backslash \\",
            "line\nbreak\r\ttab",
            "bell \u{7} nul \u{0} bs \u{8} ff \u{c} us \u{1f}",
            "unicode: ĉu — 日本 🦀 stays as it is",
            "/slashes/are/not/escaped",
        ];
        for case in cases {
            let mut out = Vec::new();
            string(&mut out, case);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                serde_json::to_string(case).unwrap(),
                "{case:?}"
            );
        }
    }

    /// Lines written by the layer under a registry, read back.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(data);
            Ok(data.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Lines {
        fn read(&self) -> Vec<serde_json::Value> {
            let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
            assert!(text.ends_with('\n'), "every line ends: {text:?}");
            text.lines()
                .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
                .collect()
        }
    }

    fn logged(f: impl FnOnce()) -> Vec<serde_json::Value> {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber =
            tracing_subscriber::registry().with(JsonLines::new(move || writer.clone()));
        tracing::subscriber::with_default(subscriber, f);
        lines.read()
    }

    #[test]
    fn a_line_has_the_event_its_fields_and_its_span() {
        let lines = logged(|| {
            let span = tracing::info_span!(
                "http.request",
                request_id = "abc",
                http.route = "/x/{id}",
                status = tracing::field::Empty,
                user_id = tracing::field::Empty,
            );
            span.record("user_id", 42_i64);
            let _entered = span.enter();
            tracing::info!(
                status = 200_u16,
                latency_ms = 1.25,
                ok = true,
                missing = None::<i64>,
                error = %"it \"broke\"",
                nan = f64::NAN,
                "request completed"
            );
        });
        assert_eq!(lines.len(), 1, "{lines:?}");
        let line = &lines[0];
        assert_eq!(line["level"], "INFO");
        assert_eq!(line["message"], "request completed");
        assert_eq!(line["status"], 200);
        assert_eq!(line["latency_ms"], 1.25);
        assert_eq!(line["ok"], true);
        assert!(line.get("missing").is_none(), "{line}");
        assert_eq!(line["error"], "it \"broke\"");
        assert!(line["nan"].is_null(), "{line}");
        assert_eq!(line["target"], module_path!());
        assert_eq!(line["span"]["name"], "http.request");
        assert_eq!(line["span"]["request_id"], "abc");
        assert_eq!(line["span"]["http.route"], "/x/{id}");
        assert_eq!(line["span"]["user_id"], 42);
        assert!(
            line["span"].get("status").is_none(),
            "empty fields are left out: {line}"
        );
        let timestamp = line["timestamp"].as_str().unwrap();
        chrono::DateTime::parse_from_rfc3339(timestamp).expect(timestamp);
    }

    #[test]
    fn a_field_recorded_again_is_replaced_not_repeated() {
        let lines = logged(|| {
            let span = tracing::info_span!("s", a = 1_u64, b = "x", c = tracing::field::Empty);
            span.record("a", 2_u64);
            span.record("c", "late");
            span.record("b", "y \"quoted\"");
            span.record("a", 3_u64);
            span.in_scope(|| tracing::warn!("inside"));
        });
        let text = lines[0]["span"].to_string();
        assert_eq!(lines[0]["span"]["a"], 3, "{text}");
        assert_eq!(lines[0]["span"]["b"], "y \"quoted\"", "{text}");
        assert_eq!(lines[0]["span"]["c"], "late", "{text}");
        assert_eq!(text.matches("\"a\"").count(), 1, "{text}");
        assert_eq!(lines[0]["level"], "WARN");
    }

    #[test]
    fn an_event_outside_a_span_has_no_span_and_raw_names_lose_their_prefix() {
        let lines = logged(|| tracing::error!(r#type = "kind", count = -3_i64, "no span"));
        assert!(lines[0].get("span").is_none(), "{}", lines[0]);
        assert_eq!(lines[0]["type"], "kind");
        assert_eq!(lines[0]["count"], -3);
        assert_eq!(lines[0]["level"], "ERROR");
    }
}
