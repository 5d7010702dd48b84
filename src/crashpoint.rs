//! Named crash points: places in the sweep and the store where a test can make
//! the real process die as abruptly as `kill -9` does.
//!
//! Random kills find the dangerous windows (intents written but not yet on
//! disk, events acknowledged but not yet committed) only by luck; a crash
//! point makes each of them reachable on purpose. They exist only in builds
//! with the `crash-points` cargo feature (the test suite's); in every other
//! build [`hit`] and [`hit_durable`] are empty inline functions and
//! [`durable_commits`] is always false.
//!
//! Arming: `VCDC_CRASH_POINT=<name>` aborts the process the first time the
//! point is reached, `VCDC_CRASH_POINT=<name>@<n>` the n-th time. Just before
//! aborting, one line `voucher-cdc: crash point <name> reached (hit <n>); aborting`
//! goes to stderr so a test can tell the point was reached. The environment
//! variable lies outside the `VOUCHER_CDC_` prefix, which belongs to the config.
//!
//! The sweep's points fire at their worst moment: everything the store has
//! accepted (staged commits included) is written and synced first, as sled's
//! background flush may have done just before a real crash. A commit made
//! too early is then on disk when the process dies, and the crash tests see
//! the change it loses. For random kills, `VCDC_DURABLE_COMMITS=1` makes
//! every commit durable before it returns, with the same effect.

/// The environment variable that arms a crash point.
pub const ENV: &str = "VCDC_CRASH_POINT";

/// The environment variable that makes every commit durable before it
/// returns (see [`durable_commits`]); ignored without crash points.
pub const DURABLE_COMMITS_ENV: &str = "VCDC_DURABLE_COMMITS";

/// Every crash point, in the order a sweep reaches them.
pub mod names {
    /// A page's intents are written and made durable; nothing of the page was published.
    pub const AFTER_INTENTS: &str = "sweep.after-intents";
    /// A publish chunk of a page's events, or a chunk of deletes, is about to
    /// be handed to the sink; none of its events is published (a page's
    /// earlier chunks may be). Nothing of the page or chunk may be committed.
    pub const BEFORE_PUBLISH: &str = "sweep.before-publish";
    /// Every event of a page is acknowledged by the sink; nothing of the page is committed.
    pub const AFTER_PUBLISH: &str = "sweep.after-publish";
    /// A page's hashes are committed (written and synced when the point fires,
    /// see the module doc); the next page is not requested.
    pub const AFTER_COMMIT: &str = "sweep.after-commit";
    /// The next page's intents are durable while an earlier page's commit is
    /// still staged (not written): every event of that page is acknowledged.
    pub const INTENTS_BEFORE_STAGED_COMMIT: &str = "store.intents-before-staged-commit";
    /// Staged commits too large for one sled batch are being written: the
    /// first batch of record buckets is in the log, the rest and the journal
    /// removals are not.
    pub const BETWEEN_SETTLE_BATCHES: &str = "store.between-settle-batches";
    /// A full sweep's delete intents are written and durable; no delete was published.
    pub const AFTER_DELETE_INTENTS: &str = "sweep.after-delete-intents";
    /// Every delete of a chunk is acknowledged; the deletes are not committed.
    pub const AFTER_DELETE_PUBLISH: &str = "sweep.after-delete-publish";
    /// A chunk of deletes is committed (synced when the point fires).
    pub const AFTER_DELETE_COMMIT: &str = "sweep.after-delete-commit";
    /// Every crash point, for tests that arm each in turn.
    pub const ALL: [&str; 9] = [
        AFTER_INTENTS,
        BEFORE_PUBLISH,
        AFTER_PUBLISH,
        AFTER_COMMIT,
        INTENTS_BEFORE_STAGED_COMMIT,
        BETWEEN_SETTLE_BATCHES,
        AFTER_DELETE_INTENTS,
        AFTER_DELETE_PUBLISH,
        AFTER_DELETE_COMMIT,
    ];
}

/// True when this build has crash points compiled in.
pub const ENABLED: bool = cfg!(feature = "crash-points");

/// Reaches the crash point `name`: aborts the process when it is armed.
#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub fn hit(_name: &'static str) {}

/// Reaches the crash point `name` at its worst: when it fires,
/// `make_durable` runs first, then the process aborts (see the crash-points
/// build's version). Unarmed, `make_durable` never runs.
#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub fn hit_durable(_name: &'static str, _make_durable: impl FnOnce() -> Result<(), String>) {}

