//! The rule for extended resource names a device kind may register (`<domain>/<name>`, outside
//! kubernetes.io, not one of the GPU resources). Pure: it reads no configuration.

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
