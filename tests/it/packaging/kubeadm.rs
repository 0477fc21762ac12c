//! `packaging/kubeadm/install-scheduler-extender.sh` against a copy of a kubeadm 1.31
//! `/etc/kubernetes` tree (`tests/fixtures/kubeadm`): apply, idempotent re-apply, dry run,
//! revert, doctor invocation, refusal of foreign layouts.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use k8s_openapi::api::core::v1::Pod;
use yaml_serde::Value;

use crate::support::helm_chart::{assert_scheduler_config, default_extender_url};
use crate::support::source_tree::{read, repo_path};

const SCRIPT: &str = "packaging/kubeadm/install-scheduler-extender.sh";
const MANIFEST: &str = "etc/kubernetes/manifests/kube-scheduler.yaml";
const CONFIG: &str = "etc/kubernetes/gpushare/scheduler-config.yaml";
const BACKUP: &str = "etc/kubernetes/gpushare/kube-scheduler.yaml.orig";
const HOST_CONFIG: &str = "/etc/kubernetes/gpushare/scheduler-config.yaml";

/// A temporary root holding a copy of the fixture tree.
struct Root {
    dir: tempfile::TempDir,
}

impl Root {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        copy_tree(&crate::support::fixture("kubeadm"), dir.path());
        Root { dir }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn read(&self, rel: &str) -> String {
        std::fs::read_to_string(self.path(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
    }

    /// Runs the script on this root with `args`; PATH is `path_dirs` plus the system's
    /// basic directories (so `gpushare` is found only where a test puts it).
    fn run_with_path(&self, args: &[&str], path_dirs: &[&Path]) -> Output {
        let mut path: Vec<String> = path_dirs.iter().map(|p| p.display().to_string()).collect();
        path.extend(["/usr/local/bin", "/usr/bin", "/bin"].map(String::from));
        Command::new("bash")
            .arg(repo_path(SCRIPT))
            .arg("--root")
            .arg(self.dir.path())
            .args(args)
            .env_clear()
            .env("PATH", path.join(":"))
            .output()
            .expect("bash runs")
    }

    fn run(&self, args: &[&str]) -> Output {
        self.run_with_path(args, &[])
    }

    /// Every file under the root with its bytes, for "nothing changed" checks.
    fn snapshot(&self) -> Vec<(PathBuf, Vec<u8>)> {
        let mut out = Vec::new();
        walk(self.dir.path(), &mut out);
        out.sort();
        out
    }
}

fn walk(dir: &Path, out: &mut Vec<(PathBuf, Vec<u8>)>) {
    for entry in std::fs::read_dir(dir).expect("read_dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            walk(&path, out);
        } else {
            let bytes = std::fs::read(&path).expect("read");
            out.push((path, bytes));
        }
    }
}

fn copy_tree(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).expect("fixture dir") {
        let path = entry.expect("entry").path();
        let target = to.join(path.file_name().expect("name"));
        if path.is_dir() {
            std::fs::create_dir_all(&target).expect("mkdir");
            copy_tree(&path, &target);
        } else {
            std::fs::copy(&path, &target).expect("copy");
        }
    }
}

fn ok(out: &Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "script failed ({:?}):\n{text}",
        out.status
    );
    text
}

fn container_of(manifest: &str) -> (Pod, k8s_openapi::api::core::v1::Container) {
    let pod: Pod = yaml_serde::from_str(manifest).expect("the manifest is still a Pod");
    let spec = pod.spec.clone().expect("pod spec");
    let container = spec.containers.into_iter().next().expect("a container");
    (pod, container)
}

