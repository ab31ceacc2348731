"""One step's forward: the torch model (in a thread, with logprobs and sampling extras when
asked) or the sim backend, whose step lasts as long as the busiest rank's modeled forward."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.engine_worker.lockstep import Action, StepView
from services.engine_worker.rank_state import RankState
from shared.cost_model import CostModel
from shared.settings import EngineSettings


class Forward:
    """Writes ``state.idle_forwards`` and the requests' logprobs."""

    def __init__(self, settings: EngineSettings, state: RankState, cost: CostModel) -> None:
        self.s, self.state, self.cost = settings, state, cost

    async def run(self, plan: Any, action: Action, view: StepView) -> dict[str, int]:
        st = self.state
        t0 = time.perf_counter()
        if self.s.backend == "torch":
            chunks = plan.chunks if action is Action.RUN else []
            want = st.lp.wants(chunks)
            extras = sampling_extras(st.core, chunks, st.guides.masks(chunks, st.core.get))
            if want:
                sampled, tok_lp, prompt_lp = await asyncio.to_thread(st.backend.run_logprobs, chunks, extras, want)
                st.lp.add(tok_lp, prompt_lp)
            else:
                sampled = await asyncio.to_thread(st.backend.run, chunks, extras)
        else:
            sampled = st.backend.run(plan.chunks, st.prompts, st.eos_from,
                                     st.guides.masks(plan.chunks, st.core.get)) if action is Action.RUN else {}
            want = st.lp.wants(plan.chunks) if action is Action.RUN else None
            if want:
                st.lp.add(*st.backend.logprobs(plan.chunks, sampled, st.prompts, want))
            # Lockstep: the step lasts as long as the busiest rank's modeled forward (plus
            # the cost model's shared term, which follows the ranks' mean).
            mean = view.mean_tokens if self.cost.shared_token_ms else 0.0
            modeled_s = self.cost.step_ms(view.max_tokens, view.max_ctx, mean) * self.s.time_scale / 1000
            left = modeled_s - (time.perf_counter() - t0)
            if left > 0:
                await asyncio.sleep(left)
        if action is Action.IDLE:
            st.idle_forwards += 1
        return sampled


def sampling_extras(core: Any, chunks: list[Any], masks: dict[str, bytes] | None = None) -> dict[str, Any] | None:
    """top_k, min_p, penalties, logit_bias and min_tokens' masking of the sampled sequences
    that ask for them (torch only); None, the common case, when none does."""
    from services.engine_worker.model.sampler import RowExtra
    from shared.tokenizer import EOS
    out: dict[str, Any] = {}
    for c in chunks:
        if not c.sample:
            continue
        seq = core.get(c.seq_id)
        if seq is None:
            continue
        p = seq.params
        early = len(seq.generated) < p.min_tokens
        mask = masks.get(c.seq_id) if masks else None
        if p.top_k > 0 or p.min_p > 0 or p.penalized or p.logit_bias or early or mask is not None:
            # before min_tokens neither EOS (unless ignored) nor a stop token may be drawn
            suppress = ([] if p.ignore_eos else [EOS]) + list(p.stop_token_ids) if early else []
            out[c.seq_id] = RowExtra(p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
                                     p.repetition_penalty, list(seq.prompt) if p.penalized else [],
                                     list(seq.generated) if p.penalized else [], p.logit_bias, suppress, mask)
    return out or None
