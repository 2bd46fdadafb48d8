"""The GPU checks at our users' scale (issue 24): each reports its wall seconds and peak CUDA memory.

    python bench/scale_gpu.py run -- sparrow fit-cost --device cuda --model qwen3-4b ...   # a CLI command
    python bench/scale_gpu.py run -- bench/rollout.py --model qwen3-4b --random-weights ...  # a bench script
    python bench/scale_gpu.py engines --context 32768 --samples 8 --engines 4

`run` runs a `sparrow` command or a bench script in this process, so torch's peak counters see it.
`engines` builds engines one after another in one process, each sampling a few tokens of a long
prompt, and checks that each one's memory is gone after `close()` (and after a plain `del`), the
issue's "several Engines built one after another". `bash bench/gpu_checks.sh scale-NAME` runs one.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import torch

from sparrow.stages.core.sparsity import as_policy
from sparrow.stages.engine import EngineConfig

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



def engines(args) -> int:
    from sparrow.stages.engine import Engine, SamplingParams
    from sparrow.stages.model.loading import load_model

    loaded = load_model(args.model, device="cuda", dtype=torch.bfloat16, random_weights=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.config.vocab_size, (args.context,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, n=args.samples, ignore_eos=True)
    dev = torch.cuda.current_device()
    before, failed = torch.cuda.memory_allocated(dev), False
    for i in range(args.engines):
        t0 = time.perf_counter()
        engine = Engine(loaded.model, as_policy(2048 if i % 2 else None),
                        EngineConfig(max_batch=args.samples))
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("run").add_argument("argv", nargs=argparse.REMAINDER)
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
    return engines(args)


if __name__ == "__main__":
    sys.exit(main())
