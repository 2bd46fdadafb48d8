"""`sparrow distill`: DistillSparse, a LoRA for the sparse actor only, distilled toward the dense policy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sparrow.stages.core.definitions import DEFAULT_BIN_WIDTH, TAIL_QUANTILE

from .console import console
from .data_options import (
    filter_overlong_option,
    max_prompt_length_option,
    prompt_column_option,
    prompt_length,
    read_eval_prompts,
    truncation_option,
)
from .errors import UsageError, friendly_errors
from .messages import warn
from .option_values import check_device, parse_int_list, raw_prompts_option, warn_first_token_stops
from .options import (
    block_topk_sparsity,
    check_budgets,
    check_gpu_memory,
    check_sampling_memory,
    check_tail,
    default_threshold,
    device_option,
    distilled_adapter,
    finite,
    given_path,
    gpu_memory_option,
    load_actor,
    model_file,
    non_negative_seed,
    option_given,
    output_path,
    rollouts_temperature,
    run_format_option,
    set_threads,
    threads_option,
)
from .output import emit, resolve_format
from .paths import check_output_dir, force_option, input_path
from .progress import (
    PHASE_BEAT_SECONDS,
    BeatingPhases,
    Heartbeat,
    PhaseProgress,
    live_progress,
    log_line,
    say_loading,
)

if TYPE_CHECKING:
    from sparrow.stages.core.schedule import Schedule

DISTILL_PHASES = {"sampling": "sampling training trajectories (samples)",
                  "sampling eval": "sampling eval trajectories (samples)",
                  "scoring before": "scoring before (trajectories)",
                  "balance weights": "balance weights, the starting objective per taught budget (budgets)",
                  "scoring after": "scoring after (trajectories)"}
# what only sampling uses: trajectories given by --rollouts are already sampled
SAMPLING_FLAGS = {"samples": "--samples", "max_new_tokens": "--max-new-tokens",
                  "raw_prompts": "--raw-prompts", "prompt_column": "--prompt-column",
                  "max_prompt_length": "--max-prompt-length", "truncation": "--truncation",
                  "filter_overlong_prompts": "--filter-overlong-prompts"}


def budget_list(given: str, flag: str, once: bool = False) -> list[int]:
    """The budgets of `flag`, each a valid block top-k budget (and given once where `once`)."""
    from sparrow.stages.core.definitions import validate_budget

    budgets = parse_int_list(given, flag)
    repeated = sorted({b for b in budgets if budgets.count(b) > 1}) if once else []
    if repeated:
        raise UsageError(f"{flag} lists {', '.join(map(str, repeated))} more than once; give each budget "
                         "once")
    for b in budgets:
        try:
            validate_budget(b)
        except ValueError as e:
            raise UsageError(f"{flag}: {e}") from None
    return budgets


def eval_budgets_of(sparsity, given: str | None) -> list[int]:
    """--eval-budgets, else the distilled budget, or the schedule's distinct sparse budgets."""
    if given is not None:
        return budget_list(given, "--eval-budgets", once=True)
    if isinstance(sparsity, int):
        return [sparsity]
    return sorted({b for b in sparsity.budgets if b})


def load_init_adapter(path: Path, cfg, rank: int, alpha: float, model: str | None = None):
    """The adapter to start from, checked against the model's shapes, --lora-rank and --lora-alpha before
    any weights load; returns (its peft state dict, its merge-ready weights). A rank or alpha other than
    the adapter's is refused rather than overridden: the adapter's scale is alpha / rank, so continuing it
    with another would score and train a different actor than the one it was distilled as."""
    from safetensors.torch import load_file

    if not path.exists():
        raise UsageError(f"--init-adapter {path}: no such directory")
    if not path.is_dir():
        raise UsageError(f"--init-adapter {path} is a file, not an adapter directory")
    lora = load_actor(path, cfg, model, "--init-adapter")
    if lora.scales:
        raise UsageError(f"--init-adapter {path}: the adapter scales some modules by its own rule (peft's "
                         "use_rslora, alpha_pattern or rank_pattern), which distill trains at alpha / rank; "
                         "merge it into a checkpoint (peft's merge_and_unload) and pass that as --model")
    if lora.r != rank:
        raise UsageError(f"--init-adapter {path}: the adapter has rank {lora.r}, but --lora-rank is {rank}; "
                         f"pass --lora-rank {lora.r} to continue it")
    if lora.alpha != alpha:
        raise UsageError(f"--init-adapter {path}: the adapter has alpha {lora.alpha:g}, but --lora-alpha is "
                         f"{alpha:g}; pass --lora-alpha {lora.alpha:g} to continue it")
    return load_file(path / "adapter_model.safetensors"), lora


