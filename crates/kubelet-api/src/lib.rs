//! Generated gRPC code for the kubelet APIs gpushare speaks (see `proto/README.md`):
//! the device plugin API v1beta1, the pod resources API v1, plugin registration v1 and the
//! DRA kubelet plugin APIs (`DRAPlugin` v1 and v1beta1, `DRAResourceHealth` v1 and v1alpha1).
//!
//! Low in the house: the device plugin and the sandbox kubelet both build on it. Hand-written
//! beyond the module wrappers and a few constants: [`unix_server`], the one way these APIs
//! are served on a unix socket (it accepts the socket path as `:authority`, as kubelet
//! 1.11-1.25 sends it).

/// Kubelet device plugin API v1beta1 (`Registration`, `DevicePlugin`).
#[allow(clippy::all, missing_docs)]
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");
}

/// Kubelet pod resources API v1 (`PodResourcesLister`).
#[allow(clippy::all, missing_docs)]
pub mod podresources {
    tonic::include_proto!("v1");
}

/// Kubelet plugin registration API (`Registration`; proto package `pluginregistration`, the
/// Go package `k8s.io/kubelet/pkg/apis/pluginregistration/v1`), which DRA plugins register
/// through on the kubelet's `plugins_registry` directory.
#[allow(clippy::all, missing_docs)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");

    /// `PluginInfo.type` of a DRA kubelet plugin (upstream `constants.go`).
    pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
}

/// The DRA kubelet plugin APIs: what a kubelet calls on a DRA driver's service socket.
pub mod dra {
    /// `DRAPlugin` v1 (`NodePrepareResources` / `NodeUnprepareResources`, with `share_id`).
    #[allow(clippy::all, missing_docs)]
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");

        /// The name of this service in `PluginInfo.supported_versions` (upstream `types.go`).
        pub const SERVICE: &str = "v1.DRAPlugin";
    }

    /// `DRAPlugin` v1beta1: the same calls without `share_id`, for kubelets 1.32-1.33.
    #[allow(clippy::all, missing_docs)]
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");

        /// The name of this service in `PluginInfo.supported_versions`.
        pub const SERVICE: &str = "v1beta1.DRAPlugin";
    }

    /// `DRAResourceHealth` v1 (`NodeWatchResources`), the only health API kubelets 1.37+ read.
    #[allow(clippy::all, missing_docs)]
    pub mod health_v1 {
        include!(concat!(env!("OUT_DIR"), "/dra_health_v1/v1.rs"));

        /// The name of this service in `PluginInfo.supported_versions` (upstream `types.go`).
        pub const SERVICE: &str = "v1.DRAResourceHealth";
    }

    /// `DRAResourceHealth` v1alpha1, read by kubelets up to 1.36.
    #[allow(clippy::all, missing_docs)]
    pub mod health_v1alpha1 {
        tonic::include_proto!("v1alpha1");

        /// The name of this service in `PluginInfo.supported_versions`.
        pub const SERVICE: &str = "v1alpha1.DRAResourceHealth";
    }
}

#[cfg(unix)]
pub mod unix_server;

/// kubelet's default gRPC receive limit for ListAndWatch messages (4 MiB).
pub const KUBELET_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    /// The gRPC paths a kubelet calls are `/<proto package>.<service>/<method>`: they must be
    /// upstream's exactly, whatever the Rust module is called.
    #[test]
    fn generated_services_have_upstream_grpc_names() {
        assert_eq!(
            pluginregistration::registration_server::SERVICE_NAME,
            "pluginregistration.Registration"
        );
        assert_eq!(
            dra::v1::dra_plugin_server::SERVICE_NAME,
            "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
        );
        assert_eq!(
            dra::v1beta1::dra_plugin_server::SERVICE_NAME,
            "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
        );
        assert_eq!(
            dra::health_v1::dra_resource_health_server::SERVICE_NAME,
            "v1.DRAResourceHealth"
        );
        assert_eq!(
            dra::health_v1alpha1::dra_resource_health_server::SERVICE_NAME,
            "v1alpha1.DRAResourceHealth"
        );
        // The pod-resources API keeps its own module although it shares the package `v1`.
        assert_eq!(
            podresources::pod_resources_lister_server::SERVICE_NAME,
            "v1.PodResourcesLister"
        );
    }

    /// `share_id` is proto3 `optional` in v1 (absent and empty are different on the wire).
    #[test]
    fn v1_devices_carry_an_optional_share_id() {
        use prost::Message;
        let device = dra::v1::Device {
            request_names: vec!["gpu".into()],
            pool_name: "node-a".into(),
            device_name: "gpu-0".into(),
            cdi_device_ids: vec!["k8s.gpushare.io/claim=uid-gpu-0".into()],
            share_id: Some(String::new()),
        };
        let bytes = device.encode_to_vec();
        let back = dra::v1::Device::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(back.share_id, Some(String::new()));
        // v1beta1 has no field 5: a v1 device read as v1beta1 keeps everything else.
        let old = dra::v1beta1::Device::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(old.device_name, "gpu-0");
    }
}
