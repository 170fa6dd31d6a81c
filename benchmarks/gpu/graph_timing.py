"""graph_us, the benchmarks' timer, lives with the kernels (kernels/graph_timing.py): the
worker times its GEMV choice with it too (services/worker/layers/gemv_choice.py)."""

from kernels.graph_timing import graph_us

__all__ = ["graph_us"]
