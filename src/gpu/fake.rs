//! The `fake` backend: GPUs described in configuration (`[gpu] fake_gpus`), with health events
//! injected through a [`FakeHealth`] handle. For tests, `gpushare demo` and clusters without
//! GPUs. It touches no driver and no device file.
//!
//! Spec grammar (comma-separated items, each one of):
//! - `<n>x<size>` — `n` GPUs of `size` (`2x16GiB`);
//! - `<size>` — one GPU (`16GiB,24GiB`);
//! - `<uuid>=<size>` — one GPU with that UUID (`GPU-aaa=16GiB,GPU-bbb=24GiB`);
//! - a one-GPU item followed by `@<PCI bus id>` — that GPU at that place on the PCI bus
//!   (`GPU-aaa=80GiB@0000:19:00.0`, `80GiB@0000:3b:00.0`), so its PCIe root and NUMA node are
//!   read from sysfs as a real GPU's (pairing with the HCAs of a recorded tree).
//!
//! Sizes are `<integer>GiB` or `<integer>MiB` (`16276MiB`). GPUs without a UUID get a
//! deterministic one from their index (`GPU-fake-0000-0000-0000-000000000000`, …).

use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use super::{Error, GpuBackend, GpuDevice, HealthEvent, Inventory};

/// Driver version the fake backend reports.
pub(crate) const FAKE_DRIVER_VERSION: &str = "550.54.15";
/// Product name of every fake GPU.
pub(crate) const FAKE_GPU_NAME: &str = "Fake GPU";
/// Capacity of each health subscriber's channel; injections beyond it are dropped.
const HEALTH_CHANNEL_CAPACITY: usize = 256;
/// Upper bound on the GPUs one spec may describe (a typo like `20000x1GiB` is an error).
const MAX_FAKE_GPUS: usize = 1024;

/// The deterministic UUID of the fake GPU at `index`.
pub fn fake_uuid(index: u32) -> String {
    format!("GPU-fake-0000-0000-0000-{index:012}")
}

/// GPUs from configuration plus injectable health.
#[derive(Debug)]
pub struct FakeBackend {
    devices: Vec<GpuDevice>,
    health: FakeHealth,
}

/// A cloneable handle that delivers injected [`HealthEvent`]s to every live
/// [`GpuBackend::watch_health`] receiver of its backend. Events injected while nobody watches
/// are not kept (like a real XID nobody was listening for).
#[derive(Clone, Debug, Default)]
pub struct FakeHealth {
    subscribers: Arc<Mutex<Vec<mpsc::Sender<HealthEvent>>>>,
}

impl FakeHealth {
    /// Delivers `event` to every live subscriber; returns how many received it.
    pub fn inject(&self, event: HealthEvent) -> usize {
        let mut subscribers = self.lock();
        subscribers.retain(|tx| !tx.is_closed());
        subscribers
            .iter()
            .filter(|tx| tx.try_send(event.clone()).is_ok())
            .count()
    }

    /// How many receivers are watching now (tests wait for a watcher before injecting).
    pub fn subscribers(&self) -> usize {
        let mut subscribers = self.lock();
        subscribers.retain(|tx| !tx.is_closed());
        subscribers.len()
    }

