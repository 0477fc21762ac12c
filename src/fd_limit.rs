//! The open-file limit of a serving process: raises the soft `RLIMIT_NOFILE` to the hard one
//! at start (systemd and container runtimes often hand out a soft 1024 under a much higher
//! hard limit, and `accept` then fails with EMFILE long before `http.max_connections`), and
//! reads what is in force for `doctor`.
//!
//! It does not choose the hard limit (the unit's `LimitNOFILE=`, the runtime's ulimits do).

/// The soft and hard `RLIMIT_NOFILE` in force (`None` where it cannot be read).
pub fn current() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: FFI call with a valid pointer to a local `rlimit` the kernel fills in.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    (rc == 0).then_some((lim.rlim_cur, lim.rlim_max))
}

/// Raises the soft open-file limit to the hard one; returns the soft limit now in force. A
/// refusal (a seccomp filter, an unprivileged container) leaves the limit as it was.
pub fn raise_soft_to_hard() -> Option<u64> {
    let (soft, hard) = current()?;
    if soft >= hard {
        return Some(soft);
    }
    let lim = libc::rlimit {
        rlim_cur: hard,
        rlim_max: hard,
    };
    // SAFETY: FFI call with a valid pointer to a local, initialised `rlimit`.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    if rc == 0 {
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
