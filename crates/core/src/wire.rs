//! Every name gpushare puts on the wire, in one place.
//!
//! The upstream names (resource names, annotation keys, env names, labels, socket, ConfigMap,
//! URL prefix) are a contract with existing clusters and must stay byte-identical
//! (reference spec §2). The names under `gpushare.io/` are ours: they carry what upstream
//! could not express (per-GPU memory and health on the node, per-container progress on the
//! pod) and are documented in docs/migration.md.

/// Extended resource: GPU memory in the device plugin's unit.
pub const RESOURCE_GPU_MEM: &str = "aliyun.com/gpu-mem";
/// Extended resource on the node status: number of physical GPUs.
pub const RESOURCE_GPU_COUNT: &str = "aliyun.com/gpu-count";

/// Pod annotation: the chosen GPU index (decimal).
pub const ANN_GPU_INDEX: &str = "ALIYUN_COM_GPU_MEM_IDX";
/// Pod annotation: the pod's total GPU memory (decimal units).
pub const ANN_POD_MEM: &str = "ALIYUN_COM_GPU_MEM_POD";
/// Pod annotation: the memory of the chosen GPU (decimal units; informational).
pub const ANN_DEVICE_MEM: &str = "ALIYUN_COM_GPU_MEM_DEV";
/// Pod annotation: `"false"` after bind, `"true"` once the device plugin allocated it.
pub const ANN_ASSIGNED: &str = "ALIYUN_COM_GPU_MEM_ASSIGNED";
/// Pod annotation: bind time, overwritten by allocation time (Unix nanoseconds).
pub const ANN_ASSUME_TIME: &str = "ALIYUN_COM_GPU_MEM_ASSUME_TIME";
/// Pod annotation written by ACK's closed scheduler plugin; read by inspect only.
pub const ANN_ALLOCATION_JSON: &str = "scheduler.framework.gpushare.allocation";

/// Container env: the GPU the runtime exposes.
pub const ENV_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Container env: GPU index.
pub const ENV_GPU_INDEX: &str = "ALIYUN_COM_GPU_MEM_IDX";
/// Container env: memory of this Allocate call.
pub const ENV_POD_MEM: &str = "ALIYUN_COM_GPU_MEM_POD";
/// Container env: memory of this container.
pub const ENV_CONTAINER_MEM: &str = "ALIYUN_COM_GPU_MEM_CONTAINER";
/// Container env: memory of the whole GPU.
pub const ENV_DEVICE_MEM: &str = "ALIYUN_COM_GPU_MEM_DEV";
/// Container env for Aliyun's proprietary cGPU module.
pub const ENV_CGPU_DISABLE: &str = "CGPU_DISABLE";
/// Container env set in MPS mode: the per-client pinned device memory limit.
pub const ENV_MPS_PINNED_MEM_LIMIT: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// Container env set in MPS mode: the share of SMs a client may use.
pub const ENV_MPS_ACTIVE_THREAD_PERCENTAGE: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
/// Container env set in MPS mode: where the MPS control pipes are.
pub const ENV_MPS_PIPE_DIRECTORY: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// Container env under driver enforcement (NVIDIA's container toolkit reads it for its own
/// `apply-cuda-memory-limits` hook): the soft limit in MiB.
pub const ENV_GPU_MEMORY_REQUEST: &str = "NVIDIA_GPU_MEMORY_REQUEST";
/// Container env under driver enforcement: the hard limit in MiB.
pub const ENV_GPU_MEMORY_LIMIT: &str = "NVIDIA_GPU_MEMORY_LIMIT";

/// Node label that selects the device plugin DaemonSet.
pub const LABEL_GPUSHARE: &str = "gpushare";
/// Node label read by the device plugin for Aliyun's cGPU module.
pub const LABEL_CGPU_DISABLE: &str = "cgpu.disable.isolation";
/// Pod label of the device plugin pods.
pub const LABEL_COMPONENT: &str = "component";

