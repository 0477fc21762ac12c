//! `gpushare doctor --dra`: the set-up the DRA path (`gpushare dra-plugin`) needs, each check
//! with a fix.
//!
//! Node (`--role node`):
//! - `dra-registry-dir`, `dra-plugin-dir`, `dra-cdi-dir`, `dra-state-dir`: kubelet's plugin
//!   registry, the plugin's socket directory, the CDI directory the plugin writes its per-claim
//!   specs in and its state directory (the checkpoint) are directories writable by their owner
//!   (the plugin runs as root);
//! - `dra-cdi-runtime`: the runtime the kubelet uses hands CDI devices over and reads the
//!   plugin's CDI directory (the runtime reading is [`super::cdi`]'s);
//! - `dra-memory-unit`: every GPU holds at least two memory units, as a valid slice device
//!   needs (`min + step <= value`); a GPU that does not is left out of the slice;
//! - `dra-plugin-conflict`: no device plugin serves the same GPUs (gpushare's own
//!   `aliyungpushare.sock` and the GPU locks it holds, NVIDIA's sockets and processes, and,
//!   with the API, a Node that advertises allocatable `aliyun.com/gpu-mem` or
//!   `nvidia.com/gpu`). `gpushare dra-plugin` runs it in its preflight.
//!
//! Control plane (`--role control-plane`, with the API):
//! - `dra-api`: `resource.k8s.io/v1` is served with its slices, claims and classes;
//! - `dra-consumable-capacity`: a server-side dry-run create of a ResourceSlice whose device has
//!   `allowMultipleAllocations: true` keeps the field (an API server with the
//!   `DRAConsumableCapacity` gate off drops it); nothing is stored;
//! - `dra-device-taints`: the same dry-run slice keeps its device's taint (with the
//!   `DRADeviceTaints` gate off, the default on 1.34 and 1.35, the API server drops it, and an
//!   unhealthy GPU keeps receiving claims);
//! - `dra-device-class`: the DeviceClass `gpu-mem.gpushare.io` exists and selects the driver's
//!   GPUs (`type == "gpu"`; a class selecting every device of the driver is a warning).
//!
//! Like every doctor check it changes nothing (the dry run stores nothing) and every request has
//! a short deadline. It does not check the plugin itself (its registration is kubelet's).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceCapacity, DeviceClass,
    DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;

use super::cdi::{self, CdiReader};
use super::cluster::{self, ApiError, ApiState, REQUEST_TIMEOUT};
use super::host::{self, HostRoot};
use super::report::{Check, Status};
use crate::core::{MemoryUnit, wire};
use crate::gpu::GpuDevice;
use crate::node::gpu_locks::{Holder, path_name};
use crate::node::paths::ServingPath;

/// kubelet's plugin registry (`--registry-dir`).
pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// Parent of the plugin's socket directory (`<this>/<driver>`).
pub const DEFAULT_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// Where the plugin writes its per-claim CDI specs (`--cdi-dir`).
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";

/// Flags of the DRA checks (the same names and defaults as `gpushare dra-plugin`'s).
#[derive(Clone, Debug, clap::Args)]
pub struct DraArgs {
    /// Check the DRA path: plugin and registry directories, CDI in the runtime, no device
    /// plugin on the same GPUs (node); resource.k8s.io/v1, consumable capacity, the
    /// DeviceClass (control plane)
    #[arg(long)]
    pub dra: bool,
    /// DRA driver name
    #[arg(long, value_name = "NAME", default_value = wire::DRA_DRIVER_NAME)]
    pub driver_name: String,
    /// kubelet's plugin registry directory
    #[arg(long, value_name = "DIR", default_value = DEFAULT_REGISTRY_DIR)]
    pub registry_dir: PathBuf,
    /// The DRA plugin's socket directory [default: /var/lib/kubelet/plugins/<driver>]
    #[arg(long, value_name = "DIR")]
    pub plugin_dir: Option<PathBuf>,
    /// Where the DRA plugin writes its CDI specs
    #[arg(long, value_name = "DIR", default_value = DEFAULT_CDI_DIR)]
    pub cdi_dir: PathBuf,
    /// The DRA plugin's state directory (its checkpoint) [default: /var/run/gpushare/<driver>]
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
}

