//! What the crates link, asked of `cargo tree` (normal dependencies, offline; nothing is
//! built): the pure core links nothing of the outside world, the binary without the `demo`
//! feature links no sandbox (and with it, does), nothing links the CUDA memory limiter, and
//! the limiter's contract crate links nothing heavy.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;

use crate::{Finding, Rule};

/// The package names in `cargo tree` for `args`, run in `root`; `Err` with cargo's words.
fn dependency_names(
    cargo: &OsStr,
    root: &Path,
    args: &[&str],
) -> Result<BTreeSet<String>, Finding> {
    let failed =
        |why: String| Finding::new(Rule::Links, format!("cargo tree {}", args.join(" ")), why);
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .args(args)
        .current_dir(root)
        .output()
        .map_err(|e| failed(format!("cargo does not run: {e}")))?;
    if !out.status.success() {
        return Err(failed(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect())
}

/// Every link rule over the workspace at `root`, with `cargo` the cargo to ask.
pub fn check_links(cargo: &OsStr, root: &Path) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut ask = |args: &[&str]| match dependency_names(cargo, root, args) {
        Ok(names) => Some(names),
        Err(finding) => {
            out.push(finding);
            None
        }
    };
    let core = ask(&["-p", "gpushare-core"]);
    let full = ask(&["-p", "gpushare"]);
    let lean = ask(&["-p", "gpushare", "--no-default-features"]);
    let contract = ask(&["-p", "gpushare-limiter-contract"]);
    let mut refuse =
        |what: &str, names: &Option<BTreeSet<String>>, forbidden: &[&str], why: &str| {
            let Some(names) = names else { return };
            let found: Vec<&str> = forbidden
                .iter()
                .copied()
                .filter(|f| names.contains(*f))
                .collect();
            if !found.is_empty() {
                out.push(Finding::new(
                    Rule::Links,
                    what.to_string(),
                    format!("links {found:?}: {why}"),
                ));
            }
        };
    let outside = [
        "kube",
        "kube-client",
        "k8s-openapi",
        "hyper",
        "tonic",
        "nvml-wrapper",
        "tokio",
    ];
    let mut core_forbidden = outside.to_vec();
    core_forbidden.extend(["gpushare-kubelet-api", "gpushare-sandbox"]);
    refuse(
        "gpushare-core",
        &core,
        &core_forbidden,
        "the core is the pure domain and links nothing of the outside world",
    );
    refuse(
        "gpushare",
        &full,
        &["gpushare-limiter"],
        "the limiter is preloaded into containers; the node roles read its ledger through \
         gpushare-limiter-contract",
    );
    refuse(
        "gpushare --no-default-features",
        &lean,
        &["gpushare-sandbox"],
        "the lean binary (the DaemonSet's) carries no sandbox",
    );
    let mut contract_forbidden = outside.to_vec();
    contract_forbidden.retain(|c| *c != "kube-client");
    contract_forbidden.extend(["gpushare-limiter", "libc"]);
    refuse(
        "gpushare-limiter-contract",
        &contract,
        &contract_forbidden,
        "the contract between the node agent and the limiter links nothing heavy",
    );
    // Each listing names the crate asked about: a `cargo tree` that answers nothing proves
    // nothing. The default build links the sandbox (`gpushare demo`).
    for (names, package, why) in [
        (&core, "gpushare-core", "cargo tree listed the crate"),
        (
            &lean,
            "gpushare-core",
            "cargo tree listed the lean binary's dependencies",
        ),
        (
            &contract,
            "gpushare-limiter-contract",
            "cargo tree listed the crate",
        ),
        (
            &full,
            "gpushare-sandbox",
            "the default build (with `gpushare demo`) links the sandbox",
        ),
    ] {
        if let Some(names) = names
            && !names.contains(package)
        {
            out.push(Finding::new(
                Rule::Links,
                format!("cargo tree: {package}"),
                format!("expected {package} in the listing ({why}): {names:?}"),
            ));
        }
    }
    out
}
