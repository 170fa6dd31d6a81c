"""`headrace bench latency --profile`: one more batch, after the timed ones, under
torch.profiler (vLLM's benchmark_latency has the flag). The Chrome trace goes to
--profile-result-dir (default $VLLM_TORCH_PROFILER_DIR, as vLLM reads it); the summary
says how much of the time from the batch's first kernel to its last the device was busy
(some kernel running: the union of their spans) and which kernels ran longest, per output
token. CUDA graph replays show their kernels one by one, so a decode step's launches, gaps
and kernels read off the trace as they ran. A kernel launched with PDL (kernels/pdl.py)
starts before the one it follows has ended and waits for it: its span counts that wait,
so the kernels' own times add up to more than the busy time; HEADRACE_PDL=0 gives each
kernel its own. The profiler's host work slows the batch: its wall time is not the timed
batches'."""

from __future__ import annotations

import gzip
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

TOP_KERNELS = 15


@dataclass(frozen=True)
class KernelTime:
    name: str
    calls: int
    total_ms: float
    us_per_token: float


@dataclass(frozen=True)
class ProfileSummary:
    trace: str  # the gzipped Chrome trace
    device: str  # "cuda": kernels' device time; "cpu": operators' own time
    span_ms: float  # from the batch's first kernel (or operator) to its last
    busy_ms: float  # of the span, with some kernel (or operator) running
    output_tokens: int  # the batch's first request's, the unit of the per-token figures
    top: list[KernelTime]

    def lines(self) -> list[str]:
        out = [f"profile: {self.trace}; {self.device} busy {self.busy_ms:.1f} of "
               f"{self.span_ms:.1f} ms ({1 - self.busy_ms / self.span_ms:.0%} idle) over "
               f"{self.output_tokens} tokens",
               f"  {'us/token':>9} {'calls':>7}  kernel" if self.device == "cuda"
               else f"  {'us/token':>9} {'calls':>7}  operator"]
        out += [f"  {k.us_per_token:9.1f} {k.calls:7d}  {k.name[:100]}" for k in self.top]
        return out


def profile_batch(time_batch: Callable[[], tuple[float, list[float]]], device: torch.device,
                  out_dir: Path, name: str) -> ProfileSummary:
    """Runs `time_batch` (bench latency's time_one_batch, bound to its arguments) under
    the profiler and writes `out_dir/name.json.gz`."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # every thread: the engine's steps run on its step thread, started before the profiler
    with profile(activities=activities,
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        _, gaps = time_batch()
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"{name}.json"
    prof.export_chrome_trace(str(raw))
    trace = out_dir / f"{name}.json.gz"
    with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    tokens = len(gaps) + 1
    # the device's own entries (kernels, copies), not the operators that launched them and
    # count them again; on the CPU the operators nest, and only their own times add up
    own = "self_device_time_total" if cuda else "self_cpu_time_total"
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    timed = [a for a in prof.key_averages() if a.device_type == kind and getattr(a, own) > 0]
    timed.sort(key=lambda a: getattr(a, own), reverse=True)
    top = [KernelTime(a.key, a.count, getattr(a, own) / 1000,
                      getattr(a, own) / tokens) for a in timed[:TOP_KERNELS]]
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == kind and e.time_range.end > e.time_range.start)
    return ProfileSummary(str(trace), device.type, (spans[-1][1] - spans[0][0]) / 1000,
                          covered_us(spans) / 1000, tokens, top)


def covered_us(spans: list[tuple[int, int]]) -> int:
    """The length of the union of sorted (start, end) spans."""
    covered, reach = 0, float("-inf")
    for start, end in spans:
        covered += max(0, end - max(start, reach))
        reach = max(reach, end)
    return covered