impl Default for DraArgs {
    fn default() -> DraArgs {
        DraArgs {
            dra: false,
            driver_name: wire::DRA_DRIVER_NAME.to_string(),
            registry_dir: PathBuf::from(DEFAULT_REGISTRY_DIR),
            plugin_dir: None,
            cdi_dir: PathBuf::from(DEFAULT_CDI_DIR),
            state_dir: None,
        }
    }
}

impl DraArgs {
    /// The checks of the DRA plugin configured as `dra` (its preflight).
    pub fn of_plugin(dra: &crate::config::DraConfig) -> DraArgs {
        DraArgs {
            dra: true,
            driver_name: dra.driver_name.clone(),
            registry_dir: dra.registry_dir.clone(),
            plugin_dir: Some(dra.plugin_dir()),
            cdi_dir: dra.cdi_dir.clone(),
            state_dir: Some(dra.state_dir()),
        }
    }

    /// `--plugin-dir`, or `/var/lib/kubelet/plugins/<driver>`.
    pub fn plugin_dir(&self) -> PathBuf {
        self.plugin_dir
            .clone()
            .unwrap_or_else(|| Path::new(DEFAULT_PLUGINS_DIR).join(&self.driver_name))
    }

    /// `--state-dir`, or `/var/run/gpushare/<driver>`.
    pub fn state_dir(&self) -> PathBuf {
        self.state_dir.clone().unwrap_or_else(|| {
            Path::new(crate::config::DEFAULT_DRA_STATE_DIR).join(&self.driver_name)
        })
    }
}

// ---------------------------------------------------------------- node

/// How a directory the plugin writes in stands.
enum DirState {
    Writable,
    ReadOnly,
    NotADirectory,
    Missing,
}

fn dir_state(host: &HostRoot, dir: &Path) -> DirState {
    match std::fs::metadata(host.path(dir)) {
        Err(_) => DirState::Missing,
        Ok(md) if !md.is_dir() => DirState::NotADirectory,
        Ok(md) => {
            #[cfg(unix)]
            let writable = std::os::unix::fs::PermissionsExt::mode(&md.permissions()) & 0o200 != 0;
            #[cfg(not(unix))]
            let writable = !md.permissions().readonly();
            if writable {
                DirState::Writable
            } else {
                DirState::ReadOnly
            }
        }
    }
}

/// One directory check. `missing`: the status and fix when it does not exist.
fn dir_check(
    host: &HostRoot,
    id: &'static str,
    title: &'static str,
    dir: &Path,
    missing: (Status, String),
) -> Check {
    let shown = dir.display();
    match dir_state(host, dir) {
        DirState::Writable => Check::new(id, title, Status::Ok, format!("{shown} is writable")),
        DirState::ReadOnly => Check::new(
            id,
            title,
            Status::Fail,
            format!("{shown} is not writable by its owner"),
        )
        .hint(format!(
            "chmod u+w {shown}; in a pod, mount the host's {shown} read-write (hostPath, no readOnly)"
        )),
        DirState::NotADirectory => Check::new(
            id,
            title,
            Status::Fail,
            format!("{shown} exists but is not a directory"),
        )
        .hint(format!("remove {shown}; it must be a directory")),
        DirState::Missing => {
            let (status, hint) = missing;
            Check::new(id, title, status, format!("{shown} does not exist")).hint(hint)
        }
    }
}

