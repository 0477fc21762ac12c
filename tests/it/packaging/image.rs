//! The container image (Dockerfile, linted structurally: no Docker engine exists here) and the
//! krew plugin manifest.

use yaml_serde::Value;

use gpushare::buildinfo::KUBECTL_PLUGIN_NAME;
use gpushare::core::wire;

use super::read;

/// The value of `NAME := value` in the Makefile.
fn make_var(makefile: &str, name: &str) -> String {
    makefile
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(":=")?;
            (k.trim() == name).then(|| v.trim().to_string())
        })
        .unwrap_or_else(|| panic!("Makefile has no {name} :="))
}

/// The Makefile's static binary path, `$(MUSL_TARGET)` expanded.
fn static_bin_path() -> String {
    let makefile = read("Makefile");
    make_var(&makefile, "STATIC_BIN").replace("$(MUSL_TARGET)", &make_var(&makefile, "MUSL_TARGET"))
}

/// Dockerfile instructions (keyword upper-cased, arguments), continuation lines joined.
fn instructions(dockerfile: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in dockerfile.lines() {
        let t = line.trim();
        if pending.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(cont) = t.strip_suffix('\\') {
            pending.push_str(cont);
            pending.push(' ');
            continue;
        }
        pending.push_str(t);
        let (kw, rest) = pending
            .split_once(char::is_whitespace)
            .unwrap_or((&pending, ""));
        out.push((kw.to_uppercase(), rest.trim().to_string()));
        pending.clear();
    }
    assert!(pending.is_empty(), "Dockerfile ends inside a continuation");
    out
}

#[test]
fn dockerfile_wraps_the_static_binary_on_a_glibc_base() {
    let text = read("packaging/Dockerfile");
    let ins = instructions(&text);
    let known = [
        "FROM",
        "COPY",
        "RUN",
        "ENV",
        "ENTRYPOINT",
        "CMD",
        "ARG",
        "LABEL",
        "USER",
        "WORKDIR",
    ];
    for (kw, _) in &ins {
        assert!(known.contains(&kw.as_str()), "unexpected instruction {kw}");
    }
    let froms: Vec<&str> = ins
        .iter()
        .filter(|(k, _)| k == "FROM")
        .map(|(_, a)| a.as_str())
        .collect();
    assert_eq!(froms.len(), 1, "one stage: {froms:?}");
    // The device plugin runs the injected nvidia-smi, a glibc program (ARCHITECTURE.md §6).
    let glibc_bases = [
        "debian:",
        "ubuntu:",
        "gcr.io/distroless/base",
        "gcr.io/distroless/cc",
    ];
    assert!(
        glibc_bases.iter().any(|b| froms[0].starts_with(b)),
        "base {} is not a known glibc image",
        froms[0]
    );
    assert!(!text.contains("FROM scratch"));

    let copy = ins.iter().find(|(k, _)| k == "COPY").expect("a COPY");
    let parts: Vec<&str> = copy.1.split_whitespace().collect();
    assert_eq!(
        parts,
        [static_bin_path().as_str(), "/usr/local/bin/gpushare"]
    );

    let run = ins.iter().find(|(k, _)| k == "RUN").expect("a RUN");
    assert!(
        run.1.contains(&format!(
            "ln -s gpushare /usr/local/bin/{KUBECTL_PLUGIN_NAME}"
        )),
        "kubectl plugin symlink: {}",
        run.1
    );
    let env: String = ins
        .iter()
        .filter(|(k, _)| k == "ENV")
        .map(|(_, a)| a.clone())
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        env.contains(&format!("{}=all", wire::ENV_VISIBLE_DEVICES)),
        "{env}"
    );
    assert!(env.contains("NVIDIA_DRIVER_CAPABILITIES=utility"), "{env}");

    let entry = ins
        .iter()
        .find(|(k, _)| k == "ENTRYPOINT")
        .expect("an ENTRYPOINT");
    let entry: Vec<String> =
        serde_json::from_str(&entry.1).expect("ENTRYPOINT in exec (JSON) form");
    assert_eq!(entry, ["/usr/local/bin/gpushare"]);
}

#[test]
fn krew_manifest_installs_the_inspect_plugin() {
    let m: Value =
        yaml_serde::from_str(&read("packaging/krew/inspect-gpushare.yaml")).expect("parses");
    assert_eq!(
        m["apiVersion"],
        "krew.googlecontainertools.github.com/v1alpha2"
    );
    assert_eq!(m["kind"], "Plugin");
    assert_eq!(m["metadata"]["name"], "inspect-gpushare");
    assert_eq!(
        m["spec"]["version"],
        format!("v{}", env!("CARGO_PKG_VERSION"))
    );
    for key in ["homepage", "shortDescription", "description"] {
        assert!(
            m["spec"][key].as_str().is_some_and(|s| !s.is_empty()),
            "spec.{key}"
        );
    }
    let platforms = m["spec"]["platforms"].as_sequence().expect("platforms");
    let linux = platforms
        .iter()
        .find(|p| {
            p["selector"]["matchLabels"]["os"] == "linux"
                && p["selector"]["matchLabels"]["arch"] == "amd64"
        })
        .expect("a linux/amd64 platform");
    assert_eq!(linux["bin"], KUBECTL_PLUGIN_NAME);
    let files = linux["files"].as_sequence().expect("files");
    assert!(files.iter().any(|f| f["from"] == KUBECTL_PLUGIN_NAME));
    let sha = linux["sha256"].as_str().expect("sha256");
    assert!(
        sha.len() == 64 && sha.chars().all(|c| c.is_ascii_hexdigit()),
        "sha256 {sha}"
    );
    let uri = linux["uri"].as_str().expect("uri");
    let musl_target = make_var(&read("Makefile"), "MUSL_TARGET");
    assert!(
        uri.starts_with("https://") && uri.ends_with(".tar.gz"),
        "{uri}"
    );
    assert!(
        uri.contains(&musl_target),
        "the static release tarball: {uri}"
    );
}
