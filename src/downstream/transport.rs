//! How one downstream exchange goes out: through reqwest (the default) or through hyper-util's
//! pooled client directly (`http_client.transport = "hyper"`), a measured option.
//!
//! Why a second way at all: reqwest wraps that same hyper-util client in layers this gateway
//! never uses, and pays for them on every call. Its redirect follower turns the request's URI
//! back into a string and parses it as a `Url` even with redirects off, and the response path
//! parses it once more; its retry layer is still there with retries off (which spares only its
//! clone of every request); its `Url` becomes a `Uri` through another string; and the header
//! map is copied into the hyper request. Going to hyper-util
//! directly keeps what the gateway does use (the keep-alive pool, its idle bound and timeout,
//! the connect timeout, `TCP_NODELAY`) and drops the rest; docs/benchmarks.md has the counts.
//!
//! The hyper way speaks plain `http://` only: it builds no TLS connector, and the configuration
//! refuses an `https://` downstream with it (`Settings::validate`). Both ways send the same
//! request: the same headers, the base URL's credentials as HTTP basic authentication, and the
//! same bound on the body.

use std::sync::Arc;

use base64::{Engine, engine::general_purpose::STANDARD};
use bytes::{Bytes, BytesMut};
use http::{
    HeaderMap, HeaderValue, StatusCode, Uri,
    header::{ACCEPT, AUTHORIZATION, HOST, USER_AGENT},
    uri::{Authority, PathAndQuery, Scheme},
};
use http_body_util::BodyExt;
use hyper_util::{
    client::legacy::{Client as HyperClient, connect::HttpConnector},
    rt::{TokioExecutor, TokioTimer},
};
use url::Url;

use super::{CallError, MAX_BODY_BYTES};
use crate::{
    config::{HttpClientSettings, TransportKind},
    domain::Service,
};

/// The `User-Agent` of every call.
const AGENT: &str = concat!("tributary/", env!("CARGO_PKG_VERSION"));

/// hyper-util's client over plain TCP, with empty request bodies (every call is a `GET`).
type Hyper = HyperClient<HttpConnector, http_body_util::Empty<Bytes>>;

/// The shared HTTP client: one connection pool for all downstreams (a grey-release variant has
/// its own), keep-alive on, sized for the admission limit so that steady load reuses
/// connections instead of opening new ones.
#[derive(Clone)]
pub(crate) struct Client {
    way: Way,
    /// Every connection speaks HTTP/2 (`http_client.http2_prior_knowledge`).
    http2: bool,
}

/// Which client sends the calls.
#[derive(Clone)]
enum Way {
    Reqwest(reqwest::Client),
    /// Boxed: hyper-util's client is some 300 bytes, reqwest's one pointer.
    Hyper(Box<Hyper>),
}

impl Client {
    pub(crate) fn new(settings: &HttpClientSettings) -> anyhow::Result<Self> {
        let way = match settings.transport {
            TransportKind::Reqwest => {
                crate::tls::install_provider();
                let mut builder = reqwest::Client::builder()
                    .pool_max_idle_per_host(settings.pool_max_idle_per_host)
                    .pool_idle_timeout(settings.pool_idle_timeout)
                    .connect_timeout(settings.connect_timeout)
                    .tcp_nodelay(true)
                    .redirect(reqwest::redirect::Policy::none())
                    // The gateway retries on its own terms (`downstreams.*.retry`: a budget,
                    // never past the deadline, never while its core is saturated), and a retry
                    // inside the client would be one that policy never sees. With none allowed,
                    // reqwest's retry layer also stops cloning every request (headers,
                    // extensions and all) in case it retries: its default allows two.
                    .retry(reqwest::retry::never().max_retries_per_request(0));
                if settings.http2_prior_knowledge {
                    builder = builder.http2_prior_knowledge();
                }
                Way::Reqwest(builder.build()?)
            }
            TransportKind::Hyper => {
                let mut connector = HttpConnector::new();
                connector.set_nodelay(true);
                connector.set_connect_timeout(Some(settings.connect_timeout));
                Way::Hyper(Box::new(
                    HyperClient::builder(TokioExecutor::new())
                        .pool_max_idle_per_host(settings.pool_max_idle_per_host)
                        .pool_idle_timeout(settings.pool_idle_timeout)
                        // The idle timeout is enforced by a timer; without one it is not.
                        .pool_timer(TokioTimer::new())
                        .http2_only(settings.http2_prior_knowledge)
                        .build(connector),
                ))
            }
        };
        Ok(Self {
            way,
            http2: settings.http2_prior_knowledge,
        })
    }
}

