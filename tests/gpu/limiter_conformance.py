#!/usr/bin/env python3
"""The CUDA memory limiter against a real GPU and the stacks users run (`make test-gpu`).

Each check runs a workload with the limiter preloaded (LD_PRELOAD, limits and state in a
temporary test root: GPUSHARE_LIMITER_ROOT, honoured only where the fixed in-container limits
file does not exist) and a limit of a quarter of the first GPU (at most 4 GiB), and reports a
row: PASS, FAIL, or SKIPPED with the reason (a stack that is not installed). The checks:

  driver API        the C probe (crates/limiter/tests/c/probe.c) on the real driver, through
                    dlsym, cuGetProcAddress_v2 and the per-thread variant: every lookup lands
                    on the hook of the exact entry point, the limit allocates and one byte
                    more is CUDA_ERROR_OUT_OF_MEMORY, cuMemGetInfo shows the limit
  nvidia-smi        memory.total of the GPU is the limit
  PyTorch default   the caching allocator fills the limit, then OutOfMemoryError; never more
  expandable        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (cuMemCreate/cuMemMap)
  cudaMallocAsync   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (stream-ordered pools)
  CUDA graphs       a captured graph replays; the limit still holds afterwards
  NCCL 2 processes  all_reduce between two processes on two GPUs (needs two GPUs)
  vLLM              --gpu-memory-utilization 0.9 inside the limit (GPUSHARE_TEST_VLLM_MODEL
                    names a model already on the machine)

The ledger's peak (what the process held at most) is read after each workload and must not
exceed the limit. Exit status: 1 when any check FAILs or when there is no GPU (nothing was
checked), else 0. Usage: limiter_conformance.py --library <libgpushare_limiter.so>
"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap

GIB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PROBE_SOURCE = os.path.join(REPO, "crates/limiter/tests/c/probe.c")
NEXT_SOURCE = os.path.join(REPO, "crates/limiter/tests/c/next.c")

# The ledger layout (crates/limiter-contract/src/ledger.rs).
HEADER_BYTES, SLOT_BYTES, SLOTS = 64, 32, 1024


def ledger_peak(state, uuid):
    """The most one process of the run held at once (the largest slot peak), or None."""
    path = os.path.join(state, uuid + ".ledger")
    if not os.path.exists(path):
        return None
    data = open(path, "rb").read()
    if len(data) != HEADER_BYTES + SLOT_BYTES * SLOTS:
        return None
    high = min(struct.unpack_from("=I", data, 20)[0], SLOTS)
    peak = 0
    for i in range(high):
        at = HEADER_BYTES + i * SLOT_BYTES
        peak = max(peak, struct.unpack_from("=Q", data, at + 24)[0])
    return peak


class Run:
    def __init__(self, library, gpus, limit):
        self.library = library
        self.gpus = gpus
        self.limit = limit
        self.rows = []

    def root(self):
        """A fresh test root: the limits file and an empty state directory."""
        root = tempfile.mkdtemp(prefix="gpushare-limiter-gpu-")
        os.mkdir(os.path.join(root, "state"))
        with open(os.path.join(root, "limits"), "w") as f:
            f.write("gpushare-limiter-limits 1\n")
            for uuid, _ in self.gpus:
                f.write("%s %d\n" % (uuid, self.limit))
        return root

    def env(self, root, extra=None):
        env = dict(os.environ)
        env["LD_PRELOAD"] = self.library
        env["GPUSHARE_LIMITER_ROOT"] = root
        # CUDA's device 0 is nvidia-smi's first GPU (the ledger read below is its).
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env.update(extra or {})
        return env

    def row(self, check, verdict, detail):
        self.rows.append((check, verdict, detail))
        print("%-18s %-8s %s" % (check, verdict, detail), flush=True)

    def python(self, check, code, extra_env=None, needs=("torch",), timeout=900):
        """Runs `code` (prints one JSON line last) with the limiter; the JSON or None."""
        for module in needs:
            probe = subprocess.run([sys.executable, "-c", "import " + module], capture_output=True)
            if probe.returncode != 0:
                self.row(check, "SKIPPED", "python module %s is not installed" % module)
                return None, None
        root = self.root()
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), str(self.limit)],
            env=self.env(root, extra_env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        peak = ledger_peak(os.path.join(root, "state"), self.gpus[0][0])
        shutil.rmtree(root, ignore_errors=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            self.row(check, "FAIL", "exit %d: %s" % (proc.returncode, tail))
            return None, peak
        try:
            return json.loads(proc.stdout.strip().splitlines()[-1]), peak
        except (ValueError, IndexError):
            self.row(check, "FAIL", "no result line: %r" % proc.stdout[-200:])
            return None, peak

    def judge(self, check, result, peak, conditions):
        if result is None:
            return
        failed = [what for what, ok in conditions if not ok]
        if peak is not None and peak > self.limit:
            failed.append("the ledger's peak %d is over the limit" % peak)
        detail = json.dumps(result)
        if peak is not None:
            detail += " peak=%d" % peak
        self.row(check, "FAIL" if failed else "PASS", "; ".join(failed) or detail)


# Allocates 128 MiB chunks until CUDA refuses one: `got` bytes held in `chunks`.
FILL_UNTIL_OUT_OF_MEMORY = """\
chunks, got = [], 0
try:
    while True:
        chunks.append(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
        got += 128 << 20
except torch.cuda.OutOfMemoryError:
    pass
"""

FILL = (
    """
import json, sys, torch
limit = int(sys.argv[1])
free, total = torch.cuda.mem_get_info()
"""
    + FILL_UNTIL_OUT_OF_MEMORY
    + """print(json.dumps({"total": total, "allocated": got, "reserved": torch.cuda.memory_reserved()}))
"""
)

GRAPHS = (
    """
import json, sys, torch
limit = int(sys.argv[1])
static = torch.zeros(1 << 20, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        out = static * 2 + 1
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out = static * 2 + 1
    tmp = torch.ones(32 << 20, device="cuda") + out.sum()
for _ in range(10):
    g.replay()
torch.cuda.synchronize()
"""
    + FILL_UNTIL_OUT_OF_MEMORY
    + """print(json.dumps({"replayed": 10, "allocated_after": got, "value": float(tmp[0].item())}))
"""
)

NCCL = """
import json, os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    t = torch.ones(64 << 20, device="cuda") * (rank + 1)
    dist.all_reduce(t)
    assert float(t[0].item()) == 3.0, float(t[0].item())
    dist.destroy_process_group()

mp.spawn(rank_main, nprocs=2, join=True)
print(json.dumps({"all_reduce": "ok"}))
"""

VLLM = """
import json, os, sys
from vllm import LLM, SamplingParams
llm = LLM(model=os.environ["GPUSHARE_TEST_VLLM_MODEL"], gpu_memory_utilization=0.9)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
print(json.dumps({"generated": out[0].outputs[0].text}))
"""


def gpus():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None, "nvidia-smi is not on PATH"
    proc = subprocess.run(
        [smi, "--query-gpu=uuid,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True,
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        return None, "nvidia-smi lists no GPU: " + (proc.stderr.strip() or proc.stdout.strip())
    out = []
    for line in proc.stdout.strip().splitlines():
        uuid, mib = [f.strip() for f in line.split(",")]
        out.append((uuid.lower().replace("gpu-", "GPU-"), int(mib) << 20))
    return out, None


def build_probe(work):
    cc = os.environ.get("CC") or "cc"
    shutil.copy(PROBE_SOURCE, work)
    shutil.copy(NEXT_SOURCE, work)
    steps = [
        [cc, "-shared", "-fPIC", "-O1", "-o", "libnext.so", "next.c", "-ldl"],
        [cc, "-O1", "-o", "probe", "probe.c", "-L.", "-lnext", "-ldl", "-Wl,-rpath,$ORIGIN"],
    ]
    for step in steps:
        proc = subprocess.run(step, cwd=work, capture_output=True, text=True)
        if proc.returncode != 0:
            return proc.stderr.strip()
    return None


def driver_api(run):
    work = tempfile.mkdtemp(prefix="gpushare-limiter-probe-")
    error = build_probe(work)
    if error:
        run.row("driver API", "SKIPPED", "the probe does not build: " + error)
        return
    limit = str(run.limit)
    root = run.root()
    proc = subprocess.run([os.path.join(work, "probe"), "dlsym-handle", "driver-version"],
                          env=run.env(root), capture_output=True, text=True, timeout=60)
    shutil.rmtree(root, ignore_errors=True)
    try:
        version = int(proc.stdout.split()[2])
    except (IndexError, ValueError):
        run.row("driver API", "FAIL", "cuDriverGetVersion: %r %r" % (proc.stdout, proc.stderr[-300:]))
        return
    # cuGetProcAddress is asked for the driver's own version, as a runtime of that version
    # would; cuGetProcAddress_v2 exists from 12.0.
    routes = ["dlsym-handle", "dlsym-default", "getproc:%d" % version]
    if version >= 12000:
        routes += ["getproc2:%d" % version, "getproc2-ptsz:%d" % version, "getproc-chain:%d" % version]
    expected_alloc = "libgpushare_limiter.so cuMemAlloc_v2"
    for route in routes:
        root = run.root()
        ops = ["driver-version", "which", "cuMemAlloc", "which", "cuMemAllocAsync", "which",
               "cuMemGetInfo", "ctx", "0", "info", "alloc", limit, "alloc", "1", "async", "1"]
        proc = subprocess.run([os.path.join(work, "probe"), route] + ops, env=run.env(root),
                              capture_output=True, text=True, timeout=300)
        shutil.rmtree(root, ignore_errors=True)
        lines = proc.stdout.strip().splitlines()
        check = "driver API " + route
        if proc.returncode != 0 or len(lines) < 9:
            run.row(check, "FAIL", "exit %d: %s %s" % (proc.returncode, lines, proc.stderr[-300:]))
            continue
        async_name = "cuMemAllocAsync_ptsz" if "ptsz" in route else "cuMemAllocAsync"
        conditions = [
            ("cuMemAlloc resolved to " + lines[1], lines[1] == "which cuMemAlloc " + expected_alloc),
            ("cuMemAllocAsync resolved to " + lines[2],
             lines[2] == "which cuMemAllocAsync libgpushare_limiter.so " + async_name),
            ("cuMemGetInfo resolved to " + lines[3],
             lines[3] == "which cuMemGetInfo libgpushare_limiter.so cuMemGetInfo_v2"),
            ("info " + lines[5], lines[5].startswith("info 0 ") and lines[5].endswith(" " + limit)),
            ("the limit: " + lines[6], lines[6] == "alloc %s 0" % limit),
            ("one byte more: " + lines[7], lines[7] == "alloc 1 2"),
            ("stream-ordered, one byte more: " + lines[8], lines[8] == "async 1 2"),
        ]
        failed = [what for what, ok in conditions if not ok]
        run.row(check, "FAIL" if failed else "PASS", "; ".join(failed) or lines[0])
    shutil.rmtree(work, ignore_errors=True)


def nvidia_smi(run):
    root = run.root()
    uuid = run.gpus[0][0]
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits", "-i", uuid],
        env=run.env(root), capture_output=True, text=True,
    )
    shutil.rmtree(root, ignore_errors=True)
    if proc.returncode != 0:
        run.row("nvidia-smi", "FAIL", proc.stderr.strip())
        return
    total = int(proc.stdout.split(",")[0]) << 20
    ok = total == run.limit
    run.row("nvidia-smi", "PASS" if ok else "FAIL",
            "memory.total %d MiB (limit %d MiB)" % (total >> 20, run.limit >> 20))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", required=True, help="the libgpushare_limiter.so to preload")
    args = parser.parse_args()
    library = os.path.abspath(args.library)
    if not os.path.isfile(library):
        print("limiter conformance: %s does not exist (cargo build -p gpushare-limiter)" % library)
        return 1
    found, why = gpus()
    if not found:
        print("limiter conformance: FAILED: no GPU, nothing was checked: " + why)
        return 1
    limit = min(4 * GIB, found[0][1] // 4) // (1 << 20) << 20
    run = Run(library, found, limit)
    print("limiter conformance on %s (%d MiB), limit %d MiB, library %s\n"
          % (found[0][0], found[0][1] >> 20, limit >> 20, library))
    driver_api(run)
    nvidia_smi(run)
    for check, env in [
        ("PyTorch default", {}),
        ("expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        ("cudaMallocAsync", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
    ]:
        result, peak = run.python(check, FILL, env)
        if result is not None:
            run.judge(check, result, peak, [
                ("mem_get_info total %d is not the limit" % result["total"], result["total"] == limit),
                ("allocated %d over the limit" % result["allocated"], result["allocated"] <= limit),
                ("allocated less than half the limit", result["allocated"] >= limit // 2),
            ])
    result, peak = run.python("CUDA graphs", GRAPHS)
    if result is not None:
        run.judge("CUDA graphs", result, peak, [
            ("the graph computed %s" % result["value"], result["value"] == 1 + (1 << 20)),
            ("allocated %d after replay, over the limit" % result["allocated_after"],
             result["allocated_after"] <= limit),
        ])
    if len(found) < 2:
        run.row("NCCL 2 processes", "SKIPPED", "needs two GPUs; this machine has one")
    else:
        result, peak = run.python("NCCL 2 processes", NCCL)
        if result is not None:
            run.judge("NCCL 2 processes", result, peak, [("all_reduce", result.get("all_reduce") == "ok")])
    if not os.environ.get("GPUSHARE_TEST_VLLM_MODEL"):
        run.row("vLLM", "SKIPPED", "GPUSHARE_TEST_VLLM_MODEL names no model on this machine")
    else:
        result, peak = run.python("vLLM", VLLM, needs=("torch", "vllm"))
        if result is not None:
            run.judge("vLLM", result, peak, [("generated text", bool(result.get("generated")))])

    print("\n| check | verdict | detail |\n| --- | --- | --- |")
    for check, verdict, detail in run.rows:
        print("| %s | %s | %s |" % (check, verdict, detail.replace("|", "/")))
    failed = sum(1 for _, v, _ in run.rows if v == "FAIL")
    passed = sum(1 for _, v, _ in run.rows if v == "PASS")
    skipped = sum(1 for _, v, _ in run.rows if v == "SKIPPED")
    print("\n%d PASS, %d FAIL, %d SKIPPED" % (passed, failed, skipped))
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
