//! Facts about this build and this executable: version, git commit, target triple, whether
//! it is statically linked, and the names it answers to as a kubectl plugin.
//!
//! A module of its own so that the dispatcher (`cli`), `doctor` and `demo` can all read them
//! without importing each other. It reads `/proc/self/maps` and nothing else.

/// Name under which the binary acts as `gpushare inspect`.
pub const KUBECTL_PLUGIN_NAME: &str = "kubectl-inspect-gpushare";
/// How a user types the plugin: what its usage line and errors name.
pub const KUBECTL_PLUGIN_COMMAND: &str = "kubectl inspect gpushare";
/// The same, as krew links it (`-` in a plugin name becomes `_`).
pub const KREW_PLUGIN_NAME: &str = "kubectl-inspect_gpushare";

/// The crate version (`0.1.0`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git commit the binary was built from (12 hex digits), or `unknown`.
pub const GIT_COMMIT: &str = env!("BUILD_GIT_COMMIT");
/// The target triple the binary was built for.
pub const TARGET_TRIPLE: &str = env!("BUILD_TARGET_TRIPLE");

/// Whether this executable is statically linked (no ELF interpreter).
pub fn is_static_binary() -> bool {
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
pub fn version_text() -> String {
    format!(
        "gpushare {VERSION}\ncommit: {GIT_COMMIT}\ntarget: {TARGET_TRIPLE}\nlinkage: {}\n",
        linkage()
    )
}