/// The node checks, in order: `dra-registry-dir`, `dra-plugin-dir`, `dra-cdi-dir`,
/// `dra-state-dir`, `dra-cdi-runtime`, `dra-plugin-conflict`. `device_plugin_dir` is kubelet's device-plugin
/// directory; `node` this node's object, when the API answered.
pub fn node_checks(
    host: &HostRoot,
    args: &DraArgs,
    device_plugin_dir: &Path,
    node: &Result<Option<Node>, ApiError>,
    locks: &[(String, Holder)],
) -> Vec<Check> {
    let registry = &args.registry_dir;
    let plugin = args.plugin_dir();
    let cdi_dir = &args.cdi_dir;
    let state = args.state_dir();
    vec![
        dir_check(
            host,
            "dra-registry-dir",
            "kubelet plugin registry directory",
            registry,
            (
                Status::Fail,
                format!(
                    "the kubelet creates {} at start: is it running, with another --root-dir? \
                     Point --registry-dir at its plugins_registry; in a pod, mount it (hostPath)",
                    registry.display()
                ),
            ),
        ),
        dir_check(
            host,
            "dra-plugin-dir",
            "DRA plugin socket directory",
            &plugin,
            (
                Status::Warn,
                format!(
                    "mkdir -p {}; the chart mounts it as hostPath DirectoryOrCreate",
                    plugin.display()
                ),
            ),
        ),
        dir_check(
            host,
            "dra-cdi-dir",
            "CDI directory the DRA plugin writes",
            cdi_dir,
            (
                Status::Warn,
                format!(
                    "mkdir -p {}; the chart mounts it as hostPath DirectoryOrCreate; the runtime \
                     must read it (cdi_spec_dirs)",
                    cdi_dir.display()
                ),
            ),
        ),
        dir_check(
            host,
            "dra-state-dir",
            "DRA plugin state directory (its checkpoint)",
            &state,
            (
                Status::Warn,
                format!(
                    "mkdir -p {}; the chart mounts it as hostPath DirectoryOrCreate \
                     (dra.stateDir); keep it on a tmpfs like the CDI directory: the checkpoint of \
                     prepared claims lives as long as their CDI specs",
                    state.display()
                ),
            ),
        ),
        cdi::runtime_for(
            host,
            &CdiReader {
                id: "dra-cdi-runtime",
                title: "container runtime hands the DRA plugin's CDI devices over",
                dirs: std::slice::from_ref(cdi_dir),
                who: "the DRA plugin",
                docker_fix: "the DRA path needs CDI: move the node to containerd 1.7+ or CRI-O, \
                             or keep it on the device-plugin path",
                dirs_flag: "--cdi-dir",
            },
        ),
        plugin_conflict(host, device_plugin_dir, node, locks),
    ]
}

/// `dra-plugin-conflict`: a GPU is served on one path only.
fn plugin_conflict(
    host: &HostRoot,
    device_plugin_dir: &Path,
    node: &Result<Option<Node>, ApiError>,
    locks: &[(String, Holder)],
) -> Check {
    const ID: &str = "dra-plugin-conflict";
    const TITLE: &str = "no device plugin serves the DRA plugin's GPUs";
    let (mut conflicts, _) = host::plugin_conflicts(host, device_plugin_dir, true);
    let ours = device_plugin_dir.join(wire::PLUGIN_SOCKET);
    if host.exists(&ours) {
        conflicts.push(format!(
            "{} exists: gpushare's device plugin serves {} on this node",
            ours.display(),
            wire::RESOURCE_GPU_MEM
        ));
    }
    for (uuid, holder) in locks {
        if holder.path == path_name(ServingPath::DevicePlugin) {
            conflicts.push(format!(
                "GPU {uuid} is served by {holder} (its lock is held; the DRA plugin offers it \
                 only once the device plugin stops and its pods are gone)"
            ));
        }
    }
    if let Ok(Some(n)) = node {
        // Allocatable, not capacity: kubelet keeps a stopped plugin's capacity for a while,
        // but its devices are unhealthy (allocatable 0) at once.
        for resource in [wire::RESOURCE_GPU_MEM, "nvidia.com/gpu"] {
            if let Some(count) = cluster::allocatable(n, resource).filter(|c| c != "0") {
                conflicts.push(format!("the node advertises {resource}: {count}"));
            }
        }
    }
    if conflicts.is_empty() {
        let mut detail = format!(
            "no device-plugin socket in {} and no device-plugin process",
            device_plugin_dir.display()
        );
        if !matches!(node, Ok(Some(_))) {
            detail.push_str(" (the Node's resources were not read)");
        }
        return Check::new(ID, TITLE, Status::Ok, detail);
    }
    Check::new(ID, TITLE, Status::Fail, conflicts.join("\n")).hint(
        "serve a node's GPUs on one path: label the node gpushare.io/gpu-mem-path=dra (the chart then \
         keeps its device plugin off it) and keep NVIDIA's device plugin off it too; a socket left by \
         a stopped plugin can be deleted; a Node's advertised gpu-mem stays until the kubelet restarts",
    )
}

