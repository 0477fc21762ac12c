#!/usr/bin/env python3
"""kubernetes-validate (PyPI) on objects gpushare creates or renders: each object against the
OpenAPI schema of every Kubernetes version from `from` to the newest the package knows,
strictly (unknown fields are errors) when asked.

Reads one JSON request on stdin and prints one JSON answer on stdout:

  request:  {"objects": [{"name": LABEL, "object": OBJECT}, ...],
             "from": "1.34", "strict": true}
  answer:   {"package": VERSION, "versions": ["1.34.0", ...],
             "results": [{"name": LABEL, "version": V, "error": MESSAGE | null,
                          "missing_schema": true | false}, ...]}

An object whose kind has no schema in the package (a CRD such as a ServiceMonitor) is
reported with "missing_schema": true. Used by tests/it/support/kube_validate.rs; needs
kubernetes-validate (`make clients`).
"""

import json
import sys

import kubernetes_validate
import kubernetes_validate.version
from kubernetes_validate import utils


def minor(version):
    parts = version.split(".")
    return (int(parts[0]), int(parts[1]))


def main():
    req = json.load(sys.stdin)
    lowest = minor(req.get("from", "1.34"))
    versions = sorted({v for v in utils.all_versions() if minor(v) >= lowest}, key=minor)
    strict = bool(req.get("strict", True))
    results = []
    for item in req["objects"]:
        for version in versions:
            error = None
            missing = False
            try:
                kubernetes_validate.validate(item["object"], version, strict=strict)
            except utils.SchemaNotFoundError as e:
                missing = True
                error = str(e)
            except utils.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                error = f"{path}: {e.message}" if path else e.message
            except utils.InvalidSchemaError as e:
                error = f"invalid schema: {e}"
            results.append(
                {"name": item["name"], "version": version, "error": error, "missing_schema": missing}
            )
    json.dump(
        {"package": kubernetes_validate.version.__version__,
         "versions": versions, "results": results},
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
