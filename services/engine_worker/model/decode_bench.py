"""Decode-step benchmark of the expert-parallel model on gloo CPU ranks.

    python -m services.engine_worker.model.decode_bench --ranks 2 [--seqs 32] [--steps 40] [--json]
    python -m services.engine_worker.model.decode_bench --model DIR --ranks 2   # a loaded checkpoint

Each rank prefills ``--seqs`` prompts, then runs greedy decode steps of one token per
sequence. Before each timed step the ranks meet at a barrier (not timed), so a step's time
is the forward itself; the lockstep step time is the slowest rank's. The collective share
is the time inside ``all_to_all_single`` ÷ the rank's step time (it includes waiting for
slower peers, which in lockstep is what a collective costs). A second phase has rank 0
decode alone while every other rank runs the idle forward ``run([])``. Figures are medians.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta


def _phase(runner, dist, steps: int, make_chunks, feed) -> list[tuple[float, float]]:
    """[(step seconds, collective seconds)] of this rank, one per step."""
    out = []
    for _ in range(steps):
        chunks = make_chunks()
        dist.barrier()
        c0, t0 = runner.comm_seconds, time.perf_counter()
        got = runner.run(chunks)
        out.append((time.perf_counter() - t0, runner.comm_seconds - c0))
        feed(got)
    return out


def _worker(rank: int, args: argparse.Namespace, port: int, results) -> None:
    try:
        import torch.distributed as dist

        from services.engine_worker.batch import ChunkInput
        from services.engine_worker.model import MoEConfig, TorchModelRunner

        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=args.ranks, timeout=timedelta(seconds=120))
        bs = args.block_size
        blocks_per_seq = -(-(args.prompt_len + args.warmup + args.steps + args.idle_steps + 1) // bs)
        if args.model:
            import torch
            dtype = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
            device = f"cuda:{rank}" if args.device == "cuda" else "cpu"   # one GPU per rank
            runner = TorchModelRunner.from_pretrained(args.model, rank, args.ranks, args.seqs * blocks_per_seq, bs,
                                                      device=device, dtype=dtype)
        else:
            runner = TorchModelRunner(MoEConfig(), rank, args.ranks, args.seqs * blocks_per_seq, bs)
        vocab = runner.config.vocab_size if args.model else 256
        tables = {f"s{i}": list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(args.seqs)}
        toks = {s: [(17 * i + 31 * rank + j) % vocab for j in range(args.prompt_len)]
                for i, s in enumerate(tables)}
        runner.run([ChunkInput(s, toks[s], 0, tables[s], True, temperature=0.0) for s in tables])  # prefill
        for s in toks:
            toks[s].append(0)

        def decode_all():
            return [ChunkInput(s, [toks[s][-1]], len(toks[s]) - 1, tables[s], True, temperature=0.0) for s in tables]

        def feed(got):
            for s, t in got.items():
                toks[s].append(t)

        _phase(runner, dist, args.warmup, decode_all, feed)
        calls0 = runner.comm_calls
        busy = _phase(runner, dist, args.steps, decode_all, feed)
        calls_per_step = (runner.comm_calls - calls0) / max(1, args.steps)
        idle = _phase(runner, dist, args.idle_steps, decode_all if rank == 0 else list, feed)
        gathered = [None] * args.ranks
        dist.all_gather_object(gathered, {"busy": busy, "idle": idle, "calls_per_step": calls_per_step})
        if rank == 0:
            results.put(("ok", gathered))
        dist.destroy_process_group()
    except BaseException:
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


def _summarize(args: argparse.Namespace, per_rank: list[dict]) -> dict:
    med = statistics.median
    steps = len(per_rank[0]["busy"])
    step_s = [max(r["busy"][i][0] for r in per_rank) for i in range(steps)]        # lockstep: slowest rank
    share = [statistics.fmean(r["busy"][i][1] / r["busy"][i][0] for r in per_rank) for i in range(steps)]
    comm_ms = [statistics.fmean(r["busy"][i][1] for r in per_rank) * 1e3 for i in range(steps)]
    n_idle = len(per_rank[0]["idle"])
    out = {
        "model": args.model or "random",
        "ranks": args.ranks,
        "seqs_per_rank": args.seqs,
        "context_tokens": args.prompt_len,
        "steps": steps,
        "step_ms_median": med(step_s) * 1e3,
        "steps_per_s": 1.0 / med(step_s),
        "decode_tokens_per_s": args.ranks * args.seqs / med(step_s),
        "collective_ms_median": med(comm_ms),
        "collective_share_median": med(share),
        "all_to_all_calls_per_step": per_rank[0]["calls_per_step"],
    }
    if n_idle and args.ranks > 1:
        out["one_busy_rank_step_ms_median"] = med([max(r["idle"][i][0] for r in per_rank) for i in range(n_idle)]) * 1e3
        out["idle_forward_ms_median"] = med([r["idle"][i][0] for r in per_rank[1:] for i in range(n_idle)]) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.engine_worker.model.decode_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, choices=[1, 2, 4, 8])
    p.add_argument("--seqs", type=int, default=32, help="decode sequences per rank")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--idle-steps", type=int, default=20)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--model", default="", help="a local Hugging Face checkpoint directory, e.g. services/engine_worker/model/bundled (default: seeded random weights of that shape)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, args, port, results), daemon=True) for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    try:
        status, payload = results.get(timeout=args.timeout)
    except Exception:
        status, payload = "error", f"no result within {args.timeout}s"
    for pr in procs:
        pr.join(10)
        if pr.is_alive():
            pr.kill()
    if status != "ok":
        print(payload, file=sys.stderr)
        return 1
    summary = _summarize(args, payload)
    if args.json:
        print(json.dumps(summary))
    else:
        width = max(map(len, summary))
        for k, v in summary.items():
            print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
