//! `[webhook]`: the admission webhook of managed clusters (listener, TLS or self-signed
//! certificate, routing) and its checks.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::error::{Check, Error};

/// The path an `aliyun.com/gpu-mem` pod is served by (`webhook.gpu_mem_path`, and per namespace
/// the label `gpushare.io/gpu-mem-path`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum GpuMemPath {
    /// The scheduler extender and the device plugin: the pod keeps its extended resource.
    #[default]
    Extender,
    /// Dynamic Resource Allocation: the webhook rewrites the pod into one ResourceClaim.
    Dra,
}

/// `[webhook]`: the admission webhook of managed clusters (`gpushare webhook`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebhookConfig {
    /// Address to listen on.
    pub bind_address: IpAddr,
    /// HTTPS port.
    pub port: u16,
    /// The scheduler gpu-mem pods are sent to (the chart's `scheduler.name`).
    pub scheduler_name: String,
    /// Largest `aliyun.com/gpu-mem` one pod may ask for, in units: more than any GPU a device
    /// plugin can advertise. The default is the most fake devices a node's ListAndWatch
    /// message can hold.
    pub max_gpu_mem: u64,
    /// PEM certificate (e.g. from cert-manager); with `tls_key`. Re-read when it changes.
    pub tls_cert: String,
    /// PEM private key for `tls_cert`.
    pub tls_key: String,
    /// Make and keep our own CA and serving certificate in a Secret, and write the CA into
    /// the webhook configurations.
    pub self_signed: bool,
    /// The Secret of `self_signed`.
    pub tls_secret: String,
    /// Namespace of the Secret and of the Service.
    pub namespace: String,
    /// The Service in front of the webhook (the serving certificate's DNS names).
    pub service_name: String,
    /// The Mutating- and ValidatingWebhookConfiguration whose `caBundle` `self_signed` writes.
    pub webhook_config: String,
    /// Serving certificate lifetime, in days.
    pub cert_validity_days: u32,
    /// Renew the serving certificate this many days before it expires.
    pub renew_before_days: u32,
    /// The path of `aliyun.com/gpu-mem` pods when their namespace has no
    /// `gpushare.io/gpu-mem-path` label: `extender` (sent to `scheduler_name`) or `dra`
    /// (rewritten into one ResourceClaim).
    pub gpu_mem_path: GpuMemPath,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        WebhookConfig {
            bind_address: IpAddr::from([0, 0, 0, 0]),
            port: 9443,
            scheduler_name: "gpushare-scheduler".to_string(),
            max_gpu_mem: 81_920,
            tls_cert: String::new(),
            tls_key: String::new(),
            self_signed: false,
            tls_secret: "gpushare-webhook-tls".to_string(),
            namespace: "kube-system".to_string(),
            service_name: "gpushare-webhook".to_string(),
            webhook_config: "gpushare-webhook".to_string(),
            cert_validity_days: 365,
            renew_before_days: 30,
            gpu_mem_path: GpuMemPath::Extender,
        }
    }
}

impl WebhookConfig {
    /// The `[webhook]` checks.
    pub fn validate(&self, check: &Check<'_>) -> Result<(), Error> {
        let w = self;
        if w.tls_cert.is_empty() != w.tls_key.is_empty() {
            return Err(check.invalid(
                "webhook.tls_cert",
                "tls_cert and tls_key must be given together".to_string(),
            ));
        }
        if w.self_signed && !w.tls_cert.is_empty() {
            return Err(check.invalid(
                "webhook.self_signed",
                "choose either self_signed or tls_cert/tls_key".to_string(),
            ));
        }
        if w.cert_validity_days <= w.renew_before_days {
            return Err(check.invalid(
                "webhook.cert_validity_days",
                format!(
                    "{} days: must exceed webhook.renew_before_days ({})",
                    w.cert_validity_days, w.renew_before_days
                ),
            ));
        }
        if w.max_gpu_mem == 0 {
            return Err(check.invalid("webhook.max_gpu_mem", "must be above 0".to_string()));
        }
        Ok(())
    }
}
