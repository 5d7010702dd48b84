//! A TLS and SASL front for the tansu test broker, which can do neither
//! itself (tansu 0.6.0: see docs/sinks.md, "Kafka security: what is
//! tested"). Each client connection is a real TLS session (rustls, with a
//! certificate from `tests/common/pki.rs`), then, when credentials are
//! configured, a real Kafka SASL exchange the proxy answers itself (PLAIN,
//! SCRAM-SHA-256 or SCRAM-SHA-512 per RFC 5802, checking the password), and
//! then bytes relayed to tansu. tansu advertises the proxy's port, so every
//! connection a client makes, bootstrap and broker alike, goes through it.
//!
//! Include with `#[path = "common/kafka_proxy.rs"] mod kafka_proxy;` beside
//! `mod common;` and the `brokers` module.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use base64::Engine as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::brokers::{spawn_tansu_advertising, TansuBroker};

/// Kafka API keys the proxy looks at.
const API_VERSIONS: i16 = 18;
const SASL_HANDSHAKE: i16 = 17;
const SASL_AUTHENTICATE: i16 = 36;
/// Kafka error codes the proxy answers with.
const UNSUPPORTED_SASL_MECHANISM: i16 = 33;
const SASL_AUTHENTICATION_FAILED: i16 = 58;
/// PBKDF2 iterations of the SCRAM credentials (Kafka's minimum).
const SCRAM_ITERATIONS: u32 = 4096;

/// A SASL mechanism the proxy checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    /// RFC 4616: the password in the clear (inside TLS).
    Plain,
    /// RFC 7677.
    ScramSha256,
    /// RFC 5802 with SHA-512.
    ScramSha512,
}

impl Mechanism {
    /// The name librdkafka's `sasl.mechanism` uses.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Plain => "PLAIN",
            Mechanism::ScramSha256 => "SCRAM-SHA-256",
            Mechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// The one user the proxy accepts.
#[derive(Debug, Clone)]
pub struct SaslUser {
    /// The mechanism it must use.
    pub mechanism: Mechanism,
    /// Its name.
    pub username: String,
    /// Its password.
    pub password: String,
}

/// Counts of what the proxy saw.
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// TLS sessions established.
    pub tls_sessions: AtomicUsize,
    /// TLS handshakes that failed (the client refused the certificate).
    pub tls_failures: AtomicUsize,
    /// SASL exchanges that succeeded.
    pub authenticated: AtomicUsize,
    /// SASL exchanges refused (wrong password, user or mechanism).
    pub refused: AtomicUsize,
}

/// A tansu broker behind a TLS (and optionally SASL) proxy, owned by a test.
pub struct SecureTansu {
    /// The broker; its advertised address is the proxy's.
    pub broker: TansuBroker,
    port: u16,
    /// What the proxy saw.
    pub stats: Arc<ProxyStats>,
    accept: tokio::task::JoinHandle<()>,
}

impl SecureTansu {
    /// The bootstrap address clients use (the proxy's).
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for SecureTansu {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Starts tansu behind a proxy that serves TLS with `cert`/`key` (PEM) and,
/// with `sasl`, demands that user; `None` when tansu is missing outside CI.
pub async fn secure_tansu(cert: &Path, key: &Path, sasl: Option<SaslUser>) -> Option<SecureTansu> {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let broker = spawn_tansu_advertising(Some(port))?;
    let upstream = broker.port();
    let acceptor = acceptor(cert, key);
    let stats = Arc::new(ProxyStats::default());
    let sasl = sasl.map(Arc::new);
    let accept = {
        let stats = stats.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(serve(
                    client,
                    upstream,
                    acceptor.clone(),
                    sasl.clone(),
                    stats.clone(),
                ));
            }
        })
    };
    Some(SecureTansu {
        broker,
        port,
        stats,
        accept,
    })
}

fn acceptor(cert: &Path, key: &Path) -> TlsAcceptor {
    let certs = CertificateDer::pem_file_iter(cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(key).unwrap();
    let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    TlsAcceptor::from(Arc::new(config))
}

/// One client connection: TLS, SASL when demanded, then a byte relay.
async fn serve(
    client: TcpStream,
    upstream: u16,
    acceptor: TlsAcceptor,
    sasl: Option<Arc<SaslUser>>,
    stats: Arc<ProxyStats>,
) {
    let mut client = match acceptor.accept(client).await {
        Ok(tls) => tls,
        Err(_) => {
            stats.tls_failures.fetch_add(1, Ordering::SeqCst);
            return;
        }
    };
    stats.tls_sessions.fetch_add(1, Ordering::SeqCst);
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
        return;
    };
    if let Some(user) = sasl {
        match authenticate(&mut client, &mut server, &user).await {
            Ok(true) => {
                stats.authenticated.fetch_add(1, Ordering::SeqCst);
            }
            Ok(false) => {
                stats.refused.fetch_add(1, Ordering::SeqCst);
                let _ = client.shutdown().await;
                return;
            }
            Err(_) => return,
        }
    }
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}

