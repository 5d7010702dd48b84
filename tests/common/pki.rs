//! Test certificates for the secure-connection tests: a private CA and a
//! server certificate for 127.0.0.1 and localhost it signed, current or
//! already expired, written as PEM files the way platforms mount them.

use std::path::{Path, PathBuf};

/// A CA and a server certificate it signed, as PEM files.
pub struct TestPki {
    /// The CA certificate.
    pub ca: PathBuf,
    /// The server certificate (for 127.0.0.1 and localhost).
    pub cert: PathBuf,
    /// The server certificate's private key.
    pub key: PathBuf,
}

/// A CA named `name` and a current server certificate, written into `dir`.
pub fn pki(dir: &Path, name: &str) -> TestPki {
    generate(dir, name, false)
}

/// Like [`pki`], but the server certificate expired in 2021.
pub fn expired_pki(dir: &Path, name: &str) -> TestPki {
    generate(dir, name, true)
}

fn generate(dir: &Path, name: &str, expired: bool) -> TestPki {
    use rcgen::{date_time_ymd, BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{name} test ca"));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    if expired {
        params.not_before = date_time_ymd(2020, 1, 1);
        params.not_after = date_time_ymd(2021, 1, 1);
    }
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    let write = |file: &str, pem: String| {
        let path = dir.join(format!("{name}-{file}"));
        std::fs::write(&path, pem).unwrap();
        path
    };
    TestPki {
        ca: write("ca.pem", ca.pem()),
        cert: write("cert.pem", cert.pem()),
        key: write("key.pem", key.serialize_pem()),
    }
}
