//! The webhook's certificates: issuing a CA and a serving certificate (rcgen) and reading them
//! back (x509-parser: expiry, DNS names, issuer). The TLS certificate the server presents,
//! swappable while it serves so a renewal needs no restart, is [`crate::tls::ServingCert`].
//!
//! It does not talk to the API server: [`super::bootstrap`] keeps the certificates in a Secret.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

pub use crate::tls::{CertFiles, PemPair, ServingCert, certified_key, pem_certs};

/// How often the certificate is checked: the files of `--tls-cert` for changes, the Secret of
/// `--self-signed` for renewal (and the caBundles).
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(60);
/// Lifetime of the CA `--self-signed` makes.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Common name of that CA.
pub(crate) const CA_COMMON_NAME: &str = "gpushare-webhook-ca";

/// A certificate problem.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen could not issue the certificate.
    #[error("issuing a certificate: {0}")]
    Issue(#[from] rcgen::Error),
    /// A PEM text holds no usable certificate or key.
    #[error("{what}: {why}")]
    Unreadable {
        /// Which PEM (`tls.crt`, a file name).
        what: String,
        /// What is wrong.
        why: String,
    },
    /// The certificate, key or their PEM text is unusable.
    #[error(transparent)]
    Material(#[from] crate::tls::TlsError),
}

fn unreadable(what: &str, why: impl ToString) -> CertError {
    CertError::Unreadable {
        what: what.to_string(),
        why: why.to_string(),
    }
}

fn to_offset(t: SystemTime) -> time::OffsetDateTime {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    time::OffsetDateTime::from_unix_timestamp(secs).unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

/// Issues a self-signed CA valid from `now` (minus an hour of clock skew) for `validity`.
pub fn issue_ca(now: SystemTime, validity: Duration) -> Result<PemPair, CertError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    dn.push(DnType::OrganizationName, "gpushare");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = to_offset(now - Duration::from_secs(3600));
    params.not_after = to_offset(now + validity);
    let cert = params.self_signed(&key)?;
    Ok(PemPair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// Issues a serving certificate for `dns_names`, signed by `ca` (its first certificate).
pub fn issue_serving(
    ca: &PemPair,
    dns_names: &[String],
    not_before: SystemTime,
    not_after: SystemTime,
) -> Result<PemPair, CertError> {
    let ca_key = KeyPair::from_pem(&ca.key)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(dns_names.to_vec())?;
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        dns_names
            .first()
            .map(String::as_str)
            .unwrap_or("gpushare-webhook"),
    );
    params.distinguished_name = dn;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = to_offset(not_before);
    params.not_after = to_offset(not_after);
    let cert = params.signed_by(&key, &issuer)?;
    Ok(PemPair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// The DNS names a webhook behind Service `service` in `namespace` is called by.
pub fn service_dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
        format!("{service}.{namespace}"),
        service.to_string(),
    ]
}

/// What a certificate says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertInfo {
    /// End of validity.
    pub not_after: SystemTime,
    /// Start of validity.
    pub not_before: SystemTime,
    /// DNS subject alternative names.
    pub dns_names: Vec<String>,
    /// Issuer distinguished name, DER.
    pub issuer: Vec<u8>,
    /// Subject distinguished name, DER.
    pub subject: Vec<u8>,
    /// Whether it is a CA.
    pub is_ca: bool,
    /// The serial number, lower-case hex.
    pub serial: String,
}

fn from_unix(secs: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs.max(0) as u64)
}

/// Reads one DER certificate.
pub fn info(what: &str, der: &[u8]) -> Result<CertInfo, CertError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| unreadable(what, e))?;
    let validity = cert.validity();
    let dns_names = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    x509_parser::extensions::GeneralName::DNSName(d) => Some(d.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(CertInfo {
        not_after: from_unix(validity.not_after.timestamp()),
        not_before: from_unix(validity.not_before.timestamp()),
        dns_names,
        issuer: cert.issuer().as_raw().to_vec(),
        subject: cert.subject().as_raw().to_vec(),
        is_ca: cert.is_ca(),
        serial: cert
            .tbs_certificate
            .raw_serial()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
    })
}

/// The first certificate of a PEM text, read.
pub fn first_info(what: &str, pem: &str) -> Result<CertInfo, CertError> {
    let certs = pem_certs(what, pem)?;
    info(what, &certs[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_serving_cert_is_issued_by_the_ca_for_the_service_names() {
        let now = SystemTime::now();
        let ca = issue_ca(now, CA_VALIDITY).unwrap();
        let names = service_dns_names("gpushare-webhook", "kube-system");
        let leaf = issue_serving(&ca, &names, now, now + Duration::from_secs(86_400)).unwrap();
        let ca_info = first_info("ca", &ca.cert).unwrap();
        let leaf_info = first_info("leaf", &leaf.cert).unwrap();
        assert!(ca_info.is_ca && !leaf_info.is_ca);
        assert_eq!(leaf_info.issuer, ca_info.subject);
        assert!(
            leaf_info
                .dns_names
                .contains(&"gpushare-webhook.kube-system.svc".to_string())
        );
        let left = leaf_info.not_after.duration_since(now).unwrap_or_default();
        assert!(left > Duration::from_secs(86_000) && left <= Duration::from_secs(86_400));
        assert!(ServingCert::new(&leaf).is_ok());
        let mismatched = PemPair {
            cert: leaf.cert.clone(),
            key: ca.key.clone(),
        };
        assert!(ServingCert::new(&mismatched).is_err());
    }

    #[test]
    fn garbage_pem_is_an_error_not_a_panic() {
        assert!(first_info("x", "not a pem").is_err());
        assert!(
            certified_key(
                &PemPair {
                    cert: "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into(),
                    key: "nope".into()
                },
                "x"
            )
            .is_err()
        );
    }
}
