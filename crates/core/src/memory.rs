//! GPU memory amounts ([`GpuMem`]) and the unit they are counted in ([`MemoryUnit`]).
//!
//! Kubernetes only sees integers for `aliyun.com/gpu-mem`: the device plugin decides what one
//! unit is (`GiB` by default, `MiB`, or a coarser multiple such as `256MiB`) and everyone
//! else counts units. The upstream rule for turning a GPU's MiB into units is kept exactly:
//! units = floor(MiB / unit size), so a 16160 MiB V100 is 15 GiB.
//!
//! All arithmetic saturates; nothing here can wrap around (upstream did, spec §10.2).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An amount of GPU memory, counted in the node's [`MemoryUnit`].
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct GpuMem(u64);

impl GpuMem {
    /// No memory.
    pub const ZERO: GpuMem = GpuMem(0);
    /// The largest amount a single request may name (2^40 units); anything above is absurd.
    pub const MAX_REQUEST: GpuMem = GpuMem(1 << 40);

    /// `units` units of memory.
    pub const fn new(units: u64) -> Self {
        GpuMem(units)
    }

    /// The number of units.
    pub const fn units(self) -> u64 {
        self.0
    }

    /// Whether this is zero.
    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// `self + other`, saturating at `u64::MAX`.
    pub const fn saturating_add(self, other: GpuMem) -> GpuMem {
        GpuMem(self.0.saturating_add(other.0))
    }

    /// `self - other`, saturating at zero.
    pub const fn saturating_sub(self, other: GpuMem) -> GpuMem {
        GpuMem(self.0.saturating_sub(other.0))
    }

    /// `self - other`, or `None` when `other` is larger.
    pub const fn checked_sub(self, other: GpuMem) -> Option<GpuMem> {
        match self.0.checked_sub(other.0) {
            Some(v) => Some(GpuMem(v)),
            None => None,
        }
    }
}

impl fmt::Display for GpuMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::iter::Sum for GpuMem {
    fn sum<I: Iterator<Item = GpuMem>>(iter: I) -> GpuMem {
        iter.fold(GpuMem::ZERO, GpuMem::saturating_add)
    }
}

/// The size of one unit of `aliyun.com/gpu-mem`, in MiB.
///
/// Written as `GiB` (1024 MiB, the upstream default), `MiB`, or `<n>MiB` for a coarser
/// multiple (`256MiB`); `<n>GiB` is accepted too. Serialized in the same form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemoryUnit {
    mib: u32,
}

/// Why a memory unit could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid memory unit {given:?}: expected GiB, MiB, or a multiple such as 256MiB or 2GiB")]
pub struct UnitError {
    /// What was given.
    pub given: String,
}

impl MemoryUnit {
    /// 1 GiB per unit (upstream default).
    pub const GIB: MemoryUnit = MemoryUnit { mib: 1024 };
    /// 1 MiB per unit (upstream `--memory-unit=MiB`).
    pub const MIB: MemoryUnit = MemoryUnit { mib: 1 };

    /// A unit of `mib` MiB; `None` for zero.
    pub const fn from_mib(mib: u32) -> Option<MemoryUnit> {
        if mib == 0 {
            None
        } else {
            Some(MemoryUnit { mib })
        }
    }

    /// The unit's size in MiB.
    pub const fn mib(self) -> u32 {
        self.mib
    }

    /// How many whole units a GPU with `mib` MiB of memory offers (floor, upstream rule).
    pub const fn units_of_mib(self, mib: u64) -> GpuMem {
        GpuMem(mib / self.mib as u64)
    }

    /// How many whole units `bytes` bytes make (floor).
    pub const fn units_of_bytes(self, bytes: u64) -> GpuMem {
        self.units_of_mib(bytes / (1024 * 1024))
    }

    /// The amount in MiB, saturating.
    pub const fn to_mib(self, mem: GpuMem) -> u64 {
        mem.0.saturating_mul(self.mib as u64)
    }

    /// The amount in bytes, saturating.
    pub const fn to_bytes(self, mem: GpuMem) -> u64 {
        self.to_mib(mem).saturating_mul(1024 * 1024)
    }