    fn subscribe(&self) -> mpsc::Receiver<HealthEvent> {
        let (tx, rx) = mpsc::channel(HEALTH_CHANNEL_CAPACITY);
        self.lock().push(tx);
        rx
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<mpsc::Sender<HealthEvent>>> {
        // A panic while holding this lock cannot leave the list inconsistent; keep going.
        self.subscribers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl FakeBackend {
    /// A backend serving exactly these devices.
    pub fn new(devices: Vec<GpuDevice>) -> FakeBackend {
        FakeBackend {
            devices,
            health: FakeHealth::default(),
        }
    }

    /// A backend from a `[gpu] fake_gpus` spec (see the module docs for the grammar).
    pub fn from_spec(spec: &str) -> Result<FakeBackend, Error> {
        Ok(FakeBackend::new(parse_spec(spec)?))
    }

    /// The handle that injects health events into this backend's watchers.
    pub fn health(&self) -> FakeHealth {
        self.health.clone()
    }

    /// The configured devices.
    pub fn devices(&self) -> &[GpuDevice] {
        &self.devices
    }
}

impl GpuBackend for FakeBackend {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn inventory(&self) -> Result<Inventory, Error> {
        Ok(Inventory {
            backend: self.name(),
            driver_version: FAKE_DRIVER_VERSION.to_string(),
            devices: self.devices.clone(),
            excluded: Vec::new(),
        })
    }

    fn watch_health(&self) -> Result<mpsc::Receiver<HealthEvent>, Error> {
        Ok(self.health.subscribe())
    }
}

/// Parses a `fake_gpus` spec into devices (index, UUID, name, minor, PCI id, memory).
pub(crate) fn parse_spec(spec: &str) -> Result<Vec<GpuDevice>, Error> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Err(Error::Fake(
            "no fake GPUs configured: set [gpu] fake_gpus (or --fake-gpus), e.g. `2x16GiB`, \
             `16GiB,24GiB` or `GPU-aaa=16GiB,GPU-bbb=24GiB`"
                .to_string(),
        ));
    }
    let mut gpus: Vec<(Option<String>, u64)> = Vec::new();
    let mut buses: Vec<(usize, String)> = Vec::new();
    for item in spec.split(',') {
        let item = item.trim();
        if item.is_empty() {
            return Err(Error::Fake(format!("`{spec}`: empty item between commas")));
        }
        let (item, bus) = match item.split_once('@') {
            Some((gpu, bus)) => (gpu.trim(), Some(parse_bus(bus.trim(), item)?)),
            None => (item, None),
        };
        if let Some(bus) = bus {
            if split_count(item).is_some() {
                return Err(Error::Fake(format!(
                    "`{item}@{bus}`: a PCI bus id places one GPU, not a count of them"
                )));
            }
            if buses.iter().any(|(_, b)| b.eq_ignore_ascii_case(&bus)) {
                return Err(Error::Fake(format!(
                    "`{spec}`: PCI bus id {bus} appears twice"
                )));
            }
            buses.push((gpus.len(), bus));
        }
        if let Some((uuid, size)) = item.split_once('=') {
            let uuid = uuid.trim();
            if uuid.is_empty() || uuid.chars().any(|c| c.is_whitespace() || c == ',') {
                return Err(Error::Fake(format!(
                    "`{item}`: the UUID before `=` is empty or has spaces"
                )));
            }
            gpus.push((Some(uuid.to_string()), parse_size(size.trim(), item)?));
        } else if let Some((count, size)) = split_count(item) {
            let n: usize = count.parse().map_err(|_| {
                Error::Fake(format!(
                    "`{item}`: `{count}` is not a GPU count (expected e.g. `2x16GiB`)"
                ))
            })?;
            if n == 0 {
                return Err(Error::Fake(format!("`{item}`: zero GPUs")));
            }
            if n > MAX_FAKE_GPUS {
                return Err(Error::Fake(format!(
                    "`{item}`: {n} GPUs is more than {MAX_FAKE_GPUS}"
                )));
            }
            let bytes = parse_size(size, item)?;
            gpus.extend(std::iter::repeat_n((None, bytes), n));
        } else {
            gpus.push((None, parse_size(item, item)?));
        }
        if gpus.len() > MAX_FAKE_GPUS {
            return Err(Error::Fake(format!(
                "`{spec}`: more than {MAX_FAKE_GPUS} GPUs"
            )));
        }
    }
    let mut devices = Vec::with_capacity(gpus.len());
    for (i, (uuid, memory_bytes)) in gpus.into_iter().enumerate() {
        let index = u32::try_from(i).map_err(|_| Error::Fake("too many GPUs".to_string()))?;
        let uuid = uuid.unwrap_or_else(|| fake_uuid(index));
        if devices.iter().any(|d: &GpuDevice| d.uuid == uuid) {
            return Err(Error::Fake(format!("`{spec}`: UUID {uuid} appears twice")));
        }
        devices.push(GpuDevice {
            index,
            uuid,
            name: FAKE_GPU_NAME.to_string(),
            minor: Some(index),
            pci_bus_id: buses
                .iter()
                .find(|(at, _)| *at == i)
                .map(|(_, bus)| bus.clone())
                .unwrap_or_else(|| format!("00000000:{:02X}:00.0", (index + 1) % 256)),
            memory_bytes,
        });
    }
    Ok(devices)
}

/// A PCI bus id (`0000:19:00.0`, `00000000:3B:00.0`: domain, bus, device and function in
/// hexadecimal), as given.
fn parse_bus(bus: &str, item: &str) -> Result<String, Error> {
    let bad = || {
        Error::Fake(format!(
            "`{item}`: `{bus}` is not a PCI bus id (write e.g. `0000:19:00.0`)"
        ))
    };
    let (domain_bus, dev_fn) = bus.rsplit_once(':').ok_or_else(bad)?;
    let (domain, b) = domain_bus.rsplit_once(':').ok_or_else(bad)?;
    let (dev, func) = dev_fn.split_once('.').ok_or_else(bad)?;
    let hex = |s: &str, max: usize| {
        !s.is_empty() && s.len() <= max && s.chars().all(|c| c.is_ascii_hexdigit())
    };
    if hex(domain, 8) && hex(b, 2) && hex(dev, 2) && hex(func, 1) {
        Ok(bus.to_string())
    } else {
        Err(bad())
    }
}

/// `2x16GiB` -> (`2`, `16GiB`); `16GiB` -> None.
fn split_count(item: &str) -> Option<(&str, &str)> {
    let (count, size) = item.split_once(['x', 'X'])?;
    let count = count.trim();
    (!count.is_empty() && count.chars().all(|c| c.is_ascii_digit())).then_some((count, size.trim()))
}

/// `16GiB` / `16276MiB` -> bytes.
fn parse_size(size: &str, item: &str) -> Result<u64, Error> {
    let digits_end = size
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(size.len());
    let (number, suffix) = size.split_at(digits_end);
    if number.is_empty() {
        return Err(Error::Fake(format!(
            "`{item}`: `{size}` does not start with a whole number"
        )));
    }
    let factor: u64 = match suffix.trim() {
        s if s.eq_ignore_ascii_case("GiB") => 1 << 30,
        s if s.eq_ignore_ascii_case("MiB") => 1 << 20,
        "" => {
            return Err(Error::Fake(format!(
                "`{item}`: size `{size}` has no unit (write e.g. `16GiB` or `16276MiB`)"
            )));
        }
        other => {
            return Err(Error::Fake(format!(
                "`{item}`: unknown unit `{other}` in `{size}` (GiB or MiB)"
            )));
        }
    };
    let n: u64 = number
        .parse()
        .map_err(|_| Error::Fake(format!("`{item}`: `{size}` is too large")))?;
    if n == 0 {
        return Err(Error::Fake(format!("`{item}`: a GPU with no memory")));
    }
    n.checked_mul(factor)
        .ok_or_else(|| Error::Fake(format!("`{item}`: `{size}` is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn sizes(spec: &str) -> Vec<u64> {
        parse_spec(spec)
            .expect(spec)
            .iter()
            .map(|d| d.memory_bytes)
            .collect()
    }

    #[test]
    fn count_form() {
        let devices = parse_spec("2x16GiB").expect("valid");
        assert_eq!(devices.len(), 2);
        assert_eq!(devices[0].uuid, "GPU-fake-0000-0000-0000-000000000000");
        assert_eq!(devices[1].uuid, "GPU-fake-0000-0000-0000-000000000001");
        assert_eq!(devices[1].index, 1);
        assert_eq!(devices[1].minor, Some(1));
        assert_eq!(devices[1].name, FAKE_GPU_NAME);
        assert_ne!(devices[0].pci_bus_id, devices[1].pci_bus_id);
        assert!(devices.iter().all(|d| d.memory_bytes == 16 * GIB));
    }

    #[test]
    fn list_and_mib_forms() {
        assert_eq!(sizes("16GiB, 24GiB"), vec![16 * GIB, 24 * GIB]);
        assert_eq!(sizes("16276MiB"), vec![16276 * MIB]);
        assert_eq!(
            sizes("1x8GiB,2x4096MiB"),
            vec![8 * GIB, 4096 * MIB, 4096 * MIB]
        );
        assert_eq!(sizes("16gib"), vec![16 * GIB]);
    }

    #[test]
    fn uuid_form_keeps_uuids() {
        let devices = parse_spec("GPU-aaa=16GiB,GPU-bbb=24GiB").expect("valid");
        assert_eq!(devices[0].uuid, "GPU-aaa");
        assert_eq!(devices[1].uuid, "GPU-bbb");
        assert_eq!(devices[1].memory_bytes, 24 * GIB);
        assert_eq!(devices[1].index, 1);
    }

    /// A GPU's place on the PCI bus (`@<bus id>`), so a fake node can pair its GPUs with the
    /// HCAs of a recorded sysfs tree; without it each GPU gets a bus of its own.
    #[test]
    fn a_bus_id_places_a_gpu() {
        let devices =
            parse_spec("GPU-a=80GiB@0000:19:00.0,80GiB@00000000:3B:00.0,2x16GiB").expect("valid");
        assert_eq!(devices[0].uuid, "GPU-a");
        assert_eq!(devices[0].pci_bus_id, "0000:19:00.0");
        assert_eq!(devices[0].memory_bytes, 80 * GIB);
        assert_eq!(devices[1].pci_bus_id, "00000000:3B:00.0");
        assert_eq!(devices[2].pci_bus_id, "00000000:03:00.0");
        for (spec, needle) in [
            ("16GiB@", "bus id"),
            ("16GiB@zz:00.0", "bus id"),
            ("2x16GiB@0000:19:00.0", "one GPU"),
            ("16GiB@0000:19:00.0,16GiB@0000:19:00.0", "twice"),
        ] {
            let err = parse_spec(spec).expect_err(spec).to_string();
            assert!(err.contains(needle), "{spec:?}: {err}");
        }
    }

    #[test]
    fn garbage_names_the_problem() {
        for (spec, needle) in [
            ("", "no fake GPUs"),
            ("16", "no unit"),
            ("16GB", "unknown unit `GB`"),
            ("axGiB", "does not start with a whole number"),
            ("0x16GiB", "zero GPUs"),
            ("2x0GiB", "no memory"),
            ("16GiB,,8GiB", "empty item"),
            ("=16GiB", "UUID"),
            ("GPU-a=1GiB,GPU-a=2GiB", "appears twice"),
            ("99999999x1GiB", "more than"),
            ("99999999999999999999GiB", "too large"),
            ("17179869184GiB", "too large"),
        ] {
            let err = parse_spec(spec).expect_err(spec).to_string();
            assert!(err.contains(needle), "{spec:?}: {err}");
            assert!(err.starts_with("fake GPUs: "), "{err}");
        }
    }

    #[tokio::test]
    async fn injected_events_reach_every_watcher() {
        let backend = FakeBackend::from_spec("1x1GiB").expect("valid");
        let health = backend.health();
        assert_eq!(health.subscribers(), 0);
        let mut a = backend.watch_health().expect("watch");
        let mut b = backend.watch_health().expect("watch");
        assert_eq!(health.subscribers(), 2);
        let event = HealthEvent::Xid {
            uuid: Some(fake_uuid(0)),
            xid: 79,
        };
        assert_eq!(health.inject(event.clone()), 2);
        assert_eq!(a.recv().await, Some(event.clone()));
        assert_eq!(b.recv().await, Some(event.clone()));
        drop(a);
        assert_eq!(health.inject(event.clone()), 1);
        assert_eq!(health.subscribers(), 1);
    }

    #[test]
    fn inventory_reports_driver_and_devices() {
        let backend = FakeBackend::from_spec("3x2GiB").expect("valid");
        let inventory = backend.inventory().expect("inventory");
        assert_eq!(inventory.backend, "fake");
        assert_eq!(inventory.driver_version, FAKE_DRIVER_VERSION);
        assert_eq!(inventory.devices.len(), 3);
    }
}
