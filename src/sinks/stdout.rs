//! The `stdout` sink: one CloudEvent JSON per line on standard output, for
//! `demo` and for piping into `jq` or another tool. Logs go to stderr.
//!
//! A closed standard output (`voucher-cdc demo | head`) cannot be retried:
//! the sink reports it through [`Sink::ended`], and the daemon then
//! stops like any Unix tool whose reader went away, after flushing its state.

use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use super::file::json_lines;
use super::{Ack, Sink, SinkError};
use crate::event::Event;

/// Writes events to standard output (or, for tests, any writer).
#[derive(Clone)]
pub struct StdoutSink {
    out: Arc<Mutex<Box<dyn Write + Send>>>,
    closed: CancellationToken,
}

impl std::fmt::Debug for StdoutSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StdoutSink")
    }
}

impl Default for StdoutSink {
    fn default() -> Self {
        StdoutSink::new()
    }
}

impl StdoutSink {
    /// A sink writing to the process's standard output.
    pub fn new() -> StdoutSink {
        StdoutSink::with_writer(io::stdout())
    }

    /// A sink writing to `out` instead (tests, embedding).
    pub fn with_writer(out: impl Write + Send + 'static) -> StdoutSink {
        StdoutSink {
            out: Arc::new(Mutex::new(Box::new(out))),
            closed: CancellationToken::new(),
        }
    }

    /// Cancelled once a write found the reader gone (EPIPE): nothing more can be delivered.
    pub fn closed(&self) -> CancellationToken {
        self.closed.clone()
    }

    async fn write(&self, bytes: Vec<u8>) -> Result<(), SinkError> {
        let out = self.out.clone();
        let joined = tokio::task::spawn_blocking(move || {
            let mut out = out.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            out.write_all(&bytes).and_then(|()| out.flush())
        })
        .await;
        match joined {
            Ok(Ok(())) => Ok(()),
            // Nobody reads our output any more: retrying cannot help.
            Ok(Err(e)) if e.kind() == io::ErrorKind::BrokenPipe => {
                self.closed.cancel();
                Err(SinkError::Fatal(format!(
                    "stdout sink: standard output is closed: {e}"
                )))
            }
            Ok(Err(e)) => Err(SinkError::Retriable(format!(
                "stdout sink: writing standard output: {e}"
            ))),
            Err(e) => Err(SinkError::Retriable(format!(
                "stdout sink: writing standard output: {e}"
            ))),
        }
    }
}

#[async_trait]
impl Sink for StdoutSink {
    fn name(&self) -> &str {
        "stdout"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Ack> {
        if events.is_empty() {
            return Vec::new();
        }
        let outcome = self.write(json_lines(events)).await;
        vec![outcome; events.len()]
    }

    async fn flush(&self) -> Result<(), SinkError> {
        if self.closed.is_cancelled() {
            // The reader went away: there is nothing left to flush to.
            return Ok(());
        }
        self.write(Vec::new()).await
    }

    fn ended(&self) -> Option<CancellationToken> {
        Some(self.closed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sinks::testing::sample_event;
    use crate::stream::{Resource, StreamKey};

    fn event(n: i64) -> Event {
        sample_event(StreamKey::new(1, Resource::Vouchers), n)
    }

    /// A writer into shared memory, or one that fails like a closed pipe.
    #[derive(Clone, Default)]
    struct Capture {
        bytes: Arc<Mutex<Vec<u8>>>,
        broken: bool,
    }

    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.broken {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            self.bytes.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn each_event_is_one_json_line_and_a_closed_pipe_is_fatal() {
        let capture = Capture::default();
        let sink = StdoutSink::with_writer(capture.clone());
        assert_eq!(
            sink.publish(&[event(1), event(2)]).await,
            vec![Ok(()), Ok(())]
        );
        sink.flush().await.unwrap();
        let text = String::from_utf8(capture.bytes.lock().unwrap().clone()).unwrap();
        let expected = format!(
            "{}\n{}\n",
            String::from_utf8_lossy(&event(1).payload),
            String::from_utf8_lossy(&event(2).payload)
        );
        assert_eq!(text, expected);

        let broken = StdoutSink::with_writer(Capture {
            broken: true,
            ..Capture::default()
        });
        assert!(!broken.closed().is_cancelled());
        let acks = broken.publish(&[event(1)]).await;
        assert!(
            broken.closed().is_cancelled(),
            "a closed pipe must stop the process, not be retried"
        );
        broken.flush().await.unwrap();
        let err = acks[0].clone().unwrap_err();
        assert!(!err.is_retriable());
        assert!(
            err.to_string()
                .starts_with("stdout sink: standard output is closed"),
            "{err}"
        );
    }

    /// Runs in a child process (see the next test): publishes three events
    /// to the process's real stdout. Does nothing in a normal test run.
    #[tokio::test]
    async fn child_publishes_to_the_real_stdout() {
        if std::env::var_os("VCDC_STDOUT_CHILD").is_none() {
            return;
        }
        let sink = StdoutSink::new();
        assert_eq!(sink.name(), "stdout");
        let acks = sink.publish(&[event(7), event(8), event(9)]).await;
        assert_eq!(acks, vec![Ok(()), Ok(()), Ok(())]);
        sink.flush().await.unwrap();
    }

    #[test]
    fn what_the_real_stdout_sink_acknowledges_is_on_the_process_stdout() {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sinks::stdout::tests::child_publishes_to_the_real_stdout",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("VCDC_STDOUT_CHILD", "1")
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        let stdout = String::from_utf8(output.stdout).unwrap();
        // libtest writes its own progress to stdout too, even mid-line.
        let events: Vec<&str> = stdout
            .lines()
            .filter_map(|l| l.find("{\"specversion\"").map(|at| &l[at..]))
            .collect();
        let expected: Vec<String> = [7, 8, 9]
            .iter()
            .map(|id| String::from_utf8_lossy(&event(*id).payload).into_owned())
            .collect();
        assert_eq!(events, expected, "stdout was: {stdout}");
    }
}
