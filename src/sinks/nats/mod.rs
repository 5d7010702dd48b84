//! The NATS JetStream sink: publishes every event to
//! `{subject_prefix}.{tenant}.{type}` with `Nats-Msg-Id` = event id (a dead
//! letter's: the id with `.deadletter`, see `dedupe_id`), keeps
//! many publishes in flight, and reports an event as acknowledged only once
//! its PubAck arrived (a PubAck flagged duplicate is an ack too: the stream
//! already holds the event). A batch reads its PubAcks on one reply
//! subscription of its own ([`acks`]) rather than one request per event.
//!
//! Start-up connects (retrying unreachable servers for `connect_timeout`,
//! then failing with the URLs named) and creates or updates the stream.
//! Afterwards the client reconnects on its own, endlessly; while no server is
//! reachable publishes fail as retriable after `publish_timeout`. A stream
//! deleted at run time is created again as at start, after the publish that
//! found it missing (which fails as retriable and is retried by the sweep).

pub mod acks;
pub mod config;
pub mod stream;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use async_nats::connection::State;
use async_nats::header::{self, HeaderMap, HeaderName, IntoHeaderName};
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::ErrorCode;
use async_nats::{
    Client, ConnectErrorKind, ConnectOptions, Event as ClientEvent, ServerAddr, Subject,
};
use async_trait::async_trait;
use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use self::acks::{read_reply, refusal, reply_index, reply_subject, Refusal, Reply, Window};
pub use self::config::{NatsConfigError, NatsSinkConfig, NatsTlsConfig, Secret};
use crate::event::{Event, EventType};
use crate::sinks::binding::{nats_header, Attributes};
use crate::sinks::metrics::record_sink_up;
use crate::sinks::{Ack, Sink, SinkError};

/// The sink name used in logs and metrics.
const SINK: &str = "nats";

/// The `Content-Type` every message carries (structured-mode CloudEvents).
pub const CONTENT_TYPE: &str = "application/cloudevents+json";

/// The header [`CONTENT_TYPE`] travels in.
static CONTENT_TYPE_HEADER: HeaderName = HeaderName::from_static("Content-Type");

/// async-nats's own default capacity of a subscription's channel.
const DEFAULT_SUBSCRIPTION_CAPACITY: usize = 64 * 1024;

/// Bytes the two headers add to a message besides the event id, for the size check.
const HEADER_OVERHEAD: usize = 128;

