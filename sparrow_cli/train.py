"""`sparrow train`: GRPO on sparse rollouts, a run directory of metrics, per-token mismatch and an adapter."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sparrow.stages.core.definitions import DEFAULT_BIN_WIDTH
from sparrow.stages.train.clip import CLIP_HIGH, CLIP_LOW

from .console import console
from .data_options import (
    answer_column_option,
    data_options,
    filter_overlong_option,
    max_prompt_length_option,
    prompt_column_option,
    prompt_length,
    read_eval_prompts,
    reward_fn_option,
    reward_kwargs_option,
    reward_option,
    truncation_option,
)
from .errors import UsageError, friendly_errors
from .messages import fail, note, warn
from .option_values import check_device, raw_prompts_option, warn_first_token_stops
from .options import (
    any_case,
    capped_speculate,
    check_budget_reach,
    check_gpu_memory,
    check_sampling_memory,
    check_speculative_schedule,
    check_workers,
    code_rewards,
    device_option,
    finite,
    given_path,
    gpu_memory_option,
    kv_budget_option,
    kv_buffer_option,
    kv_compression_option,
    kv_window_option,
    non_negative_seed,
    option_given,
    random_weights_of,
    run_format_option,
    set_threads,
    sparsity_policy,
    threads_option,
    top_k_option,
    top_p_option,
    unsafe_code_option,
)
from .output import emit_record, resolve_format
from .paths import input_path
from .progress import Heartbeat, live_progress, log_line, say_loading

TRAIN_LABELS = {"reward_first": "reward, first step", "reward_last": "reward, last step",
                "model": "fine-tuned model (Hugging Face checkpoint)",
                "initial_eval_accuracy": "eval accuracy before training",
                "initial_sampler_gap": "sampler gap before training (dense minus sparse sampled reward)",
                "final_eval_accuracy": "eval accuracy, last eval",
                "final_eval_accuracy_sparse": "eval accuracy under the run's sparsity, last eval",
                "skipped_updates": "steps whose update was skipped (every token rejected)",
                "mean_mismatch_kl": "mismatch KL (mean)",
                "mean_alpha_p5": "alpha p5, min over position bins, exact on a subsample (mean over steps)",
                "mean_alpha_lb_p5": "alpha top-20 lower bound, p5 pooled over tokens (mean over steps)",
                "mean_masked_fraction": "masked tokens (mean fraction)",
                "mean_vetoed_fraction": "vetoed tokens (mean fraction)",
                "mean_rollout_seconds": "s per step: rollout", "mean_scoring_seconds": "s per step: scoring",
                "mean_update_seconds": "s per step: update",
                "mean_weight_sync_seconds": "s per step: weight sync to the Ray workers (in rollout)",
                "first_collapse_step": "first collapse step (of the streak that ends the run)",
                "reasons": "collapse reasons", "warnings": "warnings (not collapse reasons)"}


def _no_batch_size(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> None:
    """--batch-size and --batch name the rollout engine's --max-num-seqs on rollout and profile, but a TRL or
    verl user means a training batch by them: on train they are refused, with the options that say which."""
    if value is not None and not ctx.resilient_parsing:
        fail(f"{' and '.join(param.opts)} are ambiguous for a training run: a step's batch is "
             "--prompts-per-step x --samples, the update's --micro-batch, and the rollout engine's "
             "--max-num-seqs")


@friendly_errors
def train(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", "--model", help="Preset, checkpoint dir or .gguf."),
    prompts: Path = typer.Option(..., "--prompts", callback=input_path, parser=given_path("--prompts"),
                                 metavar="<path>", help="Training prompts (with answers; - = stdin): a "
                                 "prompts artifact, or a verl or TRL dataset scored by --reward or "
                                 "--reward-fn."),
    raw_prompts: bool = raw_prompts_option(),
    max_prompt_length: int = max_prompt_length_option(),
    truncation: str = truncation_option(),
    filter_overlong_prompts: bool = filter_overlong_option(),
    prompt_column: str = prompt_column_option(),
    answer_column: str = answer_column_option(),
    reward: str = reward_option(),
    reward_fn: str = reward_fn_option(),
    reward_kwargs: str = reward_kwargs_option(),
    unsafe_code_execution: bool = unsafe_code_option(),
    eval_prompts: Path = typer.Option(None, "--eval-prompts", callback=input_path,
                                      parser=given_path("--eval-prompts"), metavar="<path>",
                                      help="Held-out prompts: "
                                      "greedy dense accuracy at the start, every --eval-every steps and "
                                      "after the last step."),
    schedule: Path = typer.Option(None, "--schedule", callback=input_path, parser=given_path("--schedule"),
                                  metavar="<path>", help="Roll out with this schedule artifact."),
    budget: int = typer.Option(None, "--budget", help="Roll out with a fixed budget in tokens (multiple of "
                               "16, at least 48)."),
    dense: bool = typer.Option(False, "--dense/--no-dense", show_default=False,
                               help="Roll out densely, as a run does without --budget, --schedule or "
                               "--kv-compression. --no-dense, the default, leaves the choice to them."),
    kv_compression: str = kv_compression_option(),
    kv_budget: int = kv_budget_option(),
    kv_window: int = kv_window_option(),
    kv_buffer: int = kv_buffer_option(),
    steps: int = typer.Option(20, "--steps", help="Training steps, each a rollout then --ppo-epochs "
                              "optimizer updates, at least 1; with --resume, the run's new total (verl's "
                              "total_training_steps; TRL's max_steps counts the updates)."),
    prompts_per_step: int = typer.Option(4, "--prompts-per-step", help="Prompts each step rolls out, each "
                                         "with --samples samples (the step's batch is their product); the "
                                         "prompts are taken in turn, in a new order each pass."),
    samples: int = typer.Option(4, "--samples", "--num-generations", help="Samples per prompt: the GRPO "
                                "group (TRL's num_generations)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "--max-completion-length",
                                       help="Tokens sampled at most per sample (TRL's "
                                       "max_completion_length). Default 64: every step samples and "
                                       "backpropagates through them; rollout and profile default to 256."),
    temperature: float = typer.Option(1.0, "--temperature", callback=finite,
                                      help="Sampling temperature of the rollouts, above 0 (0, greedy, is "
                                      "refused: a group of identical samples has no reward spread to learn "
                                      "from); the update's logprobs use it too."),
    top_p: float = top_p_option(" As TRL's and verl's top_p, the logprobs the correction and the update read "
                                "are of the whole distribution at --temperature (vLLM's raw logprobs)."),
    top_k: int = top_k_option(" As --top-p, it shapes which tokens are sampled, not the logprobs."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos/--no-ignore-eos",
                                    help="Every sample generates --max-new-tokens "
                                    "tokens (fixed-length steps, for timing)."),
    lr: float = typer.Option(1e-4, "--lr", "--learning-rate", callback=finite,
                             help="AdamW learning rate (TRL's "
                             "learning_rate)."),
    lora_rank: int = typer.Option(16, "--lora-rank", help="LoRA rank on every projection (peft)."),
    lora_alpha: float = typer.Option(32.0, "--lora-alpha", callback=finite,
                                     help="LoRA scale numerator: 2 x the default rank, "
                                     "the usual choice; distill's sparse-actor LoRA uses DistillSparse's "
                                     "published 16."),
    full: bool = typer.Option(False, "--full/--no-full", help="Full fine-tuning instead of a LoRA; writes "
                              "RUN/model/, a Hugging Face checkpoint that --model, transformers and vLLM "
                              "load."),
    correction: str = typer.Option(
        "tis", "--correction", callback=any_case, help="A preset: none | tis | mis | veto | sparse-rl | "
        "icepop | seq-mask-tis | opsm | sparrow, case-insensitive (docs/corrections.md says what each "
        "does); the options below replace the parts they name."),
    rollout_is: str = typer.Option(None, "--rollout-is", callback=any_case,
                                   help="verl's rollout_is: token | sequence | none."),
    rollout_is_threshold: str = typer.Option(
        None, "--rollout-is-threshold", help="The importance weight's bounds: U, or L_U (0.5_2.0: L 0.5, "
        "U 2.0; default 2.0)."),
    rollout_is_mode: str = typer.Option(None, "--rollout-is-mode", callback=any_case,
                                        help="truncate (TIS) | mask (IcePop; TRL's *_mask)."),
    rollout_is_batch_normalize: bool = typer.Option(
        None, "--rollout-is-batch-normalize/--no-rollout-is-batch-normalize",
        help="Divide the kept weights by their mean (default: the "
        "--correction preset's)."),
    rollout_rs: str = typer.Option(
        None, "--rollout-rs", callback=any_case, help="verl's rollout_rs: reject by the "
        "rollout-to-policy log ratio's estimators of KL (k1 = the log ratio, k2 = half its square, k3 = "
        "ratio - 1 - log ratio), a comma list of token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3 "
        "(a token must pass all), or none."),
    rollout_rs_threshold: str = typer.Option(
        None, "--rollout-rs-threshold", help="One per option, or one for all: L_U ratio bounds for k1 (U "
        "alone: L = 1/U), an upper bound for k2 and k3 (default 2.0)."),
    off_policy_mask_threshold: float = typer.Option(None, "--off-policy-mask-threshold", callback=finite,
                                                    help="OPSM's delta (TRL's name)."),
    rejection: str = typer.Option(
        None, "--rejection", callback=any_case, help="The Sparrow recipe's stochastic rejection, keep with "
        "probability min(1, r / C): token | sequence | none."),
    rejection_c: float = typer.Option(None, "--rejection-c", callback=finite, help="Its C (default 1)."),
    alpha_weight: bool = typer.Option(
        None, "--alpha-weight/--no-alpha-weight", help="Weight each token by its acceptance alpha (top-20 "
        "lower bound; 1 where sampled densely; default: the --correction preset's)."),
    bypass_mode: bool = typer.Option(False, "--bypass-mode/--no-bypass-mode",
                                     help="verl's bypass: the PPO ratio against the "
                                     "rollout logprobs instead of the dense recompute."),
    oversample: int = typer.Option(0, "--oversample", help="Roll out this many samples per prompt (more than "
                                   "--samples) and keep the --samples of highest mean acceptance (0 = off: "
                                   "roll out --samples). Not with --speculate, whose samples are all dense."),
    alpha_sequences: int = typer.Option(
        4, "--alpha-sequences", help="Sequences per step whose every token's alpha is computed exactly "
        "(full vocabulary, teacher-forced dense vs the run's sparsity) and logged as alpha_p5 / alpha_mean, "
        "the tail the stability criterion reads; with --distill-sparse the sparse side carries the sparse "
        "actor's adapter; 0: none (alpha_lb_p5, the top-20 lower bound, is logged regardless)."),
    speculate: int = typer.Option(0, "--speculate", "--num-speculative-tokens",
                                  help="Exact speculative rollouts (rollout --speculate): "
                                  "the run's sparsity drafts up to K tokens per sample and the dense policy "
                                  "verifies them, so every rollout is on-policy (no correction needed) and "
                                  "draft_acceptance is logged per step. 0 = off; not with --workers or "
                                  "--oversample."),
    epsilon: float = typer.Option(CLIP_LOW, "--epsilon", callback=finite,
                                  help="PPO clip, low side: the ratio of a negative-advantage token is cut "
                                  "at 1 - epsilon (TRL's epsilon; verl's clip_ratio_low)."),
    epsilon_high: float = typer.Option(CLIP_HIGH, "--epsilon-high", "--clip-ratio-high", callback=finite,
                                       help="PPO clip, high side: a positive-advantage token's ratio is cut "
                                       "at 1 + epsilon_high (DAPO's clip-higher; TRL's epsilon_high, verl's "
                                       "clip_ratio_high). The default is DAPO's 0.28, not TRL's (unset: "
                                       "epsilon's, 0.2) nor verl's (0.2)."),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", callback=finite,
                                        help="Clip the gradient's global norm to this (TRL's "
                                        "max_grad_norm)."),
    kl_coef: float = typer.Option(0.0, "--kl-coef", "--beta", callback=finite,
                                  help="Coefficient of the k3 KL to the initial policy (TRL's "
                                  "beta; verl's kl_loss_coef); 0 = no KL term."),
    loss_agg: str = typer.Option(
        "token-mean", "--loss-agg", "--loss-type", callback=any_case, help="How the loss averages its "
        "tokens (verl's loss_agg_mode; TRL's loss_type, whose values dapo, grpo, dr_grpo and bnpo are "
        "accepted too): token-mean (over the batch's tokens; dapo) | seq-mean-token-mean (per sequence, "
        "then over sequences; grpo) | seq-mean-token-sum-norm (the sum over sequences x --max-new-tokens; "
        "dr_grpo) | bnpo (each micro-batch's token mean, averaged)."),
    seed: int = typer.Option(0, "--seed", callback=non_negative_seed,
                             help="Seeds the run: the prompts' order, the LoRA's initial weights and every "
                             "step's samples (each from its own generator, per step, prompt and sample, as "
                             "rollout's --seed)."),
    micro_batch: int = typer.Option(8, "--micro-batch", help="Sequences per forward/backward."),
    ppo_epochs: int = typer.Option(1, "--ppo-epochs", "--num-iterations",
                                   help="Passes of the update over each step's "
                                   "samples, at least 1 (TRL's num_iterations): 1 is on-policy GRPO, more "
                                   "reuse the samples with the PPO clip."),
    checkpoint_every: int = typer.Option(10, "--checkpoint-every", help="Save RUN/checkpoint (what --resume "
                                         "continues from) every this many steps, at least 1; the last step "
                                         "and an interrupted run always save one."),
    eval_every: int = typer.Option(5, "--eval-every", help="With --eval-prompts: evaluate every this many "
                                   "steps, at least 1; the start and the last step are always evaluated."),
    bin_width: int = typer.Option(DEFAULT_BIN_WIDTH, "--bin-width",
                                  help="Position bin of the mismatch logs, in tokens."),
    distill_sparse: bool = typer.Option(False, "--distill-sparse/--no-distill-sparse",
                                        help="DistillSparse: train a second LoRA "
                                        "that only the sparse actor uses, jointly (RUN/sparse_adapter)."),
    distill_rank: int = typer.Option(16, "--distill-rank", help="Rank of the sparse actor's LoRA."),
    distill_alpha: float = typer.Option(16.0, "--distill-alpha", callback=finite,
                                        help="Its alpha (published: 16)."),
    distill_lr_ratio: float = typer.Option(5.0, "--distill-lr-ratio", callback=finite,
                                           help="Its lr over --lr (published: 5)."),
    distill_kl_coef: float = typer.Option(0.001, "--distill-kl-coef", callback=finite,
                                          help="Its k3 coefficient toward the "
                                          "dense logprobs (published: 0.001)."),
    device: str = device_option(also=" On cuda: Triton kernels, CUDA graphs."),
    dtype: str = typer.Option("auto", "--dtype", help="Weights and KV cache: auto (bfloat16 on cuda, "
                              "float32 on a CPU), float32 or bfloat16 (as profile's and rollout's)."),
    random_weights: bool = typer.Option(False, "--random-weights/--no-random-weights",
                                        help="Random weights for a shapes-only "
                                        "preset such as qwen3-0.6b (to time the GPU path)."),
    gradient_checkpointing: bool = typer.Option(None, "--gradient-checkpointing/--no-gradient-checkpointing",
                                                help="Recompute each decoder layer in the update's backward "
                                                "pass (less memory, more compute); default: on with "
                                                "--device cuda, off on the CPU."),
    gpu_memory_utilization: float = gpu_memory_option(),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs", help="Samples the rollout engine decodes "
                                     "together, at least 1 (vLLM's and verl's max_num_seqs; default: all "
                                     "of a step's, --prompts-per-step x --samples); the others wait their "
                                     "turn."),
    _batch_size: str = typer.Option(None, "--batch-size", "--batch", hidden=True, callback=_no_batch_size,
                                    help="Refused: ambiguous for a training run."),
    workers: int = typer.Option(0, "--workers", help="Roll out on N Ray workers (each loads the model once; "
                                "the weights are pushed to them before every step's rollout)."),
    ray_address: str = typer.Option(None, "--ray-address", help="An existing Ray cluster for --workers "
                                    "(default: a local Ray started for the run)."),
    resume: bool = typer.Option(False, "--resume/--no-resume",
                                help="Continue the run in -o/--output from its checkpoint (the same "
                                "options and input contents; only --steps, --checkpoint-every and "
                                "--eval-every may change, and another --threads is said in a note). A run "
                                "stopped after its last step is finished by the same --steps."),
    force: bool = typer.Option(False, "--force/--no-force",
                               help="Start the run in -o/--output over: its metrics, "
                               "per-step mismatch, schedule, checkpoint, adapters and model are replaced."),
    output_dir: Path = typer.Option(..., "-o", "--output", "--output-dir",
                                    parser=given_path("-o", "a run directory"),
                                    help="The run directory (TRL's output_dir). One that holds a run "
                                    "needs --resume or --force; files of a run's names that are not of its "
                                    "kind are replaced only with --force; a symlink is written through."),
    report_to: str = typer.Option(
        "jsonl", "--report-to", help="Live trackers of each step's metrics, a comma list: jsonl "
        "(RUN/metrics.jsonl) | tensorboard (RUN/tensorboard/) | wandb (offline, RUN/wandb/) | none; "
        "RUN/metrics.parquet is always written."),
    threads: int = threads_option(),
    format: str = run_format_option(),
) -> None:
    """GRPO whose rollouts come from the sparse engine: rewards from the task's scorer, dense recompute of
    the sampled tokens, rollout correction, PPO-clipped update. Writes RUN/metrics.parquet (and
    metrics.jsonl), RUN/mismatch/step=N.parquet, RUN/completions/step=N.parquet (query them with `sparrow
    sql --run RUN`), RUN/schedule.parquet (the sparsity it sampled with), RUN/checkpoint/ and, with a
    LoRA, RUN/adapter/ (peft format), with --full RUN/model/ (a Hugging Face checkpoint). Under `torchrun
    --nproc-per-node N` the ranks share each step's batch and DDP sums their gradients; rank 0 writes, and
    a run resumes under any number of ranks."""
    set_threads(threads)
    import torch

    from sparrow.stages.core.prompt_set import PromptSet
    from sparrow.stages.core.sparsity import spec_of
    from sparrow.stages.train import TrainConfig
    from sparrow.stages.train.launch import TrainInputs, check_run_location, join_world, launched
    from sparrow.stages.train.run_dir import resume_notes
    from sparrow.stages.train.tracking import parse_report_to
    from sparrow.stages.train.trainer import RunOptions

    fmt = resolve_format(format)
    kv = (kv_compression, kv_budget, kv_window, kv_buffer)
    policy = sparsity_policy(schedule, budget, dense, kv, model)
    notes: list[str] = []  # said once, by the process that writes the run
    if max_new_tokens >= 1:
        speculate = capped_speculate(speculate, max_new_tokens, notes.append)
    check_speculative_schedule(schedule, speculate, say=notes.append)
    try:
        trackers = parse_report_to(report_to)
    except ValueError as e:
        raise UsageError(str(e)) from None
    loss = {k: v for k, v in dict(
        rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold, rollout_is_mode=rollout_is_mode,
        rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold, off_policy_mask_threshold=off_policy_mask_threshold,
        rejection=rejection, rejection_c=rejection_c, alpha_weight=alpha_weight,
        bypass_mode=bypass_mode or None, loss_agg=None if loss_agg == "token-mean" else loss_agg,
        clip_low=None if epsilon == CLIP_LOW else epsilon,
        clip_high=None if epsilon_high == CLIP_HIGH else epsilon_high,
    ).items() if v is not None}  # a default left out: the recorded configuration names only what differs
    for flag, path in (("--prompts", prompts), ("--eval-prompts", eval_prompts)):
        if path is not None and not path.exists():
            raise UsageError(f"{flag} {path}: no such file")
    _check_lora(ctx, full, lora_rank, lora_alpha)
    _check_distill(ctx, distill_sparse, distill_rank, distill_alpha)
    cfg = TrainConfig(model=model, steps=steps, prompts_per_step=prompts_per_step, samples=samples,
                      max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                      ignore_eos=ignore_eos, lr=lr,
                      lora_rank=0 if full else lora_rank, lora_alpha=lora_alpha, correction=correction,
                      kl_coef=kl_coef, seed=seed, micro_batch=micro_batch, ppo_epochs=ppo_epochs,
                      max_grad_norm=max_grad_norm,
                      checkpoint_every=checkpoint_every, eval_every=eval_every, bin_width=bin_width,
                      sparsity=spec_of(policy, schedule), device=device, dtype=dtype,
                      random_weights=random_weights,
                      gradient_checkpointing=(device == "cuda" if gradient_checkpointing is None
                                              else gradient_checkpointing),
                      loss=loss, oversample=oversample, alpha_sequences=alpha_sequences,
                      distill_sparse=distill_sparse, distill_rank=distill_rank, distill_alpha=distill_alpha,
                      distill_lr_ratio=distill_lr_ratio, distill_kl_coef=distill_kl_coef,
                      raw_prompts=raw_prompts, speculate=speculate, reward=reward, reward_fn=reward_fn,
                      threads=torch.get_num_threads())
    try:
        cfg.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    notes += _speculative_correction(cfg)
    check_device(device)
    check_gpu_memory(gpu_memory_utilization)
    if max_num_seqs is not None and max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be at least 1, got {max_num_seqs}")
    if speculate and workers:
        raise UsageError("--speculate runs in this process's engine; drop --workers")
    check_workers(workers, ray_address, None)
    length = prompt_length(max_prompt_length, truncation, filter_overlong_prompts)
    data = data_options(answer_column, reward, reward_fn, reward_kwargs, length, prompt_column)
    from sparrow.stages.tasks.reward_function import reward_kwargs_text

    cfg = dataclasses.replace(cfg, reward_kwargs=reward_kwargs_text(data.reward_kwargs),
                              max_prompt_length=length.max_length, truncation=length.truncation.value,
                              filter_overlong_prompts=length.filter_overlong)
    code_rewards(ctx, unsafe_code_execution)
    prompt_set = PromptSet.read(prompts, data)
    rows = prompt_set.rows
    shapes = _model_shapes(cfg.model)
    if shapes is not None:
        _check_ranks(cfg, shapes.hidden_size)
        _check_step_memory(rows, cfg, shapes.vocab_size)
    check_budget_reach(budget, speculate, None if prompt_set.needs_tokenizer_for(model) else
                             [len(r["prompt_token_ids"]) for r in rows], max_new_tokens, notes.append)
    inputs = TrainInputs(prompts, output_dir, policy, eval_prompts, data)
    try:
        check_run_location(cfg, inputs, resume, force)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if resume:
        notes += resume_notes(output_dir, cfg)
    overlap = _check_prompt_sets(rows, prompts, eval_prompts, data, prompts_per_step)
    try:
        world = join_world(device, workers)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if world.main and overlap:
        warn(overlap)
    for line in notes if world.main else ():
        note(line)
    if world.main and random_weights:
        random_weights_of(model, "this run times its steps, but its rewards and adapter are not the model's")
    with launched(cfg, workers, ray_address) as pool:
        _run(cfg, inputs, RunOptions(resume=resume, force=force, world=world, pool=pool, report_to=trackers,
                                     gpu_memory_utilization=gpu_memory_utilization,
                                     max_num_seqs=max_num_seqs), fmt)


def _speculative_correction(cfg) -> list[str]:
    """A note under --speculate with a rollout correction on (tis, the default, among them): the samples
    are the dense policy's own, so the correction has nothing to correct (docs/speculative.md)."""
    extra = sorted(set(cfg.loss) - {"loss_agg", "bypass_mode"})
    if not cfg.speculate or (cfg.correction == "none" and not extra):
        return []
    named = f"--correction {cfg.correction}" + (" with its options" if extra else "")
    return [f"--speculate {cfg.speculate} rolls out the dense policy's exact samples (their ratio to the "
            f"learner's recompute is 1 to float precision), so the rollout correction ({named}) has "
            "nothing to correct; --correction none leaves it out"]


