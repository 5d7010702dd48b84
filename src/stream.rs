//! Names shared by every layer: a tenant, a catalog resource, and the stream
//! (tenant, resource) that the bridge keeps one watermark for.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Tenant identifier as used in the upstream path `/tenants/{tenant}`.
pub type TenantId = u64;

/// A catalog resource the bridge can stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resource {
    /// Catalog vouchers (`/catalog/vouchers`).
    Vouchers,
    /// Catalog categories (`/catalog/categories`).
    Categories,
}

impl Resource {
    /// Every resource, in a stable order.
    pub const ALL: [Resource; 2] = [Resource::Vouchers, Resource::Categories];

    /// Plural name used in paths, config and topics (`vouchers`).
    pub fn as_str(self) -> &'static str {
        match self {
            Resource::Vouchers => "vouchers",
            Resource::Categories => "categories",
        }
    }

    /// Singular name used in event types and partition keys (`voucher`).
    pub fn singular(self) -> &'static str {
        match self {
            Resource::Vouchers => "voucher",
            Resource::Categories => "category",
        }
    }

    /// One byte used as the resource tag in binary state keys.
    pub fn tag(self) -> u8 {
        match self {
            Resource::Vouchers => b'v',
            Resource::Categories => b'c',
        }
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error for a resource name that is not one of the valid options.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown resource `{0}`: valid options are vouchers, categories")]
pub struct UnknownResource(pub String);

impl FromStr for Resource {
    type Err = UnknownResource;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vouchers" | "voucher" => Ok(Resource::Vouchers),
            "categories" | "category" => Ok(Resource::Categories),
            other => Err(UnknownResource(other.to_string())),
        }
    }
}

/// One change stream: a (tenant, resource) pair with its own watermark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StreamKey {
    /// The tenant.
    pub tenant: TenantId,
    /// The resource.
    pub resource: Resource,
}

impl StreamKey {
    /// Builds a stream key.
    pub fn new(tenant: TenantId, resource: Resource) -> Self {
        Self { tenant, resource }
    }
}

impl fmt::Display for StreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.tenant, self.resource)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_names_round_trip_and_unknown_names_list_the_options() {
        for r in Resource::ALL {
            assert_eq!(r.as_str().parse::<Resource>(), Ok(r));
            assert_eq!(r.singular().parse::<Resource>(), Ok(r));
        }
        let err = "products".parse::<Resource>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown resource `products`: valid options are vouchers, categories"
        );
    }
}