/// True when every commit must be written and synced before it returns
/// ([`DURABLE_COMMITS_ENV`]); always false without crash points.
#[cfg(not(feature = "crash-points"))]
#[inline(always)]
pub fn durable_commits() -> bool {
    false
}

/// The armed point and the hit that fires it, read once from [`ENV`].
#[cfg(feature = "crash-points")]
fn armed() -> Option<&'static (String, u64)> {
    use std::sync::OnceLock;

    static ARMED: OnceLock<Option<(String, u64)>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let value = std::env::var(ENV).ok()?;
            let armed = parse_armed(&value);
            if armed.is_none() {
                // Loud and unarmed: a test waiting for the crash fails.
                eprintln!("voucher-cdc: {ENV}: `{value}` is not `<name>` or `<name>@<hit>` (hit 1 or more); no crash point armed");
            }
            armed
        })
        .as_ref()
}

/// Reads `<name>` (the first hit) or `<name>@<n>` (the n-th, 1 or more).
#[cfg_attr(not(feature = "crash-points"), allow(dead_code))]
fn parse_armed(value: &str) -> Option<(String, u64)> {
    let (point, nth) = match value.split_once('@') {
        Some((point, n)) => (point, n.parse::<u64>().ok().filter(|n| *n >= 1)?),
        None => (value, 1),
    };
    (!point.is_empty()).then(|| (point.to_string(), nth))
}

/// Times the armed point was reached.
#[cfg(feature = "crash-points")]
static HITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Reaches the crash point `name`: aborts the process when it is armed.
#[cfg(feature = "crash-points")]
pub fn hit(name: &'static str) {
    hit_durable(name, || Ok(()));
}

/// Reaches the crash point `name` at its worst: when it fires,
/// `make_durable` runs first (the store writes and syncs everything it has
/// accepted, as its background flush may have done just before a real
/// crash), then the process aborts. Unarmed, `make_durable` never runs.
/// When it fails the process exits with code 3 instead of aborting, so a
/// test that waits for the crash sees that the point's moment was not made.
#[cfg(feature = "crash-points")]
pub fn hit_durable(name: &'static str, make_durable: impl FnOnce() -> Result<(), String>) {
    use std::sync::atomic::Ordering;

    let Some((point, nth)) = armed() else {
        return;
    };
    if point != name {
        return;
    }
    // One count decides, even when several streams reach the point at once.
    let hits = HITS.fetch_add(1, Ordering::SeqCst) + 1;
    if hits != *nth {
        return;
    }
    if let Err(e) = make_durable() {
        eprintln!("voucher-cdc: crash point {name} reached (hit {hits}) but the store could not be made durable: {e}; exiting instead");
        std::process::exit(3);
    }
    eprintln!("voucher-cdc: crash point {name} reached (hit {hits}); aborting");
    std::process::abort();
}

/// True when every commit must be written and synced before it returns
/// ([`DURABLE_COMMITS_ENV`] set to `1`): a kill at any moment then finds on
/// disk every commit the store accepted, which a commit made too early turns
/// into a loss the end-state check sees.
#[cfg(feature = "crash-points")]
pub fn durable_commits() -> bool {
    use std::sync::OnceLock;

    static DURABLE: OnceLock<bool> = OnceLock::new();
    *DURABLE.get_or_init(|| match std::env::var(DURABLE_COMMITS_ENV) {
        Ok(value) if value == "1" => true,
        Ok(value) => {
            eprintln!("voucher-cdc: {DURABLE_COMMITS_ENV}: `{value}` is not `1`; commits are staged as usual");
            false
        }
        Err(_) => false,
    })
}

#[cfg(test)]
mod tests {
    use super::parse_armed;

    #[test]
    fn an_armed_point_is_a_name_with_an_optional_hit_of_one_or_more() {
        assert_eq!(
            parse_armed("sweep.after-intents"),
            Some(("sweep.after-intents".into(), 1))
        );
        assert_eq!(
            parse_armed("sweep.after-intents@3"),
            Some(("sweep.after-intents".into(), 3))
        );
        for bad in [
            "sweep.after-intents@",
            "sweep.after-intents@0",
            "sweep.after-intents@x",
            "",
            "@2",
        ] {
            assert_eq!(parse_armed(bad), None, "{bad:?}");
        }
    }
}
