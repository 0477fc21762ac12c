#!/usr/bin/env python3
"""A kubelet written by others, for the device plugin: Python grpcio plays kubelet's side.

It serves the Registration service on <dir>/kubelet.sock, waits for the plugin to Register,
then dials the plugin's socket the way kubelet 1.11-1.25 (grpc-go, bare path) does: the socket
path travels as the HTTP/2 `:authority`. With `--authority localhost` it sends what kubelet
1.26+ sends. Then GetDevicePluginOptions -> ListAndWatch (first list) -> Allocate of the
first `--units` device IDs (or the `--ids` given), and prints one JSON object with what it saw
on stdout. A process serving several resources registers each: `--resource` picks the one
driven (default: the first to register).

Exit status: 0 when every call answered, 1 when a call failed (the JSON says which and why),
2 when the plugin did not register in time. Used by tests/it/clients.rs; needs grpcio and
grpcio-tools (the protos are compiled at run time from crates/kubelet-api/proto).
"""

import argparse
import os
import sys
import tempfile
import threading
from concurrent import futures

import grpc
from grpc_tools import protoc

from kubelet_report import finish, rpc_failed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTO_ROOT = os.path.join(ROOT, "crates", "kubelet-api", "proto")
PROTO = "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto"


def compile_protos(out):
    """Compiles the device plugin proto (it imports nothing) as `deviceplugin.proto` in `out`."""
    import shutil

    shutil.copy(os.path.join(PROTO_ROOT, PROTO), os.path.join(out, "deviceplugin.proto"))
    rc = protoc.main(
        ["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", "deviceplugin.proto"]
    )
    if rc != 0:
        sys.exit(f"protoc failed with {rc}")
    sys.path.insert(0, out)
    import deviceplugin_pb2
    import deviceplugin_pb2_grpc

    return deviceplugin_pb2, deviceplugin_pb2_grpc


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", required=True, help="the device-plugin directory")
    ap.add_argument("--authority", choices=["path", "localhost"], default="path")
    ap.add_argument("--units", type=int, default=1)
    ap.add_argument("--resource", default=None, help="the resource to drive [default: the first]")
    ap.add_argument("--ids", default=None, help="comma-separated device IDs to allocate")
    ap.add_argument("--timeout", type=float, default=20.0)
    args = ap.parse_args()

    out = {"grpcio": grpc.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        pb2, pb2_grpc = compile_protos(tmp)

        registered = threading.Event()
        requests = []

        class Registration(pb2_grpc.RegistrationServicer):
            def Register(self, request, context):
                requests.append(request)
                if args.resource is None or request.resource_name == args.resource:
                    registered.set()
                return pb2.Empty()

        kubelet_sock = os.path.join(args.dir, "kubelet.sock")
        if os.path.exists(kubelet_sock):
            os.remove(kubelet_sock)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb2_grpc.add_RegistrationServicer_to_server(Registration(), server)
        server.add_insecure_port("unix://" + kubelet_sock)
        server.start()
        try:
            if not registered.wait(args.timeout):
                return finish(out, "the plugin did not register", 2)
            req = next(
                r for r in requests if args.resource is None or r.resource_name == args.resource
            )
            out["registered"] = sorted({r.resource_name for r in requests})
            out["register"] = {
                "version": req.version,
                "endpoint": req.endpoint,
                "resource_name": req.resource_name,
                "get_preferred_allocation_available": req.options.get_preferred_allocation_available,
            }
            plugin_sock = os.path.join(args.dir, req.endpoint)
            authority = plugin_sock if args.authority == "path" else "localhost"
            out["authority"] = authority
            channel = grpc.insecure_channel(
                "unix://" + plugin_sock,
                options=[("grpc.default_authority", authority)],
            )
            stub = pb2_grpc.DevicePluginStub(channel)
            step = "GetDevicePluginOptions"
            try:
                opts = stub.GetDevicePluginOptions(pb2.Empty(), timeout=args.timeout)
                out["options"] = {
                    "pre_start_required": opts.pre_start_required,
                    "get_preferred_allocation_available": opts.get_preferred_allocation_available,
                }
                step = "ListAndWatch"
                stream = stub.ListAndWatch(pb2.Empty(), timeout=args.timeout)
                first = next(stream)
                stream.cancel()
                ids = [d.ID for d in first.devices]
                out["devices"] = len(ids)
                out["healthy"] = sum(1 for d in first.devices if d.health == "Healthy")
                step = "Allocate"
                resp = stub.Allocate(
                    pb2.AllocateRequest(
                        container_requests=[
                            pb2.ContainerAllocateRequest(
                                devices_ids=args.ids.split(",") if args.ids else ids[: args.units]
                            )
                        ]
                    ),
                    timeout=args.timeout,
                )
                out["allocate"] = [dict(c.envs) for c in resp.container_responses]
                out["allocate_devices"] = [
                    [[d.host_path, d.container_path, d.permissions] for d in c.devices]
                    for c in resp.container_responses
                ]
            except grpc.RpcError as e:
                return rpc_failed(out, step, e)
            finally:
                channel.close()
        finally:
            server.stop(None)
    return finish(out)


if __name__ == "__main__":
    sys.exit(main())