/// Why the NATS sink could not start.
#[derive(Debug, thiserror::Error)]
pub enum NatsSinkError {
    /// A `[sink.nats]` value is invalid.
    #[error(transparent)]
    Config(#[from] NatsConfigError),
    /// A secret file of `[sink.nats]` cannot be used.
    #[error(transparent)]
    Secret(#[from] crate::secret::SecretFileError),
    /// No server could be reached, or it refused us.
    #[error("nats: cannot connect to {urls}: {reason}")]
    Connect {
        /// The configured URLs.
        urls: String,
        /// What went wrong.
        reason: String,
    },
    /// The stream cannot be created or updated to fit.
    #[error("nats stream `{stream}`: {reason}")]
    Stream {
        /// The configured stream name.
        stream: String,
        /// What conflicts.
        reason: String,
    },
}

/// Publishes events to a JetStream stream.
pub struct NatsSink {
    client: Client,
    js: async_nats::jetstream::Context,
    subject_prefix: String,
    publish_timeout: Duration,
    max_in_flight: usize,
    in_flight: Arc<Semaphore>,
    /// The config the stream is (re)created from.
    config: NatsSinkConfig,
    /// Set by a publish that found no stream listening; cleared by the re-creation.
    stream_missing: AtomicBool,
    /// One re-creation at a time.
    recreating: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for NatsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSink")
            .field("subject_prefix", &self.subject_prefix)
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}

impl NatsSink {
    /// Validates `config`, connects, and creates or updates the stream.
    pub async fn connect(config: &NatsSinkConfig) -> Result<Self, NatsSinkError> {
        config.validate()?;
        let config = &config.with_secrets_read()?;
        let client = connect_with_retry(config).await?;
        let mut js = async_nats::jetstream::new(client.clone());
        js.set_timeout(config.publish_timeout);
        stream::ensure_stream(&js, config).await?;
        record_sink_up(SINK, true);
        Ok(Self {
            client,
            js,
            subject_prefix: config.subject_prefix.clone(),
            publish_timeout: config.publish_timeout,
            max_in_flight: config.max_in_flight,
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
            config: config.clone(),
            stream_missing: AtomicBool::new(false),
            recreating: tokio::sync::Mutex::new(()),
        })
    }

    /// Creates the stream again (as at start) after a publish found it missing.
    async fn recreate_stream(&self) {
        let _one = self.recreating.lock().await;
        if !self.stream_missing.swap(false, Ordering::SeqCst) {
            return;
        }
        match stream::ensure_stream(&self.js, &self.config).await {
            Ok(()) => tracing::warn!(stream = %self.config.stream,
                "nats stream was missing (deleted at run time?); created it again, the sweep retries the failed events"),
            Err(e) => {
                tracing::warn!(stream = %self.config.stream, error = %e,
                    "nats stream is missing and cannot be created again; retrying later");
                self.stream_missing.store(true, Ordering::SeqCst);
            }
        }
    }

    /// Sends one event with `reply` as its reply subject; the PubAck comes
    /// back on the batch's reply subscription. An error is the event's ack.
    async fn send(
        &self,
        event: &Event,
        reply: String,
        max_payload: usize,
    ) -> Result<(), SendFailure> {
        // Shared bytes: the publish and any error text use the one copy.
        let subject = Subject::from(subject_for(&self.subject_prefix, event));
        // Fail fast while reconnecting rather than queueing into a dead
        // connection (the client would hold the message, and the rest of
        // the batch behind it, until it reconnects).
        if self.client.connection_state() != State::Connected {
            return Err(SendFailure::Failed(SinkError::Retriable(format!(
                "nats: not connected to any server, `{subject}` not published (reconnecting)"
            ))));
        }
        let routing = routing_headers(event);
        let size = message_size(event, &routing);
        if max_payload > 0 && size > max_payload {
            // Known from the server's INFO: no round trip for an event that cannot fit.
            return Err(SendFailure::Failed(SinkError::Rejected {
                reason: format!(
                    "nats: event {} for `{subject}` is {} bytes, more than the server's max_payload of {max_payload}",
                    event.id,
                    event.payload.len()
                ),
                limit: Some(max_payload as u64),
            }));
        }
        // Header names made once, the attribute values moved in: no name is
        // built and no value copied per event (only `Content-Type`'s value).
        let mut headers = HeaderMap::new();
        headers.insert(header::NATS_MESSAGE_ID, dedupe_id(event));
        headers.insert(CONTENT_TYPE_HEADER.clone(), CONTENT_TYPE);
        for (name, value) in routing {
            headers.insert(name, value);
        }
        let sent = self.client.publish_with_reply_and_headers(
            subject.clone(),
            reply,
            headers,
            event.payload.clone(),
        );
        match tokio::time::timeout(self.publish_timeout, sent).await {
            Ok(Ok(())) => Ok(()),
            // Only a closed client fails a send (the size was checked above).
            Ok(Err(e)) => Err(SendFailure::Failed(SinkError::Retriable(format!(
                "nats: publish to `{subject}` failed: {}",
                error_chain(&e)
            )))),
            Err(_) => Err(SendFailure::Stalled(SinkError::Retriable(format!(
                "nats: `{subject}` could not be handed to the client within {} (connection stalled)",
                humantime::format_duration(self.publish_timeout)
            )))),
        }
    }

    /// The ack of an event whose PubAck did not come within `publish_timeout`.
    fn timed_out(&self, subject: &str) -> SinkError {
        SinkError::Retriable(format!(
            "nats: no ack for `{subject}` within {} (server unreachable or overloaded)",
            humantime::format_duration(self.publish_timeout)
        ))
    }

    /// The ack of an event from JetStream's reply to its publish.
    fn outcome(&self, subject: &str, reply: Reply) -> Ack {
        match reply {
            // A duplicate PubAck means the stream already stores this event: acknowledged.
            Reply::Stored => Ok(()),
            Reply::NoStream => {
                self.stream_missing.store(true, Ordering::SeqCst);
                Err(SinkError::Retriable(format!(
                    "nats: no stream listens on `{subject}` (stream deleted or jetstream not ready; creating it again)"
                )))
            }
            Reply::Refused(error) => {
                let message = format!("nats: publish to `{subject}` failed: {error}");
                match refusal(error.error_code()) {
                    Refusal::Rejected => Err(SinkError::Rejected {
                        reason: message,
                        limit: None,
                    }),
                    Refusal::Fatal => Err(SinkError::Fatal(message)),
                    Refusal::Retriable => Err(SinkError::Retriable(message)),
                }
            }
            Reply::Unreadable(what) => Err(SinkError::Retriable(format!(
                "nats: unreadable reply to the publish to `{subject}`: {what}"
            ))),
        }
    }

    /// Publishes `events` with one reply subscription: sends while fewer than
    /// `max_in_flight` await their PubAck (over all batches), reads replies
    /// as they come, and fails as retriable every publish not answered within
    /// `publish_timeout` of being sent. Only a PubAck read for an event makes
    /// its ack `Ok`.
    async fn publish_batch(&self, events: &[Event], max_payload: usize) -> Vec<Ack> {
        let every = |message: String| vec![Err(SinkError::Retriable(message)); events.len()];
        if self.client.connection_state() != State::Connected {
            // Not even the subscription could be made: every send would fail fast.
            return every(
                "nats: not connected to any server, not published (reconnecting)".to_string(),
            );
        }
        let inbox = self.client.new_inbox();
        let subscribe = self.client.subscribe(format!("{inbox}.*"));
        let mut replies = match tokio::time::timeout(self.publish_timeout, subscribe).await {
            Ok(Ok(replies)) => replies,
            Ok(Err(e)) => {
                return every(format!(
                    "nats: cannot subscribe to the publish replies: {e}"
                ))
            }
            Err(_) => {
                return every(format!(
                    "nats: cannot subscribe to the publish replies within {} (connection stalled)",
                    humantime::format_duration(self.publish_timeout)
                ))
            }
        };
        let mut acks = every("nats: publish not acknowledged".to_string());
        // Only for the text of a failure: not built per event.
        let subject_of = |index: usize| {
            events
                .get(index)
                .map(|event| subject_for(&self.subject_prefix, event))
                .unwrap_or_default()
        };
        let mut permits = HeldPermits {
            semaphore: &self.in_flight,
            held: 0,
        };
        let mut window = Window::new(events.len());
        let mut next = 0;
        loop {
            while let Some(event) = events.get(next) {
                // Without a permit, wait for this batch's own replies (each
                // frees one) rather than for other batches' permits, which
                // could be waiting for ours.
                let may_wait = window.outstanding() == 0;
                if !permits.take_one(may_wait).await {
                    if may_wait {
                        // The semaphore closed: nothing more is sent.
                        return acks;
                    }
                    break;
                }
                let index = next;
                next += 1;
                let reply = reply_subject(&inbox, index);
                match self.send(event, reply, max_payload).await {
                    Ok(()) => window.sent(index, Instant::now()),
                    Err(SendFailure::Failed(e)) => {
                        acks[index] = Err(e);
                        permits.release(1);
                    }
                    Err(SendFailure::Stalled(e)) => {
                        // The client waited publish_timeout for this one:
                        // the rest would each wait as long. None is sent.
                        for ack in &mut acks[index..] {
                            *ack = Err(e.clone());
                        }
                        next = events.len();
                        permits.release(1);
                    }
                }
            }
            let Some(deadline) = window.deadline(self.publish_timeout) else {
                // Nothing awaits a reply: done, or the next send waits for a permit.
                if next >= events.len() {
                    break;
                }
                continue;
            };
            match tokio::time::timeout_at(deadline, replies.next()).await {
                Ok(Some(message)) => {
                    let Some(index) = reply_index(&inbox, message.subject.as_str()) else {
                        continue;
                    };
                    if window.settle(index) {
                        permits.release(1);
                        acks[index] =
                            match read_reply(message.status, &message.payload, &self.config.stream)
                            {
                                Reply::Stored => Ok(()),
                                // The subject is made only for a failure's text.
                                failed => self.outcome(&subject_of(index), failed),
                            };
                    }
                }
                Ok(None) => {
                    // The client closed: no reply will come, and nothing
                    // more can be sent.
                    for index in window.drain() {
                        permits.release(1);
                        acks[index] = Err(SinkError::Retriable(format!(
                            "nats: connection closed before the ack for `{}` arrived",
                            subject_of(index)
                        )));
                    }
                    break;
                }
                Err(_) => {
                    for index in window.expire(Instant::now(), self.publish_timeout) {
                        permits.release(1);
                        acks[index] = Err(self.timed_out(&subject_of(index)));
                    }
                }
            }
        }
        acks
    }
}

/// Why an event was not sent.
enum SendFailure {
    /// This event failed; the next may be sent.
    Failed(SinkError),
    /// The client took no message within `publish_timeout`: the rest of the
    /// batch would wait as long, each.
    Stalled(SinkError),
}

/// Permits of the sink's `max_in_flight` semaphore taken by one batch, given
/// back as its publishes are answered, and all of them when the batch ends
/// or is dropped.
struct HeldPermits<'a> {
    semaphore: &'a Semaphore,
    held: usize,
}

impl HeldPermits<'_> {
    /// Takes one permit; waits for one only when `may_wait`. False when none
    /// is free (or the semaphore closed).
    async fn take_one(&mut self, may_wait: bool) -> bool {
        let permit = match self.semaphore.try_acquire() {
            Ok(permit) => permit,
            Err(_) if may_wait => match self.semaphore.acquire().await {
                Ok(permit) => permit,
                Err(_) => return false,
            },
            Err(_) => return false,
        };
        permit.forget();
        self.held += 1;
        true
    }

