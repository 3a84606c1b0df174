"""Train the demo pair ddtree ships as its built-in model: a small Kimi-K2-architecture target and its DFlash drafter,
from scratch on the Python standard library (tools/demo_corpus.py makes the data), on one GPU with torch.

Target: MLA, first layer dense, MoE layers of a shared expert and top-k routed experts, YaRN RoPE; trained in bf16
autocast, its routed experts quantization-aware (fake INT4 group 32) over the last QAT_FRACTION of the steps and
exported as compressed-tensors INT4. Drafter: DFlash block diffusion on the INT4 target's tapped hidden states;
random anchors per sequence, the block [token at anchor, MASK...], loss the cross-entropy against the target's
own next-token distributions at the block's positions (what acceptance is measured against), depth d weighted by
exp(-(d - 1) / DEPTH_DECAY). Both step counts come from a seconds budget (measured on the first steps) unless
given; the log records them, and the same seed and steps train the same pair (up to GPU nondeterminism).

    python3 tools/train_demo.py --data DATA --out OUT    # OUT/model (checkpoint, tokenizer.json, drafter/), train.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.checkpoint import write_checkpoint
from ddtree.config import DEFAULT_QUANT_IGNORE, ModelConfig, QuantConfig, RopeConfig, yarn_mscale
from ddtree.drafter import DrafterConfig, write_drafter

from demo_corpus import EOS_TEXT, MASK_TEXT
from demo_drafter import Drafter
from demo_target import Target

SEQ_LEN = 512
QAT_FRACTION = 0.25
DEPTH_DECAY = 7.0  # DFlash's loss decay for blocks of 16
TAPS = (0, 1, 2)


def target_config(vocab_size: int, eos_id: int) -> ModelConfig:
    """Kimi-K2's shape at small scale: kv_lora 128 / rope 32 is a pair the MLA kernels are built for; hidden and
    moe_intermediate are multiples of the INT4 MoE kernel's 128; YaRN as K2 sets it (mscale = mscale_all_dim)."""
    return ModelConfig(
        model_type="kimi_k2", vocab_size=vocab_size, hidden_size=256, intermediate_size=768,
        moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0, kind="yarn", factor=4.0, original_max_position_embeddings=512,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        rope_interleave=True,
        quantization=QuantConfig(num_bits=4, group_size=32, symmetric=True, ignore=DEFAULT_QUANT_IGNORE),
        bos_token_id=None, eos_token_ids=(eos_id,))


def drafter_config(target: ModelConfig, layers: int, block_size: int, mask_id: int) -> DrafterConfig:
    """A Qwen3-style DFlash drafter over the target's hidden size, with YaRN as the published K2 drafter uses it
    (amplitude 0.1 ln(factor) + 1, DrafterConfig.rope_attention_factor)."""
    r = target.rope
    return DrafterConfig(
        hidden_size=target.hidden_size, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=target.vocab_size, rms_norm_eps=1e-6,
        rope=RopeConfig(r.theta, "yarn", r.factor, r.original_max_position_embeddings, r.beta_fast, r.beta_slow,
                        1.0, 1.0),
        rope_attention_factor=yarn_mscale(r.factor, 1.0), max_position_embeddings=target.max_position_embeddings,
        block_size=block_size, mask_token_id=mask_id, num_target_layers=target.num_hidden_layers,
        target_layer_ids=TAPS)


class Windows:
    """Random windows of a token stream, drawn from a seeded generator."""

    def __init__(self, stream: np.ndarray, device: torch.device, seed: int) -> None:
        self.stream = torch.from_numpy(stream.astype(np.int64)).to(device)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def batch(self, rows: int, length: int) -> torch.Tensor:
        starts = torch.randint(0, self.stream.numel() - length, (rows,), device=self.stream.device,
                               generator=self.generator)
        return self.stream[starts[:, None] + torch.arange(length, device=self.stream.device)]


def schedule(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=torch.cuda.is_available())


