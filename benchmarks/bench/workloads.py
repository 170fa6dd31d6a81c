"""The benchmark workloads, the trace of what a run computed, and the floor it implies.

The floor of a step is the larger of (bytes it must move / measured copy bandwidth) and
(FLOPs it must do / measured bf16 matrix rate); bytes are the weights plus the KV cache
read (every context token) and written (every new token). A run's floor is the sum over
its steps, so "fraction of floor" says how close the engine came to the hardware.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from common.messages import StepPlan
from common.sampling_params import SamplingParams

TOKEN_ID_LIMIT = 10_000  # ids valid in every vocabulary the benchmarks use
WARMUP_SEED = 1  # the workloads draw with seed 0: warm-up prompts come from another stream
WARMUP_OUTPUT_LEN = 4  # enough to run decode steps after the prefills


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    top_token_id: int  # prompts draw their ids from [0, top_token_id]

    @property
    def output_tokens(self) -> int:
        return sum((p.max_tokens or 0) * p.n for p in self.params)


def nano_workload(num_prompts: int = 256, seed: int = 0) -> Workload:
    """256 requests, prompt and output lengths uniform in [100, 1024], token ids in
    [0, 10000), temperature 0.6, ignore_eos: 133,966 output tokens with seed 0."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, TOKEN_ID_LIMIT) for _ in range(rng.randint(100, 1024))]
               for _ in range(num_prompts)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=rng.randint(100, 1024)) for _ in range(num_prompts)]
    return Workload("nano", prompts, params, TOKEN_ID_LIMIT)


def fixed_workload(name: str, num_prompts: int, prompt_len: int, output_len: int,
                   seed: int = 0, vocab_size: int = TOKEN_ID_LIMIT) -> Workload:
    rng = random.Random(seed)
    top = min(TOKEN_ID_LIMIT, vocab_size) - 1
    prompts = [[rng.randint(0, top) for _ in range(prompt_len)] for _ in range(num_prompts)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_len)
              for _ in range(num_prompts)]
    return Workload(name, prompts, params, top)


def with_output_len(workload: Workload, num_prompts: int, output_len: int) -> Workload:
    """The first prompts of a workload with one fixed output length (for engines that
    cannot take a length per request)."""
    params = [p.replace(max_tokens=output_len) for p in workload.params[:num_prompts]]
    return Workload(f"{workload.name}[:{num_prompts}],out={output_len}",
                    workload.prompts[:num_prompts], params, workload.top_token_id)


def warmup_twin(workload: Workload, seed: int) -> Workload:
    """As many prompts of the same lengths, with ids drawn from another seed, and short
    outputs: a warm-up runs the step shapes of the timed run (so the kernels compile
    untimed) without leaving the timed prompts in the prefix cache, where they would turn
    the timed prefills into cache hits. `seed` must differ from the workload's own."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, workload.top_token_id) for _ in prompt]
               for prompt in workload.prompts]
    params = [p.replace(max_tokens=WARMUP_OUTPUT_LEN) for p in workload.params]
    return Workload(f"{workload.name}:warm-up", prompts, params, workload.top_token_id)


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int  # read every step: all but the routed experts
    num_params: int  # multiplied by each token: the routed experts only k of them; a
    # packed parameter's values (int4's eight a word), not its words
    kv_value_bytes: int  # of one K or V value in the cache: 1 with an fp8 cache
    expert_bytes: int = 0  # of one routed expert of one layer: a step reads those it routes
    num_moe_layers: int = 0
    num_experts: int = 0  # routed experts per MoE layer
    top_k: int = 0

    def decode_expert_bytes(self, batch_size: int) -> int:
        """Routed experts' bytes a decode step of `batch_size` tokens reads at most: each
        token's k experts, every one distinct (exact at batch 1)."""
        per_layer = min(self.num_experts, batch_size * self.top_k)
        return self.num_moe_layers * per_layer * self.expert_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_value_bytes

    @classmethod
    def of(cls, model: torch.nn.Module, hf_config, tp_size: int, kv_value_bytes: int
           ) -> ModelShape:
        """What one GPU holds and computes: a tensor-parallel rank's share (its weights,
        heads and KV heads), the floor of a shard whose ranks run side by side."""
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads)
        moe = routed_experts(model)
        # an expert's bytes: its slice of the weights and of their scales (fp8 experts:
        # a byte a weight, plus float32 scales)
        stacked = [p for m in moe for p in m.expert_parameters()]
        routed = {id(p) for p in stacked}
        dense = [p for p in model.parameters() if id(p) not in routed]
        expert_params = sum(m.w13[0].numel() + m.w2[0].numel() for m in moe[:1])
        expert_bytes = sum(p[0].numel() * p.element_size()
                           for p in moe[0].expert_parameters()) if moe else 0
        top_k = moe[0].top_k if moe else 0
        return cls(hf_config.num_hidden_layers, hf_config.num_attention_heads // tp_size,
                   model.num_kv_heads, head_dim,
                   sum(p.numel() * p.element_size() for p in dense),
                   sum(values(p) for p in dense) + top_k * expert_params * len(moe),
                   kv_value_bytes, expert_bytes, len(moe),
                   moe[0].num_experts if moe else 0, top_k)


