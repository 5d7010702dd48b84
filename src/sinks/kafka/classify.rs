//! Which librdkafka errors a later retry can cure and which it cannot, as a
//! pure function of the error code so the rules are testable without a broker.
//!
//! Retriable: the broker or network is away or slow, leadership is moving,
//! the local queue is full, the topic does not exist yet. Rejected: this one
//! message can never be accepted (too large, an invalid record); other
//! messages are unaffected. Fatal: the configuration is wrong (not
//! authorized, invalid settings) or the idempotent producer lost its
//! guarantees; retrying any event cannot help.

use rdkafka::types::RDKafkaErrorCode;

/// Whether a failed delivery may succeed when retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Retry later; nothing is wrong with the event itself.
    Retriable,
    /// This one message can never be accepted; the others can.
    Rejected,
    /// Retrying cannot help; an operator must act.
    Fatal,
}

/// Classifies a librdkafka error code.
pub fn classify(code: RDKafkaErrorCode) -> Failure {
    use RDKafkaErrorCode as C;
    match code {
        // One message the broker can never take. (A batch that is too large
        // says nothing about any one event in it: that is retried below.)
        C::MessageSizeTooLarge
        | C::InvalidMessageSize
        | C::InvalidRecord
        | C::InvalidDifferentRecord => Failure::Rejected,
        C::InvalidTopic
        | C::InvalidRequiredAcks
        | C::InvalidConfig
        | C::InvalidArgument
        | C::InvalidRequest
        | C::PolicyViolation
        | C::UnsupportedForMessageFormat
        | C::UnsupportedVersion
        | C::UnsupportedCompressionType
        | C::UnsupportedFeature
        | C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed
        | C::SaslAuthenticationFailed
        | C::UnsupportedSASLMechanism
        | C::IllegalSASLState
        | C::Authentication
        | C::KeySerialization
        | C::ValueSerialization
        | C::BadMessage
        | C::ProducerFenced
        | C::Fenced => Failure::Fatal,
        // The idempotent producer stopped: the sink replaces it, so a retry
        // goes to a fresh producer.
        C::Fatal => Failure::Retriable,
        // Transport, timeouts, leadership changes, full queues, missing
        // topics and every code not listed: the sweep waits and retries.
        _ => Failure::Retriable,
    }
}

/// True for delivery failures that only say the brokers could not be
/// reached in time: the connection error reported meanwhile (a refused
/// certificate or password, see [`super::context`]) is the real cause.
pub fn is_connection_symptom(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::MessageTimedOut
            | C::OperationTimedOut
            | C::RequestTimedOut
            | C::BrokerTransportFailure
            | C::AllBrokersDown
            | C::NetworkException
            | C::SSL
            | C::Authentication
    )
}

/// A hint appended to the error text for codes an operator can act on.
pub fn hint(code: RDKafkaErrorCode) -> Option<&'static str> {
    use RDKafkaErrorCode as C;
    match code {
        C::UnknownTopic | C::UnknownTopicOrPartition => {
            Some("create the topic or set sink.kafka.create_topics = true")
        }
        C::MessageSizeTooLarge | C::InvalidMessageSize | C::MessageBatchTooLarge => {
            Some("set the producer's compression.type, or raise the topic's max.message.bytes and the producer's message.max.bytes")
        }
        C::TopicAuthorizationFailed | C::ClusterAuthorizationFailed => {
            Some("grant the principal WRITE on the topic and IDEMPOTENT_WRITE on the cluster")
        }
        C::AllBrokersDown | C::BrokerTransportFailure | C::MessageTimedOut | C::Resolve => {
            Some("broker unreachable")
        }
        C::Fatal => Some("the idempotent producer stopped; it is being replaced"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_and_network_trouble_is_retriable() {
        for code in [
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::RequestTimedOut,
            RDKafkaErrorCode::OperationTimedOut,
            RDKafkaErrorCode::QueueFull,
            RDKafkaErrorCode::LeaderNotAvailable,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::NotEnoughReplicas,
            RDKafkaErrorCode::NotEnoughReplicasAfterAppend,
            RDKafkaErrorCode::NetworkException,
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::KafkaStorageError,
            RDKafkaErrorCode::PurgeQueue,
        ] {
            assert_eq!(classify(code), Failure::Retriable, "{code:?}");
        }
    }

    #[test]
    fn messages_too_large_or_invalid_are_rejected_alone() {
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::InvalidMessageSize,
            RDKafkaErrorCode::InvalidRecord,
        ] {
            assert_eq!(classify(code), Failure::Rejected, "{code:?}");
        }
        // A batch too large is no verdict on any one event of it.
        assert_eq!(
            classify(RDKafkaErrorCode::MessageBatchTooLarge),
            Failure::Retriable
        );
    }

    #[test]
    fn authorization_and_config_are_fatal() {
        for code in [
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::ClusterAuthorizationFailed,
            RDKafkaErrorCode::InvalidConfig,
            RDKafkaErrorCode::InvalidTopic,
            RDKafkaErrorCode::SaslAuthenticationFailed,
        ] {
            assert_eq!(classify(code), Failure::Fatal, "{code:?}");
        }
    }

    #[test]
    fn a_stopped_producer_is_retriable_because_the_sink_replaces_it() {
        assert_eq!(classify(RDKafkaErrorCode::Fatal), Failure::Retriable);
        assert!(hint(RDKafkaErrorCode::Fatal).unwrap().contains("replaced"));
    }

    #[test]
    fn operator_fixable_codes_carry_a_hint() {
        assert!(hint(RDKafkaErrorCode::UnknownTopicOrPartition)
            .unwrap()
            .contains("create_topics"));
        assert!(hint(RDKafkaErrorCode::QueueFull).is_none());
    }
}