/// Memory units a fix may suggest, coarsest first (MiB).
const CANDIDATE_UNITS_MIB: &[u32] = &[
    16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1,
];

/// `dra-memory-unit`: every GPU holds at least [`wire::DRA_MIN_UNITS_PER_GPU`] units of
/// `unit`, so its slice device is valid (`min + step <= value`). A GPU that does not is left
/// out of the slice by the plugin (the others serve): a warning; a failure when none holds
/// enough. The fix names a unit that fits every GPU.
pub fn memory_unit(unit: MemoryUnit, devices: Option<&[GpuDevice]>) -> Check {
    const ID: &str = "dra-memory-unit";
    const TITLE: &str = "every GPU holds at least two memory units (DRA)";
    let Some(devices) = devices.filter(|d| !d.is_empty()) else {
        return Check::new(
            ID,
            TITLE,
            Status::Skip,
            format!("unit {unit}; no GPU inventory to size it against (see gpu-access)"),
        );
    };
    let units = |d: &GpuDevice, u: MemoryUnit| u.units_of_bytes(d.memory_bytes).units();
    let small: Vec<&GpuDevice> = devices
        .iter()
        .filter(|d| units(d, unit) < wire::DRA_MIN_UNITS_PER_GPU)
        .collect();
    if small.is_empty() {
        let fewest = devices.iter().map(|d| units(d, unit)).min().unwrap_or(0);
        return Check::new(
            ID,
            TITLE,
            Status::Ok,
            format!(
                "unit {unit}: each of {} GPU(s) holds {fewest} units or more",
                devices.len()
            ),
        );
    }
    let mut lines: Vec<String> = small
        .iter()
        .map(|d| {
            format!(
                "GPU {} ({}, {} MiB) holds {} unit(s) of {unit}: the API server refuses a device of \
                 fewer than {} (min + step <= value); it is left out of the slice",
                d.index,
                d.uuid,
                d.memory_bytes >> 20,
                units(d, unit),
                wire::DRA_MIN_UNITS_PER_GPU
            )
        })
        .collect();
    let fits = CANDIDATE_UNITS_MIB
        .iter()
        .filter_map(|m| MemoryUnit::from_mib(*m))
        .filter(|u| u.mib() < unit.mib())
        .find(|u| {
            devices
                .iter()
                .all(|d| units(d, *u) >= wire::DRA_MIN_UNITS_PER_GPU)
        });
    let hint = match fits {
        Some(u) => format!(
            "use --memory-unit {u} (devicePlugin.memoryUnit in the chart; the webhook takes the same \
             unit): every GPU then holds at least {} units",
            wire::DRA_MIN_UNITS_PER_GPU
        ),
        None => "use a finer --memory-unit, e.g. MiB".to_string(),
    };
    let status = if small.len() == devices.len() {
        lines.push("no GPU is left to publish".to_string());
        Status::Fail
    } else {
        Status::Warn
    };
    Check::new(ID, TITLE, status, lines.join("\n")).hint(hint)
}

// ---------------------------------------------------------------- control plane