    /// Gives `count` permits back.
    fn release(&mut self, count: usize) {
        let count = count.min(self.held);
        self.held -= count;
        self.semaphore.add_permits(count);
    }
}

impl Drop for HeldPermits<'_> {
    fn drop(&mut self) {
        self.semaphore.add_permits(self.held);
    }
}

/// The subject of an event: `{subject_prefix}.{tenant}.{type}`.
pub fn subject_for(subject_prefix: &str, event: &Event) -> String {
    format!(
        "{subject_prefix}.{}.{}",
        event.stream.tenant,
        event.ty.as_str()
    )
}

/// An error and its sources as one line. A source that only repeats what
/// the line already ends with (async-nats wraps `authorization violation`
/// in `nats: authorization violation` twice) is left out.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let said = s.to_string();
        let last = said.rsplit(": ").next().unwrap_or(&said);
        if !text.ends_with(last) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = s.source();
    }
    text
}

/// True when a connect error text says the TLS handshake failed over a
/// certificate (unknown issuer, expired, wrong name, or the server refused
/// ours): rustls reports these as I/O errors, but retrying cannot help.
pub fn is_certificate_failure(text: &str) -> bool {
    let text = text.to_ascii_lowercase();
    text.contains("invalid peer certificate")
        || text.contains("certificate")
            && (text.contains("expired") || text.contains("unknown") || text.contains("bad"))
        || text.contains("received fatal alert")
}

