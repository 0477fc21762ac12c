//! A pod's GPU memory request, read from container limits of `aliyun.com/gpu-mem`.
//!
//! Per container, the limit is parsed as a Kubernetes quantity that must be a whole,
//! non-negative number of units no larger than 2^40 (suffixes count numerically, as upstream:
//! `10G` is 10 000 000 000 units and is rejected as absurd). What the pod needs on its GPU
//! ([`PodGpuRequest::total`]) is counted as kube-scheduler counts it, native sidecars (init
//! containers with `restartPolicy: Always`, Kubernetes 1.29+) included:
//! max(max over init containers i of (init_i + sidecars declared before i),
//! sum(app containers) + sum(sidecars)). Plain init containers run one at a time before the
//! app containers, so they never add to the total (upstream ignored them); sidecars keep
//! running beside everything started after them.
//!
//! The input is a plain list of (container name, limit string) so that this module needs no
//! Kubernetes types; `k8s` projects a `Pod` into it.

use super::memory::GpuMem;

/// Why a quantity could not be used as a GPU memory request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// Not a Kubernetes quantity at all.
    #[error("{0:?} is not a quantity")]
    Malformed(String),
    /// Negative amounts make no sense.
    #[error("{0:?} is negative")]
    Negative(String),
    /// Extended resources are whole numbers.
    #[error("{0:?} is not a whole number of units")]
    Fractional(String),
    /// More than 2^40 units.
    #[error("{0:?} is absurdly large (more than 2^40 units)")]
    TooLarge(String),
    /// More than 2^63 - 1 (Kubernetes' own bound on a quantity's value), for
    /// [`parse_whole_quantity`].
    #[error("{0:?} is larger than a Kubernetes quantity can be (2^63 - 1)")]
    Overflow(String),
}

/// Parses a Kubernetes quantity (`4`, `4k`, `2Gi`, `1e3`, `2000m`) into a whole number of units.
pub fn parse_quantity(text: &str) -> Result<GpuMem, QuantityError> {
    match parse_whole(text, u128::from(GpuMem::MAX_REQUEST.units()))? {
        Some(v) => Ok(GpuMem::new(v)),
        None => Err(QuantityError::TooLarge(text.to_string())),
    }
}

/// Parses a Kubernetes quantity that must be a whole, non-negative number no larger than
/// 2^63 - 1 (a DRA device capacity in bytes, `80Gi`, `85899345920`), with the same grammar
/// as [`parse_quantity`] but without its 2^40 bound on GPU memory units.
pub fn parse_whole_quantity(text: &str) -> Result<u64, QuantityError> {
    parse_whole(text, i64::MAX as u128)?.ok_or_else(|| QuantityError::Overflow(text.to_string()))
}

/// The one quantity parser: `Ok(None)` when the value exceeds `max`.
fn parse_whole(text: &str, max: u128) -> Result<Option<u64>, QuantityError> {
    let malformed = || QuantityError::Malformed(text.to_string());
    let s = text.trim();
    let (negative, s) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        Some(_) => (false, s),
        None => return Err(malformed()),
    };
    let num_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(num_end);
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if (int_part.is_empty() && frac_part.is_empty())
        || frac_part.contains('.')
        || int_part.len() + frac_part.len() > 30
    {
        return Err(malformed());
    }
    // value = mantissa × base^exp / 10^frac_len, computed exactly in u128 with a decimal exponent.
    let mantissa: u128 = format!("{int_part}{frac_part}")
        .parse()
        .map_err(|_| malformed())?;
    let mut decimal_exp: i64 = -(frac_part.len() as i64);
    let mut binary_mult: u128 = 1;
    match suffix {
        "" => {}
        "n" => decimal_exp -= 9,
        "u" => decimal_exp -= 6,
        "m" => decimal_exp -= 3,
        "k" => decimal_exp += 3,
        "M" => decimal_exp += 6,
        "G" => decimal_exp += 9,
        "T" => decimal_exp += 12,
        "P" => decimal_exp += 15,
        "E" => decimal_exp += 18,
        "Ki" => binary_mult = 1 << 10,
        "Mi" => binary_mult = 1 << 20,
        "Gi" => binary_mult = 1 << 30,
        "Ti" => binary_mult = 1 << 40,
        "Pi" => binary_mult = 1 << 50,
        "Ei" => binary_mult = 1 << 60,
        exp if exp.starts_with(['e', 'E']) => {
            let e: i64 = exp[1..].parse().map_err(|_| malformed())?;
            if !(-100..=100).contains(&e) {
                return Err(malformed());
            }
            decimal_exp += e;
        }
        _ => return Err(malformed()),
    }
    if mantissa == 0 {
        return Ok(Some(0));
    }
    if negative {
        return Err(QuantityError::Negative(text.to_string()));
    }
    let Some(mut value) = mantissa.checked_mul(binary_mult) else {
        return Ok(None);
    };
    if decimal_exp >= 0 {
        for _ in 0..decimal_exp {
            match value.checked_mul(10) {
                Some(v) if v <= max => value = v,
                _ => return Ok(None),
            }
        }
    } else {
        for _ in 0..(-decimal_exp) {
            if value % 10 != 0 {
                return Err(QuantityError::Fractional(text.to_string()));
            }
            value /= 10;
        }
    }
    if value > max {
        return Ok(None);
    }
    // value <= max <= u64::MAX.
    Ok(u64::try_from(value).ok())
}