/// One downstream's way out: the client, and the service's base prepared once for it.
pub(crate) struct Transport {
    client: Client,
    /// `{base_url}/{service}/` without its credentials; a call appends the user id.
    base: Url,
    /// The base's scheme and authority, parsed once for the hyper way.
    scheme: Scheme,
    authority: Authority,
    /// What every call sends: `User-Agent`, `Accept`, `Host` over HTTP/1.1, and
    /// `Authorization` when the base URL has credentials.
    fixed: HeaderMap,
}

/// Where one exchange goes, built for it and moved into the request (a retry or a hedge builds
/// its own: cloning one to keep for them would cost every call a copy that almost none use).
pub(crate) enum Target {
    Url(Url),
    Uri(Uri),
}

/// A downstream's answer, with its body read only if it was a success.
pub(crate) enum Response {
    Reqwest(reqwest::Response),
    Hyper(http::Response<hyper::body::Incoming>),
}

impl Transport {
    /// `base` is `{base_url}/{service}/`, credentials included.
    pub(crate) fn new(client: Client, base: &Url) -> anyhow::Result<Self> {
        // Room for the call's own headers too: a clone keeps the table's size, so adding
        // them to a clone never rebuilds it.
        let mut fixed = HeaderMap::with_capacity(9);
        fixed.insert(USER_AGENT, HeaderValue::from_static(AGENT));
        // reqwest would send `*/*` of its own; the gateway reads JSON only, and says so.
        fixed.insert(ACCEPT, HeaderValue::from_static("application/json"));
        let mut base = base.clone();
        if let Some(auth) = basic_auth(&base) {
            fixed.insert(AUTHORIZATION, auth);
            // Neither way may see the credentials in the URL: hyper would send them in `Host`.
            let _ = base.set_username("");
            let _ = base.set_password(None);
        }
        let scheme: Scheme = base.scheme().parse()?;
        let authority: Authority = match base.port() {
            Some(port) => format!("{}:{port}", base.host_str().unwrap_or_default()),
            None => base.host_str().unwrap_or_default().to_owned(),
        }
        .parse()?;
        // hyper-util's client writes `Host` into every HTTP/1.1 request that has none: the
        // URI's host and port formatted into a new string and header value, per call. It is
        // the same for every call to this downstream, so it is made here, once. (Over HTTP/2
        // the authority travels as `:authority`, and the client adds no `Host`.)
        if !client.http2 {
            fixed.insert(HOST, HeaderValue::from_str(authority.as_str())?);
        }
        Ok(Self {
            client,
            base,
            scheme,
            authority,
            fixed,
        })
    }

    /// The URL of `user_id`'s part.
    pub(crate) fn target(&self, user_id: i64) -> Target {
        let mut id = itoa::Buffer::new();
        let id = id.format(user_id);
        match self.client.way {
            Way::Reqwest(_) => {
                // One segment appended to the base, not the whole path set (and parsed) again.
                let mut url = self.base.clone();
                if let Ok(mut segments) = url.path_segments_mut() {
                    segments.pop_if_empty().push(id);
                }
                Target::Url(url)
            }
            Way::Hyper(_) => {
                let base = self.base.path();
                let mut path = String::with_capacity(base.len() + id.len());
                path.push_str(base);
                path.push_str(id);
                let mut parts = http::uri::Parts::default();
                parts.scheme = Some(self.scheme.clone());
                parts.authority = Some(self.authority.clone());
                // The base path came out of a parsed URL and an integer is appended: valid.
                parts.path_and_query = PathAndQuery::from_maybe_shared(path).ok();
                Target::Uri(Uri::from_parts(parts).expect("scheme, authority and path are set"))
            }
        }
    }

    /// The headers every call to this downstream sends, to add the call's own to. A clone of
    /// a map made once: the fixed headers are copied, not hashed and inserted one by one on
    /// every call (three inserts, about 1,000 instructions a dashboard).
    pub(crate) fn headers(&self) -> HeaderMap {
        self.fixed.clone()
    }

    /// Sends `GET target` with `headers`, which start from [`Self::headers`].
    pub(crate) async fn send(
        &self,
        service: Service,
        target: Target,
        headers: HeaderMap,
    ) -> Result<Response, CallError> {
        match (&self.client.way, target) {
            (Way::Reqwest(client), Target::Url(url)) => {
                let mut request = reqwest::Request::new(http::Method::GET, url);
                *request.headers_mut() = headers;
                client
                    .execute(request)
                    .await
                    .map(Response::Reqwest)
                    .map_err(|e| transport_error(service, e.is_timeout(), e))
            }
            (Way::Hyper(client), Target::Uri(uri)) => {
                let mut request = http::Request::new(http_body_util::Empty::new());
                *request.uri_mut() = uri;
                *request.headers_mut() = headers;
                client
                    .request(request)
                    .await
                    .map(Response::Hyper)
                    .map_err(|e| transport_error(service, timed_out(&e), e))
            }
            _ => unreachable!("a target is built by its own transport"),
        }
    }
}

