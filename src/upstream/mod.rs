//! The upstream External Voucher API as the bridge uses it: the HTTP client,
//! the decoded page, pagination and the shared rate budget. Dependencies
//! point one way: `pagination` → `client` → {`ratelimit`, `body_budget`, `page`,
//! `error`, `tls`}.
//! The API's full wire model belongs to the simulator (`simulator::model`).

pub mod body_budget;
pub mod client;
pub mod error;
pub mod page;
pub mod pagination;
pub mod ratelimit;
pub mod tls;
