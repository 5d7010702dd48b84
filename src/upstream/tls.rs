//! Trust for an upstream served over HTTPS with a private CA: reads
//! `upstream.ca_file` once, at config load, into certificates the client adds
//! to its trust roots, and recognises a refused server certificate among
//! transport errors so the stream parks with one clear line instead of
//! retrying a check that cannot pass until an operator acts.

use std::io;
use std::path::{Path, PathBuf};

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::{self, CertificateError, RootCertStore};

/// CA certificates the upstream client trusts in addition to the public roots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustRoots {
    /// The PEM file they were read from, named in messages.
    pub source: PathBuf,
    /// The certificates, DER-encoded, in file order.
    pub certificates: Vec<Vec<u8>>,
}

impl TrustRoots {
    /// Reads every certificate in the PEM file at `path`; the error says why
    /// the file is unusable (missing, unreadable, bad PEM, no certificate).
    pub fn from_pem_file(path: &Path) -> Result<Self, String> {
        let pem = std::fs::read(path)
            .map_err(|e| format!("cannot read {}: {}", path.display(), lowercase_io(&e)))?;
        Self::from_pem(path, &pem)
    }

    /// Reads every certificate in `pem` (named `source` in messages); each must
    /// be an X.509 certificate a trust store accepts, and there must be one.
    pub fn from_pem(source: &Path, pem: &[u8]) -> Result<Self, String> {
        let mut store = RootCertStore::empty();
        let mut certificates = Vec::new();
        for item in CertificateDer::pem_slice_iter(pem) {
            let cert = item.map_err(|e| format!("{} is not valid PEM: {e}", source.display()))?;
            store.add(cert.clone()).map_err(|e| {
                format!(
                    "certificate {} in {} is not a usable CA certificate: {e}",
                    certificates.len() + 1,
                    source.display()
                )
            })?;
            certificates.push(cert.to_vec());
        }
        if certificates.is_empty() {
            return Err(format!(
                "{} holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)",
                source.display()
            ));
        }
        Ok(Self {
            source: source.to_path_buf(),
            certificates,
        })
    }
}

/// The server certificate the client refused, found in a transport error's causes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedCertificate {
    /// Why, as rustls says it (`invalid peer certificate: UnknownIssuer`).
    pub reason: String,
    /// What the operator should check, given the configured roots.
    pub hint: String,
}

/// The refused server certificate behind `err`, if a certificate check is
/// what failed (other TLS and network trouble is not returned: it may pass later).
pub fn refused_certificate(
    err: &(dyn std::error::Error + 'static),
    roots: Option<&TrustRoots>,
) -> Option<RefusedCertificate> {
    let mut cause = Some(err);
    while let Some(current) = cause {
        if let Some(error) = rustls_error(current) {
            return refusal(error, roots);
        }
        cause = current.source();
    }
    None
}

/// The rustls error `err` is, or carries as the payload of (nested) io errors;
/// an io error's `source` skips its payload, so the payload is opened here.
fn rustls_error<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(error) = err.downcast_ref::<rustls::Error>() {
        return Some(error);
    }
    let payload = err.downcast_ref::<io::Error>()?.get_ref()?;
    rustls_error(payload)
}

/// The refusal a rustls error stands for, with the hint that fits it.
fn refusal(error: &rustls::Error, roots: Option<&TrustRoots>) -> Option<RefusedCertificate> {
    let trusted = match roots {
        Some(roots) => format!(
            "upstream.ca_file {} or the public roots",
            roots.source.display()
        ),
        None => "the public roots (no upstream.ca_file is set)".to_string(),
    };
    let hint = match error {
        rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer | CertificateError::BadSignature,
        ) => format!(
            "the server certificate is not signed by a CA in {trusted}: check upstream.ca_file"
        ),
        rustls::Error::InvalidCertificate(
            CertificateError::Expired | CertificateError::ExpiredContext { .. },
        ) => "the server certificate has expired: renew it on the upstream".to_string(),
        rustls::Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => "the server certificate does not name the host of upstream.base_url".to_string(),
        rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented => {
            format!("the server certificate cannot be verified against {trusted}")
        }
        _ => return None,
    };
    Some(RefusedCertificate {
        reason: error.to_string(),
        hint,
    })
}

/// An io error as one lowercase line (`no such file or directory (os error 2)`).
fn lowercase_io(e: &io::Error) -> String {
    let text = e.to_string();
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_without_a_certificate_is_refused_with_its_name() {
        let err = TrustRoots::from_pem(Path::new("/etc/ca.pem"), b"hello\n").unwrap_err();
        assert_eq!(
            err,
            "/etc/ca.pem holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)"
        );
    }

    #[test]
    fn a_certificate_block_that_is_not_a_certificate_is_refused() {
        let pem = b"-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE-----\n";
        let err = TrustRoots::from_pem(Path::new("ca.pem"), pem).unwrap_err();
        assert!(
            err.starts_with("certificate 1 in ca.pem is not a usable CA certificate: "),
            "{err}"
        );
    }

    #[test]
    fn a_missing_file_names_the_path_and_the_cause() {
        let err = TrustRoots::from_pem_file(Path::new("/nonexistent/ca.pem")).unwrap_err();
        assert!(
            err.starts_with("cannot read /nonexistent/ca.pem: no such file"),
            "{err}"
        );
    }

    #[test]
    fn an_unknown_issuer_inside_an_io_error_is_a_refused_certificate() {
        let inner = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let io = io::Error::new(io::ErrorKind::InvalidData, inner);
        let refused = refused_certificate(&io, None).unwrap();
        assert_eq!(refused.reason, "invalid peer certificate: UnknownIssuer");
        assert!(
            refused.hint.contains("check upstream.ca_file"),
            "{}",
            refused.hint
        );
    }

    #[test]
    fn other_tls_trouble_is_not_a_refused_certificate() {
        let io = io::Error::new(
            io::ErrorKind::InvalidData,
            rustls::Error::General("peer closed".into()),
        );
        assert_eq!(refused_certificate(&io, None), None);
        let plain = io::Error::new(io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(refused_certificate(&plain, None), None);
    }
}