def values(param: torch.Tensor) -> int:
    """The parameter's values: an int4 weight (layers/quantization/int4.py) packs
    `pack_factor` of them in each int32."""
    return param.numel() * getattr(param, "pack_factor", 1)


def routed_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's FusedMoE layers (services/worker/layers/moe.py), found by their
    counter so that the benchmark needs no worker import."""
    return [m for m in model.modules() if hasattr(m, "experts_read")]


def reset_experts_read(model: torch.nn.Module) -> None:
    for m in routed_experts(model):
        m.experts_read.zero_()


def experts_read(model: torch.nn.Module) -> int:
    """Distinct experts read since the reset, summed over the layers and the forwards."""
    return sum(int(m.experts_read.item()) for m in routed_experts(model))


@dataclass(slots=True)
class StepCost:
    bytes: int
    flops: int


@dataclass(slots=True)
class Trace:
    """What each step computed, and the KV cache waste sampled at each step. An MoE
    model's routed experts come in after the run, as the mean per step that its layers'
    counters report (a count per step would need a sync per step)."""
    steps: list[StepCost] = field(default_factory=list)
    waste: list[float] = field(default_factory=list)
    experts_per_layer_step: float = 0.0  # distinct routed experts read, mean
    expert_bytes_per_step: float = 0.0

    def count_experts(self, shape: ModelShape, experts_read: int) -> None:
        """experts_read: summed over the MoE layers and this trace's steps."""
        if shape.num_moe_layers and self.steps:
            self.experts_per_layer_step = experts_read / (shape.num_moe_layers
                                                          * len(self.steps))
            self.expert_bytes_per_step = experts_read * shape.expert_bytes / len(self.steps)

    def record(self, plan: StepPlan, shape: ModelShape, waste: float) -> None:
        new_tokens = sum(plan.num_scheduled_tokens)
        context = attended = 0
        for start, n in zip(plan.num_computed_tokens, plan.num_scheduled_tokens):
            context += start + n
            attended += n * start + n * (n + 1) // 2  # query i sees start + i + 1 keys
        kv = shape.kv_bytes_per_token
        attention_flops = 4 * attended * shape.head_dim * shape.num_heads * shape.num_layers
        self.steps.append(StepCost(shape.weight_bytes + context * kv + new_tokens * kv,
                                   2 * shape.num_params * new_tokens + attention_flops))
        self.waste.append(waste)

    def floor_seconds(self, bandwidth: float, matmul_rate: float) -> float:
        return sum(max((s.bytes + self.expert_bytes_per_step) / bandwidth,
                       s.flops / matmul_rate) for s in self.steps)

    @property
    def mean_waste(self) -> float:
        return sum(self.waste) / len(self.waste) if self.waste else 0.0


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_bytes_per_s: float  # bytes read + written per second by a device-to-device copy
    matmul_flops_per_s: float  # bf16 8192^3 matrix product


def measure_ceilings(device: torch.device) -> Ceilings:
    if device.type != "cuda":  # bf16 products are slow on CPUs (2 s at 1024): a smaller one
        return _measure(device, copy_mib=256, matmul_n=512, repeat=3)
    return _measure(device, copy_mib=2048, matmul_n=8192, repeat=20)


def _measure(device: torch.device, copy_mib: int, matmul_n: int, repeat: int) -> Ceilings:
    dtype = torch.bfloat16
    src = torch.randn(copy_mib * 2**19, dtype=dtype, device=device)  # copy_mib MiB
    dst = torch.empty_like(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), device, repeat)
    a = torch.randn(matmul_n, matmul_n, dtype=dtype, device=device)
    b = torch.randn(matmul_n, matmul_n, dtype=dtype, device=device)
    matmul_s = _median_seconds(lambda: a @ b, device, repeat)
    return Ceilings(2 * src.numel() * src.element_size() / copy_s,
                    2 * matmul_n**3 / matmul_s)


def _median_seconds(fn, device: torch.device, repeat: int) -> float:
    import time
    fn()  # warm-up: allocations, library handles
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def kv_waste(scheduler) -> float:
    """(allocated slots - tokens they hold) / allocated slots, over running requests."""
    block_size = scheduler.config.block_size
    allocated = held = 0
    for req in scheduler.running:
        allocated += len(scheduler.kv.req_blocks.get(req.req_id, ())) * block_size
        held += req.num_computed_tokens
    return (allocated - held) / allocated if allocated else 0.0
