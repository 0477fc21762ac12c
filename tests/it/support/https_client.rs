//! HTTPS clients for the tests of TLS servers (the extender with client-certificate auth, the
//! webhook): a rustls connector trusting a CA and presenting a client certificate or none, and one
//! request over a fresh connection (with the certificate the server presented). Not a general
//! HTTP client: `extender_http` is that.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A TLS client trusting `ca_pem`, presenting `client` (certificate and key PEM) if given.
pub(crate) fn connector(ca_pem: &str, client: Option<(&str, &str)>) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for der in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(der.expect("pem")).expect("root");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .expect("chain");
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("key");
            builder
                .with_client_auth_cert(chain, key)
                .expect("client auth")
        }
    };
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// What one HTTPS exchange brought back.
#[derive(Debug)]
pub(crate) struct HttpsAnswer {
    /// The status.
    pub(crate) status: u16,
    /// The body, as text.
    pub(crate) body: String,
    /// The DER certificate the server presented.
    pub(crate) presented: Vec<u8>,
}

/// One HTTPS request on a fresh connection through `connector`, checking the server's
/// certificate against `server_name` (also the `Host`): the answer, or `Err` when the TLS
/// handshake or the connection failed (a refused certificate).
pub(crate) async fn https_exchange(
    connector: tokio_rustls::TlsConnector,
    server_name: &str,
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<HttpsAnswer, String> {
    // Bounded: an exchange that never ends is an answer the test reports, never a hung suite
    // (`client_auth::a_changed_client_ca_is_used_without_a_restart` once hung for 15 minutes
    // under a doubled load, with no connection open; where it waited is not known).
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let name = ServerName::try_from(server_name.to_string()).map_err(|e| e.to_string())?;
        let tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let presented = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.to_vec())
            .unwrap_or_default();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| format!("HTTP handshake: {e}"))?;
        tokio::spawn(conn);
        let request = http::Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, server_name)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::copy_from_slice(body)))
            .map_err(|e| e.to_string())?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("exchange: {e}"))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("read: {e}"))?
            .to_bytes();
        Ok(HttpsAnswer {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
            presented,
        })
    };
    tokio::time::timeout(crate::support::wait::DEADLINE, exchange)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "no answer within {:?} from https://{addr}{path}",
                crate::support::wait::DEADLINE
            ))
        })
}

/// [`https_exchange`] with a text body: the status and body.
pub(crate) async fn https_via(
    connector: tokio_rustls::TlsConnector,
    server_name: &str,
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    https_exchange(connector, server_name, addr, method, path, body.as_bytes())
        .await
        .map(|a| (a.status, a.body))
}
