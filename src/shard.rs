//! Splits the configured tenants across several bridge replicas, so a
//! Kubernetes StatefulSet can scale past one pod without two pods polling
//! (and publishing) the same tenant.
//!
//! Every replica reads the same tenant list and keeps the tenants whose
//! [`owner`] is its own shard index. The owner is a jump consistent hash
//! (Lamping & Veach, 2014) of a stable 64-bit hash of the tenant id, so
//! growing from `n` to `n + 1` shards moves only about `1 / (n + 1)` of the
//! tenants, all of them to the new shard; shrinking moves only the tenants of
//! the removed shard. The mapping is a persistent format: it must never change
//! between releases or platforms, which is why it uses blake3 and integer
//! arithmetic rather than std's `DefaultHasher` or floating point.
//!
//! Everything here is pure except [`ShardConfig::resolve`], which reads the
//! host name when `index = "hostname"`.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::stream::TenantId;

/// Domain separator of the tenant hash; part of the persistent mapping.
const TENANT_HASH_DOMAIN: &[u8] = b"voucher-cdc/shard/v1";

/// Errors of the `[shard]` config section, each naming the key at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    /// `shard.count` is zero.
    #[error("shard.count must be at least 1, got 0")]
    ZeroCount,
    /// A numeric `shard.index` is not below `shard.count`.
    #[error("shard.index {index} is out of range for shard.count {count}: valid indexes are 0..={max}", max = count - 1)]
    IndexOutOfRange {
        /// The configured index.
        index: u32,
        /// The configured count.
        count: u32,
    },
    /// `shard.index = "hostname"` but the host name has no trailing `-<ordinal>`.
    #[error("shard.index = \"hostname\": hostname `{hostname}` has no trailing -<ordinal> (expected a StatefulSet pod name such as voucher-cdc-0)")]
    NoOrdinal {
        /// The host name that was read.
        hostname: String,
    },
    /// `shard.index = "hostname"` but the ordinal is not below `shard.count`.
    #[error("shard.index = \"hostname\": ordinal {ordinal} of hostname `{hostname}` is out of range for shard.count {count}: set shard.count to the number of replicas")]
    OrdinalOutOfRange {
        /// The host name that was read.
        hostname: String,
        /// The ordinal parsed from it.
        ordinal: u32,
        /// The configured count.
        count: u32,
    },
    /// `shard.index = "hostname"` but no host name could be read.
    #[error("shard.index = \"hostname\": the hostname is unknown ($HOSTNAME is unset and /proc/sys/kernel/hostname and /etc/hostname are unreadable)")]
    HostnameUnknown,
}

/// Which shard this replica is: a number, or `"hostname"` to take the
/// trailing `-<ordinal>` of the pod's host name (StatefulSet pods are named
/// `<statefulset>-0`, `<statefulset>-1`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardIndex {
    /// A fixed shard index (`index = 2`).
    Number(u32),
    /// The ordinal at the end of the host name (`index = "hostname"`).
    Hostname,
}

impl Serialize for ShardIndex {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ShardIndex::Number(n) => serializer.serialize_u32(*n),
            ShardIndex::Hostname => serializer.serialize_str("hostname"),
        }
    }
}

impl<'de> Deserialize<'de> for ShardIndex {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ShardIndexVisitor)
    }
}

/// Accepts a non-negative integer, the string `"hostname"`, or a decimal
/// string (environment variables arrive as strings in some config layers).
struct ShardIndexVisitor;

