#!/usr/bin/env python3
"""A kubelet written by others, for DRA kubelet plugins: Python grpcio plays kubelet's side.

It dials a plugin's registration socket (`<registry>/<driver>-reg.sock`) and calls
`Registration.GetInfo`, checks the answer as kubelet does (type `DRAPlugin`, a name, an
endpoint, a `DRAPlugin` service it speaks), answers `NotifyRegistrationStatus`, then dials the
endpoint the way kubelet 1.11-1.25 (grpc-go, bare path) does: the socket path travels as the
HTTP/2 `:authority` (`--authority localhost`: what kubelet 1.26+ sends). Then, in this order and
each only when asked: `NodePrepareResources` for every `--claim`, `NodeWatchResources` (first
message), `NodeUnprepareResources` for every `--claim`. It prints one JSON object with what it
saw on stdout.

`--api auto` uses `v1.DRAPlugin` when the plugin lists it, else `v1beta1.DRAPlugin`; health
uses `v1.DRAResourceHealth`, else `v1alpha1.DRAResourceHealth`.

Exit status: 0 when every call answered, 1 when a call failed or registration was refused (the
JSON says which and why), 2 when the registration socket never appeared. Needs grpcio and
grpcio-tools (the protos are compiled at run time from crates/kubelet-api/proto, the files
vendored from kubernetes/kubelet).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import grpc
from grpc_tools import protoc

from kubelet_report import finish, rpc_failed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APIS = os.path.join(ROOT, "crates", "kubelet-api", "proto", "k8s.io", "kubelet", "pkg", "apis")
# Flat module name -> vendored file (none imports another).
PROTOS = {
    "pluginregistration": "pluginregistration/v1/api.proto",
    "dra_v1": "dra/v1/api.proto",
    "dra_v1beta1": "dra/v1beta1/api.proto",
    "health_v1": "dra-health/v1/api.proto",
    "health_v1alpha1": "dra-health/v1alpha1/api.proto",
}
HEALTH = {0: "UNKNOWN", 1: "HEALTHY", 2: "UNHEALTHY"}


def compile_protos(out):
    """Compiles every vendored DRA proto into `out`; returns {name: (pb2, pb2_grpc)}."""
    import importlib

    for name, rel in PROTOS.items():
        shutil.copy(os.path.join(APIS, rel), os.path.join(out, f"{name}.proto"))
        rc = protoc.main(
            ["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", f"{name}.proto"]
        )
        if rc != 0:
            sys.exit(f"protoc failed with {rc} on {rel}")
    sys.path.insert(0, out)
    return {
        name: (importlib.import_module(f"{name}_pb2"), importlib.import_module(f"{name}_pb2_grpc"))
        for name in PROTOS
    }


def check(info):
    """What kubelet refuses in GetInfo's answer, or None."""
    if info.type != "DRAPlugin":
        return f"plugin type {info.type!r} is not 'DRAPlugin'"
    if not info.name:
        return "the plugin has no name"
    if not info.endpoint:
        return "the plugin has no endpoint"
    if not {"v1.DRAPlugin", "v1beta1.DRAPlugin"} & set(info.supported_versions):
        return f"no DRAPlugin service in {list(info.supported_versions)}"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--socket", required=True, help="the plugin's registration socket")
    ap.add_argument("--authority", choices=["path", "localhost"], default="path")
    ap.add_argument("--api", choices=["auto", "v1", "v1beta1"], default="auto")
    ap.add_argument("--claim", action="append", default=[], help="namespace/uid/name")
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--unprepare", action="store_true")
    ap.add_argument("--health", action="store_true")
    ap.add_argument("--timeout", type=float, default=20.0)
    args = ap.parse_args()

    out = {"grpcio": grpc.__version__}
    deadline = time.monotonic() + args.timeout
    while not os.path.exists(args.socket):
        if time.monotonic() > deadline:
            return finish(out, "the registration socket did not appear", 2)
        time.sleep(0.05)
    claims = []
    for c in args.claim:
        ns, uid, name = c.split("/", 2)
        claims.append((ns, uid, name))

    with tempfile.TemporaryDirectory() as tmp:
        m = compile_protos(tmp)
        reg_pb2, reg_grpc = m["pluginregistration"]
        step = "GetInfo"
        reg_channel = grpc.insecure_channel(
            "unix://" + args.socket,
            options=[("grpc.default_authority", args.socket if args.authority == "path" else "localhost")],
        )
        try:
            reg = reg_grpc.RegistrationStub(reg_channel)
            info = reg.GetInfo(reg_pb2.InfoRequest(), timeout=args.timeout)
            out["info"] = {
                "type": info.type,
                "name": info.name,
                "endpoint": info.endpoint,
                "supported_versions": list(info.supported_versions),
            }
            refused = check(info)
            step = "NotifyRegistrationStatus"
            reg.NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=refused is None, error=refused or ""),
                timeout=args.timeout,
            )
            if refused:
                return finish(out, f"registration refused: {refused}", 1)
            versions = set(info.supported_versions)
            api = args.api
            if api == "auto":
                api = "v1" if "v1.DRAPlugin" in versions else "v1beta1"
            out["api"] = api
            pb2, pb2_grpc = m["dra_v1"] if api == "v1" else m["dra_v1beta1"]
            authority = info.endpoint if args.authority == "path" else "localhost"
            out["authority"] = authority
            channel = grpc.insecure_channel(
                "unix://" + info.endpoint, options=[("grpc.default_authority", authority)]
            )
            try:
                stub = pb2_grpc.DRAPluginStub(channel)
                wire_claims = [pb2.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]
                if args.prepare:
                    step = "NodePrepareResources"
                    resp = stub.NodePrepareResources(
                        pb2.NodePrepareResourcesRequest(claims=wire_claims), timeout=args.timeout
                    )
                    out["prepare"] = {
                        uid: {
                            "error": r.error,
                            "devices": [
                                {
                                    "request_names": list(d.request_names),
                                    "pool": d.pool_name,
                                    "device": d.device_name,
                                    "cdi_device_ids": list(d.cdi_device_ids),
                                    "share_id": (
                                        d.share_id
                                        if api == "v1" and d.HasField("share_id")
                                        else None
                                    ),
                                }
                                for d in r.devices
                            ],
                        }
                        for uid, r in resp.claims.items()
                    }
                if args.health:
                    step = "NodeWatchResources"
                    hname = "health_v1" if "v1.DRAResourceHealth" in versions else "health_v1alpha1"
                    hpb2, hgrpc = m[hname]
                    out["health_api"] = hname
                    stream = hgrpc.DRAResourceHealthStub(channel).NodeWatchResources(
                        hpb2.NodeWatchResourcesRequest(), timeout=args.timeout
                    )
                    first = next(stream)
                    stream.cancel()
                    out["health"] = [
                        {
                            "pool": d.device.pool_name,
                            "device": d.device.device_name,
                            "health": HEALTH.get(d.health, str(d.health)),
                            "message": d.message,
                        }
                        for d in first.devices
                    ]
                if args.unprepare:
                    step = "NodeUnprepareResources"
                    resp = stub.NodeUnprepareResources(
                        pb2.NodeUnprepareResourcesRequest(claims=wire_claims), timeout=args.timeout
                    )
                    out["unprepare"] = {uid: r.error for uid, r in resp.claims.items()}
            finally:
                channel.close()
        except grpc.RpcError as e:
            return rpc_failed(out, step, e)
        finally:
            reg_channel.close()
    return finish(out)


if __name__ == "__main__":
    sys.exit(main())
