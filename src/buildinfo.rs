//! Facts about this build and this executable: version, git commit, target triple, whether
//! it is statically linked, the names it answers to as a kubectl plugin, and whether this
//! platform runs the server roles (Linux) or only the kubectl plugin (macOS, Windows).
//!
//! A module of its own so that the dispatcher (`cli`), `doctor` and `demo` can all read them
//! without importing each other. It reads `/proc/self/maps` and nothing else.

/// Name under which the binary acts as `gpushare inspect`.
pub const KUBECTL_PLUGIN_NAME: &str = "kubectl-inspect-gpushare";
/// How a user types the plugin: what its usage line and errors name.
pub(crate) const KUBECTL_PLUGIN_COMMAND: &str = "kubectl inspect gpushare";
/// The same, as krew links it (`-` in a plugin name becomes `_`).
pub(crate) const KREW_PLUGIN_NAME: &str = "kubectl-inspect_gpushare";

/// The release version: `GPUSHARE_VERSION` at build time (`make dist VERSION=x.y.z` sets
/// it), otherwise the crate version (`0.1.0`). See `build.rs`.
pub const VERSION: &str = env!("BUILD_VERSION");
/// The git commit the binary was built from (12 hex digits), or `unknown`.
pub const GIT_COMMIT: &str = env!("BUILD_GIT_COMMIT");
/// The target triple the binary was built for.
pub const TARGET_TRIPLE: &str = env!("BUILD_TARGET_TRIPLE");

/// Whether this executable is statically linked (no ELF interpreter).
pub(crate) fn is_static_binary() -> bool {
    // A dynamically linked program always maps its interpreter (ld-linux / ld-musl).
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(maps) => !maps
            .lines()
            .any(|l| l.contains("/ld-linux") || l.contains("/ld-musl")),
        Err(_) => cfg!(target_env = "musl"),
    }
}

/// `static` or `dynamic`.
pub fn linkage() -> &'static str {
    if is_static_binary() {
        "static"
    } else {
        "dynamic"
    }
}

/// What `gpushare version` prints.
pub(crate) fn version_text() -> String {
    format!(
        "gpushare {VERSION}\ncommit: {GIT_COMMIT}\ntarget: {TARGET_TRIPLE}\nlinkage: {}\n",
        linkage()
    )
}

/// Whether this build runs the server roles (extender, device plugin): they need a Linux node.
/// Elsewhere (the macOS and Windows kubectl-plugin builds) only `inspect`, `doctor` and
/// `version` run.
pub(crate) const SERVER_ROLES_RUN_HERE: bool = cfg!(target_os = "linux");

/// A server role asked for on a platform that only runs the kubectl plugin.
#[derive(Debug, thiserror::Error)]
#[error(
    "gpushare {role} runs on Linux nodes only; this build ({target}) is the kubectl plugin: use `inspect` or `doctor`"
)]
pub(crate) struct ServerRoleNotHere {
    /// The role asked for (`extender`, `device-plugin`).
    pub role: String,
    /// The target triple of this build.
    pub target: &'static str,
}

/// `Ok` where the server roles run (Linux); the refusal for `role` elsewhere.
pub(crate) fn ensure_server_platform(role: &str) -> Result<(), ServerRoleNotHere> {
    if SERVER_ROLES_RUN_HERE {
        Ok(())
    } else {
        Err(ServerRoleNotHere {
            role: role.to_string(),
            target: TARGET_TRIPLE,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_roles_are_refused_off_linux_with_the_role_and_target_named() {
        let e = ServerRoleNotHere {
            role: "extender".to_string(),
            target: "x86_64-pc-windows-gnu",
        };
        let msg = e.to_string();
        assert!(
            msg.contains("gpushare extender runs on Linux nodes only"),
            "{msg}"
        );
        assert!(msg.contains("x86_64-pc-windows-gnu"), "{msg}");
        assert!(msg.contains("`inspect` or `doctor`"), "{msg}");
        assert_eq!(
            ensure_server_platform("device-plugin").is_ok(),
            cfg!(target_os = "linux")
        );
    }
}