def refuse_sampling_flags(ctx: typer.Context, rollouts: Path) -> None:
    """With --rollouts and no --eval-prompts nothing is sampled: refuse the sampling options rather than
    ignore them."""
    for name, flag in SAMPLING_FLAGS.items():
        if option_given(ctx, name):
            raise UsageError(f"{flag} applies only when sampling from --prompts or --eval-prompts; the "
                             f"trajectories of --rollouts {rollouts} are already sampled")


def read_prompt_sets(prompts: Path | None, eval_prompts: Path | None, samples: int, max_new_tokens: int,
                     vocab: int, prompt_column: str | None, length) -> dict:
    """The prompt sets to sample from (their prompt in `prompt_column`, fitted later to `length`, a
    `PromptLength`), read once here; refused, before any weights load, if their samples could not fit in
    this machine's memory. The training trajectories are kept while the eval ones are
    sampled, so both sets count together."""
    from sparrow.stages.core.prompt_set import PromptSet
    from sparrow.stages.core.user_data import DataOptions

    data = DataOptions(prompt_length=length, prompt_column=prompt_column)
    sets = {path: PromptSet.read(path, data) for path in (prompts,) if path is not None}
    if eval_prompts is not None:
        sets[eval_prompts] = read_eval_prompts(eval_prompts, data)
    if sets:
        lengths = [len(r.get("prompt_token_ids") or ()) for s in sets.values() for r in s.rows]
        which = " and ".join(flag for flag, path in (("--prompts", prompts), ("--eval-prompts", eval_prompts))
                             if path is not None)
        check_sampling_memory(lengths, samples, max_new_tokens, vocab, "sample fewer trajectories per "
                              f"prompt (--samples applies to {which}), or give fewer prompts")
    return sets


def shown_loss(loss: float) -> float:
    """A step's loss as a line shows it: both objectives (KL and its k3 estimate) are never negative, so a
    value a rounding below 0 (-1e-9) shows as 0; the history keeps the number as computed."""
    return max(loss, 0.0)


def steps_batch(batch_size: int, explicit: bool, available: int, source: str) -> int:
    """The trajectories per step: a step holds each trajectory at most once, so more than there are is
    refused when --trajectories-per-step is given, and the default is lowered to all of them (what a step
    then holds, and what sparrow_distill.json records)."""
    if available < 1:
        raise UsageError(f"no trajectory {source} has generated tokens, so there is nothing to distill on")
    if batch_size > available and explicit:
        raise UsageError(f"--trajectories-per-step {batch_size} is more than the {available} trajectories "
                         f"{source}; a step holds each trajectory at most once, so give at most {available}")
    return min(batch_size, available)


def check_k3_trajectories(path: Path, sampler: str | None, speculate: int | None = None,
                          truncated: str | None = None) -> None:
    """k3 estimates KL(actor || dense) only on tokens the sparse actor sampled from its whole softmax."""
    if sampler is None:
        raise UsageError(f"--objective k3 needs trajectories sampled by the sparse actor, and {path} "
                         "does not record how it was sampled (no 'sparsity' in its metadata); use "
                         "--objective kl, which needs only the tokens")
    if sampler == "dense":
        raise UsageError(f"--objective k3 needs trajectories sampled by the sparse actor, but {path} was "
                         "sampled densely; use --objective kl, or sample with sparrow rollout --budget or "
                         "--schedule")
    if speculate:
        raise UsageError(f"--objective k3 needs trajectories sampled by the sparse actor, but {path} holds "
                         f"exact speculative samples (--speculate {speculate}), which are the dense model's; "
                         "use --objective kl, or sample with sparrow rollout --budget or --schedule alone")
    if truncated:
        raise UsageError(f"--objective k3 needs tokens drawn from the sparse actor's whole distribution, but "
                         f"{path} was sampled with {truncated}, which cuts it; use --objective kl, or sample "
                         "with sparrow rollout --top-p 1 --top-k 0")


