"""`sparrow rollout`: batched sampling with the schedule's sparse attention, to a rollouts artifact."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .console import console, stdout_taken
from .data_options import (
    answer_column_option,
    data_options,
    filter_overlong_option,
    max_prompt_length_option,
    prompt_column_option,
    prompt_length,
    reward_fn_option,
    reward_kwargs_option,
    reward_option,
    truncation_option,
)
from .errors import UsageError, friendly_errors
from .messages import note, warn
from .option_values import (
    check_device,
    check_max_prompts,
    max_prompts_option,
    on_a_cluster,
    raw_prompts_option,
    warn_first_token_stops,
)
from .options import (
    SAMPLE_SEED_HELP,
    capped_speculate,
    check_budget_reach,
    check_gpu_memory,
    check_has_weights,
    check_host_memory,
    check_sampling_memory,
    check_speculative_schedule,
    check_workers,
    code_rewards,
    device_option,
    distilled_adapter,
    finite,
    given_path,
    gpu_memory_option,
    kv_budget_option,
    kv_buffer_option,
    kv_compression_option,
    kv_window_option,
    load_actor,
    model_file,
    non_negative_seed,
    output_path,
    set_threads,
    sparsity_policy,
    threads_option,
    top_k_option,
    top_p_option,
    unsafe_code_option,
)
from .output import emit_record, format_option, resolve_format
from .paths import FORCE_HELP, check_output, input_path, output_help
from .progress import LogProgress, live_progress, say_loading

SUMMARY_LABELS = {"tokens": "generated tokens", "seconds": "seconds (sampling)",
                  "prefill_seconds": "  prefill seconds", "decode_seconds": "  decode seconds",
                  "reward_seconds": "reward seconds (scoring)",
                  "tokens_per_s": "tokens / s (prefill included)",
                  "mean_budget": "mean budget (sparse tokens)",
                  "dense_fraction": "dense tokens (fraction)", "stop_fraction": "stopped at EOS (fraction)",
                  "reward_mean": "mean reward",
                  "preemptions": "preemptions (KV pool full, recomputed)", "kv_policy": "KV policy",
                  "kv_tokens_peak": "KV tokens held (fullest step)",
                  "kv_tokens_mean": "KV tokens held (mean step)",
                  "dense_kv_tokens_peak": "  dense would hold (fullest step)",
                  "dense_kv_tokens_mean": "  dense would hold (mean step)",
                  "kv_saved": "KV storage saved (fraction)", "peak_pages": "pool pages in use (fullest step)",
                  "compactions": "KV compressions", "speculative_cycles": "speculative cycles",
                  "sample_cycles": "  samples' cycles", "drafted_tokens": "  drafts proposed",
                  "accepted_drafts": "  drafts kept (dense verification)",
                  "acceptance": "  acceptance (kept / proposed)",
                  "tokens_per_cycle": "  tokens per sample's cycle",
                  "resumed_prompts": "prompts kept from the interrupted run (--resume)"}
# every text format's word for a dense run's mean budget (JSON keeps the null), as other commands say dense
SUMMARY_WORDS = {"mean_budget": lambda v: "dense" if v is None else v}
# the table's alone, for the eye: csv and tsv write a float whole and a null as their null
SUMMARY_READING = {"mean_budget": lambda v: "dense" if v is None else f"{v:g}",
                   "reward_mean": lambda v: "no scorer" if v is None else f"{v:.6g}",
                   "kv_saved": lambda v: "-" if v is None else f"{v:.3f}"}


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


@friendly_errors
def rollout(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", "--model", help="Preset, checkpoint dir or .gguf."),
    prompts: Path = typer.Option(..., "--prompts", callback=input_path, parser=given_path("--prompts"),
                                 metavar="<path>", help="A prompts artifact (sparrow "
                                 "prompts; - = stdin), any Parquet or JSONL file with its columns (token ids "
                                 "or text), or a verl or TRL dataset (Parquet, JSONL or a save_to_disk "
                                 "folder; docs/datasets.md)."),
    raw_prompts: bool = raw_prompts_option(),
    max_prompts: int = max_prompts_option(),
    max_prompt_length: int = max_prompt_length_option(),
    truncation: str = truncation_option(),
    filter_overlong_prompts: bool = filter_overlong_option(),
    prompt_column: str = prompt_column_option(),
    answer_column: str = answer_column_option(),
    reward: str = reward_option(),
    reward_fn: str = reward_fn_option(),
    reward_kwargs: str = reward_kwargs_option(),
    unsafe_code_execution: bool = unsafe_code_option(),
    schedule: Path = typer.Option(None, "--schedule", callback=input_path, parser=given_path("--schedule"),
                                  metavar="<path>", help="A schedule artifact (sparrow plan-schedule)."),
    budget: int = typer.Option(None, "--budget", help="A fixed budget in tokens (multiple of 16, "
                               "at least 48)."),
    dense: bool = typer.Option(False, "--dense/--no-dense", show_default=False,
                               help="Dense attention, as without --budget, --schedule or --kv-compression; "
                               "--no-dense, the default, leaves the choice to them."),
    kv_compression: str = kv_compression_option(),
    kv_budget: int = kv_budget_option(),
    kv_window: int = kv_window_option(),
    kv_buffer: int = kv_buffer_option(),
    samples: int = typer.Option(1, "--samples", help="Samples per prompt (they share one prefill; vLLM's n). "
                                "Default 1, a plain generation as vLLM's; profile, train and distill "
                                "sample a group of 4 per prompt."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Tokens generated at most per sample "
                                       "(vLLM's max_tokens)."),
    temperature: float = typer.Option(1.0, "--temperature", callback=finite, help="Sampling temperature, "
                                      ">= 0 (0 = greedy: the most likely token at every step)."),
    top_p: float = top_p_option(" Not with --engine vllm."),
    top_k: int = top_k_option(" Not with --engine vllm."),
    seed: int = typer.Option(0, "--seed", callback=non_negative_seed, help=SAMPLE_SEED_HELP),
    ignore_eos: bool = typer.Option(False, "--ignore-eos/--no-ignore-eos",
                                    help="Always generate --max-new-tokens."),
    max_batch: int = typer.Option(16, "--max-num-seqs", "--max-batch", help="Sequences (samples) decoded "
                                  "together (vLLM's name)."),
    kv_pages: int = typer.Option(None, "--kv-pages", help="KV cache pool in pages of 16 tokens (default: "
                                 "room for every sample at full length). A smaller pool allocates pages as "
                                 "samples grow and preempts (then recomputes) the latest sample when full: "
                                 "less memory, some recompute, and in fp32 the same tokens."),
    lora: Path = typer.Option(None, "--adapter", "--lora", help="A peft LoRA adapter directory (e.g. "
                              "`sparrow train`'s RUN/adapter), merged into the weights; a sparse actor's "
                              "(sparrow distill's) only with --budget or --schedule."),
    device: str = device_option(also=" On cuda: bfloat16, Triton kernels, CUDA graphs."),
    dtype: str = typer.Option("auto", "--dtype", help="Weights and KV cache: auto (bfloat16 on cuda, "
                              "float32 on cpu), float32 or bfloat16. bfloat16 decodes faster on a CPU that "
                              "runs our C++ kernels (AVX512-BF16 or AVX2; docs/benchmarks.md); float32 "
                              "matches teacher-forced scoring to "
                              "about 1e-4."),
    eager: bool = typer.Option(False, "--eager/--no-eager", "--enforce-eager",
                               help="On cuda, run the decode step eagerly instead of "
                               "replaying CUDA graphs: the same step and tokens (for debugging; slower)."),
    gpu_memory_utilization: float = gpu_memory_option(),
    max_num_batched_tokens: int = typer.Option(8192, "--max-num-batched-tokens", help="The most prompt "
                                               "tokens one prefill forward takes (vLLM's name); longer "
                                               "prompts are prefilled in chunks of this many."),
    speculate: int = typer.Option(0, "--speculate", "--num-speculative-tokens",
                                  help="Exact speculative decoding (vLLM's "
                                  "num_speculative_tokens): the sparse attention of --budget/--schedule "
                                  "drafts up to K tokens per sample, one dense forward verifies them "
                                  "and rejection sampling keeps the dense model's law. The rollouts are "
                                  "dense samples (dense logprobs, budget 0); the artifact records per token "
                                  "whether it was a kept draft. 0 = off."),
    workers: int = typer.Option(0, "--workers", help="Ray workers, each a process with the model loaded "
                                "once, sharing the prompts by index (0 = this process). -o is then a "
                                "directory of one Parquet part per worker, read as one artifact."),
    ray_address: str = typer.Option(None, "--ray-address", help="An existing Ray cluster (e.g. "
                                    "ray://head:10001 or auto); default: a local Ray started for the run."),
    output: Path = typer.Option(..., "-o", "--output", help=output_help("the rollouts artifact"),
                                parser=output_path()),
    force: bool = typer.Option(False, "--force/--no-force", help=FORCE_HELP + " Also starts over an "
                               "interrupted run's journal (OUT.partial/, beside -o) instead of refusing it."),
    resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue the run that an interruption "
                                "(Ctrl-C, SIGTERM, a crash, a lost machine) stopped: the prompts finished in "
                                "its journal OUT.partial/ are kept and the rest are sampled with the seeds "
                                "they had, when every flag that decides the samples is the same "
                                "(docs/resume.md). Our engine in this process only."),
    checkpoint_interval: float = typer.Option(None, "--checkpoint-interval", callback=finite,
                                              show_default=False, metavar="SECONDS", help="How often the "
                                              "prompts whose samples have all finished are journaled in "
                                              "OUT.partial/, beside -o, for --resume (default 60; 0 = as "
                                              "each prompt finishes); the folder is removed when the run "
                                              "completes."),
    engine: str = typer.Option("ours", "--engine", help="ours (dense, budget or schedule) or vllm (dense "
                               "only; the optional extra .\\[vllm])."),
    threads: int = threads_option(),
    format: str = format_option(),
) -> None:
    """Generate K samples per prompt with dense, fixed-budget or scheduled block top-k sparse attention,
    or a compressed KV cache (--kv-compression): tokens, sampled-token logprobs, the budget of every
    token, the KV tokens the cache held at each token, finish reason and the task's reward (or --reward's, or
    --reward-fn's with the extra fields it returns). The summary (tokens/s,
    mean budget, KV tokens held against dense, reward) goes to stdout and into the artifact's metadata
    ("summary"). With --workers N the same rollouts (same seeds) come from N Ray workers. A run of our
    engine in this process journals its finished prompts in OUT.partial/ as it goes; an interrupted run
    continues from there with --resume."""
    set_threads(threads)
    from sparrow.schemas import input_name
    from sparrow.stages.backends.vllm_sampler import vllm_checkpoint
    from sparrow.stages.core.prompt_set import PromptSet
    from sparrow.stages.engine import DecodeStep, SamplingParams
    from sparrow.stages.model.loading import canonical_dtype, resolve_config, resolve_dtype
    from sparrow.stages.rollout import (
        RolloutOptions,
        RolloutRun,
        write_rollouts,
        write_rollouts_on_ray,
        write_rollouts_with_vllm,
    )

    fmt = resolve_format(format)
    engine = engine.lower()  # as --format, --task and --reward take any case
    if engine not in ("ours", "vllm"):
        raise UsageError(f"--engine must be ours or vllm, got {engine!r}")
    journaled = _check_journal_flags(resume, checkpoint_interval, workers, engine, output)
    _check_speculate(speculate, engine, kv_compression, schedule is not None or budget is not None)
    if engine == "vllm":
        _check_vllm_flags(schedule, budget, lora, top_k, top_p, kv_compression)
    kv = (kv_compression, kv_budget, kv_window, kv_buffer)
    policy = sparsity_policy(schedule, budget, dense, kv, model)
    _check_sparse_actor(lora, policy, speculate)
    for flag, value in (("--samples", samples), ("--max-new-tokens", max_new_tokens),
                        ("--max-num-seqs", max_batch), ("--kv-pages", 1 if kv_pages is None else kv_pages),
                        ("--max-num-batched-tokens", max_num_batched_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    check_max_prompts(max_prompts)
    notes: list[str] = []  # said once every check passed, so that a refusal is its one line
    speculate = capped_speculate(speculate, max_new_tokens, notes.append)
    check_speculative_schedule(schedule, speculate, say=notes.append)
    check_gpu_memory(gpu_memory_utilization)
    if temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {temperature}")
    from sparrow.stages.engine.sequence import TEMPERATURE_FLOOR, below_temperature_floor

    if below_temperature_floor(temperature):
        raise UsageError(f"--temperature {TEMPERATURE_FLOOR}, got {temperature}")
    if not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {top_p}")
    check_device(device, remote=on_a_cluster(workers, ray_address))
    try:
        dtype = canonical_dtype(dtype)
    except ValueError as e:
        raise UsageError(str(e)) from None
    dtype_name = str(resolve_dtype(dtype, device)).removeprefix("torch.")
    check_workers(workers, ray_address, output)
    if workers and reward_fn:
        raise UsageError("--reward-fn runs in this process, not in Ray workers; roll out with --workers and "
                         "score the rollouts with sparrow reward --reward-fn")
    data = data_options(answer_column, reward, reward_fn, reward_kwargs,
                        prompt_length(max_prompt_length, truncation, filter_overlong_prompts), prompt_column)
    check_output(output, "rollouts", force, parts=bool(workers),
                 inputs={"--prompts": prompts, "--schedule": schedule, "--adapter": lora,
                         "--model": model_file(model)})
    if journaled:
        from sparrow.stages.rollout_journal import check_folder

        check_folder(output, resume, force)
    cfg = resolve_config(model)
    check_has_weights(model)
    adapter = load_actor(lora, cfg, model)  # one sentence for a bad adapter, before any weights load
    prompt_set = PromptSet.read(prompts, data, max_prompts)
    code_rewards(ctx, unsafe_code_execution)
    prompt_set.check_rewards()
    if prompt_set.needs_tokenizer_for(model):  # ids made for another tokenizer are made again from the text
        from sparrow.stages.model.loading import spec_tokenizer

        prompt_set.match_model(model, spec_tokenizer(model), not raw_prompts)
    from sparrow.stages.core.notes import muted

    with muted():  # what it left out or cut is said below, once every check has passed
        prompt_set.check_fits(cfg.vocab_size, cfg.max_position_embeddings, max_new_tokens)  # before weights
    lengths = (None if prompt_set.needs_tokenizer else
               [len(r.get("prompt_token_ids") or ()) for r in prompt_set.rows])
    check_budget_reach(budget, speculate, lengths, max_new_tokens, notes.append)
    total = len(prompt_set.rows) * samples
    hint = "roll out fewer samples per call, or fewer prompts (--max-prompts, or several prompt files)"
    check_host_memory(total, f"{total:,} samples (--samples {samples} for {len(prompt_set.rows)} prompts)",
                      hint)
    check_sampling_memory([len(r.get("prompt_token_ids") or ()) for r in prompt_set.rows], samples,
                          max_new_tokens, cfg.vocab_size, hint)
    _check_tokenizer(model, prompt_set)
    if kv_pages is not None and engine == "vllm":
        raise UsageError("--kv-pages sizes our engine's pool; vLLM sizes its own (VLLM_CPU_KVCACHE_SPACE)")
    _warn_unscored_tasks(prompt_set)
    for line in prompt_set.length_notes + notes:
        note(line)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=seed, n=samples, ignore_eos=ignore_eos)
    opts = RolloutOptions(sampling=sampling, max_batch=max_batch, policy=policy,
                          lora=adapter, kv_pages=kv_pages,
                          decode_step=DecodeStep.EAGER if eager and device.startswith("cuda")
                          else DecodeStep.AUTO,
                          gpu_memory_utilization=gpu_memory_utilization,
                          max_prefill_tokens=max_num_batched_tokens, speculate=speculate)
    mode = (f"schedule {input_name(schedule)}" if schedule is not None
            else policy.spec().replace("budget:", "budget "))
    if speculate:
        mode = f"speculative, {mode} drafts {speculate} a cycle"
    if workers > len(prompt_set.rows):  # a worker per prompt at most: each loads the model
        note(f"--workers {workers} is capped at the {len(prompt_set.rows)} prompts: a worker with none would "
             "load the model for nothing")
        workers = len(prompt_set.rows)
    run = RolloutRun(model, prompts, mode, output, device, dtype_name, lora, workers, ray_address,
                     reward=reward, reward_fn=reward_fn, reward_kwargs=data.reward_kwargs,
                     raw_prompts=raw_prompts, resume=resume, force=force,
                     checkpoint_interval=60.0 if checkpoint_interval is None else checkpoint_interval)
    if engine == "vllm":
        console.print(f"starting vLLM on {vllm_checkpoint(model)} ({dtype_name}; 1-4 minutes on a small CPU)")
        with _progress(None, 0, rate=False) as bars:
            table, summary, timing = write_rollouts_with_vllm(  # top-k/top-p refused: the defaults
                prompt_set, sampling, run, max_batch, not raw_prompts, on_scored=bars.scored)
        warn_first_token_stops(_lengths(table), max_new_tokens, raw_prompts)
        console.print(f"wrote {table.num_rows} rollouts to {output} (vLLM start-up {timing.startup_s:.0f} s)")
        return _print_summary(summary, fmt, "dense, vLLM")
    if workers:
        with _progress(f"rollouts (samples) on {workers} workers", total, rate=False) as bars:
            summary, n = write_rollouts_on_ray(run, prompt_set, opts, not raw_prompts,
                                               lambda r: bars.advance(r.table.num_rows, 0))
        console.print(f"wrote {n} rollouts in {workers} parts to {output}/")
        _warn_uncompressed(policy, summary)
        return _print_summary(summary, fmt, f"{mode}, {workers} workers")
    from sparrow.stages.rollout_journal import AlreadyComplete

    try:
        with _progress("rollouts (samples)", total, rate=True, most_tokens=max_new_tokens,
                       exact=ignore_eos) as bars:
            table, summary = write_rollouts(run, prompt_set, opts, not raw_prompts,
                                            lambda new, finished: bars.advance(finished, new),
                                            on_loading=lambda longest: _say_loading(model, device, longest),
                                            on_scored=bars.scored,
                                            on_tokenizing=_say_tokenizing,
                                            on_resume=lambda found: _say_resuming(found, bars, samples))
    except AlreadyComplete as done:
        return console.print(str(done), highlight=False)
    warn_first_token_stops(_lengths(table), max_new_tokens, raw_prompts)
    n = summary.resumed_prompts
    kept = f" ({n} prompt{'s' * (n != 1)} from the interrupted run)" if n else ""
    console.print(f"wrote {table.num_rows} rollouts to {output}{kept}")
    _warn_uncompressed(policy, summary)
    _print_summary(summary, fmt, mode)


def _check_journal_flags(resume: bool, interval: float | None, workers: int, engine: str, output: Path
                         ) -> bool:
    """Whether the run keeps a journal beside -o (our engine in this process, to a file), with --resume
    and --checkpoint-interval refused where it keeps none."""
    from sparrow.schemas.locations import is_stdio

    if interval is not None and interval < 0:
        raise UsageError(f"--checkpoint-interval must be >= 0 seconds (0 = as each prompt finishes), got "
                         f"{interval:g}")
    why = ("--workers runs in Ray workers, which keep no journal" if workers else
           "--engine vllm keeps no journal" if engine == "vllm" else
           "-o - (stdout) has no folder beside it for one" if is_stdio(output) else None)
    if why is None:
        return True
    for given, flag in ((resume, "--resume"), (interval is not None, "--checkpoint-interval")):
        if given:
            raise UsageError(f"{flag} needs the journal that our engine keeps in this process beside -o "
                             f"(OUT.partial/), and {why}; drop {flag}")
    return False


def _say_resuming(found, bars: _Bars, samples: int) -> None:
    """What --resume found, said before the work starts; the progress then starts at the kept samples."""
    for line in found.notes:
        note(line)
    if not found.kept:
        note(f"--resume: {found.folder}/ holds no finished prompt of an interrupted run (or is not there), "
             "so there is nothing to resume: the run starts from the first prompt")
        return
    n = found.unscored
    first = f"; the rewards of {n} of the done prompts are scored first" if n else ""
    console.print(f"resuming {found.folder}/: {found.kept} of {found.total} prompts done, "
                  f"{found.total - found.kept} to go{first}", highlight=False)
    bars.skip(found.kept * samples)


def _check_tokenizer(model: str, prompt_set) -> None:
    """A model without a tokenizer cannot read text prompts, and its samples have no text, so a task's
    scorer cannot reward them."""
    from sparrow.stages.model.loading import has_tokenizer
    from sparrow.stages.tasks import has_scorer

    if has_tokenizer(model):
        return
    if prompt_set.needs_tokenizer:
        prompt_set.tokenize(None)  # refuses text-only prompts in its own sentence, before any weights load
    if any(has_scorer(r.get("task")) for r in prompt_set.rows):
        warn(f"--model {model} has no tokenizer, so the samples have no text and their task's scorer cannot "
             "reward them (text and reward are left null)")


TOKENIZING_NOTE = 1000  # prompts from which their tokenizing, seconds or minutes, is said before it starts
LONG_PREFILL_NOTE = 4096  # prompt tokens from which the first step, a long prefill, is said before it starts


def _say_loading(model: str, device: str, longest: int) -> None:
    """The loading line, and for long prompts what the first step is about to do: a long prefill, with
    nothing to show until it ends, since progress can show only after a step."""
    say_loading(model, device)
    if longest >= LONG_PREFILL_NOTE:
        console.print(f"the first step prefills prompts of up to {longest:,} tokens; progress follows it",
                      highlight=False)


def _say_tokenizing(count: int) -> None:
    if count >= TOKENIZING_NOTE:
        console.print(f"tokenizing {count:,} prompts with the model's tokenizer ...", highlight=False)


class _Bars:
    """A rollout's progress on stderr, bars on a terminal and whole lines for a log: the samples (with the
    token rate when `rate`; none when `what` is None), then the rewards, which are scored once sampling is
    done. With `rate` the samples' bar and its clock start at the engine's first step, after the prompts
    were read and tokenized and the model loaded: its elapsed time is the sampling's, and its tok/s counts
    the tokens after that first step over the time since, as the summary's tokens / s counts sampling alone
    (the first step's prefill aside). Without it (Ray workers, whose own loading is in their shards'
    time), the bar shows from the start. With `most_tokens` (--max-new-tokens) the rate also gives the
    time left (`time_left`): at most that, since a stop token may end a sample early, or about that when
    every sample generates them all (`exact`, --ignore-eos)."""

    def __init__(self, bar: Progress, what: str | None, total: int, rate: bool,
                 most_tokens: int | None = None, exact: bool = False) -> None:
        self.bar, self.what, self.total, self.rate = bar, what, total, rate
        self.most_tokens, self.exact = most_tokens, exact
        self.tokens, self.done = 0, 0
        self.skipped = 0  # samples kept from a journal (--resume): done, but not generated by this run
        self.start: float | None = None  # the first step's time, and the tokens then (the rate's origin)
        self.tokens_at_start = 0
        self.task, self.log = None, None
        if what is not None and not rate:
            self._show()
        self.scoring: tuple[object, LogProgress] | None = None

    def _show(self) -> None:
        self.task = self.bar.add_task(self.what, total=self.total, rate="")
        # `time_left` says what remains where the rate and --max-new-tokens bound it
        self.log = LogProgress(self.what, eta=not (self.rate and self.most_tokens))

    def skip(self, samples: int) -> None:
        """Samples done before this run (kept from its journal): the bar starts there."""
        self.done += samples
        self.skipped += samples

    def advance(self, finished: int, new_tokens: int) -> None:
        """Samples finished and tokens generated since the last call."""
        self.tokens += new_tokens
        self.done += finished
        if self.what is None:
            return
        now = time.perf_counter()
        if self.start is None:
            self.start, self.tokens_at_start = now, self.tokens
            if self.task is None:
                self._show()
        info = ""
        if self.rate:  # this run's tokens: the samples kept from a journal were generated before
            kept = f"{self.skipped} from the journal, " if self.skipped else ""
            info = f"{kept}{self.tokens} tokens"
            if now > self.start and self.tokens > self.tokens_at_start:
                per_s = (self.tokens - self.tokens_at_start) / (now - self.start)
                info += f", {per_s:,.1f} tok/s" + self.time_left(per_s)
        self.bar.update(self.task, completed=self.done, rate=info)
        self.log(self.done, self.total, info)

    def time_left(self, per_s: float) -> str:
        """", at most 0:02:35 left": the tokens that may remain at the current rate. Each unfinished sample
        generates at most --max-new-tokens, and all samples together at most total x --max-new-tokens,
        so the smaller of the two bounds, less what was generated, is what remains at most."""
        if self.most_tokens is None or self.done >= self.total:
            return ""
        most = (self.total - self.skipped) * self.most_tokens  # what this run's samples generate at most
        left = min(most - self.tokens, (self.total - self.done) * self.most_tokens)
        clock = timedelta(seconds=round(max(left, 0) / per_s))  # h:mm:ss, as rich's elapsed column
        return f", about {clock} left" if self.exact else f", at most {clock} left"

    def scored(self, done: int, total: int) -> None:
        """Samples rewarded so far, of `total`."""
        if self.scoring is None:
            what = "scoring rewards (samples)"
            self.scoring = (self.bar.add_task(what, total=total, rate=""), LogProgress(what))
        task, log = self.scoring
        self.bar.update(task, completed=done, total=total)
        log(done, total)


@contextmanager
def _progress(what: str | None, total: int, rate: bool, most_tokens: int | None = None,
              exact: bool = False) -> Iterator[_Bars]:
    """The bars of a rollout (`_Bars`) for the length of the block."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=not live_progress()) as bar:
        yield _Bars(bar, what, total, rate, most_tokens, exact)