impl Visitor<'_> for ShardIndexVisitor {
    type Value = ShardIndex;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a shard number (0, 1, ...) or \"hostname\"")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<ShardIndex, E> {
        u32::try_from(v)
            .map(ShardIndex::Number)
            .map_err(|_| E::custom(format_args!("shard index {v} is too large")))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<ShardIndex, E> {
        u64::try_from(v)
            .map_err(|_| E::custom(format_args!("shard index {v} is negative")))
            .and_then(|v| self.visit_u64(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<ShardIndex, E> {
        if v == "hostname" {
            return Ok(ShardIndex::Hostname);
        }
        v.parse::<u32>().map(ShardIndex::Number).map_err(|_| {
            E::custom(format_args!(
                "unknown shard index `{v}`: valid options are a shard number (0, 1, ...) or \"hostname\""
            ))
        })
    }
}

/// The `[shard]` config section: how many replicas split the tenants, and
/// which one this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardConfig {
    /// Number of replicas sharing the tenant list (default 1: this replica owns every tenant).
    #[serde(default = "default_count")]
    pub count: u32,
    /// This replica's shard (default 0); `"hostname"` reads the StatefulSet ordinal.
    #[serde(default = "default_index")]
    pub index: ShardIndex,
}

/// Default `shard.count`: a single replica.
fn default_count() -> u32 {
    1
}

/// Default `shard.index`: shard 0.
fn default_index() -> ShardIndex {
    ShardIndex::Number(0)
}

impl Default for ShardConfig {
    fn default() -> Self {
        Self {
            count: default_count(),
            index: default_index(),
        }
    }
}

impl ShardConfig {
    /// Checks what can be checked without the host name (for `check-config`).
    pub fn validate(&self) -> Result<(), ShardError> {
        if self.count == 0 {
            return Err(ShardError::ZeroCount);
        }
        match self.index {
            ShardIndex::Number(index) if index >= self.count => Err(ShardError::IndexOutOfRange {
                index,
                count: self.count,
            }),
            _ => Ok(()),
        }
    }

    /// Resolves the index against the host name given (pure; `None` = unknown).
    pub fn resolve_with_hostname(&self, hostname: Option<&str>) -> Result<Shard, ShardError> {
        self.validate()?;
        let index = match self.index {
            ShardIndex::Number(index) => index,
            ShardIndex::Hostname => {
                let hostname = hostname.ok_or(ShardError::HostnameUnknown)?;
                let ordinal = ordinal_from_hostname(hostname)?;
                if ordinal >= self.count {
                    return Err(ShardError::OrdinalOutOfRange {
                        hostname: hostname.to_string(),
                        ordinal,
                        count: self.count,
                    });
                }
                ordinal
            }
        };
        Ok(Shard {
            index,
            count: self.count,
        })
    }

    /// Resolves the index, reading the host name only when `index = "hostname"`.
    pub fn resolve(&self) -> Result<Shard, ShardError> {
        match self.index {
            ShardIndex::Number(_) => self.resolve_with_hostname(None),
            ShardIndex::Hostname => self.resolve_with_hostname(read_hostname().as_deref()),
        }
    }
}

/// Reads the host name: `$HOSTNAME`, else the kernel's, else `/etc/hostname`.
fn read_hostname() -> Option<String> {
    let from_env = std::env::var("HOSTNAME").ok();
    let candidates = from_env.into_iter().chain(
        ["/proc/sys/kernel/hostname", "/etc/hostname"]
            .iter()
            .filter_map(|path| std::fs::read_to_string(path).ok()),
    );
    candidates
        .map(|name| name.trim().to_string())
        .find(|name| !name.is_empty())
}

/// Parses the StatefulSet ordinal at the end of a host name:
/// `voucher-cdc-3` -> 3; a fully qualified `voucher-cdc-3.voucher-cdc.ns.svc` -> 3.
pub fn ordinal_from_hostname(hostname: &str) -> Result<u32, ShardError> {
    let no_ordinal = || ShardError::NoOrdinal {
        hostname: hostname.to_string(),
    };
    let short = hostname.split('.').next().unwrap_or(hostname);
    let (_, digits) = short.rsplit_once('-').ok_or_else(no_ordinal)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(no_ordinal());
    }
    digits.parse::<u32>().map_err(|_| no_ordinal())
}

/// A resolved shard: this replica's index and the replica count (`index < count`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    index: u32,
    count: u32,
}

impl Shard {
    /// The shard of a single replica, which owns every tenant.
    pub fn single() -> Self {
        Self { index: 0, count: 1 }
    }

    /// Builds a shard, checking `count >= 1` and `index < count`.
    pub fn new(index: u32, count: u32) -> Result<Self, ShardError> {
        ShardConfig {
            count,
            index: ShardIndex::Number(index),
        }
        .resolve_with_hostname(None)
    }

