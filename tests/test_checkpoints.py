"""Real checkpoints: lockstep's Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, GLM-4.5 and gpt-oss
match transformers' own
forward (fp32, atol 1e-4) on tiny random checkpoints made at test time, through the
paged KV cache with chunked prefill and decode, on 1 rank and on 2 and 4 EP ranks
(gloo, real all-to-alls); each rank reads only its own experts from the shards."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from services.engine_worker.batch import ChunkInput  # noqa: E402
from services.engine_worker.model import TorchModelRunner  # noqa: E402
from services.engine_worker.model.hf_config import HFConfig  # noqa: E402
from services.engine_worker.model.loader import Rows, read_config, tensor_files  # noqa: E402
from services.engine_worker.model.rope import inv_freq_and_scale  # noqa: E402
from tests.hf_checkpoints import make_checkpoint  # noqa: E402

ATOL = 1e-4
BLOCK = 4
ARCHS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "qwen2_moe", "glm4_moe", "gpt_oss"]


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {a: (root / a, make_checkpoint(root / a, a)) for a in ARCHS}
    # Qwen3 with a dense layer (mlp_only_layers) and YaRN rope scaling, Mixtral with llama3-style scaling
    out["qwen3_moe_dense_yarn"] = (root / "qy", make_checkpoint(
        root / "qy", "qwen3_moe", layers=3, mlp_only_layers=[1],
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}))
    out["mixtral_linear"] = (root / "ml", make_checkpoint(
        root / "ml", "mixtral", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    # DeepSeek-V2 as V2 itself is configured: low-rank queries, group-limited routing, YaRN with mscale
    out["deepseek_v2_full"] = (root / "dv", make_checkpoint(
        root / "dv", "deepseek_v2", layers=3, q_lora_rank=12, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}))
    # DeepSeek-V3 with its rotary dimensions in halves, not interleaved pairs
    out["deepseek_v3_halves"] = (root / "d3h", make_checkpoint(root / "d3h", "deepseek_v3", rope_interleave=False))
    return out


@pytest.mark.parametrize("name", ARCHS + ["qwen3_moe_dense_yarn", "mixtral_linear", "deepseek_v2_full",
                                          "deepseek_v3_halves"])
def test_one_rank_chunked_prefill_and_decode_match_transformers(checkpoints, name):
    path, ref = checkpoints[name]
    runner = TorchModelRunner.from_pretrained(str(path), 0, 1, num_kv_blocks=24, block_size=BLOCK)
    assert runner.dtype == torch.float32
    vocab = ref.config.vocab_size
    prompt = _prompt(vocab, 21, 1)
    want = reference_logits(ref, prompt)
    table = [9, 2, 17, 11, 5, 20]                       # non-contiguous blocks for 24 positions
    other = _prompt(vocab, 5, 2)
    # chunked prefill 0..8 then 9..17 beside another sequence, then decode 18, 19, 20
    got = runner.logits([ChunkInput("s", prompt[:9], 0, table, False)])
    torch.testing.assert_close(got["s"], want[8], atol=ATOL, rtol=0)
    got = runner.logits([ChunkInput("o", other, 0, [1, 3], False), ChunkInput("s", prompt[9:18], 9, table, False)])
    torch.testing.assert_close(got["s"], want[17], atol=ATOL, rtol=0)
    torch.testing.assert_close(got["o"], reference_logits(ref, other)[-1], atol=ATOL, rtol=0)
    for p in range(18, 21):
        got = runner.logits([ChunkInput("s", [prompt[p]], p, table, True)])
        torch.testing.assert_close(got["s"], want[p], atol=ATOL, rtol=0)


def test_config_reading_and_the_memory_it_implies(checkpoints):
    path, ref = checkpoints["qwen3_moe_dense_yarn"]
    cfg = read_config(path)
    assert (cfg.architecture, cfg.n_kv_heads, cfg.head_dim, cfg.dense_layers) == ("qwen3_moe", 2, 16, {1})
    assert cfg.rope["rope_type"] == "yarn" and cfg.norm_topk_prob
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert list(cfg.eos_token_ids) == eos and len(eos) == 2      # generation_config.json wins
    assert len({f for f in tensor_files(path).values()}) > 1       # sharded: loaded through the index
    n_params = sum(p.numel() for p in ref.parameters())
    one, four = cfg.param_bytes(1, 4), cfg.param_bytes(4, 4)
    assert one["shared"] + one["experts"] == 4 * n_params
    assert four["experts"] * 4 == one["experts"] and four["shared"] == one["shared"]
    for name in ARCHS + ["deepseek_v2_full"]:      # the memory formula counts every parameter
        p, m = checkpoints[name]
        b = read_config(p).param_bytes(1, 2)
        assert b["shared"] + b["experts"] == 2 * sum(t.numel() for t in m.parameters()), name
    with pytest.raises(ValueError, match="not divisible"):
        cfg.experts_of_rank(0, 3)
    with pytest.raises(ValueError, match="not supported"):
        HFConfig.from_dict({**json.loads((path / "config.json").read_text()), "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
])
def test_rope_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=131072,
                      rope_parameters=dict(rope))
    ours, scale = inv_freq_and_scale(rope, 64)
    if rope["rope_type"] == "default":
        want = 1.0 / rope["rope_theta"] ** (torch.arange(0, 64, 2).float() / 64)
        want_scale = 1.0
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    torch.testing.assert_close(ours, want.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)


def test_bf16_forward_is_close_to_fp32(checkpoints):
    path, ref = checkpoints["qwen3_moe"]
    prompt = _prompt(ref.config.vocab_size, 12, 3)
    r16 = TorchModelRunner.from_pretrained(str(path), 0, 1, 8, BLOCK, dtype=torch.bfloat16)
    assert r16.model.embed_tokens.dtype == torch.bfloat16 and r16.cache.data.dtype == torch.bfloat16
    got = r16.logits([ChunkInput("s", prompt, 0, [0, 1, 2], False)])["s"]
    want = reference_logits(ref, prompt)[-1]
    assert (got - want).abs().max() < 0.05 * want.abs().max()      # bf16 rounding, not a different model


# ---------------------------------------------------------------- expert parallel ranks

def _ep_worker(rank: int, world: int, port: int, paths: dict[str, str], out_dir: str) -> None:
    try:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        pair = dist.new_group([0, 1])
        out = {}
        for name, path in paths.items():
            for w, group in ((world, None), (2, pair)):
                if rank >= w:
                    continue
                runner = TorchModelRunner.from_pretrained(path, rank, w, 16, BLOCK, group=group)
                vocab = runner.config.vocab_size
                prompt = _prompt(vocab, 10 + 3 * rank, 100 + rank)
                table = list(range(15, -1, -1))
                steps = [runner.logits([ChunkInput("s", prompt[:6], 0, table, False)]),
                         runner.logits([ChunkInput("s", prompt[6:], 6, table, True)]),
                         # rank 0 idle: it still joins every all-to-all (the idle forward)
                         runner.logits([] if rank == 0 else [ChunkInput("s", [7], len(prompt), table, True)])]
                experts = _experts_read(runner.model.weight_names())
                out[(name, w)] = {"prompt": prompt, "logits": [s.get("s") for s in steps], "experts": experts,
                                  "read": runner.model.bytes_read}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _experts_read(targets: dict) -> list[int]:
    """The experts a rank reads: by name (experts.<e>.<proj>), or the rows of a fused tensor (gpt-oss)."""
    out: set[int] = set()
    for name, t in targets.items():
        if ".experts." in name:
            out.update(range(t.start, t.stop) if isinstance(t, Rows) else [int(name.split(".")[5])])
    return sorted(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_and_four_ep_ranks_match_transformers(checkpoints, tmp_path):
    names = ["qwen3_moe", "mixtral", "olmoe", "qwen3_moe_dense_yarn", "deepseek_v2_full", "deepseek_v3", "qwen2_moe",
             "glm4_moe", "gpt_oss"]
    paths = {n: str(checkpoints[n][0]) for n in names}
    world = 4
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_ep_worker, args=(r, world, port, paths, str(tmp_path)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + 240
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errs = [f.read_text() for f in tmp_path.glob("*.err")]
    assert not errs, "\n".join(errs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name in names:
        ref = checkpoints[name][1]
        for w in (world, 2):
            full = {}
            for r in range(w):
                got = results[r][(name, w)]
                prompt = got["prompt"]
                want = reference_logits(ref, prompt + [7])
                torch.testing.assert_close(got["logits"][0], want[5], atol=ATOL, rtol=0)
                torch.testing.assert_close(got["logits"][1], want[len(prompt) - 1], atol=ATOL, rtol=0)
                if r:
                    torch.testing.assert_close(got["logits"][2], want[len(prompt)], atol=ATOL, rtol=0)
                else:
                    assert got["logits"][2] is None
                per = 8 // w
                assert got["experts"] == list(range(r * per, (r + 1) * per))   # only its own experts
                full[r] = got["read"]
            # every rank reads the same shared weights and an equal share of the experts
            assert len(set(full.values())) == 1
        assert results[0][(name, 4)]["read"] < results[0][(name, 2)]["read"]


@pytest.mark.slow
def test_bench_reports_steps_and_collective_share_for_a_checkpoint(checkpoints, capsys):
    from services.engine_worker.model import decode_bench

    path = str(checkpoints["mixtral"][0])
    assert decode_bench.main(["--model", path, "--ranks", "2", "--seqs", "4", "--prompt-len", "8", "--steps", "3",
                       "--warmup", "1", "--idle-steps", "2", "--json", "--timeout", "120"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == path and out["ranks"] == 2
    assert out["steps_per_s"] > 0 and 0 < out["collective_share_median"] < 1
    assert out["all_to_all_calls_per_step"] == 3 * 2          # 3 per MoE layer, 2 layers


def _fp8_tiles(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as DeepSeek's FP8 checkpoints hold it: e4m3 values and one scale per tile."""
    rows, cols = t.shape
    br, bc = block
    pr, pc = -(-rows // br) * br, -(-cols // bc) * bc
    padded = torch.zeros(pr, pc)
    padded[:rows, :cols] = t.float()
    tiles = padded.view(pr // br, br, pc // bc, bc)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).view(pr, pc)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def test_a_block_scaled_fp8_checkpoint_is_dequantized_on_load(checkpoints, tmp_path):
    # DeepSeek-V3's (and Qwen3's -FP8) checkpoints: e4m3 weights, one float scale per tile
    # (weight_scale_inv). Read without the scales, every value is off by its tile's scale.
    import shutil

    from safetensors.torch import load_file, save_file

    src, _ = checkpoints["deepseek_v3"]
    block = (4, 8)            # partial tiles at the edges too (e.g. 12 x 32, 48 x 32)
    fp8, plain = tmp_path / "fp8", tmp_path / "dequantized"
    shutil.copytree(src, fp8)
    shutil.copytree(src, plain)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    quantized = 0
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(src / shard))
        q_out, d_out = dict(tensors), dict(tensors)
        for name, t in tensors.items():
            if t.dim() == 2 and name.endswith(".weight") and "embed" not in name and "lm_head" not in name \
                    and not name.endswith("mlp.gate.weight"):
                q, scale = _fp8_tiles(t, block)
                q_out[name], q_out[name + "_scale_inv"] = q, scale
                index["weight_map"][name + "_scale_inv"] = shard
                d_out[name] = q.float() * scale.repeat_interleave(block[0], 0)[:t.shape[0]].repeat_interleave(
                    block[1], 1)[:, :t.shape[1]]
                quantized += 1
        save_file(q_out, str(fp8 / shard))
        save_file(d_out, str(plain / shard))
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    assert quantized > 10 and read_config(fp8).fp8_block == block

    prompt = _prompt(cfg["vocab_size"], 9, 3)
    logits = {}
    for name, path in (("fp8", fp8), ("plain", plain)):
        runner = TorchModelRunner.from_pretrained(str(path), 0, 1, num_kv_blocks=8, block_size=BLOCK)
        logits[name] = runner.logits([ChunkInput("s", prompt, 0, [0, 1, 2], False)])["s"]
    torch.testing.assert_close(logits["fp8"], logits["plain"], atol=ATOL, rtol=0)
    # other quantizations are refused at the config, with what to use instead
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with pytest.raises(ValueError, match="'awq'.*not supported"):
        HFConfig.from_dict(cfg)


def test_an_fp8_tensor_without_its_scale_is_refused(tmp_path):
    from safetensors.torch import save_file

    from services.engine_worker.model.loader import load_weights
    w = torch.ones(4, 4).to(torch.float8_e4m3fn)
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="FP8 without a block scale"):
        load_weights({"w": torch.empty(4, 4)}, tmp_path, fp8_block=(2, 2))   # a config with a tile, no scale
    with pytest.raises(ValueError, match="FP8 without a block scale"):
        load_weights({"w": torch.empty(4, 4)}, tmp_path)                     # no tile in the config
    save_file({"w": w, "w_scale_inv": torch.full((2, 2), 0.5)}, str(tmp_path / "model.safetensors"))
    out = torch.empty(4, 4)
    load_weights({"w": out}, tmp_path, fp8_block=(2, 2))
    assert torch.equal(out, torch.full((4, 4), 0.5))


