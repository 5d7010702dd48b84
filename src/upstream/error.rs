//! The one error type of the upstream client, so the bridge can tell a stream
//! to park (401/403/404), to try again next sweep, or to report bad input,
//! and every message names the HTTP status, the path and the upstream's own
//! words without ever containing the bearer token.

use std::collections::BTreeMap;
use std::time::Duration;

/// Why an upstream call failed; every message is one lowercase line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    /// 401: the token is missing, invalid or expired.
    #[error("upstream returned 401 for {path}: {message}")]
    Unauthorized {
        /// Request path below the base URL, without query.
        path: String,
        /// The upstream `message`.
        message: String,
    },
    /// 403: the token lacks tenant access or the permission.
    #[error("upstream returned 403 for {path}: {message}")]
    Forbidden {
        /// Request path below the base URL, without query.
        path: String,
        /// The upstream `message`.
        message: String,
    },
    /// 404: the tenant or record is not in the token's scope.
    #[error("upstream returned 404 for {path}: {message}")]
    NotFound {
        /// Request path below the base URL, without query.
        path: String,
        /// The upstream `message`.
        message: String,
    },
    /// 422: the request failed validation.
    #[error("upstream returned 422 for {path}: {message}{}", format_field_errors(.errors))]
    Validation {
        /// Request path below the base URL, without query.
        path: String,
        /// The upstream `message`.
        message: String,
        /// The upstream `errors`: field name to messages.
        errors: BTreeMap<String, Vec<String>>,
    },
    /// 429 on a request that is not retried further (attempts used up).
    #[error("upstream returned 429 for {path}: {message}")]
    RateLimited {
        /// Request path below the base URL, without query.
        path: String,
        /// The upstream `message`.
        message: String,
        /// The wait the upstream asked for (capped), or the window when absent.
        retry_after: Duration,
    },
    /// A 5xx answer (surfaced directly only for requests that are never retried).
    #[error("upstream returned {status} for {path}: {message}")]
    Server {
        /// The HTTP status.
        status: u16,
        /// Request path below the base URL, without query.
        path: String,
        /// The upstream `message`, or a short excerpt of the body.
        message: String,
    },
    /// Any other non-success status (400, 405, 409, 3xx, ...); not retried.
    #[error("upstream returned unexpected {status} for {path}: {message}")]
    UnexpectedStatus {
        /// The HTTP status.
        status: u16,
        /// Request path below the base URL, without query.
        path: String,
        /// The upstream `message`, or a short excerpt of the body.
        message: String,
    },
    /// No complete response within the configured timeout.
    #[error("upstream request to {path} timed out after {}", humantime::format_duration(*.after))]
    Timeout {
        /// Request path below the base URL, without query.
        path: String,
        /// The configured timeout.
        after: Duration,
    },
    /// Connecting, sending or receiving failed at the transport level.
    #[error("upstream request to {path} failed: {reason}")]
    Transport {
        /// Request path below the base URL, without query.
        path: String,
        /// What went wrong (no URL, no headers).
        reason: String,
    },
    /// The client refused the upstream's TLS certificate (unknown issuer,
    /// expired, wrong name): not retried, the stream parks until it is fixed.
    #[error("upstream {origin}: tls: {reason} for {path} ({hint})")]
    Tls {
        /// Scheme, host and port of the upstream.
        origin: String,
        /// Request path below the base URL, without query.
        path: String,
        /// Why the certificate was refused, as the TLS library says it.
        reason: String,
        /// What to check: `upstream.ca_file`, the certificate's dates or names.
        hint: String,
    },
    /// A success status with a body that is truncated, not JSON, or not the documented shape.
    #[error("upstream sent an invalid response for {path}: {reason}")]
    InvalidResponse {
        /// Request path below the base URL, without query.
        path: String,
        /// What is wrong with the body.
        reason: String,
    },
    /// Every attempt of a retried request failed; `last` is the final failure.
    #[error("upstream request to {path} failed after {attempts} attempts: {last}")]
    Exhausted {
        /// Request path below the base URL, without query.
        path: String,
        /// Attempts made (the configured maximum).
        attempts: u32,
        /// The last attempt's error text.
        last: String,
        /// The last attempt's HTTP status, when it got one.
        last_status: Option<u16>,
    },
    /// A listing that does not end: a cursor came back that the listing had
    /// already followed (a cycle), or it ran past its page limit.
    #[error("listing {path} does not end: {reason} after {pages} pages; the sweep stops and the watermark does not move")]
    EndlessListing {
        /// Request path below the base URL, without query.
        path: String,
        /// Pages listed before the listing was stopped.
        pages: u64,
        /// A repeated cursor or the page limit.
        reason: String,
    },
    /// The client cannot be built from its options (base URL, token, TLS).
    #[error("invalid upstream client configuration: {0}")]
    Config(String),
}

impl UpstreamError {
    /// True for 401, 403, 404 and a refused TLS certificate: retrying will not
    /// help until an operator acts, so the stream parks.
    pub fn is_parking(&self) -> bool {
        matches!(
            self,
            UpstreamError::Unauthorized { .. }
                | UpstreamError::Forbidden { .. }
                | UpstreamError::NotFound { .. }
                | UpstreamError::Tls { .. }
        )
    }

