//! voucher-cdc: polls the External Voucher API per tenant, detects catalog
//! changes against a store of content hashes, and publishes CloudEvents to
//! Kafka, NATS JetStream, a file or stdout.

pub mod admin;
pub mod cli;
pub mod config;
pub mod control;
pub mod crashpoint;
pub mod daemon;
pub mod demo;
pub mod diff;
pub mod event;
pub mod hash;
mod json;
pub mod planner;
pub mod probe;
pub mod scheduler;
pub mod schema;
pub mod secret;
pub mod shard;
pub mod simulator;
pub mod sinks;
pub mod state;
pub mod stream;
pub mod sweep;
pub mod telemetry;
pub mod upstream;
