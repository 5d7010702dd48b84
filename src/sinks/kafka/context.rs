//! Why a Kafka connection failed is only told to librdkafka's error callback:
//! a TLS handshake the broker's certificate failed, or a SASL authentication
//! the broker refused, leaves the queued messages waiting until they time out
//! with `Message timed out`, which names no cause. The sink's client context
//! keeps the latest such error so that the failed delivery, the health check
//! and `check-config --probe` can say what went wrong, in one line.

use std::sync::{Arc, Mutex};

use rdkafka::client::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::producer::{DeliveryResult, ProducerContext};
use rdkafka::types::RDKafkaErrorCode;

/// A connection error librdkafka reported through its error callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerError {
    /// librdkafka's code (`SSL`, `Authentication`, `BrokerTransportFailure`, ...).
    pub code: RDKafkaErrorCode,
    /// librdkafka's text, which names the broker and the cause.
    pub reason: String,
}

impl BrokerError {
    /// True for errors no retry can cure until the configuration (CA,
    /// credentials) or the broker's certificate changes.
    pub fn is_security(&self) -> bool {
        matches!(
            self.code,
            RDKafkaErrorCode::SSL
                | RDKafkaErrorCode::Authentication
                | RDKafkaErrorCode::SaslAuthenticationFailed
                | RDKafkaErrorCode::UnsupportedSASLMechanism
                | RDKafkaErrorCode::IllegalSASLState
        )
    }

    /// The reason and, for a security error, what to check: one line.
    pub fn describe(&self) -> String {
        match self.hint() {
            Some(hint) => format!("{} ({hint})", self.reason),
            None => self.reason.clone(),
        }
    }

    /// What an operator should check, for a security error.
    pub fn hint(&self) -> Option<&'static str> {
        match self.code {
            RDKafkaErrorCode::SSL => Some(
                "check sink.kafka.properties \"ssl.ca.location\" and the broker's certificate",
            ),
            RDKafkaErrorCode::Authentication
            | RDKafkaErrorCode::SaslAuthenticationFailed
            | RDKafkaErrorCode::UnsupportedSASLMechanism
            | RDKafkaErrorCode::IllegalSASLState => Some(
                "check sink.kafka.properties \"sasl.mechanism\", \"sasl.username\" and \"sasl.password\"",
            ),
            _ => None,
        }
    }
}

/// The latest connection error of a sink's clients, shared by every client
/// the sink creates (the producer, its replacements, the admin client).
#[derive(Debug, Default)]
pub struct BrokerErrors {
    latest: Mutex<Option<BrokerError>>,
}

impl BrokerErrors {
    /// Remembers `error`. `AllBrokersDown` only summarises the errors before
    /// it, so it never replaces a cause already known. A refused certificate
    /// can come as a transport failure (OpenSSL 3 failing `SSL_connect`
    /// rather than the handshake): it counts as the TLS error it is.
    fn record(&self, code: RDKafkaErrorCode, reason: &str) {
        let code = if reason.contains("certificate verify failed") {
            RDKafkaErrorCode::SSL
        } else {
            code
        };
        let mut latest = match self.latest.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        if code == RDKafkaErrorCode::AllBrokersDown && latest.is_some() {
            return;
        }
        *latest = Some(BrokerError {
            code,
            reason: reason.to_string(),
        });
    }

    /// The latest error since the last successful delivery. (librdkafka
    /// reports an error identical to the one before at most every 30 s, so
    /// its age says nothing about whether it still holds.)
    pub fn latest(&self) -> Option<BrokerError> {
        match self.latest.lock() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Forgets the latest error: a delivery succeeded since.
    pub fn clear(&self) {
        match self.latest.lock() {
            Ok(mut guard) => *guard = None,
            Err(poisoned) => *poisoned.into_inner() = None,
        }
    }
}

/// The client context of every librdkafka client the Kafka sink creates:
/// logs connection errors as structured events and keeps the latest one.
#[derive(Debug, Clone)]
pub struct SinkContext {
    errors: Arc<BrokerErrors>,
    brokers: String,
}

impl SinkContext {
    /// A context for clients of `brokers` that records into `errors`.
    pub fn new(errors: Arc<BrokerErrors>, brokers: &str) -> Self {
        Self {
            errors,
            brokers: brokers.to_string(),
        }
    }

    /// Where this context records connection errors.
    pub fn errors(&self) -> &BrokerErrors {
        &self.errors
    }
}

impl ClientContext for SinkContext {
    fn error(&self, error: KafkaError, reason: &str) {
        let code = error.rdkafka_error_code().unwrap_or(RDKafkaErrorCode::Fail);
        tracing::warn!(sink = "kafka", brokers = %self.brokers, code = %code, error = %reason,
            "kafka client error");
        self.errors.record(code, reason);
    }
}

impl ProducerContext for SinkContext {
    type DeliveryOpaque = ();

    fn delivery(&self, _result: &DeliveryResult<'_>, _opaque: Self::DeliveryOpaque) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_brokers_down_never_hides_the_cause_reported_before_it() {
        let errors = BrokerErrors::default();
        errors.record(RDKafkaErrorCode::SSL, "SSL handshake failed");
        errors.record(RDKafkaErrorCode::AllBrokersDown, "1/1 brokers are down");
        let latest = errors.latest().unwrap();
        assert_eq!(latest.code, RDKafkaErrorCode::SSL);
        assert!(latest.is_security());
        assert!(latest.hint().unwrap().contains("ssl.ca.location"));
        errors.clear();
        assert_eq!(errors.latest(), None);
        errors.record(RDKafkaErrorCode::AllBrokersDown, "1/1 brokers are down");
        assert!(!errors.latest().unwrap().is_security());
    }

    #[test]
    fn a_certificate_refused_as_a_transport_failure_is_a_tls_error() {
        let errors = BrokerErrors::default();
        errors.record(
            RDKafkaErrorCode::BrokerTransportFailure,
            "ssl://b:9093/bootstrap: error:0A000086:SSL routines::certificate verify failed",
        );
        assert_eq!(errors.latest().unwrap().code, RDKafkaErrorCode::SSL);
        errors.record(
            RDKafkaErrorCode::BrokerTransportFailure,
            "b:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused",
        );
        assert!(!errors.latest().unwrap().is_security());
    }
}