    /// True when the same request may succeed later (rate limit, 5xx, timeout, transport, broken body).
    pub fn is_retriable(&self) -> bool {
        match self {
            UpstreamError::RateLimited { .. }
            | UpstreamError::Server { .. }
            | UpstreamError::Timeout { .. }
            | UpstreamError::Transport { .. }
            | UpstreamError::InvalidResponse { .. }
            | UpstreamError::Exhausted { .. } => true,
            UpstreamError::Unauthorized { .. }
            | UpstreamError::Forbidden { .. }
            | UpstreamError::NotFound { .. }
            | UpstreamError::Tls { .. }
            | UpstreamError::Validation { .. }
            | UpstreamError::UnexpectedStatus { .. }
            | UpstreamError::EndlessListing { .. }
            | UpstreamError::Config(_) => false,
        }
    }

    /// The HTTP status behind the error (the last attempt's for `Exhausted`), if any.
    pub fn status(&self) -> Option<u16> {
        match self {
            UpstreamError::Unauthorized { .. } => Some(401),
            UpstreamError::Forbidden { .. } => Some(403),
            UpstreamError::NotFound { .. } => Some(404),
            UpstreamError::Validation { .. } => Some(422),
            UpstreamError::RateLimited { .. } => Some(429),
            UpstreamError::Server { status, .. }
            | UpstreamError::UnexpectedStatus { status, .. } => Some(*status),
            UpstreamError::Exhausted { last_status, .. } => *last_status,
            UpstreamError::Timeout { .. }
            | UpstreamError::Transport { .. }
            | UpstreamError::Tls { .. }
            | UpstreamError::InvalidResponse { .. }
            | UpstreamError::EndlessListing { .. }
            | UpstreamError::Config(_) => None,
        }
    }

    /// The upstream `message` for errors that carry one.
    pub fn upstream_message(&self) -> Option<&str> {
        match self {
            UpstreamError::Unauthorized { message, .. }
            | UpstreamError::Forbidden { message, .. }
            | UpstreamError::NotFound { message, .. }
            | UpstreamError::Validation { message, .. }
            | UpstreamError::RateLimited { message, .. }
            | UpstreamError::Server { message, .. }
            | UpstreamError::UnexpectedStatus { message, .. } => Some(message),
            _ => None,
        }
    }
}

/// Renders 422 field errors as ` (field: msg; msg, other: msg)`, empty when there are none.
fn format_field_errors(errors: &BTreeMap<String, Vec<String>>) -> String {
    if errors.is_empty() {
        return String::new();
    }
    let fields: Vec<String> = errors
        .iter()
        .map(|(field, messages)| format!("{field}: {}", messages.join("; ")))
        .collect();
    format!(" ({})", fields.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forbidden_text_names_status_path_and_upstream_message() {
        let err = UpstreamError::Forbidden {
            path: "/tenants/3/catalog/vouchers".into(),
            message: "token lacks view_vouchers".into(),
        };
        assert_eq!(
            err.to_string(),
            "upstream returned 403 for /tenants/3/catalog/vouchers: token lacks view_vouchers"
        );
        assert!(err.is_parking());
        assert!(!err.is_retriable());
        assert_eq!(err.status(), Some(403));
    }

    #[test]
    fn validation_text_lists_every_field_error() {
        let mut errors = BTreeMap::new();
        errors.insert(
            "voucher_id".to_string(),
            vec!["must be an integer".to_string()],
        );
        errors.insert(
            "amount".to_string(),
            vec!["is required".to_string(), "must be positive".to_string()],
        );
        let err = UpstreamError::Validation {
            path: "/tenants/1/redemptions".into(),
            message: "the given data was invalid".into(),
            errors,
        };
        assert_eq!(
            err.to_string(),
            "upstream returned 422 for /tenants/1/redemptions: the given data was invalid \
             (amount: is required; must be positive, voucher_id: must be an integer)"
        );
        assert!(!err.is_parking());
    }

    #[test]
    fn exhausted_reports_the_last_status_and_is_retriable_later() {
        let err = UpstreamError::Exhausted {
            path: "/tenants/1/catalog/categories".into(),
            attempts: 6,
            last: "upstream returned 503 for /tenants/1/catalog/categories: down".into(),
            last_status: Some(503),
        };
        assert_eq!(err.status(), Some(503));
        assert!(err.is_retriable());
        assert!(err.to_string().starts_with(
            "upstream request to /tenants/1/catalog/categories failed after 6 attempts: "
        ));
    }

    #[test]
    fn timeout_text_uses_a_human_duration() {
        let err = UpstreamError::Timeout {
            path: "/tenants/1/catalog/vouchers".into(),
            after: Duration::from_secs(30),
        };
        assert_eq!(
            err.to_string(),
            "upstream request to /tenants/1/catalog/vouchers timed out after 30s"
        );
    }
}
