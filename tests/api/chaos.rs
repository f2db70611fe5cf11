//! A chaos TCP proxy for database outage tests.
//!
//! Stopping the machine's Postgres would take down every other test running in this binary, so
//! an outage is simulated one hop earlier: the gateway's database URL points at this proxy,
//! which forwards to the real server until told otherwise. [`cut`](ChaosProxy::cut) closes
//! every open connection and closes new ones as soon as they are accepted — what a client sees
//! when the server goes away; [`stall`](ChaosProxy::stall) keeps connections open but stops
//! delivering bytes either way — a network partition, where nothing is closed and nothing
//! arrives; [`restore`](ChaosProxy::restore) forwards again. The shape follows the chaos proxy
//! of the Rust package registry's test suite.

use std::net::SocketAddr;

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpListener, TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
    sync::watch,
    task::{JoinHandle, JoinSet},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    Up,
    Stalled,
    Cut,
}

pub struct ChaosProxy {
    addr: SocketAddr,
    link: watch::Sender<Link>,
    accept: JoinHandle<()>,
}

impl ChaosProxy {
    /// Listens on an ephemeral loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("proxy listens");
        let addr = listener.local_addr().unwrap();
        let (link, _) = watch::channel(Link::Up);
        let accept = tokio::spawn(accept_loop(listener, upstream, link.clone()));
        Self { addr, link, accept }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every open connection and refuses new ones until [`restore`](Self::restore).
    pub fn cut(&self) {
        self.link.send_replace(Link::Cut);
    }

    /// Holds every byte in flight, both ways, without closing anything.
    pub fn stall(&self) {
        self.link.send_replace(Link::Stalled);
    }

    /// Forwards again: stalled bytes are delivered, new connections accepted (connections
    /// closed by a cut stay closed).
    pub fn restore(&self) {
        self.link.send_replace(Link::Up);
    }
}

impl Drop for ChaosProxy {
    fn drop(&mut self) {
        // The accept task owns the connection tasks: aborting it closes them all.
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, upstream: String, link: watch::Sender<Link>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                if *link.borrow() == Link::Cut {
                    // "Refused": the client sees its connection closed before the server spoke.
                    drop(client);
                    continue;
                }
                connections.spawn(forward(client, upstream.clone(), link.subscribe()));
            }
            // Reap finished connections so the set does not grow with the test.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn forward(client: TcpStream, upstream: String, mut link: watch::Receiver<Link>) {
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = pipe(client_read, server_write, link.clone()) => {}
        _ = pipe(server_read, client_write, link.clone()) => {}
        // `wait_for` checks the current value first, so a cut that raced this connection's
        // start still closes it.
        _ = link.wait_for(|l| *l == Link::Cut) => {}
    }
    // Every half is dropped here: the client and the server each see the connection close.
}

/// Copies one direction; while the link is stalled, what was read is held back.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut link: watch::Receiver<Link>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        match link.wait_for(|l| *l != Link::Stalled).await {
            Ok(l) if *l == Link::Up => {}
            _ => return,
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