@dataclass(frozen=True)
class K3Actor:
    """The sparse actor that `--objective k3` distills, whose own samples the estimator needs: its sampling
    sparsity (--budget or --schedule), the budgets it is taught at (None: that sparsity itself) and the
    adapter it starts from (--init-adapter; None: a fresh, zero one)."""

    sparsity: int | Schedule  # --budget, or the --schedule read
    schedule: Path | None
    taught: list[int] | None
    init_adapter: Path | None

    def sampler(self) -> str:
        """The sampling flag as given: --budget B or --schedule FILE."""
        return f"--schedule {self.schedule}" if self.schedule is not None else f"--budget {self.sparsity}"


def check_k3_taught(actor: K3Actor, sampled: str) -> None:
    """k3 at a budget other than the one that sampled the tokens estimates another actor's KL: the taught
    budgets must be the sampling sparsity itself (`sampled` names where the samples come from)."""
    if actor.taught is None or (isinstance(actor.sparsity, int) and actor.taught == [actor.sparsity]):
        return
    hint = f"--train-budgets {actor.sparsity}" if isinstance(actor.sparsity, int) else "no --train-budgets"
    taught = ",".join(map(str, actor.taught))
    raise UsageError(f"--objective k3 needs trajectories sampled by the actor it teaches, but {sampled} "
                     f"{actor.sampler()} while the adapter is taught at budgets {taught} (--train-budgets, "
                     f"which defaults to --eval-budgets); give {hint}, or use --objective kl, which needs "
                     "only the tokens")


def check_k3_actor(path: Path, sampler: str, actor: K3Actor) -> None:
    """A rollouts file's recorded sampler (its `sparsity` and `lora` metadata) must be the actor being
    distilled: the same budget or schedule, the adapter it starts from (none for a fresh one), and no other
    budget taught; one sentence naming the file's sampler and the flag otherwise."""
    from sparrow.schemas import artifact_metadata

    kl = "use --objective kl, which needs only the tokens"
    if not _same_sparsity(sampler, actor):
        kind, _, value = sampler.partition(":")
        hint = f"give --{kind} {value}, or " if kind in ("budget", "schedule") else ""
        raise UsageError(f"--objective k3 needs trajectories sampled by the sparse actor it distills, but "
                         f"{path} was sampled with {sampler} (its metadata), not by the {actor.sampler()} "
                         f"actor; {hint}{kl}")
    check_k3_taught(actor, f"{path} was sampled with")
    lora = str(artifact_metadata(path).get("lora") or "")
    start = f"--init-adapter {actor.init_adapter}" if actor.init_adapter is not None else "a fresh adapter"
    if lora and actor.init_adapter is not None and _same_adapter(Path(lora), actor.init_adapter):
        return
    if lora or actor.init_adapter is not None:
        recorded = f"the adapter {lora} (its metadata 'lora')" if lora else "no adapter (its metadata)"
        fix = f"give --init-adapter {lora}" if lora else "drop --init-adapter"
        raise UsageError(f"--objective k3 needs trajectories sampled by the sparse actor it distills, but "
                         f"{path} was sampled with {recorded} and distill starts from {start}; {fix}, or "
                         f"{kl}")


