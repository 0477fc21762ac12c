//! `[extender]`: the scheduler extender's listener, TLS, binds and leader election, with its
//! checks; and the `HOST[:PORT]` reading of `advertise_address`. It does not check the HTTP
//! deadlines against the bind timeout (a cross-section check of [`super::Config`]).

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::error::{Check, Error};
use crate::core::{GpuPolicy, NodePolicy};

/// `[extender]`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExtenderConfig {
    /// Address to listen on.
    pub bind_address: IpAddr,
    /// Port to listen on (upstream env `PORT`; the upstream manifests use 12345).
    pub port: u16,
    /// URL prefix of the scheduling verbs.
    pub url_prefix: String,
    /// Node scoring in prioritize: binpack | spread.
    pub node_policy: NodePolicy,
    /// GPU choice in bind: binpack (upstream) | spread.
    pub gpu_policy: GpuPolicy,
    /// PEM certificate for HTTPS; empty serves plain HTTP.
    pub tls_cert: String,
    /// PEM private key for HTTPS.
    pub tls_key: String,
    /// PEM CA certificate(s); when set, filter / prioritize / bind / inspect need a client
    /// certificate signed by it (the scheduler's `tlsConfig.certFile`); health, readiness,
    /// version and metrics stay open. Needs `tls_cert`. Re-read when it changes.
    pub tls_client_ca: String,
    /// Largest request body accepted, in bytes (larger gets 413).
    pub max_body_bytes: u64,
    /// Time budget of one bind including retries, in milliseconds (keep it under the
    /// scheduler's `httpTimeout`).
    pub bind_timeout_ms: u64,
    /// How long a Binding whose outcome is unknown (timeout, lost answer) may still land, in
    /// milliseconds: its reservation is kept, and the bind finished, until the API shows the
    /// pod bound, gone or bound elsewhere, or it stays unbound this long (default 60 000, the
    /// API server's own request timeout).
    pub bind_settle_ms: u64,
    /// A watch that keeps failing this long, in milliseconds, makes the ledger stale: the
    /// scheduling verbs and `/readyz` answer 503 until it recovers (default 30 000).
    pub watch_stale_after_ms: u64,
    /// Compete for a Lease; the leader serves the scheduling verbs, the other replicas
    /// forward them to it.
    pub leader_elect: bool,
    /// `HOST[:PORT]` where the other replicas reach this one when it leads; empty means the
    /// `POD_IP` environment variable (else the bind address, when it is not 0.0.0.0) and the
    /// serving port.
    pub advertise_address: String,
    /// Name of the Lease.
    pub lease_name: String,
    /// Namespace of the Lease.
    pub lease_namespace: String,
    /// How long a lease is valid without renewal, in seconds.
    pub lease_duration_secs: u64,
    /// How long the leader keeps trying to renew before it stops serving, in seconds.
    pub renew_deadline_secs: u64,
    /// How often to try to acquire or renew, in seconds.
    pub retry_period_secs: u64,
}

impl Default for ExtenderConfig {
    fn default() -> Self {
        ExtenderConfig {
            bind_address: IpAddr::from([0, 0, 0, 0]),
            port: 39999,
            url_prefix: crate::core::wire::EXTENDER_URL_PREFIX.to_string(),
            node_policy: NodePolicy::Binpack,
            gpu_policy: GpuPolicy::Binpack,
            tls_cert: String::new(),
            tls_key: String::new(),
            tls_client_ca: String::new(),
            max_body_bytes: 32 * 1024 * 1024,
            bind_timeout_ms: 4000,
            bind_settle_ms: 60_000,
            watch_stale_after_ms: 30_000,
            leader_elect: false,
            advertise_address: String::new(),
            lease_name: "gpushare-schd-extender".to_string(),
            lease_namespace: "kube-system".to_string(),
            lease_duration_secs: 15,
            renew_deadline_secs: 10,
            retry_period_secs: 2,
        }
    }
}

