//! `--self-signed`: one CA and serving certificate for all replicas, kept in a Secret, and the
//! CA written into the `caBundle` of the Mutating- and ValidatingWebhookConfiguration.
//!
//! Every replica runs the same loop ([`Bootstrap::reconcile`]): read the Secret; when it is
//! missing, create it (create-if-absent: the API server lets exactly one create win, the
//! others get 409 and read the winner's) — with the material the replica serves now if it has
//! any, so a deleted Secret comes back with the CA every replica already serves with; when it is due for renewal or unusable, rewrite it
//! with a `resourceVersion` precondition (a replica that loses the race gets 409 and reads the
//! new one). A timeout or a dropped connection is an unknown outcome: the loop reads the
//! Secret again rather than assuming either way. Then the CA goes into every webhook of both
//! configurations (a merge patch of the whole `webhooks` list, raw JSON so that no field of a
//! newer API is lost, with a `resourceVersion` precondition, so no replica's update is lost).
//! The caBundle is a union, never a replacement: a still-valid CA it held that the Secret no
//! longer names (a replica may still serve with it until its next look at the Secret) stays
//! for the retention period (three refresh periods), its retirement time recorded in the
//! configuration's `gpushare.io/retired-cas` annotation (`{"<serial hex>": <unix seconds>}`). The loop repeats, so a
//! `helm upgrade` that empties the caBundle, or a renewal by another replica, is picked up.
//!
//! It does not serve anything: the caller swaps the served certificate
//! ([`super::certs::ServingCert`]).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};

use super::certs::{self, CertError, PemPair};

/// Keys of the Secret (`kubernetes.io/tls` plus the CA).
pub const KEY_TLS_CRT: &str = "tls.crt";
/// The serving key.
pub(crate) const KEY_TLS_KEY: &str = "tls.key";
/// The CA bundle (signing CA first).
pub const KEY_CA_CRT: &str = "ca.crt";
/// The CA key, so that any replica can renew.
pub const KEY_CA_KEY: &str = "ca.key";

/// How many read-decide-write rounds one reconcile tries before giving up for this round.
const ROUNDS: usize = 8;

/// Why a reconcile round failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BootstrapError {
    /// The API server refused or could not be reached.
    #[error("{action}: {source}")]
    Api {
        /// What we were doing.
        action: String,
        /// The error.
        #[source]
        source: kube::Error,
    },
    /// Issuing or reading certificates failed.
    #[error(transparent)]
    Cert(#[from] CertError),
    /// Every round lost a race or met an unknown outcome.
    #[error("{0}: no agreement after {ROUNDS} rounds (conflicts or lost answers); will retry")]
    Contended(String),
}

fn api(action: impl Into<String>) -> impl FnOnce(kube::Error) -> BootstrapError {
    let action = action.into();
    move |source| BootstrapError::Api { action, source }
}

/// The outcome of a write we cannot take as final.
fn is_retryable(err: &kube::Error) -> bool {
    crate::k8s::retry::is_transient(err)
        || matches!(err, kube::Error::Api(s) if s.code == 422 || s.code == 404)
}

/// What the Secret holds, read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Material {
    /// The CA bundle and the signing CA's key.
    pub ca: PemPair,
    /// The serving certificate and key.
    pub serving: PemPair,
}

/// Where the certificates live and what they must cover.
#[derive(Clone)]
pub(crate) struct Bootstrap {
    client: kube::Client,
    namespace: String,
    secret: String,
    webhook_config: String,
    dns_names: Vec<String>,
    validity: Duration,
    renew_before: Duration,
    /// How long a CA stays in the caBundle after the Secret stopped naming it.
    retain: Duration,
}

/// Annotation of the webhook configurations: CAs kept in the caBundle after they left the
/// Secret, by serial, with the Unix second they left it.
pub const ANN_RETIRED_CAS: &str = "gpushare.io/retired-cas";

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bootstrap")
            .field("namespace", &self.namespace)
            .field("secret", &self.secret)
            .field("webhook_config", &self.webhook_config)
            .finish_non_exhaustive()
    }
}

