"""Engine steps replayed from CUDA graphs captured for ladders of token counts.

A step of a small model, decode or short prefill, is hundreds of tiny kernel launches whose
host cost dwarfs their device time; replaying a graph issues them all at once. Two kinds:

- decode graphs (every request computes one token) for 1, 2, 4, 8, 16, ... requests;
- mixed graphs for any step of at most 512 tokens (prefills, prefill chunks beside
  decodes), captured with as many request slots as tokens, since a step never has more
  requests than tokens.

A vision-language model's graphs take token ids and 1-D positions too: they replay its
steps without image rows (services/worker/model_runner.replays_graph).

A pipeline stage's graphs hold its layers' forward pass only (layers/pipeline.py): a stage
after the first takes the hidden states the stage before sent as one more static buffer,
and a stage before the last returns the hidden states it sends on. The receives and sends
stay outside the graphs, in the runner's step, so a stage never waits on another inside
a replay.

On the last stage each decode graph has heads: small graphs replayed after it that take
its hidden states to the greedy tokens, by the argmax or with their top logprobs
(services/worker/sampler.greedy_head). A greedy decode step then launches its sampling as
one replay instead of issuing the kernels of the lm_head, the logits and the sampler one
by one: four launches without logprobs, five and as many allocations with them (issue
31). The heads stay apart from the forward graphs so that each of those is captured once:
a head costs the host one replay more.

The attention of a small decode batch cuts each context into parts to fill the GPU, as
many as the longest context the launch allows makes worth having
(kernels/triton_attention.py), and a graph fixes that count. So a decode size has a graph
for each bound on the context that changes some layer's count: max_model_len, and the
powers of two below it. A batch-1 decode at a context of 62 then attends unsplit in one
launch instead of in 16 parts and their combine (3.6 against 5.2 us a layer at
Qwen3-0.6B's heads on an H200; at batch 4, 3.7 against 8.5;
benchmarks/issue31-h200/split10). The bound sets the count alone: the kernel cuts the
actual context, so every graph of a size computes any of its steps alike.

A step replays the smallest graph of its kind that fits, a decode at the smallest bound
that holds its longest context. Its inputs are copied into the graphs' static buffers;
the unused request slots have no queries and context length 0, the tokens past the last
real one have cache slot -1 and form the kernel's padding tail
(kernels/triton_attention.py), so they attend to nothing and write nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from services.worker.layers.attention import Attention, AttentionMetadata, ForwardContext
from services.worker.models import CausalLM
from services.worker.sampler import greedy_head

MAX_TOKENS = 512  # beyond this a step's device time hides its launches
MIN_SPAN = 16  # no attention splits a context shorter than this


class GraphKey(NamedTuple):
    mixed: bool  # a mixed graph, or a decode one
    size: int    # its tokens (a decode graph's: its requests)
    span: int    # the longest context its attention is split for


def graph_tokens(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most tokens one captured graph computes (its activations' size)."""
    return max(min(max_num_seqs, MAX_TOKENS), min(max_num_batched_tokens, MAX_TOKENS))


