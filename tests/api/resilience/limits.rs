//! Input and connection limits: header limits (431), slowloris, slow and oversized bodies
//! (408, 413), clients that stop reading, half-closed connections, the connection cap (503).

use std::time::Duration;

use axum::{Router, routing::get};
use serde_json::Value;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpSocket, TcpStream},
};
use tributary::config::RouteGroup;

use super::serial;
use crate::helpers::{TestApp, eventually, nz, problem, spawn_app_full, spawn_app_with};

/// Writes `request` on a fresh connection and reads until the server closes it (or 5 s pass).
/// Returns what was read and whether the connection was closed.
async fn raw_exchange(app: &TestApp, request: &[u8]) -> (String, bool) {
    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    // The server may stop reading (and close) before the whole request is written.
    let _ = stream.write_all(request).await;
    read_until_closed(&mut stream).await
}

/// The JSON body of a raw HTTP/1.1 response (everything after the head).
fn body_of(response: &str) -> Value {
    let (_, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {response:?}"));
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {response:?}"))
}

/// Permits of the orders group in use.
fn orders_in_flight(app: &TestApp) -> usize {
    app.state
        .admission
        .as_ref()
        .expect("admission is on")
        .limiter(RouteGroup::Orders)
        .in_flight()
}

async fn read_until_closed(stream: &mut TcpStream) -> (String, bool) {
    let mut out = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok();
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_headers_or_an_oversized_request_head_are_431() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        s.server.max_headers = nz(16);
        s.server.max_header_bytes = nz(8192);
    })
    .await;

    let mut many = String::from("GET /healthz HTTP/1.1\r\nhost: gateway\r\n");
    for i in 0..40 {
        many.push_str(&format!("x-extra-{i}: {i}\r\n"));
    }
    many.push_str("\r\n");
    let (response, _) = raw_exchange(&app, many.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 431"), "{response:?}");

    let big = format!(
        "GET /healthz HTTP/1.1\r\nhost: gateway\r\nx-big: {}\r\n\r\n",
        "a".repeat(20_000)
    );
    let (response, _) = raw_exchange(&app, big.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 431"), "{response:?}");

    // Over the configured limits but within hyper's hard bounds (twice them): a problem document.
    let mut some = String::from("GET /healthz HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n");
    for i in 0..20 {
        some.push_str(&format!("x-extra-{i}: {i}\r\n"));
    }
    some.push_str("\r\n");
    let (response, _) = raw_exchange(&app, some.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 431"), "{response:?}");
    assert!(
        response.contains("application/problem+json"),
        "{response:?}"
    );
    assert!(
        response.contains("/problems/header-fields-too-large"),
        "{response:?}"
    );
    let large = format!(
        "GET /healthz HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\nx-big: {}\r\n\r\n",
        "a".repeat(10_000)
    );
    let (response, _) = raw_exchange(&app, large.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 431"), "{response:?}");
    assert!(
        response.contains("/problems/header-fields-too-large"),
        "{response:?}"
    );

    // Within the limits the same request is fine.
    let (response, _) = raw_exchange(
        &app,
        b"GET /healthz HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_client_is_disconnected_after_the_header_read_timeout() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| s.server.header_read_timeout = Duration::from_millis(300)).await;

    // Half a request head, then nothing.
    let (response, closed) =
        raw_exchange(&app, b"GET /api/v1/dashboard/1 HTTP/1.1\r\nhost: gat").await;
    assert!(closed, "a stalled request head kept its connection open");
    assert!(response.is_empty(), "{response:?}");

    // Not even a first byte: the connection is just as stalled.
    let (response, closed) = raw_exchange(&app, b"").await;
    assert!(closed, "a silent connection was kept open");
    assert!(response.is_empty(), "{response:?}");

    // An idle keep-alive connection is closed by the same timer once its request is answered.
    let (response, closed) =
        raw_exchange(&app, b"GET /healthz HTTP/1.1\r\nhost: gateway\r\n\r\n").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response:?}");
    assert!(closed, "an idle keep-alive connection was kept open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_max_connections_get_a_503_problem() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| s.server.max_connections = nz(2)).await;

    // Two kept-alive connections, each proven established by a completed request.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(app.addr).await.unwrap();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: gateway\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = stream.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(stream);
    }

    // A real client on a third connection: it sends its request and reads the refusal.
    let client = reqwest::Client::new();
    let (status, body) = problem(client.get(app.url("/healthz")).send().await.unwrap()).await;
    assert_eq!(status, 503);
    assert_eq!(body["type"], "/problems/unavailable");

    drop(held);
    assert!(
        eventually(Duration::from_secs(5), || async {
            reqwest::Client::new()
                .get(app.url("/healthz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        })
        .await,
        "closed connections did not free their slots"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_sent_a_byte_at_a_time_is_a_408_and_lets_its_permit_go() {
    let _serial = serial().await;
    // A deadline far away: the body bound alone has to end the request.
    let app = spawn_app_with(|s| {
        s.server.request_deadline = Duration::from_secs(60);
        s.server.body_read_timeout = Duration::from_millis(500);
    })
    .await;

    let stream = TcpStream::connect(app.addr).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    writer
        .write_all(
            b"POST /api/v1/orders HTTP/1.1\r\nhost: gateway\r\nidempotency-key: k-slow\r\n\
              content-type: application/json\r\ncontent-length: 1000\r\n\r\n{",
        )
        .await
        .unwrap();
    // One byte every 100 ms: never idle, never done.
    let drip = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if writer.write_all(b" ").await.is_err() {
                return;
            }
        }
    });
    assert!(
        eventually(Duration::from_secs(5), || async {
            orders_in_flight(&app) == 1
        })
        .await,
        "the slow order never took its admission permit"
    );

    let mut response = Vec::new();
    let read =
        tokio::time::timeout(Duration::from_secs(10), reader.read_to_end(&mut response)).await;
    drip.abort();
    let response = String::from_utf8_lossy(&response).into_owned();
    assert!(
        read.is_ok(),
        "no answer to a slow body within 10 s: {response:?}"
    );
    assert!(response.starts_with("HTTP/1.1 408"), "{response:?}");
    assert!(
        response.contains("application/problem+json"),
        "{response:?}"
    );
    assert_eq!(body_of(&response)["type"], "/problems/request-timeout");
    assert!(
        eventually(Duration::from_secs(5), || async {
            orders_in_flight(&app) == 0
        })
        .await,
        "the slow body kept its admission permit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_body_over_the_limit_is_a_413_before_it_is_sent() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| {
        s.server.request_deadline = Duration::from_secs(60);
        s.server.body_read_timeout = Duration::from_secs(60);
        s.server.max_body_bytes = nz(1000);
    })
    .await;

    // 2^63 bytes announced, one sent: the answer must not wait for the rest.
    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    stream
        .write_all(
            b"POST /api/v1/orders HTTP/1.1\r\nhost: gateway\r\nidempotency-key: k-huge\r\n\
              content-type: application/json\r\ncontent-length: 9223372036854775808\r\n\r\n{",
        )
        .await
        .unwrap();
    let (response, closed) = read_until_closed(&mut stream).await;
    assert!(response.starts_with("HTTP/1.1 413"), "{response:?}");
    assert!(
        closed,
        "the connection stayed open for the rest of the body"
    );
    let body = body_of(&response);
    assert_eq!(body["type"], "/problems/payload-too-large");
    assert_eq!(
        body["detail"], "the request body must not exceed 1000 bytes",
        "the detail states the configured limit"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            orders_in_flight(&app) == 0
        })
        .await,
        "the refused order kept its admission permit"
    );

    // Without a declared length (chunked), the limit cuts the body off as it grows.
    let chunk = format!("{:x}\r\n{}\r\n", 1500, "x".repeat(1500));
    let request = format!(
        "POST /api/v1/orders HTTP/1.1\r\nhost: gateway\r\nidempotency-key: k-chunked\r\n\
         content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{chunk}0\r\n\r\n"
    );
    let (response, _) = raw_exchange(&app, request.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 413"), "{response:?}");
    assert_eq!(
        body_of(&response)["detail"],
        "the request body must not exceed 1000 bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_disconnected_after_the_write_timeout() {
    let _serial = serial().await;
    const LARGE: usize = 32 * 1024 * 1024;
    // One connection at a time: the slot the stuck client holds is how the test sees it go.
    let app = spawn_app_full(
        |s| {
            s.server.max_connections = nz(1);
            s.server.write_timeout = Duration::from_millis(300);
        },
        Router::new().route("/large", get(|| async { vec![b'x'; LARGE] })),
        Default::default(),
    )
    .await;

    // A small receive window, so the gateway's writes stall long before the response is out.
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stuck = socket.connect(app.addr).await.unwrap();
    stuck
        .write_all(b"GET /large HTTP/1.1\r\nhost: gateway\r\n\r\n")
        .await
        .unwrap();

    // While the stuck client holds the only slot, another client is refused; once the gateway
    // has given up on it, the slot is free again.
    assert!(
        eventually(Duration::from_secs(20), || async {
            reqwest::Client::new()
                .get(app.url("/healthz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        })
        .await,
        "a client that reads nothing kept its connection"
    );
    let mut received = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stuck.read_to_end(&mut received)).await;
    assert!(
        received.len() < LARGE,
        "the whole response was delivered to a client that was not reading"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_half_close_on_a_client_that_half_closes_after_its_request_gets_the_response() {
    let _serial = serial().await;
    let app = spawn_app_with(|s| s.server.half_close = true).await;

    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: gateway\r\n\r\n")
        .await
        .unwrap();
    stream.shutdown().await.unwrap();
    let (response, closed) = read_until_closed(&mut stream).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response:?}");
    assert!(
        closed,
        "the half-closed connection was not closed after its response"
    );
}
