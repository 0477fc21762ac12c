//! The container image (Dockerfile, checked structurally here and by hadolint in CI: no Docker
//! engine exists here; it carries the binary and the CUDA memory limiter) and the krew plugin manifest template (`make dist-check` validates the
//! manifest `make dist` writes against the archives).

use yaml_serde::Value;

use gpushare::buildinfo::KUBECTL_PLUGIN_NAME;
use gpushare::core::wire;

use crate::support::source_tree::read;

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

/// The value of `key = "value"` in rust-toolchain.toml.
fn toolchain_value(key: &str) -> String {
    read("rust-toolchain.toml")
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
        })
        .unwrap_or_else(|| panic!("rust-toolchain.toml has no {key}"))
}

/// The make targets the Makefile defines (`name:` at the start of a line).
fn make_targets() -> Vec<String> {
    read("Makefile")
        .lines()
        .filter_map(|l| {
            let (name, _) = l.split_once(':')?;
            (!name.is_empty()
                && !l.contains(":=")
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
            .then(|| name.to_string())
        })
        .collect()
}

#[test]
fn dockerfile_builds_the_static_binary_from_source_then_wraps_it_on_a_glibc_base() {
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
        "SHELL",
    ];
    for (kw, _) in &ins {
        assert!(known.contains(&kw.as_str()), "unexpected instruction {kw}");
    }
    let froms: Vec<&str> = ins
        .iter()
        .filter(|(k, _)| k == "FROM")
        .map(|(_, a)| a.as_str())
        .collect();
    assert_eq!(
        froms.len(),
        2,
        "a build stage and a runtime stage: {froms:?}"
    );

    // Build stage: the builder's own platform (cross-compiles, no emulation), the Rust image of
    // the pinned toolchain, named `build`.
    let build: Vec<&str> = froms[0].split_whitespace().collect();
    assert_eq!(
        build,
        [
            "--platform=$BUILDPLATFORM",
            "rust:${RUST_VERSION}-slim-bookworm",
            "AS",
            "build"
        ]
    );
    let channel = toolchain_value("channel");
    assert!(
        ins.iter()
            .any(|(k, a)| k == "ARG" && *a == format!("RUST_VERSION={channel}")),
        "ARG RUST_VERSION must default to rust-toolchain.toml's channel {channel}"
    );
    // It runs the make targets a developer runs, for both architectures, from the source tree.
    let targets = make_targets();
    let build_run = ins
        .iter()
        .find(|(k, a)| k == "RUN" && a.contains("make \"${goal}\""))
        .expect("a RUN that runs make ${goal}");
    let makefile = read("Makefile");
    let arm64_bin = make_var(&makefile, "ARM64_STATIC_BIN").replace(
        "$(ARM64_MUSL_TARGET)",
        &make_var(&makefile, "ARM64_MUSL_TARGET"),
    );
    for (arch, goal, bin) in [
        ("amd64", "static", static_bin_path()),
        ("arm64", "static-arm64", arm64_bin),
    ] {
        assert!(targets.iter().any(|t| t == goal), "Makefile has no {goal}");
        assert!(
            build_run
                .1
                .contains(&format!("{arch}) goal={goal}; bin={bin};")),
            "{arch} builds `make {goal}` and takes {bin}: {}",
            build_run.1
        );
    }
    // The roles, not the demo sandbox: NO_DEMO=1, which the release targets turn into
    // --no-default-features (the `demo` feature is the default one).
    assert!(
        build_run.1.contains(" NO_DEMO=1 "),
        "the image is built without the demo: {}",
        build_run.1
    );
    assert_eq!(
        make_var(&makefile, "NO_DEMO_FLAGS"),
        "$(if $(NO_DEMO),--no-default-features --bin gpushare,)"
    );
    for goal in ["static", "static-arm64"] {
        let recipe = makefile
            .split(&format!("\n{goal}: "))
            .nth(1)
            .unwrap_or_else(|| panic!("no {goal} target"));
        let build = recipe
            .lines()
            .find(|l| l.contains("build $(CI_FLAGS) --release --target"))
            .unwrap_or_else(|| panic!("{goal} runs no cargo build"));
        assert!(build.contains("$(NO_DEMO_FLAGS)"), "{goal}: {build}");
    }
    // Not root by default; the chart runs the device plugin (only) as uid 0.
    let user = ins
        .iter()
        .rfind(|(k, _)| k == "USER")
        .expect("a USER in the runtime stage");
    assert_eq!(user.1, "65534:65534");
    assert!(
        ins.iter().any(|(k, a)| k == "COPY" && a == ". ."),
        "the build stage copies the source tree"
    );
    let ignore = read(".dockerignore");
    for excluded in ["target", ".venv", "dist"] {
        assert!(
            ignore.lines().any(|l| l.trim() == excluded),
            ".dockerignore must keep {excluded} out of the context"
        );
    }

    // Runtime stage: the device plugin runs the injected nvidia-smi, a glibc program
    // (ARCHITECTURE.md §6).
    let glibc_bases = [
        "debian:",
        "ubuntu:",
        "gcr.io/distroless/base",
        "gcr.io/distroless/cc",
    ];
    assert!(
        glibc_bases.iter().any(|b| froms[1].starts_with(b)),
        "base {} is not a known glibc image",
        froms[1]
    );
    assert!(!text.contains("FROM scratch"));

    let copy = ins
        .iter()
        .find(|(k, a)| k == "COPY" && a.starts_with("--from="))
        .expect("a COPY --from the build stage");
    let parts: Vec<&str> = copy.1.split_whitespace().collect();
    assert_eq!(
        parts,
        ["--from=build", "/gpushare", "/usr/local/bin/gpushare"]
    );

    // The CUDA memory limiter: built by the make target of each architecture (its checks
    // without the tests, which need mount namespaces), carried where --limiter-library looks.
    for (arch, goal, lib) in [
        (
            "amd64",
            "limiter",
            "target/limiter/x86_64/libgpushare_limiter.so",
        ),
        (
            "arm64",
            "limiter-arm64",
            "target/limiter/aarch64/libgpushare_limiter.so",
        ),
    ] {
        assert!(targets.iter().any(|t| t == goal), "Makefile has no {goal}");
        let case = build_run
            .1
            .split(&format!("{arch}) "))
            .nth(1)
            .and_then(|rest| rest.split(";;").next())
            .unwrap_or_default();
        assert!(
            case.contains(&format!("limiter=\"{goal}\";")) && case.contains(&format!("lib={lib}")),
            "{arch} builds `make {goal}` and takes {lib}: {case}"
        );
    }
    assert!(
        build_run
            .1
            .contains("make \"${limiter}\" CI=true LIMITER_NO_TESTS=1")
            && build_run
                .1
                .contains("cp \"${lib}\" /libgpushare_limiter.so"),
        "{}",
        build_run.1
    );
    let limiter = ins
        .iter()
        .find(|(k, a)| k == "COPY" && a.contains("libgpushare_limiter.so"))
        .expect("a COPY of the limiter");
    let parts: Vec<&str> = limiter.1.split_whitespace().collect();
    assert_eq!(
        parts,
        [
            "--from=build",
            "/libgpushare_limiter.so",
            gpushare::config::DEFAULT_LIMITER_LIBRARY
        ],
        "the image carries the limiter where the node roles look for it"
    );

    let run = ins
        .iter()
        .find(|(k, a)| k == "RUN" && a.contains("ln -s"))
        .expect("a RUN with the plugin symlink");
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
    // The template's one platform shows the shape `make dist` writes for every archive.
    let platforms = m["spec"]["platforms"].as_sequence().expect("platforms");
    let linux = platforms
        .iter()
        .find(|p| {
            p["selector"]["matchLabels"]["os"] == "linux"
                && p["selector"]["matchLabels"]["arch"] == "amd64"
        })
        .expect("a linux/amd64 platform");
    // krew links `bin` as kubectl-inspect_gpushare, a name the binary answers to as inspect.
    assert_eq!(linux["bin"], "gpushare");
    let files = linux["files"].as_sequence().expect("files");
    assert!(files.iter().any(|f| f["from"] == "gpushare"));
    assert!(files.iter().any(|f| f["from"] == "LICENSE"));
    let sha = linux["sha256"].as_str().expect("sha256");
    assert!(
        sha.len() == 64 && sha.chars().all(|c| c.is_ascii_hexdigit()),
        "sha256 {sha}"
    );
    let uri = linux["uri"].as_str().expect("uri");
    assert!(
        uri.starts_with("https://")
            && uri.ends_with(&format!(
                "gpushare-{}-linux-amd64.tar.gz",
                env!("CARGO_PKG_VERSION")
            )),
        "the static release archive, as make dist names it: {uri}"
    );
}
