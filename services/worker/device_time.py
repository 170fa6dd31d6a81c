"""The device's time on each step, from CUDA events: how busy the engine keeps the GPU.

A step's span runs from an event recorded as its forward pass is queued (after its inputs'
copy, microseconds) to the event its tokens' copies end with, or one recorded after its
last launch where it copies nothing back (a prompt's chunk that samples no token). Each
result carries the spans that ended by the time its tokens reached the host: its own,
and any such chunk before it, whose end no one waited for. Summed over a run, they are
the seconds the device worked on the engine's steps; the rest of the run it waited on
the host. An eager step's span includes the gaps where the device waited for its
launches. The scheduler keeps the total (`headrace:device_busy_seconds_total`).
"""

from __future__ import annotations

import torch

Span = tuple[torch.cuda.Event, torch.cuda.Event]


def mark(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on the current stream now, that times; None off a GPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class DeviceTimer:
    """The spans of launched steps not yet measured, oldest first."""

    def __init__(self) -> None:
        self._open: list[Span] = []

    def take_ms(self, span: Span | None) -> float:
        """Milliseconds of `span` (its end has fired) and of every span before it, which
        ended before it on the same stream; spans whose end has not fired yet wait."""
        if span is not None:
            self._open.append(span)
        total, ended = 0.0, 0
        for begun, end in self._open:
            if not end.query():
                break
            total += begun.elapsed_time(end)
            ended += 1
        del self._open[:ended]
        return total
