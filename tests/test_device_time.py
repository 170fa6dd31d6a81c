"""The device's time on steps (services/worker/device_time.py): a span counts once its end
has fired, and a result carries the spans before it that nobody waited for."""

import pytest
import torch

from services.worker.device_time import DeviceTimer, mark


def test_off_a_gpu_nothing_is_timed():
    assert mark(torch.device("cpu")) is None
    assert DeviceTimer().take_ms(None) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_span_waits_for_its_end_and_a_later_result_carries_it():
    cuda, timer = torch.device("cuda"), DeviceTimer()
    begun = mark(cuda)
    torch.cuda._sleep(50_000_000)  # some 25 ms of the device's clock
    chunk = (begun, mark(cuda))  # a step that copies nothing back: no one waits on it
    assert timer.take_ms(chunk) == 0.0  # its end has not fired yet
    begun = mark(cuda)
    torch.cuda._sleep(10_000_000)
    step = (begun, mark(cuda))
    step[1].synchronize()  # the step's tokens are on the host
    expected = chunk[0].elapsed_time(chunk[1]) + step[0].elapsed_time(step[1])
    assert timer.take_ms(step) == pytest.approx(expected) and expected > 20
    assert timer.take_ms(None) == 0.0  # each span counts once
