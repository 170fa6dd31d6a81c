"""Layerwise profiling: where one engine step's time goes, per nn.Module and per op.

Every module's forward is wrapped in a torch.profiler range named after its path (forward
pre/post hooks open and close a `record_function`), so the profiler's event tree nests
aten ops, and the CUDA kernels they launch, under the module that called them. Walking that
tree gives two tables:

* the MODEL table: one row per module path as it was called (a shared module appears under
  each caller), nested like the calls, with CUDA time (kernels launched inside), CPU time
  (wall time of the range) and invocations; a last root row holds the rest of the step.
* the SUMMARY table: one row per CUDA kernel name (CUDA time) and per CPU op name (self
  CPU time, so nothing is counted twice), with percentages of the step's totals.

Kernels are matched to the CUDA runtime/driver call that launched them (cudaLaunchKernel,
cuLaunchKernelEx, cudaMemcpyAsync, ...) by their shared CUPTI correlation id, read from the
raw profiler events. FunctionEvent.kernels is not used: it links kernels through the aten op
around the launch, so Triton kernels (launched outside any aten op) go missing, and a
Triton launch whose correlation id equals some aten op's id is handed that op's kernels.

The tree walk (`phase_stats`) reads only the attributes below from each event, so it is
tested on real CPU profiles and on hand-built trees with kernels alike.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

STEP_RANGE = "engine_step"
REST_OF_STEP = "(rest of step)"
PYTHON_ROW = "(python, outside torch ops)"
RUNTIME_CALL = re.compile(r"^cuda[A-Z]|^cu[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx, ...


class EventLike(Protocol):
    """What the walk reads of a torch.autograd.profiler FunctionEvent."""
    name: str
    id: int  # a runtime call's CUPTI correlation id, shared with the kernels it launched
    device_type: DeviceType  # a range also leaves a CUDA-side twin in a GPU profile
    is_user_annotation: bool
    cpu_time_total: float  # us, the range's wall time
    self_cpu_time_total: float  # us, minus the children's
    cpu_children: Sequence[EventLike]


@dataclass(frozen=True, slots=True)
class Kernel:
    """Device work: a kernel, a memcpy or a memset."""
    name: str
    duration_us: float


Launches = dict[int, list[Kernel]]  # correlation id -> the device work it launched


def device_work(raw_events: Sequence[Any]) -> Launches:
    """The device events of a profile (torch's raw kineto events), by correlation id."""
    launches: Launches = {}
    for event in raw_events:
        if event.device_type() != DeviceType.CPU and not event.is_user_annotation():
            kernel = Kernel(event.name(), (event.end_ns() - event.start_ns()) / 1000)
            launches.setdefault(event.correlation_id(), []).append(kernel)
    return launches


def launched(event: EventLike, launches: Launches) -> list[Kernel]:
    """The device work a CPU event launched itself (only runtime calls launch)."""
    if event.is_user_annotation or not RUNTIME_CALL.match(event.name):
        return []
    return launches.get(event.id, [])


@dataclass(slots=True)
class ModelRow:
    path: str  # module path in the model ("" is the model itself)
    module: str  # class name
    cuda_time_us: float = 0.0
    cpu_time_us: float = 0.0
    invocations: int = 0
    children: list[ModelRow] = field(default_factory=list)

    def child(self, path: str, module: str) -> ModelRow:
        return _row_in(self.children, path, module)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "module": self.module, "cuda_time_us": self.cuda_time_us,
                "cpu_time_us": self.cpu_time_us, "invocations": self.invocations,
                "children": [c.to_dict() for c in self.children]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelRow:
        return cls(data["path"], data["module"], data["cuda_time_us"], data["cpu_time_us"],
                   data["invocations"], [cls.from_dict(c) for c in data["children"]])


@dataclass(slots=True)
class SummaryRow:
    name: str
    kind: str  # "kernel" (CUDA time), "op" (self CPU time) or "python"
    cuda_time_us: float
    pct_cuda_time: float
    cpu_time_us: float
    pct_cpu_time: float
    invocations: int


@dataclass(slots=True)
class PhaseStats:
    """One profiled engine step."""
    num_running_requests: int
    num_tokens: int  # tokens the step computed (prompt tokens in a prefill)
    cuda_time_us: float
    cpu_time_us: float
    model: list[ModelRow]
    summary: list[SummaryRow]

    def to_dict(self) -> dict[str, Any]:
        return {"num_running_requests": self.num_running_requests,
                "num_tokens": self.num_tokens,
                "totals": {"cuda_time_us": self.cuda_time_us, "cpu_time_us": self.cpu_time_us},
                "model_stats": [r.to_dict() for r in self.model],
                "summary_stats": [_summary_dict(r) for r in self.summary]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PhaseStats:
        totals = data["totals"]
        return cls(data["num_running_requests"], data["num_tokens"], totals["cuda_time_us"],
                   totals["cpu_time_us"], [ModelRow.from_dict(r) for r in data["model_stats"]],
                   [SummaryRow(**r) for r in data["summary_stats"]])


def _summary_dict(row: SummaryRow) -> dict[str, Any]:
    return {name: getattr(row, name) for name in SummaryRow.__slots__}


def _row_in(rows: list[ModelRow], path: str, module: str) -> ModelRow:
    for row in rows:
        if row.path == path:
            return row
    rows.append(ModelRow(path, module))
    return rows[-1]


# --- the event tree -> tables ------------------------------------------------------------

def device_time_us(event: EventLike, launches: Launches) -> float:
    """CUDA time of the kernels launched inside an event, its descendants' included."""
    own = sum(k.duration_us for k in launched(event, launches))
    return own + sum(device_time_us(c, launches) for c in event.cpu_children)


@dataclass(slots=True)
class _Totals:
    """Accumulates the summary table: kernel time and self CPU time by name."""
    kernels: dict[str, list[float]] = field(default_factory=dict)  # name -> [us, count]
    ops: dict[str, list[float]] = field(default_factory=dict)
    python_us: float = 0.0
    python_count: int = 0

    def add(self, event: EventLike, launches: Launches) -> None:
        for kernel in launched(event, launches):
            _bump(self.kernels, kernel.name, kernel.duration_us)
        if event.is_user_annotation:  # Python code between ops, in forwards and the engine
            self.python_us += event.self_cpu_time_total
            self.python_count += 1
        else:
            _bump(self.ops, event.name, event.self_cpu_time_total)

    def rows(self, cuda_total: float, cpu_total: float) -> list[SummaryRow]:
        rows = [SummaryRow(name, "kernel", us, _pct(us, cuda_total), 0.0, 0.0, int(n))
                for name, (us, n) in self.kernels.items()]
        rows += [SummaryRow(name, "op", 0.0, 0.0, us, _pct(us, cpu_total), int(n))
                 for name, (us, n) in self.ops.items()]
        rows.append(SummaryRow(PYTHON_ROW, "python", 0.0, 0.0, self.python_us,
                               _pct(self.python_us, cpu_total), self.python_count))
        rows.sort(key=lambda r: (r.cuda_time_us, r.cpu_time_us), reverse=True)
        return rows


def _bump(table: dict[str, list[float]], name: str, us: float) -> None:
    entry = table.setdefault(name, [0.0, 0])
    entry[0] += us
    entry[1] += 1


def _pct(part: float, total: float) -> float:
    return 100.0 * part / total if total > 0 else 0.0


def phase_stats(events: Sequence[EventLike], launches: Launches,
                modules: dict[str, tuple[str, str]], num_running_requests: int = 0,
                num_tokens: int = 0) -> PhaseStats:
    """Tables of the step range in `events` (one profile's event list). `modules` maps a
    range name to (module path, class name), as `ModuleRanges.names` does."""
    step = find_step(events)
    root = ModelRow("", "")
    totals = _Totals()
    for child in step.cpu_children:
        _walk(child, root, modules, launches, totals)
    totals.add(step, launches)
    cuda_total, cpu_total = device_time_us(step, launches), step.cpu_time_total
    rest = ModelRow(REST_OF_STEP, "", invocations=1,
                    cuda_time_us=max(0.0, cuda_total - sum(r.cuda_time_us for r in root.children)),
                    cpu_time_us=max(0.0, cpu_total - sum(r.cpu_time_us for r in root.children)))
    return PhaseStats(num_running_requests, num_tokens, cuda_total, cpu_total,
                      root.children + [rest], totals.rows(cuda_total, cpu_total))


def find_step(events: Sequence[EventLike]) -> EventLike:
    steps = [e for e in events if e.is_user_annotation and e.name == STEP_RANGE
             and e.device_type == DeviceType.CPU]
    if len(steps) != 1:
        raise ValueError(f"expected one {STEP_RANGE!r} range in the profile, found {len(steps)}")
    return steps[0]


def _walk(event: EventLike, parent: ModelRow, modules: dict[str, tuple[str, str]],
          launches: Launches, totals: _Totals) -> None:
    totals.add(event, launches)
    module = modules.get(event.name) if event.is_user_annotation else None
    if module is not None:
        parent = parent.child(*module)
        parent.invocations += 1
        parent.cpu_time_us += event.cpu_time_total
        parent.cuda_time_us += device_time_us(event, launches)
    for child in event.cpu_children:
        _walk(child, parent, modules, launches, totals)


# --- ranges around module forwards --------------------------------------------------------

class ModuleRanges:
    """Opens a profiler range around every forward of `model`'s modules (and around the
    extra callables given, e.g. the sampler) while the context is entered.

    Module ranges are named by path, so Chrome traces read like the model; the model itself
    is named by its class. Graph replays run no Python, so their modules get no range:
    profile with eager execution."""

    def __init__(self, model: nn.Module, calls: dict[str, tuple[object, str]] | None = None
                 ) -> None:
        self.model = model
        self.calls = calls or {}  # range name -> (object, method name)
        self.names: dict[str, tuple[str, str]] = {}  # range name -> (path, class name)
        for path, module in model.named_modules():
            self.names[path or type(module).__name__] = (path, type(module).__name__)
        for name, (obj, _) in self.calls.items():
            self.names[name] = (name, type(obj).__name__)
        self._open: list[record_function] = []
        self._handles: list[Any] = []

    def __enter__(self) -> ModuleRanges:
        for path, module in self.model.named_modules():
            name = path or type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._opener(name)))
            self._handles.append(module.register_forward_hook(self._close))
        for name, (obj, method) in self.calls.items():
            setattr(obj, method, _in_range(name, getattr(obj, method)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for obj, method in self.calls.values():
            delattr(obj, method)  # the class's method shows through again
        self._open.clear()

    def _opener(self, name: str) -> Callable[..., None]:
        def open_range(module: nn.Module, args: Any) -> None:
            self._open.append(record_function(name).__enter__())
        return open_range

    def _close(self, module: nn.Module, args: Any, output: Any) -> None:
        self._open.pop().__exit__(None, None, None)


def _in_range(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)
    return wrapper


# --- one profiled step ---------------------------------------------------------------------

@dataclass(slots=True)
class StepProfile:
    profiler: profile
    stats: PhaseStats


def profile_step(run: Callable[[], tuple[int, int]], ranges: ModuleRanges, use_cuda: bool
                 ) -> StepProfile:
    """Profile `run()` (one engine step, returning how many requests and tokens it
    computed) inside the module ranges; CPU activity always, CUDA activity on a GPU."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    with ranges, profile(activities=activities) as prof:
        with record_function(STEP_RANGE):
            num_requests, num_tokens = run()
            if use_cuda:
                torch.cuda.synchronize()  # the step's kernels end inside its range
    launches = device_work(prof.profiler.kineto_results.events())
    stats = phase_stats(prof.events(), launches, ranges.names, num_requests, num_tokens)
    return StepProfile(prof, stats)