/// Device plugin socket name inside the device-plugin directory.
pub const PLUGIN_SOCKET: &str = "aliyungpushare.sock";
/// Kubelet registration socket name inside the device-plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Default kubelet device-plugin directory.
pub const DEFAULT_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
/// Default kubelet pod-resources socket.
pub const DEFAULT_POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// Device plugin API version we register with.
pub const DEVICE_PLUGIN_API_VERSION: &str = "v1beta1";
/// Separator of fake device IDs: `<UUID>-_-<n>`.
pub const FAKE_ID_SEPARATOR: &str = "-_-";
/// Health strings of the device plugin API.
pub const HEALTHY: &str = "Healthy";
/// Health strings of the device plugin API.
pub const UNHEALTHY: &str = "Unhealthy";

/// Namespace of the unhealthy-GPU ConfigMaps.
pub const UNHEALTHY_CONFIGMAP_NAMESPACE: &str = "kube-system";
/// Name prefix of the unhealthy-GPU ConfigMaps (`unhealthy-gpu-<node>`).
pub const UNHEALTHY_CONFIGMAP_PREFIX: &str = "unhealthy-gpu-";
/// Key of the unhealthy-GPU ConfigMaps: comma-separated GPU indices.
pub const UNHEALTHY_CONFIGMAP_KEY: &str = "gpus";

/// Default extender URL prefix.
pub const EXTENDER_URL_PREFIX: &str = "/gpushare-scheduler";
/// Upstream's event source component.
pub const EXTENDER_COMPONENT: &str = "gpushare-schd-extender";
/// Our device plugin's event source component.
pub const DEVICE_PLUGIN_COMPONENT: &str = "gpushare-device-plugin";

/// Node annotation (ours): the GPUs the device plugin serves, as JSON
/// `[{"index":0,"uuid":"GPU-…","memory":15,"healthy":true}]` (memory in units).
pub const NODE_ANN_DEVICES: &str = "gpushare.io/devices";
/// Node annotation (ours): GPUs the device plugin saw but does not offer, and why, as JSON
/// `[{"index":0,"uuid":"GPU-…","reason":"MIG mode is enabled: …"}]`; `[]` when none.
pub const NODE_ANN_EXCLUDED_GPUS: &str = "gpushare.io/excluded-gpus";
/// Node annotation (ours): the GPUs the device plugin offers and those it holds back (another
/// path serves them, or that path's pods still hold memory on them), as JSON
/// `{"offered":[0,1],"heldBack":{"2":"…"}}`; removed when the device plugin stops.
pub const NODE_ANN_DEVICE_PLUGIN_GPUS: &str = "gpushare.io/device-plugin-gpus";
/// Node annotation (ours): the same for the DRA kubelet plugin.
pub const NODE_ANN_DRA_GPUS: &str = "gpushare.io/dra-gpus";
/// Node annotation (ours): the unit the device plugin counts in (`GiB`, `MiB`, `256MiB`).
pub const NODE_ANN_MEMORY_UNIT: &str = "gpushare.io/memory-unit";
/// Node annotation (ours): under driver enforcement, each served container's GPU memory limit
/// and use as the node agent last read them back, as JSON
/// `[{"namespace":"d","pod":"p","container":"c","gpu":"GPU-…","index":0,"expected":4294967296,
/// "limit":4294967296,"used":1073741824,"state":"enforced"}]` (bytes).
pub const NODE_ANN_CONTAINER_GPU_MEMORY: &str = "gpushare.io/container-gpu-memory";
/// Pod annotation (ours): names of the pod's GPU containers already allocated, comma-separated.
pub const POD_ANN_ALLOCATED_CONTAINERS: &str = "gpushare.io/allocated-containers";
/// Pod annotation (ours): the reservation a bind holds while its Binding may still land, as
/// JSON `{"node":"n1","gpu":0,"since":1733380000000000000}` (since: Unix nanoseconds). Written
/// with the Aliyun annotations before the Binding is sent, so any successor of the extender
/// that sent it reads what the pod is promised and counts it until the API settles it.
pub const POD_ANN_RESERVATION: &str = "gpushare.io/reservation";

