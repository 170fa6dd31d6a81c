"""This build's version, for /version and the responses' system_fingerprint."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def package_version() -> str:
    """The installed package's version; a checkout run without installing it (the GPU
    image runs the tree as it is) reads pyproject.toml."""
    try:
        return importlib.metadata.version("headrace")
    except importlib.metadata.PackageNotFoundError:
        return tomllib.loads(PYPROJECT.read_text())["project"]["version"]


VERSION = package_version()
