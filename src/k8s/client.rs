//! Building a `kube::Client`: an explicit kubeconfig (flag or `[cluster] kubeconfig`), else
//! `$KUBECONFIG` (several paths merged) / `~/.kube/config`, else the in-cluster service account.
//!
//! A client that cannot be built from the configuration (no kubeconfig, an unreadable one)
//! is a configuration error ([`crate::failure::config`], exit 78).
//!
//! No system CA store is needed: TLS uses rustls with the kubeconfig's or the service
//! account's CA, falling back to the bundled webpki roots, so the static binary works in an
//! empty root filesystem.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::failure;

/// How to reach the API server.
#[derive(Clone, Debug, Default)]
pub struct ClientOptions<'a> {
    /// Kubeconfig file; `None` or empty means infer.
    pub kubeconfig: Option<&'a str>,
    /// Context to use from the kubeconfig.
    pub context: Option<&'a str>,
    /// Timeout of each request (None keeps kube's default).
    pub timeout: Option<Duration>,
    /// Turns off kube's own quiet retry of 429 / 503 / 504 (up to 15 tries over minutes), for
    /// a caller that retries itself and logs each try ([`super::reachable`]).
    pub without_kube_retry: bool,
}

/// A client per `opts`.
pub async fn client(opts: &ClientOptions<'_>) -> anyhow::Result<kube::Client> {
    let kube_opts = KubeConfigOptions {
        context: opts.context.map(str::to_string),
        ..KubeConfigOptions::default()
    };
    let mut config = match opts.kubeconfig.filter(|p| !p.is_empty()) {
        Some(path) => {
            let kc = Kubeconfig::read_from(Path::new(path))
                .with_context(|| format!("reading kubeconfig {path}"))
                .map_err(failure::config)?;
            kube::Config::from_custom_kubeconfig(kc, &kube_opts)
                .await
                .with_context(|| format!("using kubeconfig {path}"))
                .map_err(failure::config)?
        }
        None => match kube::Config::from_kubeconfig(&kube_opts).await {
            Ok(c) => c,
            Err(kc_err) => kube::Config::incluster().map_err(|ic_err| {
                failure::config(anyhow::anyhow!(
                    "no cluster configuration: kubeconfig ({kc_err}); in-cluster ({ic_err}); \
                     pass --kubeconfig or set KUBECONFIG"
                ))
            })?,
        },
    };
    if let Some(t) = opts.timeout {
        config.read_timeout = Some(t);
        config.write_timeout = Some(t);
        config.connect_timeout = Some(t);
    }
    if opts.without_kube_retry {
        config.default_retry = false;
    }
    kube::Client::try_from(config).context("building the Kubernetes client")
}