    /// `amount` followed by this unit, as the upstream failure env writes it
    /// (`2GiB`, `4096MiB`; a coarse unit is spelled out in MiB: `512MiB` for 2 × 256MiB).
    pub fn format_amount(self, amount: GpuMem) -> String {
        match self.mib {
            1024 => format!("{amount}GiB"),
            1 => format!("{amount}MiB"),
            _ => format!("{}MiB", self.to_mib(amount)),
        }
    }
}

impl Default for MemoryUnit {
    fn default() -> Self {
        MemoryUnit::GIB
    }
}

impl fmt::Display for MemoryUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.mib {
            1024 => f.write_str("GiB"),
            1 => f.write_str("MiB"),
            n if n % 1024 == 0 => write!(f, "{}GiB", n / 1024),
            n => write!(f, "{n}MiB"),
        }
    }
}

impl FromStr for MemoryUnit {
    type Err = UnitError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || UnitError {
            given: s.to_string(),
        };
        let t = s.trim();
        let (num, scale) = if let Some(n) = t.strip_suffix("GiB") {
            (n, 1024u64)
        } else if let Some(n) = t.strip_suffix("MiB") {
            (n, 1u64)
        } else {
            return Err(err());
        };
        let count: u64 = if num.is_empty() {
            1
        } else {
            num.parse().map_err(|_| err())?
        };
        let mib = count.checked_mul(scale).ok_or_else(err)?;
        // A unit larger than 1 TiB makes no sense for one GPU.
        if mib == 0 || mib > 1024 * 1024 {
            return Err(err());
        }
        Ok(MemoryUnit { mib: mib as u32 })
    }
}

impl Serialize for MemoryUnit {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MemoryUnit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gib_is_the_floor_of_mib_over_1024() {
        assert_eq!(MemoryUnit::GIB.units_of_mib(16160), GpuMem::new(15));
        assert_eq!(MemoryUnit::GIB.units_of_mib(7618), GpuMem::new(7));
        assert_eq!(MemoryUnit::GIB.units_of_mib(16384), GpuMem::new(16));
        assert_eq!(MemoryUnit::MIB.units_of_mib(16276), GpuMem::new(16276));
        assert_eq!(
            "256MiB".parse::<MemoryUnit>().unwrap().units_of_mib(81559),
            GpuMem::new(318)
        );
    }

    #[test]
    fn units_parse_and_print_round_trip() {
        for s in ["GiB", "MiB", "256MiB", "2GiB", "512MiB"] {
            let u: MemoryUnit = s.parse().unwrap();
            assert_eq!(u.to_string(), s);
        }
        assert_eq!("1024MiB".parse::<MemoryUnit>().unwrap(), MemoryUnit::GIB);
        for bad in ["", "gib", "0MiB", "-1MiB", "1.5GiB", "KiB", "99999999GiB"] {
            assert!(bad.parse::<MemoryUnit>().is_err(), "{bad} must be rejected");
        }
    }

    #[test]
    fn arithmetic_saturates_instead_of_wrapping() {
        let a = GpuMem::new(3);
        assert_eq!(a.saturating_sub(GpuMem::new(5)), GpuMem::ZERO);
        assert_eq!(a.checked_sub(GpuMem::new(5)), None);
        assert_eq!(
            GpuMem::new(u64::MAX).saturating_add(a),
            GpuMem::new(u64::MAX)
        );
        assert_eq!(MemoryUnit::GIB.to_bytes(GpuMem::new(u64::MAX)), u64::MAX);
    }

    #[test]
    fn failure_env_amounts_use_the_unit() {
        assert_eq!(MemoryUnit::GIB.format_amount(GpuMem::new(2)), "2GiB");
        assert_eq!(MemoryUnit::MIB.format_amount(GpuMem::new(4)), "4MiB");
        let coarse: MemoryUnit = "256MiB".parse().unwrap();
        assert_eq!(coarse.format_amount(GpuMem::new(2)), "512MiB");
    }
}
