# gpushare — every target has a one-line ## comment; `make help` lists them.
SHELL := /bin/bash
CARGO ?= cargo
MUSL_TARGET := x86_64-unknown-linux-musl
STATIC_BIN := target/$(MUSL_TARGET)/release/gpushare
GLIBC_TARGET := x86_64-unknown-linux-gnu.2.17
CI_FLAGS := $(if $(CI),--locked,)

.PHONY: help build static glibc test test-cluster test-gpu lint fmt bench fuzz demo ci check-static setup soak

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

build: ## debug build of the gpushare binary (dynamically linked, NVML backend available)
	$(CARGO) build $(CI_FLAGS)

demo: ## run the self-contained demo (sandbox cluster, extender, device plugin, fake GPUs)
	$(CARGO) run $(CI_FLAGS) --quiet -- demo

test: ## unit + integration tests (no cluster, no GPU needed)
	$(CARGO) test $(CI_FLAGS) --workspace --all-targets

SOAK_PODS ?= 2000
SOAK_NODES ?= 50
soak: ## 2,000 pods bound and deleted over 50 nodes under random API faults, a re-list every ~500 events and one extender restart; prints the counts (SOAK_PODS, SOAK_NODES, SOAK_SEED)
	SOAK_PODS=$(SOAK_PODS) SOAK_NODES=$(SOAK_NODES) $(CARGO) test $(CI_FLAGS) --test it soak:: -- --ignored --nocapture

test-cluster: ## tests against a real cluster (needs KUBECONFIG)
	$(CARGO) test $(CI_FLAGS) --test it -- --ignored cluster_

test-gpu: ## tests against a real GPU
	$(CARGO) test $(CI_FLAGS) --test it -- --ignored gpu_

lint: ## cargo fmt --check and clippy with warnings denied
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy $(CI_FLAGS) --workspace --all-targets -- -D warnings

fmt: ## format the code
	$(CARGO) fmt --all

static: ## fully static musl release binary (LTO, stripped); checks it is static and prints its size
	@command -v x86_64-linux-musl-gcc >/dev/null || command -v musl-gcc >/dev/null || { echo "static: needs musl-tools (apt-get install -y musl-tools)"; exit 1; }
	CC_x86_64_unknown_linux_musl=$$(command -v x86_64-linux-musl-gcc || command -v musl-gcc) \
	  $(CARGO) build $(CI_FLAGS) --release --target $(MUSL_TARGET)
	@$(MAKE) --no-print-directory check-static

check-static: ## prove $(STATIC_BIN) is statically linked and under 20 MiB
	@bin=$(STATIC_BIN); \
	if readelf -l $$bin | grep -q 'INTERP'; then echo "static: $$bin has a PT_INTERP (dynamic)"; exit 1; fi; \
	if readelf -d $$bin 2>/dev/null | grep -q NEEDED; then echo "static: $$bin needs shared libraries"; exit 1; fi; \
	file $$bin | grep -Eq 'statically linked|static-pie linked' || { file $$bin; echo "static: file(1) does not say static"; exit 1; }; \
	size=$$(stat -c %s $$bin); echo "static: $$bin is static, $$((size / 1024 / 1024)) MiB ($$size bytes)"; \
	[ $$size -lt $$((20 * 1024 * 1024)) ] || { echo "static: over the 20 MiB budget"; exit 1; }; \
	$$bin version

glibc: ## gpushare-glibc: glibc 2.17+ build with NVML (cargo-zigbuild; zig from PyPI)
	./packaging/build-glibc.sh

bench: static ## benchmarks of the static binary that ships (extender at scale, device plugin); results in README
	GPUSHARE_BENCH_BIN=$(CURDIR)/$(STATIC_BIN) $(CARGO) bench $(CI_FLAGS) --bench scale

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
