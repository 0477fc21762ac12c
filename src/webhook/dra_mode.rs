//! The webhook's DRA mode: which path an `aliyun.com/gpu-mem` pod takes, and on the DRA path
//! its rewrite into one ResourceClaim.
//!
//! The path is the namespace's label `gpushare.io/gpu-mem-path` (`dra` or `extender`) when it
//! has one, else `webhook.gpu_mem_path`: the label wins both ways. On the extender path the
//! pod gets what [`super::admission::mutate`] gives it (our scheduler). On the DRA path it is
//! rewritten by [`super::dra_rewrite`] (one claim from a ResourceClaimTemplate, one
//! request per GPU container, and the devices of the kinds `[devices]` enables the pod asks for
//! in its limits, an HCA aligned with its container's GPU) and the template is made to exist
//! in the pod's namespace first:
//! created, an `AlreadyExists` is fine (pods of one shape share it), and a create whose answer
//! was lost is settled by reading the template. A dry run creates nothing (the webhook
//! configurations say `sideEffects: NoneOnDryRun`). Pods that already name claims are left
//! alone.
//!
//! What it does not do: judge malformed requests (the validating endpoint refuses them; here
//! they are admitted unchanged), delete templates, or talk to nodes.

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::api::{Api, PostParams};

use super::admission::{self, ReviewError, ReviewRequest, Verdict};
use super::dra_rewrite::{self, RewriteError};
use crate::config::GpuMemPath;
use crate::core::MemoryUnit;
use crate::core::wire::DRA_DEVICE_CLASS;
use crate::k8s::retry::{is_transient, retry_attempts};

/// The namespace label that picks the path of its gpu-mem pods (`dra` or `extender`).
pub const NAMESPACE_LABEL_GPU_MEM_PATH: &str = "gpushare.io/gpu-mem-path";

/// Tries of one API call on the admission path (the API server's own timeout bounds them).
const ATTEMPTS: u32 = 3;

/// What the DRA mode needs: the API (namespaces, templates), the cluster-wide path, the unit
/// and the driver.
#[derive(Clone)]
pub struct DraMode {
    client: kube::Client,
    default_path: GpuMemPath,
    unit: MemoryUnit,
    driver: String,
    kinds: Vec<dra_rewrite::KindRequest>,
}

impl std::fmt::Debug for DraMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraMode")
            .field("default_path", &self.default_path)
            .field("unit", &self.unit)
            .field("driver", &self.driver)
            .field("kinds", &self.kinds)
            .finish_non_exhaustive()
    }
}

/// Why a gpu-mem pod could not be admitted on its path (answered as a refusal that says so).
#[derive(Debug, thiserror::Error)]
pub enum DraModeError {
    /// The pod's namespace could not be read, so its path is unknown.
    #[error(
        "cannot read namespace {namespace} to learn its {NAMESPACE_LABEL_GPU_MEM_PATH} label: {source}"
    )]
    Namespace {
        /// The namespace.
        namespace: String,
        /// The API's answer.
        source: kube::Error,
    },
    /// The namespace's label names no path.
    #[error(
        "namespace {namespace} has {NAMESPACE_LABEL_GPU_MEM_PATH}={value:?}; write dra or extender"
    )]
    Label {
        /// The namespace.
        namespace: String,
        /// The label's value.
        value: String,
    },
    /// The ResourceClaimTemplate of the pod's claim could not be made to exist.
    #[error("cannot make sure ResourceClaimTemplate {namespace}/{name} exists: {source}")]
    Template {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The API's answer.
        source: kube::Error,
    },
    /// The pod could not be rewritten.
    #[error(transparent)]
    Rewrite(#[from] RewriteError),
}

impl DraMode {
    /// The mode over `client`, with `default_path` for namespaces without the label, the
    /// memory unit `unit` (`node.memory_unit`: what one `aliyun.com/gpu-mem` is in bytes, the
    /// DRA plugins' unit) and the DRA driver `driver` (`dra.driver_name`: the plugins' driver,
    /// whose `<driver>/uuid` keeps a pod's requests on one GPU).
    pub fn new(
        client: kube::Client,
        default_path: GpuMemPath,
        unit: MemoryUnit,
        driver: &str,
    ) -> DraMode {
        DraMode {
            client,
            default_path,
            unit,
            driver: driver.to_string(),
            kinds: Vec::new(),
        }
    }

    /// The same, moving the devices of `kinds` a gpu-mem pod asks for into its claim
    /// ([`dra_rewrite::kind_requests`] of `[devices]`).
    pub fn with_kinds(mut self, kinds: Vec<dra_rewrite::KindRequest>) -> DraMode {
        self.kinds = kinds;
        self
    }