impl ExtenderConfig {
    /// The `[extender]` checks of its own (the one against `[http]` is [`super::Config`]'s).
    pub fn validate(&self, check: &Check<'_>) -> Result<(), Error> {
        let e = self;
        if !e.url_prefix.starts_with('/') || e.url_prefix.ends_with('/') && e.url_prefix.len() > 1 {
            return Err(check.invalid(
                "extender.url_prefix",
                format!(
                    "{:?}: must start with '/' and not end with '/'",
                    e.url_prefix
                ),
            ));
        }
        if e.tls_cert.is_empty() != e.tls_key.is_empty() {
            return Err(check.invalid(
                "extender.tls_cert",
                "tls_cert and tls_key must be given together".to_string(),
            ));
        }
        if !e.tls_client_ca.is_empty() && e.tls_cert.is_empty() {
            return Err(check.invalid(
                "extender.tls_client_ca",
                "client certificates need HTTPS: give tls_cert and tls_key too".to_string(),
            ));
        }
        if e.max_body_bytes < 1024 {
            return Err(check.invalid(
                "extender.max_body_bytes",
                "must be at least 1024".to_string(),
            ));
        }
        if e.bind_timeout_ms == 0 {
            return Err(check.invalid("extender.bind_timeout_ms", "must be above 0".to_string()));
        }
        for (key, ms) in [
            ("extender.bind_settle_ms", e.bind_settle_ms),
            ("extender.watch_stale_after_ms", e.watch_stale_after_ms),
        ] {
            if ms == 0 {
                return Err(check.invalid(key, "must be above 0".to_string()));
            }
        }
        if e.retry_period_secs == 0
            || e.renew_deadline_secs <= e.retry_period_secs
            || e.lease_duration_secs <= e.renew_deadline_secs
        {
            return Err(check.invalid(
                "extender.lease_duration_secs",
                format!(
                    "need lease_duration_secs ({}) > renew_deadline_secs ({}) > retry_period_secs ({}) > 0",
                    e.lease_duration_secs, e.renew_deadline_secs, e.retry_period_secs
                ),
            ));
        }
        if e.leader_elect {
            let margin_ms = (e.lease_duration_secs - e.renew_deadline_secs).saturating_mul(1000);
            if e.bind_timeout_ms >= margin_ms {
                return Err(check.invalid(
                    "extender.bind_timeout_ms",
                    format!(
                        "{} ms does not fit inside extender.lease_duration_secs ({}) - \
                         extender.renew_deadline_secs ({}) = {margin_ms} ms: with leader election a \
                         bind of a deposed leader could still write after the next leader took over; \
                         lower bind_timeout_ms or widen the gap between the two",
                        e.bind_timeout_ms, e.lease_duration_secs, e.renew_deadline_secs
                    ),
                ));
            }
        }
        if !e.advertise_address.is_empty()
            && let Err(why) = split_host_port(&e.advertise_address)
        {
            return Err(check.invalid(
                "extender.advertise_address",
                format!("{:?}: {why}", e.advertise_address),
            ));
        }
        Ok(())
    }
}

/// Why a text is no `HOST[:PORT]`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HostPortError {
    /// The port is not 1–65535.
    #[error("port {0:?} is not a number from 1 to 65535")]
    BadPort(String),
    /// `[` without `]`.
    #[error("an opening '[' without ']'")]
    UnclosedBracket,
    /// Brackets around something that is not an IPv6 address.
    #[error("{0:?} in brackets is not an IPv6 address")]
    NotIpv6(String),
    /// Text after `]` that is not `:PORT`.
    #[error("unexpected {0:?} after ']'")]
    AfterBracket(String),
    /// An empty host, or one with characters no host name has.
    #[error("expected HOST[:PORT]")]
    NotHostPort,
}

/// Splits `HOST[:PORT]` (an IPv6 host bare or in brackets: `fe80::1`, `[fe80::1]:8080`).
pub fn split_host_port(s: &str) -> Result<(String, Option<u16>), HostPortError> {
    let port = |p: &str| match p.parse::<u16>() {
        Ok(0) | Err(_) => Err(HostPortError::BadPort(p.to_string())),
        Ok(n) => Ok(Some(n)),
    };
    if let Some(rest) = s.strip_prefix('[') {
        let (host, tail) = rest.split_once(']').ok_or(HostPortError::UnclosedBracket)?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(HostPortError::NotIpv6(host.to_string()));
        }
        return match tail {
            "" => Ok((host.to_string(), None)),
            t => match t.strip_prefix(':') {
                Some(p) => Ok((host.to_string(), port(p)?)),
                None => Err(HostPortError::AfterBracket(t.to_string())),
            },
        };
    }
    if s.parse::<std::net::Ipv6Addr>().is_ok() {
        return Ok((s.to_string(), None));
    }
    let (host, p) = match s.rsplit_once(':') {
        Some((h, p)) => (h, port(p)?),
        None => (s, None),
    };
    if host.is_empty() || host.contains(['/', ' ', '[', ']', ':', '@']) {
        return Err(HostPortError::NotHostPort);
    }
    Ok((host.to_string(), p))
}
