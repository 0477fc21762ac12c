#!/usr/bin/env python3
"""Pushes the packaged chart (dist/gpushare-VERSION.tgz) to an OCI registry with the Helm SDK,
as `helm push CHART oci://REGISTRY/PATH` would. Used by the release workflow; credentials come
from the environment (REGISTRY_USER, REGISTRY_PASSWORD), never from arguments.

  push_chart.py dist/gpushare-0.2.0.tgz oci://ghcr.io/OWNER/charts
"""

import os
import sys
from urllib.parse import urlparse

import helm_python as helm


def main() -> int:
    if len(sys.argv) != 3 or not sys.argv[2].startswith("oci://"):
        print(__doc__, file=sys.stderr)
        return 64
    chart, remote = sys.argv[1], sys.argv[2]
    client = helm.RegistryClient()
    user, password = os.environ.get("REGISTRY_USER"), os.environ.get("REGISTRY_PASSWORD")
    if user and password:
        client.login(urlparse(remote).netloc, user, password)
    result = client.push(chart, remote)
    print(f"push_chart: {chart} -> {remote}: {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
