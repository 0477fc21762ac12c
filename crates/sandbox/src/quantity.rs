//! Kubernetes resource quantities (`16Gi`, `1.5`, `500m`, `1e3`) read exactly, for the sandbox
//! API server's validation and the DRA allocator: parsed as upstream's `resource.ParseQuantity`
//! does (the same grammar and suffixes), compared and added exactly, and written back in
//! upstream's canonical form.
//!
//! A value is held as a whole number of nano-units in an `i128` (upstream keeps nano precision
//! and rounds finer values up, as this does). Values beyond `i128` nano-units (about 1.7e29)
//! are refused as too large rather than rounded. It does not keep upstream's distinction
//! between the formats of two equal quantities beyond what [`Quantity::canonical`] needs (the
//! suffix family of the text it was parsed from).

use std::cmp::Ordering;
use std::fmt;

/// Nano-units per unit.
const NANO: i128 = 1_000_000_000;

/// Why a text is not a quantity.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// Not upstream's grammar (`^[+-]?[0-9.]+([eEinumkKMGTP]*[-+]?[0-9]*)$` with a known suffix).
    #[error(
        "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
    )]
    Format,
    /// Larger than the sandbox represents.
    #[error("quantity {0:?} is too large")]
    TooLarge(String),
}

/// The family of the suffix a quantity was written with, which picks its canonical form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `Ki`, `Mi`, ... (`BinarySI`).
    Binary,
    /// `k`, `M`, `m`, ... or none (`DecimalSI`).
    Decimal,
    /// `e3`, `E6` (`DecimalExponent`).
    Exponent,
}

/// An exact quantity.
#[derive(Clone, Copy, Debug)]
pub struct Quantity {
    nanos: i128,
    format: Format,
}

impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.nanos == other.nanos
    }
}

impl Eq for Quantity {}

impl PartialOrd for Quantity {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Quantity {
    fn cmp(&self, other: &Self) -> Ordering {
        self.nanos.cmp(&other.nanos)
    }
}

impl std::str::FromStr for Quantity {
    type Err = QuantityError;

    fn from_str(s: &str) -> Result<Quantity, QuantityError> {
        Quantity::parse(s)
    }
}

impl Quantity {
    /// Zero.
    pub const ZERO: Quantity = Quantity {
        nanos: 0,
        format: Format::Decimal,
    };

    /// A whole number of units written in the binary format (upstream's
    /// `NewQuantity(n, BinarySI)`).
    pub fn from_units(units: i64) -> Quantity {
        Quantity {
            nanos: i128::from(units) * NANO,
            format: Format::Binary,
        }
    }

