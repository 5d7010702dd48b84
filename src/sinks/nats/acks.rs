//! The bookkeeping of one batch's JetStream publishes, free of I/O: which
//! reply subject names which event, what a PubAck reply says, and which
//! publishes have waited longer than `publish_timeout`.
//!
//! The sink publishes a batch with one reply subscription of its own
//! (`{inbox}.{index}` per event) instead of one request future per event:
//! async-nats's request path pays, per message, a fresh inbox, a oneshot,
//! two timers, a boxed future and an untagged parse of the reply. Here a
//! batch pays one subscription, and an event a reply subject, a slot in
//! [`Window`] and a plain parse ([`read_reply`]).

use std::borrow::Cow;
use std::time::Duration;

use async_nats::jetstream::{self, ErrorCode};
use async_nats::StatusCode;
use serde::Deserialize;
use tokio::time::Instant;

/// What JetStream answered to one publish.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// The stream stored the message (or already held it: a duplicate).
    Stored,
    /// No stream listens on the subject (the server's no-responders status).
    NoStream,
    /// The stream refused the message, with the API error it gave.
    Refused(jetstream::Error),
    /// The reply is not a PubAck (what it is instead).
    Unreadable(String),
}

/// The body of a PubAck reply: `{"stream":..,"seq":..}` or `{"error":{..}}`.
#[derive(Deserialize)]
struct ReplyBody<'a> {
    #[serde(default)]
    error: Option<jetstream::Error>,
    #[serde(default, borrow)]
    stream: Option<Cow<'a, str>>,
    #[serde(default)]
    seq: Option<u64>,
}

/// Reads a reply to a JetStream publish from its status and body; only a
/// PubAck of `stream` (with a sequence) is [`Reply::Stored`].
pub fn read_reply(status: Option<StatusCode>, payload: &[u8], stream: &str) -> Reply {
    if status == Some(StatusCode::NO_RESPONDERS) {
        return Reply::NoStream;
    }
    match serde_json::from_slice::<ReplyBody>(payload) {
        Ok(ReplyBody {
            error: Some(error), ..
        }) => Reply::Refused(error),
        Ok(ReplyBody {
            stream: Some(stored_in),
            seq: Some(_),
            ..
        }) => {
            if stored_in == stream {
                Reply::Stored
            } else {
                Reply::Unreadable(format!(
                    "a pub ack of stream `{stored_in}`, not of `{stream}`"
                ))
            }
        }
        Ok(_) => Reply::Unreadable("a reply without `stream` and `seq`, or `error`".to_string()),
        Err(e) => Reply::Unreadable(match status {
            Some(status) => format!("status {status} and a body that is not a pub ack ({e})"),
            None => format!("not a pub ack: {e}"),
        }),
    }
}

/// How a refusal by the stream is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// This one message can never be stored (larger than the stream's
    /// `max_msg_size`): a per-record failure.
    Rejected,
    /// Retrying the same publish cannot succeed for any event: only the
    /// optimistic-concurrency checks this sink never asks for.
    Fatal,
    /// Full or unavailable storage, a cluster without a leader: clears up on
    /// its own or by operator action.
    Retriable,
}

/// Classifies a JetStream API error code given in a refused publish.
pub fn refusal(code: ErrorCode) -> Refusal {
    match code {
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM => Refusal::Rejected,
        ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID | ErrorCode::STREAM_WRONG_LAST_SEQUENCE => {
            Refusal::Fatal
        }
        _ => Refusal::Retriable,
    }
}

/// The reply subject of the `index`th event of a batch whose inbox is `inbox`.
pub fn reply_subject(inbox: &str, index: usize) -> String {
    let mut subject = String::with_capacity(inbox.len() + 8);
    subject.push_str(inbox);
    subject.push('.');
    subject.push_str(crate::json::decimal(index as u64, &mut [0; 20]));
    subject
}