    /// The path of gpu-mem pods in `namespace`: its label, else the cluster-wide default. A
    /// namespace that is not there (yet) has no label.
    pub async fn path_of(&self, namespace: &str) -> Result<GpuMemPath, DraModeError> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        let found = retry_attempts(ATTEMPTS, || api.get_opt(namespace))
            .await
            .map_err(|source| DraModeError::Namespace {
                namespace: namespace.to_string(),
                source,
            })?;
        let label = found
            .and_then(|n| n.metadata.labels)
            .and_then(|mut l| l.remove(NAMESPACE_LABEL_GPU_MEM_PATH));
        match label.as_deref() {
            None => Ok(self.default_path),
            Some("dra") => Ok(GpuMemPath::Dra),
            Some("extender") => Ok(GpuMemPath::Extender),
            Some(other) => Err(DraModeError::Label {
                namespace: namespace.to_string(),
                value: other.to_string(),
            }),
        }
    }

    /// Makes sure `template` exists: create; `AlreadyExists` is fine; an unknown outcome is
    /// settled by reading it (and creating again when it is not there).
    pub async fn ensure_template(
        &self,
        template: &ResourceClaimTemplate,
    ) -> Result<(), DraModeError> {
        let namespace = template.metadata.namespace.clone().unwrap_or_default();
        let name = template.metadata.name.clone().unwrap_or_default();
        let api: Api<ResourceClaimTemplate> = Api::namespaced(self.client.clone(), &namespace);
        let failed = |source| DraModeError::Template {
            namespace: namespace.clone(),
            name: name.clone(),
            source,
        };
        let mut tried = 0u32;
        loop {
            tried += 1;
            let err = match api.create(&PostParams::default(), template).await {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(s)) if s.code == 409 => return Ok(()),
                Err(e) => e,
            };
            // Lost or refused: whether it landed is told by reading it.
            match retry_attempts(ATTEMPTS, || api.get_opt(&name)).await {
                Ok(Some(_)) => return Ok(()),
                Ok(None) if is_transient(&err) && tried < ATTEMPTS => continue,
                Ok(None) => return Err(failed(err)),
                Err(e) => return Err(failed(e)),
            }
        }
    }

    /// `POST /mutate` with the DRA mode, of a review parsed once (the caller's): see the
    /// module documentation. A pod on the extender path gets [`admission::mutate_pod`] of the
    /// same decoded pod.
    pub(crate) async fn mutate(
        &self,
        review: &ReviewRequest,
        scheduler_name: &str,
    ) -> Result<Verdict, ReviewError> {
        let pod: Pod = match admission::pod_of(review)? {
            Err(verdict) => return Ok(verdict),
            Ok(None) => return Ok(Verdict::allow()),
            Ok(Some(pod)) if admission::asks_for_gpu_mem(&pod) => pod,
            Ok(Some(pod)) => return Ok(admission::mutate_pod(&pod, scheduler_name)),
        };
        let namespace = if review.namespace.is_empty() {
            pod.metadata.namespace.clone().unwrap_or_default()
        } else {
            review.namespace.clone()
        };
        match self.dra_verdict(&pod, &namespace, review.dry_run).await {
            Ok(Some(verdict)) => Ok(verdict),
            Ok(None) => Ok(admission::mutate_pod(&pod, scheduler_name)),
            Err(e) => {
                tracing::warn!(namespace, error = %e, "gpu-mem pod refused by the DRA mode");
                Ok(Verdict {
                    allowed: false,
                    message: Some(format!("gpushare: {e}")),
                    ..Verdict::default()
                })
            }
        }
    }

    /// The verdict on the DRA path; `None` when the pod takes the extender path.
    async fn dra_verdict(
        &self,
        pod: &Pod,
        namespace: &str,
        dry_run: bool,
    ) -> Result<Option<Verdict>, DraModeError> {
        if self.path_of(namespace).await? == GpuMemPath::Extender {
            return Ok(None);
        }
        let rewritten = match dra_rewrite::rewrite_with_kinds(
            pod,
            namespace,
            self.unit,
            &self.driver,
            DRA_DEVICE_CLASS,
            &self.kinds,
        ) {
            Ok(r) => r,
            // Malformed: the validating endpoint refuses it with the fix; nothing to do here.
            Err(RewriteError::Request(_)) => None,
            Err(e) => return Err(e.into()),
        };
        let Some(rewritten) = rewritten else {
            // Already written with claims (or no memory after all): left alone.
            return Ok(Some(Verdict {
                allowed: true,
                ..Verdict::default()
            }));
        };
        if !dry_run {
            self.ensure_template(&rewritten.template).await?;
        }
        Ok(Some(Verdict {
            allowed: true,
            patch: rewritten.patch,
            ..Verdict::default()
        }))
    }
}
