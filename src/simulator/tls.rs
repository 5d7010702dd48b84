//! The simulator's optional TLS listener, so the bridge's HTTPS path (a
//! private CA in `upstream.ca_file`, a refused or expired certificate) is
//! tested against a real handshake rather than assumed.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// The server certificate chain and private key the simulator presents, in PEM.
#[derive(Clone)]
pub struct TlsIdentity {
    /// The certificate chain, leaf first.
    pub cert_pem: String,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub key_pem: String,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsIdentity")
            .field("cert_pem", &format_args!("{} bytes", self.cert_pem.len()))
            .field("key_pem", &"***")
            .finish()
    }
}

impl TlsIdentity {
    /// Reads the certificate chain and the key from PEM files (`--tls-cert`, `--tls-key`).
    pub fn from_files(cert: &Path, key: &Path) -> anyhow::Result<Self> {
        let read = |path: &Path| {
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the tls file {}", path.display()))
        };
        Ok(Self {
            cert_pem: read(cert)?,
            key_pem: read(key)?,
        })
    }

    /// The acceptor serving this identity over TLS 1.2 and 1.3, HTTP/1.1 only.
    pub fn acceptor(&self) -> anyhow::Result<TlsAcceptor> {
        let certs = CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .context("the tls certificate is not valid PEM")?;
        if certs.is_empty() {
            anyhow::bail!("the tls certificate file holds no PEM certificate");
        }
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .context("the tls key file holds no usable PEM private key")?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("choosing tls protocol versions")?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .context("the tls key does not fit the certificate")?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsAcceptor::from(Arc::new(config)))
    }
}