impl Response {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Response::Reqwest(r) => r.status(),
            Response::Hyper(r) => r.status(),
        }
    }

    pub(crate) fn headers(&self) -> &HeaderMap {
        match self {
            Response::Reqwest(r) => r.headers(),
            Response::Hyper(r) => r.headers(),
        }
    }

    /// The body's declared length: hyper parsed `Content-Length` already and keeps it as the
    /// body's exact size hint, so the header is not looked up and parsed again.
    fn content_length(&self) -> Option<u64> {
        match self {
            Response::Reqwest(r) => r.content_length(),
            Response::Hyper(r) => hyper::body::Body::size_hint(r.body()).exact(),
        }
    }

    /// The whole body, at most [`MAX_BODY_BYTES`]: a larger one is an error, not an allocation.
    pub(crate) async fn body(self, service: Service) -> Result<Bytes, CallError> {
        let too_large = || CallError::InvalidBody {
            service,
            reason: "body too large".into(),
        };
        let length = self.content_length();
        if length.is_some_and(|n| n as usize > MAX_BODY_BYTES) {
            return Err(too_large());
        }
        let mut buf = BytesMut::with_capacity(length.unwrap_or(1024) as usize);
        // Checked per chunk too: a body without a length, or with a false one.
        let mut append = |chunk: &[u8]| {
            if buf.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(too_large());
            }
            buf.extend_from_slice(chunk);
            Ok(())
        };
        match self {
            Response::Reqwest(mut response) => {
                while let Some(chunk) = response
                    .chunk()
                    .await
                    .map_err(|e| transport_error(service, e.is_timeout(), e))?
                {
                    append(&chunk)?;
                }
            }
            Response::Hyper(response) => {
                let mut body = response.into_body();
                while let Some(frame) = body.frame().await {
                    let frame = frame.map_err(|e| transport_error(service, timed_out(&e), e))?;
                    if let Ok(chunk) = frame.into_data() {
                        append(&chunk)?; // trailers are skipped
                    }
                }
            }
        }
        Ok(buf.freeze())
    }
}

fn transport_error(
    service: Service,
    timed_out: bool,
    source: impl std::error::Error + Send + Sync + 'static,
) -> CallError {
    CallError::Transport {
        service,
        timed_out,
        source: Arc::new(source),
    }
}

/// Whether an error, or one of its causes, is an I/O timeout (the connect timeout's).
fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        cause = e.source();
    }
    false
}

