//! The sandbox API server's TLS: a CA of its own and a serving certificate for `127.0.0.1` and
//! `localhost`, issued at start (rcgen), and the rustls server configuration.
//!
//! The server answers plain HTTP and HTTPS on one port (the first byte of a connection tells a
//! TLS handshake apart). Its kubeconfig files name the HTTPS URL with the CA as
//! `certificate-authority-data`: kubectl (client-go) sends a kubeconfig's credentials only over
//! TLS. The in-process clients ([`super::ApiServer::admin_client`]) use plain HTTP with the
//! same bearer tokens. No client certificates are asked for.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// The first byte of a TLS handshake record.
pub(crate) const HANDSHAKE: u8 = 0x16;

/// What the server presents and what its clients trust.
pub(crate) struct ServingTls {
    /// The CA certificate, PEM (a kubeconfig's `certificate-authority-data`, base64 of it).
    pub ca_pem: String,
    /// The rustls server configuration (HTTP/1.1 only).
    pub config: Arc<rustls::ServerConfig>,
}

/// Why the TLS material could not be made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TlsSetupError {
    #[error("issuing the sandbox certificates: {0}")]
    Issue(#[from] rcgen::Error),
    #[error("the sandbox TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Issues a CA and a serving certificate for `127.0.0.1` and `localhost`.
pub(crate) fn issue() -> Result<ServingTls, TlsSetupError> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "gpushare-sandbox-ca");
    ca_params.distinguished_name = dn;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate()?;
    let mut params =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "gpushare-sandbox-apiserver");
    params.distinguished_name = dn;
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, &issuer)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(cert.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )?;
    Ok(ServingTls {
        ca_pem: ca_cert.pem(),
        config: Arc::new(config),
    })
}
