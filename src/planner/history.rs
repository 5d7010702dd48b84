//! What a first sync's `updated_at` values say about a stream's change rate
//! before the bridge started, so the planner does not begin from the
//! population prior alone (docs/planner.md, "Learning the rates").
//!
//! A record's `updated_at` is its last change. If a stream's `n` records
//! each change as a Poisson process at rate `mu`, the age of a record's last
//! change is exponential with mean `1 / mu`; seen over a window `W` before
//! the listing, a record younger than `W` is an observed change after an
//! exposure of its age, and an older one is `W` of exposure without one.
//! The maximum-likelihood rate is `mu = k / sum(min(age, W))` (`k` records
//! younger than `W`), and the stream's rate `n * mu`: `k` changes over an
//! exposure of `sum(min(age, W)) / n` (the last-modified estimator of Cho and
//! Garcia-Molina, "Estimating frequency of change", 2003). A hot stream whose
//! records all changed minutes ago and an idle one untouched for months are
//! told apart at the first sync instead of after an hour of polls.
//!
//! Pure: the sweep adds each listed record, the planner reads the evidence.

use std::time::Duration;

/// How far back a first sync's `updated_at` values count as change history:
/// long enough that a tenant changing a few times an hour is told from one
/// that never changes, short enough to describe the catalog of today.
pub const HISTORY_WINDOW: Duration = Duration::from_secs(6 * 3600);

/// The change history a complete listing shows (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChangeHistory {
    /// Records listed.
    pub records: u64,
    /// Records whose last change is within [`HISTORY_WINDOW`] of the listing.
    pub recent: u64,
    /// Sum over records with an `updated_at` of `min(age, window)`, in microseconds.
    pub exposure_micros: u64,
}

/// Changes seen over an exposure, as the planner's rate estimate takes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evidence {
    /// Changes observed.
    pub changes: f64,
    /// Over this much time of the stream, in seconds.
    pub seconds: f64,
}

impl ChangeHistory {
    /// Adds one listed record whose last change was at `updated_at_micros`
    /// (None: the API gave none), listed at `listed_at_micros`.
    pub fn add(&mut self, updated_at_micros: Option<i64>, listed_at_micros: i64) {
        self.records += 1;
        let Some(updated_at) = updated_at_micros else {
            return;
        };
        let window = HISTORY_WINDOW.as_micros() as i64;
        // A timestamp ahead of the listing's server_time is a change just now.
        let age = listed_at_micros.saturating_sub(updated_at).clamp(0, window);
        if age < window {
            self.recent += 1;
        }
        self.exposure_micros = self.exposure_micros.saturating_add(age as u64);
    }

    /// Adds another part of the same listing (another page).
    pub fn merge(&mut self, other: ChangeHistory) {
        self.records += other.records;
        self.recent += other.recent;
        self.exposure_micros = self.exposure_micros.saturating_add(other.exposure_micros);
    }

    /// The stream's changes and exposure; None when no record had an
    /// `updated_at` (nothing to learn).
    pub fn evidence(&self) -> Option<Evidence> {
        if self.records == 0 || self.exposure_micros == 0 && self.recent == 0 {
            return None;
        }
        // At least a second: every record changed "just now" is still a rate, not a division by zero.
        let seconds = (self.exposure_micros as f64 / 1e6 / self.records as f64).max(1.0);
        Some(Evidence {
            changes: self.recent as f64,
            seconds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: i64 = 3_600_000_000;

    fn history(ages_micros: &[Option<i64>]) -> ChangeHistory {
        let now = 1_000 * HOUR;
        let mut h = ChangeHistory::default();
        for age in ages_micros {
            h.add(age.map(|a| now - a), now);
        }
        h
    }

    #[test]
    fn an_idle_stream_shows_no_change_over_the_whole_window() {
        let h = history(&[Some(500 * HOUR), Some(9 * HOUR), Some(7 * HOUR)]);
        let e = h.evidence().expect("evidence");
        assert_eq!(e.changes, 0.0);
        assert!((e.seconds - HISTORY_WINDOW.as_secs_f64()).abs() < 1e-6);
    }

    #[test]
    fn a_hot_stream_is_its_changes_over_the_mean_age_of_its_records() {
        // Four records changed 1, 2, 3 and 4 minutes ago: about 4 changes in 2.5 minutes.
        let minute = 60_000_000;
        let h = history(&[
            Some(minute),
            Some(2 * minute),
            Some(3 * minute),
            Some(4 * minute),
        ]);
        let e = h.evidence().expect("evidence");
        assert_eq!(e.changes, 4.0);
        assert!((e.seconds - 150.0).abs() < 1e-6, "{}", e.seconds);
        assert!((e.changes / e.seconds - 4.0 / 150.0).abs() < 1e-9);
    }

    #[test]
    fn the_estimate_finds_the_rate_of_poisson_changes() {
        // 2,000 records each changed at rate mu; the age of the last change is exponential.
        let mu_per_hour = 0.05;
        let n = 2_000;
        let mut h = ChangeHistory::default();
        let now = 1_000 * HOUR;
        for i in 0..n {
            // Quantiles of the exponential law, deterministic.
            let u = (i as f64 + 0.5) / n as f64;
            let age_hours = -(1.0 - u).ln() / mu_per_hour;
            h.add(Some(now - (age_hours * HOUR as f64) as i64), now);
        }
        let e = h.evidence().expect("evidence");
        let stream_rate_per_hour = e.changes / e.seconds * 3600.0;
        let expected = mu_per_hour * n as f64;
        assert!(
            (stream_rate_per_hour - expected).abs() < 0.03 * expected,
            "{stream_rate_per_hour} vs {expected}"
        );
    }

    #[test]
    fn records_without_updated_at_count_as_records_but_add_no_exposure() {
        let h = history(&[None, None]);
        assert_eq!(h.evidence(), None);
        let h = history(&[None, Some(HOUR)]);
        let e = h.evidence().expect("evidence");
        assert_eq!(e.changes, 1.0);
        assert!((e.seconds - 1800.0).abs() < 1e-6);
    }

    #[test]
    fn a_future_timestamp_is_a_change_just_now_and_pages_merge() {
        let now = 1_000 * HOUR;
        let mut a = ChangeHistory::default();
        a.add(Some(now + HOUR), now);
        assert_eq!(a.recent, 1);
        assert_eq!(a.exposure_micros, 0);
        let mut b = ChangeHistory::default();
        b.add(Some(now - HOUR), now);
        a.merge(b);
        assert_eq!(
            (a.records, a.recent, a.exposure_micros),
            (2, 2, HOUR as u64)
        );
        assert_eq!(ChangeHistory::default().evidence(), None);
    }
}
