//! Serde types for every resource of the External Voucher API spec.