def _warn_unscored_tasks(prompt_set) -> None:
    """Prompts whose task has no scorer (a misspelled name) are sampled, and their samples get no reward:
    one sentence naming the tasks and the known ones (a verl or TRL dataset without --reward is not one)."""
    from sparrow.stages.tasks import TASKS, has_scorer

    unknown: dict[str, int] = {}
    for r in prompt_set.rows:
        task = r.get("task")
        if task and task not in ("verl", "trl") and not has_scorer(task):
            unknown[task] = unknown.get(task, 0) + 1
    if unknown:
        named = ", ".join(f"{t!r} ({n} prompt{'s' * (n != 1)})" for t, n in unknown.items())
        have = "tasks {} have" if len(unknown) > 1 else "task {} has"
        warn(f"{prompt_set.path}: {have.format(named)} no scorer, so their samples get no reward (known "
             f"tasks: {', '.join(TASKS)})")
    layouts = sorted({r.get("task") for r in prompt_set.rows} & {"verl", "trl"})
    if layouts:
        note(f"{prompt_set.path} is a {' and '.join(layouts)} dataset, whose rows name no Sparrow task to "
             "score them, so the samples' rewards are null; give --reward math or code, or --reward-fn, to "
             "score them")


def _check_speculate(speculate: int, engine: str, kv_compression, block_topk: bool) -> None:
    if speculate < 0:
        raise UsageError(f"--speculate must be >= 0 (draft tokens per cycle; 0 = off), got {speculate}")
    if not speculate:
        return
    if engine == "vllm":
        raise UsageError("--speculate runs on our engine (its sparse attention drafts); drop --engine vllm")
    if kv_compression:
        raise UsageError("--speculate drafts with block top-k attention (--budget or --schedule), not with "
                         "--kv-compression's eviction")
    if not block_topk:
        raise UsageError("--speculate drafts with block top-k attention (--budget or --schedule), not with "
                         "dense attention; give --budget or --schedule")