/// Reads one Kafka frame (without its 4-byte size).
async fn read_frame<S: AsyncRead + Unpin>(stream: &mut S) -> std::io::Result<Vec<u8>> {
    let size = stream.read_i32().await?;
    let size = usize::try_from(size).map_err(|_| std::io::ErrorKind::InvalidData)?;
    let mut frame = vec![0; size];
    stream.read_exact(&mut frame).await?;
    Ok(frame)
}

async fn write_frame<S: AsyncWrite + Unpin>(stream: &mut S, frame: &[u8]) -> std::io::Result<()> {
    stream.write_i32(frame.len() as i32).await?;
    stream.write_all(frame).await?;
    stream.flush().await
}

/// A cursor over a request frame (non-flexible encodings only: librdkafka
/// sends SaslHandshake and SaslAuthenticate at versions 0 and 1).
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> std::io::Result<&[u8]> {
        if self.0.len() < n {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn i16(&mut self) -> std::io::Result<i16> {
        Ok(i16::from_be_bytes(self.take(2)?.try_into().unwrap()))
    }

    fn i32(&mut self) -> std::io::Result<i32> {
        Ok(i32::from_be_bytes(self.take(4)?.try_into().unwrap()))
    }

    /// A (nullable) string: int16 length, -1 for null.
    fn string(&mut self) -> std::io::Result<Vec<u8>> {
        let len = self.i16()?;
        Ok(match usize::try_from(len) {
            Ok(len) => self.take(len)?.to_vec(),
            Err(_) => Vec::new(),
        })
    }

    /// Bytes: int32 length.
    fn bytes(&mut self) -> std::io::Result<Vec<u8>> {
        let len = usize::try_from(self.i32()?).map_err(|_| std::io::ErrorKind::InvalidData)?;
        Ok(self.take(len)?.to_vec())
    }
}

fn put_string(out: &mut Vec<u8>, text: Option<&str>) {
    match text {
        Some(text) => {
            out.extend_from_slice(&(text.len() as i16).to_be_bytes());
            out.extend_from_slice(text.as_bytes());
        }
        None => out.extend_from_slice(&(-1i16).to_be_bytes()),
    }
}

/// The SASL phase of a connection, as a Kafka broker runs it (KIP-43,
/// KIP-152): ApiVersions is relayed to tansu (which lists SaslHandshake and
/// SaslAuthenticate), the SASL requests are answered here. True when the
/// user authenticated; false after refusing it (the response is sent first).
async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    client: &mut S,
    server: &mut TcpStream,
    user: &SaslUser,
) -> std::io::Result<bool> {
    let mut scram: Option<ScramServer> = None;
    loop {
        let frame = read_frame(client).await?;
        let mut request = Reader(&frame);
        let api_key = request.i16()?;
        let version = request.i16()?;
        let correlation_id = request.i32()?;
        if api_key == API_VERSIONS {
            write_frame(server, &frame).await?;
            let response = read_frame(server).await?;
            write_frame(client, &response).await?;
            continue;
        }
        let _client_id = request.string()?;
        let mut response = correlation_id.to_be_bytes().to_vec();
        match (api_key, version) {
            (SASL_HANDSHAKE, 1) => {
                let offered = request.string()?;
                let accepted = offered == user.mechanism.name().as_bytes();
                let code = if accepted {
                    0
                } else {
                    UNSUPPORTED_SASL_MECHANISM
                };
                response.extend_from_slice(&code.to_be_bytes());
                response.extend_from_slice(&1i32.to_be_bytes());
                put_string(&mut response, Some(user.mechanism.name()));
                write_frame(client, &response).await?;
                if !accepted {
                    return Ok(false);
                }
            }
            (SASL_AUTHENTICATE, 0 | 1) => {
                let token = request.bytes()?;
                let step = match user.mechanism {
                    Mechanism::Plain => plain(user, &token),
                    Mechanism::ScramSha256 | Mechanism::ScramSha512 => match scram.take() {
                        None => ScramServer::first(user, &token).map(|(server, reply)| {
                            scram = Some(server);
                            Step::Continue(reply)
                        }),
                        Some(server) => server.last(&token),
                    },
                };
                let step = step.unwrap_or_else(Step::Refused);
                let (code, message, reply) = match &step {
                    Step::Continue(reply) | Step::Done(reply) => (0, None, reply.as_bytes()),
                    Step::Refused(why) => (SASL_AUTHENTICATION_FAILED, Some(why.as_str()), &[][..]),
                };
                response.extend_from_slice(&code.to_be_bytes());
                put_string(&mut response, message);
                response.extend_from_slice(&(reply.len() as i32).to_be_bytes());
                response.extend_from_slice(reply);
                if version >= 1 {
                    response.extend_from_slice(&0i64.to_be_bytes()); // no session lifetime
                }
                write_frame(client, &response).await?;
                match step {
                    Step::Continue(_) => {}
                    Step::Done(_) => return Ok(true),
                    Step::Refused(_) => return Ok(false),
                }
            }
            // Anything else before authenticating is an illegal SASL state: a
            // Kafka broker closes the connection.
            _ => return Ok(false),
        }
    }
}

