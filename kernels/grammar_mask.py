"""The grammar mask: -inf on the logits of the tokens a grammar forbids, in place.

xgrammar packs a row's allowed tokens into int32 words: bit j of word w stands for token
32 * w + j, 1 meaning allowed. Only structured requests have a row of the bitmask; `rows`
says which logits row each bitmask row belongs to, so a batch's plain rows are never
touched. The kernel never reads the logits: one program per (bitmask row, vocabulary
block) writes -inf where the bit is 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_VOCAB = 1024  # tokens per program


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
                        ) -> None:
    """logits [N, vocab] (float), bitmask int32 [k, >= vocab / 32], rows int64 [k]: the
    logits row of each bitmask row. The one dispatch point: CUDA tensors take Triton."""
    assert bitmask.shape[1] * 32 >= logits.shape[1], "the bitmask must cover the vocabulary"
    if logits.is_cuda:
        apply_token_bitmask_triton(logits, bitmask, rows)
    else:
        apply_token_bitmask_ref(logits, bitmask, rows)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
                            ) -> None:
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                               rows: torch.Tensor) -> None:
    vocab = logits.shape[1]
    assert logits.stride(1) == 1 and bitmask.is_contiguous()
    if rows.numel() == 0:
        return
    grid = (rows.numel(), triton.cdiv(vocab, BLOCK_VOCAB))
    _apply_bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.shape[1], rows,
                                vocab, BLOCK=BLOCK_VOCAB, num_warps=4)


@triton.jit
def _apply_bitmask_kernel(logits_ptr, stride_row, bitmask_ptr, words, rows_ptr, vocab,
                          BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    # 32 neighbouring lanes read the same word: one cached load for them all
    word = tl.load(bitmask_ptr + i * words + cols // 32, mask=in_vocab, other=-1)
    forbidden = ((word >> (cols % 32)) & 1) == 0
    minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_row + cols, minus_inf, mask=in_vocab & forbidden)
