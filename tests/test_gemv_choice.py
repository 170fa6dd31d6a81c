"""Which unquantized projections take the 16-bit GEMV (services/worker/layers/gemv_choice.py):
the row counts follow the two timings per shape, one choice per shape, CPU models never
take it, and on CUDA the layer's output is the kernel's for the rows it took and cuBLAS's
for the others. The kernel itself is checked against its twin in test_kernels_triton.py,
whole models with the choice on and off in test_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from kernels.gemv import gemv_triton
from services import LLM
from services.worker.layers import gemv_choice
from services.worker.layers.linear import LinearBase, QKVParallelLinear, RowParallelLinear
from tests.tiny_models import make_tiny_model
from tests.tiny_models import model_in_this_process  # noqa: F401 (autouse)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def layers_of(*modules: LinearBase) -> dict[str, LinearBase]:
    return {f"model.layers.{i}.self_attn.o_proj": m for i, m in enumerate(modules)}


@pytest.mark.parametrize("one, more, rows", [
    ((5.0, 9.0), (8.0, 9.0), range(1, 17)),  # faster at both
    ((5.0, 9.0), (12.0, 9.0), range(1, 2)),  # one row only
    ((10.0, 9.0), (8.0, 9.0), range(2, 17)),  # tensor cores only
    ((10.0, 9.0), (12.0, 9.0), range(2, 2)),  # never
])
def test_the_kernel_takes_the_rows_where_it_was_faster(one, more, rows, monkeypatch, caplog):
    timings = {1: one, 16: more}
    monkeypatch.setattr(gemv_choice, "time_both", lambda layers, n_rows: timings[n_rows])
    with torch.device("cpu"):
        layers = layers_of(RowParallelLinear(48, 40), RowParallelLinear(48, 40))
    with caplog.at_level(logging.INFO, logger="headrace.worker.gemv"):
        assert gemv_choice.rows_for(layers) == rows
    assert f"gemv: o_proj 40x48 float32: 1 row {one[0]:.1f} us vs cuBLAS {one[1]:.1f} us" \
        in caplog.text


@pytest.mark.parametrize("device, eager", [
    ("cpu", False), pytest.param("cuda", True, marks=needs_cuda)])
def test_cpu_and_eager_engines_never_take_the_gemv(device, eager, tmp_path, monkeypatch):
    """A bf16 engine on the CPU, or eager on CUDA (a Triton launch costs the host more than
    cuBLAS's), times nothing and every projection keeps F.linear."""
    monkeypatch.setattr(gemv_choice, "rows_for", lambda layers: pytest.fail("timed"))
    llm = LLM(str(make_tiny_model(tmp_path, "llama")), dtype="bfloat16", device=device,
              enforce_eager=eager, num_gpu_blocks_override=64)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(not m.gemv_rows for m in linears)
    assert llm.engine.runner.device.type == device


def test_headrace_gemv_fixes_the_rows_or_leaves_them_to_the_timing():
    assert gemv_choice.fixed_rows("timed") is None
    assert gemv_choice.fixed_rows("cublas") == range(0)
    assert gemv_choice.fixed_rows("gemv") == range(1, 17)
    with pytest.raises(ValueError, match="HEADRACE_GEMV='fast': timed, cublas or gemv"):
        gemv_choice.fixed_rows("fast")


@needs_cuda
@pytest.mark.parametrize("choice, rows", [("cublas", range(0)), ("gemv", range(1, 17))])
def test_a_fixed_choice_times_nothing_and_keeps_no_choice(choice, rows, monkeypatch):
    """HEADRACE_GEMV=cublas|gemv: every 16-bit projection takes those rows untimed, and the
    process's timed choices stay as they were for a later engine without it."""
    monkeypatch.setattr(gemv_choice, "_CHOSEN", {})
    monkeypatch.setattr(gemv_choice, "rows_for", lambda layers: pytest.fail("timed"))
    monkeypatch.setenv(gemv_choice.GEMV_ENV, choice)
    with torch.device("cuda"):
        model = torch.nn.ModuleDict({"o": RowParallelLinear(256, 256).to(torch.bfloat16)})
    gemv_choice.choose_gemv(model)
    assert model["o"].gemv_rows == rows and gemv_choice._CHOSEN == {}


@needs_cuda
def test_one_choice_per_shape_and_the_layer_takes_it(monkeypatch):
    """Two q/k/v layers of one shape and a row-parallel one of another: each shape is timed
    once (the second model reuses the choice); the q/k/v layers' decode rows are the
    kernel's, a step of 17 rows cuBLAS's, and the shape the kernel lost keeps cuBLAS."""
    monkeypatch.setattr(gemv_choice, "_CHOSEN", {})
    timed = []

    def rows_for(layers):
        timed.append(sorted(layers))
        return range(1, 17) if isinstance(next(iter(layers.values())), QKVParallelLinear) \
            else range(0)

    monkeypatch.setattr(gemv_choice, "rows_for", rows_for)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = torch.nn.ModuleDict({"a": QKVParallelLinear(256, 64, 4, 2, bias=True),
                                         "b": QKVParallelLinear(256, 64, 4, 2, bias=True),
                                         "o": RowParallelLinear(256, 256)})
        finally:
            torch.set_default_dtype(torch.float32)
    for param in model.parameters():
        param.data.normal_()
    gemv_choice.choose_gemv(model)
    gemv_choice.choose_gemv(model)
    assert timed == [["a", "b"], ["o"]]
    qkv = model["a"]
    for rows in (1, 3, 16, 17):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        expected = gemv_triton(x, qkv.weight, qkv.bias) if rows <= 16 else \
            F.linear(x, qkv.weight, qkv.bias)
        assert torch.equal(qkv(x), expected), rows
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(model["o"](x), F.linear(x, model["o"].weight))


@needs_cuda
def test_timing_a_real_shape_picks_rows(caplog):
    """The real timing at Phi-3-mini's o_proj (3072 x 3072, bf16) over four layers: a
    choice of rows, logged with both timings."""
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layers = layers_of(*(RowParallelLinear(3072, 3072) for _ in range(4)))
        finally:
            torch.set_default_dtype(torch.float32)
    for layer in layers.values():
        layer.weight.data.normal_(std=0.02)
    with caplog.at_level(logging.INFO, logger="headrace.worker.gemv"):
        rows = gemv_choice.rows_for(layers)
    assert rows.start in (1, 2) and rows.stop in (2, 17)
    assert "gemv: o_proj 3072x3072 bfloat16: 1 row" in caplog.text
