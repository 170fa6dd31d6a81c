"""The pinned host blocks that a launched step's outputs land in (services/worker/
launched.py): each is taken for one step and comes back only when that step is finished,
so a step in flight never shares its block with a later one."""

import pytest
import torch

from services.worker.device_time import DeviceTimer
from services.worker.launched import Launched, PinnedBlocks, finish

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory is CUDA's")


def launched_with(pool: PinnedBlocks, step: int, values: torch.Tensor) -> Launched:
    launched = Launched(step, [], pinned=pool)
    launched.host = launched.to_host(values.cuda())
    return launched


def test_a_steps_block_is_reused_only_after_the_step_is_finished():
    pool = PinnedBlocks()
    first = launched_with(pool, 0, torch.arange(6))
    second = launched_with(pool, 1, torch.arange(6) * 2)  # the first is still in flight
    assert second.blocks[0].data_ptr() != first.blocks[0].data_ptr()
    finish(first, DeviceTimer())
    third = launched_with(pool, 2, torch.full((5,), 7))
    assert third.blocks[0].data_ptr() == first.blocks[0].data_ptr()
    finish(second, DeviceTimer())
    finish(third, DeviceTimer())
    assert second.host.tolist() == [0, 2, 4, 6, 8, 10] and third.host.tolist() == [7] * 5


def test_copies_keep_their_dtype_and_shape_whatever_the_blocks_size():
    pool = PinnedBlocks()
    values = torch.randn(3, 100, dtype=torch.float32)
    launched = launched_with(pool, 0, values)
    empty = launched.to_host(torch.zeros(0, 4, dtype=torch.bfloat16, device="cuda"))
    finish(launched, DeviceTimer())
    assert launched.host.is_pinned() and launched.host.dtype == torch.float32
    assert torch.equal(launched.host, values)
    assert empty.shape == (0, 4) and empty.dtype == torch.bfloat16
