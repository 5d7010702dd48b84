//! The `file` sink: appends one CloudEvent JSON per line to a local file.
//!
//! Meant for demos, audits and pipelines that tail a file. A batch is
//! acknowledged only after its bytes were written and `fdatasync`ed, so the
//! invariant "a hash is committed only after a durable ack" holds here too.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::{Ack, Sink, SinkError};
use crate::event::Event;

/// `[sink.file]`: where the file sink writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSinkConfig {
    /// File the events are appended to, one JSON per line; parent directories
    /// are created (default `./data/events.jsonl`).
    #[serde(default = "default_file_path")]
    pub path: PathBuf,
}

/// Default of `sink.file.path`.
pub fn default_file_path() -> PathBuf {
    PathBuf::from("./data/events.jsonl")
}

impl FileSinkConfig {
    /// Builds the sink: opens the file for appending (see [`FileSink::open`]).
    pub fn build(&self) -> Result<FileSink, SinkError> {
        FileSink::open(self)
    }

    /// `check-config --probe`: the file can be opened for appending (a file
    /// or directories the probe had to create are removed again).
    pub fn probe(&self) -> Result<String, String> {
        let existed = self.path.exists();
        let missing_dirs: Vec<PathBuf> = self
            .path
            .ancestors()
            .skip(1)
            .filter(|dir| !dir.as_os_str().is_empty() && !dir.exists())
            .map(PathBuf::from)
            .collect();
        let opened = FileSink::open(self).map_err(|e| e.to_string());
        if !existed {
            // Best effort: leave the disk as the probe found it.
            let _ = std::fs::remove_file(&self.path);
            for dir in &missing_dirs {
                let _ = std::fs::remove_dir(dir);
            }
        }
        opened.map(|_| format!("{} is writable", self.path.display()))
    }
}

impl Default for FileSinkConfig {
    fn default() -> Self {
        FileSinkConfig {
            path: default_file_path(),
        }
    }
}

/// Appends events to a JSON-lines file, durably.
#[derive(Debug, Clone)]
pub struct FileSink {
    path: PathBuf,
    file: Arc<Mutex<File>>,
}

impl FileSink {
    /// Opens (creating it and its parent directories if needed) the file for appending.
    pub fn open(config: &FileSinkConfig) -> Result<FileSink, SinkError> {
        let path = config.path.clone();
        let fatal = |action: &str, e: io::Error| {
            SinkError::Fatal(format!(
                "file sink: cannot {action} {}: {e}",
                path.display()
            ))
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| fatal("create the directory of", e))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| fatal("open", e))?;
        Ok(FileSink {
            path,
            file: Arc::new(Mutex::new(file)),
        })
    }

    /// The file events are appended to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `op` on the file on the blocking pool; errors name the file.
    async fn with_file<T: Send + 'static>(
        &self,
        action: &'static str,
        op: impl FnOnce(&mut File) -> io::Result<T> + Send + 'static,
    ) -> Result<T, SinkError> {
        let file = self.file.clone();
        let path = self.path.clone();
        let failed = move |e: &dyn std::fmt::Display| {
            SinkError::Retriable(format!("file sink: {action} {}: {e}", path.display()))
        };
        let joined = tokio::task::spawn_blocking(move || {
            // A panic while holding the lock cannot leave a half-written
            // batch visible (it is truncated below), so a poisoned lock is safe.
            let mut file = file.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            op(&mut file)
        })
        .await;
        match joined {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(failed(&e)),
            Err(e) => Err(failed(&e)),
        }
    }
}

/// Appends one line per payload and syncs; on failure truncates back so no
/// partial line remains.
fn append_durably(file: &mut File, payloads: &[Bytes]) -> io::Result<()> {
    let before = file.metadata()?.len();
    let result = write_lines(file, payloads).and_then(|()| file.sync_data());
    if result.is_err() {
        // Best effort: the write error is what the caller needs to see.
        let _ = file.set_len(before);
    }
    result
}

