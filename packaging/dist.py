#!/usr/bin/env python3
"""`make dist`: lays out a release in dist/ from binaries already built by the make targets.

Writes, for VERSION:
  gpushare-VERSION-linux-amd64.tar.gz          static musl binary (x86_64): nodes, image, krew
  gpushare-VERSION-linux-arm64.tar.gz          static musl binary (aarch64)
  gpushare-glibc-VERSION-linux-amd64.tar.gz    glibc 2.17+ build with the NVML backend (x86_64)
  gpushare-glibc-VERSION-linux-arm64.tar.gz    the same for aarch64
  kubectl-inspect-gpushare-VERSION-windows-amd64.zip   kubectl plugin (inspect, doctor)
  kubectl-inspect-gpushare-VERSION-darwin-{amd64,arm64}.tar.gz   when built (plugin-macos)
  gpushare-VERSION.tgz                         the Helm chart, packaged by the Helm SDK
  inspect-gpushare.yaml                        krew manifest: URLs under --base-url, sha256s
  gpushare-VERSION.cdx.json                    CycloneDX 1.5 SBOM of the Linux binary's crates
  SHA256SUMS                                   sha256sum(1) format, every file above

Archives are reproducible: fixed mtimes (the commit time, SOURCE_DATE_EPOCH), owner 0, sorted
members, no gzip file name. It builds nothing and publishes nothing; `dist_check.py` verifies
the result.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
VERSION_RE = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")
PLUGIN = "kubectl-inspect-gpushare"
CHART_DIR = ROOT / "packaging/helm/gpushare"
KREW_TEMPLATE = ROOT / "packaging/krew/inspect-gpushare.yaml"
SBOM_TARGET = "x86_64-unknown-linux-musl"


class DistError(Exception):
    """Something the release cannot be made without."""


def source_date_epoch() -> int:
    env = os.environ.get("SOURCE_DATE_EPOCH")
    if env:
        return int(env)
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%ct"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return int(out.stdout.strip())
    except (subprocess.CalledProcessError, ValueError, FileNotFoundError):
        return 0


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# Every artifact a release can hold, by key: `--artifacts` (make's DIST_ARTIFACTS) picks some;
# without it a release holds all of them but the macOS plugins, which come when built (or are
# required with --require-macos).
LINUX_ARTIFACTS = ("linux-amd64", "linux-arm64", "glibc-linux-amd64", "glibc-linux-arm64")
PLUGIN_ARTIFACTS = ("plugin-windows-amd64", "plugin-darwin-amd64", "plugin-darwin-arm64")
ALL_ARTIFACTS = LINUX_ARTIFACTS + PLUGIN_ARTIFACTS
RELEASE_ARTIFACTS = LINUX_ARTIFACTS + ("plugin-windows-amd64",)


def archive_name(key: str, version: str) -> str:
    """The file name of artifact `key` in a release of `version`."""
    if key.startswith("glibc-"):
        return f"gpushare-glibc-{version}-{key[len('glibc-'):]}.tar.gz"
    if key.startswith("plugin-"):
        platform = key[len("plugin-") :]
        return f"{PLUGIN}-{version}-{platform}." + ("zip" if platform.startswith("windows") else "tar.gz")
    return f"gpushare-{version}-{key}.tar.gz"


def parse_artifacts(text: str | None) -> list[str] | None:
    """`--artifacts a,b,c` as a list of known keys (None: the whole release)."""
    if not text:
        return None
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ALL_ARTIFACTS]
    if unknown:
        raise DistError(f"--artifacts: unknown {unknown}; known: {', '.join(ALL_ARTIFACTS)}")
    if "linux-amd64" not in keys:
        raise DistError("--artifacts: linux-amd64 is required (it is the host binary dist checks)")
    return keys


def doc_pages() -> list[tuple[str, Path, bool]]:
    """The documentation pages (docs/*.md, not the drafts in docs/incoming/), as archive members."""
    return [(f"docs/{p.name}", p, False) for p in sorted((ROOT / "docs").glob("*.md"))]


# (archive name, [(member name, source path, executable)]) for every artifact chosen.
def artifacts(
    version: str, require_macos: bool, only: list[str] | None = None
) -> list[tuple[str, list[tuple[str, Path, bool]]]]:
    t = ROOT / "target"
    # README.md links into docs/: the pages travel with it, so its links work unpacked.
    docs = [("LICENSE", ROOT / "LICENSE", False), ("README.md", ROOT / "README.md", False)] + doc_pages()
    sources = {
        "linux-amd64": t / "x86_64-unknown-linux-musl/release/gpushare",
        "linux-arm64": t / "aarch64-unknown-linux-musl/release/gpushare",
        "glibc-linux-amd64": t / "gpushare-glibc",
        "glibc-linux-arm64": t / "gpushare-glibc-aarch64",
        "plugin-windows-amd64": t / "x86_64-pc-windows-gnu/release/gpushare.exe",
        "plugin-darwin-amd64": t / "x86_64-apple-darwin/release/gpushare",
        "plugin-darwin-arm64": t / "aarch64-apple-darwin/release/gpushare",
    }
    if only is None:
        wanted = list(RELEASE_ARTIFACTS)
        for key in ("plugin-darwin-amd64", "plugin-darwin-arm64"):
            if sources[key].exists() or require_macos:
                wanted.append(key)
            else:
                print(f"dist: no {sources[key].relative_to(ROOT)} (make plugin-macos): no {key[7:]} plugin archive")
    else:
        wanted = only
        print(f"dist: only {', '.join(only)} (--artifacts); not a whole release")
    out = []
    for key in wanted:
        src = sources[key]
        if key.startswith("plugin-windows"):
            members = [(f"{PLUGIN}.exe", src, True)] + docs[:1]
        elif key.startswith("plugin-"):
            members = [(PLUGIN, src, True)] + docs[:1]
        else:
            members = [("gpushare", src, True)] + docs
        out.append((archive_name(key, version), members))
    for name, members in out:
        for _, src, _ in members:
            if not src.exists():
                raise DistError(f"{name}: {src.relative_to(ROOT)} is missing (build it first: see `make help`)")
    return out


def write_tar_gz(dest: Path, members: list[tuple[str, Path, bool]], mtime: int) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, src, executable in sorted(members):
            info = tarfile.TarInfo(name)
            info.size = src.stat().st_size
            info.mtime = mtime
            info.mode = 0o755 if executable else 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with src.open("rb") as f:
                tar.addfile(info, f)
    with dest.open("wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=mtime, compresslevel=9) as gz:
        gz.write(raw.getvalue())


def write_zip(dest: Path, members: list[tuple[str, Path, bool]], mtime: int) -> None:
    import time

    stamp = time.gmtime(max(mtime, 315532800))[:6]  # zip dates start in 1980
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, src, executable in sorted(members):
            info = zipfile.ZipInfo(name, date_time=stamp)
            info.external_attr = ((0o755 if executable else 0o644) | 0o100000) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, src.read_bytes())


def check_host_binary(path: Path, version: str) -> None:
    """The host's static binary must report the release version before it is shipped."""
    out = subprocess.run([str(path), "version"], capture_output=True, text=True, check=False)
    first = out.stdout.splitlines()[0] if out.stdout else ""
    if out.returncode != 0 or first != f"gpushare {version}":
        raise DistError(
            f"{path.relative_to(ROOT)} says {first!r}, not 'gpushare {version}': "
            "rebuild with the same VERSION (make exports it as GPUSHARE_VERSION)"
        )


def package_chart(dest_dir: Path, version: str) -> Path:
    """The chart with version, appVersion and image.tag set to the release, via the Helm SDK."""
    import helm_python as helm

    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "gpushare"
        shutil.copytree(CHART_DIR, chart)
        values = chart / "values.yaml"
        text = values.read_text()
        # The image block's tag line, rewritten in place so that the comments stay.
        new, n = re.subn(r'(?m)^(image:\n(?:  .*\n)*?  tag: ).*$', rf'\g<1>"{version}"', text, count=1)
        if n != 1:
            raise DistError("values.yaml: no image.tag line under image:")
        values.write_text(new)
        report = helm.lint(str(chart), strict=True)
        bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2] + report.get("errors", [])
        if bad:
            raise DistError(f"helm lint --strict: {bad}")
        path = helm.package(str(chart), destination=str(dest_dir), version=version, app_version=version)
    return Path(path)


def krew_manifest(dest: Path, version: str, base_url: str, archives: dict[str, Path]) -> None:
    """The krew manifest from packaging/krew/inspect-gpushare.yaml, one platform per plugin archive."""
    template = yaml.safe_load(KREW_TEMPLATE.read_text())
    platforms = []
    # (os, arch, archive, bin in the archive); Linux plugins are the static archives, whose
    # `gpushare` krew links as kubectl-inspect_gpushare (the binary acts as inspect by that name).
    wanted = [
        ("linux", "amd64", f"gpushare-{version}-linux-amd64.tar.gz", "gpushare"),
        ("linux", "arm64", f"gpushare-{version}-linux-arm64.tar.gz", "gpushare"),
        ("darwin", "amd64", f"{PLUGIN}-{version}-darwin-amd64.tar.gz", PLUGIN),
        ("darwin", "arm64", f"{PLUGIN}-{version}-darwin-arm64.tar.gz", PLUGIN),
        ("windows", "amd64", f"{PLUGIN}-{version}-windows-amd64.zip", f"{PLUGIN}.exe"),
    ]
    for os_, arch, name, binary in wanted:
        if name not in archives:
            continue
        platforms.append(
            {
                "selector": {"matchLabels": {"os": os_, "arch": arch}},
                "uri": f"{base_url.rstrip('/')}/{name}",
                "sha256": sha256(archives[name]),
                "files": [{"from": binary, "to": "."}, {"from": "LICENSE", "to": "."}],
                "bin": binary,
            }
        )
    spec = template["spec"]
    spec["version"] = f"v{version}"
    spec["platforms"] = platforms
    header = (
        "# krew manifest of this release, written by `make dist` (packaging/dist.py) from\n"
        "# packaging/krew/inspect-gpushare.yaml: install with\n"
        "#   kubectl krew install --manifest=inspect-gpushare.yaml\n"
    )
    dest.write_text(header + yaml.dump(template, Dumper=_LiteralDumper, sort_keys=False, width=100))


class _LiteralDumper(yaml.SafeDumper):
    """Writes multi-line strings (the description) as `|` blocks, as the template has them."""


def _str_representer(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_LiteralDumper.add_representer(str, _str_representer)


def sbom(dest: Path, version: str, mtime: int) -> None:
    """CycloneDX 1.5 JSON: the crates linked into the Linux binary (normal dependencies of the
    `gpushare` package with its default features, for SBOM_TARGET), with licences, purls,
    Cargo.lock checksums and the dependency graph. Crates of build scripts, proc macros and
    tests are left out: they are not in the binary."""
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", SBOM_TARGET],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    packages = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    root = next(p["id"] for p in meta["packages"] if p["name"] == "gpushare" and p["source"] is None)

    def normal_deps(node_id: str) -> list[str]:
        return sorted(
            {d["pkg"] for d in nodes[node_id]["deps"] if any(k["kind"] is None for k in d["dep_kinds"])}
        )

    def proc_macro(pid: str) -> bool:
        return any("proc-macro" in t["kind"] for t in packages[pid]["targets"])

    # Proc macros run in the compiler and are not linked: left out, with what only they use.
    seen: set[str] = set()
    todo = [root]
    while todo:
        cur = todo.pop()
        if cur in seen or proc_macro(cur):
            continue
        seen.add(cur)
        todo.extend(normal_deps(cur))

    def ref(pid: str) -> str:
        p = packages[pid]
        return f"pkg:cargo/{p['name']}@{p['version']}" if p["source"] else f"gpushare-workspace:{p['name']}@{p['version']}"

    checksums: dict[tuple[str, str], str] = {}
    lock = (ROOT / "Cargo.lock").read_text()
    for block in lock.split("[[package]]"):
        name = re.search(r'^name = "(.*)"$', block, re.M)
        ver = re.search(r'^version = "(.*)"$', block, re.M)
        csum = re.search(r'^checksum = "(.*)"$', block, re.M)
        if name and ver and csum:
            checksums[(name.group(1), ver.group(1))] = csum.group(1)

    components = []
    for pid in sorted(seen - {root}, key=ref):
        p = packages[pid]
        c = {
            "type": "library",
            "bom-ref": ref(pid),
            "name": p["name"],
            "version": p["version"],
        }
        if p.get("description"):
            c["description"] = " ".join(p["description"].split())
        if p.get("license"):
            c["licenses"] = [{"expression": p["license"]}]
        if p["source"]:
            c["purl"] = ref(pid)
            if (p["name"], p["version"]) in checksums:
                c["hashes"] = [{"alg": "SHA-256", "content": checksums[(p["name"], p["version"])]}]
        components.append(c)
    root_ref = f"pkg:cargo/gpushare@{version}"
    from datetime import datetime, timezone

    doc = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, f'gpushare/{version}/{SBOM_TARGET}')}",
        "version": 1,
        "metadata": {
            "timestamp": datetime.fromtimestamp(mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tools": {"components": [{"type": "application", "name": "gpushare packaging/dist.py"}]},
            "component": {
                "type": "application",
                "bom-ref": root_ref,
                "name": "gpushare",
                "version": version,
                "licenses": [{"license": {"id": "Apache-2.0"}}],
                "purl": root_ref,
                "properties": [{"name": "gpushare:target", "value": SBOM_TARGET}],
            },
        },
        "components": components,
        "dependencies": [
            {
                "ref": root_ref if pid == root else ref(pid),
                "dependsOn": [ref(d) for d in normal_deps(pid) if d in seen],
            }
            for pid in sorted(seen, key=ref)
        ],
    }
    dest.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", required=True)
    ap.add_argument("--base-url", required=True, help="where the archives will be downloadable")
    ap.add_argument("--out", default="dist")
    ap.add_argument("--require-macos", action="store_true", help="fail without the darwin plugin binaries")
    ap.add_argument(
        "--artifacts",
        help=f"comma-separated subset of {','.join(ALL_ARTIFACTS)} (CI lays out what it built); default: the whole release",
    )
    args = ap.parse_args()
    version = args.version
    try:
        if not VERSION_RE.match(version):
            raise DistError(f"VERSION={version!r} is not a version like 1.2.3 (no leading v)")
        if not args.base_url.startswith("https://"):
            raise DistError(f"--base-url {args.base_url!r} is not an https URL")
        mtime = source_date_epoch()
        out = (ROOT / args.out) if not os.path.isabs(args.out) else Path(args.out)
        todo = artifacts(version, args.require_macos, parse_artifacts(args.artifacts))
        check_host_binary(ROOT / "target/x86_64-unknown-linux-musl/release/gpushare", version)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        archives: dict[str, Path] = {}
        for name, members in todo:
            dest = out / name
            (write_zip if name.endswith(".zip") else write_tar_gz)(dest, members, mtime)
            archives[name] = dest
            print(f"dist: {name} ({dest.stat().st_size // 1024} KiB)")
        chart = package_chart(out, version)
        print(f"dist: {chart.name} (Helm chart)")
        krew_manifest(out / "inspect-gpushare.yaml", version, args.base_url, archives)
        print("dist: inspect-gpushare.yaml (krew)")
        sbom(out / f"gpushare-{version}.cdx.json", version, mtime)
        print(f"dist: gpushare-{version}.cdx.json (SBOM)")
        files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "SHA256SUMS")
        (out / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n" for p in files))
        print(f"dist: SHA256SUMS ({len(files)} files) in {out}")
    except (DistError, subprocess.CalledProcessError) as e:
        print(f"dist: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