def _check_lora(ctx: typer.Context, full: bool, rank: int, alpha: float) -> None:
    """The LoRA's options, before the model loads: under --full there is no LoRA, so a --lora-rank or
    --lora-alpha given with it is refused rather than dropped; a LoRA needs rank >= 1 and alpha > 0 (its
    scale alpha / rank multiplies every update, so alpha 0 trains nothing and a negative one reverses it)."""
    if full:
        for name, value in (("lora_rank", rank), ("lora_alpha", alpha)):
            flag = f"--{name.replace('_', '-')}"
            if option_given(ctx, name):
                raise UsageError(f"{flag} {value:g} sets the LoRA, but --full trains every weight without "
                                 f"one; drop {flag} or --full")
        return
    _check_size("--lora", rank, alpha, "; for full fine-tuning pass --full")


DISTILL_OPTIONS = ("distill_rank", "distill_alpha", "distill_lr_ratio", "distill_kl_coef")


def _check_distill(ctx: typer.Context, distill_sparse: bool, rank: int, alpha: float) -> None:
    """The sparse actor's LoRA options act only under --distill-sparse: given without it they are refused
    rather than dropped; with it its LoRA needs rank >= 1 and alpha > 0, as the learner's does."""
    if not distill_sparse:
        given = [f"--{n.replace('_', '-')}" for n in DISTILL_OPTIONS if option_given(ctx, n)]
        if given:
            one = len(given) == 1
            raise UsageError(f"{', '.join(given)} set{'s' * one} the sparse actor's LoRA, which only "
                             "--distill-sparse trains; add --distill-sparse or drop "
                             f"{'it' if one else 'them'}")
        return
    _check_size("--distill", rank, alpha)