def _check_sparse_actor(lora: Path | None, policy, speculate: int) -> None:
    """A sparse actor's adapter (sparrow distill's, with sparrow_distill.json) belongs to block top-k
    sampling only: the dense policy is the base alone, so a dense rollout with it, or the dense verification
    of --speculate, is refused rather than merged, as is an eviction rollout (--kv-compression), whose
    cache is not the one the actor was trained to read."""
    from sparrow.stages.kv_policies import Eviction

    if lora is None or not distilled_adapter(lora):
        return
    if isinstance(policy, Eviction):
        raise UsageError(f"--adapter {lora} is a sparse actor (sparrow distill's, with "
                         "sparrow_distill.json), trained for block top-k attention, not for "
                         "--kv-compression's eviction: give --budget or --schedule to sample with the actor, "
                         "or drop --adapter")
    if speculate:
        raise UsageError(f"--adapter {lora} is a sparse actor (sparrow distill's, with "
                         "sparrow_distill.json), and --speculate verifies with the dense model, which that "
                         "adapter is not: drop one of them")
    if not policy.sparse:
        raise UsageError(f"--adapter {lora} is a sparse actor (sparrow distill's, with "
                         "sparrow_distill.json), which samples with sparse attention only, but this "
                         "rollout is dense (--dense, or no --budget/--schedule/--kv-compression), whose "
                         "policy is the base alone: give --budget or --schedule to sample with the actor, "
                         "or drop --adapter")