#[test]
fn apply_patches_the_manifest_and_installs_the_config() {
    let root = Root::new();
    let original = root.read(MANIFEST);
    let out = ok(&root.run(&["--no-doctor"]));
    assert!(out.contains("patched"), "{out}");

    let patched = root.read(MANIFEST);
    let (pod, c) = container_of(&patched);
    let command = c.command.clone().expect("command");
    assert_eq!(command[0], "kube-scheduler");
    let flag = format!("--config={HOST_CONFIG}");
    assert_eq!(
        command.iter().filter(|a| **a == flag).count(),
        1,
        "{command:?}"
    );
    // Everything kubeadm had is still there, in order.
    let (_, orig_c) = container_of(&original);
    let orig_command = orig_c.command.expect("command");
    assert_eq!(command[..orig_command.len()], orig_command[..]);

    let mounts = c.volume_mounts.expect("mounts");
    let mount = mounts
        .iter()
        .find(|m| m.mount_path == "/etc/kubernetes/gpushare")
        .expect("the gpushare mount");
    assert_eq!(mount.read_only, Some(true));
    assert!(mounts.iter().any(|m| m.name == "kubeconfig"));
    let volumes = pod.spec.expect("spec").volumes.expect("volumes");
    let volume = volumes
        .iter()
        .find(|v| v.name == mount.name)
        .expect("the mount's volume");
    let host = volume.host_path.as_ref().expect("hostPath");
    assert_eq!(host.path, "/etc/kubernetes/gpushare");
    assert_eq!(host.type_.as_deref(), Some("DirectoryOrCreate"));
    assert!(volumes.iter().any(|v| v.name == "kubeconfig"));

    // The installed configuration is the shipped one (same parsed content).
    let installed: Value = yaml_serde::from_str(&root.read(CONFIG)).expect("config parses");
    assert_scheduler_config(&installed, &default_extender_url());
    let shipped: Value =
        yaml_serde::from_str(&read("packaging/scheduler/scheduler-config.yaml")).expect("parses");
    assert_eq!(installed, shipped);
    assert_eq!(
        root.read(BACKUP),
        original,
        "the backup is the untouched original"
    );
}

#[test]
fn second_apply_changes_nothing() {
    let root = Root::new();
    ok(&root.run(&["--no-doctor"]));
    let before = root.snapshot();
    let out = ok(&root.run(&["--no-doctor"]));
    assert!(out.contains("no change"), "{out}");
    assert_eq!(root.snapshot(), before, "re-apply must be byte-identical");
}

#[test]
fn dry_run_prints_the_diff_and_writes_nothing() {
    let root = Root::new();
    let before = root.snapshot();
    let out = ok(&root.run(&[
        "--dry-run",
        "--extender-url",
        "https://10.0.0.5:32766/gpushare-scheduler",
    ]));
    assert_eq!(root.snapshot(), before, "dry run wrote something");
    assert!(
        out.contains("+++ b/etc/kubernetes/manifests/kube-scheduler.yaml"),
        "{out}"
    );
    assert!(
        out.contains(&format!("+    - --config={HOST_CONFIG}")),
        "{out}"
    );
    assert!(
        out.contains("+    - mountPath: /etc/kubernetes/gpushare"),
        "{out}"
    );
    assert!(
        out.contains("+      path: /etc/kubernetes/gpushare"),
        "{out}"
    );
    assert!(
        out.contains("+  - urlPrefix: \"https://10.0.0.5:32766/gpushare-scheduler\""),
        "{out}"
    );
    assert!(out.contains("+    enableHTTPS: true"), "{out}");

    // After an apply, a dry run has nothing to show.
    ok(&root.run(&["--no-doctor"]));
    let out = ok(&root.run(&["--dry-run"]));
    assert!(!out.contains("+++"), "{out}");
    assert!(out.contains("no change"), "{out}");
}

#[test]
fn revert_restores_the_original_bytes() {
    let root = Root::new();
    let before = root.snapshot();
    ok(&root.run(&["--no-doctor"]));
    let out = ok(&root.run(&["--revert", "--dry-run"]));
    assert!(
        out.contains(&format!("-    - --config={HOST_CONFIG}")),
        "{out}"
    );
    ok(&root.run(&["--revert"]));
    assert_eq!(
        root.snapshot(),
        before,
        "revert must restore the tree byte for byte"
    );
    // Reverting twice is harmless.
    let out = ok(&root.run(&["--revert"]));
    assert!(out.contains("nothing to revert"), "{out}");
    assert_eq!(root.snapshot(), before);
}

#[test]
fn revert_after_the_manifest_changed_removes_only_our_edits() {
    let root = Root::new();
    let original = root.read(MANIFEST);
    ok(&root.run(&["--no-doctor"]));
    // An operator bumps the image after the install: the backup no longer applies.
    let bump = |s: &str| s.replace("kube-scheduler:v1.31.4", "kube-scheduler:v1.31.5");
    std::fs::write(root.path(MANIFEST), bump(&root.read(MANIFEST))).expect("write");
    let out = ok(&root.run(&["--revert"]));
    assert!(out.contains("removing the gpushare edits"), "{out}");
    assert_eq!(root.read(MANIFEST), bump(&original));
}

