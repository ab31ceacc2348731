"""TorchModelRunner: runs one step's chunks through the sharded MoE model on this rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from services.engine_worker.batch import ChunkInput
from services.engine_worker.model.config import MoEConfig
from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.kv_cache import PagedKVCache, build_layout
from services.engine_worker.model.loader import load_model, read_config
from services.engine_worker.model.model import MoETransformer
from services.engine_worker.model.moe import AllToAll
from services.engine_worker.model.sampler import RowExtra, logprobs, sample


class TorchModelRunner:
    """One DP rank's model: replicated attention/embeddings/router/norms, this rank's
    share of the experts, and this rank's own paged KV cache.

    With world_size > 1 the caller has already initialized ``torch.distributed`` (gloo on
    CPU, NCCL for cuda); ``group`` (None = the default group) must contain exactly the
    ``world_size`` ranks of the EP group, and ``rank`` is this process's rank within it.
    Every ``run`` (including the idle ``run([])``) makes 3 all-to-alls per layer, so all
    ranks of the group must call ``run``/``logits`` the same number of times, in step.

    Inputs are validated before the first collective; a ValueError on one rank leaves its
    peers waiting in the collective until the group's timeout, so the engine's scheduler
    must only hand over chunks it has validated (these checks are a safety net).
    """

    grammar_vocab: Any = None   # a checkpoint's tokens for structured output (factory.py); None: bytes

    def __init__(self, config: MoEConfig | HFConfig, rank: int, world_size: int, num_kv_blocks: int,
                 block_size: int, device: str = "cpu", group=None, model_dir: str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        torch.set_num_threads(1)  # several ranks share a few CPU cores
        config.experts_of_rank(rank, world_size)  # validates rank and the expert split
        if world_size > 1:
            if not dist.is_initialized():
                raise RuntimeError("world_size > 1 needs torch.distributed initialized first")
            if dist.get_world_size(group) != world_size:
                raise ValueError(f"process group has {dist.get_world_size(group)} ranks, not {world_size}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.block_size = block_size
        self.comm = AllToAll(group) if world_size > 1 else None
        if isinstance(config, HFConfig):
            # A real checkpoint: this rank reads the shared weights and its own experts only.
            if model_dir is None:
                raise ValueError("an HFConfig needs the checkpoint's model_dir")
            self.model = load_model(model_dir, config, rank, world_size, self.comm, dtype, self.device)
        else:
            self.model = MoETransformer(config, rank, world_size, self.comm, self.device).eval()
            dtype = torch.float32
        self.dtype = dtype
        self.cache = PagedKVCache(config, num_kv_blocks, block_size, self.device, dtype)

    @classmethod
    def from_pretrained(cls, model_dir: str, rank: int, world_size: int, num_kv_blocks: int, block_size: int,
                        device: str = "cpu", group=None, dtype: torch.dtype | None = None) -> "TorchModelRunner":
        """A runner for the checkpoint in ``model_dir`` (bf16 on CUDA, fp32 on CPU unless told)."""
        if dtype is None:
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        return cls(read_config(model_dir), rank, world_size, num_kv_blocks, block_size, device, group,
                   model_dir=model_dir, dtype=dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a sequence (the checkpoint's generation config; the bundled model's EOS)."""
        if isinstance(self.config, HFConfig):
            return self.config.eos_token_ids
        from shared.tokenizer import EOS
        return (EOS,)

    @property
    def local_experts(self) -> range:
        return self.config.experts_of_rank(self.rank, self.world_size)

    @property
    def comm_seconds(self) -> float:
        """Wall time spent inside all-to-all calls since construction (includes waiting
        for slower peers: in lockstep that wait is part of the collective)."""
        return self.comm.seconds if self.comm else 0.0

    @property
    def comm_calls(self) -> int:
        return self.comm.calls if self.comm else 0

    @torch.inference_mode()
    def _last_hidden(self, chunks: list[ChunkInput]) -> torch.Tensor:
        """Forward the whole batch (writing K/V); hidden state of each chunk's last token."""
        hidden, layout = self._hidden(chunks)
        return hidden[layout.last_index]

    @torch.inference_mode()
    def _hidden(self, chunks: list[ChunkInput]) -> tuple[torch.Tensor, object]:
        """Forward the whole batch (writing K/V); every token's hidden state, and the layout."""
        seen: set[str] = set()
        for c in chunks:
            if c.seq_id in seen:
                raise ValueError(f"sequence {c.seq_id!r} appears twice in one batch")
            seen.add(c.seq_id)
            if any(not 0 <= t < self.config.vocab_size for t in c.token_ids):
                raise ValueError(f"chunk of {c.seq_id!r} has a token outside 0..{self.config.vocab_size - 1}")
        layout = build_layout(chunks, self.block_size, self.cache.num_blocks, self.config.max_position,
                              self.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        hidden = self.model(ids, layout, self.cache)
        return hidden, layout

    def run(self, chunks: list[ChunkInput], extras: dict[str, RowExtra] | None = None) -> dict[str, int]:
        """Compute the chunks (prefill and decode mixed), writing their K/V into the paged
        cache, and return {seq_id: next_token} for chunks with sample=True.
        ``extras`` adds top_k, min_p and penalties to the sequences it names (sampler.py).
        ``run([])`` is an idle forward: zero tokens, but it joins every collective."""
        last = self._last_hidden(chunks)
        picked = [i for i, c in enumerate(chunks) if c.sample]
        if not picked:
            return {}
        with torch.inference_mode():
            logits = self.model.compute_logits(last[picked])
        sel = [chunks[i] for i in picked]
        tokens = sample(logits, [c.temperature for c in sel], [c.top_p for c in sel],
                        [c.seed for c in sel], [c.context_len for c in sel],
                        [extras.get(c.seq_id) for c in sel] if extras else None)
        return {c.seq_id: t for c, t in zip(sel, tokens)}

    def run_logprobs(self, chunks: list[ChunkInput], extras: dict[str, RowExtra] | None,
                     want: dict[str, tuple[int | None, int | None, list[int]]]
                     ) -> tuple[dict[str, int], dict[str, list], dict[str, tuple[int, list]]]:
        """``run`` plus logprobs for the sequences in ``want`` (seq id -> (k for the sampled
        token or None, k for prompt tokens or None, the prompt)): (tokens, {id: entry of
        the sampled token}, {id: (first prompt position, entries)}) with entries as in
        sampler.logprobs, all from the logits this step computed."""
        hidden, layout = self._hidden(chunks)
        rows = layout.last_index.tolist()
        picked = [i for i, c in enumerate(chunks) if c.sample]
        tokens: dict[str, int] = {}
        tok_lp: dict[str, list] = {}
        prompt_lp: dict[str, tuple[int, list]] = {}
        with torch.inference_mode():
            if picked:
                logits = self.model.compute_logits(hidden[[rows[i] for i in picked]])
                sel = [chunks[i] for i in picked]
                got = sample(logits, [c.temperature for c in sel], [c.top_p for c in sel],
                             [c.seed for c in sel], [c.context_len for c in sel],
                             [extras.get(c.seq_id) for c in sel] if extras else None)
                tokens = {c.seq_id: t for c, t in zip(sel, got)}
                lp_rows = [j for j, c in enumerate(sel) if want.get(c.seq_id, (None,))[0] is not None]
                if lp_rows:
                    entries = logprobs(logits[lp_rows], [got[j] for j in lp_rows],
                                       [want[sel[j].seq_id][0] for j in lp_rows])
                    tok_lp = {sel[j].seq_id: e for j, e in zip(lp_rows, entries)}
            for c, last in zip(chunks, rows):
                w = want.get(c.seq_id)
                if w is None or w[1] is None:
                    continue
                prompt = w[2]
                # row q (absolute position start+r) predicts the token at q+1; prompt tokens only
                n = min(c.num_tokens, len(prompt) - 1 - c.start_pos)
                if n <= 0:
                    continue
                first = last - c.num_tokens + 1
                lg = self.model.compute_logits(hidden[first:first + n])
                targets = prompt[c.start_pos + 1:c.start_pos + 1 + n]
                prompt_lp[c.seq_id] = (c.start_pos + 1, logprobs(lg, targets, [w[1]] * n))
        return tokens, tok_lp, prompt_lp

    def logits(self, chunks: list[ChunkInput]) -> dict[str, torch.Tensor]:
        """Like ``run`` (it writes K/V too, and joins the collectives) but returns every
        chunk's last-position logits, float32 on CPU. For tests and debugging."""
        last = self._last_hidden(chunks)
        with torch.inference_mode():
            logits = self.model.compute_logits(last).float().cpu()
        return {c.seq_id: logits[i].clone() for i, c in enumerate(chunks)}

    def free_seq(self, seq_id: str) -> None:
        """No per-sequence state lives here: KV blocks belong to the engine's block manager."""