/// One container's GPU memory request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerGpuRequest {
    /// Container name.
    pub name: String,
    /// Its `aliyun.com/gpu-mem` limit.
    pub mem: GpuMem,
    /// An init container with `restartPolicy: Always` (a native sidecar): it keeps running
    /// beside the containers started after it.
    pub restartable: bool,
}

/// A pod's GPU memory requests, per container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodGpuRequest {
    /// App containers with a non-zero request, in spec order.
    pub containers: Vec<ContainerGpuRequest>,
    /// Init containers (native sidecars included) with a non-zero request, in spec order.
    pub init_containers: Vec<ContainerGpuRequest>,
}

/// A container limit that could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("container {container:?}: aliyun.com/gpu-mem limit {source}")]
pub struct RequestError {
    /// The container.
    pub container: String,
    /// What is wrong with its limit.
    #[source]
    pub source: QuantityError,
}

impl PodGpuRequest {
    /// Reads the request from (name, limit) pairs of app and init containers (no sidecars).
    pub fn from_limits<'a>(
        containers: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
        init_containers: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
    ) -> Result<PodGpuRequest, RequestError> {
        Self::from_containers(
            containers,
            init_containers.into_iter().map(|(n, l)| (n, l, false)),
        )
    }

    /// Reads the request from (name, limit) pairs of app containers and (name, limit,
    /// restartable) triples of init containers, in spec order; `restartable` marks a native
    /// sidecar (`restartPolicy: Always`).
    pub fn from_containers<'a>(
        containers: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
        init_containers: impl IntoIterator<Item = (&'a str, Option<&'a str>, bool)>,
    ) -> Result<PodGpuRequest, RequestError> {
        fn read<'a>(
            list: impl IntoIterator<Item = (&'a str, Option<&'a str>, bool)>,
        ) -> Result<Vec<ContainerGpuRequest>, RequestError> {
            let mut out = Vec::new();
            for (name, limit, restartable) in list {
                let Some(limit) = limit else { continue };
                let mem = parse_quantity(limit).map_err(|source| RequestError {
                    container: name.to_string(),
                    source,
                })?;
                if !mem.is_zero() {
                    out.push(ContainerGpuRequest {
                        name: name.to_string(),
                        mem,
                        restartable,
                    });
                }
            }
            Ok(out)
        }
        Ok(PodGpuRequest {
            containers: read(containers.into_iter().map(|(n, l)| (n, l, false)))?,
            init_containers: read(init_containers)?,
        })
    }

    /// Sum of the app containers' requests.
    pub fn app_total(&self) -> GpuMem {
        self.containers.iter().map(|c| c.mem).sum()
    }

    /// Sum of the native sidecars' requests.
    pub fn sidecar_total(&self) -> GpuMem {
        self.init_containers
            .iter()
            .filter(|c| c.restartable)
            .map(|c| c.mem)
            .sum()
    }

    /// What the pod needs on its GPU, as kube-scheduler counts a pod's resources:
    /// max(max over init containers i of (init_i + sidecars declared before i),
    /// sum(app containers) + sum(sidecars)). The one rule for the extender, the device
    /// plugin and `inspect`.
    pub fn total(&self) -> GpuMem {
        let mut sidecars = GpuMem::ZERO;
        let mut init_peak = GpuMem::ZERO;
        for c in &self.init_containers {
            if c.restartable {
                sidecars = sidecars.saturating_add(c.mem);
                init_peak = init_peak.max(sidecars);
            } else {
                init_peak = init_peak.max(c.mem.saturating_add(sidecars));
            }
        }
        init_peak.max(self.app_total().saturating_add(sidecars))
    }

    /// Whether the pod asks for GPU memory at all.
    pub fn is_gpu_pod(&self) -> bool {
        !self.total().is_zero()
    }

    /// Every GPU container, init containers first (the order kubelet starts them in).
    pub fn all_containers(&self) -> impl Iterator<Item = &ContainerGpuRequest> {
        self.init_containers.iter().chain(self.containers.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_like_kubernetes_value() {
        let ok = |s: &str, v: u64| assert_eq!(parse_quantity(s), Ok(GpuMem::new(v)), "{s}");
        ok("4", 4);
        ok(" 16276 ", 16276);
        ok("+3", 3);
        ok("2k", 2000);
        ok("1Ki", 1024);
        ok("2000m", 2);
        ok("1e3", 1000);
        ok("1.5k", 1500);
        ok("0", 0);
        ok("-0", 0);
        ok("1Ti", 1 << 40);
    }

    #[test]
    fn whole_quantities_reach_kubernetes_bound_not_the_unit_bound() {
        assert_eq!(parse_whole_quantity("80Gi"), Ok(80 << 30));
        assert_eq!(parse_whole_quantity("2Ti"), Ok(2 << 40));
        assert_eq!(
            parse_quantity("2Ti"),
            Err(QuantityError::TooLarge("2Ti".into()))
        );
        assert_eq!(
            parse_whole_quantity("9223372036854775807"),
            Ok(i64::MAX as u64)
        );
        assert_eq!(
            parse_whole_quantity("9223372036854775808"),
            Err(QuantityError::Overflow("9223372036854775808".into()))
        );
        assert_eq!(
            parse_whole_quantity("8Ei"),
            Err(QuantityError::Overflow("8Ei".into()))
        );
        assert_eq!(
            parse_whole_quantity("1.5"),
            Err(QuantityError::Fractional("1.5".into()))
        );
    }

    #[test]
    fn absurd_quantities_are_rejected_with_a_reason() {
        use QuantityError::*;
        let e = |s: &str| parse_quantity(s).unwrap_err();
        assert!(matches!(e("-1"), Negative(_)));
        assert!(matches!(e("1.5"), Fractional(_)));
        assert!(matches!(e("1500m"), Fractional(_)));
        // Suffixes count numerically, as upstream: 10G is ten billion units (it never fits).
        assert_eq!(parse_quantity("10G"), Ok(GpuMem::new(10_000_000_000)));
        assert!(matches!(e("2T"), TooLarge(_)));
        assert!(matches!(e("2Ti"), TooLarge(_)));
        assert!(matches!(e("1e100"), TooLarge(_)));
        for bad in [
            "",
            "abc",
            "1.2.3",
            "1x",
            "e3",
            "1e",
            "--1",
            "1e1000",
            "99999999999999999999999999999999",
        ] {
            assert!(matches!(e(bad), Malformed(_)), "{bad}");
        }
    }

    #[test]
    fn init_containers_take_the_max_not_the_sum() {
        let req = PodGpuRequest::from_limits(
            [("a", Some("2")), ("b", Some("3")), ("c", None)],
            [("init1", Some("4")), ("init2", Some("1"))],
        )
        .unwrap();
        assert_eq!(req.app_total(), GpuMem::new(5));
        assert_eq!(req.total(), GpuMem::new(5));
        let req = PodGpuRequest::from_limits([("a", Some("2"))], [("init", Some("7"))]).unwrap();
        assert_eq!(req.total(), GpuMem::new(7));
        let names: Vec<_> = req.all_containers().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["init", "a"]);
    }

    #[test]
    fn native_sidecars_count_as_kube_scheduler_counts_them() {
        let req = |app: &[(&str, &str)], init: &[(&str, &str, bool)]| {
            PodGpuRequest::from_containers(
                app.iter().map(|(n, l)| (*n, Some(*l))),
                init.iter().map(|(n, l, r)| (*n, Some(*l), *r)),
            )
            .unwrap()
            .total()
            .units()
        };
        // The case: a 4-unit sidecar beside a 16-unit app is 20, not 16.
        assert_eq!(req(&[("app", "16")], &[("sidecar", "4", true)]), 20);
        // An init container after a sidecar runs beside it: 4 + 10 = 14 > 2 + 4.
        assert_eq!(
            req(&[("app", "2")], &[("sc", "4", true), ("init", "10", false)]),
            14
        );
        // Before the sidecar it runs alone: max(10, 2 + 4).
        assert_eq!(
            req(&[("app", "2")], &[("init", "10", false), ("sc", "4", true)]),
            10
        );
        // Plain init containers still take the max, not the sum.
        assert_eq!(
            req(&[("app", "3")], &[("i1", "5", false), ("i2", "1", false)]),
            5
        );
        // Only sidecars: they all run together.
        assert_eq!(req(&[], &[("a", "3", true), ("b", "4", true)]), 7);
    }

    #[test]
    fn a_bad_limit_names_its_container() {
        let err =
            PodGpuRequest::from_limits([("ok", Some("1")), ("bad", Some("-2"))], []).unwrap_err();
        assert_eq!(err.container, "bad");
        assert!(err.to_string().contains("negative"));
        assert!(
            !PodGpuRequest::from_limits([("a", Some("0"))], [])
                .unwrap()
                .is_gpu_pod()
        );
    }
}
