//! Append-only JSON-lines journals (`--change-log`, `--request-log`).
//!
//! They exist so a benchmark can follow, while the simulator runs, what
//! changed upstream and which requests the bridge spent: every line is
//! written with one unbuffered `write` (bounded work, visible at once to a
//! reader tailing the file).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use anyhow::Context;
use chrono::{DateTime, Utc};

/// One JSON-lines file, appended to by many tasks.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: Mutex<File>,
    warned: AtomicBool,
}

impl Journal {
    /// Opens (creating, appending to) the file at `path`.
    pub fn open(path: &Path) -> anyhow::Result<Journal> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening journal {}", path.display()))?;
        Ok(Journal {
            path: path.to_path_buf(),
            file: Mutex::new(file),
            warned: AtomicBool::new(false),
        })
    }

    /// Appends `record` as one line; a write failure is logged once and otherwise ignored
    /// (a journal never fails the request or change it describes).
    pub fn append(&self, record: &serde_json::Value) {
        let mut line = record.to_string();
        line.push('\n');
        let written = match self.file.lock() {
            Ok(mut file) => file.write_all(line.as_bytes()),
            Err(poisoned) => poisoned.into_inner().write_all(line.as_bytes()),
        };
        if let Err(error) = written {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(path = %self.path.display(), %error, "cannot write to the journal; further failures are not logged");
            }
        }
    }
}

/// The journals' timestamp format: RFC 3339 UTC with microseconds and `Z`.
pub fn timestamp(at: DateTime<Utc>) -> String {
    super::model::ts::format(&at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_append_is_one_complete_line_readable_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.jsonl");
        let journal = Journal::open(&path).unwrap();
        journal.append(&serde_json::json!({"a": 1}));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"a\":1}\n");
        journal.append(&serde_json::json!({"b": "x"}));
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"a\":1}\n{\"b\":\"x\"}\n"
        );
    }
}
