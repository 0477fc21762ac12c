//! The one outbound HTTP client of the roles: one HTTP/1.1 request on a fresh connection,
//! plain or TLS, within a deadline, its whole answer read into memory. Doctor's probes of the
//! extender and the webhook, inspect's `--from-extender` and the extender's forwarding to its
//! leader all send through it.
//!
//! One TLS set-up ([`TlsOptions`]): whom to trust ([`Trust`]: a CA file, a PEM bundle, exactly
//! the replicas' own serving certificate, or nothing, like `curl -k`), which client
//! certificate to present ([`Identity`]) and which name to check the server's certificate
//! against when it differs from the URL's host.
//!
//! Errors are typed and keep their cause ([`Error`], [`SetupError`]): a refused connection,
//! a failed name lookup and a TLS handshake failure are told apart, and
//! [`Error::surely_unsent`] says whether the request surely never reached the server (so a
//! caller can tell a refusal from an unknown outcome).
//!
//! Answers are read whole, up to [`MAX_BODY`] bytes.
//!
//! What it does not do: pool connections, retry, follow redirects, speak HTTP/2, or talk to
//! the Kubernetes API (the kube client does that).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode, header};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::tls::{PeerCheck, ServingCert, provider};

/// The largest answer body read (an extender's inspect of a large cluster is a few MiB).
pub const MAX_BODY: usize = 64 << 20;

/// Whom a TLS client trusts.
#[derive(Clone)]
pub enum Trust {
    /// The CA certificates of a PEM file.
    CaFile(PathBuf),
    /// The CA certificates of a PEM text (a webhook configuration's caBundle).
    CaPem(String),
    /// Exactly the certificate this replica serves now, whatever the name (the extender
    /// replicas share one key pair).
    Pinned(Arc<ServingCert>),
    /// Any certificate: the connection is encrypted but the server is not authenticated
    /// (doctor's reachability probe, like `curl -k`).
    InsecureSkipVerify,
}

impl std::fmt::Debug for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Trust::CaFile(p) => f.debug_tuple("CaFile").field(p).finish(),
            Trust::CaPem(_) => f.write_str("CaPem(..)"),
            Trust::Pinned(_) => f.write_str("Pinned(..)"),
            Trust::InsecureSkipVerify => f.write_str("InsecureSkipVerify"),
        }
    }
}

/// The client certificate a TLS client presents.
#[derive(Clone, Default)]
pub enum Identity {
    /// None.
    #[default]
    None,
    /// A PEM certificate chain and its PEM private key, from files.
    Files {
        /// The certificate chain.
        cert: PathBuf,
        /// Its private key.
        key: PathBuf,
    },
    /// The certificate this replica serves (kept current as it is renewed).
    Serving(Arc<ServingCert>),
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::None => f.write_str("None"),
            Identity::Files { cert, key } => f
                .debug_struct("Files")
                .field("cert", cert)
                .field("key", key)
                .finish(),
            Identity::Serving(_) => f.write_str("Serving(..)"),
        }
    }
}

/// How a client speaks TLS to `https://` URLs.
#[derive(Clone, Debug)]
pub struct TlsOptions {
    /// Whom to trust.
    pub trust: Trust,
    /// What to present.
    pub identity: Identity,
    /// The name to check the server's certificate against instead of the URL's host.
    pub server_name: Option<String>,
}

impl TlsOptions {
    /// Trusting `trust`, presenting nothing, checking the URL's host.
    pub fn trusting(trust: Trust) -> TlsOptions {
        TlsOptions {
            trust,
            identity: Identity::None,
            server_name: None,
        }
    }
}

/// Why a TLS set-up cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A PEM file or text cannot be read or parsed.
    #[error("{what}: {source}")]
    Pem {
        /// Which PEM (the file, or the text's role).
        what: String,
        /// Why.
        source: rustls::pki_types::pem::Error,
    },
    /// A CA file or text holds no certificate.
    #[error("{what}: no certificate in it")]
    NoCertificate {
        /// Which PEM.
        what: String,
    },
    /// rustls refuses a CA, or the client certificate and key do not belong together.
    #[error("{what}: {source}")]
    Rustls {
        /// What was being set up.
        what: String,
        /// Why.
        source: rustls::Error,
    },
    /// The name to check is no DNS name or IP address.
    #[error("{name:?} is not a server name")]
    ServerName {
        /// The name.
        name: String,
    },
}

