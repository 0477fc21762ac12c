//! `gpushare doctor` with a CDI `--device-list-strategy`, over fixture host roots
//! (`tests/fixtures/doctor/cdi-*`): specs present, missing, stale (a foreign UUID, a wrong
//! device node) and CDI disabled in containerd; the nvidia-as-default check is dropped with
//! CDI only and kept when envvar is combined with CDI.

use std::path::Path;

use serde_json::Value;

use crate::support::doctor_node::{fake_node_doctor, find_check, report_of};
use crate::support::fixture;

fn doctor(root: &str, extra: &[&str]) -> Value {
    let root = fixture(&format!("doctor/{root}"));
    report_of(&fake_node_doctor(
        &root,
        "2x16GiB",
        &[&["-o", "json"], extra].concat(),
    ))
}

fn check<'a>(report: &'a Value, id: &str) -> Option<&'a Value> {
    find_check(report, id)
}

fn status_of(report: &Value, id: &str) -> String {
    check(report, id)
        .map(|c| c["status"].as_str().unwrap_or("?").to_string())
        .unwrap_or_else(|| "absent".to_string())
}

fn text_of(report: &Value, id: &str) -> String {
    check(report, id)
        .map(|c| format!("{}\n{}", c["detail"], c["hint"]))
        .unwrap_or_default()
}

#[test]
fn specs_present_and_cdi_on_pass_without_nvidia_as_default() {
    for id_strategy in ["index", "uuid"] {
        let r = doctor(
            "cdi-present",
            &[
                "--device-list-strategy",
                "cdi-cri",
                "--device-id-strategy",
                id_strategy,
            ],
        );
        assert_eq!(
            status_of(&r, "cdi-specs"),
            "ok",
            "{}",
            text_of(&r, "cdi-specs")
        );
        assert!(
            text_of(&r, "cdi-specs").contains("/var/run/cdi/nvidia.yaml"),
            "{}",
            text_of(&r, "cdi-specs")
        );
        assert_eq!(
            status_of(&r, "cdi-runtime"),
            "ok",
            "{}",
            text_of(&r, "cdi-runtime")
        );
        // The root's containerd defaults to runc: with only CDI that is fine.
        assert_eq!(status_of(&r, "container-runtime"), "absent");
    }
}

#[test]
fn envvar_with_cdi_still_asks_for_nvidia_as_default() {
    let r = doctor(
        "cdi-present",
        &["--device-list-strategy", "envvar,cdi-annotations"],
    );
    assert_eq!(status_of(&r, "container-runtime"), "fail");
    assert_eq!(status_of(&r, "cdi-specs"), "ok");
}

#[test]
fn no_cdi_strategy_means_no_cdi_checks() {
    let r = doctor("cdi-missing", &[]);
    assert_eq!(status_of(&r, "cdi-specs"), "absent");
    assert_eq!(status_of(&r, "cdi-runtime"), "absent");
    assert_eq!(status_of(&r, "container-runtime"), "fail");
}

#[test]
fn missing_specs_fail_with_the_nvidia_ctk_command() {
    let r = doctor("cdi-missing", &["--device-list-strategy", "cdi-cri"]);
    assert_eq!(status_of(&r, "cdi-specs"), "fail");
    let text = text_of(&r, "cdi-specs");
    assert!(
        text.contains("no CDI spec in /etc/cdi, /var/run/cdi"),
        "{text}"
    );
    assert!(
        text.contains("nvidia.com/gpu=0") && text.contains("nvidia.com/gpu=1"),
        "{text}"
    );
    assert!(
        text.contains(
            "nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml --device-name-strategy=index"
        ),
        "{text}"
    );
}

#[test]
fn a_stale_spec_is_named() {
    // By UUID: GPU 1 is missing and a foreign UUID is there.
    let r = doctor(
        "cdi-stale",
        &[
            "--device-list-strategy",
            "cdi-cri",
            "--device-id-strategy",
            "uuid",
        ],
    );
    assert_eq!(status_of(&r, "cdi-specs"), "fail");
    let text = text_of(&r, "cdi-specs");
    assert!(
        text.contains("missing: nvidia.com/gpu=GPU-fake-0000-0000-0000-000000000001"),
        "{text}"
    );
    assert!(
        text.contains(
            "nvidia.com/gpu=GPU-520e01f2-cf30-6396-abef-e8e9a5233b0e is not a GPU of this node"
        ),
        "{text}"
    );
    assert!(text.contains("--device-name-strategy=uuid"), "{text}");
    // By index: both names exist, but index 1 points at another device node.
    let r = doctor("cdi-stale", &["--device-list-strategy", "cdi-annotations"]);
    assert_eq!(status_of(&r, "cdi-specs"), "warn");
    let text = text_of(&r, "cdi-specs");
    assert!(
        text.contains("nvidia.com/gpu=1 in /etc/cdi/nvidia.yaml has device nodes /dev/nvidia3 but GPU 1 is /dev/nvidia1"),
        "{text}"
    );
}

#[test]
fn cdi_disabled_in_containerd_fails_with_the_fix() {
    let r = doctor(
        "cdi-containerd-disabled",
        &["--device-list-strategy", "cdi-cri"],
    );
    assert_eq!(status_of(&r, "cdi-specs"), "ok");
    assert_eq!(status_of(&r, "cdi-runtime"), "fail");
    let text = text_of(&r, "cdi-runtime");
    assert!(text.contains("CDI DISABLED"), "{text}");
    assert!(text.contains("enable_cdi = true"), "{text}");
    assert!(text.contains("io.containerd.grpc.v1.cri"), "{text}");
}

#[test]
fn the_runtime_and_the_plugin_must_read_the_same_directories() {
    let r = doctor(
        "cdi-present",
        &[
            "--device-list-strategy",
            "cdi-cri",
            "--cdi-spec-dirs",
            "/opt/cdi",
        ],
    );
    assert_eq!(status_of(&r, "cdi-runtime"), "warn");
    assert!(
        text_of(&r, "cdi-runtime").contains("the device plugin from /opt/cdi"),
        "{}",
        text_of(&r, "cdi-runtime")
    );
    assert!(Path::new(&fixture("doctor/cdi-present/var/run/cdi/nvidia.yaml")).exists());
}
