"""Options and checks that several subcommands share: finite numbers, the engine's device and host
memory, Ray workers, the sparsity flags (--dense/--budget/--schedule and --kv-*), the tail quantile and
threshold, and a sparse actor's adapter."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import typer

from .errors import UsageError
from .messages import fail, note, warn
from .option_values import DEVICE_HELP, parse_device

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def finite(ctx: typer.Context, param: typer.CallbackParam, value: float | None) -> float | None:
    """typer callback of every float option: inf and nan are refused in one sentence as the command line
    is read (a range check alone lets nan through, since every comparison with it is false)."""
    if value is None or ctx.resilient_parsing or math.isfinite(value):
        return value
    fail(f"{param.opts[0] if param.opts else param.name} must be a finite number, got {value}")


MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed


def non_negative_seed(ctx: typer.Context, param: typer.CallbackParam, value: int | None) -> int | None:
    """typer callback of every --seed: a negative seed (numpy's generators, which every sample's seed goes
    through, take none) or one beyond 64 bits (torch's) is refused in one sentence as the command line is
    read."""
    if value is None or ctx.resilient_parsing or 0 <= value <= MAX_SEED:
        return value
    fail(f"--seed must be >= 0, got {value}" if value < 0 else
         f"--seed must be at most 2**63 - 1, got {value}")


def top_k_off(ctx: typer.Context, param: typer.CallbackParam, value: int | None) -> int | None:
    """typer callback of every --top-k: -1 (vLLM's "off") is 0, the engine's; below -1 is refused in one
    sentence as the command line is read."""
    if value is None or ctx.resilient_parsing or value >= 0:
        return value
    if value == -1:
        return 0
    fail(f"--top-k must be a number of tokens >= 1, or 0 or -1 for off, got {value}")


TOP_K_HELP = ("Sample from the K most likely tokens only; 0 or -1 (vLLM's spelling) = off, the whole "
              "vocabulary.")
TOP_P_HELP = ("Nucleus sampling: sample from the fewest most likely tokens whose probabilities add up to P, "
              "in (0, 1]; 1 = off, the whole vocabulary.")
SAMPLE_SEED_HELP = ("Each sample draws from its own generator seeded from (seed, the prompt's row in the "
                    "prompt file, sample): at a given --threads the same --seed gives the same samples "
                    "whatever --max-num-seqs or --workers, and another seed other samples (greedy, "
                    "--temperature 0, draws nothing); a prompt moved to another row draws other samples.")


def top_k_option(also: str = ""):
    return typer.Option(0, "--top-k", callback=top_k_off, help=TOP_K_HELP + also)


def top_p_option(also: str = ""):
    return typer.Option(1.0, "--top-p", callback=finite, help=TOP_P_HELP + also)


def device_option(default: str | None = "cpu", also: str = ""):
    """--device: cpu or cuda (cuda:0 is cuda; another index says to use CUDA_VISIBLE_DEVICES)."""
    return typer.Option(default, "--device", parser=parse_device, help=DEVICE_HELP + also)


def spec_kind_any_case(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """typer callback of a sampler spec (dense, budget:B, schedule:FILE, snapkv:B, rkv:B): its kind in any
    case, as --kv-compression takes its kind; what follows the kind (a budget, a path) as given."""
    if value is None or ctx.resilient_parsing:
        return value
    kind, sep, rest = value.partition(":")
    return kind.lower() + sep + rest


def any_case(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """typer callback of a choice flag (--correction, --rollout-is, ...): any case, as --kv-compression and
    -f take theirs; the lower-case name is what every later check, message and record sees."""
    if value is None or ctx.resilient_parsing:
        return value
    return value.lower()


UNSAFE_HELP = ("Where no sandbox can run (no user namespaces, no bwrap), run code tasks' programs anyway, "
               "with resource limits only and without isolation: a program can then read your files and "
               "reach the network. Said on stderr when it happens.")


def unsafe_code_option():
    """--unsafe-code-execution of every command that scores code tasks (reward, rollout, train)."""
    return typer.Option(False, "--unsafe-code-execution/--no-unsafe-code-execution", help=UNSAFE_HELP)


def code_rewards(ctx: typer.Context, unsafe: bool) -> None:
    """The settings of code rewards, before any work: $SPARROW_REWARD_WORKERS checked (a bad value refused
    in one sentence, not after sampling), and --unsafe-code-execution passed on:
    SPARROW_UNSAFE_CODE_EXECUTION=1, which the code tasks' sandbox reads, for this process and those it
    starts, until the command ends (`ctx` closes: a later command in the same process, a test's or a
    notebook's, is sandboxed again); without the flag the variable is left as the user set it."""
    from sparrow.stages.tasks import TaskError, reward_workers
    from sparrow.stages.tasks.sandbox import UNSAFE_ENV

    try:
        reward_workers()
    except TaskError as e:
        raise UsageError(str(e)) from None
    if not unsafe:
        return
    before = os.environ.get(UNSAFE_ENV)
    os.environ[UNSAFE_ENV] = "1"

    def put_back() -> None:
        if before is None:
            os.environ.pop(UNSAFE_ENV, None)
        else:
            os.environ[UNSAFE_ENV] = before

    ctx.call_on_close(put_back)


def option_given(ctx: typer.Context, name: str) -> bool:
    """Whether the option `name` was given (on the command line or in the environment), not defaulted."""
    source = ctx.get_parameter_source(name)  # typer vendors click: compare by name, not by enum class
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


RUN_FORMAT_HELP = ("The summary's format: table, csv, json or tsv on stdout, case-insensitive (default: "
                   "table on a terminal, tsv in a pipe).")


def run_format_option():
    """--format/-f of a command whose product is a directory (train, distill): -o - is refused there, so its
    help says nothing of stdout carrying an artifact."""
    from .output import FORMAT_METAVAR

    return typer.Option(None, "--format", "-f", metavar=FORMAT_METAVAR, help=RUN_FORMAT_HELP)


def given_path(flag: str, give: str = "a file (- = stdin)"):
    """typer parser of a path option: an empty path is refused as one (a Path of '' would be the working
    directory), before any work; the sentence asks for `give`, what the option names."""

    def parse(value: str) -> Path:
        if not value.strip():
            fail(f"{flag} is an empty path; give {give}")
        return Path(value)

    return parse


def model_file(model: str | None) -> Path | None:
    """The checkpoint directory or .gguf file that --model reads, which no output may replace (None for a
    preset, read from no file)."""
    from sparrow.stages.model.presets import PRESETS

    return None if model is None or model.lower() in PRESETS else Path(model).expanduser()


def output_path(give: str = "a file path such as out.parquet (- = stdout)", folder: bool = False):
    """typer parser of an -o option: `given_path` for -o, asking for `give`; a file output written as a
    directory (out/), which a Path would turn into a file of that name, is refused as it is typed."""
    from sparrow.schemas import ArtifactError
    from sparrow.schemas.locations import check_file_path

    parse_given = given_path("-o", give)

    def parse(value: str) -> Path:
        path = parse_given(value)
        if not folder:
            try:
                check_file_path(value)
            except ArtifactError as e:
                fail(f"-o {e}")
        return path

    return parse


def check_tail(quantile: float, threshold: float | None = None) -> None:
    """--quantile and --threshold of a tail summary, by the planner's own checks, before any work."""
    from sparrow.stages.core.schedule import ScheduleError, check_quantile, check_threshold

    try:
        check_quantile(quantile)
    except ScheduleError as e:
        raise UsageError(f"--quantile: {e}") from None
    try:
        if threshold is not None:
            check_threshold(threshold)
    except ScheduleError as e:
        raise UsageError(f"--threshold: {e}") from None


# ---------------------------------------------------------------- memory

HOST_BYTES_PER_ITEM = 4096  # the least a prompt or a sample holds on the host (its row, sequence, generator)


def host_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(items: int, what: str, hint: str) -> None:
    """Refuse, before any work, more prompts or samples (`items`, described by `what`) than this machine
    could hold even at the least each one takes; `hint` says what to do instead."""
    need, have = items * HOST_BYTES_PER_ITEM, host_memory()
    if need > have:
        raise UsageError(f"{what} need at least {need / 2**30:,.0f} GiB of memory to hold ("
                         f"{HOST_BYTES_PER_ITEM // 1024} KiB each), more than this machine's "
                         f"{have / 2**30:,.0f} GiB; {hint}")


ID_BYTES = 4  # a token id (int32): what a sample's copy of its prompt holds per token, at least
SAMPLED_BYTES = 16  # the least a sampled token holds on the host: its id, logprob, budget and KV length
SCORE_BYTES = 4  # a first-token score (fp32), one per vocabulary entry and sample


def check_sampling_memory(prompt_lengths: list[int], samples: int, max_new_tokens: int, vocab: int,
                          hint: str) -> None:
    """Refuse, before any weights load, samples this machine could not hold even at the least they take:
    every sample keeps its prompt's and its generated tokens until the artifact is written, and the samples
    of a prompt draw their first token together, each from its own copy of the vocabulary's scores."""
    prompt, sampled = samples * sum(prompt_lengths), samples * len(prompt_lengths) * max_new_tokens
    tokens, have = prompt + sampled, host_memory()
    need = prompt * ID_BYTES + sampled * SAMPLED_BYTES + samples * vocab * SCORE_BYTES
    if need > have:
        n = len(prompt_lengths)
        raise UsageError(f"--samples {samples} for {n} prompt{'s' * (n != 1)} with --max-new-tokens "
                         f"{max_new_tokens} need at least {need / 2**30:,.0f} GiB of memory (their "
                         f"{tokens:,} tokens, and {vocab:,} first-token scores per sample, one per "
                         f"vocabulary entry), more than this machine's {have / 2**30:,.0f} GiB; {hint}")


def gpu_memory_option():
    return typer.Option(DEFAULT_GPU_MEMORY_UTILIZATION, "--gpu-memory-utilization", callback=finite,
                        help="On cuda, the share of the GPU's memory the rollout engine may fill (weights "
                             "and anything else in use counted), in (0, 1]: its KV cache is sized after "
                             "a profiling run, never larger than the rollouts can use (vLLM's and verl's "
                             "name). Ignored on a CPU.")


def threads_option():
    return typer.Option(None, "--threads", show_default=False,
                        help="CPU threads for torch (default: torch's own choice, one per core; fewer leave "
                             "cores to other work on a shared machine).")


def check_threads(threads: int | None) -> None:
    """--threads between 1 and this machine's CPUs: more threads than CPUs only slow torch down, and
    tens of thousands fail to start at all."""
    if threads is None:
        return
    if threads < 1:
        raise UsageError(f"--threads must be at least 1, got {threads}")
    cpus = os.cpu_count() or 1
    if threads > cpus:
        raise UsageError(f"--threads {threads} is more than this machine's {cpus} CPUs; give at most {cpus}")


def set_threads(threads: int | None) -> None:
    """Apply --threads before any work (torch is imported only when it is given)."""
    check_threads(threads)
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)


def check_gpu_memory(fraction: float) -> float:
    from sparrow.stages.engine.memory import check_memory_utilization  # light: no torch

    try:
        return check_memory_utilization(fraction)
    except ValueError as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------- sparsity: KV compression, block top-k

def kv_compression_option():
    return typer.Option(None, "--kv-compression", help="Roll out with a compressed KV cache, as Sparse-RL "
                        "does: snapkv or rkv. Per layer and KV head, the first 4 tokens and the last "
                        "--kv-window are always kept; whenever a sample's cache reaches --kv-budget + "
                        "--kv-buffer tokens it is compressed back to --kv-budget (SnapKV: the tokens the "
                        "window's queries attend to most; R-KV: that minus key redundancy), freeing pages "
                        "for more samples. The flag takes the kind alone, snapkv or rkv (case-insensitive), "
                        "and --kv-budget its B; the spec form snapkv:B or rkv:B is profile's --sampler's. "
                        "Not with --budget or --schedule (block top-k keeps every token; the two do not "
                        "combine).")


def kv_budget_option():
    return typer.Option(None, "--kv-budget", help="With --kv-compression: the tokens a compressed cache "
                        "keeps (Sparse-RL ran 512); more than the 4 sink tokens plus --kv-window.")


def kv_window_option():
    return typer.Option(None, "--kv-window", help="With --kv-compression: the observation window, the last "
                        "W queries that score the cache and the last W tokens always kept (default 8, "
                        "R-KV's and the Sparse-RL release's).")


def kv_buffer_option():
    return typer.Option(None, "--kv-buffer", help="With --kv-compression: the tokens a cache grows by "
                        "between compressions (default 128, R-KV's buffer and the release's divide length).")


def eviction_from_flags(kind: str | None, budget: int | None, window: int | None, buffer: int | None,
                        cfg=None, block_topk: dict[str, object] | None = None, need_budget: bool = True):
    """The eviction policy of --kv-compression/--kv-budget/--kv-window/--kv-buffer (None: not given),
    checked against the model's context (`cfg`) and the block top-k flags given with it
    (`block_topk`: flag -> value); one sentence otherwise, before any work."""
    from sparrow.stages.kv_policies import EVICTION_POLICIES

    if kind is None:
        for flag, value in (("--kv-budget", budget), ("--kv-window", window), ("--kv-buffer", buffer)):
            if value is not None:
                raise UsageError(f"{flag} applies only with --kv-compression snapkv or rkv")
        return None
    if kind.lower() not in EVICTION_POLICIES:
        raise UsageError(f"--kv-compression must be one of {', '.join(EVICTION_POLICIES)}, got {kind!r}"
                         + _spec_hint(kind))
    given = [flag for flag, value in (block_topk or {}).items() if value]
    if given == ["--dense"]:
        raise UsageError("--kv-compression and --dense were given together: eviction and --dense (attention "
                         "over the whole cache) do not combine; pick one")
    if given:
        topk = next(flag for flag in given if flag != "--dense")
        raise UsageError(f"--kv-compression and {topk} were given together: eviction and block top-k "
                         "selection do not combine; pick one")
    if budget is None and need_budget:
        raise UsageError(f"--kv-compression {kind} needs --kv-budget (the tokens a compressed cache keeps)")
    options = {k: v for k, v in (("window", window), ("buffer", buffer)) if v is not None}
    policy = EVICTION_POLICIES[kind.lower()](budget if budget is not None else 0, **options)
    if not need_budget:
        return policy
    try:
        return policy.validate(None if cfg is None else cfg.max_position_embeddings,
                               label=f"--kv-compression {kind} --kv-budget {budget}")
    except ValueError as e:
        raise UsageError(str(e)) from None


def _spec_hint(kind: str) -> str:
    """For a spec given to --kv-compression (snapkv:64): how the flags say it, the budget as --kv-budget."""
    from sparrow.stages.kv_policies import EVICTION_POLICIES

    name, _, budget = kind.partition(":")
    if not budget or name.lower() not in EVICTION_POLICIES:
        return ""
    return f"; the flags give the spec {kind} as --kv-compression {name} --kv-budget {budget.split(',')[0]}"


def sparsity_policy(schedule: Path | None, budget: int | None, dense: bool, kv: tuple, model: str):
    """The one KV policy of the sparsity flags: --kv-compression with --kv-budget/--kv-window/--kv-buffer
    (`kv`, in that order) or one of --schedule/--budget/--dense (none: dense); one sentence on error."""
    from sparrow.stages.core.sparsity import as_policy
    from sparrow.stages.model.config import ModelSpecError
    from sparrow.stages.model.loading import resolve_config

    cfg = None  # the model's own error comes when it loads
    if kv[0] is not None:  # the model's context is needed only to check a compression
        try:
            cfg = resolve_config(model)
        except ModelSpecError:
            pass
    eviction = eviction_from_flags(*kv, cfg, {"--budget": budget, "--schedule": schedule, "--dense": dense})
    return eviction or as_policy(block_topk_sparsity(schedule, budget, dense, model))


def block_topk_sparsity(schedule: Path | None, budget: int | None, dense: bool, model: str):
    """The one of --schedule/--budget/--dense the user gave (None = dense), validated for the engine's
    pages and, for a schedule, for `model`'s shape; one sentence on error."""
    from sparrow.stages.attention import PAGE_SIZE
    from sparrow.stages.core.sparsity import sparsity_from_flags
    from sparrow.stages.model.config import ModelSpecError
    from sparrow.stages.model.loading import resolve_config

    try:
        cfg = resolve_config(model)
    except ModelSpecError:
        cfg = None  # the model's own error comes when it loads
    try:
        sparsity = sparsity_from_flags(schedule, budget, dense, PAGE_SIZE, cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if budget is not None and cfg is not None:
        check_budgets([budget], cfg.max_position_embeddings, "--budget", model)
    if schedule is not None and cfg is not None:  # `sparsity` is the schedule read, its budgets checked
        check_budgets([b for b in sparsity.budgets if b], cfg.max_position_embeddings,
                      f"--schedule {schedule}: its budget", model)
    return sparsity


def check_speculative_schedule(schedule: Path | None, speculate: int, label: str | None = None,
                               budget_flag: str = "--budget",
                               say: Callable[[str], None] | None = None) -> None:
    """A schedule's fit for the sampler it drives: under --speculate, one dense in every bin is refused
    (its drafts would be the verification's own dense steps); without it, a draft schedule that
    `plan-schedule --speculate` wrote is warned about (its budgets were planned for speed under
    verification, with no tail threshold behind them). `label` is how the user gave the schedule
    (`--schedule FILE` unless told) and `budget_flag` how a fixed budget is given instead, so rollout,
    train and profile say the same sentences in their own flags. A draft schedule run with another K than
    it was planned for gets a note (to `say`, which may hold it until the other checks passed)."""
    from sparrow.schemas import ArtifactError, artifact_metadata
    from sparrow.stages.core.schedule import Schedule

    if schedule is None:
        return
    label = label or f"--schedule {schedule}"
    budgets = Schedule.from_artifact(schedule).budgets
    if speculate > 0 and not any(budgets):
        raise UsageError(f"{label} is dense in every bin, so --speculate would draft with the dense model "
                         f"itself; give a sparse schedule or {budget_flag}, or drop --speculate")
    if speculate > 0 and not all(budgets):
        dense = [str(i) for i, b in enumerate(budgets) if not b]
        warn(f"{label} is dense in bin{'s' * (len(dense) > 1)} {', '.join(dense)}, where --speculate drafts "
             "with the dense model itself: those cycles cost a verification for nothing")
    try:
        drafts = artifact_metadata(schedule).get("speculate")
    except ArtifactError:
        return
    if drafts and speculate == 0:
        warn(f"{label} holds draft budgets for --speculate {drafts} (plan-schedule --speculate), planned for "
             "speed under verification with no tail threshold; as a lossy schedule it may train off-policy: "
             f"add --speculate {drafts}, or plan a lossy schedule without --speculate")
    elif drafts and speculate != int(drafts):
        _note_other_k(label, int(drafts), speculate, artifact_metadata(schedule).get("predicted_speedup"),
                      say or note)


def _note_other_k(label: str, planned: int, speculate: int, speedup: object,
                  say: Callable[[str], None]) -> None:
    """A draft schedule run with another K than it was planned for: exact all the same (any K keeps the
    dense law), but its predicted speedup is the planned K's, which a note says."""
    predicted = "its predicted speedup" if not isinstance(speedup, int | float) else \
        f"its predicted speedup ({speedup:.3f}x)"
    say(f"{label} was planned for --speculate {planned} (plan-schedule --speculate); {predicted} is for "
         f"K = {planned}, not for K = {speculate}")


def capped_speculate(speculate: int, max_new_tokens: int, say: Callable[[str], None] | None = None) -> int:
    """--speculate K as the engine can use it: a cycle drafts at most --max-new-tokens - 2 tokens (a sample's
    first token comes from the prefill, and every cycle ends with a token of the dense verification), so
    a larger K is capped there (at least 1), with a note (or `say`); the samples are the same."""
    most = max(max_new_tokens - 2, 1)
    if speculate <= most:
        return speculate
    why = "(the first token comes from the prefill and every cycle ends with one of the dense verification)"
    if max_new_tokens > 2:
        said = f"is capped at {most}: with --max-new-tokens {max_new_tokens} a cycle drafts at most {most} " \
               f"token{'s' * (most != 1)} {why}"
    else:
        said = f"drafts nothing: with --max-new-tokens {max_new_tokens} no cycle has a token to draft " \
               f"{why}, so every token is the dense model's own step"
    (say or note)(f"--speculate {speculate} {said}")
    return most


def check_budget_reach(budget: int | None, speculate: int, prompt_lengths: list[int] | None,
                       max_new_tokens: int, say: Callable[[str], None] = note) -> None:
    """--budget B where B covers every sample's cache (its longest prompt plus --max-new-tokens - 1
    tokens, the most a token's attention reads): block top-k keeps every page, which a note to `say` says
    (the run is dense attention, at a sparse step's cost). With --speculate K every draft would be the dense
    model's own step, as a schedule dense in every bin, which is refused alike; where it covers some
    prompts' whole caches, a warning says so, as for a schedule's dense bins. `prompt_lengths` None (text
    prompts, tokenized later): not checked."""
    from sparrow.stages.core.definitions import PAGE_SIZE, RESERVED_PAGES

    if budget is None or not prompt_lengths:
        return
    longest = max(prompt_lengths) + max_new_tokens - 1
    if not speculate:
        if budget >= longest:
            say(f"--budget {budget} covers every sample's cache (the longest prompt, {max(prompt_lengths)} "
                f"tokens, with --max-new-tokens {max_new_tokens} reaches at most {longest} tokens), so "
                "block top-k keeps every page: this run's attention is dense")
        return
    below = (longest - 1) // PAGE_SIZE * PAGE_SIZE  # the largest budget below the longest cache
    if budget >= longest:
        raise UsageError(f"--budget {budget} covers every sample's cache (the longest prompt, "
                         f"{max(prompt_lengths)} tokens, with --max-new-tokens {max_new_tokens} reaches at "
                         f"most {longest} tokens), so --speculate would draft with the dense model itself; "
                         + (f"give a --budget of at most {below} (a multiple of {PAGE_SIZE}), or drop "
                            "--speculate" if below >= RESERVED_PAGES * PAGE_SIZE else "drop --speculate"))
    covered = sum(n + max_new_tokens - 1 <= budget for n in prompt_lengths)
    if covered:
        warn(f"--budget {budget} covers the whole cache of {covered} of {len(prompt_lengths)} prompts (up to "
             f"{budget - max_new_tokens + 1} prompt tokens with --max-new-tokens {max_new_tokens}), where "
             "--speculate drafts with the dense model itself: their cycles cost a verification for nothing")


def check_budgets(budgets: list[int], context: int, flag: str, model: str) -> None:
    """Block top-k budgets no larger than the model's context: a larger one is never reached."""
    for b in budgets:
        if b > context:
            raise UsageError(f"{flag} {b} exceeds the context of {model} ({context} tokens); a budget that "
                             "covers the whole context is dense attention")


# ---------------------------------------------------------------- Ray workers

def check_workers(workers: int, ray_address: str | None, output: Path | None) -> None:
    """--workers/--ray-address: a count, Ray installed, a cluster that answers at --ray-address (or
    RAY_ADDRESS), and -o (when the parts go there) a directory; one sentence otherwise, before any work."""
    from sparrow.stages.backends.ray_pool import RayMissing, RayUnreachable, check_cluster, require_ray

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
    if output is not None and os.path.isfile(output):  # False for a name too long: check_output says so
        raise UsageError(f"-o {output} is a file, but --workers writes a directory of Parquet parts")
    try:
        check_cluster(ray_address)
    except RayUnreachable as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------- adapters, weights and thresholds

def check_has_weights(model: str, random_weights: bool | None = None) -> None:
    """A shapes-only preset (qwen3-4b) has no weights to sample with: refused before the prompts are read
    or a model loads; `random_weights` None where the command has no --random-weights to time it with."""
    from sparrow.stages.model.presets import shapes_only

    if (why := shapes_only(model)) and not random_weights:
        timing = "" if random_weights is None else ", or --random-weights to time its shapes"
        raise UsageError(why + timing)


def random_weights_of(model: str, consequence: str) -> bool:
    """Whether --random-weights gives `model` random weights: a preset's only (a checkpoint keeps its own,
    with a one-sentence warning). The flag is for shapes-only presets: on a preset with weights of its own,
    a one-sentence warning gives the `consequence`."""
    from sparrow.stages.model.presets import PRESETS

    preset = PRESETS.get(model.lower())
    if preset is None:
        warn(f"--random-weights applies to presets only; {model} runs with its own weights")
        return False
    if preset.weights == "embedded":
        warn(f"--random-weights replaces the weights of {preset.name} with random ones, so {consequence}; "
             "the flag is for shapes-only presets such as qwen3-4b")
    return True


def base_name(spec: str) -> str:
    """A model's name for comparison: a preset, or a checkpoint directory's (or a hub id's) last part."""
    from sparrow.stages.model.names import short_name

    return short_name(spec.rstrip("/")).lower()


def load_actor(path: Path | None, cfg, model: str | None = None, flag: str = "--adapter"):
    """The sparse actor's adapter, checked against the model's shapes (one sentence if it was trained on
    another base model, or if its files are not a peft adapter); a warning when its config names another
    base model than `model` whose shapes happen to fit."""
    from safetensors import SafetensorError

    from sparrow.stages.model.lora import check_lora_fits, load_lora

    if path is None:
        return None
    base = read_adapter_config(path, flag).get("base_model_name_or_path")
    try:
        lora = load_lora(path)
    except (ValueError, KeyError, OSError, SafetensorError) as e:
        raise UsageError(f"{flag} {path}: {e.args[0] if e.args else e}") from None
    try:
        check_lora_fits(lora, cfg, f"{flag} {path}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if model is not None and base and base_name(base) != base_name(model):
        warn(f"{flag} {path} was trained on {base!r} (its adapter_config.json), not on --model {model}; its "
             "shapes fit, so it is used as given")
    return lora


def distilled_adapter(folder: Path) -> bool:
    """An adapter directory that `sparrow distill` (or `train --distill-sparse`) wrote: a sparse actor's."""
    return (folder / "adapter_config.json").exists() and (folder / "sparrow_distill.json").exists()


def read_adapter_config(path: Path, flag: str = "--adapter") -> dict:
    """A peft adapter directory's adapter_config.json, checked: one sentence naming the file otherwise."""
    import json

    config_file = path / "adapter_config.json"
    if not path.exists():
        raise UsageError(f"{flag} {path} does not exist; give a peft LoRA adapter directory (with "
                         "adapter_config.json and adapter_model.safetensors)")
    if not path.is_dir():
        raise UsageError(f"{flag} {path} is a file, not a peft LoRA adapter directory (with "
                         "adapter_config.json and adapter_model.safetensors)")
    if not config_file.is_file():
        raise UsageError(f"{flag} {path}: not a LoRA adapter directory (no adapter_config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {path}: {config_file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{flag} {path}: {config_file} holds a JSON {type(config).__name__}, not peft's "
                         "adapter config object")
    for key in ("r", "lora_alpha"):
        if isinstance(config.get(key), bool) or not isinstance(config.get(key), (int, float)):
            raise UsageError(f"{flag} {path}: {config_file}: {key!r} must be a number, got "
                             f"{config.get(key)!r}")
    if not (path / "adapter_model.safetensors").is_file():
        raise UsageError(f"{flag} {path}: no adapter_model.safetensors beside its adapter_config.json")
    return config


def default_threshold(threshold: float | None, model: str, quantile: float):
    """The threshold a summary marks, by the rule every command follows (`resolve_threshold`): given, else
    the calibration shipped for the model, else the prior; one sentence if it is out of range."""
    from sparrow.stages.calibrate import resolve_threshold
    from sparrow.stages.core.schedule import ScheduleError

    try:
        return resolve_threshold(threshold, None, quantile, model)
    except ScheduleError as e:
        raise UsageError(f"--threshold: {e}") from None


def rollouts_temperature(path: Path, recorded: float | None, given: float | None) -> float:
    """Alpha is measured at the sampling temperature: the one the artifact records, else --temperature,
    else 1."""
    if recorded is not None and given is not None and given != recorded:
        raise UsageError(f"{path} was sampled at temperature {recorded:g} (its metadata), but "
                         f"--temperature {given:g} was given; leave --temperature out to measure alpha at "
                         "the sampling temperature")
    return recorded if recorded is not None else 1.0 if given is None else given
