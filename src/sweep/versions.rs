//! `events.changed_fields` and `events.before`: what a page's events say
//! about the previous version of their records, and what its commit keeps of
//! the new one.
//!
//! The previous version is read from the state (per-field hashes, the
//! compressed body), never fetched or guessed: it is used only when it is
//! exactly the version the event's `previoushash` names, so a record whose
//! previous version the store does not hold (committed before the option was
//! on, or only journalled when a crash or an unacknowledged page interrupted
//! it) gets no `changedfields` / `before` rather than a wrong one. The new
//! version is kept only through the page's acknowledged commit. Both are
//! derived from state that changes only at that commit, so a change
//! re-published after a crash carries the same attributes (and, since neither
//! is an input of it, the same id).

use super::{Doomed, PendingChange, SweepError, SweepSettings};
use crate::event::{Op, VersionAttributes};
use crate::hash::{changed_fields, content_hash_with_fields, encode_field_list, FieldHashes};
use crate::state::{StateStore, StoredVersion};
use crate::stream::StreamKey;

/// The version attributes of a page's events and the versions its commit stores.
#[derive(Debug, Default)]
pub(super) struct PageVersions {
    /// Per change, in page order: `changedfields` and `before`.
    attributes: Vec<(Option<String>, Option<String>)>,
    /// The new versions, stored by the page's commit.
    pub(super) stored: Vec<(i64, StoredVersion)>,
}

impl PageVersions {
    /// The attributes of the event of change number `index` (none when off).
    pub(super) fn attributes(&self, index: usize) -> VersionAttributes<'_> {
        match self.attributes.get(index) {
            Some((changed, before)) => VersionAttributes {
                changed_fields: changed.as_deref(),
                before: before.as_deref(),
            },
            None => VersionAttributes::default(),
        }
    }
}

/// Computes the version attributes of `changes` and the versions to store;
/// nothing (no read, no hashing) when both options are off.
pub(super) fn page_versions(
    settings: &SweepSettings,
    store: &dyn StateStore,
    stream: StreamKey,
    changes: &[PendingChange<'_>],
) -> Result<PageVersions, SweepError> {
    if !settings.changed_fields && !settings.before {
        return Ok(PageVersions::default());
    }
    let mut stored = Vec::with_capacity(changes.len());
    for change in changes {
        let record = change.record;
        let fields = if settings.changed_fields {
            let (hash, fields) = content_hash_with_fields(record.raw.get(), &settings.ignore_keys)
                .map_err(|source| SweepError::Hash {
                    record_id: record.id,
                    source,
                })?;
            // The same canonical form as the page's content hash: never differs.
            fields.filter(|_| hash == change.hash)
        } else {
            None
        };
        let body = settings.before.then(|| record.raw.get().to_string());
        stored.push((
            record.id,
            StoredVersion {
                hash: change.hash,
                fields,
                body,
            },
        ));
    }
    let updates: Vec<usize> = (0..changes.len())
        .filter(|&i| changes[i].change.op == Op::Update && changes[i].change.previous.is_some())
        .collect();
    let mut attributes = vec![(None, None); changes.len()];
    if !updates.is_empty() {
        let ids: Vec<i64> = updates.iter().map(|&i| changes[i].record.id).collect();
        let previous = store.get_versions(stream, &ids)?;
        for (&i, previous) in updates.iter().zip(previous) {
            let Some(previous) = previous.filter(|p| Some(p.hash) == changes[i].change.previous)
            else {
                continue;
            };
            attributes[i] = version_attributes(settings, &previous, stored[i].1.fields.as_ref());
        }
    }
    Ok(PageVersions { attributes, stored })
}

/// `changedfields` (both field sets known) and `before` (the body known) of an
/// update from `previous` to a version with `fields`.
fn version_attributes(
    settings: &SweepSettings,
    previous: &StoredVersion,
    fields: Option<&FieldHashes>,
) -> (Option<String>, Option<String>) {
    let changed = match (&previous.fields, fields) {
        (Some(before), Some(after)) if settings.changed_fields => {
            Some(encode_field_list(&changed_fields(before, after)))
        }
        _ => None,
    };
    let before = previous.body.clone().filter(|_| settings.before);
    (changed, before)
}

/// The `before` of each delete in `gone` (None when off or not stored).
pub(super) fn delete_befores(
    settings: &SweepSettings,
    store: &dyn StateStore,
    stream: StreamKey,
    gone: &[&Doomed],
) -> Result<Vec<Option<String>>, SweepError> {
    if !settings.before {
        return Ok(vec![None; gone.len()]);
    }
    let ids: Vec<i64> = gone.iter().map(|d| d.id).collect();
    let stored = store.get_versions(stream, &ids)?;
    Ok(gone
        .iter()
        .zip(stored)
        .map(|(d, v)| v.filter(|v| v.hash == d.last_hash()).and_then(|v| v.body))
        .collect())
}