def decode_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_batch (and max_batch itself)."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def context_spans(splits: Callable[[int], tuple[int, ...]], max_model_len: int) -> list[int]:
    """The context bounds of one decode size's graphs, ascending: max_model_len, and each
    power of two below it (from MIN_SPAN) whose attention splits, `splits(bound)` over
    the model's kinds of attention layer, differ from those of the next larger bound
    kept. Bounds that split alike would capture the same graph twice."""
    spans, kept = [max_model_len], splits(max_model_len)
    bound = 1 << (max_model_len - 1).bit_length()
    while (bound := bound // 2) >= MIN_SPAN:
        if (split := splits(bound)) != kept:
            spans.insert(0, bound)
            kept = split
    return spans


def attention_kinds(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> list[tuple[Attention, torch.Tensor]]:
    """One attention layer of each kind (heads, window, cache dtype) with its K cache."""
    kinds: dict[tuple, tuple[Attention, torch.Tensor]] = {}
    for layer in model.modules():
        if isinstance(layer, Attention):
            k_cache = kv_caches[layer.cache_index][0]
            kind = (layer.num_heads, layer.num_kv_heads, layer.head_dim,
                    layer.sliding_window, layer.q_dtype, k_cache.dtype)
            kinds.setdefault(kind, (layer, k_cache))
    return list(kinds.values())


def mixed_sizes(max_tokens: int) -> list[int]:
    """16, 32, 48, 64, then steps of about 1.5x (at most a third of a replay is padding)
    up to max_tokens, which is included."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        size = size + 16 if size < 64 else size * 3 // 2 // 16 * 16
    return sizes + [max_tokens]


class StepGraphs:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_size: int, receives: torch.dtype | None = None,
                 heads: tuple[int, ...] = ()) -> None:
        """receives: on a pipeline stage after the first, the dtype of the hidden states
        it receives from the stage before; heads: the k of each head a decode graph has
        (greedy_head's), none where the stage does not sample."""
        self.model, self.kv_caches, self.head_ks = model, kv_caches, heads
        self.decode_sizes = decode_sizes(min(max_num_seqs, MAX_TOKENS))
        self.mixed_sizes = mixed_sizes(min(max_num_batched_tokens, MAX_TOKENS))
        self.max_model_len = max_model_len
        kinds = attention_kinds(model, kv_caches)
        self.decode_spans = {size: context_spans(
            lambda span, size=size: tuple(layer.decode_splits(size, span, k_cache)
                                          for layer, k_cache in kinds), max_model_len)
            for size in self.decode_sizes}
        device = kv_caches[0][0].device
        rows = max(self.decode_sizes[-1], self.mixed_sizes[-1])
        max_blocks = -(-max_model_len // block_size)

        def ints(*shape: int, dtype=torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
        self.input_ids = ints(rows, dtype=torch.int64)
        self.positions = ints(rows, dtype=torch.int64)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.block_tables = ints(rows, max_blocks)
        self.seq_lens = ints(rows)
        self.hidden = None if receives is None else torch.zeros(
            (rows, model.hidden_size), dtype=receives, device=device)
        # decode graphs: request i is token i; mixed graphs: written for every step
        self.decode_starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.mixed_starts = ints(rows + 1)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}  # each graph's hidden states
        # by (decode graph, k): a decode graph's heads and their outputs
        self.heads: dict[tuple[GraphKey, int], torch.cuda.CUDAGraph] = {}
        self.head_outputs: dict[tuple[GraphKey, int], torch.Tensor] = {}

    @property
    def sizes(self) -> dict[str, list[int]]:
        return {"decode": self.decode_sizes, "mixed": self.mixed_sizes}

    @property
    def keys(self) -> list[GraphKey]:
        return [GraphKey(False, size, span) for size in self.decode_sizes
                for span in self.decode_spans[size]] + \
            [GraphKey(True, size, self.max_model_len) for size in self.mixed_sizes]

    def key(self, attn: AttentionMetadata, num_tokens: int) -> GraphKey | None:
        """The graph that replays a step: the smallest of its kind that fits (a decode
        batch past the decode ladder takes a mixed one), a decode's at the smallest
        context bound that holds its longest context; None where none fits."""
        mixed = attn.max_query_len > 1 or num_tokens > self.decode_sizes[-1]
        size = next((s for s in (self.mixed_sizes if mixed else self.decode_sizes)
                     if s >= num_tokens), None)
        if size is None:
            return None
        longest = min(attn.max_seq_len, self.max_model_len)
        span = self.max_model_len if mixed else next(
            s for s in self.decode_spans[size] if s >= longest)
        return GraphKey(mixed, size, span)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # largest first: the rest reuse its memory
        ordered = sorted(self.keys, key=lambda k: -k.size)
        for key in ordered:
            self.forward(key)  # warm-up outside capture (compiles, allocates workspaces)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self.forward(key)
            self.graphs[key] = graph
        heads = [(key, k) for key in ordered if not key.mixed for k in self.head_ks]
        for head in heads:  # after every forward graph: each reads its graph's output
            self.head(*head)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.head_outputs[head] = self.head(*head)
            self.heads[head] = graph
        torch.cuda.synchronize()

    def run(self, key: GraphKey, input_ids: torch.Tensor, positions: torch.Tensor,
            attn: AttentionMetadata, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states of a step, replayed by graph `key` (from `key()`); hidden:
        those the stage before sent, on a pipeline stage after the first. The result is
        the graph's output buffer, which the next replay overwrites."""
        self.load(key, input_ids, positions, attn, hidden)
        self.graphs[key].replay()
        return self.outputs[key][:input_ids.shape[0]]

    def sample(self, key: GraphKey, k: int) -> torch.Tensor | None:
        """Head k's output for the step graph `key` has just replayed, over all the graph's
        rows (the next replay overwrites it); None where that graph has no such head."""
        head = self.heads.get((key, k))
        if head is None:
            return None
        head.replay()
        return self.head_outputs[(key, k)]

    def load(self, key: GraphKey, input_ids: torch.Tensor, positions: torch.Tensor,
             attn: AttentionMetadata, hidden: torch.Tensor | None = None) -> None:
        """Copy a step into the static buffers, padded to graph `key`'s size (the padding
        tokens' hidden rows are whatever an earlier step left: they write nothing)."""
        mixed, size, _ = key
        num_tokens, num_reqs = input_ids.shape[0], attn.seq_lens.shape[0]
        assert (hidden is None) == (self.hidden is None), \
            "a stage after the first, and only such a stage, takes the hidden states sent"
        if hidden is not None:
            self.hidden[:num_tokens].copy_(hidden)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(attn.slot_mapping)
        self.slot_mapping[num_tokens:size] = -1
        self.seq_lens[:num_reqs].copy_(attn.seq_lens)
        self.seq_lens[num_reqs:size] = 0
        self.block_tables[:num_reqs, :attn.block_tables.shape[1]].copy_(attn.block_tables)
        if mixed:
            self.mixed_starts[:num_reqs + 1].copy_(attn.query_start_loc)
            self.mixed_starts[num_reqs + 1:size + 1] = num_tokens

    def forward(self, key: GraphKey) -> torch.Tensor:
        """The model over the static buffers as graph `key` sees them."""
        mixed, size, span = key
        starts = self.mixed_starts if mixed else self.decode_starts
        attn = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size],
                                 starts[:size + 1], self.seq_lens[:size],
                                 max_query_len=size if mixed else 1, max_seq_len=span)
        return self.model(self.input_ids[:size], self.positions[:size],
                          ForwardContext(attn, self.kv_caches),
                          None if self.hidden is None else self.hidden[:size])

    def head(self, key: GraphKey, k: int) -> torch.Tensor:
        """Head k of decode graph `key` over that graph's output buffer."""
        return greedy_head(self.model.greedy_logits(self.outputs[key]), k)
