"""The report the Python kubelets (`kubelet_grpcio.py`, `dra_kubelet_grpcio.py`) print: one
JSON object on stdout with what they saw and, where a step failed, the error that ended the
run; the exit status goes with it.
"""

import json


def finish(out, error=None, status=0):
    """Prints the report `out`, with `error` where one ended the run; returns `status`."""
    if error:
        out["error"] = error
    print(json.dumps(out))
    return status


def rpc_failed(out, step, e):
    """Prints the report with the gRPC error `e` that `step` met; returns 1."""
    return finish(out, f"{step}: {e.code().name}: {e.details()}", 1)