def _check_size(prefix: str, rank: int, alpha: float, hint: str = "") -> None:
    """A LoRA's rank >= 1 and alpha > 0 (PREFIX-rank, PREFIX-alpha)."""
    if rank < 1:
        raise UsageError(f"{prefix}-rank must be at least 1, got {rank}{hint}")
    if not alpha > 0:
        raise UsageError(f"{prefix}-alpha must be positive, got {alpha}")


def _check_ranks(cfg, width: int) -> None:
    """A LoRA rank (--lora-rank, --distill-rank) above the model's hidden size `width` is refused: above its
    layers' width an adapter is no longer low-rank, only larger and slower."""
    ranks = (("--lora-rank", cfg.lora_rank), ("--distill-rank", cfg.distill_sparse and cfg.distill_rank))
    for flag, rank in ranks:
        if rank and rank > width:
            raise UsageError(f"{flag} {rank} is more than {cfg.model}'s hidden size ({width}): above its "
                             "layers' width an adapter is no longer low-rank, only larger and slower")


def _model_shapes(model: str):
    """The model's config without its weights; None where it does not resolve (its own error comes when it
    loads)."""
    from sparrow.stages.model.config import ModelSpecError
    from sparrow.stages.model.loading import resolve_config

    try:
        return resolve_config(model)
    except ModelSpecError:
        return None


