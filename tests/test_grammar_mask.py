"""The grammar-mask kernel (kernels/grammar_mask.py): its torch twin against the plain
bit-by-bit rule and against xgrammar's own CPU kernel, and the Triton kernel against the
twin, under Triton's interpreter on CPU (in a fresh process, as tests/test_kernels_triton.py
explains) and at a real vocabulary on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels.grammar_mask import (BLOCK_VOCAB, apply_token_bitmask, apply_token_bitmask_ref,
                                  apply_token_bitmask_triton)
from tests.conftest import REPO

# (vocabulary, batch rows, masked rows): a vocabulary inside one word, one that ends inside
# a word, one over two program blocks and a partial third
CASES = [(20, 3, [1]), (1000, 5, [4, 0, 2]), (2 * BLOCK_VOCAB + 37, 4, [3, 1])]


def random_case(vocab: int, batch: int, rows: list[int], dtype: torch.dtype, device: str,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g).to(dtype)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31, (len(rows), words), generator=g,
                            dtype=torch.int64).to(torch.int32)
    return logits.to(device), bitmask.to(device), torch.tensor(rows, device=device)


def test_the_twin_follows_the_bit_rule():
    for seed, (vocab, batch, rows) in enumerate(CASES):
        logits, bitmask, index = random_case(vocab, batch, rows, torch.float32, "cpu", seed)
        out = logits.clone()
        apply_token_bitmask_ref(out, bitmask, index)
        for r in range(batch):
            for t in range(vocab):
                allowed = r not in rows or (
                    int(bitmask[rows.index(r), t // 32]) >> (t % 32)) & 1
                assert out[r, t] == (logits[r, t] if allowed else float("-inf"))


def test_the_twin_matches_xgrammars_cpu_kernel():
    xgrammar = pytest.importorskip("xgrammar")
    for seed, (vocab, batch, rows) in enumerate(CASES):
        logits, bitmask, index = random_case(vocab, batch, rows, torch.float32, "cpu", seed)
        ours = logits.clone()
        apply_token_bitmask_ref(ours, bitmask, index)
        full = torch.full((batch, bitmask.shape[1]), -1, dtype=torch.int32)
        full[index] = bitmask  # xgrammar's bitmask has a row per logits row
        theirs = logits.clone()
        xgrammar.apply_token_bitmask_inplace(theirs, full, indices=rows)
        assert torch.equal(ours, theirs)


def check_triton(device: str, cases: list[tuple[int, int, list[int]]]) -> None:
    for seed, (vocab, batch, rows) in enumerate(cases):
        for dtype in (torch.float32, torch.bfloat16):
            logits, bitmask, index = random_case(vocab, batch, rows, dtype, device, seed)
            expected, out = logits.clone(), logits.clone()
            apply_token_bitmask_ref(expected, bitmask, index)
            apply_token_bitmask_triton(out, bitmask, index)
            assert torch.equal(out, expected), (vocab, dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the compiled kernel is checked on "
                    "CUDA; the GPU image's Triton 3.6 interpreter has no bfloat16")
def test_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "tests.test_grammar_mask"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_at_a_real_vocabulary():
    check_triton("cuda", [(151936, 256, list(range(0, 256, 3))), (49152, 8, [7, 0])])
    logits, bitmask, index = random_case(1000, 3, [2], torch.float32, "cuda", 0)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, index)
    apply_token_bitmask(logits, bitmask, index)  # the dispatch takes Triton
    assert torch.equal(logits, expected)


if __name__ == "__main__":  # the interpreter check, in the fresh process above
    check_triton("cpu", CASES)