/// What one SaslAuthenticate round came to.
enum Step {
    /// Send this and expect another round.
    Continue(String),
    /// Authenticated; send this last message.
    Done(String),
    /// Refused, for this reason.
    Refused(String),
}

fn refused(mechanism: Mechanism) -> String {
    format!(
        "Authentication failed during authentication due to invalid credentials with SASL mechanism {}",
        mechanism.name()
    )
}

/// PLAIN: `authzid NUL username NUL password`.
fn plain(user: &SaslUser, token: &[u8]) -> Result<Step, String> {
    let parts: Vec<&[u8]> = token.split(|b| *b == 0).collect();
    match parts.as_slice() {
        [_, name, password]
            if *name == user.username.as_bytes() && *password == user.password.as_bytes() =>
        {
            Ok(Step::Done(String::new()))
        }
        _ => Err("Authentication failed: Invalid username or password".to_string()),
    }
}

/// The server side of one SCRAM exchange after the client's first message.
struct ScramServer {
    mechanism: Mechanism,
    password: String,
    salt: Vec<u8>,
    nonce: String,
    client_first_bare: String,
    server_first: String,
}

impl ScramServer {
    /// Takes `n,,n=<user>,r=<client nonce>`; answers `r=<nonce>,s=<salt>,i=<iterations>`.
    fn first(user: &SaslUser, token: &[u8]) -> Result<(Self, String), String> {
        let text = std::str::from_utf8(token).map_err(|_| refused(user.mechanism))?;
        let bare = text
            .strip_prefix("n,,")
            .ok_or_else(|| refused(user.mechanism))?;
        let name = attribute(bare, 'n').ok_or_else(|| refused(user.mechanism))?;
        let client_nonce = attribute(bare, 'r').ok_or_else(|| refused(user.mechanism))?;
        if name != user.username {
            return Err(refused(user.mechanism));
        }
        let salt: [u8; 16] = rand::random();
        let server_nonce: [u8; 18] = rand::random();
        let b64 = base64::engine::general_purpose::STANDARD;
        let nonce = format!("{client_nonce}{}", b64.encode(server_nonce));
        let server_first = format!("r={nonce},s={},i={SCRAM_ITERATIONS}", b64.encode(salt));
        Ok((
            Self {
                mechanism: user.mechanism,
                password: user.password.clone(),
                salt: salt.to_vec(),
                nonce,
                client_first_bare: bare.to_string(),
                server_first: server_first.clone(),
            },
            server_first,
        ))
    }

    /// Takes `c=biws,r=<nonce>,p=<proof>`, checks the proof; answers `v=<server signature>`.
    fn last(self, token: &[u8]) -> Result<Step, String> {
        let denied = || refused(self.mechanism);
        let text = std::str::from_utf8(token).map_err(|_| denied())?;
        let (without_proof, proof) = text.rsplit_once(",p=").ok_or_else(denied)?;
        if attribute(without_proof, 'r') != Some(self.nonce.as_str()) {
            return Err(denied());
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        let proof = b64.decode(proof).map_err(|_| denied())?;
        let (pbkdf2, hmac, digest) = match self.mechanism {
            Mechanism::ScramSha512 => (
                ring::pbkdf2::PBKDF2_HMAC_SHA512,
                ring::hmac::HMAC_SHA512,
                &ring::digest::SHA512,
            ),
            _ => (
                ring::pbkdf2::PBKDF2_HMAC_SHA256,
                ring::hmac::HMAC_SHA256,
                &ring::digest::SHA256,
            ),
        };
        let mut salted = vec![0; digest.output_len()];
        ring::pbkdf2::derive(
            pbkdf2,
            std::num::NonZeroU32::new(SCRAM_ITERATIONS).unwrap(),
            &self.salt,
            self.password.as_bytes(),
            &mut salted,
        );
        let salted = ring::hmac::Key::new(hmac, &salted);
        let client_key = ring::hmac::sign(&salted, b"Client Key");
        let stored_key = ring::digest::digest(digest, client_key.as_ref());
        let auth_message = format!(
            "{},{},{without_proof}",
            self.client_first_bare, self.server_first
        );
        let signature = ring::hmac::sign(
            &ring::hmac::Key::new(hmac, stored_key.as_ref()),
            auth_message.as_bytes(),
        );
        if proof.len() != signature.as_ref().len() {
            return Err(denied());
        }
        let recovered: Vec<u8> = proof
            .iter()
            .zip(signature.as_ref())
            .map(|(p, s)| p ^ s)
            .collect();
        if ring::digest::digest(digest, &recovered).as_ref() != stored_key.as_ref() {
            return Err(denied());
        }
        let server_key = ring::hmac::sign(&salted, b"Server Key");
        let server_signature = ring::hmac::sign(
            &ring::hmac::Key::new(hmac, server_key.as_ref()),
            auth_message.as_bytes(),
        );
        Ok(Step::Done(format!("v={}", b64.encode(server_signature))))
    }
}

/// The value of attribute `name` (`name=value`) in a SCRAM message.
fn attribute(message: &str, name: char) -> Option<&str> {
    message
        .split(',')
        .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
}