def _check_step_memory(rows: list[dict], cfg, vocab: int) -> None:
    """Refuse a step's samples (--prompts-per-step prompts x --samples, or --oversample) that this machine
    could not hold, by rollout's check (`check_sampling_memory`) before anything is written, counted at the
    least they take: over the shortest prompts, each as long as its token ids (text: not yet tokenized)."""
    lengths = sorted(len(r.get("prompt_token_ids") or ()) for r in rows)
    check_sampling_memory(lengths[:cfg.prompts_per_step], cfg.oversample or cfg.samples, cfg.max_new_tokens,
                          vocab, "train with fewer --samples (or --oversample) or --prompts-per-step")


def _check_prompt_sets(rows: list[dict], prompts: Path, eval_prompts: Path | None, data,
                       per_step: int) -> str | None:
    """Refuse more prompts per step than --prompts (`rows`) holds (a prompt would be several GRPO groups of
    one step, its samples' rows alike); returns the warning that --eval-prompts shares prompts with it, if
    so."""

    if per_step > len(rows):
        raise UsageError(f"--prompts-per-step {per_step} is more than the {len(rows)} prompts of {prompts}; "
                         f"a step would roll out a prompt more than once, so give at most {len(rows)}")
    if eval_prompts is None:
        return None
    held_out = read_eval_prompts(eval_prompts, data).rows
    seen = {_prompt_text(r) for r in rows}
    shared = sum(_prompt_text(r) in seen for r in held_out)
    if not shared:
        return None
    return (f"{shared} of the {len(held_out)} --eval-prompts ({eval_prompts}) are also in --prompts "
            f"({prompts}), by their text, so the eval accuracy is not held out")


