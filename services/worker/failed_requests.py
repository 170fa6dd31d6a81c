"""Requests the worker leaves out of its steps: those it could not start, because an image's
pixels had lapsed from Redis (common/image_blobs.py). The worker tells the scheduler
(RequestFailed), which ends them; but the scheduler plans steps ahead, so plans made before
it heard may still hold them. Such a request is left out of every plan until one lists it
as finished, and the rest of each batch runs as planned. A plan left with no request
still carries the state others dropped (`finished`): that goes with the next plan."""

from __future__ import annotations

import dataclasses
import itertools

from common.messages import StepPlan
from common.speculative import split_drafts


class FailedRequests:
    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.carried: list[str] = []  # `finished` of plans left empty

    def add(self, req_ids: list[str]) -> None:
        self.ids.update(req_ids)

    def strip(self, plan: StepPlan) -> StepPlan:
        """`plan` without the failed requests (and those its `finished` names are
        forgotten: the scheduler sends them no more)."""
        if self.carried:
            plan = dataclasses.replace(plan, finished=self.carried + plan.finished)
            self.carried = []
        if self.ids:
            plan = self._without(plan, self.ids)
            self.ids.difference_update(plan.finished)
        if not plan.req_ids and plan.finished:
            self.carried, plan = plan.finished, dataclasses.replace(plan, finished=[])
        return plan

    @staticmethod
    def _without(plan: StepPlan, ids: set[str]) -> StepPlan:
        keep = [i for i, req_id in enumerate(plan.req_ids) if req_id not in ids]
        if len(keep) == len(plan.req_ids):
            return plan
        drafts = split_drafts(plan.num_draft_tokens, plan.draft_token_ids,
                              len(plan.req_ids))
        kept = [drafts[i] for i in keep]
        return dataclasses.replace(
            plan, req_ids=[plan.req_ids[i] for i in keep],
            num_scheduled_tokens=[plan.num_scheduled_tokens[i] for i in keep],
            num_computed_tokens=[plan.num_computed_tokens[i] for i in keep],
            new=[new for new in plan.new if new.req_id not in ids],
            cached=[cached for cached in plan.cached if cached.req_id not in ids],
            num_draft_tokens=[len(d) for d in kept] if any(kept) else [],
            draft_token_ids=list(itertools.chain.from_iterable(kept)))
