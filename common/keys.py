"""Every Redis name headrace uses, in one place.

Streams that every GPU shard shares (client requests, token batches for the detokenizers,
each gateway's replies, dead letters) have plain names. What belongs to one shard (its
admissions, plans, results, control messages, liveness and stats) is named by a function of
the shard whose names carry a hash tag, `hr:{s0}:steps`, so a Redis Cluster keeps one
shard's keys in one slot and spreads the shards over its nodes.
"""

from __future__ import annotations

import re

PATTERN = "hr:*"
REQUESTS = "hr:requests"  # gateway -> tokenizers
DETOK = "hr:detok"  # schedulers -> detokenizers
DEAD = "hr:dead"  # entries no stage could decode or handle, with the reason
LORA_ADAPTERS = "hr:lora:adapters"  # hash: every gateway's LoRA adapters, name -> JSON
LORA_IDS = "hr:lora:ids"  # counter: the last lora_int_id given to an adapter
HEALTH_PATTERN = "hr:health:*"


def health(process: str) -> str:
    """hash: a process's recent stalls (common/stalls.py), for `headrace queues`"""
    return f"hr:health:{process}"


def image(content_hash: str) -> str:
    """An image's pixels, by its content hash (common/image_blobs.py)."""
    return f"hr:image:{content_hash}"


def replies(gateway_id: str) -> str:
    """detokenizers and any stage's errors -> one gateway"""
    return f"hr:replies:{gateway_id}"


def alive_gateway(gateway_id: str) -> str:
    """A gateway's liveness: once it lapses, the schedulers end its requests."""
    return f"hr:alive:gateway:{gateway_id}"


def shard_of(name: str) -> int | None:
    """The shard a key belongs to, None for the keys every shard shares."""
    found = _SHARD_KEY.match(name)
    return int(found[1]) if found else None


_SHARD_KEY = re.compile(r"hr:\{s(\d+)\}:")


def _shard(shard: int) -> str:
    if shard < 0:
        raise ValueError(f"a shard is a non-negative integer, got {shard}")
    return f"hr:{{s{shard}}}"


def admit(shard: int = 0) -> str:
    """tokenizers -> the shard's scheduler: tokenized, validated requests"""
    return f"{_shard(shard)}:admit"


def control(shard: int = 0) -> str:
    """gateways (client gone) and detokenizers (stop string) -> the shard's scheduler"""
    return f"{_shard(shard)}:control"


def steps(shard: int = 0) -> str:
    """scheduler -> worker: step plans"""
    return f"{_shard(shard)}:steps"


def results(shard: int = 0) -> str:
    """worker -> scheduler: sampled tokens and the worker's announcements"""
    return f"{_shard(shard)}:results"


def alive_scheduler(shard: int = 0) -> str:
    return f"{_shard(shard)}:alive:scheduler"


def alive_worker(shard: int = 0) -> str:
    return f"{_shard(shard)}:alive:worker"


def worker_ready(shard: int = 0) -> str:
    """The running worker's WorkerReady, for a scheduler that starts after it."""
    return f"{_shard(shard)}:worker:ready"


def worker_failed(shard: int = 0) -> str:
    """The shard's WorkerFailed while its worker cannot load the model, for the gateways'
    503s and /health."""
    return f"{_shard(shard)}:worker:failed"


def scheduler_stats(shard: int = 0) -> str:
    return f"{_shard(shard)}:stats:scheduler"


def stored_response(response_id: str) -> str:
    """gateways -> gateways: a stored /v1/responses answer (common.messages.StoredResponse),
    dropped after its TTL."""
    return f"hr:response:{response_id}"
