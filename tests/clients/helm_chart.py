#!/usr/bin/env python3
"""The real Helm v4 engine (helm-python-sdk, Helm's Go SDK as a library) on our chart.

Reads one JSON request on stdin and prints one JSON answer on stdout:

  request:  {"chart": DIR, "release": NAME, "namespace": NS,
             "renders": [VALUES, ...],          # user values, as `helm template -f`
             "lints": [VALUES, ...],            # `helm lint --strict` with these values
             "kube_version": "v1.33.0",         # optional, for lint
             "full_paths": false,               # optional: FILE is the template's path
             "notes": false}                    # optional: each render's NOTES.txt too
  answer:   {"helm": SDK_VERSION,
             "renders": [{"manifests": {FILE: TEXT}, "notes": TEXT} | {"error": MESSAGE}, ...],
             "lints": [REPORT, ...]}

FILE is the template's file name (`extender-service.yaml`); partials (`_*.tpl`) and
NOTES.txt are left out, as `helm template` leaves them out of the manifests (with "notes",
NOTES.txt's text is the render's "notes"). A REPORT is the
SDK's lint report: {"total_charts_linted", "messages": [{"severity", "path", "error"}],
"errors"}. Used by tests/it/packaging/chart.rs; needs helm-python-sdk.
"""

import json
import os
import sys

import helm_python as helm


def main():
    req = json.load(sys.stdin)
    out = {"helm": helm.helm_sdk_version(), "renders": [], "lints": []}
    with helm.Chart.load(req["chart"]) as chart:
        for values in req.get("renders", []):
            try:
                rendered = chart.render(
                    values,
                    name=req["release"],
                    namespace=req["namespace"],
                    is_install=True,
                )
            except helm.HelmError as e:
                out["renders"].append({"error": str(e)})
                continue
            manifests = {}
            answer = {"manifests": manifests}
            for path, text in rendered.items():
                name = os.path.basename(path)
                if name == "NOTES.txt" and req.get("notes"):
                    answer["notes"] = text
                if name.startswith("_") or name == "NOTES.txt":
                    continue
                manifests[path if req.get("full_paths") else name] = text
            out["renders"].append(answer)
    for values in req.get("lints", []):
        kwargs = {"strict": True, "namespace": req["namespace"]}
        if req.get("kube_version"):
            kwargs["kube_version"] = req["kube_version"]
        out["lints"].append(helm.lint(req["chart"], values, **kwargs))
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