// The DRA path (`resource.k8s.io/v1`): names the DRA kubelet plugin publishes and the
// webhook's DRA rewrite writes; both sides must agree.
/// Default DRA driver name (`gpushare dra-plugin --driver-name`).
pub const DRA_DRIVER_NAME: &str = "gpushare.io";
/// The DeviceClass the chart installs and the webhook's claims name.
pub const DRA_DEVICE_CLASS: &str = "gpu-mem.gpushare.io";
/// The consumable capacity of each published GPU, in bytes.
pub const DRA_CAPACITY_MEMORY: &str = "memory";
/// The fewest whole memory units a GPU must hold to be published on the DRA path: its
/// [`DRA_CAPACITY_MEMORY`] has a `requestPolicy.validRange` of `min` and `step` one unit, and
/// the API server refuses a device whose `min + step` exceeds its value (and with it the
/// node's whole slice). A GPU of fewer units is left out of the slice, by name.
pub const DRA_MIN_UNITS_PER_GPU: u64 = 2;
/// Device attribute: the GPU's UUID (`matchAttribute` keeps a pod's requests on one GPU).
pub const DRA_ATTR_UUID: &str = "uuid";
/// Device attribute: the GPU's enumeration index.
pub const DRA_ATTR_INDEX: &str = "index";
/// Device attribute: the GPU's product name.
pub const DRA_ATTR_PRODUCT_NAME: &str = "productName";
/// Device attribute: the NVIDIA driver version.
pub const DRA_ATTR_DRIVER_VERSION: &str = "driverVersion";
/// Standard device attribute: the GPU's PCIe root complex (`pci<domain>:<bus>`).
pub const DRA_ATTR_PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// Device attribute: what the device is, [`DRA_TYPE_GPU`], [`DRA_TYPE_RDMA`] or
/// [`DRA_TYPE_GENERIC`]; the GPU DeviceClass selects on it.
pub const DRA_ATTR_TYPE: &str = "type";
/// [`DRA_ATTR_TYPE`] of a GPU.
pub const DRA_TYPE_GPU: &str = "gpu";
/// [`DRA_ATTR_TYPE`] of an RDMA HCA.
pub const DRA_TYPE_RDMA: &str = "rdma";
/// [`DRA_ATTR_TYPE`] of a device declared in `[[devices.generic]]`.
pub const DRA_TYPE_GENERIC: &str = "generic";
/// Device attribute of a device other than a GPU: the extended resource its kind is served
/// as on the device-plugin path (`gpushare.io/rdma`, `example.com/fuse`); the kind's
/// DeviceClass selects on it.
pub const DRA_ATTR_RESOURCE: &str = "resource";
/// The consumable capacity of a device other than a GPU shared by several pods: how many
/// pods may hold it (`shares_per_hca`, a declaration's `shares`); each claim takes one.
pub const DRA_CAPACITY_SHARES: &str = "shares";
/// Standard device attribute: the device's NUMA node (an integer).
pub const DRA_ATTR_NUMA_NODE: &str = "resource.kubernetes.io/numaNode";
/// Standard device attribute: the device's PCI address (`dddd:bb:dd.f`).
pub const DRA_ATTR_PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";

/// The CEL selector of the GPU DeviceClass ([`DRA_DEVICE_CLASS`]) of driver `driver`: its
/// devices whose [`DRA_ATTR_TYPE`] is [`DRA_TYPE_GPU`].
///
/// Every attribute it reads is guarded by `has()`: upstream's allocator turns a CEL runtime
/// error (`no such key`) of a class selector into an allocation error for the whole claim, so
/// a selector must evaluate to a boolean on every device of the driver's pools, whatever its
/// kind. (CEL's `&&` is commutative on errors, so a false `device.driver` test alone guards
/// nothing against another device of the same driver.)
pub fn dra_gpu_class_selector(driver: &str) -> String {
    let attrs = format!("device.attributes[\"{driver}\"]");
    format!(
        "device.driver == \"{driver}\" && has({attrs}.{DRA_ATTR_TYPE}) && {attrs}.{DRA_ATTR_TYPE} == \"{DRA_TYPE_GPU}\""
    )
}