/// Why a request has no answer. [`Error::surely_unsent`] tells the failures before the
/// request was written from those after.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The URL is not `http(s)://HOST[:PORT]/...`.
    #[error("{url:?} is not an http:// or https:// URL with a host")]
    BadUrl {
        /// The URL.
        url: String,
    },
    /// An https:// URL for a client set up without TLS.
    #[error("{url}: an https:// URL, but no TLS is set up for it")]
    NoTls {
        /// The URL.
        url: String,
    },
    /// The name to check the certificate against is no server name.
    #[error("{name:?} is not a server name")]
    ServerName {
        /// The name.
        name: String,
    },
    /// The TCP connection failed (refused, no route, name lookup failed).
    #[error("connect {authority}: {source}")]
    Connect {
        /// host:port.
        authority: String,
        /// Why.
        source: std::io::Error,
    },
    /// The TLS handshake failed (certificate not trusted, wrong name, client certificate
    /// refused, not a TLS server).
    #[error("TLS handshake with {authority}: {source}")]
    Tls {
        /// host:port.
        authority: String,
        /// Why (rustls's error, inside).
        source: std::io::Error,
    },
    /// The HTTP/1.1 connection could not be set up.
    #[error("HTTP handshake with {authority}: {source}")]
    Handshake {
        /// host:port.
        authority: String,
        /// Why.
        source: hyper::Error,
    },
    /// No connection within the deadline.
    #[error("no connection to {authority} within {timeout:?}")]
    ConnectTimeout {
        /// host:port.
        authority: String,
        /// The deadline.
        timeout: Duration,
    },
    /// Sending the request or reading the answer failed: the server may have it.
    #[error("{method} {url}: {source}")]
    Exchange {
        /// The method.
        method: http::Method,
        /// The URL.
        url: String,
        /// Why.
        source: hyper::Error,
    },
    /// The answer's body is larger than the client reads ([`Client::with_max_body`]): the
    /// server has the request.
    #[error("{method} {url}: the answer is larger than {limit} bytes")]
    TooLarge {
        /// The method.
        method: http::Method,
        /// The URL.
        url: String,
        /// The limit.
        limit: usize,
    },
    /// The connection was made but no whole answer came within the deadline: the server
    /// may have the request.
    #[error("{method} {url}: no answer within {timeout:?}")]
    NoAnswer {
        /// The method.
        method: http::Method,
        /// The URL.
        url: String,
        /// The deadline.
        timeout: Duration,
    },
}

impl Error {
    /// True when the request surely never reached the server (it failed before it was
    /// written); false when its outcome is unknown.
    pub fn surely_unsent(&self) -> bool {
        !matches!(
            self,
            Error::Exchange { .. } | Error::NoAnswer { .. } | Error::TooLarge { .. }
        )
    }

    /// True when the TLS handshake failed (the server is there but the certificates do not
    /// agree).
    pub fn is_tls(&self) -> bool {
        matches!(self, Error::Tls { .. })
    }
}

/// A whole answer.
#[derive(Debug, Clone)]
pub struct Response {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body.
    pub body: Bytes,
}

impl Response {
    /// The body as text, cut to `max` bytes (on a character boundary, `...` appended) and
    /// trimmed: for error messages.
    pub fn body_excerpt(&self, max: usize) -> String {
        let text = String::from_utf8_lossy(&self.body);
        let text = text.trim();
        if text.len() <= max {
            return text.to_string();
        }
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}...", &text[..cut])
    }
}

/// Sends requests; cheap to clone.
#[derive(Clone)]
pub struct Client {
    tls: Option<Arc<ClientTls>>,
    max_body: usize,
}

impl Default for Client {
    fn default() -> Client {
        Client {
            tls: None,
            max_body: MAX_BODY,
        }
    }
}

struct ClientTls {
    connector: TlsConnector,
    server_name: Option<String>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// Where an absolute request URI points.
struct Target {
    /// `https` (else `http`).
    https: bool,
    /// The host without an IPv6 address's brackets (the TLS server name by default).
    bare_host: String,
    /// The URI's authority as written (the `Host` header).
    authority: String,
    /// `host:port` to connect to (the port by the scheme when the URI has none).
    dial: String,
}

impl Target {
    /// `None` when `uri` is not an absolute `http(s)` URI with a host.
    fn of(uri: &http::Uri) -> Option<Target> {
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return None,
        };
        let host = uri.host().filter(|h| !h.is_empty())?;
        let bare_host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let authority = uri
            .authority()
            .map_or_else(|| host.to_string(), |a| a.to_string());
        let dial = if bare_host.contains(':') {
            format!("[{bare_host}]:{port}")
        } else {
            format!("{bare_host}:{port}")
        };
        Some(Target {
            https,
            bare_host,
            authority,
            dial,
        })
    }
}

