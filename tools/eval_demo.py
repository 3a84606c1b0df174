"""Evaluate the trained demo pair with ddtree's numpy reference (and, with --engine, on the GPU engine), and write
its report.

1. Agreement: the exported checkpoints, loaded by ddtree.checkpoint and the drafter loader, give on the reference
   the logits the torch training models give from the same weights (a held-out snippet; float32 both sides).
2. Acceptance: mean acceptance length (tokens per round, the bonus included) of ddtree.reference.generate on
   held-out stdlib files, at T = 0 and T = 1, for the DFlash chain (the top-1 token at each of the block - 1
   depths) and DDTree trees of each budget. Prompts are PROMPT_TOKENS tokens from a seeded offset of each held-out
   file long enough, one prompt per file.
3. The report: bench/results/demo/demo.{json,md,png} with train_demo.py's log (curves, perplexities).

    python3 tools/eval_demo.py --model MODEL --data DATA --train-log OUT/train.json --out bench/results/demo
    python3 tools/eval_demo.py --out bench/results/demo --report-only    # the Markdown and plot from demo.json
    python3 tools/eval_demo.py --model py/ddtree/demo --out bench/results/demo --engine   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from ddtree.reference import ReferenceModel, generate
from ddtree.reference.drafter import ReferenceDrafter

from bench_report import pyplot

PROMPT_TOKENS = 128
PROMPTS_FILE = "held_out_prompts.json"  # beside demo.json: the prompts the acceptance tables were measured on
BUDGETS = (4, 8, 16, 32, 64)
TEMPERATURES = (0.0, 1.0)
# Logits other than the top-1 get this much less, so best-first DDTree grows the top-1 chain first: with a budget
# of block - 1 nodes the tree is then exactly DFlash's chain (see ChainDrafter).
CHAIN_PENALTY = 1e30


class ChainDrafter(ReferenceDrafter):
    """The drafter whose per-depth distributions put (almost) all mass on the top-1 token: DDTree with budget
    block - 1 over it verifies DFlash's single chain, the baseline DDTree's trees are compared against."""

    def draft(self, cache, context, bonus_token, start):  # type: ignore[override]
        logits = super().draft(cache, context, bonus_token, start)
        top = logits.argmax(axis=1)
        chained = logits - np.float32(CHAIN_PENALTY)
        chained[np.arange(logits.shape[0]), top] = logits[np.arange(logits.shape[0]), top]
        return chained


def held_out_prompts(data: Path, count: int, new_tokens: int, seed: int) -> list[dict]:
    """One prompt per held-out file with room for the prompt and `new_tokens` of its own text after it."""
    corpus = json.loads((data / "corpus.json").read_text())
    stream = np.load(data / "held_out.npy")
    ends = corpus["held_out_offsets"][1:] + [int(stream.size)]
    rng = np.random.default_rng(seed)
    prompts = []
    for name, start, end in zip(corpus["held_out_files"], corpus["held_out_offsets"], ends):
        room = end - 1 - start - PROMPT_TOKENS - new_tokens  # the file's tokens, its end-of-text left out
        if room >= 0:
            offset = start + int(rng.integers(0, room + 1))
            prompts.append({"file": name, "offset": offset - start,
                            "ids": stream[offset:offset + PROMPT_TOKENS].astype(np.int64).tolist()})
    return prompts[:count]


def check_agreement(model_dir: Path, data: Path) -> dict:
    """Largest |reference - torch| logit difference of the target (a held-out snippet) and of the drafter (one
    block after it), beside the largest |logit|."""
    import torch

    from ddtree.checkpoint import open_checkpoint
    from ddtree.drafter import open_drafter

    from demo_drafter import Drafter
    from demo_target import Target

    ids = np.load(data / "held_out.npy")[:PROMPT_TOKENS].astype(np.int64)
    model = ReferenceModel.load(model_dir)
    drafter_cfg, drafter_tensors = open_drafter(model_dir / "drafter", model.config)
    drafter = ReferenceDrafter.for_model(model_dir / "drafter", model)
    taps = drafter_cfg.target_layer_ids
    start = ids.size - drafter_cfg.block_size
    out = model.forward(ids[:start + 1], np.arange(start + 1), model.new_cache(), hidden_layers=taps)
    context = np.concatenate([out.hidden[t][:start] for t in taps], axis=1)
    ref_draft = drafter.draft(drafter.new_cache(), context, int(ids[start]), start)

    target = Target(model.config)
    target.load_checkpoint_tensors(open_checkpoint(model_dir))
    torch_drafter = Drafter(drafter_cfg)
    torch_drafter.load_checkpoint_tensors(drafter_tensors)
    with torch.no_grad():
        logits, tapped = target(torch.from_numpy(ids[None]), taps=taps)
        draft = torch_drafter(torch.cat(tapped, dim=-1), torch.from_numpy(ids[None]), torch.tensor([[start]]),
                              target.embed_tokens, target.lm_head)[0, 0].numpy()
    ref_logits = model.forward(ids, np.arange(ids.size), model.new_cache()).logits
    return {
        "tokens": int(ids.size),
        "target_max_abs_diff": float(np.abs(ref_logits - logits[0].numpy()).max()),
        "target_max_abs_logit": float(np.abs(ref_logits).max()),
        "target_argmax_equal": float((ref_logits.argmax(1) == logits[0].numpy().argmax(1)).mean()),
        "drafter_max_abs_diff": float(np.abs(ref_draft - draft).max()),
        "drafter_max_abs_logit": float(np.abs(ref_draft).max()),
    }


def _acceptance_job(job: tuple[str, dict, str, int, float, int, int]) -> dict:
    model_dir, prompt, kind, budget, temperature, new_tokens, seed = job
    model = ReferenceModel.load(model_dir)
    drafter_class = ChainDrafter if kind == "chain" else ReferenceDrafter
    drafter = drafter_class.for_model(Path(model_dir) / "drafter", model)
    begin = time.perf_counter()
    result = generate(model, drafter, prompt["ids"], new_tokens, method="ddtree", budget=budget,
                      temperature=temperature, seed=seed)
    return {"file": prompt["file"], "kind": kind, "budget": budget, "temperature": temperature,
            "rounds": len(result.accept_lengths),
            "accepted": int(sum(result.accept_lengths)), "seconds": time.perf_counter() - begin}


def _mean(runs: list[dict]) -> float:
    """Tokens per round over every round of the runs, pooled."""
    return sum(r["accepted"] for r in runs) / sum(r["rounds"] for r in runs)


def acceptance(model_dir: Path, prompts: list[dict], block_size: int, new_tokens: int,
               workers: int) -> tuple[list[dict], list[dict]]:
    """Per (kind, budget, T): the mean acceptance length over every round of every prompt, and beside it the
    same without the files under encodings/ (codec tables, far easier to draft than code); and every run."""
    settings = [("chain", block_size - 1)] + [("ddtree", b) for b in BUDGETS]
    jobs = [(str(model_dir), p, kind, budget, t, new_tokens, i)
            for kind, budget in settings for t in TEMPERATURES for i, p in enumerate(prompts)]
    with ProcessPoolExecutor(workers) as pool:
        runs = list(pool.map(_acceptance_job, jobs))
    return _summary(runs, settings), runs


def _summary(runs: list[dict], settings: list[tuple[str, int]]) -> list[dict]:
    rows = []
    for kind, budget in settings:
        for t in TEMPERATURES:
            mine = [r for r in runs if r["kind"] == kind and r["budget"] == budget and r["temperature"] == t]
            code = [r for r in mine if not r["file"].startswith("encodings/")]
            rows.append({"kind": kind, "budget": budget, "temperature": t, "prompts": len(mine),
                         "rounds": sum(r["rounds"] for r in mine), "mean_acceptance": _mean(mine),
                         "mean_acceptance_without_encodings": _mean(code),
                         "seconds": sum(r["seconds"] for r in mine)})
    return rows


def engine_acceptance(model_dir: Path, prompts: list[dict], block_size: int, new_tokens: int) -> list[dict]:
    """The same table from the GPU engine's DDTree rounds, 16 prompts per call. The chain is the drafter's top-1
    token per depth (width 1) at budget block - 1; noise at T = 1 is keyed by (seed 0, stream slot, position)."""
    from ddtree import Engine

    streams = 16
    engine = Engine(model_dir, model_dir / "drafter", streams=streams,
                    max_context=PROMPT_TOKENS + new_tokens + block_size, budget=max(BUDGETS))
    settings = [("chain", block_size - 1)] + [("ddtree", b) for b in BUDGETS]
    runs = []
    for kind, budget in settings:
        for t in TEMPERATURES:
            for begin in range(0, len(prompts), streams):
                batch = prompts[begin:begin + streams]
                out = engine.native.generate_ddtree([p["ids"] for p in batch], new_tokens, t, 0, budget,
                                                    width=1 if kind == "chain" else 0)
                for p, accepts in zip(batch, out["accept_lengths"]):
                    runs.append({"file": p["file"], "kind": kind, "budget": budget, "temperature": t,
                                 "rounds": len(accepts), "accepted": int(sum(accepts)),
                                 "seconds": out["decode_seconds"]})
    return _summary(runs, settings)


def _acceptance_table(rows: list[dict]) -> list[str]:
    """Markdown rows of an acceptance table, each beside the chain's figure at its temperature."""
    chain = {r["temperature"]: r["mean_acceptance"] for r in rows if r["kind"] == "chain"}
    lines = ["| drafting | T | mean acceptance | gain over the chain | rounds | without encodings/ |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        name = f"chain ({r['budget']} nodes)" if r["kind"] == "chain" else f"DDTree, budget {r['budget']}"
        gain = r["mean_acceptance"] / chain[r["temperature"]]
        lines.append(f"| {name} | {r['temperature']:g} | {r['mean_acceptance']:.2f} | {gain:.2f}x | {r['rounds']} | "
                     f"{r['mean_acceptance_without_encodings']:.2f} |")
    return lines


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(report, indent=1))
    train, ppl, agree = report["train"], report["train"]["perplexity"], report["agreement"]
    chain = {r["temperature"]: r["mean_acceptance"] for r in report["acceptance"] if r["kind"] == "chain"}
    codecs = sorted({r["file"] for r in report["runs"] if r["file"].startswith("encodings/")})
    lines = ["# The trained demo pair (the built-in model)", "",
             f"Trained on {train['device']} with torch {train['torch']}, seed {train['seed']}; corpus: the standard "
             f"library of Python {train['corpus']['python']} ({train['corpus']['train_files']} training files, "
             f"{train['corpus']['train_tokens']} tokens; {train['corpus']['held_out_tokens']} held-out tokens).", "",
             f"Target: {train['target']['steps']} steps in {train['target']['seconds']:.0f} s; "
             f"{train['target']['quantization']}. Drafter: {train['drafter']['steps']} steps in "
             f"{train['drafter']['seconds']:.0f} s.", "",
             "## Held-out perplexity", "", "| model | perplexity |", "| --- | --- |",
             f"| unigram baseline | {ppl['unigram']:.1f} |", f"| target, bf16 experts | {ppl['bf16']:.2f} |",
             f"| target, INT4 experts (exported) | {ppl['int4']:.2f} |", "",
             "## Reference agreement", "",
             f"Exported checkpoints on ddtree.reference against the torch training models, {agree['tokens']} held-out "
             f"tokens, float32: target logits differ by at most {agree['target_max_abs_diff']:.2e} (largest |logit| "
             f"{agree['target_max_abs_logit']:.1f}; argmax equal at {agree['target_argmax_equal']:.0%} of "
             f"positions); drafter logits by at most {agree['drafter_max_abs_diff']:.2e} (largest |logit| "
             f"{agree['drafter_max_abs_logit']:.1f}).", "",
             "## Mean acceptance length (reference backend)", "",
             f"{report['prompts']} held-out files, a {PROMPT_TOKENS}-token prompt from each, {report['new_tokens']} "
             "new tokens; tokens per round, the bonus token included, pooled over every round of every prompt. The "
             "chain is DFlash's: the top-1 token at each of the block - 1 depths. The last column leaves out the "
             f"{len(codecs)} prompts from codec modules ({', '.join(codecs)}): their tables and boilerplate are "
             "shared by about a hundred near-identical training files, so they draft far more easily than the "
             "rest.", ""] + _acceptance_table(report["acceptance"])
    if "acceptance_engine" in report:
        lines += ["", f"## Mean acceptance length (GPU engine, {report['engine_device']})", "",
                  "The same prompts through the GPU engine's DDTree rounds (bf16 and INT4 kernels, 16 prompts per "
                  "call); the chain is the drafter's top-1 token per depth (width 1, budget block - 1).", ""]
        lines += _acceptance_table(report["acceptance_engine"])
    (out / "demo.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, (ax_train, ax_accept) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("target", "drafter"):
        curve = train[name]["curve"]
        ax_train.plot([c["step"] for c in curve], [c["loss"] for c in curve], label=name)
    ax_train.set(xlabel="step", ylabel="training loss (nats; the drafter's is a cross-entropy against the "
                 "target's distributions)", title="Training curves", yscale="log")
    ax_train.legend()
    for t in TEMPERATURES:
        rows = [r for r in report["acceptance"] if r["temperature"] == t and r["kind"] == "ddtree"]
        ax_accept.plot([r["budget"] for r in rows], [r["mean_acceptance"] for r in rows], "o-", label=f"DDTree T={t:g}")
        ax_accept.axhline(chain[t], linestyle="--", color=ax_accept.lines[-1].get_color(), label=f"chain T={t:g}")
    ax_accept.set(xlabel="tree budget (nodes)", ylabel="mean acceptance length", xscale="log",
                  title="Held-out acceptance (reference)")
    ax_accept.set_xticks(BUDGETS, [str(b) for b in BUDGETS])
    ax_accept.minorticks_off()
    ax_accept.legend()
    fig.tight_layout()
    fig.savefig(out / "demo.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="train_demo.py's OUT/model")
    parser.add_argument("--data", type=Path, help="demo_corpus.py's output")
    parser.add_argument("--train-log", type=Path, help="train_demo.py's OUT/train.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite OUT's Markdown and plot from its demo.json, evaluating nothing")
    parser.add_argument("--engine", action="store_true",
                        help="add the GPU engine's acceptance table, on the prompts of OUT's held_out_prompts.json, to "
                             "its demo.json (needs --model and a CUDA device) and rewrite the report")
    args = parser.parse_args()
    if args.report_only:
        write_report(args.out, json.loads((args.out / "demo.json").read_text()))
        return
    if args.engine:
        if args.model is None:
            parser.error("--engine needs --model")
        from ddtree.device import device_info

        # The reference run's prompts (the corpus depends on the Python that built it, so they are kept).
        report = json.loads((args.out / "demo.json").read_text())
        prompts = json.loads((args.out / PROMPTS_FILE).read_text())
        block = json.loads((args.model / "drafter" / "config.json").read_text())["block_size"]
        report["acceptance_engine"] = engine_acceptance(args.model, prompts, block, report["new_tokens"])
        report["engine_device"] = str(device_info()).splitlines()[-1].strip()
        write_report(args.out, report)
        print((args.out / "demo.md").read_text())
        return
    if None in (args.model, args.data, args.train_log):
        parser.error("--model, --data and --train-log are required unless --report-only")
    agreement = check_agreement(args.model, args.data)
    print(json.dumps(agreement))
    prompts = held_out_prompts(args.data, args.prompts, args.new_tokens, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / PROMPTS_FILE).write_text(json.dumps(prompts))
    block = json.loads((args.model / "drafter" / "config.json").read_text())["block_size"]
    rows, runs = acceptance(args.model, prompts, block, args.new_tokens, args.workers)
    report = {"train": json.loads(args.train_log.read_text()), "agreement": agreement, "prompts": len(prompts),
              "prompt_tokens": PROMPT_TOKENS, "new_tokens": args.new_tokens, "acceptance": rows, "runs": runs}
    write_report(args.out, report)
    print((args.out / "demo.md").read_text())


if __name__ == "__main__":
    main()
