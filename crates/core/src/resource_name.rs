//! The rule for extended resource names a device kind may register (`<domain>/<name>`, outside
//! kubernetes.io, not one of the GPU resources), and the DNS labels gpushare makes names from
//! ([`dns_label`], [`unique_dns_label`]: DRA device and request names). Pure: it reads no
//! configuration.

/// Resource names no device kind may take: gpushare's own and NVIDIA's GPU resources.
pub const RESERVED_RESOURCES: &[&str] = &[
    crate::wire::RESOURCE_GPU_MEM,
    crate::wire::RESOURCE_GPU_COUNT,
    "nvidia.com/gpu",
];

/// Why a resource name is not a usable extended resource name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceNameError {
    /// No `domain/` prefix.
    #[error("{0:?} has no domain: write it as <domain>/<name>, e.g. example.com/fuse")]
    NoDomain(String),
    /// The domain is not a DNS subdomain, or is kubernetes.io's.
    #[error("{0:?}: the domain must be a DNS subdomain outside kubernetes.io")]
    BadDomain(String),
    /// The name part is empty, too long or has other characters than `[A-Za-z0-9._-]`.
    #[error(
        "{0:?}: the name after the domain must be 1-63 of [A-Za-z0-9._-], starting and ending alphanumeric"
    )]
    BadName(String),
    /// One of [`RESERVED_RESOURCES`].
    #[error("{0} is a GPU resource; pick another name")]
    Reserved(String),
}

/// Checks `name` is an extended resource name a device kind may register.
pub fn check_resource_name(name: &str) -> Result<(), ResourceNameError> {
    if RESERVED_RESOURCES.contains(&name) {
        return Err(ResourceNameError::Reserved(name.to_string()));
    }
    let (domain, rest) = name
        .split_once('/')
        .ok_or_else(|| ResourceNameError::NoDomain(name.to_string()))?;
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if domain.len() > 253
        || !domain.split('.').all(label_ok)
        || domain == "kubernetes.io"
        || domain.ends_with(".kubernetes.io")
    {
        return Err(ResourceNameError::BadDomain(name.to_string()));
    }
    let alnum = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_alphanumeric());
    if rest.is_empty()
        || rest.len() > 63
        || !rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        || !alnum(rest.bytes().next())
        || !alnum(rest.bytes().last())
    {
        return Err(ResourceNameError::BadName(name.to_string()));
    }
    Ok(())
}

/// `text` as a DNS label fragment: lower case, every character outside `[a-z0-9]` a `-`, no
/// `-` at either end.
pub fn dns_label(text: &str) -> String {
    text.chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '-'
            }
        })
        .collect::<String>()
        .trim_matches('-')
        .to_string()
}

/// A DNS label of `parts` ([`dns_label`] each) joined by `-`, at most 63 characters, unique
/// among `taken` (a `-<n>` suffix when it is not), which it joins.
pub fn unique_dns_label(parts: &[&str], taken: &mut Vec<String>) -> String {
    let joined: Vec<String> = parts.iter().map(|p| dns_label(p)).collect();
    let base: String = joined
        .join("-")
        .chars()
        .take(56)
        .collect::<String>()
        .trim_matches('-')
        .to_string();
    let mut name = base.clone();
    let mut n = 1;
    while taken.contains(&name) {
        n += 1;
        name = format!("{base}-{n}");
    }
    taken.push(name.clone());
    name
}

/// The stable DRA device name of a GPU (the one both node roles agree on): its UUID in lower
/// case when that is a DNS label (`gpu-8e4c1c2e-…`), else `gpu-<index>`.
pub fn gpu_device_name(uuid: &str, index: u32) -> String {
    let lower = uuid.to_ascii_lowercase();
    let label = !lower.is_empty()
        && lower.len() <= 63
        && lower.starts_with("gpu-")
        && lower
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !lower.ends_with('-');
    if label { lower } else { format!("gpu-{index}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_names_are_checked() {
        assert_eq!(check_resource_name("example.com/fuse"), Ok(()));
        assert_eq!(check_resource_name("gpushare.io/rdma"), Ok(()));
        assert!(matches!(
            check_resource_name("fuse"),
            Err(ResourceNameError::NoDomain(_))
        ));
        assert!(matches!(
            check_resource_name("Example.com/x"),
            Err(ResourceNameError::BadDomain(_))
        ));
        assert!(matches!(
            check_resource_name("kubernetes.io/x"),
            Err(ResourceNameError::BadDomain(_))
        ));
        assert!(matches!(
            check_resource_name("example.com/"),
            Err(ResourceNameError::BadName(_))
        ));
        assert!(matches!(
            check_resource_name("example.com/a b"),
            Err(ResourceNameError::BadName(_))
        ));
        assert!(matches!(
            check_resource_name("aliyun.com/gpu-mem"),
            Err(ResourceNameError::Reserved(_))
        ));
        assert!(matches!(
            check_resource_name("nvidia.com/gpu"),
            Err(ResourceNameError::Reserved(_))
        ));
    }
}