impl Client {
    /// A client for http:// URLs only.
    pub fn plain() -> Client {
        Client::default()
    }

    /// A client for http:// URLs and, set up by `tls`, https:// ones.
    pub fn new(tls: TlsOptions) -> Result<Client, SetupError> {
        let connector = connector(&tls)?;
        if let Some(name) = &tls.server_name {
            ServerName::try_from(name.clone())
                .map_err(|_| SetupError::ServerName { name: name.clone() })?;
        }
        Ok(Client {
            tls: Some(Arc::new(ClientTls {
                connector,
                server_name: tls.server_name,
            })),
            max_body: MAX_BODY,
        })
    }

    /// The same client, reading answer bodies of at most `bytes` ([`MAX_BODY`] by default).
    pub fn with_max_body(mut self, bytes: usize) -> Client {
        self.max_body = bytes;
        self
    }

    /// Sends `request` (its URI absolute: `http(s)://host:port/path`) on a fresh connection
    /// and reads the whole answer, all within `timeout`. A `Host` header is added from the
    /// URL unless the request has one.
    pub async fn send(
        &self,
        request: Request<Bytes>,
        timeout: Duration,
    ) -> Result<Response, Error> {
        let deadline = Instant::now() + timeout;
        let (mut parts, body) = request.into_parts();
        let url = parts.uri.to_string();
        let bad_url = || Error::BadUrl { url: url.clone() };
        let Target {
            https,
            bare_host,
            authority,
            dial,
        } = Target::of(&parts.uri).ok_or_else(bad_url)?;
        let tls = match (https, &self.tls) {
            (false, _) => None,
            (true, None) => return Err(Error::NoTls { url }),
            (true, Some(tls)) => {
                let name = tls.server_name.clone().unwrap_or(bare_host);
                let name =
                    ServerName::try_from(name.clone()).map_err(|_| Error::ServerName { name })?;
                Some((tls.connector.clone(), name))
            }
        };
        if !parts.headers.contains_key(header::HOST) {
            let value = header::HeaderValue::from_str(&authority).map_err(|_| bad_url())?;
            parts.headers.insert(header::HOST, value);
        }
        parts.uri = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .parse()
            .map_err(|_| bad_url())?;
        let method = parts.method.clone();
        let request = Request::from_parts(parts, Full::new(body));

        let connect = async {
            let tcp = TcpStream::connect(dial.as_str())
                .await
                .map_err(|source| Error::Connect {
                    authority: dial.clone(),
                    source,
                })?;
            let _ = tcp.set_nodelay(true);
            let io: Box<dyn Io> = match tls {
                None => Box::new(tcp),
                Some((connector, name)) => Box::new(connector.connect(name, tcp).await.map_err(
                    |source| Error::Tls {
                        authority: dial.clone(),
                        source,
                    },
                )?),
            };
            hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(io))
                .await
                .map_err(|source| Error::Handshake {
                    authority: dial.clone(),
                    source,
                })
        };
        let (mut sender, conn) = match tokio::time::timeout_at(deadline, connect).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::ConnectTimeout {
                    authority: dial,
                    timeout,
                });
            }
        };
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        // From here on the server may have the request.
        let exchange = async {
            let failed = |source| Error::Exchange {
                method: method.clone(),
                url: url.clone(),
                source,
            };
            let response = sender.send_request(request).await.map_err(failed)?;
            let (parts, body) = response.into_parts();
            let body = match Limited::new(body, self.max_body).collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(e) => match e.downcast::<hyper::Error>() {
                    Ok(source) => return Err(failed(*source)),
                    Err(_) => {
                        return Err(Error::TooLarge {
                            method: method.clone(),
                            url: url.clone(),
                            limit: self.max_body,
                        });
                    }
                },
            };
            Ok(Response {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        let result = match tokio::time::timeout_at(deadline, exchange).await {
            Ok(r) => r,
            Err(_) => Err(Error::NoAnswer {
                method: method.clone(),
                url: url.clone(),
                timeout,
            }),
        };
        driver.abort();
        result
    }

    /// `GET url` with `Accept: application/json`: see [`Client::send`].
    pub async fn get(&self, url: &str, timeout: Duration) -> Result<Response, Error> {
        let request = Request::get(url)
            .header(header::ACCEPT, "application/json")
            .body(Bytes::new())
            .map_err(|_| Error::BadUrl {
                url: url.to_string(),
            })?;
        self.send(request, timeout).await
    }
}