    /// Parses `text` as upstream's `resource.ParseQuantity` does.
    pub fn parse(text: &str) -> Result<Quantity, QuantityError> {
        let too_large = || QuantityError::TooLarge(text.to_string());
        let bytes = text.as_bytes();
        let (negative, rest) = match bytes.first() {
            Some(b'-') => (true, &text[1..]),
            Some(b'+') => (false, &text[1..]),
            Some(_) => (false, text),
            None => return Err(QuantityError::Format),
        };
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(num_end);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return Err(QuantityError::Format);
        }
        let (decimal_exp, binary_shift, format): (i32, u32, Format) = match suffix {
            "" => (0, 0, Format::Decimal),
            "n" => (-9, 0, Format::Decimal),
            "u" => (-6, 0, Format::Decimal),
            "m" => (-3, 0, Format::Decimal),
            "k" => (3, 0, Format::Decimal),
            "M" => (6, 0, Format::Decimal),
            "G" => (9, 0, Format::Decimal),
            "T" => (12, 0, Format::Decimal),
            "P" => (15, 0, Format::Decimal),
            "E" => (18, 0, Format::Decimal),
            "Ki" => (0, 10, Format::Binary),
            "Mi" => (0, 20, Format::Binary),
            "Gi" => (0, 30, Format::Binary),
            "Ti" => (0, 40, Format::Binary),
            "Pi" => (0, 50, Format::Binary),
            "Ei" => (0, 60, Format::Binary),
            exp => {
                let digits = exp
                    .strip_prefix('e')
                    .or_else(|| exp.strip_prefix('E'))
                    .ok_or(QuantityError::Format)?;
                let unsigned = digits.strip_prefix(['+', '-']).unwrap_or(digits);
                if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(QuantityError::Format);
                }
                let e: i32 = digits.parse().map_err(|_| too_large())?;
                (e, 0, Format::Exponent)
            }
        };
        // value = digits × 10^(decimal_exp - fraction.len()) × 2^binary_shift, in nano-units.
        let digits = format!("{whole}{fraction}");
        let digits = digits.trim_start_matches('0');
        let mantissa: i128 = if digits.is_empty() {
            0
        } else if digits.len() > 36 {
            return Err(too_large());
        } else {
            digits.parse().map_err(|_| QuantityError::Format)?
        };
        let exp10 = i64::from(decimal_exp) - fraction.len() as i64 + 9;
        let mut nanos = mantissa
            .checked_mul(1i128 << binary_shift)
            .ok_or_else(too_large)?;
        if exp10 >= 0 {
            let scale = 10i128.checked_pow(exp10 as u32).ok_or_else(too_large)?;
            nanos = nanos.checked_mul(scale).ok_or_else(too_large)?;
        } else {
            // Finer than a nano-unit: rounded up, as upstream does.
            let scale = 10i128
                .checked_pow((-exp10).min(38) as u32)
                .unwrap_or(i128::MAX);
            let rounded_down = nanos / scale;
            nanos = if rounded_down * scale == nanos {
                rounded_down
            } else {
                rounded_down + 1
            };
        }
        Ok(Quantity {
            nanos: if negative { -nanos } else { nanos },
            format,
        })
    }

    /// The sign: -1, 0 or 1.
    pub fn sign(&self) -> i32 {
        self.nanos.signum() as i32
    }

    /// Whether the value is a whole number of units.
    pub fn is_integer(&self) -> bool {
        self.nanos % NANO == 0
    }

    /// The value rounded up (away from zero) to a whole number of units, as upstream's
    /// `Quantity.Value()`; `None` beyond `i64`.
    pub fn value(&self) -> Option<i64> {
        let whole = self.nanos / NANO;
        let whole = if self.nanos % NANO != 0 {
            whole + self.nanos.signum()
        } else {
            whole
        };
        i64::try_from(whole).ok()
    }

    /// The value in thousandths, rounded up, as upstream's `MilliValue()`; `None` beyond `i64`.
    pub fn milli_value(&self) -> Option<i64> {
        let per_milli = NANO / 1000;
        let whole = self.nanos / per_milli;
        let whole = if self.nanos % per_milli != 0 {
            whole + self.nanos.signum()
        } else {
            whole
        };
        i64::try_from(whole).ok()
    }

    /// The value as a float (upstream's `AsApproximateFloat64`).
    pub fn as_f64(&self) -> f64 {
        self.nanos as f64 / NANO as f64
    }

    /// `self + other`, `None` on overflow.
    pub fn checked_add(&self, other: &Quantity) -> Option<Quantity> {
        Some(Quantity {
            nanos: self.nanos.checked_add(other.nanos)?,
            format: self.format,
        })
    }

    /// `self - other`, `None` on overflow.
    pub fn checked_sub(&self, other: &Quantity) -> Option<Quantity> {
        Some(Quantity {
            nanos: self.nanos.checked_sub(other.nanos)?,
            format: self.format,
        })
    }

    /// The quantity as upstream's `Quantity.String()` writes it: binary quantities with the
    /// largest binary suffix that keeps them whole (below 1024, or fractional, as decimal),
    /// decimal ones with the largest SI suffix that keeps the number whole.
    pub fn canonical(&self) -> String {
        if self.nanos == 0 {
            return "0".to_string();
        }
        let sign = if self.nanos < 0 { "-" } else { "" };
        let abs = self.nanos.unsigned_abs();
        let nano = NANO as u128;
        if self.format == Format::Binary && abs.is_multiple_of(nano) && abs / nano >= 1024 {
            let mut units = abs / nano;
            let mut suffix = 0;
            const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
            while units.is_multiple_of(1024) && suffix < 6 {
                units /= 1024;
                suffix += 1;
            }
            return format!("{sign}{units}{}", SUFFIXES[suffix]);
        }
        // Decimal: exponent of 10 (a multiple of 3) with a whole mantissa, as large as possible.
        const SI: [(i32, &str); 10] = [
            (18, "E"),
            (15, "P"),
            (12, "T"),
            (9, "G"),
            (6, "M"),
            (3, "k"),
            (0, ""),
            (-3, "m"),
            (-6, "u"),
            (-9, "n"),
        ];
        for (exp, suffix) in SI {
            let scale = 10u128.pow((exp + 9) as u32);
            if abs.is_multiple_of(scale) {
                return format!("{sign}{}{suffix}", abs / scale);
            }
        }
        format!("{sign}{abs}n")
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.canonical())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn upstream_grammar_and_suffixes() {
        assert_eq!(q("16Gi").value(), Some(16 << 30));
        assert_eq!(q("1.5Ki").value(), Some(1536));
        assert_eq!(q("1e3").value(), Some(1000));
        assert_eq!(q("1E-3").milli_value(), Some(1));
        assert_eq!(q("500m").milli_value(), Some(500));
        assert_eq!(q("500m").value(), Some(1), "rounded up");
        assert_eq!(q("-1").sign(), -1);
        assert_eq!(q(".5").milli_value(), Some(500));
        assert_eq!(q("0"), Quantity::ZERO);
        assert_eq!(q("1n").milli_value(), Some(1), "rounded up");
        for bad in [
            "", "Gi", "1K", "1.2.3", "1 Gi", "1Gii", "e3", "1e", "1e+", "--1", "1gi",
        ] {
            assert_eq!(
                Quantity::parse(bad).map(|_| ()),
                Err(QuantityError::Format),
                "{bad:?}"
            );
        }
        assert!(matches!(
            Quantity::parse("1e40"),
            Err(QuantityError::TooLarge(_))
        ));
    }

    #[test]
    fn comparisons_are_exact_across_formats() {
        assert_eq!(q("1Gi"), q("1024Mi"));
        assert_eq!(q("1k"), q("1000"));
        assert!(q("1G") < q("1Gi"));
        assert_eq!(q("0.1Ki").checked_add(&q("0.9Ki")), Some(q("1Ki")));
    }

    #[test]
    fn canonical_forms_are_upstreams() {
        assert_eq!(q("1024Mi").canonical(), "1Gi");
        assert_eq!(q("1536Mi").canonical(), "1536Mi");
        assert_eq!(q("1000").canonical(), "1k");
        assert_eq!(q("1500").canonical(), "1500");
        assert_eq!(q("0.5").canonical(), "500m");
        assert_eq!(q("512Ki").canonical(), "512Ki");
        assert_eq!(q("100Ki").canonical(), "100Ki");
        assert_eq!(Quantity::from_units(1536).canonical(), "1536");
        assert_eq!(Quantity::from_units(2 << 30).canonical(), "2Gi");
        assert_eq!(q("-2Gi").canonical(), "-2Gi");
    }
}
