//! TLS material of gpushare's HTTPS servers and of the replicas that call each other: PEM
//! certificates and keys read from files and read again when the files change
//! ([`CertFiles`], [`ServerTls::refresh`]), the certificate a server presents, swappable while
//! it serves ([`ServingCert`]), and the optional check of client certificates against a CA
//! file, swappable too ([`ClientCa`]); and the check of the certificate another replica
//! shows a client calling it ([`PeerCheck`], used by [`crate::outbound`]).
//!
//! Client certificates are optional at the TLS layer: a client that presents one must present
//! one the CA (or the replica set's own serving certificate) vouches for, or the handshake
//! fails; a client that presents none gets through, and [`crate::http_server`] marks only the
//! requests of connections with a verified certificate ([`crate::http_server::PeerCertificate`]).
//! Which paths need that mark is the role's router's decision, not this module's.
//!
//! It does not issue certificates (the webhook's `certs` module does) and talks to no API.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::client::ResolvesClientCert;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::shutdown::Shutdown;

/// How often [`ServerTls::keep_fresh`] looks at the files' modification times by default.
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(10);

/// A TLS material problem.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM text or file holds no usable certificate or key.
    #[error("{what}: {why}")]
    Unreadable {
        /// Which PEM (`tls.crt`, a file name).
        what: String,
        /// What is wrong.
        why: String,
    },
    /// The certificate and key do not belong together, or rustls refuses them.
    #[error("TLS certificate and key: {0}")]
    Tls(#[from] rustls::Error),
    /// A client CA file rustls cannot verify with.
    #[error("client CA {path}: {why}")]
    ClientCa {
        /// The file.
        path: String,
        /// What is wrong.
        why: String,
    },
}

fn unreadable(what: &str, why: impl ToString) -> TlsError {
    TlsError::Unreadable {
        what: what.to_string(),
        why: why.to_string(),
    }
}

/// The crypto provider of every TLS endpoint, serving or calling (ring).
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The handshake signature checks of a certificate verifier, with the algorithms of its
/// `provider` field: the same in every verifier here ([`ClientCa`] serving, [`PeerCheck`]
/// calling), so the peer proves it holds the key of the certificate it shows.
macro_rules! signature_checks {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(
                message,
                cert,
                dss,
                &self.provider.signature_verification_algorithms,
            )
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                message,
                cert,
                dss,
                &self.provider.signature_verification_algorithms,
            )
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.provider
                .signature_verification_algorithms
                .supported_schemes()
        }
    };
}

/// A certificate with its private key, both PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PemPair {
    /// The certificate (for a CA bundle, several, the signing one first).
    pub cert: String,
    /// Its private key.
    pub key: String,
}

/// Every certificate of a PEM text, DER.
pub fn pem_certs(what: &str, pem: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| unreadable(what, e))?;
    if certs.is_empty() {
        return Err(unreadable(what, "no certificate in it"));
    }
    Ok(certs)
}

/// A certificate chain and key as rustls wants them.
pub fn certified_key(pair: &PemPair, what: &str) -> Result<CertifiedKey, TlsError> {
    let certs = pem_certs(what, &pair.cert)?;
    let key = PrivateKeyDer::from_pem_slice(pair.key.as_bytes())
        .map_err(|e| unreadable(&format!("{what} key"), e))?;
    Ok(CertifiedKey::from_der(certs, key, &provider())?)
}

/// The certificate the server presents; [`ServingCert::set`] swaps it for the next handshakes.
/// The extender's replicas share it, so it is also what one replica presents to another as a
/// client ([`ResolvesClientCert`]) and what it expects the other to present.
#[derive(Debug)]
pub struct ServingCert {
    current: RwLock<Arc<CertifiedKey>>,
    pem: RwLock<String>,
}

impl ServingCert {
    /// Starts with `pair`.
    pub fn new(pair: &PemPair) -> Result<Arc<ServingCert>, TlsError> {
        let key = certified_key(pair, "serving certificate")?;
        Ok(Arc::new(ServingCert {
            current: RwLock::new(Arc::new(key)),
            pem: RwLock::new(pair.cert.clone()),
        }))
    }

    /// Presents `pair` from now on.
    pub fn set(&self, pair: &PemPair) -> Result<(), TlsError> {
        let key = Arc::new(certified_key(pair, "serving certificate")?);
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = key;
        *self.pem.write().unwrap_or_else(|e| e.into_inner()) = pair.cert.clone();
        Ok(())
    }