def _prompt_text(row: dict) -> str:
    """What a prompt asks, as two prompt files are compared: its text, else its messages, else its ids."""
    import json

    text = (row.get("prompt") or "").strip()
    return text or json.dumps(row.get("messages") or list(row.get("prompt_token_ids") or []), default=str)


def _phase_of_step(phase: str, step: int, steps: int) -> str:
    """What a log's heartbeat says runs: a step's phase (rollout, scoring, update, eval) with the step it
    belongs to, the initial and final evals as they are."""
    if phase.startswith(("initial eval", "final eval")):
        return phase
    return f"{phase} of train step {step}/{steps}"


def _run(cfg, inputs, opts, fmt: str) -> None:
    """The run with a progress bar (a terminal) or one line per step (a log), then its summary."""
    from sparrow.stages.train.launch import start_training, summary_record

    world, steps = opts.world, cfg.steps
    # a terminal gets a live bar; a log gets one whole line per step (a bar there is cut to 80 columns)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                   disable=not world.main or not live_progress())
    task = bar.add_task("train steps", total=steps, info="")
    done: list[int] = []  # the steps finished in this process
    trainer_step = [0]  # the step the run starts from (a resume's checkpoint)
    warned: list[int] = []
    silent: list[int] = []
    heartbeat = Heartbeat()  # a log hears of every step's phases only when one runs long

    def on_phase(phase: str) -> None:
        if not world.main:
            return
        if phase == "loading":
            return say_loading(cfg.model, cfg.device)
        bar.update(task, description=f"train steps ({phase})")
        heartbeat.doing(_phase_of_step(phase, trainer_step[0] + len(done) + 1, steps))
        if phase == "initial eval":
            log_line("initial eval of the --eval-prompts ...")
        elif phase.startswith("initial eval "):  # each of its passes: greedy and sampled, dense and sparse
            log_line(f"  {phase} ...")
        elif phase == "final eval":
            log_line(f"final eval of the --eval-prompts (step {steps} was logged without one) ...")
        elif not done:  # a log hears of the first step's phases; each step's line follows it
            log_line(f"{phase} of train step {trainer_step[0] + 1}/{steps} ...")

    def on_step(r: dict) -> None:
        done.append(r["step"])
        ev = "" if r.get("eval_accuracy") is None else f" eval {r['eval_accuracy']:.2f}"
        info = (f"reward {r['reward_mean']:.3f} acc {r['accuracy']:.2f}{ev} | mismatch KL "
                f"{r['mismatch_kl']:.2e} alpha-lb p5 {r['alpha_lb_p5']:.2f} | {r['seconds']:.1f} s"
                + (f" | collapse: {r['collapse']}" if r.get("collapse") else ""))
        bar.update(task, completed=r["step"], info=info)
        if world.main:
            heartbeat.doing(None)
            log_line(f"train step {r['step']}/{steps}: {info}")
        on_signal(r)

    def on_signal(r: dict) -> None:  # the first step without learning signal says so at once
        if world.main and not silent and r.get("frac_reward_zero_std") == 1.0:
            silent.append(r["step"])
            warn(f"step {r['step']}: every group's samples got the same reward (frac_reward_zero_std 1), so "
                 "its advantages are zero and the update learns nothing from them; metrics.parquet logs the "
                 "share per step")

    def on_rollouts(step: int, lengths: list[int]) -> None:  # the first step's samples tell
        if world.main and not warned:
            warned.append(step)
            warn_first_token_stops(lengths, cfg.max_new_tokens, cfg.raw_prompts)

    def on_warning(message: str) -> None:
        if world.main:
            warn(message)

    opts.on_step, opts.on_phase, opts.on_rollouts = on_step, on_phase, on_rollouts
    opts.on_warning = on_warning
    try:  # a refused --resume says so before any bar is drawn
        trainer = start_training(cfg, inputs, opts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    trainer_step[0] = trainer.step
    with bar, heartbeat:
        bar.update(task, completed=trainer.step)
        summary = trainer.run()
    if world.main:
        run = inputs.output_dir
        console.print(f"metrics: {run / 'metrics.parquet'}; per-token mismatch: {run / 'mismatch'}/")
        for warning in summary.get("warnings", []):
            warn(warning)
        emit_record(summary_record(summary), fmt, title=f"sparrow train: {run}",
                    labels=TRAIN_LABELS)