/// `Basic base64(user:password)` from the URL's percent-decoded userinfo, if it has one.
fn basic_auth(url: &Url) -> Option<HeaderValue> {
    if url.username().is_empty() && url.password().is_none() {
        return None;
    }
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let credentials = format!(
        "{}:{}",
        decode(url.username()),
        url.password().map(decode).unwrap_or_default()
    );
    let mut value =
        HeaderValue::try_from(format!("Basic {}", STANDARD.encode(credentials))).ok()?;
    value.set_sensitive(true);
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_the_base_url_become_basic_auth_and_leave_the_url() {
        let url = Url::parse("http://svc%40corp:p%3Ass@h:9001/users/").unwrap();
        for kind in [TransportKind::Reqwest, TransportKind::Hyper] {
            let settings = HttpClientSettings {
                transport: kind,
                ..HttpClientSettings::default()
            };
            let transport = Transport::new(Client::new(&settings).unwrap(), &url).unwrap();
            assert_eq!(
                transport.fixed[AUTHORIZATION],
                // base64("svc@corp:p:ss")
                "Basic c3ZjQGNvcnA6cDpzcw=="
            );
            assert!(transport.fixed[AUTHORIZATION].is_sensitive());
            let sent = match transport.target(7) {
                Target::Url(url) => url.to_string(),
                Target::Uri(uri) => uri.to_string(),
            };
            assert_eq!(sent, "http://h:9001/users/7", "{kind:?}");
        }
    }

    /// reqwest's default retries a stream the server refused (RST_STREAM REFUSED_STREAM) twice
    /// more, inside `send` and out of sight of the gateway's own retry policy; the client is
    /// built to make one attempt, and the refusal comes back as the call's error.
    #[tokio::test]
    async fn the_reqwest_client_makes_one_attempt_and_leaves_retries_to_the_gateway() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let streams = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&streams);
        let server = tokio::spawn(async move {
            loop {
                let (socket, _) = listener.accept().await.unwrap();
                let seen = Arc::clone(&seen);
                tokio::spawn(async move {
                    let Ok(mut conn) = h2::server::handshake(socket).await else {
                        return;
                    };
                    while let Some(Ok((_request, mut respond))) = conn.accept().await {
                        seen.fetch_add(1, SeqCst);
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                    }
                });
            }
        });
        let settings = HttpClientSettings {
            transport: TransportKind::Reqwest,
            http2_prior_knowledge: true,
            ..HttpClientSettings::default()
        };
        let base = Url::parse(&format!("http://{addr}/users/")).unwrap();
        let transport = Transport::new(Client::new(&settings).unwrap(), &base).unwrap();
        let sent = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            transport.send(Service::Users, transport.target(1), transport.headers()),
        )
        .await
        .expect("the refused call ends");
        assert!(sent.is_err(), "a refused stream is the call's error");
        assert_eq!(streams.load(SeqCst), 1, "one stream sent, no retry");
        server.abort();
    }

    #[test]
    fn a_base_url_without_credentials_sends_no_authorization() {
        let url = Url::parse("http://h/carts/").unwrap();
        let transport = Transport::new(
            Client::new(&HttpClientSettings {
                transport: TransportKind::Hyper,
                ..HttpClientSettings::default()
            })
            .unwrap(),
            &url,
        )
        .unwrap();
        assert!(!transport.fixed.contains_key(AUTHORIZATION));
        match transport.target(42) {
            Target::Uri(uri) => assert_eq!(uri, "http://h/carts/42"),
            Target::Url(_) => panic!("the hyper way targets a Uri"),
        }
    }

    /// One request head as it arrived on the wire, answered with `200 {}`.
    async fn capture_one_request(listener: tokio::net::TcpListener) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = socket.read(&mut buf).await.unwrap();
            assert!(n > 0, "the connection closed before the request head ended");
            head.extend_from_slice(&buf[..n]);
        }
        socket
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            .await
            .unwrap();
        String::from_utf8(head).unwrap()
    }

    #[tokio::test]
    async fn host_is_made_once_per_downstream_and_sent_once_as_the_client_would() {
        for kind in [TransportKind::Reqwest, TransportKind::Hyper] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let url = Url::parse(&format!("http://user:pw@127.0.0.1:{port}/users/")).unwrap();
            let settings = HttpClientSettings {
                transport: kind,
                ..HttpClientSettings::default()
            };
            let transport = Transport::new(Client::new(&settings).unwrap(), &url).unwrap();
            let expected = format!("127.0.0.1:{port}");
            assert_eq!(transport.fixed[HOST], expected.as_str(), "{kind:?}");
            let server = tokio::spawn(capture_one_request(listener));
            let response = transport
                .send(Service::Users, transport.target(3), transport.headers())
                .await
                .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
            assert_eq!(response.status(), StatusCode::OK);
            let head = server.await.unwrap().to_ascii_lowercase();
            let hosts: Vec<&str> = head
                .lines()
                .filter_map(|l| l.strip_prefix("host:"))
                .map(str::trim)
                .collect();
            assert_eq!(hosts, [expected.as_str()], "{kind:?}: {head}");
            assert!(
                head.starts_with("get /users/3 http/1.1\r\n"),
                "{kind:?}: {head}"
            );
        }
    }

    #[test]
    fn over_http2_the_authority_is_the_host_and_no_host_header_is_added() {
        let url = Url::parse("http://h:9001/users/").unwrap();
        for kind in [TransportKind::Reqwest, TransportKind::Hyper] {
            let settings = HttpClientSettings {
                transport: kind,
                http2_prior_knowledge: true,
                ..HttpClientSettings::default()
            };
            let transport = Transport::new(Client::new(&settings).unwrap(), &url).unwrap();
            assert!(!transport.fixed.contains_key(HOST), "{kind:?}");
        }
    }

    #[derive(Debug, thiserror::Error)]
    #[error("connect failed")]
    struct Wrapper(#[source] std::io::Error);

    #[test]
    fn a_timeout_anywhere_in_the_causes_is_a_timeout_and_nothing_else_is() {
        let io = |kind| std::io::Error::new(kind, "x");
        assert!(timed_out(&Wrapper(io(std::io::ErrorKind::TimedOut))));
        assert!(timed_out(&io(std::io::ErrorKind::TimedOut)));
        assert!(!timed_out(&Wrapper(io(
            std::io::ErrorKind::ConnectionRefused
        ))));
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_transport_error_and_not_a_timeout() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = Url::parse(&format!("http://{}/users/", closed.local_addr().unwrap())).unwrap();
        drop(closed);
        for kind in [TransportKind::Reqwest, TransportKind::Hyper] {
            let settings = HttpClientSettings {
                transport: kind,
                ..HttpClientSettings::default()
            };
            let transport = Transport::new(Client::new(&settings).unwrap(), &url).unwrap();
            let sent = transport
                .send(Service::Users, transport.target(1), transport.headers())
                .await;
            match sent {
                Err(CallError::Transport { timed_out, .. }) => assert!(!timed_out, "{kind:?}"),
                Err(e) => panic!("{kind:?}: {e}"),
                Ok(_) => panic!("{kind:?}: a closed port answered"),
            }
        }
    }
}