def _same_sparsity(sampler: str, actor: K3Actor) -> bool:
    """Whether a recorded sampler ("budget:48", "schedule:FILE") is the actor's --budget or --schedule; a
    recorded schedule is the same if it is the same file or holds the same bins and budgets."""
    from sparrow.schemas import ArtifactError
    from sparrow.stages.core.schedule import Schedule

    kind, _, value = sampler.partition(":")
    if actor.schedule is None:
        return kind == "budget" and value == str(actor.sparsity)
    if kind != "schedule":
        return False
    if Path(value).resolve() == actor.schedule.resolve():
        return True
    try:
        recorded = Schedule.from_artifact(value)
    except (ArtifactError, OSError, ValueError):
        return False
    return (recorded.bin_starts, recorded.budgets) == (actor.sparsity.bin_starts, actor.sparsity.budgets)


def _same_adapter(recorded: Path, given: Path) -> bool:
    """The same adapter directory, or one with the same weights (the recorded path may be relative to
    another working directory)."""
    if recorded.resolve() == given.resolve():
        return True
    weights = "adapter_model.safetensors"
    try:
        return (recorded / weights).read_bytes() == (given / weights).read_bytes()
    except OSError:
        return False


@friendly_errors
def distill(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", "--model", help="Preset, checkpoint dir or .gguf."),
    prompts: Path = typer.Option(None, "--prompts", callback=input_path, parser=given_path("--prompts"),
                                 metavar="<path>", help="Prompts to sample training "
                                 "trajectories from, with the sparse actor (the engine under "
                                 "--budget/--schedule)."),
    raw_prompts: bool = raw_prompts_option(),
    prompt_column: str = prompt_column_option(),
    max_prompt_length: int = max_prompt_length_option(),
    truncation: str = truncation_option(),
    filter_overlong_prompts: bool = filter_overlong_option(),
    rollouts: Path = typer.Option(None, "--rollouts", callback=input_path, parser=given_path("--rollouts"),
                                  metavar="<path>", help="Training trajectories "
                                  "sampled before (sparrow rollout, or any sampler's Parquet with "
                                  "prompt_id, prompt_token_ids, token_ids)."),
    schedule: Path = typer.Option(None, "--schedule", callback=input_path, parser=given_path("--schedule"),
                                  metavar="<path>", help="The schedule the actor samples with."),
    budget: int = typer.Option(None, "--budget", help="The fixed budget the actor samples with, in tokens "
                               "(multiple of 16, at least 48)."),
    steps: int = typer.Option(50, "--steps", help="Optimizer steps of the sparse actor's LoRA, at least 1, "
                              "each on --trajectories-per-step trajectories (in turn, a new order each "
                              "pass)."),
    batch_size: int = typer.Option(8, "--trajectories-per-step", "--batch-size", help="Trajectories per "
                                   "optimizer step (as train's --prompts-per-step counts prompts); at most "
                                   "the trajectories there are (the default: all of them where fewer). "
                                   "--batch-size is its older name here; on rollout, profile and "
                                   "plan-schedule --batch-size is --max-num-seqs, the sequences decoded "
                                   "together."),
    lora_rank: int = typer.Option(16, "--lora-rank", help="LoRA rank on every linear layer of every block."),
    lora_alpha: float = typer.Option(16.0, "--lora-alpha", callback=finite,
                                     help="Published: 16 (DistillSparse's, as train's "
                                     "--distill-alpha; train's own LoRA defaults to 2 x its rank)."),
    lr: float = typer.Option(5e-4, "--lr", "--learning-rate", callback=finite,
                             help="AdamW learning rate of the LoRA "
                             "(published: 5 x the base model's lr in joint training)."),
    objective: str = typer.Option("kl", "--objective", help="kl: full-vocabulary KL(dense || actor) per "
                                  "position; k3: the published sampled-token estimator (needs trajectories "
                                  "the sparse actor sampled)."),
    init_adapter: Path = typer.Option(None, "--init-adapter", help="Continue distilling this adapter."),
    eval_prompts: Path = typer.Option(None, "--eval-prompts", callback=input_path,
                                      parser=given_path("--eval-prompts"), metavar="<path>",
                                      help="Held-out prompts: "
                                      "their dense trajectories are scored before and after (default: "
                                      "the training trajectories, in-sample)."),
    eval_budgets: str = typer.Option(None, "--eval-budgets", help="Budgets to score before and after "
                                     "(default: --budget, or the schedule's budgets)."),
    train_budgets: str = typer.Option(None, "--train-budgets", help="Budgets to teach the adapter at, each "
                                      "trajectory of a step at one of them in turn (default: the "
                                      "--eval-budgets when given, so that the one adapter helps at every "
                                      "budget a schedule planned from its profile may pick; else the "
                                      "sampling --budget/--schedule)."),
    balance_budgets: bool = typer.Option(True, "--balance-budgets/--no-balance-budgets",
                                         help="Weight each training budget by 1 / the objective the actor "
                                         "starts with at it, so that near-dense budgets, whose loss starts "
                                         "small, are not traded for aggressive ones."),
    gradient_checkpointing: bool = typer.Option(None, "--gradient-checkpointing/--no-gradient-checkpointing",
                                                help="Recompute each decoder layer of the actor's forward in "
                                                "the backward pass (less memory, more compute); default: on "
                                                "when the model is on a CUDA device, off on the CPU."),
    samples: int = typer.Option(4, "--samples", "--num-generations", help="Trajectories per prompt "
                                "(--prompts, --eval-prompts; --rollouts alone samples nothing)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "--max-completion-length",
                                       help="Tokens sampled at most per trajectory (TRL's "
                                       "max_completion_length). Default 64, as train's: every step "
                                       "backpropagates through them; rollout and profile default to 256."),
    temperature: float = typer.Option(None, "--temperature", callback=finite,
                                      help="Sampling temperature (default 1, or what "
                                      "--rollouts records); the objectives use it."),
    seed: int = typer.Option(0, "--seed", callback=non_negative_seed,
                             help="Sampling and batch order; eval trajectories use seed + 1."),
    bin_width: int = typer.Option(DEFAULT_BIN_WIDTH, "--bin-width",
                                  help="Position bin width in tokens of the before and after mismatch "
                                  "(OUTPUT/mismatch/) and of the tail per bin, as profile's."),
    device: str = device_option(also=" On cuda, the actor's sampling and the distillation run on the GPU."),
    dtype: str = typer.Option("auto", "--dtype", help="Base weights and KV cache: auto (bfloat16 on cuda, "
                              "float32 on cpu), float32 or bfloat16; the LoRA trains in fp32 either way."),
    gpu_memory_utilization: float = gpu_memory_option(),
    quantile: float = typer.Option(TAIL_QUANTILE, "--quantile", callback=finite,
                                   help="Tail quantile of alpha per bin that the before/after summary shows "
                                   "(as profile's)."),
    threshold: float = typer.Option(None, "--threshold", callback=finite, show_default=False,
                                    help="Tail threshold the summary marks (default: the calibration shipped "
                                    "for --model if there is one, else the published prior 0.86)."),
    output: Path = typer.Option(..., "-o", "--output", help="The adapter directory to write. An existing "
                                "directory is replaced only if it holds an adapter from sparrow distill "
                                "(another adapter: --force; other files: never); files of yours in it "
                                "(notes, a sparrow report) are kept.",
                                parser=output_path("an adapter directory", folder=True)),
    force: bool = force_option(),
    threads: int = threads_option(),
    format: str = run_format_option(),
) -> None:
    """Distill the sparse actor (block top-k attention + a LoRA on every linear layer, gradients through the
    LoRA only) toward the frozen dense policy, teacher forced on trajectories. Writes OUTPUT/ in peft's
    format (transformers + peft load it; sparrow rollout/profile --adapter use it as the sparse actor),
    OUTPUT/mismatch/{before,after}.parquet and OUTPUT/sparrow_distill.json; prints the tail per bin before
    and after."""
    set_threads(threads)
    from sparrow.stages.core.sparsity import spec_of
    from sparrow.stages.core.trajectories import read_rollouts
    from sparrow.stages.distill import (
        DistillConfig,
        DistillHooks,
        DistillRun,
        distill_to_folder,
    )
    from sparrow.stages.model.loading import canonical_dtype, resolve_config

    fmt = resolve_format(format)
    if (prompts is None) == (rollouts is None):
        raise UsageError("give one of --prompts (sample training trajectories with the sparse actor) and "
                         "--rollouts (trajectories sampled before)" + (", not both" if prompts else ""))
    if rollouts is not None and eval_prompts is None:
        refuse_sampling_flags(ctx, rollouts)
    cfg = DistillConfig(steps=steps, batch_size=batch_size, lora_rank=lora_rank, lora_alpha=lora_alpha,
                        lr=lr, objective=objective, seed=seed, balance_budgets=balance_budgets,
                        temperature=1.0 if temperature is None else temperature)
    try:
        cfg.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if temperature is not None and temperature < 0:  # rollout's check and sentence, before any model loads
        raise UsageError(f"--temperature must be >= 0, got {temperature}")
    from sparrow.stages.engine.sequence import TEMPERATURE_FLOOR, below_temperature_floor

    if temperature is not None and below_temperature_floor(temperature):
        raise UsageError(f"--temperature {TEMPERATURE_FLOOR}, got {temperature}")
    for flag, value in (("--samples", samples), ("--max-new-tokens", max_new_tokens),
                        ("--bin-width", bin_width)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    check_gpu_memory(gpu_memory_utilization)
    check_tail(quantile, threshold)
    check_device(device)
    try:
        dtype = canonical_dtype(dtype)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_output_dir(output, "an adapter written by sparrow distill", force=force, ours=distilled_adapter,
                     replaceable=lambda d: (d / "adapter_config.json").exists(),
                     inputs={"--prompts": prompts, "--rollouts": rollouts, "--schedule": schedule,
                             "--eval-prompts": eval_prompts, "--model": model_file(model),
                             "--init-adapter": init_adapter})
    hold_adapter_dir(output)
    resolved = default_threshold(threshold, model, quantile)
    sparsity = block_topk_sparsity(schedule, budget, False, model)
    if sparsity is None:
        raise UsageError("give --budget or --schedule: the sparse actor to distill is the one that samples "
                         "with that sparsity")
    budgets = eval_budgets_of(sparsity, eval_budgets)
    taught = budgets if eval_budgets else None  # the adapter then serves every budget it is compared at
    if train_budgets:
        taught = budget_list(train_budgets, "--train-budgets", once=True)
    model_cfg = resolve_config(model)
    for flag, given_budgets in (("--eval-budgets", eval_budgets and budgets),
                                ("--train-budgets", train_budgets and taught)):
        check_budgets(given_budgets or [], model_cfg.max_position_embeddings, flag, model)
    init = None if init_adapter is None else load_init_adapter(init_adapter, model_cfg, lora_rank,
                                                                 lora_alpha, model)
    for flag, path in (("--prompts", prompts), ("--rollouts", rollouts), ("--eval-prompts", eval_prompts)):
        if path is not None and not path.exists():
            raise UsageError(f"{flag} {path}: no such file")
    actor = K3Actor(sparsity, schedule, taught, init_adapter)
    if objective == "k3" and prompts is not None:  # sampled by the actor itself, at its sampling sparsity
        check_k3_taught(actor, "--prompts are sampled with")
    length = prompt_length(max_prompt_length, truncation, filter_overlong_prompts)
    prompt_sets = read_prompt_sets(prompts, eval_prompts, samples, max_new_tokens, model_cfg.vocab_size,
                                   prompt_column, length)
    trajectories, batch_given = None, option_given(ctx, "batch_size")
    if prompts is not None:
        n = len(prompt_sets[prompts].rows)
        cfg.batch_size = steps_batch(batch_size, batch_given, n * samples, f"that --prompts {prompts} "
                                     f"samples ({n} prompt{'s' * (n != 1)} x --samples {samples})")
    if rollouts is not None:
        trajectories = read_rollouts(rollouts, context=model_cfg.max_position_embeddings)
        if objective == "k3":
            check_k3_trajectories(rollouts, trajectories.sampler, trajectories.speculate,
                                  trajectories.truncated)
            check_k3_actor(rollouts, trajectories.sampler, actor)
        cfg.batch_size = steps_batch(batch_size, batch_given,
                                     sum(bool(r["token_ids"]) for r in trajectories.rows),
                                     f"of --rollouts {rollouts}")
        cfg.temperature = rollouts_temperature(rollouts, trajectories.temperature, temperature)
    run = DistillRun(model=model, output=output, sparsity=sparsity, sampler=spec_of(sparsity, schedule),
                     eval_budgets=budgets, train_budgets=taught, prompts=prompts, rollouts=trajectories,
                     rollouts_path=rollouts, eval_prompts=eval_prompts, prompt_sets=prompt_sets,
                     init_adapter=init_adapter, init=init,
                     samples=samples, max_new_tokens=max_new_tokens, raw_prompts=raw_prompts, dtype=dtype,
                     bin_width=bin_width, device=device, gradient_checkpointing=gradient_checkpointing,
                     gpu_memory_utilization=gpu_memory_utilization, quantile=quantile,
                     threshold=resolved.value)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, transient=True,
                  disable=not live_progress()) as bar, Heartbeat(PHASE_BEAT_SECONDS) as beat:
        phases = BeatingPhases(PhaseProgress(bar, DISTILL_PHASES), beat)
        task = []  # the distilling steps' bar, from the phase on

        def on_phase(name: str) -> None:
            if name == "distilling":
                task.append(bar.add_task("distilling", total=steps, info=""))
            log_line(name)
            phases.doing(name)

        def on_step(r: dict) -> None:
            info = (f"{objective} loss {shown_loss(r['loss']):.4g} | grad norm {r['grad_norm']:.3g} | "
                    f"{r['seconds']:.1f} s/step")
            bar.update(task[0], completed=r["step"], info=info)
            log_line(f"distilling step {r['step']}/{steps}: {info}")

        sampled = "trajectories" if prompts is not None else "eval trajectories"
        hooks = DistillHooks(lambda: log_line(f"sampling {sampled}"),
                             lambda lengths: warn_first_token_stops(lengths, max_new_tokens, raw_prompts),
                             on_phase, on_step, lambda: say_loading(model, device), phases)
        try:
            folder, result = distill_to_folder(run, cfg, hooks)
        except ValueError as e:
            raise UsageError(str(e)) from None
    h = result.history
    console.print(f"wrote the adapter to {folder} ({len(h)} step{'s' * (len(h) != 1)} at "
                  f"{f'budgets {run.taught}' if taught else run.sampler}, {result.seconds:.1f} s of "
                  f"training; {objective} loss {shown_loss(h[0]['loss']):.4g} -> "
                  f"{shown_loss(h[-1]['loss']):.4g}); per-token mismatch before and after: "
                  f"{folder / 'mismatch'}/")
    for warning in result.warnings:
        warn(warning)
    columns = ("bin", "budget", "tokens", "tail_before", "tail_after", "mean_before", "mean_after",
               "above_after", "worse_after")
    emit(columns, [[r[c] for c in columns] for r in result.comparison], fmt,
         title=f"alpha per bin and budget, plain vs distilled sparse actor (tail = {quantile:g} quantile, "
               f"above = tail >= threshold {resolved.short}, worse = tail or mean below before; eval: "
               f"{eval_prompts or 'training trajectories'})")


def hold_adapter_dir(output: Path) -> None:
    """One distill per adapter directory: a second one writing the same -o is refused at once, not left
    to replace the first one's adapter when it ends (the lock goes with the process)."""
    from sparrow.schemas import ArtifactError
    from sparrow.schemas.locations import hold_output

    try:
        hold_output(output, "sparrow distill", "another adapter directory (-o)")
    except ArtifactError as e:
        raise UsageError(str(e)) from None