#[test]
fn doctor_runs_when_gpushare_is_on_path() {
    let root = Root::new();
    let bin = tempfile::tempdir().expect("tempdir");
    let log = bin.path().join("args");
    let fake = bin.path().join("gpushare");
    std::fs::write(
        &fake,
        format!("#!/bin/sh\necho \"$@\" > '{}'\nexit 0\n", log.display()),
    )
    .expect("write fake");
    make_executable(&fake);
    ok(&root.run_with_path(&[], &[bin.path()]));
    let args = std::fs::read_to_string(&log).expect("doctor was run");
    assert!(
        args.contains(&format!(
            "doctor --role control-plane --scheduler-config {HOST_CONFIG}"
        )),
        "{args}"
    );

    // A failing doctor fails the script (the change is made, the report says what is wrong).
    std::fs::write(&fake, "#!/bin/sh\necho extender unreachable\nexit 1\n").expect("write fake");
    let out = root.run_with_path(&[], &[bin.path()]);
    assert_eq!(out.status.code(), Some(1));

    // --no-doctor and a missing gpushare skip it.
    std::fs::remove_file(&log).ok();
    let fresh = Root::new();
    let out = ok(&fresh.run(&[]));
    assert!(out.contains("gpushare is not on PATH"), "{out}");
}

fn make_executable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

#[test]
fn refuses_layouts_it_cannot_patch_safely() {
    // kube-scheduler already has a --config of its own: nothing written, exit 2.
    let root = Root::new();
    let m = root.read(MANIFEST).replace(
        "    - --leader-elect=true\n",
        "    - --leader-elect=true\n    - --config=/etc/kubernetes/custom-scheduler.yaml\n",
    );
    std::fs::write(root.path(MANIFEST), m).expect("write");
    let before = root.snapshot();
    let out = root.run(&["--no-doctor"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("custom-scheduler.yaml"));
    assert_eq!(root.snapshot(), before);

    // No volumeMounts list: refused, nothing written.
    let root = Root::new();
    let m = root.read(MANIFEST);
    let cut = m.replace(
        "    volumeMounts:\n    - mountPath: /etc/kubernetes/scheduler.conf\n      name: kubeconfig\n      readOnly: true\n",
        "",
    );
    assert_ne!(cut, m, "fixture layout changed");
    std::fs::write(root.path(MANIFEST), cut).expect("write");
    let before = root.snapshot();
    let out = root.run(&["--no-doctor"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(root.snapshot(), before);

    // Bad flags.
    let root = Root::new();
    for args in [&["--extender-url", "ftp://x"][..], &["--bogus"][..]] {
        assert_eq!(root.run(args).status.code(), Some(2), "{args:?}");
    }
}

#[test]
fn indented_list_style_is_handled_too() {
    // Some tools re-serialise the manifest with lists indented under their key.
    let root = Root::new();
    let m = root.read(MANIFEST);
    let indented = shift_region(&m, "  - command:\n", "    image:");
    let indented = shift_region(&indented, "    volumeMounts:\n", "  hostNetwork:");
    let indented = shift_region(&indented, "  volumes:\n", "status:");
    assert_ne!(indented, m, "fixture layout changed");
    std::fs::write(root.path(MANIFEST), &indented).expect("write");
    let _: Pod = yaml_serde::from_str(&indented).expect("the re-indented fixture is a Pod");
    ok(&root.run(&["--no-doctor"]));
    let (pod, c) = container_of(&root.read(MANIFEST));
    assert!(
        c.command
            .expect("command")
            .iter()
            .any(|a| a.ends_with(HOST_CONFIG))
    );
    assert!(
        c.volume_mounts
            .expect("mounts")
            .iter()
            .any(|m| m.mount_path == "/etc/kubernetes/gpushare")
    );
    assert!(
        pod.spec
            .expect("spec")
            .volumes
            .expect("volumes")
            .iter()
            .any(|v| v.name == "gpushare-config")
    );
    ok(&root.run(&["--revert"]));
    assert_eq!(root.read(MANIFEST), indented);
}

/// `text` with every line between `after` (exclusive) and the first line starting with
/// `until` indented two more columns.
fn shift_region(text: &str, after: &str, until: &str) -> String {
    let Some(start) = text.find(after).map(|i| i + after.len()) else {
        return text.to_string();
    };
    let (head, tail) = text.split_at(start);
    let end = tail
        .find(&format!("\n{until}"))
        .map_or(tail.len(), |i| i + 1);
    let (region, rest) = tail.split_at(end);
    let shifted: String = region.lines().map(|l| format!("  {l}\n")).collect();
    format!("{head}{shifted}{rest}")
}
