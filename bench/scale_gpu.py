"""The GPU checks at our users' scale (issue 24): each reports its wall seconds and peak CUDA memory.

    python bench/scale_gpu.py run -- sparrow fit-cost --device cuda --model qwen3-4b ...   # a CLI command
    python bench/scale_gpu.py run -- bench/rollout.py --model qwen3-4b --random-weights ...  # a bench script
    python bench/scale_gpu.py profile --context 32768 --trajectories 4 --budgets 1024,2048,4096
    python bench/scale_gpu.py engines --context 32768 --samples 8 --engines 4

`run` runs a `sparrow` command or a bench script in this process, so torch's peak counters see it.
`profile` is `sparrow profile --device cuda` through the Python API (the CLI has no shapes-only
weights): the engine samples `--trajectories` trajectories of `--context` tokens in all (a random
prompt, then `--new-tokens`) with Qwen3-4B shapes and random bf16 weights, then every generated token
is scored teacher forced under dense attention and each budget. `engines` builds engines one after
another in one process, each sampling a few tokens of a long prompt, and checks that each one's memory
is gone after `close()` (and after a plain `del`), the issue's "several Engines built one after
another". `bash bench/gpu_checks.sh scale` runs them all, each under ten minutes.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import torch

GiB = 2**30


def report(label: str, t0: float) -> None:
    dev = torch.cuda.current_device()
    print(f"[{label}] {time.perf_counter() - t0:.1f} s, peak CUDA memory allocated "
          f"{torch.cuda.max_memory_allocated(dev) / GiB:.2f} GiB, reserved "
          f"{torch.cuda.max_memory_reserved(dev) / GiB:.2f} GiB of "
          f"{torch.cuda.get_device_properties(dev).total_memory / GiB:.1f} GiB", flush=True)


def run(argv: list[str]) -> int:
    """A `sparrow ...` command or a bench script, in this process."""
    t0, code = time.perf_counter(), 0
    sys.argv = argv if argv[0] != "sparrow" else ["sparrow", *argv[1:]]
    try:
        if argv[0] == "sparrow":
            from sparrow.cli.app import main

            main()
        else:
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    report(" ".join(argv[:2]), t0)
    return code


def profile(args) -> int:
    from sparrow.stages.model.loading import load_model
    from sparrow.stages.profile import ProfileOptions, profile_trajectories, sample_trajectories

    loaded = load_model(args.model, device="cuda", dtype=torch.bfloat16, random_weights=True)
    g = torch.Generator().manual_seed(0)
    prompt_len = args.context - args.new_tokens
    prompts = [torch.randint(0, loaded.config.vocab_size, (prompt_len,), generator=g).tolist()]
    opts = ProfileOptions(budgets=[int(b) for b in args.budgets.split(",")], samples=args.trajectories,
                          max_new_tokens=args.new_tokens, batch_size=args.trajectories, bin_width=2000)
    t0 = time.perf_counter()
    trajectories = sample_trajectories(loaded, ["p0"], prompts, opts)
    report(f"sampled {len(trajectories)} trajectories of {args.context} tokens", t0)
    t1 = time.perf_counter()
    table = profile_trajectories(loaded, trajectories, opts)
    report(f"scored {table.num_rows} rows at budgets {args.budgets}", t1)
    return 0


def engines(args) -> int:
    from sparrow.stages.model.loading import load_model
    from sparrow.stages.rollout import Engine, SamplingParams

    loaded = load_model(args.model, device="cuda", dtype=torch.bfloat16, random_weights=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.config.vocab_size, (args.context,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.samples, ignore_eos=True)
    dev = torch.cuda.current_device()
    before, failed = torch.cuda.memory_allocated(dev), False
    for i in range(args.engines):
        t0 = time.perf_counter()
        engine = Engine(loaded.model, 2048 if i % 2 else None, max_batch=args.samples)
        engine.generate([prompt], params)
        pool = engine.num_pages
        sizing = engine.runner.memory
        if i % 2:
            del engine  # dropped: reference counting alone must free it
        else:
            engine.close()
        left = torch.cuda.memory_allocated(dev) - before
        failed |= left > 64 * 2**20
        gib = {k: v if k == "pages" else round(v / GiB, 2) for k, v in sizing.items()}
        print(f"engine {i}: pool {pool} pages, sizing (GiB) {gib}, {left / 2**20:.0f} MiB left after "
              f"{'del' if i % 2 else 'close()'}", flush=True)
        report(f"engine {i}", t0)
    print("every engine's memory was freed" if not failed else "an engine left memory behind")
    return int(failed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("run").add_argument("argv", nargs=argparse.REMAINDER)
    p = sub.add_parser("profile")
    p.add_argument("--model", default="qwen3-4b")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--trajectories", type=int, default=4)
    p.add_argument("--budgets", default="1024,2048,4096")
    e = sub.add_parser("engines")
    e.add_argument("--model", default="qwen3-4b")
    e.add_argument("--context", type=int, default=32768)
    e.add_argument("--samples", type=int, default=8)
    e.add_argument("--new-tokens", type=int, default=16)
    e.add_argument("--engines", type=int, default=4)
    args = ap.parse_args()
    if args.what == "run":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return run(argv)
    return profile(args) if args.what == "profile" else engines(args)


if __name__ == "__main__":
    sys.exit(main())