/// Writes each payload followed by a newline with as few `writev`s as the
/// kernel takes, without first copying a page's payloads (megabytes for a
/// page of categories with their products) into one buffer.
fn write_lines(out: &mut impl Write, payloads: &[Bytes]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(payloads.len() * 2);
    for payload in payloads {
        slices.push(IoSlice::new(payload));
        slices.push(IoSlice::new(b"\n"));
    }
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        match out.write_vectored(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut rest, written),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Concatenates the payloads, one per line.
pub(crate) fn json_lines(events: &[Event]) -> Vec<u8> {
    let len = events.iter().map(|e| e.payload.len() + 1).sum();
    let mut buf = Vec::with_capacity(len);
    for event in events {
        buf.extend_from_slice(&event.payload);
        buf.push(b'\n');
    }
    buf
}

#[async_trait]
impl Sink for FileSink {
    fn name(&self) -> &str {
        "file"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Ack> {
        if events.is_empty() {
            return Vec::new();
        }
        let payloads: Vec<Bytes> = events.iter().map(|e| e.payload.clone()).collect();
        let outcome = self
            .with_file("writing", move |file| append_durably(file, &payloads))
            .await;
        vec![outcome; events.len()]
    }

    async fn health(&self) -> Result<(), SinkError> {
        self.with_file("checking", |file| file.metadata().map(|_| ()))
            .await
    }

    async fn flush(&self) -> Result<(), SinkError> {
        self.with_file("syncing", |file| file.sync_all()).await
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

    #[tokio::test]
    async fn every_acknowledged_event_is_one_line_in_the_file_across_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let config = FileSinkConfig {
            path: dir.path().join("nested/dir/events.jsonl"),
        };
        let sink = FileSink::open(&config).unwrap();
        let acks = sink.publish(&[event(1), event(2)]).await;
        assert_eq!(acks, vec![Ok(()), Ok(())]);
        assert!(sink.publish(&[]).await.is_empty());
        sink.flush().await.unwrap();
        drop(sink);
        let sink = FileSink::open(&config).unwrap();
        assert_eq!(sink.publish(&[event(3)]).await, vec![Ok(())]);
        sink.health().await.unwrap();
        let text = std::fs::read_to_string(&config.path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        for (line, n) in lines.iter().zip([1, 2, 3]) {
            let value: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(value["data"]["id"], n);
        }
        assert!(text.ends_with('\n'));
    }

    /// Accepts at most `step` bytes per call, as a kernel may.
    struct Trickle {
        bytes: Vec<u8>,
        step: usize,
    }

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = buf.len().min(self.step);
            self.bytes.extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_written_in_short_writes_are_the_payloads_each_followed_by_a_newline() {
        let events = [event(1), event(2), event(3)];
        let payloads: Vec<Bytes> = events.iter().map(|e| e.payload.clone()).collect();
        for step in [1, 7, 4096] {
            let mut out = Trickle {
                bytes: Vec::new(),
                step,
            };
            write_lines(&mut out, &payloads).unwrap();
            assert_eq!(out.bytes, json_lines(&events), "step {step}");
        }
    }

    #[test]
    fn a_file_that_cannot_be_opened_gives_one_line_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("not-a-dir");
        std::fs::write(&blocker, b"x").unwrap();
        let config = FileSinkConfig {
            path: blocker.join("events.jsonl"),
        };
        let err = FileSink::open(&config).unwrap_err();
        assert!(!err.is_retriable());
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "file sink: cannot create the directory of {}: ",
                config.path.display()
            )),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_failed_write_is_retriable_and_names_the_file() {
        // /dev/full accepts the open but fails every write with ENOSPC.
        if !Path::new("/dev/full").exists() {
            return;
        }
        let sink = FileSink::open(&FileSinkConfig {
            path: PathBuf::from("/dev/full"),
        })
        .unwrap();
        let acks = sink.publish(&[event(1), event(2)]).await;
        assert_eq!(acks.len(), 2);
        for ack in acks {
            let err = ack.unwrap_err();
            assert!(err.is_retriable());
            assert!(
                err.to_string()
                    .starts_with("file sink: writing /dev/full: "),
                "{err}"
            );
        }
    }

    #[test]
    fn config_defaults_and_rejects_unknown_keys() {
        let config: FileSinkConfig = toml::from_str("").unwrap();
        assert_eq!(config, FileSinkConfig::default());
        assert_eq!(config.path, PathBuf::from("./data/events.jsonl"));
        let err = toml::from_str::<FileSinkConfig>("pth = \"x\"").unwrap_err();
        assert!(err.to_string().contains("unknown field `pth`"), "{err}");
    }
}
