"""`sparrow train` around the Trainer: the run directory checked before any weights load, the model and
prompts loaded and checked, the Ray rollout workers or torchrun ranks, and the summary record."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sparrow.schemas import check_output_dir

from ..backends.ray_pool import RolloutPool
from ..core.notes import muted, note
from ..core.prompt_set import PromptError, PromptSet
from ..core.user_data import DataOptions
from ..kv_policies import KVPolicy
from ..model import loading
from .checkpoint import check_resumable
from .config import TrainConfig
from .data import PromptRow, load_prompts
from .distributed import World, init_world, shutdown_world
from .run_dir import check_run_dir, with_fingerprints
from .trainer import SUMMARY_MEANS, RunOptions, Trainer


@dataclass
class TrainInputs:
    """What a run reads and where it writes, beside what defines it (`TrainConfig`)."""

    prompts: Path
    output_dir: Path
    policy: KVPolicy  # the rollouts' KV policy; `TrainConfig.sparsity` stores its spec
    eval_prompts: Path | None = None
    data: DataOptions = DataOptions()  # how users' datasets are read and scored (both prompt files)


def read_prompts(cfg: TrainConfig, inputs: TrainInputs, tokenizer) -> tuple[list[PromptRow],
                                                                           list[PromptRow] | None]:
    """Both prompt files tokenized and fitted to the model (`fitted`)."""
    chat = not cfg.raw_prompts
    rows = load_prompts(inputs.prompts, tokenizer, chat, inputs.data, cfg.model, fitted(cfg, "--prompts"))
    held_out = None if inputs.eval_prompts is None else load_prompts(
        inputs.eval_prompts, tokenizer, chat, inputs.data, cfg.model, fitted(cfg, "--eval-prompts"))
    return rows, held_out


def check_run_location(cfg: TrainConfig, inputs: TrainInputs, resume: bool, force: bool) -> None:
    """The run directory (writable, a run to resume with the same options and input contents, a readable
    checkpoint and steps left to train, or none to overwrite), before any weights load: the prompts are read
    with the model's tokenizer alone."""
    check_output_dir(inputs.output_dir, "a training run", ours=lambda d: True, force=force)  # no FIFO
    if not (inputs.output_dir.exists() or resume):
        return
    with muted():  # what the prompts' reading finds is said when the run reads them
        rows, held_out = read_prompts(cfg, inputs, loading.spec_tokenizer(cfg.model))
    check_run_dir(inputs.output_dir, with_fingerprints(cfg, rows, held_out, inputs.policy), resume, force)
    if resume:
        check_resumable(inputs.output_dir, cfg.steps)


def join_world(device: str, workers: int) -> World:
    """This process's torchrun rank (or the single process); Ray workers are refused under torchrun."""
    world = init_world(device)
    if workers and world.distributed:
        raise ValueError("--workers (Ray rollout workers) cannot run under torchrun; use one of them")
    return world


@contextmanager
def launched(cfg: TrainConfig, workers: int, ray_address: str | None) -> Iterator[RolloutPool | None]:
    """The Ray rollout pool of `workers` (None: none), seeded with the learner's base weights; the pool
    and the torchrun process group are released at the end."""
    pool = None
    try:
        if workers:
            pool = RolloutPool(cfg.model, workers, address=ray_address, device=cfg.device,
                               random_weights=cfg.random_weights)
        yield pool
    finally:
        if pool is not None:
            pool.close()
        shutdown_world()


def fitted(cfg: TrainConfig, flag: str) -> Callable[[PromptSet], None]:
    """A prompt set's check against the model: token ids within its vocabulary, prompts too long for its
    context (or --max-prompt-length) cut or left out as the run says, else refused (`PromptSet.check_fits`:
    the file and the prompt id), the flag that named the file said first."""
    model = loading.resolve_config(cfg.model)

    def fit(prompt_set: PromptSet) -> None:
        try:
            with muted():  # said below, once the prompts left suffice for a step
                prompt_set.check_fits(model.vocab_size, model.max_position_embeddings, cfg.max_new_tokens)
        except PromptError as e:
            raise PromptError(f"{flag} {e}") from None
        if flag == "--prompts" and prompt_set.left_out and cfg.prompts_per_step > len(prompt_set.rows):
            raise PromptError(f"--prompts-per-step {cfg.prompts_per_step} is more than the "
                              f"{len(prompt_set.rows)} prompts --filter-overlong-prompts keeps of "
                              f"{prompt_set.path}; a step would roll out a prompt more than once, so give at "
                              f"most {len(prompt_set.rows)}")
        for line in prompt_set.length_notes:
            note(line)

    return fit


def start_training(cfg: TrainConfig, inputs: TrainInputs, opts: RunOptions) -> Trainer:
    """The prompts read with the model's tokenizer and checked against its context before its weights
    load, then the model and the Trainer (a refused resume says so here); ValueError in one sentence,
    before the run directory is written."""
    tokenizer = loading.spec_tokenizer(cfg.model)  # the one load_model returns, without the weights
    if tokenizer is None:
        raise ValueError(f"--model {cfg.model} has no tokenizer, so the task's scorer cannot read the "
                         "sampled answers; train a model with a tokenizer (a checkpoint with tokenizer "
                         "files)")
    rows, held_out = read_prompts(cfg, inputs, tokenizer)
    if opts.on_phase:
        opts.on_phase("loading")
    loaded = loading.load_model(cfg.model, device=cfg.device, random_weights=cfg.random_weights,
                                dtype=loading.resolve_dtype(cfg.dtype, cfg.device))
    return Trainer(cfg, loaded, rows, inputs.output_dir, eval_prompts=held_out, options=opts,
                   policy=inputs.policy)


def summary_record(s: dict) -> dict:
    """The run's summary (`Trainer.summary`) as the one record `sparrow train` prints (per-step numbers:
    metrics.parquet)."""
    sparse_eval = s.get("final_eval_accuracy_sparse")
    return {**{k: s[k] for k in ("steps", "reward_first", "reward_last", "initial_eval_accuracy",
                                 "final_eval_accuracy")},
            **({"final_eval_accuracy_sparse": sparse_eval} if sparse_eval is not None else {}),
            **({"initial_sampler_gap": s["initial_sampler_gap"]} if s.get("initial_sampler_gap") is not None
               else {}),
            "skipped_updates": s.get("skipped_updates", 0),
            **{f"mean_{k}": s[f"mean_{k}"] for k in SUMMARY_MEANS},
            "label": s["label"], "first_collapse_step": s["first_collapse_step"],
            "reasons": "; ".join(s["reasons"]), "warnings": "; ".join(s.get("warnings", [])),
            "adapter": s["adapter"] or None, **({"model": s["model"]} if s.get("model") else {}),
            **({"sparse_adapter": s["sparse_adapter"]} if s.get("sparse_adapter") else {})}