def _warn_uncompressed(policy, summary) -> None:
    """A compressed KV cache that no sample filled to budget + buffer was never compressed: the rollouts
    are dense samples although their budgets column reads the KV budget, which a warning says."""
    from sparrow.stages.kv_policies import Eviction

    if isinstance(policy, Eviction) and summary.samples and not summary.compactions:
        capacity = f"{policy.budget} + {policy.buffer} = {policy.capacity} tokens"
        warn(f"--kv-compression {policy.name} --kv-budget {policy.budget}: no sample's cache reached "
             f"budget + buffer ({capacity}) before its last token, so none was compressed: these are dense "
             "samples")


def _lengths(table) -> list[int]:
    return [len(t) for t in table.column("token_ids").to_pylist()]


def _print_summary(summary, fmt: str, what: str) -> None:
    """The summary as every command's record: the table rounds and words its nulls for the eye (no scorer,
    -), while csv and tsv lose nothing (a float whole, a null as the format's null) and json keeps types;
    a dense run's mean budget reads dense in every text format."""
    table = fmt == "table" or stdout_taken()
    emit_record(summary.metadata(), fmt, title=f"rollouts ({what})", labels=SUMMARY_LABELS,
                render={**SUMMARY_WORDS, **SUMMARY_READING} if table else SUMMARY_WORDS)