/// The event index a reply subject of `inbox` names (see [`reply_subject`]);
/// None for any other subject.
pub fn reply_index(inbox: &str, subject: &str) -> Option<usize> {
    let digits = subject.strip_prefix(inbox)?.strip_prefix('.')?;
    if digits.is_empty() || digits.len() > 19 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The publishes of one batch still waiting for their reply, in the order
/// they were sent, each with the moment it was sent.
#[derive(Debug)]
pub struct Window {
    /// When each event was sent, while it awaits its reply.
    sent_at: Vec<Option<Instant>>,
    /// Events awaiting a reply.
    outstanding: usize,
    /// No event before this index awaits a reply (sends go in index order,
    /// so the first awaiting one was sent first).
    oldest: usize,
}

impl Window {
    /// A window for a batch of `events` events, none sent.
    pub fn new(events: usize) -> Self {
        Self {
            sent_at: vec![None; events],
            outstanding: 0,
            oldest: 0,
        }
    }

    /// How many events await a reply.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Records that event `index` was sent at `at`.
    pub fn sent(&mut self, index: usize, at: Instant) {
        let Some(slot) = self.sent_at.get_mut(index) else {
            return;
        };
        if slot.replace(at).is_some() {
            return;
        }
        if self.outstanding == 0 {
            // Nothing older awaits a reply.
            self.oldest = index;
        }
        self.outstanding += 1;
    }

    /// Takes event `index` out of the window; false when it was not
    /// awaiting a reply (never sent, already answered or timed out).
    pub fn settle(&mut self, index: usize) -> bool {
        let Some(slot) = self.sent_at.get_mut(index) else {
            return false;
        };
        if slot.take().is_none() {
            return false;
        }
        self.outstanding -= 1;
        self.advance_oldest();
        true
    }

    /// When the event sent first of those awaiting a reply runs out of time.
    pub fn deadline(&self, timeout: Duration) -> Option<Instant> {
        if self.outstanding == 0 {
            return None;
        }
        let sent = self.sent_at.get(self.oldest).copied().flatten()?;
        Some(sent + timeout)
    }

    /// Takes out of the window, and returns, every event sent `timeout` or
    /// longer before `now`.
    pub fn expire(&mut self, now: Instant, timeout: Duration) -> Vec<usize> {
        let mut expired = Vec::new();
        if self.outstanding == 0 {
            return expired;
        }
        for (index, slot) in self.sent_at.iter_mut().enumerate().skip(self.oldest) {
            match slot {
                Some(sent) if *sent + timeout <= now => {
                    *slot = None;
                    expired.push(index);
                }
                // Sent in index order: the rest were sent later still.
                Some(_) => break,
                None => {}
            }
        }
        self.outstanding -= expired.len();
        self.advance_oldest();
        expired
    }

    /// Takes every event awaiting a reply out of the window, and returns them.
    pub fn drain(&mut self) -> Vec<usize> {
        let drained: Vec<usize> = (self.oldest..self.sent_at.len())
            .filter(|&index| self.sent_at[index].take().is_some())
            .collect();
        self.outstanding = 0;
        self.oldest = self.sent_at.len();
        drained
    }

    fn advance_oldest(&mut self) {
        if self.outstanding == 0 {
            // Nothing awaits: the next event sent becomes the oldest (`sent`).
            return;
        }
        while self.sent_at.get(self.oldest).is_some_and(Option::is_none) {
            self.oldest += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(code: u64, description: &str) -> jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": 400, "err_code": code, "description": description
        }))
        .unwrap()
    }

    #[test]
    fn a_pub_ack_is_stored_whether_or_not_it_is_a_duplicate() {
        assert_eq!(
            read_reply(None, br#"{"stream":"V","seq":7}"#, "V"),
            Reply::Stored
        );
        assert_eq!(
            read_reply(
                None,
                br#"{"stream":"V","seq":7,"duplicate":true,"domain":"x"}"#,
                "V"
            ),
            Reply::Stored
        );
    }

    #[test]
    fn an_api_error_is_a_refusal_with_its_code_and_no_responders_is_a_missing_stream() {
        let body = br#"{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}}"#;
        assert_eq!(
            read_reply(None, body, "V"),
            Reply::Refused(error(10054, "message size exceeds maximum allowed"))
        );
        assert_eq!(
            read_reply(Some(StatusCode::NO_RESPONDERS), b"", "V"),
            Reply::NoStream
        );
    }

    #[test]
    fn a_reply_that_is_no_pub_ack_is_unreadable_never_stored() {
        for body in [
            &b""[..],
            b"not json",
            b"{}",
            br#"{"stream":"V"}"#,
            br#"{"seq":7}"#,
            br#"{"stream":"V","seq":"seven"}"#,
            br#"{"stream":"OTHER","seq":7}"#,
            b"[1]",
        ] {
            assert!(
                matches!(read_reply(None, body, "V"), Reply::Unreadable(_)),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        match read_reply(Some(StatusCode::from_u16(408).unwrap()), b"", "V") {
            Reply::Unreadable(what) => assert!(what.contains("408"), "{what}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn only_a_message_too_large_is_rejected_alone_and_only_concurrency_checks_are_fatal() {
        assert_eq!(
            refusal(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM),
            Refusal::Rejected
        );
        assert_eq!(
            refusal(ErrorCode::STREAM_WRONG_LAST_SEQUENCE),
            Refusal::Fatal
        );
        assert_eq!(
            refusal(ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID),
            Refusal::Fatal
        );
        for code in [
            ErrorCode::STREAM_STORE_FAILED,
            ErrorCode::STORAGE_RESOURCES_EXCEEDED,
            ErrorCode::CLUSTER_NOT_AVAILABLE,
            ErrorCode::INSUFFICIENT_RESOURCES,
            ErrorCode::STREAM_NOT_FOUND,
        ] {
            assert_eq!(refusal(code), Refusal::Retriable, "{code:?}");
        }
    }

    #[test]
    fn a_reply_subject_names_its_event_and_no_other_subject_does() {
        let inbox = "_INBOX.abc";
        for index in [0, 7, 49, 1023, 123_456] {
            assert_eq!(
                reply_index(inbox, &reply_subject(inbox, index)),
                Some(index)
            );
        }
        assert_eq!(reply_subject(inbox, 12), "_INBOX.abc.12");
        for other in [
            "_INBOX.abc",
            "_INBOX.abc.",
            "_INBOX.abcd.1",
            "_INBOX.ab.1",
            "_INBOX.abc.1.2",
            "_INBOX.abc.-1",
            "_INBOX.abc.x",
            "_INBOX.abc.99999999999999999999",
        ] {
            assert_eq!(reply_index(inbox, other), None, "{other}");
        }
    }

    #[test]
    fn a_window_settles_each_sent_event_once() {
        let t0 = Instant::now();
        let mut window = Window::new(4);
        assert!(!window.settle(0), "never sent");
        window.sent(0, t0);
        window.sent(1, t0);
        assert_eq!(window.outstanding(), 2);
        assert!(window.settle(1));
        assert!(!window.settle(1), "answered twice");
        assert!(!window.settle(9), "out of range");
        assert_eq!(window.outstanding(), 1);
        assert!(window.settle(0));
        assert_eq!(window.outstanding(), 0);
        assert_eq!(window.deadline(Duration::from_secs(1)), None);
    }

    #[test]
    fn the_deadline_is_the_oldest_awaiting_events_and_expiry_takes_only_events_past_it() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(10);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut window = Window::new(6);
        window.sent(0, at(0));
        window.sent(1, at(1));
        window.sent(2, at(2));
        assert_eq!(window.deadline(timeout), Some(at(10)));
        // The oldest answered: the next oldest's time counts.
        assert!(window.settle(0));
        assert_eq!(window.deadline(timeout), Some(at(11)));
        // Answered out of order: 2 before 1.
        assert!(window.settle(2));
        assert_eq!(window.deadline(timeout), Some(at(11)));
        window.sent(3, at(5));
        window.sent(4, at(6));
        assert_eq!(window.expire(at(11), timeout), vec![1]);
        assert_eq!(window.deadline(timeout), Some(at(15)));
        assert_eq!(window.expire(at(15), timeout), vec![3]);
        assert_eq!(window.outstanding(), 1);
        assert!(!window.settle(3), "expired events are out of the window");
        assert!(window.settle(4));
        // Everything answered, then one more sent: its own time counts.
        window.sent(5, at(20));
        assert_eq!(window.deadline(timeout), Some(at(30)));
        assert_eq!(window.expire(at(29), timeout), Vec::<usize>::new());
        assert_eq!(window.drain(), vec![5]);
        assert_eq!(window.outstanding(), 0);
        assert_eq!(window.deadline(timeout), None);
    }

    #[test]
    fn events_that_failed_to_send_leave_gaps_the_window_steps_over() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(10);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut window = Window::new(8);
        // 1, 3 and 4 failed to send: never in the window.
        window.sent(0, at(0));
        window.sent(2, at(1));
        window.sent(5, at(2));
        window.sent(6, at(3));
        assert!(!window.settle(1));
        assert!(window.settle(0));
        assert_eq!(
            window.deadline(timeout),
            Some(at(11)),
            "1 is a gap, 2 is next"
        );
        assert_eq!(window.expire(at(11), timeout), vec![2]);
        assert_eq!(window.deadline(timeout), Some(at(12)), "3 and 4 are gaps");
        assert_eq!(window.drain(), vec![5, 6]);
        assert_eq!(window.outstanding(), 0);
        assert!(!window.settle(5), "drained events are out of the window");
    }

    #[test]
    fn a_window_emptied_by_expiry_counts_the_next_send_from_its_own_time() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(10);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut window = Window::new(4);
        window.sent(0, at(0));
        window.sent(1, at(0));
        assert_eq!(window.expire(at(10), timeout), vec![0, 1]);
        assert_eq!(window.deadline(timeout), None);
        window.sent(3, at(12));
        assert_eq!(window.outstanding(), 1);
        assert_eq!(window.deadline(timeout), Some(at(22)));
        assert_eq!(window.expire(at(21), timeout), Vec::<usize>::new());
        assert_eq!(window.expire(at(22), timeout), vec![3]);
    }
}
