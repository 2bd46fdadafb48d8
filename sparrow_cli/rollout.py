"""`sparrow rollout`: batched sampling with the schedule's sparse attention, to a rollouts artifact."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .common import (
    LogProgress,
    UsageError,
    check_device,
    check_output,
    console,
    force_option,
    friendly_errors,
    input_path,
    output_help,
    raw_prompts_option,
    warn_first_token_stops,
)
from .engine_options import (
    check_gpu_memory,
    eviction_from_flags,
    gpu_memory_option,
    kv_budget_option,
    kv_buffer_option,
    kv_compression_option,
    kv_window_option,
)
from .output import emit_record, format_option, resolve_format

SUMMARY_LABELS = {"tokens": "generated tokens", "seconds": "seconds (total)",
                  "prefill_seconds": "  prefill seconds", "decode_seconds": "  decode seconds",
                  "tokens_per_s": "tokens / s", "mean_budget": "mean budget (sparse tokens)",
                  "dense_fraction": "dense tokens (fraction)", "stop_fraction": "stopped at EOS (fraction)",
                  "reward_mean": "mean reward",
                  "preemptions": "preemptions (KV pool full, recomputed)", "kv_policy": "KV policy",
                  "kv_tokens_peak": "KV tokens held (fullest step)",
                  "kv_tokens_mean": "KV tokens held (mean step)",
                  "dense_kv_tokens_peak": "  dense would hold (fullest step)",
                  "dense_kv_tokens_mean": "  dense would hold (mean step)",
                  "kv_saved": "KV storage saved (fraction)", "peak_pages": "pool pages in use (fullest step)",
                  "compactions": "KV compressions"}
# the text formats' word for a null (JSON keeps the null)
SUMMARY_RENDER = {"mean_budget": lambda v: "dense" if v is None else f"{v:g}",
                  "reward_mean": lambda v: "no scorer" if v is None else f"{v:.6g}",
                  "kv_saved": lambda v: "-" if v is None else f"{v:.3f}"}


def _sparsity(schedule: Path | None, budget: int | None, dense: bool, model: str):
    """The one sparsity spec the user gave (None = dense), validated for the engine's pages and, for a
    schedule, for `model`'s shape; one sentence on error."""
    from sparrow.stages.attention import PAGE_SIZE
    from sparrow.stages.core.sparsity import sparsity_from_flags
    from sparrow.stages.model.config import ModelSpecError
    from sparrow.stages.model.loading import resolve_config

    try:
        cfg = resolve_config(model)
    except ModelSpecError:
        cfg = None  # the model's own error comes when it loads
    try:
        return sparsity_from_flags(schedule, budget, dense, PAGE_SIZE, cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_vllm_flags(schedule, budget, lora, top_k: int, top_p: float, kv_compression=None) -> None:
    """What vLLM cannot do is refused in one sentence, and a missing extra says how to install it,
    before anything loads."""
    from sparrow.stages.backends.vllm_sampler import VllmMissing, require_vllm

    if schedule is not None or budget is not None or kv_compression is not None:
        raise UsageError("--budget, --schedule and --kv-compression need --engine ours: vLLM samples with "
                         "dense attention only")
    if lora is not None:
        raise UsageError("--adapter is not supported with --engine vllm; merge the adapter into a "
                         "checkpoint directory or use --engine ours")
    if top_k or top_p < 1:
        raise UsageError("--top-k/--top-p are not supported with --engine vllm: it reports logprobs of the "
                         "truncated distribution, not the full one that the rollouts artifact stores")
    try:
        require_vllm()
    except VllmMissing as e:
        raise UsageError(str(e)) from None


def _rollout_vllm(model: str, prompt_set, output: Path, fmt: str, cfg, device: str, dtype: str,
                  max_batch: int, sampling, raw_prompts: bool = False) -> None:
    """Dense sampling with vLLM into the same rollouts artifact (budget 0 for every token)."""
    from sparrow.schemas import input_name, write_artifact
    from sparrow.stages.attention import PAGE_SIZE
    from sparrow.stages.backends.vllm_sampler import run_vllm_rollouts, vllm_checkpoint
    from sparrow.stages.model.loading import _dir_tokenizer, model_name

    checkpoint = vllm_checkpoint(model)
    tokenizer = _dir_tokenizer(checkpoint)
    if prompt_set.needs_tokenizer:
        prompt_set.tokenize(tokenizer, not raw_prompts)
        prompt_set.check_fits(cfg.vocab_size, cfg.max_position_embeddings, sampling.max_new_tokens)
    rows = prompt_set.rows
    longest = max(len(r["prompt_token_ids"]) for r in rows)
    console.print(f"starting vLLM on {checkpoint} ({dtype}; 1-4 minutes on a small CPU)")
    table, summary, timing = run_vllm_rollouts(
        model, rows, sampling, tokenizer=tokenizer, eos_ids=cfg.eos_token_ids, max_batch=max_batch,
        max_model_len=min(cfg.max_position_embeddings, longest + sampling.max_new_tokens), dtype=dtype)
    write_artifact(table, output, "rollouts", metadata={
        "model": model_name(model), "prompts": input_name(prompt_set.path), "sparsity": "dense",
        "engine": "vllm",
        "samples": sampling.n, "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature, "top_p": 1.0, "top_k": 0, "seed": sampling.seed,
        "seed_scope": "vLLM global seed (per-request seeds fail on the CPU)",
        "ignore_eos": sampling.ignore_eos, "page_size": PAGE_SIZE, "device": device, "dtype": dtype,
        "lora": "", "vllm_startup_seconds": round(timing.startup_s, 2), "summary": summary.metadata()})
    warn_first_token_stops([len(t) for t in table.column("token_ids").to_pylist()],
                           sampling.max_new_tokens, raw_prompts)
    console.print(f"wrote {table.num_rows} rollouts to {output} (vLLM start-up {timing.startup_s:.0f} s)")
    emit_record(summary.metadata(), fmt, title="rollouts (dense, vLLM)", labels=SUMMARY_LABELS,
                render=SUMMARY_RENDER)


@friendly_errors
def rollout(
    model: str = typer.Option("smollm2-135m", "--model", help="Preset, checkpoint dir or .gguf."),
    prompts: Path = typer.Option(..., "--prompts", callback=input_path, help="A prompts artifact (sparrow "
                                 "prompts; - = stdin), or any Parquet or JSONL file with its columns "
                                 "(token ids or text)."),
    raw_prompts: bool = raw_prompts_option(),
    schedule: Path = typer.Option(None, "--schedule", callback=input_path,
                                  help="A schedule artifact (sparrow plan-schedule)."),
    budget: int = typer.Option(None, "--budget", help="A fixed budget in tokens (multiple of 16, "
                               "at least 48)."),
    dense: bool = typer.Option(False, "--dense", help="Dense attention (the default)."),
    kv_compression: str = kv_compression_option(),
    kv_budget: int = kv_budget_option(),
    kv_window: int = kv_window_option(),
    kv_buffer: int = kv_buffer_option(),
    samples: int = typer.Option(1, "--samples", help="Samples per prompt (they share one prefill)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    temperature: float = typer.Option(1.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: int = typer.Option(0, "--seed"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Always generate --max-new-tokens."),
    max_batch: int = typer.Option(16, "--max-batch", help="Samples decoded together."),
    kv_pages: int = typer.Option(None, "--kv-pages", help="KV cache pool in pages of 16 tokens (default: "
                                 "room for every sample at full length). A smaller pool allocates pages as "
                                 "samples grow and preempts (then recomputes) the latest sample when full: "
                                 "less memory, some recompute, and in fp32 the same tokens."),
    lora: Path = typer.Option(None, "--adapter", "--lora", help="A peft LoRA adapter directory (e.g. "
                              "`sparrow train`'s RUN/adapter), merged into the weights."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (bf16, Triton kernels, CUDA graphs)."),
    dtype: str = typer.Option("auto", "--dtype", help="Weights and KV cache: auto (bfloat16 on cuda, "
                              "float32 on cpu), float32 or bfloat16. bfloat16 decodes about 1.5x faster on "
                              "a CPU with AVX512-BF16; float32 matches teacher-forced scoring exactly."),
    eager: bool = typer.Option(False, "--eager", help="On cuda, run the decode step eagerly instead of "
                               "replaying CUDA graphs: the same step and tokens (for debugging; slower)."),
    gpu_memory_utilization: float = gpu_memory_option(),
    max_num_batched_tokens: int = typer.Option(8192, "--max-num-batched-tokens", help="The most prompt "
                                               "tokens one prefill forward takes (vLLM's name); longer "
                                               "prompts are prefilled in chunks of this many."),
    workers: int = typer.Option(0, "--workers", help="Ray workers, each a process with the model loaded "
                                "once, sharing the prompts by index (0 = this process). -o is then a "
                                "directory of one Parquet part per worker, read as one artifact."),
    ray_address: str = typer.Option(None, "--ray-address", help="An existing Ray cluster (e.g. "
                                    "ray://head:10001 or auto); default: a local Ray started for the run."),
    output: Path = typer.Option(..., "-o", "--output", help=output_help("the rollouts artifact")),
    force: bool = force_option(),
    engine: str = typer.Option("ours", "--engine", help="ours (dense, budget or schedule) or vllm (dense "
                               "only; the optional extra .\\[vllm])."),
    format: str = format_option(),
) -> None:
    """Generate K samples per prompt with dense, fixed-budget or scheduled block top-k sparse attention,
    or a compressed KV cache (--kv-compression): tokens, sampled-token logprobs, the budget of every
    token, the KV tokens each token read, finish reason and the task's reward. The summary (tokens/s,
    mean budget, KV tokens held against dense, reward) goes to stdout and into the artifact's metadata
    ("summary"). With --workers N the same rollouts (same seeds) come from N Ray workers."""
    import torch

    from sparrow.schemas import input_name, write_artifact
    from sparrow.stages.attention import PAGE_SIZE
    from sparrow.stages.core.prompt_set import PromptSet
    from sparrow.stages.engine import DecodeStep, SamplingParams
    from sparrow.stages.model.loading import (
        DTYPES,
        load_model,
        model_name,
        resolve_config,
        resolve_dtype,
        spec_tokenizer,
    )
    from sparrow.stages.rollout import RolloutOptions, run_rollouts

    from .profile import load_actor

    fmt = resolve_format(format)
    if engine not in ("ours", "vllm"):
        raise UsageError(f"--engine must be ours or vllm, got {engine!r}")
    if engine == "vllm":
        _check_vllm_flags(schedule, budget, lora, top_k, top_p, kv_compression)
    sparsity = _eviction(kv_compression, kv_budget, kv_window, kv_buffer, model,
                         {"--budget": budget, "--schedule": schedule, "--dense": dense})
    if sparsity is None:
        sparsity = _sparsity(schedule, budget, dense, model)
    for flag, value in (("--samples", samples), ("--max-new-tokens", max_new_tokens),
                        ("--max-batch", max_batch), ("--kv-pages", 1 if kv_pages is None else kv_pages),
                        ("--max-num-batched-tokens", max_num_batched_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    check_gpu_memory(gpu_memory_utilization)
    if temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {top_k}")
    check_device(device, remote=bool(ray_address))
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    dtype_name = str(resolve_dtype(dtype, device)).removeprefix("torch.")
    check_workers(workers, ray_address, output)
    check_output(output, "rollouts", force, parts=bool(workers))
    cfg = resolve_config(model)
    adapter = load_actor(lora, cfg, model)  # one sentence for a bad adapter, before any weights load
    prompt_set = PromptSet.read(prompts)
    prompt_set.check_rewards()
    prompt_set.check_fits(cfg.vocab_size, cfg.max_position_embeddings, max_new_tokens)  # before weights
    if kv_pages is not None and engine == "vllm":
        raise UsageError("--kv-pages sizes our engine's pool; vLLM sizes its own (VLLM_CPU_KVCACHE_SPACE)")
    if engine == "vllm":
        return _rollout_vllm(model, prompt_set, output, fmt, cfg, device, dtype_name, max_batch,
                             SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                            n=samples, ignore_eos=ignore_eos), raw_prompts)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=seed, n=samples, ignore_eos=ignore_eos)
    opts = RolloutOptions(sampling=sampling, max_batch=max_batch, sparsity=sparsity,
                          lora=adapter, kv_pages=kv_pages,
                          decode_step=DecodeStep.EAGER if eager and device.startswith("cuda")
                          else DecodeStep.AUTO,
                          gpu_memory_utilization=gpu_memory_utilization,
                          max_prefill_tokens=max_num_batched_tokens)
    mode = ("dense" if sparsity is None else f"budget {sparsity}" if isinstance(sparsity, int)
            else f"schedule {schedule}" if schedule is not None else sparsity.spec())
    meta = {"model": model_name(model), "prompts": input_name(prompts), "sparsity": mode, "samples": samples,
            "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "seed": seed, "ignore_eos": ignore_eos, "page_size": PAGE_SIZE, "device": device,
            "dtype": dtype_name, "engine": "ours", "lora": str(lora) if lora else ""}
    if workers:  # this process only tokenizes: the weights load in the workers
        if prompt_set.needs_tokenizer:
            prompt_set.tokenize(spec_tokenizer(model), not raw_prompts)
            prompt_set.check_fits(cfg.vocab_size, cfg.max_position_embeddings, max_new_tokens)
        _check_kv_pages(kv_pages, prompt_set.rows, max_new_tokens, sparsity)
        summary, n = _rollout_on_ray(model, prompt_set.rows, opts, workers, ray_address, device, dtype_name,
                                     meta, output)
        console.print(f"wrote {n} rollouts in {workers} parts to {output}/")
        emit_record(summary.metadata(), fmt, title=f"rollouts ({mode}, {workers} workers)",
                    labels=SUMMARY_LABELS, render=SUMMARY_RENDER)
        return
    loaded = load_model(model, device=device, dtype=getattr(torch, dtype_name))
    if prompt_set.needs_tokenizer:
        prompt_set.tokenize(loaded.tokenizer, not raw_prompts)
        prompt_set.check_fits(cfg.vocab_size, cfg.max_position_embeddings, max_new_tokens)
    rows = prompt_set.rows
    _check_kv_pages(kv_pages, rows, max_new_tokens, sparsity)

    total = len(rows) * samples
    start = time.perf_counter()
    state = {"tokens": 0, "done": 0}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("rollouts (samples)", total=total, rate="")
        log = LogProgress("rollouts (samples)")

        def on_step(new_tokens: int, finished: int) -> None:
            state["tokens"] += new_tokens
            state["done"] += finished
            rate = state["tokens"] / max(time.perf_counter() - start, 1e-9)
            info = f"{state['tokens']} tokens, {rate:,.1f} tok/s"
            bar.update(task, completed=state["done"], rate=info)
            log(state["done"], total, info)

        table, summary = run_rollouts(loaded, rows, opts, on_step)
    write_artifact(table, output, "rollouts", metadata={**meta, "summary": summary.metadata()})
    warn_first_token_stops([len(t) for t in table.column("token_ids").to_pylist()], max_new_tokens,
                           raw_prompts)
    console.print(f"wrote {table.num_rows} rollouts to {output}")
    emit_record(summary.metadata(), fmt, title=f"rollouts ({mode})", labels=SUMMARY_LABELS,
                render=SUMMARY_RENDER)



def _eviction(kind, budget, window, buffer, model: str, block_topk: dict):
    """The --kv-compression policy (None: not given), checked against the model's context."""
    from sparrow.stages.model.config import ModelSpecError
    from sparrow.stages.model.loading import resolve_config

    cfg = None  # the model's own error comes when it loads
    if kind is not None:  # the model's context is needed only to check a compression
        try:
            cfg = resolve_config(model)
        except ModelSpecError:
            pass
    return eviction_from_flags(kind, budget, window, buffer, cfg, block_topk)


def _check_kv_pages(kv_pages: int | None, rows: list[dict], max_new_tokens: int, sparsity=None) -> None:
    """One sample of the longest prompt at full length (a compressed cache's longest, under eviction)
    must fit in the pool (before any work)."""
    from sparrow.stages.attention import PAGE_SIZE
    from sparrow.stages.engine.memory import Workload
    from sparrow.stages.kv_policies import Eviction

    if kv_pages is None:
        return
    longest = max(len(r["prompt_token_ids"]) for r in rows)
    work = [(longest, 1, max_new_tokens) + ((sparsity,) if isinstance(sparsity, Eviction) else ())]
    need = Workload.of(work, 1, PAGE_SIZE).one_sample()
    if need > kv_pages:
        raise UsageError(f"--kv-pages {kv_pages} is too small: one sample of the longest prompt ({longest} "
                         f"tokens) with --max-new-tokens {max_new_tokens} needs {need} pages")


def check_workers(workers: int, ray_address: str | None, output: Path | None) -> None:
    """--workers/--ray-address: a count, Ray installed, and -o (when the parts go there) a directory; one
    sentence otherwise, before any work. Shared by rollout, profile and train."""
    from sparrow.stages.backends.ray_pool import RayMissing, require_ray

    if workers < 0:
        raise UsageError(f"--workers must be >= 0, got {workers}")
    if ray_address and not workers:
        raise UsageError("--ray-address was given without --workers")
    if not workers:
        return
    try:
        require_ray()
    except RayMissing as e:
        raise UsageError(str(e)) from None
    if output is not None and output.is_file():
        raise UsageError(f"-o {output} is a file, but --workers writes a directory of Parquet parts")


def _rollout_on_ray(model: str, rows: list[dict], opts, workers: int, address: str | None, device: str,
                    dtype: str, meta: dict, output: Path):
    """Rollouts of `rows` on a pool of Ray workers, written as one part per shard; (summary, rows)."""
    from sparrow.schemas import write_artifact_parts
    from sparrow.stages.backends.ray_pool import RolloutPool, merge_summaries

    total = len(rows) * opts.sampling.n
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(f"starting {workers} Ray workers", total=total)
        pool = RolloutPool(model, workers, address=address, device=device, dtype=dtype)
        try:
            bar.update(task, description=f"rollouts (samples) on {workers} workers")
            start = time.perf_counter()
            log, done = LogProgress(f"rollouts (samples) on {workers} workers"), [0]

            def on_shard(r) -> None:
                done[0] += r.table.num_rows
                bar.advance(task, r.table.num_rows)
                log(done[0], total)

            results = pool.run(rows, opts, on_shard=on_shard)
            wall = time.perf_counter() - start
        finally:
            pool.close()
    summary = merge_summaries(results, wall)
    parts_meta = [{**meta, "summary": summary.metadata(), "part": r.shard, "parts": len(results),
                   "part_summary": r.summary.metadata(), "worker_pid": r.worker_pid, "attempts": r.attempts}
                  for r in results]
    write_artifact_parts([r.table for r in results], output, "rollouts", parts_meta)
    return summary, sum(r.table.num_rows for r in results)
