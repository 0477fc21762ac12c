#!/usr/bin/env python3
"""`make dist-check`: verifies a release directory made by `make dist`, as a user would.

Each check is independent and reports pass/fail; the last line is `dist: N passed, N failed`.
  - SHA256SUMS lists every file in the directory and every sum matches;
  - every archive unpacks safely (no absolute or `..` paths, no links), holds its binary
    (executable) and LICENSE, and the binary is of the architecture its name says; an archive
    with README.md holds every docs/ page the README links to;
  - the host's binaries (linux-amd64 static and glibc) report the release version, and the
    static one answers as the kubectl plugin under krew's link name;
  - the krew manifest: each platform's uri is the base URL plus an archive here, its sha256 is
    that archive's, its `files` and `bin` exist in the archive, os/arch match the archive name;
  - the Helm chart: loaded and linted by the Helm SDK, version/appVersion/image.tag = release;
  - the SBOM: valid CycloneDX 1.5 (the schema, via cyclonedx-python-lib), for this version,
    every component with a licence and a purl.
It only reads the directory (unpacking into a temporary one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import traceback
import zipfile
from pathlib import Path

import yaml

from dist import RELEASE_ARTIFACTS, archive_name, parse_artifacts

PLUGIN = "kubectl-inspect-gpushare"
KREW_LINK = "kubectl-inspect_gpushare"
# ELF e_machine values
EM_X86_64, EM_AARCH64 = 62, 183


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unpack(archive: Path, into: Path) -> dict[str, Path]:
    """Members (name -> unpacked path) of a .tar.gz or .zip, refusing unsafe entries."""
    out: dict[str, Path] = {}

    def safe(name: str) -> Path:
        if name.startswith("/") or ".." in Path(name).parts or not name:
            raise AssertionError(f"{archive.name}: unsafe member {name!r}")
        return into / name

    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                dest = safe(info.filename)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(z.read(info))
                mode = (info.external_attr >> 16) & 0o777
                os.chmod(dest, mode or 0o644)
                out[info.filename] = dest
    else:
        with tarfile.open(archive, "r:gz") as tar:
            for m in tar.getmembers():
                dest = safe(m.name)
                if not m.isfile():
                    raise AssertionError(f"{archive.name}: {m.name} is not a plain file")
                tar.extract(m, into, filter="data")
                os.chmod(dest, m.mode & 0o777)
                out[m.name] = dest
    return out


def arch_of(binary: Path) -> str:
    """`linux-amd64`, `linux-arm64`, `windows-amd64`, `darwin-amd64`, `darwin-arm64`, or '?'."""
    head = binary.read_bytes()[:4096]
    if head[:4] == b"\x7fELF":
        machine = int.from_bytes(head[18:20], "little")
        return {EM_X86_64: "linux-amd64", EM_AARCH64: "linux-arm64"}.get(machine, "?")
    if head[:2] == b"MZ":
        pe = int.from_bytes(head[0x3C:0x40], "little")
        if head[pe : pe + 4] == b"PE\0\0" and int.from_bytes(head[pe + 4 : pe + 6], "little") == 0x8664:
            return "windows-amd64"
    if head[:4] == b"\xcf\xfa\xed\xfe":
        cpu = int.from_bytes(head[4:8], "little")
        return {0x01000007: "darwin-amd64", 0x0100000C: "darwin-arm64"}.get(cpu, "?")
    return "?"


class Checker:
    def __init__(self, root: Path, version: str, base_url: str, work: Path, only: list[str] | None = None):
        self.root, self.version, self.base_url, self.work = root, version, base_url.rstrip("/"), work
        # The artifacts the directory must hold: the whole release, or the --artifacts subset.
        self.wanted = list(only) if only is not None else list(RELEASE_ARTIFACTS)
        self.passed = self.failed = 0
        self.unpacked: dict[str, dict[str, Path]] = {}

    def check(self, what: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # a failed check is reported, the others still run
            self.failed += 1
            detail = str(e) if isinstance(e, AssertionError) else traceback.format_exc(limit=2)
            print(f"FAIL {what}: {detail}")
        else:
            self.passed += 1
            print(f"ok   {what}")

    def archives(self) -> list[Path]:
        return sorted(p for p in self.root.iterdir() if re.search(r"-(linux|darwin|windows)-(amd64|arm64)\.(tar\.gz|zip)$", p.name))

    def sums(self) -> None:
        listed = {}
        for line in (self.root / "SHA256SUMS").read_text().splitlines():
            digest, name = line.split("  ", 1)
            listed[name] = digest
        files = {p.name for p in self.root.iterdir() if p.is_file() and p.name != "SHA256SUMS"}
        assert set(listed) == files, f"SHA256SUMS lists {sorted(listed)}, directory has {sorted(files)}"
        for name, digest in listed.items():
            assert sha256(self.root / name) == digest, f"{name}: sha256 differs from SHA256SUMS"
        # and the tool users will run agrees
        subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=self.root, check=True)

    def expected_set(self) -> None:
        names = {p.name for p in self.archives()}
        v = self.version
        want = {archive_name(k, v) for k in self.wanted}
        assert want <= names, f"missing archives: {sorted(want - names)}"
        for f in (f"gpushare-{v}.tgz", "inspect-gpushare.yaml", f"gpushare-{v}.cdx.json", "SHA256SUMS"):
            assert (self.root / f).is_file(), f"missing {f}"

    def archive(self, path: Path) -> None:
        members = unpack(path, self.work / path.name)
        self.unpacked[path.name] = members
        platform = re.search(r"-((?:linux|darwin|windows)-(?:amd64|arm64))\.", path.name).group(1)
        binary = f"{PLUGIN}.exe" if platform.startswith("windows") else (PLUGIN if path.name.startswith(PLUGIN) else "gpushare")
        assert binary in members, f"no {binary} in {sorted(members)}"
        assert "LICENSE" in members, "no LICENSE"
        assert "Apache License" in members["LICENSE"].read_text()[:200], "LICENSE is not the Apache licence"
        assert os.access(members[binary], os.X_OK), f"{binary} is not executable"
        if "README.md" in members:
            # the README's links into the repository that the archive carries (docs/) resolve
            for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", members["README.md"].read_text()):
                if target.startswith("docs/"):
                    assert target in members, f"README.md links to {target}, which the archive lacks"
        got = arch_of(members[binary])
        assert got == platform, f"{binary} is a {got} binary, the archive says {platform}"

    def host_binary(self, archive: str, linkage: str) -> None:
        binary = self.unpacked[archive]["gpushare"]
        out = subprocess.run([str(binary), "version"], capture_output=True, text=True, check=True).stdout
        lines = out.splitlines()
        assert lines[0] == f"gpushare {self.version}", f"version says {lines[0]!r}"
        assert f"linkage: {linkage}" in lines, out
        if linkage == "static":
            link = binary.parent / KREW_LINK
            link.symlink_to(binary.name)
            res = subprocess.run([str(link), "--help"], capture_output=True, text=True)
            assert res.returncode == 0 and "inspect" in (res.stdout + res.stderr).lower(), res.stdout + res.stderr

    def krew(self) -> None:
        m = yaml.safe_load((self.root / "inspect-gpushare.yaml").read_text())
        assert m["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2", m["apiVersion"]
        assert m["kind"] == "Plugin" and m["metadata"]["name"] == "inspect-gpushare"
        spec = m["spec"]
        assert spec["version"] == f"v{self.version}", spec["version"]
        for key in ("homepage", "shortDescription", "description"):
            assert spec.get(key), f"spec.{key} empty"
        seen = set()
        for p in spec["platforms"]:
            sel = p["selector"]["matchLabels"]
            platform = f"{sel['os']}-{sel['arch']}"
            assert platform not in seen, f"{platform} twice"
            seen.add(platform)
            uri = p["uri"]
            assert uri.startswith(self.base_url + "/"), f"{uri} is not under {self.base_url}"
            name = uri[len(self.base_url) + 1 :]
            assert (self.root / name).is_file(), f"{uri}: no {name} here"
            assert platform in name, f"{platform} points at {name}"
            assert p["sha256"] == sha256(self.root / name), f"{platform}: sha256 is not {name}'s"
            members = self.unpacked[name]
            for f in p["files"]:
                assert f["from"] in members, f"{platform}: files.from {f['from']} not in {name}"
            assert p["bin"] in {f["from"] for f in p["files"]}, f"{platform}: bin {p['bin']} not installed"
            assert arch_of(members[p["bin"]]) == platform, f"{platform}: bin is {arch_of(members[p['bin']])}"
        # Every plugin platform of the archives here is in the manifest.
        krew_platforms = {"linux-amd64", "linux-arm64", "windows-amd64", "darwin-amd64", "darwin-arm64"}
        want = {k.removeprefix("plugin-") for k in self.wanted if not k.startswith("glibc-")} & krew_platforms
        assert want <= seen, f"platforms {sorted(seen)}, archives here for {sorted(want)}"

    def chart(self) -> None:
        import helm_python as helm

        path = self.root / f"gpushare-{self.version}.tgz"
        chart = helm.Chart.load(str(path))
        meta = chart.metadata
        assert meta.get("version") == self.version, meta
        assert meta.get("appVersion") == self.version, meta
        assert chart.values["image"]["tag"] == self.version, chart.values["image"]
        report = helm.lint(str(path), strict=True)
        errors = [m for m in report.get("messages", []) if m.get("severity", 0) >= 3] + report.get("errors", [])
        assert not errors, errors

    def sbom(self) -> None:
        from cyclonedx.schema import SchemaVersion
        from cyclonedx.validation.json import JsonStrictValidator

        text = (self.root / f"gpushare-{self.version}.cdx.json").read_text()
        error = JsonStrictValidator(SchemaVersion.V1_5).validate_str(text)
        assert error is None, f"not valid CycloneDX 1.5: {error}"
        doc = json.loads(text)
        assert doc["metadata"]["component"]["version"] == self.version
        names = {c["name"] for c in doc["components"]}
        for must in ("kube-client", "tokio", "rustls", "gpushare-core"):
            assert must in names, f"{must} not in the SBOM"
        assert "proptest" not in names, "a dev-dependency is in the SBOM"
        assert "serde_derive" not in names, "a proc macro (not linked) is in the SBOM"
        for c in doc["components"]:
            assert c.get("licenses"), f"{c['name']}: no licence"
            if not c["name"].startswith("gpushare-"):
                assert c.get("purl", "").startswith("pkg:cargo/"), f"{c['name']}: no purl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="dist")
    ap.add_argument("--version", required=True)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--artifacts", help="the subset `make dist` was asked for (DIST_ARTIFACTS); default: the whole release")
    args = ap.parse_args()
    root = Path(args.dir).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        c = Checker(root, args.version, args.base_url, Path(tmp), parse_artifacts(args.artifacts))
        c.check("the expected files are there", c.expected_set)
        c.check("SHA256SUMS covers every file and matches", c.sums)
        for a in c.archives():
            c.check(f"{a.name} unpacks with its binary (right architecture) and LICENSE", lambda a=a: c.archive(a))
        v = args.version
        c.check("linux-amd64 static binary runs here and reports the version",
                lambda: c.host_binary(f"gpushare-{v}-linux-amd64.tar.gz", "static"))
        if "glibc-linux-amd64" in c.wanted:
            c.check("linux-amd64 glibc binary runs here and reports the version",
                    lambda: c.host_binary(f"gpushare-glibc-{v}-linux-amd64.tar.gz", "dynamic"))
        c.check("krew manifest matches the archives", c.krew)
        c.check("Helm chart loads and lints (Helm SDK)", c.chart)
        c.check("SBOM is valid CycloneDX 1.5", c.sbom)
    print(f"dist: {c.passed} passed, {c.failed} failed")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
