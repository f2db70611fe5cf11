//! Integration tests: the real gateway, a real simulator and a real Postgres, on ephemeral
//! ports. One binary, helpers in one file, a module per concern.

mod cache;
mod chaos;
mod cli;
mod context;
mod dashboard;
mod grey;
mod health;
mod helpers;
mod observability;
mod openapi;
mod orders;
mod overload;
mod ratelimit;
mod resilience;