fn days(d: u32) -> Duration {
    Duration::from_secs(u64::from(d) * 24 * 3600)
}

impl Bootstrap {
    /// From `[webhook]`.
    pub fn new(client: kube::Client, config: &crate::config::WebhookConfig) -> Bootstrap {
        Bootstrap {
            client,
            namespace: config.namespace.clone(),
            secret: config.tls_secret.clone(),
            webhook_config: config.webhook_config.clone(),
            dns_names: certs::service_dns_names(&config.service_name, &config.namespace),
            validity: days(config.cert_validity_days),
            renew_before: days(config.renew_before_days),
            retain: 3 * super::DEFAULT_REFRESH,
        }
    }

    /// Keeps a CA that left the Secret in the caBundles for `retain` (three refresh periods:
    /// every live replica has looked at the Secret again by then).
    pub fn retaining(mut self, retain: Duration) -> Bootstrap {
        self.retain = retain;
        self
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Fresh CA (keeping `old_ca` in the bundle while it is valid) and serving certificate.
    fn issue(&self, now: SystemTime, old_ca: Option<&PemPair>) -> Result<Material, CertError> {
        let mut ca = certs::issue_ca(now, certs::CA_VALIDITY)?;
        let signing = ca.clone();
        if let Some(old) = old_ca
            && certs::first_info("old CA", &old.cert).is_ok_and(|i| i.not_after > now)
        {
            ca.cert.push_str(&old.cert);
        }
        let serving = certs::issue_serving(&signing, &self.dns_names, now, now + self.validity)?;
        Ok(Material { ca, serving })
    }

    /// A new serving certificate from the existing CA.
    fn renew_serving(&self, now: SystemTime, ca: &PemPair) -> Result<Material, CertError> {
        let serving = certs::issue_serving(ca, &self.dns_names, now, now + self.validity)?;
        Ok(Material {
            ca: ca.clone(),
            serving,
        })
    }

    /// What to do with the stored material: keep it, renew the serving certificate, or start
    /// over with a new CA.
    fn judge(&self, m: &Material, now: SystemTime) -> Judgement {
        let due = |not_after: SystemTime| {
            not_after
                .duration_since(now)
                .map_or(true, |left| left < self.renew_before)
        };
        let Ok(ca) = certs::first_info(KEY_CA_CRT, &m.ca.cert) else {
            return Judgement::NewCa("ca.crt is unreadable");
        };
        if !ca.is_ca || certs::certified_key(&m.ca, "CA").is_err() {
            return Judgement::NewCa("ca.crt and ca.key are not a CA and its key");
        }
        if due(ca.not_after) {
            return Judgement::NewCa("the CA expires soon");
        }
        let Ok(leaf) = certs::first_info(KEY_TLS_CRT, &m.serving.cert) else {
            return Judgement::Renew("tls.crt is unreadable");
        };
        if certs::certified_key(&m.serving, "serving").is_err() {
            return Judgement::Renew("tls.crt and tls.key do not match");
        }
        if leaf.issuer != ca.subject {
            return Judgement::Renew("tls.crt was not issued by ca.crt");
        }
        if !self.dns_names.iter().all(|n| leaf.dns_names.contains(n)) {
            return Judgement::Renew("tls.crt does not name the Service");
        }
        if due(leaf.not_after) {
            return Judgement::Renew("tls.crt expires soon");
        }
        Judgement::Keep
    }

    /// Reads or creates the Secret, renewing what is due; returns what every replica now
    /// agrees on. `held`: what this replica serves now (re-creates a deleted Secret with it).
    pub(crate) async fn ensure_secret(
        &self,
        now: SystemTime,
        held: Option<&Material>,
    ) -> Result<Material, BootstrapError> {
        let secrets = self.secrets();
        let what = format!("Secret {}/{}", self.namespace, self.secret);
        for _ in 0..ROUNDS {
            let current = match secrets.get_opt(&self.secret).await {
                Ok(c) => c,
                Err(e) if crate::k8s::retry::is_transient(&e) => continue,
                Err(e) => return Err(api(format!("reading {what}"))(e)),
            };
            let Some(current) = current else {
                // Re-created with what this replica serves: the CA every replica trusts stays.
                let fresh = match held {
                    Some(m) => m.clone(),
                    None => self.issue(now, None)?,
                };
                match secrets
                    .create(&PostParams::default(), &self.secret_object(&fresh))
                    .await
                {
                    Ok(created) => {
                        tracing::info!(secret = %what, "created the webhook CA and serving certificate");
                        return Ok(read_secret(&created).unwrap_or(fresh));
                    }
                    // 409: another replica created it first; anything else unknown: read it.
                    Err(e) if is_retryable(&e) => continue,
                    Err(e) => return Err(api(format!("creating {what}"))(e)),
                }
            };
            let rv = current
                .metadata
                .resource_version
                .clone()
                .unwrap_or_default();
            let stored = read_secret(&current);
            let next = match &stored {
                None => {
                    tracing::warn!(secret = %what, "the Secret lacks ca.crt/ca.key/tls.crt/tls.key; replacing it");
                    self.issue(now, None)?
                }
                Some(m) => match self.judge(m, now) {
                    Judgement::Keep => return Ok(m.clone()),
                    Judgement::Renew(why) => {
                        tracing::info!(secret = %what, why, "renewing the serving certificate");
                        self.renew_serving(now, &m.ca)?
                    }
                    Judgement::NewCa(why) => {
                        tracing::info!(secret = %what, why, "issuing a new CA");
                        self.issue(now, Some(&m.ca))?
                    }
                },
            };
            let patch = json!({
                "metadata": { "resourceVersion": rv },
                "data": secret_data(&next),
            });
            match secrets
                .patch(&self.secret, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(written) => return Ok(read_secret(&written).unwrap_or(next)),
                // 409: another replica renewed first; unknown outcomes: read again.
                Err(e) if is_retryable(&e) => continue,
                Err(e) => return Err(api(format!("renewing {what}"))(e)),
            }
        }
        Err(BootstrapError::Contended(what))
    }

    fn secret_object(&self, m: &Material) -> Secret {
        let data = [
            (KEY_CA_CRT, &m.ca.cert),
            (KEY_CA_KEY, &m.ca.key),
            (KEY_TLS_CRT, &m.serving.cert),
            (KEY_TLS_KEY, &m.serving.key),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
        .collect();
        Secret {
            metadata: ObjectMeta {
                name: Some(self.secret.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(
                    [(
                        "app.kubernetes.io/name".to_string(),
                        "gpushare-webhook".to_string(),
                    )]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            type_: Some("kubernetes.io/tls".to_string()),
            data: Some(data),
            ..Secret::default()
        }
    }

    /// Writes `ca_bundle` into every webhook of both configurations. A configuration that
    /// does not exist (yet) is reported, not an error: the chart may create it later.
    pub(crate) async fn ensure_ca_bundle(
        &self,
        ca_bundle: &str,
        now: SystemTime,
    ) -> Result<Vec<String>, BootstrapError> {
        let mut missing = Vec::new();
        for kind in [
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
        ] {
            if !self.patch_ca_bundle(kind, ca_bundle, now).await? {
                missing.push(format!("{kind} {}", self.webhook_config));
            }
        }
        Ok(missing)
    }

    /// Returns whether the configuration exists.
    async fn patch_ca_bundle(
        &self,
        kind: &str,
        ca_bundle: &str,
        now: SystemTime,
    ) -> Result<bool, BootstrapError> {
        let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            kind,
        ));
        let configs: Api<DynamicObject> = Api::all_with(self.client.clone(), &resource);
        let what = format!("{kind} {}", self.webhook_config);
        for _ in 0..ROUNDS {
            let current = match configs.get_opt(&self.webhook_config).await {
                Ok(Some(c)) => c,
                Ok(None) => return Ok(false),
                Err(e) if crate::k8s::retry::is_transient(&e) => continue,
                Err(e) => return Err(api(format!("reading {what}"))(e)),
            };
            let retired_before = current
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANN_RETIRED_CAS))
                .and_then(|v| serde_json::from_str::<BTreeMap<String, u64>>(v).ok())
                .unwrap_or_default();
            let (bundle, retired) = merged_bundle(
                ca_bundle,
                &bundles_of(&current.data),
                &retired_before,
                now,
                self.retain,
            );
            let encoded = base64::engine::general_purpose::STANDARD.encode(&bundle);
            let webhooks = with_ca_bundle(&current.data, &encoded);
            if webhooks.is_none() && retired == retired_before {
                return Ok(true);
            }
            let retired_value = if retired.is_empty() {
                Value::Null
            } else {
                json!(serde_json::to_string(&retired).unwrap_or_default())
            };
            let mut patch = json!({
                "metadata": {
                    "resourceVersion": current.metadata.resource_version,
                    "annotations": { ANN_RETIRED_CAS: retired_value },
                },
            });
            if let Some(webhooks) = webhooks {
                patch["webhooks"] = json!(webhooks);
            }
            match configs
                .patch(
                    &self.webhook_config,
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
            {
                Ok(_) => {
                    tracing::info!(config = %what, "caBundle written");
                    return Ok(true);
                }
                Err(e) if is_retryable(&e) => continue,
                Err(e) => return Err(api(format!("writing the caBundle of {what}"))(e)),
            }
        }
        Err(BootstrapError::Contended(what))
    }

    /// One round: the Secret, then the caBundles. Returns the material and the
    /// configurations that were not found.
    /// `held`: the material this replica serves now, if any.
    pub async fn reconcile(
        &self,
        held: Option<&Material>,
    ) -> Result<(Material, Vec<String>), BootstrapError> {
        let now = SystemTime::now();
        let material = self.ensure_secret(now, held).await?;
        let missing = self.ensure_ca_bundle(&material.ca.cert, now).await?;
        Ok((material, missing))
    }
}

/// What [`Bootstrap::judge`] decided.
#[derive(Debug, PartialEq, Eq)]
enum Judgement {
    Keep,
    Renew(&'static str),
    NewCa(&'static str),
}

fn secret_data(m: &Material) -> Value {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    json!({
        KEY_CA_CRT: b64(&m.ca.cert),
        KEY_CA_KEY: b64(&m.ca.key),
        KEY_TLS_CRT: b64(&m.serving.cert),
        KEY_TLS_KEY: b64(&m.serving.key),
    })
}

/// The certificates a Secret holds, if all four keys are there as text.
pub(crate) fn read_secret(secret: &Secret) -> Option<Material> {
    let data = secret.data.as_ref()?;
    let text = |k: &str| {
        data.get(k)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
            .filter(|s| !s.trim().is_empty())
    };
    Some(Material {
        ca: PemPair {
            cert: text(KEY_CA_CRT)?,
            key: text(KEY_CA_KEY)?,
        },
        serving: PemPair {
            cert: text(KEY_TLS_CRT)?,
            key: text(KEY_TLS_KEY)?,
        },
    })
}

/// Every certificate the `webhooks` entries' caBundles hold now (DER, once each).
fn bundles_of(data: &Value) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    let entries = data.get("webhooks").and_then(Value::as_array);
    for w in entries.into_iter().flatten() {
        let Some(b64) = w.pointer("/clientConfig/caBundle").and_then(Value::as_str) else {
            continue;
        };
        let Ok(pem) = base64::engine::general_purpose::STANDARD.decode(b64) else {
            continue;
        };
        let pem = String::from_utf8_lossy(&pem);
        for der in certs::pem_certs("caBundle", &pem).unwrap_or_default() {
            if !out.iter().any(|d| d.as_slice() == der.as_ref()) {
                out.push(der.to_vec());
            }
        }
    }
    out
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// PEM text of one DER certificate.
fn pem_of(der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

/// The caBundle to write: the Secret's CAs (`secret_ca`, first), then every CA of `current`
/// that the Secret no longer names, is still valid and left the Secret less than `retain`
/// ago (by `retired`, serial → Unix second; one seen for the first time leaves now). Returns
/// the bundle and the retirement record to store with it.
pub(crate) fn merged_bundle(
    secret_ca: &str,
    current: &[Vec<u8>],
    retired: &BTreeMap<String, u64>,
    now: SystemTime,
    retain: Duration,
) -> (String, BTreeMap<String, u64>) {
    let named: Vec<Vec<u8>> = certs::pem_certs("ca.crt", secret_ca)
        .unwrap_or_default()
        .iter()
        .map(|c| c.to_vec())
        .collect();
    let mut bundle = secret_ca.trim_end().to_string();
    bundle.push('\n');
    let mut kept = BTreeMap::new();
    let now_secs = unix_secs(now);
    for der in current.iter().filter(|d| !named.contains(d)) {
        let Ok(info) = certs::info("caBundle", der) else {
            continue;
        };
        if !info.is_ca || info.not_after <= now {
            continue;
        }
        let since = retired.get(&info.serial).copied().unwrap_or(now_secs);
        if now_secs.saturating_sub(since) < retain.as_secs().max(1) {
            bundle.push_str(&pem_of(der));
            kept.insert(info.serial, since);
        }
    }
    (bundle, kept)
}

/// The `webhooks` list with `clientConfig.caBundle` set to `encoded` in each entry, or `None`
/// when every entry has it already.
pub(crate) fn with_ca_bundle(data: &Value, encoded: &str) -> Option<Vec<Value>> {
    let webhooks = data.get("webhooks")?.as_array()?;
    let mut changed = false;
    let out = webhooks
        .iter()
        .map(|w| {
            let mut w = w.clone();
            if w.pointer("/clientConfig/caBundle").and_then(Value::as_str) != Some(encoded) {
                changed = true;
                if !w.get("clientConfig").is_some_and(Value::is_object) {
                    w["clientConfig"] = json!({});
                }
                w["clientConfig"]["caBundle"] = json!(encoded);
            }
            w
        })
        .collect();
    changed.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_that_left_the_secret_stays_in_the_bundle_for_the_retention_only() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let old = certs::issue_ca(t0, certs::CA_VALIDITY).unwrap();
        let new = certs::issue_ca(t0, certs::CA_VALIDITY).unwrap();
        let current: Vec<Vec<u8>> = certs::pem_certs("old", &old.cert)
            .unwrap()
            .iter()
            .map(|c| c.to_vec())
            .collect();
        let retain = Duration::from_secs(180);
        let (bundle, retired) = merged_bundle(&new.cert, &current, &BTreeMap::new(), t0, retain);
        assert_eq!(certs::pem_certs("b", &bundle).unwrap().len(), 2);
        assert!(bundle.starts_with(new.cert.trim_end()));
        assert_eq!(retired.len(), 1);
        // Within the retention it stays, with its first retirement time.
        let later = t0 + Duration::from_secs(100);
        let (again, kept) = merged_bundle(&new.cert, &current, &retired, later, retain);
        assert_eq!((again, &kept), (bundle, &retired));
        // Past it, it goes.
        let past = t0 + Duration::from_secs(200);
        let (gone, none) = merged_bundle(&new.cert, &current, &retired, past, retain);
        assert_eq!(certs::pem_certs("b", &gone).unwrap().len(), 1);
        assert!(none.is_empty());
    }

    #[test]
    fn the_ca_bundle_goes_into_every_webhook_once() {
        let data = json!({ "webhooks": [
            { "name": "a", "clientConfig": { "service": { "name": "s" } }, "sideEffects": "None" },
            { "name": "b", "clientConfig": { "caBundle": "old" } },
        ]});
        let out = with_ca_bundle(&data, "new").unwrap();
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|w| w["clientConfig"]["caBundle"] == "new"));
        assert_eq!(out[0]["sideEffects"], "None");
        assert_eq!(out[0]["clientConfig"]["service"]["name"], "s");
        assert!(with_ca_bundle(&json!({ "webhooks": out }), "new").is_none());
    }
}