    /// The PEM certificate presented now.
    pub fn pem(&self) -> String {
        self.pem.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn key(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether `der` is the end-entity certificate presented now.
    pub fn is_ours(&self, der: &[u8]) -> bool {
        self.key()
            .end_entity_cert()
            .is_ok_and(|c| c.as_ref() == der)
    }

    /// A TLS acceptor (HTTP/1.1) presenting this certificate, without client certificates.
    pub fn acceptor(self: &Arc<Self>) -> Result<TlsAcceptor, TlsError> {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsAcceptor::from(Arc::new(config)))
    }
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.key())
    }
}

impl ResolvesClientCert for ServingCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.key())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// `--tls-cert/--tls-key` files (cert-manager and kubelet rewrite them in place): read now,
/// and again whenever their modification time changes.
#[derive(Clone, Debug)]
pub struct CertFiles {
    /// The certificate chain.
    pub cert: PathBuf,
    /// The key.
    pub key: PathBuf,
}

fn read_file(p: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(p).map_err(|e| unreadable(&p.display().to_string(), e))
}

fn modified(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

impl CertFiles {
    /// Reads both files.
    pub fn read(&self) -> Result<PemPair, TlsError> {
        Ok(PemPair {
            cert: read_file(&self.cert)?,
            key: read_file(&self.key)?,
        })
    }

    /// The later modification time of the two files.
    pub fn stamp(&self) -> Option<SystemTime> {
        modified(&self.cert).max(modified(&self.key))
    }
}

/// The check of client certificates: a certificate chaining to the CA file's certificates
/// (the scheduler's), or the serving certificate of this replica set (another replica
/// forwarding; it proves it holds the shared key in the handshake). Optional at the TLS
/// layer; the CA is read again by [`ClientCa::reload`].
#[derive(Debug)]
pub struct ClientCa {
    path: PathBuf,
    webpki: RwLock<Arc<dyn ClientCertVerifier>>,
    peers: Arc<ServingCert>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ClientCa {
    /// Reads the CA file; `peers` is the certificate the other replicas present.
    pub fn load(path: &Path, peers: Arc<ServingCert>) -> Result<Arc<ClientCa>, TlsError> {
        let provider = provider();
        let webpki = Self::verifier(path, &provider)?;
        Ok(Arc::new(ClientCa {
            path: path.to_path_buf(),
            webpki: RwLock::new(webpki),
            peers,
            provider,
        }))
    }

    fn verifier(
        path: &Path,
        provider: &Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
        let shown = path.display().to_string();
        let pem = read_file(path)?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in pem_certs(&shown, &pem)? {
            roots.add(cert).map_err(|e| TlsError::ClientCa {
                path: shown.clone(),
                why: e.to_string(),
            })?;
        }
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .allow_unauthenticated()
            .build()
            .map_err(|e| TlsError::ClientCa {
                path: shown,
                why: e.to_string(),
            })
    }

    /// Reads the CA file again; on an error the previous CA stays in force.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = Self::verifier(&self.path, &self.provider)?;
        *self.webpki.write().unwrap_or_else(|e| e.into_inner()) = fresh;
        Ok(())
    }

    /// The CA file's modification time.
    pub fn stamp(&self) -> Option<SystemTime> {
        modified(&self.path)
    }

    fn current(&self) -> Arc<dyn ClientCertVerifier> {
        self.webpki
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl ClientCertVerifier for ClientCa {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // No hints: a client then sends the certificate it has (Go's crypto/tls, rustls).
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        if self.peers.is_ours(end_entity.as_ref()) {
            return Ok(ClientCertVerified::assertion());
        }
        self.current()
            .verify_client_cert(end_entity, intermediates, now)
    }

    signature_checks!();
}

/// The server-certificate check of a client calling another replica: exactly this replica
/// set's serving certificate ([`PeerCheck::pinned`]) or any ([`PeerCheck::any`], the
/// insecure-skip-verify choice). Signatures are verified either way, so the peer holds the
/// key of the certificate it shows.
#[derive(Debug)]
pub struct PeerCheck {
    pinned: Option<Arc<ServingCert>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl PeerCheck {
    /// Accepts only `ours`, the certificate this replica set serves with.
    pub fn pinned(ours: Arc<ServingCert>, provider: Arc<rustls::crypto::CryptoProvider>) -> Self {
        PeerCheck {
            pinned: Some(ours),
            provider,
        }
    }

    /// Accepts any certificate (its signatures still checked).
    pub fn any(provider: Arc<rustls::crypto::CryptoProvider>) -> Self {
        PeerCheck {
            pinned: None,
            provider,
        }
    }
}

impl ServerCertVerifier for PeerCheck {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match &self.pinned {
            Some(ours) if !ours.is_ours(end_entity.as_ref()) => Err(rustls::Error::General(
                "the peer presents a certificate other than this replica's".to_string(),
            )),
            _ => Ok(ServerCertVerified::assertion()),
        }
    }

    signature_checks!();
}

/// Issues no stateless session tickets (rustls' default too, stated where it matters).
#[derive(Debug)]
struct NoTickets;

impl rustls::server::ProducesTickets for NoTickets {
    fn enabled(&self) -> bool {
        false
    }
    fn lifetime(&self) -> u32 {
        0
    }
    fn encrypt(&self, _plain: &[u8]) -> Option<Vec<u8>> {
        None
    }
    fn decrypt(&self, _cipher: &[u8]) -> Option<Vec<u8>> {
        None
    }
}

/// An HTTPS server's material from files: the serving certificate and key, and optionally
/// the CA that signs the client certificates it accepts. [`ServerTls::refresh`] reads the
/// files again when they changed.
#[derive(Debug)]
pub struct ServerTls {
    files: CertFiles,
    serving: Arc<ServingCert>,
    client_ca: Option<Arc<ClientCa>>,
    stamps: Mutex<(Option<SystemTime>, Option<SystemTime>)>,
}

impl ServerTls {
    /// Reads `files` and, when given, the client CA file.
    pub fn load(files: CertFiles, client_ca: Option<&Path>) -> Result<ServerTls, TlsError> {
        let stamps = (files.stamp(), client_ca.and_then(modified));
        let serving = ServingCert::new(&files.read()?)?;
        let client_ca = client_ca
            .map(|p| ClientCa::load(p, serving.clone()))
            .transpose()?;
        Ok(ServerTls {
            files,
            serving,
            client_ca,
            stamps: Mutex::new(stamps),
        })
    }

    /// The certificate presented now (shared with the forwarding client).
    pub fn serving(&self) -> Arc<ServingCert> {
        self.serving.clone()
    }

    /// Whether client certificates are checked.
    pub fn checks_clients(&self) -> bool {
        self.client_ca.is_some()
    }

    /// Whether a client certificate chain (end entity first) verified at a connection's
    /// handshake is still trusted by the client CA in force NOW: a connection kept alive
    /// across a rotation of the CA file gets no request through on the replaced CA.
    pub fn still_trusts(&self, chain: &[CertificateDer<'_>]) -> bool {
        let (Some(ca), Some((leaf, intermediates))) = (&self.client_ca, chain.split_first()) else {
            return false;
        };
        ca.verify_client_cert(leaf, intermediates, UnixTime::now())
            .is_ok()
    }

    /// A TLS acceptor (HTTP/1.1) presenting the serving certificate and, with a client CA,
    /// asking for (not requiring) a client certificate.
    pub fn acceptor(&self) -> Result<TlsAcceptor, TlsError> {
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?;
        let builder = match &self.client_ca {
            Some(ca) => builder.with_client_cert_verifier(ca.clone()),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(self.serving.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        if self.client_ca.is_some() {
            // A resumed session skips the client certificate check: it would keep a client
            // of a replaced CA in (each resumption handing out new tickets). Every
            // connection makes a full handshake against the CA in force instead.
            config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
            config.send_tls13_tickets = 0;
            config.ticketer = Arc::new(NoTickets);
        }
        Ok(TlsAcceptor::from(Arc::new(config)))
    }

    /// Reads the files whose modification time changed since the last successful read; a
    /// file that cannot be used yet (half written) is tried again next time. Returns what
    /// was reloaded.
    pub fn refresh(&self) -> Vec<&'static str> {
        let mut stamps = self.stamps.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = Vec::new();
        let now = self.files.stamp();
        if now != stamps.0 {
            match self.files.read().and_then(|p| self.serving.set(&p)) {
                Ok(()) => {
                    tracing::info!(cert = %self.files.cert.display(), "serving the changed TLS certificate");
                    stamps.0 = now;
                    done.push("certificate");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the TLS certificate changed but cannot be used yet")
                }
            }
        }
        if let Some(ca) = &self.client_ca {
            let now = ca.stamp();
            if now != stamps.1 {
                match ca.reload() {
                    Ok(()) => {
                        tracing::info!(ca = %ca.path.display(), "checking client certificates against the changed CA");
                        stamps.1 = now;
                        done.push("client-ca");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the client CA changed but cannot be used yet")
                    }
                }
            }
        }
        done
    }

    /// Calls [`ServerTls::refresh`] every `period` until `shutdown`.
    pub async fn keep_fresh(self: Arc<Self>, period: Duration, shutdown: Shutdown) {
        let stop = shutdown.wait();
        let mut stop = std::pin::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => return,
                _ = tokio::time::sleep(period) => { self.refresh(); }
            }
        }
    }
}
