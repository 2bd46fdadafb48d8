"""`sparrow profile`: per-token sparse-to-dense mismatch of a model on a prompt set or on given rollouts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from sparrow.stages.core.definitions import DEFAULT_BIN_WIDTH, TAIL_QUANTILE

from .console import console
from .data_options import (
    filter_overlong_option,
    max_prompt_length_option,
    prompt_column_option,
    prompt_length,
    truncation_option,
)
from .errors import UsageError, friendly_errors
from .messages import note, warn
from .option_values import (
    check_device,
    check_max_prompts,
    max_prompts_option,
    on_a_cluster,
    parse_int_list,
    raw_prompts_option,
    warn_first_token_stops,
)
from .options import (
    block_topk_sparsity,
    check_budgets,
    check_gpu_memory,
    check_has_weights,
    check_sampling_memory,
    check_speculative_schedule,
    check_tail,
    check_workers,
    default_threshold,
    device_option,
    distilled_adapter,
    eviction_from_flags,
    finite,
    given_path,
    gpu_memory_option,
    kv_buffer_option,
    kv_window_option,
    load_actor,
    model_file,
    non_negative_seed,
    option_given,
    output_path,
    random_weights_of,
    rollouts_temperature,
    set_threads,
    spec_kind_any_case,
    threads_option,
    top_k_option,
    top_p_option,
)
from .output import emit, format_option, resolve_format
from .paths import check_output, force_option, input_path, output_help
from .progress import (
    PHASE_BEAT_SECONDS,
    BeatingPhases,
    Heartbeat,
    LogProgress,
    PhaseProgress,
    live_progress,
    say_loading,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from sparrow.stages.calibrate import ResolvedThreshold
    from sparrow.stages.kv_policies import Eviction
    from sparrow.stages.model.lora import LoraWeights
    from sparrow.stages.profile import Hooks, Speculation


SAMPLING_FLAGS = {"max_prompts": "--max-prompts", "prompt_column": "--prompt-column",
                  "max_prompt_length": "--max-prompt-length",
                  "truncation": "--truncation", "filter_overlong_prompts": "--filter-overlong-prompts",
                  "samples": "--samples",
                  "max_new_tokens": "--max-new-tokens", "sampler": "--sampler",
                  "budget": "--budget", "schedule": "--schedule",
                  "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed",
                  "batch_size": "--max-num-seqs", "speculate": "--speculate"}
PHASES = {"sampling": "sampling (samples)", "scoring": "scoring (sequences)"}
RANDOM_WEIGHTS_NOTE = ("this profile times the scoring and measures its memory, but its mismatch is not the "
                       "model's: plan no schedule from it")


def scored_budgets(text: str) -> list[int]:
    """--budgets as a list; `dense` is refused as what every budget is scored against (fit-cost's and
    plan-schedule's lists take it: there it is a step to time or a bin's choice)."""
    if "dense" in (x.strip().lower() for x in text.split(",")):
        raise UsageError("--budgets lists dense, which every budget is scored against (alpha 1 by "
                         "definition); give the block top-k budgets to score, such as 256,512")
    return parse_int_list(text, "--budgets")


@friendly_errors
def profile(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", "--model", help="Preset, checkpoint dir or .gguf."),
    prompts: Path = typer.Option(None, "--prompts", callback=input_path, parser=given_path("--prompts"),
                                 metavar="<path>", help="A prompts artifact (sparrow "
                                 "prompts; - = stdin), or any Parquet or JSONL file with its columns (token "
                                 "ids or text): sample "
                                 "trajectories of these prompts with the engine."),
    raw_prompts: bool = raw_prompts_option(),
    prompt_column: str = prompt_column_option(),
    max_prompts: int = max_prompts_option(),
    max_prompt_length: int = max_prompt_length_option(),
    truncation: str = truncation_option(),
    filter_overlong_prompts: bool = filter_overlong_option(),
    rollouts: Path = typer.Option(None, "--rollouts", callback=input_path, parser=given_path("--rollouts"),
                                  metavar="<path>", help="A rollouts artifact "
                                  "(sparrow rollout; - = stdin), or any Parquet file from another sampler "
                                  "with columns prompt_id, token_ids and prompt_token_ids (or prompt text): "
                                  "score these trajectories instead."),
    budgets: str = typer.Option("256,512,1024", "--budgets",
                                help="Candidate budgets in tokens, multiples of the page size 16 of "
                                "at least 48 (with "
                                "--kv-compression: KV budgets, any number above the sink plus the window): "
                                "the budgets scored, not the sampler's (--budget)."),
    kv_compression: str = typer.Option(None, "--kv-compression", help="Score each of --budgets as the KV "
                                       "budget of this eviction policy, snapkv or rkv (Sparse-RL's KV "
                                       "compression, replayed teacher forced), instead of block top-k. A "
                                       "compressed sampler is --sampler snapkv:B or rkv:B."),
    kv_window: int = kv_window_option(),
    kv_buffer: int = kv_buffer_option(),
    samples: int = typer.Option(4, "--samples", help="Trajectories per prompt."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Tokens generated at most per "
                                       "trajectory, as sparrow rollout's."),
    sampler: str = typer.Option("dense", "--sampler", callback=spec_kind_any_case,
                                help="How trajectories are sampled: dense, budget:B, schedule:FILE, or with "
                                "KV compression snapkv:B or rkv:B (optionally ,window=W,buffer=N). "
                                "--budget B and --schedule FILE say budget:B and schedule:FILE as rollout "
                                "does."),
    budget: int = typer.Option(None, "--budget", help="Sample with this fixed block top-k budget, as "
                               "rollout's --budget: the same as --sampler budget:B, and not with --sampler "
                               "(--budgets lists the budgets scored)."),
    schedule: Path = typer.Option(None, "--schedule", callback=input_path, parser=given_path("--schedule"),
                                  metavar="<path>", help="Sample with this schedule, as rollout's "
                                  "--schedule: the same as --sampler schedule:FILE, and not with --sampler."),
    bin_width: int = typer.Option(DEFAULT_BIN_WIDTH, "--bin-width", help="Position bin width in tokens "
                                  "(the embedded model's 8K context wants 512; Qwen3 runs use 2000)."),
    temperature: float = typer.Option(None, "--temperature", callback=finite,
                                      help="Sampling temperature (0 = greedy; "
                                      "default 1, or what a --rollouts artifact records); alpha is "
                                      "measured at this temperature (1 when greedy)."),
    top_p: float = top_p_option(" As rollout's."),
    top_k: int = top_k_option(" As rollout's."),
    seed: int = typer.Option(0, "--seed", callback=non_negative_seed, help="Each sample draws from its "
                             "own generator seeded from (seed, prompt row, sample): the same trajectories as "
                             "sparrow rollout --seed."),
    batch_size: int = typer.Option(16, "--max-num-seqs", "--batch-size", help="Sequences (samples) decoded "
                                   "together (vLLM's name; on a CPU, up to 16, it does not change the "
                                   "trajectories at a given --threads)."),
    speculate: int = typer.Option(0, "--speculate", help="Exact speculative sampling (rollout --speculate): "
                                  "the sparse --sampler (budget:B or schedule:FILE) drafts up to K tokens a "
                                  "cycle and the dense model verifies them, so the trajectories are dense "
                                  "samples (0 = off)."),
    draft_alpha: bool = typer.Option(False, "--draft-alpha/--no-draft-alpha",
                                     help="Also score each budget's alpha for a speculative draft, whose "
                                     "queries read the dense keys and values that verification keeps (column "
                                     "alpha_draft): what plan-schedule --speculate prices drafts with. One "
                                     "more sparse pass per budget."),
    quantile: float = typer.Option(TAIL_QUANTILE, "--quantile", callback=finite,
                                   help="Tail quantile shown in the summary."),
    threshold: float = typer.Option(None, "--threshold", callback=finite, show_default=False,
                                    help="Tail threshold shown in the summary (default: the calibration "
                                    "shipped for --model if there is one, else the published prior 0.86)."),
    adapter: Path = typer.Option(None, "--adapter", help="The sparse actor's LoRA (sparrow distill's, or "
                                 "train --distill-sparse's RUN/sparse_adapter): every budget is scored as "
                                 "sparse attention + this adapter against the dense model without it, and a "
                                 "block top-k --sampler samples with it; not with --kv-compression or an "
                                 "eviction --sampler (it was trained for block top-k). Not a trained "
                                 "learner's LoRA (train's RUN/adapter): that is --lora."),
    lora: Path = typer.Option(None, "--lora", help="A trained learner's LoRA (a peft directory such as "
                              "sparrow train's RUN/adapter), merged into the weights on both sides, as "
                              "sparrow rollout --lora does: the samples, the dense scores and every budget's "
                              "sparse scores are the learner's. With --adapter (train --distill-sparse's "
                              "RUN/sparse_adapter) the sparse side is the learner plus that actor. Recorded "
                              "as the artifact's lora (sparrow sql: source_lora)."),
    device: str = device_option(),
    dtype: str = typer.Option("auto", "--dtype", help="Weights and KV cache: auto (bfloat16 on cuda, float32 "
                              "on cpu), float32 or bfloat16; the scores are fp32 either way (fp32 head)."),
    random_weights: bool = typer.Option(False, "--random-weights/--no-random-weights",
                                        help="Random weights for a shapes-only "
                                        "preset such as qwen3-4b (to time the scoring and measure its "
                                        "memory, not mismatch)."),
    gpu_memory_utilization: float = gpu_memory_option(),
    workers: int = typer.Option(0, "--workers", help="Ray workers, each a process with the model loaded "
                                "once, sharing the prompts (or trajectories) by index (0 = this process). "
                                "-o is then a directory of one Parquet part per worker."),
    ray_address: str = typer.Option(None, "--ray-address", help="An existing Ray cluster for --workers "
                                    "(default: a local Ray started for the run)."),
    output: Path = typer.Option(..., "-o", "--output", help=output_help("the mismatch artifact"),
                                parser=output_path()),
    force: bool = force_option(),
    threads: int = threads_option(),
    format: str = format_option(),
) -> None:
    """Sample K trajectories per prompt with the rollout engine (or take them from --rollouts), then
    score every generated token under dense attention and under each budget (teacher forced): one row
    per token per budget."""
    set_threads(threads)
    from sparrow.stages.core.prompt_set import PromptSet
    from sparrow.stages.core.trajectories import read_rollouts
    from sparrow.stages.core.user_data import DataOptions
    from sparrow.stages.model.loading import canonical_dtype, resolve_config, resolve_dtype
    from sparrow.stages.profile import (
        DRAFT_ALPHA_WITH_ADAPTER,
        SPECULATE_WITH_ADAPTER,
        ProfileOptions,
        ProfileRun,
        profile_prompts,
        profile_rollouts,
        summarize,
        unevicted,
    )

    fmt = resolve_format(format)
    if (prompts is None) == (rollouts is None):
        raise UsageError("give one of --prompts (sample trajectories with the engine) and --rollouts "
                         "(score trajectories sampled before)" + (", not both" if prompts else ""))
    if rollouts is not None:
        refuse_sampling_flags(ctx, rollouts)
    check_max_prompts(max_prompts)
    length = prompt_length(max_prompt_length, truncation, filter_overlong_prompts)
    sampler, sampler_label = sampler_of_flags(ctx, sampler, budget, schedule, model)
    opts = ProfileOptions(budgets=scored_budgets(budgets), samples=samples,
                          max_new_tokens=max_new_tokens, sampler=sampler, bin_width=bin_width,
                          temperature=1.0 if temperature is None else temperature, top_p=top_p, top_k=top_k,
                          seed=seed, batch_size=batch_size, speculate=speculate, draft_alpha=draft_alpha,
                          gpu_memory_utilization=check_gpu_memory(gpu_memory_utilization),
                          kv_compression=kv_compression and kv_compression.lower(), kv_window=kv_window,
                          kv_buffer=kv_buffer)
    eviction_from_flags(kv_compression, None, kv_window, kv_buffer, need_budget=False)  # the flags' own
    if opts.kv_compression:
        replay_sampler_eviction(opts, rollouts, sampler)
    try:
        opts.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if speculate and adapter is not None:  # the adapter's weights load later; refused before then
        raise UsageError(SPECULATE_WITH_ADAPTER)
    check_actor_under_eviction(adapter, opts.kv_compression, sampler)
    if draft_alpha and adapter is not None:
        raise UsageError(DRAFT_ALPHA_WITH_ADAPTER)
    check_learner(lora)
    check_tail(quantile, threshold)
    check_device(device, remote=on_a_cluster(workers, ray_address))
    try:
        dtype = canonical_dtype(dtype)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_workers(workers, ray_address, output)
    check_output(output, "mismatch", force, parts=bool(workers),
                 inputs={"--prompts": prompts, "--rollouts": rollouts, "--sampler": sampler_file(sampler),
                         "--adapter": adapter, "--lora": lora, "--model": model_file(model)})
    resolved = default_threshold(threshold, model, quantile)
    cfg = resolve_config(model)
    check_has_weights(model, random_weights)
    if prompts is not None:
        opts.policy = sampler_policy(sampler, cfg, speculate, sampler_label)
    source = ctx.get_parameter_source("budgets")  # typer vendors click: compare by name, not by enum class
    _check_context(opts, cfg, model, source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"))
    opts.adapter = load_actor(adapter, cfg, model)  # before any weights load
    check_sparse_actor(adapter)
    opts.lora = load_learner(lora, cfg, model)
    run = ProfileRun(model, output, device, str(resolve_dtype(dtype, device)).removeprefix("torch."),
                     False, adapter, workers, ray_address, lora)
    counted: list[Speculation] = []  # under --speculate: the sampling's counts
    if rollouts is not None:
        given = read_rollouts(rollouts, context=cfg.max_position_embeddings)
        warn_unmerged_learner(rollouts, lora)
        warn_other_sampler(rollouts, model)
        opts.temperature = rollouts_temperature(rollouts, given.temperature, temperature)
        run.random_weights = random_weights and random_weights_of(model, RANDOM_WEIGHTS_NOTE)
        said = f"{rollouts} records no sampling temperature; alpha is measured at temperature 1 " \
               "(--temperature sets another)"
        unrecorded = given.temperature is None and temperature is None
        with progress_hooks(workers) as hooks:
            hooks.ready = (lambda: console.print(said)) if unrecorded else None
            hooks.loading = lambda: say_loading(model, device)
            table = profile_rollouts(run, given, rollouts, opts, hooks)
    else:
        prompt_set = PromptSet.read(prompts, DataOptions(prompt_length=length, prompt_column=prompt_column),
                                    max_prompts)
        check_sampling_memory([len(r.get("prompt_token_ids") or ()) for r in prompt_set.rows], samples,
                              max_new_tokens, cfg.vocab_size, "sample fewer trajectories per prompt, or "
                              "fewer prompts (--max-prompts, or several prompt files)")
        run.random_weights = random_weights and random_weights_of(model, RANDOM_WEIGHTS_NOTE)
        with progress_hooks(workers) as hooks:
            hooks.loading = lambda: say_loading(model, device)
            hooks.speculation = counted.append
            table = profile_prompts(run, prompt_set, prompts, opts, not raw_prompts, hooks)
        warn_first_token_stops(sample_lengths(table, len(opts.budgets)), max_new_tokens, raw_prompts)
    n = len(opts.budgets)
    console.print(f"wrote {table.num_rows} rows ({table.num_rows // n} tokens x {n} budget{'s' * (n > 1)}) "
                  f"to {output}")
    warn_unevicted(unevicted(table, opts), opts.kv_compression)
    if counted:
        console.print(speculation_line(counted[0], speculate), highlight=False)
    print_summary(summarize(table, quantile, resolved.value), quantile, resolved, fmt)
    console.print(f"above: the tail is at or above the threshold {resolved.short}", highlight=False)


def _check_context(opts, cfg, model: str, given_budgets: bool) -> None:
    """Eviction budgets (scored, or the sampler's) whose cache would never be compressed within the
    model's context: one sentence before any weights load."""
    from sparrow.stages.kv_policies import Eviction

    context = cfg.max_position_embeddings
    if given_budgets and not opts.kv_compression:  # a default beyond a small model's context scores as dense
        check_budgets(opts.budgets, context, "--budgets", model)
    if opts.sampler.startswith("budget:") and int(opts.sampler.split(":", 1)[1]) > context:
        raise UsageError(f"--sampler {opts.sampler} exceeds the context of {model} ({context} tokens); a "
                         "budget that covers the whole context is dense attention (--sampler dense)")
    try:
        for b, mode in zip(opts.budgets, opts.modes() if opts.kv_compression else ()):
            mode.validate(cfg.max_position_embeddings, label=f"--budgets {b} under --kv-compression "
                          f"{opts.kv_compression} for {model}")
        if isinstance(opts.policy, Eviction):
            opts.policy.validate(cfg.max_position_embeddings, label=f"--sampler {opts.sampler} for {model}")
    except ValueError as e:
        raise UsageError(str(e)) from None


def sampled_eviction(rollouts: Path | None, sampler: str) -> tuple[Eviction | None, str]:
    """The eviction policy that sampled the trajectories, and how to name it: --sampler's, or the one a
    --rollouts artifact records (its metadata's sparsity); None for any other sampler, or a file that
    records none (its reader names a damaged one later)."""
    from sparrow.schemas import ArtifactError, artifact_metadata
    from sparrow.stages.core.trajectories import sampler_words
    from sparrow.stages.kv_policies import EVICTION_POLICIES, parse_eviction

    if rollouts is None:
        spec, source = sampler, f"--sampler {sampler}"
    else:
        try:
            spec = sampler_words(artifact_metadata(rollouts).get("sparsity"))[0] or ""
        except (ArtifactError, OSError, ValueError):
            return None, ""
        source = f"the eviction that sampled --rollouts {rollouts} ({spec}, their metadata's sparsity)"
    if spec.partition(":")[0].lower() not in EVICTION_POLICIES:
        return None, ""
    try:
        return parse_eviction(spec), source
    except ValueError:
        return None, ""  # --sampler's own check names it


def replay_sampler_eviction(opts, rollouts: Path | None, sampler: str) -> None:
    """Under --kv-compression, trajectories sampled with an eviction policy are scored with its window,
    buffer and sink, so that each budget replays the eviction that ran: the defaults (buffer 128) would
    compress short sequences never and score the dense cache as the budget's. A --kv-window or
    --kv-buffer other than the sampler's is refused, one sentence before any weights load."""
    sampled, source = sampled_eviction(rollouts, sampler)
    if sampled is None:
        return
    for flag, name in (("--kv-window", "window"), ("--kv-buffer", "buffer")):
        given, own = getattr(opts, f"kv_{name}"), getattr(sampled, name)
        if given is not None and given != own:
            raise UsageError(f"{flag} {given} differs from the {name} ({own} tokens) of {source}, which each "
                             f"budget replays; drop {flag} to score with the sampler's own")
    opts.kv_window, opts.kv_buffer, opts.kv_sink = sampled.window, sampled.buffer, sampled.sink


def warn_unevicted(modes: list[Eviction], kind: str | None) -> None:
    """Scored eviction budgets under which no sequence was ever compressed: their alpha of 1 is the dense
    cache's, so a warning says plainly that it measures no eviction."""
    if not modes:
        return
    budgets = ", ".join(str(m.budget) for m in modes)
    caps = ", ".join(f"{m.budget} + {m.buffer} = {m.capacity}" for m in modes)
    its, them = ("their", "them") if len(modes) > 1 else ("its", "it")
    warn(f"--budgets {budgets} under --kv-compression {kind} evicted nothing: no sequence grew to budget + "
         f"buffer ({caps} tokens) before its last generated token, so {its} alpha of 1 is the dense cache's "
         f"and says nothing about eviction (plan no KV budget from {them})")


def check_actor_under_eviction(adapter: Path | None, kv_compression: str | None, sampler: str) -> None:
    """A sparse actor (sparrow distill's) was trained for block top-k attention: scoring it under
    --kv-compression, or sampling with it merged into an eviction sampler, is refused in one sentence."""
    if adapter is None or not distilled_adapter(adapter):
        return
    actor = (f"--adapter {adapter} is a sparse actor (sparrow distill's, with sparrow_distill.json), trained "
             "for block top-k attention")
    if kv_compression:
        raise UsageError(f"{actor}, not for --kv-compression's eviction: score block top-k budgets (drop "
                         "--kv-compression) or drop --adapter")
    if sampler.split(":", 1)[0] in ("snapkv", "rkv"):
        raise UsageError(f"{actor}, not for the eviction of --sampler {sampler}, which would sample with it "
                         "merged: sample with --sampler dense, budget:B or schedule:FILE, or drop --adapter")


def check_sparse_actor(adapter: Path | None) -> None:
    """--adapter is the sparse actor's alone, scored against the dense model without it: an adapter that
    sparrow distill (or train --distill-sparse) did not write, such as a trained learner's, would count its
    own training as mismatch, so it is refused; --lora merges a learner's into both sides."""
    if adapter is not None and not distilled_adapter(adapter):
        raise UsageError(f"--adapter {adapter} is not a sparse actor's adapter (it has no "
                         "sparrow_distill.json, which sparrow distill and train --distill-sparse write), and "
                         "profile scores --adapter on the sparse side only, against the dense model without "
                         "it, so a trained learner's LoRA would count its own training as mismatch; to "
                         f"profile a learner, give it as --lora {adapter}, which merges it into both sides")


def warn_other_sampler(rollouts: Path, model: str) -> None:
    """Rollouts that another model sampled (their metadata's model) are scored as given, and said to be
    off-policy for --model: its mismatch on another policy's tokens."""
    from sparrow.schemas import artifact_metadata
    from sparrow.stages.model.names import same_model

    sampled_by = artifact_metadata(rollouts).get("model")
    if not same_model(sampled_by, model):
        warn(f"--rollouts {rollouts} were sampled by {sampled_by} (their metadata), not by --model {model}: "
             f"the mismatch is measured on another policy's tokens, off-policy for {model}")


def warn_unmerged_learner(rollouts: Path, lora: Path | None) -> None:
    """Rollouts sampled with a learner's LoRA (their metadata's `lora`, a folder still there without
    sparrow_distill.json) are that policy's samples: profiling them without the same --lora scores another
    policy on them, which a warning says. A sparse actor's adapter, or a folder that is gone, says nothing."""
    from sparrow.schemas import ArtifactError, artifact_metadata

    try:
        recorded = artifact_metadata(rollouts).get("lora") or ""
    except (ArtifactError, OSError, ValueError):
        return
    sampled = Path(recorded) if isinstance(recorded, str) and recorded else None
    if sampled is None or not sampled.is_dir() or distilled_adapter(sampled):
        return
    if lora is not None and lora.resolve() == sampled.resolve():
        return
    scored = "the model without it" if lora is None else f"the model with --lora {lora}"
    warn(f"--rollouts {rollouts} were sampled with the learner's LoRA {sampled} (their metadata 'lora'), "
         f"but the profile scores {scored}; give --lora {sampled} to profile the policy that sampled them")


def check_learner(lora: Path | None) -> None:
    """--lora is a learner's LoRA, merged into both sides: a sparse actor's (sparrow_distill.json beside
    it) belongs to the sparse side alone, so it is refused there and pointed at --adapter."""
    if lora is not None and distilled_adapter(lora):
        raise UsageError(f"--lora {lora} is a sparse actor's adapter (its sparrow_distill.json: sparrow "
                         "distill's or train --distill-sparse's), which adapts the sparse side only, but "
                         "--lora merges a learner's LoRA into both sides; give it as --adapter")


def load_learner(lora: Path | None, cfg, model: str) -> LoraWeights | None:
    """--lora's weights, checked against the model's shapes as rollout's are (`load_actor`), and a LoRA on
    lm_head refused where the model ties it to the embeddings (there is no head of its own to merge
    into); one sentence before any weights load."""
    weights = load_actor(lora, cfg, model, "--lora")
    if weights is not None and "lm_head" in weights.modules and cfg.tie_word_embeddings:
        raise UsageError(f"--lora {lora} adapts lm_head, which {model} ties to its embeddings, so it cannot "
                         "be merged into the weights")
    return weights


def sampler_of_flags(ctx: typer.Context, sampler: str, budget: int | None, schedule: Path | None,
                     model: str) -> tuple[str, str]:
    """The --sampler spec and how the user named the sampler: --budget B and --schedule FILE (rollout's and
    train's flags) are budget:B and schedule:FILE, checked by rollout's own checks; given with --sampler,
    or together, they are refused in one sentence."""
    given = [flag for flag, value in (("--budget", budget), ("--schedule", schedule)) if value is not None]
    if not given:
        return sampler, f"--sampler {sampler}"
    if len(given) > 1:
        raise UsageError("--budget and --schedule were given together; pick one")
    if option_given(ctx, "sampler"):
        spec = "budget:B" if budget is not None else "schedule:FILE"
        raise UsageError(f"{given[0]} and --sampler were given together; {given[0]} is --sampler {spec}, so "
                         "give one of them")
    block_topk_sparsity(schedule, budget, False, model)
    if budget is not None:
        return f"budget:{budget}", f"--budget {budget}"
    return f"schedule:{schedule}", f"--schedule {schedule}"


def sampler_policy(spec: str, cfg=None, speculate: int = 0, label: str | None = None):
    """--sampler (checked by ProfileOptions.validate) as the KV policy the engine samples with. A
    schedule:FILE is read as rollout's --schedule is: an empty path refused as one, the schedule checked
    against the engine's pages and the model's shape (`cfg`), and a draft schedule (or one dense where
    --speculate drafts) said in rollout's sentences, naming the sampler as the user did (`label`)."""
    from sparrow.stages.core.sparsity import as_policy

    kind, _, path = spec.partition(":")
    if kind != "schedule":
        try:
            return as_policy(spec)
        except ValueError as e:
            raise UsageError(f"--sampler {spec}: {e}") from None
    if not path.strip():
        raise UsageError(f"--sampler {spec} is an empty path; give a schedule file, as in "
                         "schedule:run/schedule.parquet")
    schedule = _sampler_schedule(Path(path), cfg)
    by_flags = label is not None and label.startswith("--schedule")
    check_speculative_schedule(Path(path), speculate, label or f"--sampler {spec}",
                               "--budget" if by_flags else "--sampler budget:B")
    return as_policy(schedule)


def sampler_file(spec: str) -> Path | None:
    """The schedule file a --sampler schedule:FILE reads (None for any other sampler)."""
    kind, _, path = spec.partition(":")
    return Path(path) if kind == "schedule" and path.strip() else None


def _sampler_schedule(path: Path, cfg):
    """schedule:FILE's schedule, by rollout's own reading (`sparsity_from_flags`: a missing file, another
    model's shape or another page size is one sentence)."""
    from sparrow.stages.attention import PAGE_SIZE
    from sparrow.stages.core.sparsity import sparsity_from_flags

    try:
        return sparsity_from_flags(path, None, False, PAGE_SIZE, cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None


def speculation_line(counted: Speculation, speculate: int) -> str:
    """The speculative sampling's counts in one line, in the words of `sparrow rollout`'s summary."""
    acceptance = "none proposed" if counted.acceptance is None else f"{counted.acceptance:.4g}"
    per_cycle = "" if counted.tokens_per_cycle is None else \
        f", {counted.tokens_per_cycle:.4g} tokens per sample's cycle"
    return (f"speculative sampling (--speculate {speculate}): {counted.cycles} speculative cycles, "
            f"{counted.drafted_tokens} drafts proposed, {counted.accepted_drafts} drafts kept (dense "
            f"verification), acceptance (kept / proposed) {acceptance}{per_cycle}")


def sample_lengths(table: pa.Table, budgets: int) -> list[int]:
    """Generated tokens per sampled trajectory of a mismatch table (one row per token per budget)."""
    counts = table.group_by(["prompt_id", "sample"]).aggregate([("position", "count")])
    return [n // budgets for n in counts.column("position_count").to_pylist()]


def refuse_sampling_flags(ctx: typer.Context, rollouts: Path) -> None:
    """Sampling options do nothing to trajectories that are given: refuse them rather than ignore them."""
    for name, flag in SAMPLING_FLAGS.items():
        source = ctx.get_parameter_source(name)  # typer vendors click: compare by name, not by enum class
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            raise UsageError(f"{flag} applies only when sampling from --prompts; the trajectories of "
                             f"--rollouts {rollouts} are already sampled")


@contextmanager
def progress_hooks(workers: int) -> Iterator[Hooks]:
    """The progress of a profile on stderr: one bar per phase (sampling, scoring) in this
    process, or one bar of shards with Ray workers."""
    from sparrow.stages.profile import Hooks

    info = () if workers else (TextColumn("{task.fields[info]}"),)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *info,
                  TimeElapsedColumn() if workers else TimeRemainingColumn(), console=console, transient=True,
                  disable=not live_progress()) as bar:
        if workers:
            what = "profile on Ray workers (shards)"
            task, log, done, total = bar.add_task(what, total=workers), LogProgress(what), [0], [workers]

            def shards(n: int) -> None:
                if n < workers:
                    note(f"--workers {workers} is capped at the {n} items to profile: a worker with none "
                         "would load the model for nothing")
                total[0] = n
                bar.update(task, total=n)

            def on_shard(_result) -> None:
                done[0] += 1
                bar.advance(task)
                log(done[0], total[0])

            yield Hooks(on_shard=on_shard, shards=shards)
            return
        with Heartbeat(PHASE_BEAT_SECONDS) as beat:
            yield Hooks(progress=BeatingPhases(PhaseProgress(bar, PHASES), beat))


def print_summary(summary, quantile: float, threshold: ResolvedThreshold, fmt: str) -> None:
    """Mean and tail alpha per bin and budget, on stdout, with a draft's beside them when it was scored
    (--draft-alpha); `above` says whether the (lossy) tail clears the threshold."""
    draft = ("mean_alpha_draft", "tail_alpha_draft") if "tail_alpha_draft" in summary.column_names else ()
    columns = ("bin", "budget", "tokens", "mean_alpha", "tail_alpha", *draft, "above")
    rows = [[r[c] for c in columns[:-1]] + [bool(r["above"])] for r in summary.to_pylist()]
    emit(columns, rows, fmt, title=f"alpha per bin and budget (tail = {quantile:g} quantile, "
                                   f"above = tail >= threshold {threshold.short})")