#[async_trait]
impl Sink for NatsSink {
    fn name(&self) -> &str {
        SINK
    }

    async fn publish(&self, events: &[Event]) -> Vec<Ack> {
        let max_payload = self.client.server_info().max_payload;
        let acks = self.publish_batch(events, max_payload).await;
        if self.stream_missing.load(Ordering::SeqCst) {
            self.recreate_stream().await;
        }
        acks
    }

    async fn health(&self) -> Result<(), SinkError> {
        let up = self.client.connection_state() == State::Connected;
        record_sink_up(SINK, up);
        if up {
            Ok(())
        } else {
            Err(SinkError::Retriable(
                "nats: not connected to any server (reconnecting)".to_string(),
            ))
        }
    }

    async fn flush(&self) -> Result<(), SinkError> {
        self.client
            .flush()
            .await
            .map_err(|e| SinkError::Retriable(format!("nats: flush failed: {e}")))
    }
}

/// `check-config --probe`: connects as the sink would (giving up after at
/// most 5 seconds) and looks the stream up, without creating or changing it.
pub async fn probe(config: &NatsSinkConfig) -> Result<String, NatsSinkError> {
    config.validate()?;
    let config = NatsSinkConfig {
        connect_timeout: config.connect_timeout.min(Duration::from_secs(5)),
        ..config.with_secrets_read()?
    };
    let client = connect_with_retry(&config).await?;
    let info = client.server_info();
    let server = format!("{}:{} (nats-server {})", info.host, info.port, info.version);
    let js = async_nats::jetstream::new(client);
    match js.get_stream(&config.stream).await {
        Ok(stream) => Ok(format!(
            "connected to {server}; stream `{}` holds {} messages",
            config.stream,
            stream.cached_info().state.messages
        )),
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(inner) if inner.error_code() == ErrorCode::STREAM_NOT_FOUND => Ok(format!(
                "connected to {server}; stream `{}` does not exist yet (the daemon creates it at start)",
                config.stream
            )),
            _ => Err(NatsSinkError::Stream {
                stream: config.stream.clone(),
                reason: format!("lookup failed: {e}"),
            }),
        },
    }
}

