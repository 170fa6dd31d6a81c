"""vLLM's /score and /rerank for embedding models, on the /v1/embeddings path: every
distinct text is embedded once, and a pair's score is the cosine similarity of its two
embeddings (vLLM's rule for embedding models). No I/O.

Cross-encoders (sequence-classification checkpoints, whose score is a classifier head
over the pair read together) are refused: this server pools embeddings only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from common.errors import ApiError
from services.gateway.protocol import (SCORING_UNSUPPORTED, EmbeddingJob, Limits,
                                      check_priority, refuse_unsupported,
                                      unknown_names, within)
from services.gateway.request_bodies import RerankRequest, ScoreRequest, validate
from services.gateway.response_bodies import (EmbeddingUsage, RerankResponse, RerankResult,
                                              RerankUsage, ScoreData, ScoreResponse)

CROSS_ENCODER_SUFFIX = "ForSequenceClassification"


def check_scorable(hf_config: Any, endpoint: str) -> None:
    """A 400 for a cross-encoder checkpoint, whose scores need its classifier head."""
    architectures = getattr(hf_config, "architectures", None) or []
    classifiers = [a for a in architectures if a.endswith(CROSS_ENCODER_SUFFIX)]
    if classifiers:
        raise ApiError(400, f"{endpoint} scores with embeddings (cosine similarity); this "
                            f"model is a cross-encoder ({classifiers[0]}), whose "
                            "classifier head this server does not run. Serve an embedding "
                            "model for /score and /rerank.")


@dataclass(slots=True)
class Pairs:
    """What a score or rerank call embeds (each distinct text once) and the pairs it
    scores, as indices into `job.inputs`."""
    job: EmbeddingJob
    pairs: list[tuple[int, int]]


def _pairs(req: ScoreRequest | RerankRequest, left: list[str], right: list[str],
           limits: Limits) -> Pairs:
    texts = list(dict.fromkeys(left + right))
    position = {text: i for i, text in enumerate(texts)}
    if not all(texts):
        raise ApiError(400, "texts to score must not be empty strings", "text_1")
    ignored = [name for name in unknown_names(req) if name not in SCORING_UNSUPPORTED]
    job = EmbeddingJob(req.model, list(texts), ignored=ignored, priority=req.priority or 0,
                       truncate_prompt_tokens=req.truncate_prompt_tokens)
    check_priority(job.priority)
    within("input", len(texts), limits.max_prompts_per_request, "distinct texts",
            "max-prompts-per-request")
    return Pairs(job, [(position[a], position[b]) for a, b in zip(left, right)])


def parse_score(body: Any, limits: Limits = Limits()) -> Pairs:
    """vLLM's pairing: one text_1 against every text_2, or text_1[i] with text_2[i]."""
    refuse_unsupported(body, SCORING_UNSUPPORTED)
    req = validate(ScoreRequest, body)
    left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if not left or not right:
        raise ApiError(400, "'text_1' and 'text_2' must each hold at least one text",
                       "text_1" if not left else "text_2")
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise ApiError(400, f"'text_1' has {len(left)} texts and 'text_2' {len(right)}: "
                            "give one text_1, or as many as text_2 (scored pairwise)",
                       "text_2")
    return _pairs(req, left, right, limits)


@dataclass(slots=True)
class Rerank:
    pairs: Pairs
    documents: list[str]
    top_n: int  # 0: all
    return_documents: bool


def parse_rerank(body: Any, limits: Limits = Limits()) -> Rerank:
    refuse_unsupported(body, SCORING_UNSUPPORTED)
    req = validate(RerankRequest, body)
    if not req.documents:
        raise ApiError(400, "'documents' must hold at least one document", "documents")
    documents = [d if isinstance(d, str) else d.text for d in req.documents]
    pairs = _pairs(req, [req.query] * len(documents), documents, limits)
    return Rerank(pairs, documents, req.top_n or 0, req.return_documents is not False)


def cosine(a: bytes, b: bytes) -> float:
    """The cosine similarity of two float32 embeddings (0 for an all-zero one)."""
    x, y = np.frombuffer(a, "<f4").astype(np.float64), np.frombuffer(b, "<f4").astype(
        np.float64)
    norms = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y) / norms if norms else 0.0


def scores(pairs: Pairs, embeddings: list[bytes]) -> list[float]:
    return [cosine(embeddings[a], embeddings[b]) for a, b in pairs.pairs]


def score_response(call_id: str, created: int, model: str, values: list[float],
                   prompt_tokens: int) -> ScoreResponse:
    return ScoreResponse(id=call_id, created=created, model=model,
                         data=[ScoreData(index=i, score=v) for i, v in enumerate(values)],
                         usage=EmbeddingUsage(prompt_tokens=prompt_tokens,
                                              total_tokens=prompt_tokens))


def rerank_response(call_id: str, model: str, rerank: Rerank, values: list[float],
                    prompt_tokens: int) -> RerankResponse:
    order = sorted(range(len(values)), key=lambda i: -values[i])  # stable: ties keep order
    if rerank.top_n:
        order = order[:rerank.top_n]
    results = [RerankResult(index=i, relevance_score=values[i],
                            document={"text": rerank.documents[i]}
                            if rerank.return_documents else None)
               for i in order]
    return RerankResponse(id=call_id, model=model, results=results,
                          usage=RerankUsage(total_tokens=prompt_tokens))
