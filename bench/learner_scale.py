"""The learner and teacher-forced scoring at long sequences, without the rollout engine: peak memory and
seconds on a GPU (or a small CPU smoke run).

Three parts, each on random token ids (no tokenizer, no sampling, so they measure the learner's side
alone):
- `score`: `profile_trajectories` (what `sparrow profile --rollouts` runs) on --trajectories sequences of
  --length tokens (a --prompt-tokens prompt, the rest generated) at each of --budgets: dense prefill,
  one completion pass per mode, alpha/logprobs/entropy over chunks of positions;
- `update`: one GRPO learner step's model work on --prompts x --samples sequences of --prompt-tokens +
  --new-tokens: the dense recompute under no_grad with the top-20 ids (the alpha bound's), then the
  loss's forward and backward through a LoRA in micro-batches of --micro-batch, with per-layer
  gradient checkpointing unless --no-gradient-checkpointing, then an AdamW step;
- `rollouts`: writes the random trajectories of `score` as a rollouts Parquet file (prompt_id,
  prompt_token_ids, token_ids) to --output, so that the CLI itself can score them:
  `sparrow profile --device cuda --model qwen3-4b --random-weights --rollouts FILE --budgets ...`.
Each part prints one JSON line: seconds, peak device memory (`torch.cuda.max_memory_allocated`, reset
before the part), and the shapes.

    python bench/learner_scale.py score --model qwen3-4b --device cuda --trajectories 4 --length 32768
    python bench/learner_scale.py update --model qwen3-4b --device cuda --prompts 2 --samples 4 \\
        --new-tokens 16384 --micro-batch 1
    python bench/learner_scale.py score --model tiny-qwen3 --device cpu --length 300   # smoke
"""

from __future__ import annotations

import argparse
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sparrow.stages.core.trajectories import Trajectory
from sparrow.stages.model.adapter import add_lora
from sparrow.stages.model.loading import load_model, resolve_config
from sparrow.stages.profile import ProfileOptions, profile_trajectories
from sparrow.stages.train.objective import LossConfig, policy_loss
from sparrow.stages.train.policy import completion_logprobs


def random_trajectories(args, vocab: int) -> list[Trajectory]:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [Trajectory(f"p{i}", 0, ids(args.prompt_tokens), ids(args.length - args.prompt_tokens))
            for i in range(args.trajectories)]


def measure(device: torch.device, run) -> tuple[float, float | None]:
    """Seconds and peak device GiB of run()."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return seconds, peak


def score(args, loaded) -> dict:
    trajectories = random_trajectories(args, loaded.config.vocab_size)
    opts = ProfileOptions(budgets=args.budgets, bin_width=2000, score_tokens=args.length)
    out = {}
    seconds, peak = measure(args.device, lambda: out.setdefault("table", profile_trajectories(
        loaded, trajectories, opts)))
    return {"rows": out["table"].num_rows, "seconds": seconds, "peak_gib": peak,
            "trajectories": args.trajectories, "length": args.length, "budgets": args.budgets}


def update(args, loaded) -> dict:
    model = loaded.model
    g = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prompts, comps = [], []
    for _ in range(args.prompts):
        prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist()
        for _ in range(args.samples):
            prompts.append(prompt)
            comps.append(torch.randint(0, vocab, (args.new_tokens,), generator=g).tolist())
    torch.manual_seed(0)
    add_lora(model, args.lora_rank, 2.0 * args.lora_rank)
    model.gradient_checkpointing = args.gradient_checkpointing
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    top = torch.randint(0, vocab, (len(comps), args.new_tokens, 20), generator=g)
    mb, cfg = args.micro_batch, LossConfig()
    old: list[torch.Tensor] = []

    def recompute() -> None:
        with torch.no_grad():
            for s in range(0, len(comps), mb):
                part = completion_logprobs(model, prompts[s:s + mb], comps[s:s + mb], 1.0,
                                           extra_ids=top[s:s + mb])
                old.append(part.logp.cpu())

    def step() -> None:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        advantages = torch.linspace(-1, 1, len(comps))
        for i, s in enumerate(range(0, len(comps), mb)):
            logp = completion_logprobs(model, prompts[s:s + mb], comps[s:s + mb], 1.0, entropy=False).logp
            dev = logp.device
            mask = torch.ones_like(logp, dtype=torch.bool)
            loss, _ = policy_loss(logp, old[i].to(dev), advantages[s:s + mb].to(dev), torch.ones_like(logp),
                                  mask, cfg, normalizer=len(comps) * args.new_tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        model.eval()

    rec_s, rec_peak = measure(args.device, recompute)
    upd_s, upd_peak = measure(args.device, step)
    return {"recompute_seconds": rec_s, "recompute_peak_gib": rec_peak, "update_seconds": upd_s,
            "update_peak_gib": upd_peak, "sequences": len(comps), "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "micro_batch": mb,
            "gradient_checkpointing": args.gradient_checkpointing, "lora_rank": args.lora_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("score", "update", "rollouts"))
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--trajectories", type=int, default=4)
    ap.add_argument("--length", type=int, default=32768, help="tokens per trajectory, prompt included")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--budgets", default="1024,2048,3072,4096")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16384)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--output", default="bench/results/long_rollouts.parquet")
    args = ap.parse_args()
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.device = torch.device(args.device)
    if args.part == "rollouts":
        trajs = random_trajectories(args, resolve_config(args.model).vocab_size)
        table = pa.table({"prompt_id": [t.prompt_id for t in trajs], "sample": [t.sample for t in trajs],
                          "prompt_token_ids": [t.prompt for t in trajs],
                          "token_ids": [t.completion for t in trajs]})
        pq.write_table(table, args.output)
        print(json.dumps({"part": "rollouts", "output": args.output, "trajectories": len(trajs)}))
        return
    loaded = load_model(args.model, device=str(args.device), dtype=getattr(torch, args.dtype),
                        random_weights=True)
    result = score(args, loaded) if args.part == "score" else update(args, loaded)
    print(json.dumps({"part": args.part, "model": args.model, "device": str(args.device),
                      "dtype": args.dtype, **result}))


if __name__ == "__main__":
    main()