/// The CEL selector of the DeviceClass of the device kind served as `resource`: the
/// devices of driver `driver` whose [`DRA_ATTR_RESOURCE`] is `resource` (the GPUs have none:
/// guarded by `has()`, as [`dra_gpu_class_selector`] says why).
pub fn dra_kind_class_selector(driver: &str, resource: &str) -> String {
    let attrs = format!("device.attributes[\"{driver}\"]");
    format!(
        "device.driver == \"{driver}\" && has({attrs}.{DRA_ATTR_RESOURCE}) && {attrs}.{DRA_ATTR_RESOURCE} == \"{resource}\""
    )
}

/// The DeviceClass name of the device kind served as `resource` (`<domain>/<name>`):
/// `<name>.<domain>` (`gpushare.io/rdma` → `rdma.gpushare.io`), as the GPU's is
/// `gpu-mem.gpushare.io`; `None` when `resource` has no domain.
pub fn dra_kind_class_name(resource: &str) -> Option<String> {
    let (domain, name) = resource.split_once('/')?;
    (!domain.is_empty() && !name.is_empty()).then(|| format!("{name}.{domain}"))
}

/// Device taint key of an unhealthy GPU (effect `NoSchedule`).
pub const DRA_TAINT_UNHEALTHY: &str = "gpushare.io/unhealthy";
/// The pod's claim entry (`spec.resourceClaims[].name`) the webhook's DRA rewrite adds.
pub const DRA_POD_CLAIM: &str = "gpushare-gpu-mem";
/// Pod annotation (ours): what the DRA rewrite replaced, `{"<container>": <units>, …}` with
/// the memory unit, as JSON (`{"unit":"GiB","containers":{…}}`).
pub const POD_ANN_DRA_GPU_MEM: &str = "gpushare.io/dra-gpu-mem";

/// Whether a pod annotation key is one gpushare (ours or upstream's) writes and reads:
/// `ALIYUN_COM_GPU_MEM_*`, `gpushare.io/*` and the scheduler framework's allocation JSON.
/// Bind removes every such key it does not set (a clean slate).
pub fn is_our_pod_annotation(key: &str) -> bool {
    key.starts_with("ALIYUN_COM_GPU_MEM_")
        || key.starts_with("gpushare.io/")
        || key == ANN_ALLOCATION_JSON
}

/// The fake device ID of unit `n` of the GPU with `uuid`.
pub fn fake_device_id(uuid: &str, n: u64) -> String {
    format!("{uuid}{FAKE_ID_SEPARATOR}{n}")
}

/// The GPU UUID and unit number of a fake device ID; `None` when it is not one.
pub fn parse_fake_device_id(id: &str) -> Option<(&str, u64)> {
    let (uuid, n) = id.rsplit_once(FAKE_ID_SEPARATOR)?;
    if uuid.is_empty() {
        return None;
    }
    Some((uuid, n.parse().ok()?))
}

/// Name of the unhealthy-GPU ConfigMap of `node`.
pub fn unhealthy_configmap_name(node: &str) -> String {
    format!("{UNHEALTHY_CONFIGMAP_PREFIX}{node}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_ids_round_trip() {
        let id = fake_device_id("GPU-1234-abcd", 7);
        assert_eq!(id, "GPU-1234-abcd-_-7");
        assert_eq!(parse_fake_device_id(&id), Some(("GPU-1234-abcd", 7)));
        assert_eq!(parse_fake_device_id("GPU-1234"), None);
        assert_eq!(parse_fake_device_id("-_-3"), None);
        assert_eq!(parse_fake_device_id("GPU-x-_-z"), None);
    }
}
