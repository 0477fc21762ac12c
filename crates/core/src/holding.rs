//! What one pod holds on its GPU: the ONE rule the extender's ledger, the device plugin and
//! `inspect` count a bound pod by, so they cannot disagree.
//!
//! A pod holds the larger of what its containers request now ([`PodGpuRequest::total`],
//! native sidecars included) and what the bind recorded (`ALIYUN_COM_GPU_MEM_POD`): a pod
//! bound by an older extender that missed its sidecars is not under-counted, and a request
//! that cannot be read any more still holds what was recorded. This module does not decide
//! WHICH GPU the pod is on (the annotations say so) nor whether it holds anything at all
//! (bound, not finished: the callers' projection of the Pod decides).

use super::annotations::PodGpuAnnotations;
use super::memory::GpuMem;
use super::request::PodGpuRequest;

/// The memory a bound pod holds on its GPU; `request` is `None` when the pod's limits
/// could not be read.
pub fn pod_holding(request: Option<&PodGpuRequest>, annotations: &PodGpuAnnotations) -> GpuMem {
    let requested = request.map(PodGpuRequest::total).unwrap_or_default();
    requested.max(annotations.pod_mem.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(app: u64, sidecar: u64) -> PodGpuRequest {
        let (a, s) = (app.to_string(), sidecar.to_string());
        PodGpuRequest::from_containers(
            [("app", Some(a.as_str()))],
            [("sc", Some(s.as_str()), true)],
        )
        .expect("valid limits")
    }

    fn recorded(pod_mem: Option<u64>) -> PodGpuAnnotations {
        PodGpuAnnotations {
            pod_mem: pod_mem.map(GpuMem::new),
            ..PodGpuAnnotations::default()
        }
    }

    #[test]
    fn the_larger_of_request_and_record_is_held() {
        // An old bind recorded 16 without the 4-unit sidecar: 20 is held.
        assert_eq!(
            pod_holding(Some(&request(16, 4)), &recorded(Some(16))).units(),
            20
        );
        // A record larger than the request (the spec changed under it) is kept.
        assert_eq!(
            pod_holding(Some(&request(2, 1)), &recorded(Some(8))).units(),
            8
        );
        // Unreadable limits: the record alone.
        assert_eq!(pod_holding(None, &recorded(Some(6))).units(), 6);
        assert_eq!(pod_holding(None, &recorded(None)), GpuMem::ZERO);
    }
}