/// Connects, retrying unreachable servers until `connect_timeout` has passed.
async fn connect_with_retry(config: &NatsSinkConfig) -> Result<Client, NatsSinkError> {
    let connect_error = |reason: String| NatsSinkError::Connect {
        urls: config.url.clone(),
        reason,
    };
    let addrs = config
        .urls()
        .iter()
        .map(|u| u.parse::<ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| connect_error(format!("invalid server URL: {e}")))?;
    let deadline = StdInstant::now() + config.connect_timeout;
    let mut delay = Duration::from_millis(250);
    loop {
        let options = connect_options(config).map_err(connect_error)?;
        let error = match options.connect(addrs.clone()).await {
            Ok(client) => return Ok(client),
            Err(e) => e,
        };
        let text = error_chain(&error);
        if is_certificate_failure(&text) {
            // Arrives as an I/O error, but no retry fixes a certificate.
            return Err(connect_error(format!(
                "tls: {text} (check sink.nats.tls.ca_file and the server's certificate)"
            )));
        }
        let retriable = matches!(
            error.kind(),
            ConnectErrorKind::Io | ConnectErrorKind::TimedOut | ConnectErrorKind::Dns
        );
        if !retriable {
            return Err(connect_error(text));
        }
        if StdInstant::now() + delay > deadline {
            return Err(connect_error(format!(
                "{error} (gave up after connect_timeout {})",
                humantime::format_duration(config.connect_timeout)
            )));
        }
        tracing::warn!(url = %config.url, error = %error, "nats server unreachable, retrying");
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// Client options from the config: authentication, TLS, timeouts, event logging.
fn connect_options(config: &NatsSinkConfig) -> Result<ConnectOptions, String> {
    let mut options = ConnectOptions::new()
        .name("voucher-cdc")
        .connection_timeout(config.connect_timeout.min(Duration::from_secs(10)))
        .max_reconnects(None::<usize>)
        // A batch's reply subscription must hold every PubAck it awaits
        // (at most max_in_flight), or the client drops the rest.
        .subscription_capacity(config.max_in_flight.max(DEFAULT_SUBSCRIPTION_CAPACITY))
        .event_callback(|event| async move {
            match event {
                ClientEvent::Connected => {
                    record_sink_up(SINK, true);
                    tracing::info!(sink = SINK, "connected to nats");
                }
                ClientEvent::Disconnected => {
                    record_sink_up(SINK, false);
                    tracing::warn!(sink = SINK, "disconnected from nats, reconnecting");
                }
                other => tracing::debug!(sink = SINK, event = %other, "nats client event"),
            }
        });
    // Secret files were read into their values by `with_secrets_read`.
    if let Some(creds) = &config.credentials {
        options = options
            .credentials(creds.expose())
            .map_err(|e| format!("sink.nats.credentials: not a valid .creds file: {e}"))?;
    }
    if let Some(seed) = &config.nkey_seed {
        options = options.nkey(seed.expose().trim().to_string());
    }
    if let (Some(user), Some(password)) = (&config.user, &config.password) {
        options = options.user_and_password(user.clone(), password.expose().to_string());
    }
    if let Some(token) = &config.token {
        options = options.token(token.expose().to_string());
    }
    if let Some(ca) = &config.tls.ca_file {
        options = options.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&config.tls.cert_file, &config.tls.key_file) {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    Ok(options.require_tls(config.tls.required))
}

/// The routing attributes as `ce-` headers (CloudEvents NATS binding),
/// beside `Nats-Msg-Id`; the body stays the structured event.
pub fn routing_headers(event: &Event) -> Vec<(HeaderName, String)> {
    match Attributes::routing_of(&event.payload) {
        Ok(routing) => routing
            .into_iter()
            .map(|(name, value)| (header_name(name), value))
            .collect(),
        Err(e) => {
            tracing::warn!(sink = SINK, event = %event.id, error = %e,
                "event payload is not a structured cloudevent; published without ce- headers");
            Vec::new()
        }
    }
}

/// The bytes the sink counts for `event` against the server's
/// `max_payload`: body, the `ce-` headers in `routing` (see
/// [`routing_headers`]), the message id and the other headers.
pub fn message_size(event: &Event, routing: &[(HeaderName, String)]) -> usize {
    let header_bytes: usize = routing
        .iter()
        .map(|(k, v)| AsRef::<[u8]>::as_ref(k).len() + v.len() + 4)
        .sum();
    event.payload.len() + event.id.len() + header_bytes + HEADER_OVERHEAD
}

/// The `ce-` header of every attribute [`Attributes::routing_of`] returns,
/// made once instead of for each event.
static ROUTING_HEADER_NAMES: [(&str, HeaderName); 8] = [
    ("id", HeaderName::from_static("ce-id")),
    ("type", HeaderName::from_static("ce-type")),
    ("source", HeaderName::from_static("ce-source")),
    ("subject", HeaderName::from_static("ce-subject")),
    ("specversion", HeaderName::from_static("ce-specversion")),
    ("tenant", HeaderName::from_static("ce-tenant")),
    ("op", HeaderName::from_static("ce-op")),
    ("changedfields", HeaderName::from_static("ce-changedfields")),
];

/// The `ce-` header of a routing attribute (`nats_header`, without an
/// allocation for the attributes [`ROUTING_HEADER_NAMES`] lists).
fn header_name(attribute: &str) -> HeaderName {
    ROUTING_HEADER_NAMES
        .iter()
        .find(|(known, _)| *known == attribute)
        .map(|(_, name)| name.clone())
        .unwrap_or_else(|| nats_header(attribute).into_header_name())
}

/// The `Nats-Msg-Id` JetStream deduplicates by: the event id, except for a
/// dead letter, which carries its event's id in the body but must never make
/// JetStream drop that event itself as a duplicate (a dead letter acked before
/// a crash, the limit raised, the event re-published and now fitting).
fn dedupe_id(event: &Event) -> String {
    if event.ty == EventType::DeadLetter {
        format!("{}.deadletter", event.id)
    } else {
        event.id.clone()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::stream::{Resource, StreamKey};

    fn event(tenant: u64, ty: EventType) -> Event {
        Event {
            id: "0123456789abcdef0123456789abcdef".to_string(),
            stream: StreamKey::new(tenant, Resource::Vouchers),
            ty,
            op: None,
            partition_key: format!("{tenant}:voucher:1"),
            payload: Bytes::from_static(b"{}"),
        }
    }

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn every_routing_attribute_has_its_ce_header_without_a_lookup_miss() {
        use crate::sinks::binding::{OPTIONAL_ROUTING_ATTRIBUTES, ROUTING_ATTRIBUTES};
        let attributes = ROUTING_ATTRIBUTES
            .iter()
            .chain(OPTIONAL_ROUTING_ATTRIBUTES.iter());
        for attribute in attributes {
            let known = ROUTING_HEADER_NAMES
                .iter()
                .find(|(name, _)| name == attribute)
                .map(|(_, header)| header.to_string());
            assert_eq!(known, Some(nats_header(attribute)), "{attribute}");
            assert_eq!(header_name(attribute).to_string(), nats_header(attribute));
        }
        assert_eq!(header_name("future").to_string(), "ce-future");
    }

    #[test]
    fn routing_headers_are_the_events_attributes_as_ce_headers() {
        let event = crate::sinks::testing::sample_event(StreamKey::new(42, Resource::Vouchers), 7);
        let headers: Vec<(String, String)> = routing_headers(&event)
            .into_iter()
            .map(|(name, value)| (name.to_string(), value))
            .collect();
        let expected = [
            ("ce-id", event.id.as_str()),
            ("ce-type", "voucher.updated"),
            ("ce-source", "/tenants/42/catalog/vouchers"),
            ("ce-subject", "7"),
            ("ce-specversion", "1.0"),
            ("ce-tenant", "42"),
            ("ce-op", "create"),
        ];
        let mut sorted = headers.clone();
        sorted.sort();
        let mut wanted: Vec<(String, String)> = expected
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        wanted.sort();
        assert_eq!(sorted, wanted);
        let named: usize = headers.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
        let size = message_size(&event, &routing_headers(&event));
        assert_eq!(
            size,
            event.payload.len() + event.id.len() + named + HEADER_OVERHEAD
        );
    }

    #[test]
    fn an_error_chain_says_each_cause_once() {
        let repeated = Layer(
            "authorization violation",
            Some(Box::new(Layer(
                "nats: authorization violation",
                Some(Box::new(Layer("nats: authorization violation", None))),
            ))),
        );
        assert_eq!(error_chain(&repeated), "authorization violation");
        let nested = Layer(
            "IO error",
            Some(Box::new(Layer(
                "invalid peer certificate: UnknownIssuer",
                None,
            ))),
        );
        assert_eq!(
            error_chain(&nested),
            "IO error: invalid peer certificate: UnknownIssuer"
        );
    }

    #[test]
    fn a_dead_letter_never_takes_the_dedupe_id_of_the_event_it_stands_for() {
        let record = event(4, EventType::Updated(Resource::Vouchers));
        let letter = event(4, EventType::DeadLetter);
        assert_eq!(dedupe_id(&record), record.id);
        assert_eq!(dedupe_id(&letter), format!("{}.deadletter", letter.id));
        assert_ne!(dedupe_id(&letter), dedupe_id(&record));
    }

    #[test]
    fn subjects_are_prefix_tenant_and_dotted_type() {
        assert_eq!(
            subject_for(
                "voucher_cdc",
                &event(42, EventType::Updated(Resource::Vouchers))
            ),
            "voucher_cdc.42.voucher.updated"
        );
        assert_eq!(
            subject_for(
                "acme.cdc",
                &event(7, EventType::Deleted(Resource::Categories))
            ),
            "acme.cdc.7.category.deleted"
        );
        assert_eq!(
            subject_for("voucher_cdc", &event(1, EventType::ReplayStarted)),
            "voucher_cdc.1.replay.started"
        );
    }

    #[test]
    fn certificate_failures_are_told_apart_from_an_unreachable_server() {
        assert!(is_certificate_failure(
            "IO error: invalid peer certificate: UnknownIssuer"
        ));
        assert!(is_certificate_failure(
            "IO error: invalid peer certificate: Expired"
        ));
        assert!(is_certificate_failure(
            "IO error: received fatal alert: BadCertificate"
        ));
        assert!(!is_certificate_failure(
            "IO error: Connection refused (os error 111)"
        ));
        assert!(!is_certificate_failure("timed out"));
    }
}