/// The control-plane checks, in order: `dra-api`, `dra-consumable-capacity`,
/// `dra-device-class`.
pub async fn control_plane_checks(api: &ApiState, args: &DraArgs) -> Vec<Check> {
    const API_TITLE: &str = "resource.k8s.io/v1 served";
    const CC_TITLE: &str = "consumable capacity (DRAConsumableCapacity) enabled";
    const CLASS_TITLE: &str = "DeviceClass gpu-mem.gpushare.io present";
    let titles = [
        ("dra-api", API_TITLE),
        ("dra-consumable-capacity", CC_TITLE),
        ("dra-device-taints", TAINTS_TITLE),
        ("dra-device-class", CLASS_TITLE),
    ];
    let client = match api {
        ApiState::Up { client, .. } => client,
        _ => {
            return titles
                .iter()
                .filter_map(|&(id, title)| cluster::skipped(id, title, api))
                .collect();
        }
    };
    let minor = match api {
        ApiState::Up { minor, .. } => *minor,
        _ => None,
    };
    let served = api_served(client, minor).await;
    let up = served.status == Status::Ok;
    let mut out = vec![served];
    if up {
        let probe = dry_run_probe(client, &args.driver_name).await;
        out.push(consumable_capacity(&probe, minor));
        out.push(device_taints(&probe, minor));
        out.push(device_class(client, &args.driver_name).await);
    } else {
        for &(id, title) in &titles[1..] {
            out.push(Check::new(
                id,
                title,
                Status::Skip,
                "resource.k8s.io/v1 is not served (see dra-api)",
            ));
        }
    }
    out
}

/// What an API call came to, under [`REQUEST_TIMEOUT`].
async fn timed<T>(
    call: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, ApiError> {
    match tokio::time::timeout(REQUEST_TIMEOUT, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ApiError::Kube(e)),
        Err(_) => Err(ApiError::TimedOut),
    }
}

fn status_code(e: &ApiError) -> Option<u16> {
    match e {
        ApiError::Kube(kube::Error::Api(s)) => Some(s.code),
        _ => None,
    }
}

/// `dra-api`.
async fn api_served(client: &kube::Client, minor: Option<u32>) -> Check {
    const ID: &str = "dra-api";
    const TITLE: &str = "resource.k8s.io/v1 served";
    let needed = ["resourceslices", "resourceclaims", "deviceclasses"];
    match timed(client.list_api_group_resources("resource.k8s.io/v1")).await {
        Ok(list) => {
            let missing: Vec<&str> = needed
                .iter()
                .copied()
                .filter(|r| !list.resources.iter().any(|x| x.name == *r))
                .collect();
            if missing.is_empty() {
                Check::new(
                    ID,
                    TITLE,
                    Status::Ok,
                    format!("resource.k8s.io/v1 serves {}", needed.join(", ")),
                )
            } else {
                Check::new(
                    ID,
                    TITLE,
                    Status::Fail,
                    format!("resource.k8s.io/v1 lacks {}", missing.join(", ")),
                )
                .hint("enable resource.k8s.io/v1 on kube-apiserver (--runtime-config)")
            }
        }
        Err(e) if status_code(&e) == Some(404) => {
            let version = minor
                .map(|m| format!(" (Kubernetes 1.{m})"))
                .unwrap_or_default();
            Check::new(
                ID,
                TITLE,
                Status::Fail,
                format!("the API server does not serve resource.k8s.io/v1{version}"),
            )
            .hint(
                "the DRA path needs Kubernetes 1.34+ (resource.k8s.io/v1 GA); on an older cluster \
                 keep every node on the extender path",
            )
        }
        Err(e) => Check::new(
            ID,
            TITLE,
            Status::Warn,
            format!("GET /apis/resource.k8s.io/v1: {e}"),
        )
        .hint("check that the API server answers discovery (kubectl api-resources --api-group=resource.k8s.io)"),
    }
}

