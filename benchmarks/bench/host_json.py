"""The JSON figures of the benchmarks that time host code alone (no model, no GPU), with the
host they ran on: such figures only compare within one machine."""

from __future__ import annotations

import json
import os
import platform
from typing import Any


def write_host_json(path: str, figures: dict[str, Any]) -> None:
    """`figures` with the machine, its CPU count and the Python version, to `path`."""
    host = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version()}
    with open(path, "w") as f:
        json.dump({**figures, **host}, f, indent=2)
