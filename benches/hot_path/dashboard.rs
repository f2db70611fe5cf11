//! The dashboard's merge and serialisation: after the fan-out, the five bodies (embedded as
//! they came, never parsed into a DOM) and the five recent orders become one JSON body and a
//! `Server-Timing` header, and the fan-out's metrics are recorded. It is the gateway's own
//! CPU per dashboard beyond the I/O: it should grow with the bytes, not with their structure.

use std::time::Duration;

use chrono::{DateTime, Utc};
use divan::Bencher;
use serde_json::value::RawValue;
use tributary::{db::OrderSummary, domain::Service, http::dashboard_response};

use crate::fixture::GATEWAY;

const USER: i64 = 42;

/// The simulator's bodies for one user, as the gateway's client received them.
fn bodies() -> [Box<RawValue>; 5] {
    Service::ALL.map(|service| {
        GATEWAY
            .rt
            .block_on(
                GATEWAY
                    .fixed
                    .downstreams
                    .get(service)
                    .fetch_user_part_for_bench(USER),
            )
            .expect("the simulator answers")
    })
}

/// Five recent orders as the seed data has them.
fn orders() -> Vec<OrderSummary> {
    let now = DateTime::<Utc>::from_timestamp(1_764_600_000, 0).expect("a time");
    ["created", "paid", "shipped", "delivered", "cancelled"]
        .into_iter()
        .enumerate()
        .map(|(i, status)| OrderSummary {
            id: 4_200_000 + i as i64,
            status: status.to_owned(),
            total_cents: 1_999 + 2_750 * i as i64,
            created_at: now - chrono::Duration::hours(30 * i as i64),
        })
        .collect()
}

/// Five bodies of about 512 bytes each (the lab's size) and five orders into a response of
/// about 3 KiB.
#[divan::bench]
fn merge_and_serialise(bencher: Bencher) {
    let bodies = bodies();
    let orders = orders();
    let ms = Duration::from_millis;
    let took = [ms(12), ms(9), ms(14), ms(8), ms(11)];
    let body = dashboard_response(
        &GATEWAY.fixed,
        USER,
        std::array::from_fn(|i| (bodies[i].clone(), took[i])),
        (orders.clone(), ms(4)),
        ms(15),
    );
    assert!(body.status().is_success());
    assert!(body.headers().contains_key("server-timing"));
    bencher
        .with_inputs(|| {
            (
                std::array::from_fn(|i| (bodies[i].clone(), took[i])),
                orders.clone(),
            )
        })
        .bench_local_values(|(parts, orders)| {
            dashboard_response(&GATEWAY.fixed, USER, parts, (orders, ms(4)), ms(15))
        });
}