def test_gpt_oss_windows_and_sinks_are_what_makes_it_match(checkpoints):
    # gpt-oss's alternate layers see only the last sliding_window positions, and every head's
    # softmax has a sink logit: without either, the same weights give other logits.
    path, ref = checkpoints["gpt_oss"]
    cfg = read_config(path)
    assert cfg.sliding_layers == {0} and cfg.sliding_window == 6 and cfg.max_position == 512   # not capped
    assert cfg.attn_sinks and cfg.qkv_bias and cfg.o_bias
    prompt = _prompt(ref.config.vocab_size, 14, 5)
    want = reference_logits(ref, prompt)[-1]

    def last_logits(change=None) -> torch.Tensor:
        runner = TorchModelRunner.from_pretrained(str(path), 0, 1, num_kv_blocks=8, block_size=BLOCK)
        if change:
            change(runner.model.layers[0].self_attn)
        return runner.logits([ChunkInput("s", prompt, 0, [0, 1, 2, 3], False)])["s"]

    torch.testing.assert_close(last_logits(), want, atol=ATOL, rtol=0)
    assert (last_logits(lambda a: setattr(a, "window", 0)) - want).abs().max() > 1e-2
    assert (last_logits(lambda a: a.sinks.data.fill_(-1e9)) - want).abs().max() > 1e-2


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] as gpt-oss's checkpoints hold it: FP4 codes two to a byte (low nibble
    first) in blocks of 32 along ``in``, and one power-of-two scale per block (biased by 127)."""
    from services.engine_worker.model.loader import FP4_VALUES

    E, rows, cols = w.shape
    g = w.reshape(E, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0))
    lut = torch.tensor(FP4_VALUES)
    codes = ((g / torch.exp2(exp)[..., None])[..., None] - lut).abs().argmin(-1).to(torch.uint8)   # nearest value
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def test_a_gpt_oss_mxfp4_checkpoint_is_dequantized_as_transformers_does(tmp_path):
    # gpt-oss ships its experts in MXFP4: <name>_blocks and <name>_scales in place of <name>.
    # Read with transformers' own dequantization as the reference, so the layout (nibble
    # order, the scales' bias, the transpose) is theirs, not our guess of it.
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from services.engine_worker.model.loader import build_model, load_weights
    from services.engine_worker.model.moe import AllToAll

    src = tmp_path / "plain"
    ref = make_checkpoint(src, "gpt_oss", intermediate_size=64)           # both matrices' inputs: 32 x k
    tensors = {}
    for shard in sorted(set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values())):
        tensors.update(load_file(str(src / shard)))
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (packed / f.name).write_bytes(f.read_bytes())
    out, quantized = {}, 0
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _mxfp4(t.transpose(1, 2))
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
            with torch.no_grad():     # the reference model runs the same dequantized values
                ref.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            quantized += 1
        else:
            out[name] = t
    save_file(out, str(packed / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                   "model.layers.*.mlp.router",
                                                                                   "model.embed_tokens", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(cfg))
    assert quantized == 4 and read_config(packed).mxfp4

    prompt = _prompt(cfg["vocab_size"], 11, 4)
    runner = TorchModelRunner.from_pretrained(str(packed), 0, 1, num_kv_blocks=8, block_size=BLOCK)
    got = runner.logits([ChunkInput("s", prompt, 0, [0, 1, 2], False)])["s"]
    torch.testing.assert_close(got, reference_logits(ref, prompt)[-1], atol=ATOL, rtol=0)
    # an EP rank dequantizes only its own experts' rows
    rank1 = build_model(read_config(packed), 1, 2, AllToAll(), torch.float32, "cpu")
    load_weights(rank1.weight_names(), packed, mxfp4=True)
    torch.testing.assert_close(rank1.layers[1].mlp.experts.down_proj.data,
                               ref.get_parameter("model.layers.1.mlp.experts.down_proj")[4:].float(), atol=0, rtol=0)
    # MXFP4 is gpt-oss's own format: on another architecture it is refused at the config
    other = {**cfg, "architectures": ["MixtralForCausalLM"]}
    with pytest.raises(ValueError, match="'mxfp4'.*not supported"):
        HFConfig.from_dict(other)