def train_loop(step_fn, params, lr: float, steps: int | None, seconds: float, warmup: int, on_step=None) -> dict:
    """Runs `step_fn(step, steps) -> loss tensor` under AdamW; steps from `seconds` (timed over the first ones) when
    not given. Returns the loss curve and timings."""
    opt = optimizer(params, lr)
    # the step time is measured over steps 10..30, after the first steps' warm-up (allocations, kernel choice)
    curve, begin, probe_from, probe_to = [], time.perf_counter(), 10, 30
    total = steps if steps is not None else 10**9
    step = 0
    while step < total:
        if steps is None and step in (probe_from, probe_to):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            if step == probe_from:
                probe_start = now
            else:
                per_step = (now - probe_start) / (probe_to - probe_from)
                total = max(probe_to + 1, probe_to + int((seconds - (now - begin)) / per_step))
        for group in opt.param_groups:
            group["lr"] = lr * schedule(step, total, warmup)
        loss = step_fn(step, total)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if on_step is not None:
            on_step()
        if step % 25 == 0:
            curve.append({"step": step, "loss": loss.item(), "seconds": time.perf_counter() - begin})
            if step % 500 == 0:
                print(f"step {step} of {total}: loss {curve[-1]['loss']:.3f} at {curve[-1]['seconds']:.0f} s")
        step += 1
    return {"steps": total, "seconds": time.perf_counter() - begin, "curve": curve}


@torch.no_grad()
def perplexity(model: Target, held_out: np.ndarray, device: torch.device, length: int = SEQ_LEN) -> float:
    """exp(mean NLL) of every held-out token after the first of its window, windows of `length` + 1 tokens, in
    float32 (the reference's precision)."""
    usable = (held_out.size - 1) // length * length
    ids = torch.from_numpy(held_out[:usable + 1].astype(np.int64)).to(device)
    inputs, labels = ids[:-1].view(-1, length), ids[1:].view(-1, length)
    nll, count = 0.0, 0
    for i in range(0, inputs.shape[0], 32):
        logits, _ = model(inputs[i:i + 32])
        nll += float(F.cross_entropy(logits.flatten(0, 1), labels[i:i + 32].flatten(), reduction="sum"))
        count += labels[i:i + 32].numel()
    return math.exp(nll / count)


def unigram_perplexity(train: np.ndarray, held_out: np.ndarray, vocab: int) -> float:
    """The baseline: each token's training frequency (add-one smoothed), context ignored."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1
    log_p = np.log(counts / counts.sum())
    return float(np.exp(-log_p[held_out[1:]].mean()))


def train_target(model: Target, windows: Windows, args: argparse.Namespace) -> dict:
    def step_fn(step: int, steps: int) -> torch.Tensor:
        model.set_fake_quant(step >= steps * (1 - QAT_FRACTION))
        ids = windows.batch(args.target_batch, SEQ_LEN + 1)
        with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.device.type == "cuda"):
            logits, _ = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    def balance() -> None:
        for moe in model.moe_layers():
            moe.balance()

    return train_loop(step_fn, list(model.parameters()), args.target_lr, args.target_steps, args.target_seconds,
                      warmup=100, on_step=balance)


def drafter_loss(drafter: Drafter, target: Target, ids: torch.Tensor, anchors_per_seq: int,
                 generator: torch.Generator, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted block-diffusion loss of random anchors, and the per-depth top-1 agreement with the target."""
    block = drafter.cfg.block_size
    rows, length = ids.shape
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits, taps = target(ids, taps=TAPS)
        teacher = F.softmax(logits.float(), dim=-1)
        context = torch.cat(taps, dim=-1)
    # anchors in [1, length - block]: a non-empty context, and a teacher distribution for every drafted depth
    scores = torch.rand(rows, length - block, device=ids.device, generator=generator)
    anchors = scores.topk(anchors_per_seq, dim=1).indices + 1
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        draft = drafter(context, ids, anchors, target.embed_tokens.detach(), target.lm_head.detach()).float()
    # depth d (1..B-1) below the anchor is the token at anchor + d, which the target predicts at anchor + d - 1
    where = anchors[..., None] + torch.arange(block - 1, device=ids.device)
    wanted = torch.gather(teacher, 1, where.flatten(1)[..., None].expand(-1, -1, teacher.shape[-1]))
    wanted = wanted.view(rows, anchors_per_seq, block - 1, -1)
    per_depth = -(wanted * F.log_softmax(draft, dim=-1)).sum(-1).mean((0, 1))
    weights = torch.exp(-torch.arange(block - 1, device=ids.device) / DEPTH_DECAY)
    agree = (draft.argmax(-1) == wanted.argmax(-1)).float().mean((0, 1))
    return (per_depth * weights).sum() / weights.sum(), agree