/// The probe slice of `dra-consumable-capacity` and `dra-device-taints`: one device with
/// `allowMultipleAllocations`, a capacity with a request policy and a taint, as the plugin
/// publishes an unhealthy GPU.
fn probe_slice(driver: &str) -> ResourceSlice {
    let gib = |n: u64| Quantity(format!("{n}Gi"));
    ResourceSlice {
        metadata: ObjectMeta {
            generate_name: Some("gpushare-doctor-".to_string()),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.to_string(),
            all_nodes: Some(true),
            pool: ResourcePool {
                name: "gpushare-doctor-probe".to_string(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some(vec![Device {
                name: "gpu-probe".to_string(),
                allow_multiple_allocations: Some(true),
                capacity: Some(BTreeMap::from([(
                    wire::DRA_CAPACITY_MEMORY.to_string(),
                    DeviceCapacity {
                        value: gib(16),
                        request_policy: Some(CapacityRequestPolicy {
                            default: Some(gib(16)),
                            valid_range: Some(CapacityRequestPolicyRange {
                                min: gib(1),
                                max: Some(gib(16)),
                                step: Some(gib(1)),
                            }),
                            ..CapacityRequestPolicy::default()
                        }),
                    },
                )])),
                taints: Some(vec![DeviceTaint {
                    key: wire::DRA_TAINT_UNHEALTHY.to_string(),
                    value: Some("doctor-probe".to_string()),
                    effect: "NoSchedule".to_string(),
                    time_added: None,
                }]),
                ..Device::default()
            }]),
            ..ResourceSliceSpec::default()
        },
    }
}

/// The API server's answer to a dry-run create of [`probe_slice`]: what it keeps of the
/// fields its feature gates drop. Nothing is stored.
async fn dry_run_probe(client: &kube::Client, driver: &str) -> Result<ResourceSlice, ApiError> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let params = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    timed(api.create(&params, &probe_slice(driver))).await
}

const TAINTS_TITLE: &str = "device taints (DRADeviceTaints) enabled";

/// The check a failed probe comes to, for `id`: it could not tell.
fn probe_failed(id: &'static str, title: &'static str, e: &ApiError) -> Check {
    if status_code(e) == Some(403) {
        return Check::new(
            id,
            title,
            Status::Warn,
            format!("could not tell: a dry-run create of a ResourceSlice was refused: {e}"),
        )
        .hint(
            "run doctor with an identity that may create resourceslices (a dry run stores nothing), \
             e.g. a cluster admin's kubeconfig",
        );
    }
    Check::new(
        id,
        title,
        Status::Warn,
        format!("could not tell: a dry-run create of a ResourceSlice failed: {e}"),
    )
    .hint("run again; the dry run needs the API server to answer POST resourceslices?dryRun=All")
}

/// `dra-device-taints`: the dry-run slice kept its device's taint. Without the gate (off by
/// default on Kubernetes 1.34 and 1.35) the API server drops the taints the plugin puts on an
/// unhealthy GPU, and the GPU keeps receiving claims: a warning (the path works otherwise).
fn device_taints(probe: &Result<ResourceSlice, ApiError>, minor: Option<u32>) -> Check {
    const ID: &str = "dra-device-taints";
    let answer = match probe {
        Ok(a) => a,
        Err(e) => return probe_failed(ID, TAINTS_TITLE, e),
    };
    let kept = answer
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.first())
        .and_then(|d| d.taints.as_ref())
        .is_some_and(|t| !t.is_empty());
    if kept {
        return Check::new(
            ID,
            TAINTS_TITLE,
            Status::Ok,
            "a dry-run ResourceSlice keeps its device's taint: an unhealthy GPU gets no new claim",
        );
    }
    let version = minor
        .map(|m| format!("Kubernetes 1.{m}: "))
        .unwrap_or_default();
    Check::new(
        ID,
        TAINTS_TITLE,
        Status::Warn,
        format!(
            "{version}the API server dropped the taints of a dry-run ResourceSlice: the \
             DRADeviceTaints feature gate is off, and a GPU the DRA plugin marks unhealthy \
             ({}) keeps receiving claims",
            wire::DRA_TAINT_UNHEALTHY
        ),
    )
    .hint(
        "enable --feature-gates=DRADeviceTaints=true on kube-apiserver, kube-scheduler and \
         kube-controller-manager (on by default from Kubernetes 1.36; off on 1.34 and 1.35)",
    )
}