    /// This replica's shard index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The number of replicas.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// True when this replica polls and publishes `tenant`.
    pub fn owns(&self, tenant: TenantId) -> bool {
        owner(tenant, self.count) == self.index
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// The shard (in `0..count`) that owns `tenant`; a `count` of 0 is treated as 1.
pub fn owner(tenant: TenantId, count: u32) -> u32 {
    jump_consistent_hash(tenant_hash(tenant), count.max(1))
}

/// A stable, well-mixed 64-bit hash of a tenant id (blake3, little-endian).
pub fn tenant_hash(tenant: TenantId) -> u64 {
    let mut hasher = blake3::Hasher::new();
    hasher.update(TENANT_HASH_DOMAIN);
    hasher.update(&tenant.to_le_bytes());
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// Jump consistent hash (Lamping & Veach, "A Fast, Minimal Memory, Consistent
/// Hash Algorithm", 2014) in exact integer arithmetic; `buckets` must be >= 1.
pub fn jump_consistent_hash(mut key: u64, buckets: u32) -> u32 {
    let buckets = u64::from(buckets.max(1));
    let mut bucket: u64 = 0;
    let mut next: u64 = 0;
    while next < buckets {
        bucket = next;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        // (bucket + 1) <= 2^32 and 2^31 fit u64 when multiplied; the divisor is >= 1.
        next = ((bucket + 1) << 31) / ((key >> 33) + 1);
    }
    // bucket < buckets <= u32::MAX + 1 and bucket is the last value below buckets.
    u32::try_from(bucket).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        #[serde(default)]
        shard: ShardConfig,
    }

    fn parse(toml_text: &str) -> Result<ShardConfig, String> {
        toml::from_str::<Doc>(toml_text)
            .map(|doc| doc.shard)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn missing_section_means_one_shard_that_owns_everything() {
        let config = parse("").unwrap();
        assert_eq!(config, ShardConfig::default());
        let shard = config.resolve().unwrap();
        assert_eq!(shard, Shard::single());
        assert!((0..1000).all(|t| shard.owns(t)));
    }

    #[test]
    fn index_accepts_a_number_or_hostname_and_rejects_anything_else() {
        let numbered = parse("[shard]\ncount = 3\nindex = 2\n").unwrap();
        assert_eq!(numbered.index, ShardIndex::Number(2));
        let named = parse("[shard]\ncount = 3\nindex = \"hostname\"\n").unwrap();
        assert_eq!(named.index, ShardIndex::Hostname);
        let from_env_string = parse("[shard]\ncount = 3\nindex = \"1\"\n").unwrap();
        assert_eq!(from_env_string.index, ShardIndex::Number(1));

        let err = parse("[shard]\ncount = 3\nindex = \"pod\"\n").unwrap_err();
        assert!(err.contains("unknown shard index `pod`"), "{err}");
        assert!(err.contains("\"hostname\""), "{err}");
        let err = parse("[shard]\ncount = 3\nindex = -1\n").unwrap_err();
        assert!(err.contains("negative"), "{err}");
        let err = parse("[shard]\ncount = 3\nordinal = 1\n").unwrap_err();
        assert!(err.contains("ordinal"), "{err}");
    }

    #[test]
    fn index_serializes_back_to_the_form_it_was_written_in() {
        let text = toml::to_string(&ShardConfig {
            count: 4,
            index: ShardIndex::Hostname,
        })
        .unwrap();
        assert!(text.contains("index = \"hostname\""), "{text}");
        let text = toml::to_string(&ShardConfig {
            count: 4,
            index: ShardIndex::Number(3),
        })
        .unwrap();
        assert!(text.contains("index = 3"), "{text}");
    }

    #[test]
    fn validation_errors_name_the_key_and_the_valid_range() {
        let zero = ShardConfig {
            count: 0,
            index: ShardIndex::Number(0),
        };
        assert_eq!(
            zero.validate().unwrap_err().to_string(),
            "shard.count must be at least 1, got 0"
        );
        let out_of_range = ShardConfig {
            count: 3,
            index: ShardIndex::Number(3),
        };
        assert_eq!(
            out_of_range.validate().unwrap_err().to_string(),
            "shard.index 3 is out of range for shard.count 3: valid indexes are 0..=2"
        );
        assert!(Shard::new(2, 3).is_ok());
        assert_eq!(Shard::new(0, 0), Err(ShardError::ZeroCount));
    }

    #[test]
    fn hostname_index_uses_the_statefulset_ordinal_and_checks_it_against_count() {
        let config = ShardConfig {
            count: 4,
            index: ShardIndex::Hostname,
        };
        let shard = config.resolve_with_hostname(Some("voucher-cdc-3")).unwrap();
        assert_eq!((shard.index(), shard.count()), (3, 4));

        let err = config
            .resolve_with_hostname(Some("voucher-cdc-4"))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "shard.index = \"hostname\": ordinal 4 of hostname `voucher-cdc-4` is out of range for shard.count 4: set shard.count to the number of replicas"
        );
        let err = config.resolve_with_hostname(Some("laptop")).unwrap_err();
        assert!(err.to_string().contains("hostname `laptop`"), "{err}");
        assert_eq!(
            config.resolve_with_hostname(None),
            Err(ShardError::HostnameUnknown)
        );
    }

    #[test]
    fn jump_hash_matches_the_reference_implementation() {
        // The paper's floating-point form is the oracle; the exact integer form
        // must agree with it (they could differ only when a quotient is within
        // one rounding step of an integer).
        assert_eq!(jump_consistent_hash(0, 1), 0);
        assert_eq!(jump_consistent_hash(u64::MAX, 1), 0);
        for key in [1u64, 42, 0xdead_beef, u64::MAX] {
            for buckets in 1..=64 {
                assert_eq!(
                    jump_consistent_hash(key, buckets),
                    reference_jump(key, buckets),
                    "key {key} buckets {buckets}"
                );
            }
        }
    }

    /// The paper's algorithm verbatim (with `f64`), as an oracle.
    fn reference_jump(mut key: u64, buckets: u32) -> u32 {
        let mut b: i64 = -1;
        let mut j: i64 = 0;
        while j < i64::from(buckets) {
            b = j;
            key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
            j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
        }
        b as u32
    }
}