def train_drafter(drafter: Drafter, target: Target, windows: Windows, args: argparse.Namespace) -> dict:
    generator = torch.Generator(device=args.device).manual_seed(args.seed + 2)
    autocast = args.device.type == "cuda"

    def step_fn(step: int, steps: int) -> torch.Tensor:
        loss, _ = drafter_loss(drafter, target, windows.batch(args.drafter_batch, SEQ_LEN), args.anchors,
                               generator, autocast)
        return loss

    return train_loop(step_fn, list(drafter.parameters()), args.drafter_lr, args.drafter_steps,
                      args.drafter_seconds, warmup=50)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="tools/demo_corpus.py's output")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-seconds", type=float, default=130.0)
    parser.add_argument("--target-steps", type=int, default=None, help="overrides --target-seconds")
    parser.add_argument("--target-batch", type=int, default=128)
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument("--drafter-seconds", type=float, default=80.0)
    parser.add_argument("--drafter-steps", type=int, default=None, help="overrides --drafter-seconds")
    parser.add_argument("--drafter-batch", type=int, default=64)
    parser.add_argument("--drafter-lr", type=float, default=2e-3)
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per training sequence")
    args = parser.parse_args()
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 evaluations stay float32

    train_ids, held_out = np.load(args.data / "train.npy"), np.load(args.data / "held_out.npy")
    corpus = json.loads((args.data / "corpus.json").read_text())
    special = corpus["special_ids"]
    cfg = target_config(corpus["vocab_size"], special[EOS_TEXT])
    target = Target(cfg).to(args.device)
    log: dict = {"seed": args.seed, "device": torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "corpus": {k: v for k, v in corpus.items() if "held_out_" not in k
                                                       or k.endswith(("tokens", "bytes"))}}
    log["target"] = train_target(target, Windows(train_ids, args.device, args.seed), args)

    target.round_to_bf16(experts=False)
    target.set_fake_quant(True)
    ppl = {"int4": perplexity(target, held_out, args.device)}
    model_dir = args.out / "model"
    write_checkpoint(model_dir, cfg, target.checkpoint_tensors())
    shutil.copy(args.data / "tokenizer.json", model_dir / "tokenizer.json")
    log["target"]["quantization"] = "QAT: fake INT4 group-32 routed experts over the last " \
                                    f"{QAT_FRACTION:.0%} of the steps (straight-through gradients)"

    dcfg = drafter_config(cfg, args.drafter_layers, args.block_size, special[MASK_TEXT])
    drafter = Drafter(dcfg).to(args.device)
    target.requires_grad_(False)
    log["drafter"] = train_drafter(drafter, target, Windows(train_ids, args.device, args.seed + 1), args)
    write_drafter(model_dir / "drafter", dcfg, drafter.checkpoint_tensors())
    with torch.no_grad():
        generator = torch.Generator(device=args.device).manual_seed(args.seed + 3)
        windows = Windows(held_out, args.device, args.seed + 3)
        _, agree = drafter_loss(drafter, target, windows.batch(64, SEQ_LEN), args.anchors, generator, False)
    log["drafter"]["held_out_top1_agreement_by_depth"] = agree.tolist()

    target.round_to_bf16(experts=True)
    target.set_fake_quant(False)
    ppl["bf16"] = perplexity(target, held_out, args.device)
    ppl["unigram"] = unigram_perplexity(train_ids, held_out, cfg.vocab_size)
    log["perplexity"] = ppl
    log["drafter_config"] = {k: v for k, v in asdict(dcfg).items() if k != "rope"}
    (args.out / "train.json").write_text(json.dumps(log, indent=1))
    print(json.dumps({"perplexity": ppl, "target_steps": log["target"]["steps"],
                      "drafter_steps": log["drafter"]["steps"], "agreement": log["drafter"][
                          "held_out_top1_agreement_by_depth"]}, indent=1))


if __name__ == "__main__":
    main()