/// `dra-consumable-capacity`.
fn consumable_capacity(probe: &Result<ResourceSlice, ApiError>, minor: Option<u32>) -> Check {
    const ID: &str = "dra-consumable-capacity";
    const TITLE: &str = "consumable capacity (DRAConsumableCapacity) enabled";
    match probe {
        Ok(answer) => {
            let device = answer
                .spec
                .devices
                .as_ref()
                .and_then(|d| d.first())
                .cloned()
                .unwrap_or_default();
            if device.allow_multiple_allocations == Some(true) {
                Check::new(
                    ID,
                    TITLE,
                    Status::Ok,
                    "a dry-run ResourceSlice keeps allowMultipleAllocations: several claims can share a GPU",
                )
            } else {
                let version = minor
                    .map(|m| format!("Kubernetes 1.{m}: "))
                    .unwrap_or_default();
                Check::new(
                    ID,
                    TITLE,
                    Status::Fail,
                    format!(
                        "{version}the API server dropped allowMultipleAllocations from a dry-run ResourceSlice: \
                         the DRAConsumableCapacity feature gate is off, and no two claims could share a GPU"
                    ),
                )
                .hint(
                    "enable --feature-gates=DRAConsumableCapacity=true on kube-apiserver, kube-scheduler, \
                     kube-controller-manager and every kubelet (beta and on by default from Kubernetes 1.36)",
                )
            }
        }
        Err(e) => probe_failed(ID, TITLE, e),
    }
}

/// `dra-device-class`.
async fn device_class(client: &kube::Client, driver: &str) -> Check {
    const ID: &str = "dra-device-class";
    const TITLE: &str = "DeviceClass gpu-mem.gpushare.io present";
    let api: Api<DeviceClass> = Api::all(client.clone());
    let install = format!(
        "install the chart with dra.enabled=true (it creates the class), or apply:\n\
         apiVersion: resource.k8s.io/v1\n\
         kind: DeviceClass\n\
         metadata: {{ name: {class} }}\n\
         spec: {{ selectors: [{{ cel: {{ expression: '{selector}' }} }}] }}",
        class = wire::DRA_DEVICE_CLASS,
        selector = wire::dra_gpu_class_selector(driver)
    );
    match timed(api.get_opt(wire::DRA_DEVICE_CLASS)).await {
        Ok(None) => Check::new(
            ID,
            TITLE,
            Status::Fail,
            format!(
                "no DeviceClass {}: the claims the webhook writes name it",
                wire::DRA_DEVICE_CLASS
            ),
        )
        .hint(install),
        Ok(Some(class)) => {
            let expressions: Vec<String> = class
                .spec
                .iter()
                .flat_map(|s| s.selectors.iter().flatten())
                .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone()))
                .collect();
            let quoted = format!("\"{driver}\"");
            let selects = expressions.iter().any(|e| e.contains(&quoted));
            let shown = if expressions.is_empty() {
                "no CEL selector".to_string()
            } else {
                format!("selectors: {}", expressions.join("; "))
            };
            let gpus_only = format!(".{} == \"{}\"", wire::DRA_ATTR_TYPE, wire::DRA_TYPE_GPU);
            if selects && expressions.iter().any(|e| e.contains(&gpus_only)) {
                Check::new(ID, TITLE, Status::Ok, shown)
            } else if selects {
                Check::new(
                    ID,
                    TITLE,
                    Status::Warn,
                    format!(
                        "{shown}\nit selects every device of the driver, not only its GPUs: with \
                         [devices] enabled, a claim of this class without a memory request can \
                         be given an HCA or a generic device"
                    ),
                )
                .hint(install)
            } else {
                Check::new(
                    ID,
                    TITLE,
                    Status::Warn,
                    format!("{shown}\nno selector names the driver {quoted}"),
                )
                .hint(install)
            }
        }
        Err(e) => Check::new(
            ID,
            TITLE,
            Status::Warn,
            format!("could not read DeviceClass {}: {e}", wire::DRA_DEVICE_CLASS),
        )
        .hint("run doctor with an identity that may get deviceclasses"),
    }
}
