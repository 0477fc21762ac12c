//! The open-file limit of a serving process: raises the soft `RLIMIT_NOFILE` to the hard one
//! at start (systemd and container runtimes often hand out a soft 1024 under a much higher
//! hard limit, and `accept` then fails with EMFILE long before `http.max_connections`), and
//! reads what is in force for `doctor`.
//!
//! It does not choose the hard limit (the unit's `LimitNOFILE=`, the runtime's ulimits do).

/// The soft and hard `RLIMIT_NOFILE` in force (`None` where it cannot be read); "unlimited"
/// reads as `u64::MAX`.
#[cfg(unix)]
pub fn current() -> Option<(u64, u64)> {
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    Some((
        lim.current.unwrap_or(u64::MAX),
        lim.maximum.unwrap_or(u64::MAX),
    ))
}

/// No open-file limit to read off unix.
#[cfg(not(unix))]
pub fn current() -> Option<(u64, u64)> {
    None
}

/// Raises the soft open-file limit to the hard one; returns the soft limit now in force. A
/// refusal (a seccomp filter, an unprivileged container) leaves the limit as it was.
pub fn raise_soft_to_hard() -> Option<u64> {
    let (soft, hard) = current()?;
    if soft >= hard {
        return Some(soft);
    }
    if set_soft(hard) {
        tracing::debug!(from = soft, to = hard, "raised the soft open-file limit");
        Some(hard)
    } else {
        tracing::warn!(
            soft,
            hard,
            "could not raise the soft open-file limit; connections beyond it fail with EMFILE"
        );
        Some(soft)
    }
}

/// Sets the soft and hard limits to `hard`: whether the kernel took it.
#[cfg(unix)]
fn set_soft(hard: u64) -> bool {
    let to = (hard != u64::MAX).then_some(hard);
    let lim = rustix::process::Rlimit {
        current: to,
        maximum: to,
    };
    rustix::process::setrlimit(rustix::process::Resource::Nofile, lim).is_ok()
}

#[cfg(not(unix))]
fn set_soft(_hard: u64) -> bool {
    false
}

/// The warning for a server whose connection cap is above the open-file limit, if it is.
pub fn cap_warning(max_connections: usize, soft_limit: u64) -> Option<String> {
    // Files besides the connections: the listener, the API client's, logs, TLS files.
    const RESERVED: u64 = 64;
    let needed = max_connections as u64 + RESERVED;
    (soft_limit < needed).then(|| {
        format!(
            "http.max_connections is {max_connections} but the open-file limit is {soft_limit}: \
             accept fails with EMFILE before the cap engages; raise LimitNOFILE= (systemd) or \
             the container's nofile ulimit to at least {needed}, or lower http.max_connections"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_read_and_raising_never_lowers_it() {
        let (soft, hard) = current().unwrap_or((0, 0));
        assert!(soft <= hard);
        let now = raise_soft_to_hard().unwrap_or(0);
        assert!(now >= soft);
    }

    #[test]
    fn a_cap_above_the_limit_is_named() {
        let w = cap_warning(4096, 1024).unwrap_or_default();
        assert!(
            w.contains("4096") && w.contains("1024") && w.contains("LimitNOFILE"),
            "{w}"
        );
        assert_eq!(cap_warning(4096, 65_536), None);
    }
}