fn pem_error(what: &str) -> impl Fn(rustls::pki_types::pem::Error) -> SetupError + '_ {
    move |source| SetupError::Pem {
        what: what.to_string(),
        source,
    }
}

fn rustls_error(what: &str) -> impl Fn(rustls::Error) -> SetupError + '_ {
    move |source| SetupError::Rustls {
        what: what.to_string(),
        source,
    }
}

fn roots(
    what: &str,
    certs: Vec<CertificateDer<'static>>,
) -> Result<rustls::RootCertStore, SetupError> {
    if certs.is_empty() {
        return Err(SetupError::NoCertificate {
            what: what.to_string(),
        });
    }
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs {
        roots.add(cert).map_err(rustls_error(what))?;
    }
    Ok(roots)
}

/// The rustls connector of `tls`.
fn connector(tls: &TlsOptions) -> Result<TlsConnector, SetupError> {
    let provider = provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(rustls_error("TLS protocol versions"))?;
    let builder = match &tls.trust {
        Trust::CaFile(path) => {
            let what = format!("CA file {}", path.display());
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(pem_error(&what))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(pem_error(&what))?;
            builder.with_root_certificates(roots(&what, certs)?)
        }
        Trust::CaPem(pem) => {
            let what = "CA bundle";
            let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(pem_error(what))?;
            builder.with_root_certificates(roots(what, certs)?)
        }
        Trust::Pinned(ours) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PeerCheck::pinned(ours.clone(), provider))),
        Trust::InsecureSkipVerify => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PeerCheck::any(provider))),
    };
    let mut config = match &tls.identity {
        Identity::None => builder.with_no_client_auth(),
        Identity::Files { cert, key } => {
            let what = format!("client certificate {}", cert.display());
            let chain = CertificateDer::pem_file_iter(cert)
                .map_err(pem_error(&what))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(pem_error(&what))?;
            if chain.is_empty() {
                return Err(SetupError::NoCertificate { what });
            }
            let key_what = format!("client key {}", key.display());
            let key = PrivateKeyDer::from_pem_file(key).map_err(pem_error(&key_what))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(rustls_error(&format!("{what} and {key_what}")))?
        }
        Identity::Serving(serving) => builder.with_client_cert_resolver(serving.clone()),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_refused_connection_keeps_its_cause_and_was_not_sent() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let e = Client::plain()
            .get(&format!("http://{addr}/version"), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(e.surely_unsent(), "{e:?}");
        assert!(matches!(e, Error::Connect { .. }), "{e:?}");
        assert!(e.to_string().contains("refused"), "{e}");
    }

    #[tokio::test]
    async fn an_answer_larger_than_the_limit_is_refused_as_sent() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let body = "x".repeat(1000);
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(body.as_bytes()).await;
        });
        let e = Client::plain()
            .with_max_body(100)
            .get(&format!("http://{addr}/big"), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::TooLarge { limit: 100, .. }), "{e:?}");
        assert!(!e.surely_unsent(), "{e:?}");
    }

    #[tokio::test]
    async fn urls_that_cannot_work_are_named() {
        let plain = Client::plain();
        let e = plain
            .get("ftp://h/x", Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::BadUrl { .. }), "{e:?}");
        let e = plain
            .get("https://127.0.0.1:1/x", Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NoTls { .. }), "{e:?}");
    }

    #[test]
    fn a_missing_ca_file_names_the_file() {
        let tls = TlsOptions::trusting(Trust::CaFile("/nonexistent/ca.crt".into()));
        let e = Client::new(tls).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/ca.crt"), "{e}");
        let e = Client::new(TlsOptions::trusting(Trust::CaPem("not pem".into()))).unwrap_err();
        assert!(matches!(e, SetupError::NoCertificate { .. }), "{e:?}");
    }

    #[test]
    fn body_excerpts_are_cut_on_a_character_boundary() {
        let r = Response {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from("ééé"),
        };
        assert_eq!(r.body_excerpt(3), "é...");
        assert_eq!(r.body_excerpt(10), "ééé");
    }
}
