"""`sparrow train`'s step loop: rollouts, rewards, the learner's scores and the rollout correction
(experience.py), the update (update.py), the sparse actor's step, metrics, evaluation and checkpoints
(docs/training.md)."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from sparrow.schemas import ArtifactError
from sparrow.schemas.io import write_bytes

from ..backends.ray_pool import RolloutPool
from ..core.schedule import Schedule
from ..core.sparsity import budget_fn
from ..engine import SamplingParams
from ..kv_policies import Dense, KVPolicy
from ..model.adapter import adapter_base, add_lora, load_lora_state, lora_state, save_adapter
from ..model.export import export_model
from ..model.loading import LoadedModel
from ..tasks import judge_batch, score_batch, with_completion_ids
from ..tasks.base import RewardError
from ..tasks.reward_function import logged_metrics
from . import objective as grpo
from .checkpoint import drop_mismatch_after, load_checkpoint, rng_states, save_checkpoint, set_rng_states
from .config import TrainConfig, kv_policy
from .data import PromptRow, epoch_order
from .detectors import InitialEval
from .distributed import World, current_world, data_parallel
from .exact_alpha import exact_alpha
from .experience import TOP_LOGPROBS, Experience, rejection_generator, score, select_oversampled
from .metrics import (
    collapse,
    global_step,
    label,
    metrics_row,
    reward_extra_means,
    write_completions,
    write_metrics,
    write_mismatch,
    write_schedule,
)
from .rollouts import Rollouts
from .run_dir import (
    MODEL_DIR,
    Deferral,
    TrainingInterrupted,
    check_run_dir,
    checkpoint_step,
    clear_run,
    interrupts_deferred,
    lock_run,
    planned_schedule,
    record_summary,
    release_run,
    run_outputs,
    unwritten,
    with_fingerprints,
)
from .sparse_actor import JointSparseActor
from .tracking import Trackers, initial_eval_row, tracked_history
from .update import Learner

# the per-step numbers the summary averages over the run's steps (mean_<name>)
SUMMARY_MEANS = ("mismatch_kl", "alpha_p5", "alpha_lb_p5", "masked_fraction", "vetoed_fraction",
                 "rollout_seconds", "scoring_seconds", "update_seconds", "weight_sync_seconds")


@dataclass
class RunOptions:
    """How a run is launched and watched, beside what defines it (`TrainConfig`)."""

    resume: bool = False
    force: bool = False  # start the run in the directory over
    world: World | None = None  # None: this process's (torchrun's, or the single process)
    pool: RolloutPool | None = None  # Ray rollout workers
    gpu_memory_utilization: float = 0.9  # on CUDA, the rollout engine's share of device memory
    max_num_seqs: int | None = None  # samples one engine decodes together (None: all of a step's at once)
    report_to: Sequence[str] = ()  # live trackers of each step's row (tracking.py)
    on_step: Callable[[dict], None] | None = None  # each step's metrics row
    on_phase: Callable[[str], None] | None = None  # "loading" | "initial eval" | "rollout" | "scoring" |
    # "update" | "eval" | "final eval", and "initial eval I/N: <pass>" per pass of the initial eval
    on_rollouts: Callable[[int, list[int]], None] | None = None  # each step's completion lengths
    on_warning: Callable[[str], None] | None = None  # once per cause: what the run cannot use


class Trainer:
    def __init__(self, config: TrainConfig, loaded: LoadedModel, prompts: list[PromptRow],
                 run_dir: str | Path, eval_prompts: list[PromptRow] | None = None,
                 options: RunOptions | None = None, policy: KVPolicy | None = None):
        """`policy`: the rollouts' KV policy, the one `config.sparsity` names (None: read from it)."""
        opts = options or RunOptions()
        config.validate()
        world = opts.world or current_world()
        _check_launch(config, world, opts.pool)
        self.policy = policy or kv_policy(config.sparsity, loaded.config)
        config = with_fingerprints(config, prompts, eval_prompts, self.policy)
        self.cfg, self.loaded, self.model, self.world = config, loaded, loaded.model, world
        self.prompts, self.eval_prompts = prompts, eval_prompts or []
        self.run_dir, self.opts = Path(run_dir), opts
        self.on_step = opts.on_step or (lambda row: None)
        self.on_phase = opts.on_phase or (lambda phase: None)
        self.on_warning = opts.on_warning or (lambda message: None)
        self.on_rollouts = opts.on_rollouts or (lambda step, lengths: None)
        self.loss_cfg = grpo.LossConfig(correction=config.correction, kl_coef=config.kl_coef, **config.loss)
        self.history: list[dict] = []
        self.step = 0
        self.trackers: Trackers | None = None  # rank 0's, while the run runs
        # the initial eval's tracker row, held until the first step's: a run stopped before then logs nothing
        self.step0: dict | None = None
        self.initial_eval: InitialEval | None = None
        check_run_dir(self.run_dir, config, opts.resume, opts.force)
        if world.main:  # held until the run ends (run_dir.py)
            lock_run(self.run_dir)
        try:
            self._prepare(config, loaded, opts, world)
        except BaseException:
            release_run(self.run_dir)
            raise

    def _prepare(self, config: TrainConfig, loaded: LoadedModel, opts: RunOptions, world: World) -> None:
        """The learner, its optimizer, the sparse actor and the rollouts; a resume's checkpoint restored."""
        self.start_over = opts.force
        self.applying = False  # inside a step's update and writes: an interrupt there leaves no checkpoint
        self.schedule_written = False  # by this process, before the run's first step
        torch.manual_seed(config.seed)
        self.reference = None
        self.lora_config = None
        if config.lora_rank:
            self.lora_config = add_lora(self.model, config.lora_rank, config.lora_alpha)
        elif config.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).requires_grad_(False)
        self.model.gradient_checkpointing = config.gradient_checkpointing
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
        self.sparse_actor = None
        self.sparse_history: list[dict] = []
        if config.distill_sparse:
            self.sparse_actor = JointSparseActor(self.model, config, budget_fn(self.policy))
        if opts.resume:
            self._restore(load_checkpoint(self.run_dir))
        self.learner = Learner(self.model, data_parallel(self.model, world), self.optimizer, self.loss_cfg,
                               config, world)
        self.rollouts = Rollouts(self.model, self.policy, world, opts.pool,
                                 opts.gpu_memory_utilization, config.speculate, opts.max_num_seqs)
        if opts.pool is not None and self.lora_config is not None:
            opts.pool.add_lora(config.lora_rank, config.lora_alpha)
        self.rng_at_step = rng_states()  # the RNG states at the last step boundary
        world.barrier()  # no rank writes before every rank has checked the run directory

    # ------------------------------------------------------------------ the run

    def run(self) -> dict:
        """Train until `steps`, then write the run's outputs (adapter or model) and, last, its summary
        (also in the metrics artifact's metadata), which it returns. On an interrupt, a checkpoint at the
        last complete step (run_dir.py), then TrainingInterrupted; a run interrupted after its last step
        is finished by a resume with the same --steps."""
        try:
            self._start()
            self._missing_eval()  # a resume of a run stopped during its last step's eval
            while self.step < self.cfg.steps:
                self.train_step()
                if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                    self._save_checkpoint()
            self._missing_eval()
            summary = self._finish()
        except KeyboardInterrupt:
            self._interrupted()
        except RewardError as e:
            self._reward_failed(e)
        except Exception:
            self._discard_unstarted()
            raise
        finally:
            if self.trackers is not None:
                self.trackers.close()
                self.trackers = None
            self.rollouts.close()
            release_run(self.run_dir)
        self.world.barrier()
        return summary

    def _start(self) -> None:
        """A forced run's directory cleared, the trackers (a resume's given the steps they lack, step 0
        included), and before the first step the schedule and the initial eval, logged as step 0 with the
        first step."""
        if self.start_over and self.world.main:
            clear_run(self.run_dir)
            self.start_over = False
        if self.world.main and self.opts.report_to:
            self.trackers = Trackers(self.opts.report_to, self.run_dir, self.step, asdict(self.cfg),
                                     tracked_history(self.history, self.initial_eval), warn=self.on_warning)
        if self.step == 0 and self.world.main:
            self._write_schedule()
            if self.eval_prompts:
                self.on_phase("initial eval")
                self.initial_eval = self.evaluate_start()
                self.step0 = initial_eval_row(self.initial_eval)  # logged with the first step's row

    def _interrupted(self):
        """Keep the last complete step resumable, say so, and go on interrupting."""
        if self.applying:  # a second SIGINT (or an interrupt raised by code) inside the update
            at = checkpoint_step(self.run_dir)
            raise TrainingInterrupted(
                f"a step was being applied, so {self.run_dir} keeps " + (
                    f"its checkpoint at step {at}; {self._again('--resume', 'continue from it')}"
                    if at is not None else f"no checkpoint; {self._again('--force', 'start it over')}"))
        if self.start_over or checkpoint_step(self.run_dir) != self.step:  # else it holds this very step
            self._save_checkpoint(self.rng_at_step)
        steps = self.cfg.steps
        if self.step == steps:
            raise TrainingInterrupted(f"{self.run_dir}/checkpoint holds the run's {steps} step"
                                      f"{'s' * (steps != 1)}, but {unwritten(self.cfg)} are not written "
                                      f"yet; {self._again('--resume', 'write them')}") from None
        raise TrainingInterrupted(f"{self.run_dir}/checkpoint holds the {self.step} complete "
                                  f"step{'s' * (self.step != 1)} of {steps}; "
                                  f"{self._again('--resume', 'continue')}") from None

    def _reward_failed(self, error: RewardError) -> None:
        """A reward that raised (a user's function, say) keeps the complete steps resumable, as an
        interrupt does, so that the reward fixed, --resume goes on from them (run_dir: a reward file edited
        in place is noted on resume, not refused)."""
        if self.applying or self.step == 0:
            self._discard_unstarted()
            raise error
        if self.start_over or checkpoint_step(self.run_dir) != self.step:
            self._save_checkpoint(self.rng_at_step)
        steps = f"{self.step} complete step{'s' * (self.step != 1)} of {self.cfg.steps}"
        raise RewardError(f"{error}; {self.run_dir}/checkpoint holds the {steps}, so once the reward is "
                          f"fixed, {self._again('--resume', 'continue')}") from None

    def _discard_unstarted(self) -> None:
        """A run that an error (a reward function that raised, say) stops before anything resumable was
        written leaves no schedule.parquet of its own behind: the folder holds what it held before."""
        if self.schedule_written and checkpoint_step(self.run_dir) is None and \
                not (self.run_dir / "metrics.parquet").exists():
            (self.run_dir / "schedule.parquet").unlink(missing_ok=True)

    def _again(self, flag: str, what: str) -> str:
        """How the same command goes on with `flag` (--resume or --force) to do `what`: run again when it
        has the flag, the other flag replaced when it has that one (the two are refused together), else
        the flag added."""
        given = {"--resume": self.opts.resume, "--force": self.opts.force}
        other = "--force" if flag == "--resume" else "--resume"
        if given[flag]:
            return f"run the same command again to {what}"
        if given[other]:
            return f"replace {other} with {flag} in the same command to {what}"
        return f"add {flag} to the same command to {what}"

    def train_step(self) -> dict:
        """One step; from its update to its tracker lines and `on_step` an interrupt waits (a step the
        metrics hold is a step the trackers and the log hold), except during the step's eval, which it
        stops at once: the step is then logged without its eval numbers, and the run stops after it."""
        exp = self.experience(self.step)
        with interrupts_deferred() as deferral:  # the weights change from here to the end of its writes
            self.applying = True
            row = self._apply(exp, deferral)
            self.applying = False
            if self.trackers is not None:
                for logged in ([self.step0] if self.step0 else []) + [row]:
                    self.trackers.log(logged)
            self.step0 = None
            self.on_step(row)
        return row

    # ------------------------------------------------------------------ one step

    def experience(self, step: int) -> Experience:
        """A step's prompts, rollouts (flat, prompt-major), rewards, advantages, the learner's scores and
        the rollout correction."""
        cfg = self.cfg
        order = epoch_order(len(self.prompts), cfg.seed, step, cfg.prompts_per_step)
        prompts = [self.prompts[i] for i in order]
        t0 = time.perf_counter()
        self.on_phase("rollout")
        with self.sparse_actor.acting() if self.sparse_actor is not None else nullcontext():
            # DistillSparse: the sparse actor (the learner plus its own adapter) samples
            groups = self.rollouts.sample([r.token_ids for r in prompts], self._sampling(step),
                                          cfg.prompts_per_step, self.lora_config is not None)
        completions = [c for group in groups for c in group]
        t_roll = time.perf_counter() - t0
        self.on_rollouts(step, [len(c.token_ids) for c in completions])
        t_reward = time.perf_counter()  # code tasks run each sample's program in a pool of sandboxes
        rewards, reward_extra = self._rewards(prompts, groups)
        t_reward = time.perf_counter() - t_reward
        t1 = time.perf_counter()
        self.on_phase("scoring")
        scores = score(self.model, completions, cfg, self.world, self.reference)
        if self.policy.sparse and cfg.alpha_sequences and self.world.main:
            actor = None if self.sparse_actor is None else self.sparse_actor.weights()
            scores.alpha = exact_alpha(self.model, completions, self.policy, cfg.alpha_sequences, cfg.seed,
                                       step, cfg.temperature, scores.mask.shape[1], actor)
        t_score = time.perf_counter() - t1
        selection = None
        if cfg.oversample:
            completions, rewards, scores, selection = select_oversampled(completions, rewards, scores,
                                                                         cfg.samples)
        rewards_t = torch.tensor(rewards, dtype=torch.float32)
        advantages = grpo.group_advantages(rewards_t, self.loss_cfg).flatten()
        correction = grpo.rollout_correction(scores.log_ratio, scores.mask, self.loss_cfg,
                                             advantages=advantages, alpha=scores.acceptance(),
                                             generator=rejection_generator(cfg.seed, step))
        return Experience(step, prompts, completions, rewards, advantages, scores, correction, t_roll,
                          t_score, t_reward, selection, reward_extra)

    def _sampling(self, step: int) -> SamplingParams:
        cfg = self.cfg
        return SamplingParams(max_new_tokens=cfg.max_new_tokens, n=cfg.oversample or cfg.samples,
                              temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              seed=cfg.seed * 1_000_003 + step, logprobs=TOP_LOGPROBS,
                              ignore_eos=cfg.ignore_eos)

    def _rewards(self, prompts: list[PromptRow], groups) -> tuple[np.ndarray, dict[str, float] | None]:
        """[P, samples] from each task's scorer, and the step's means of what a user's reward function
        reported beside its scores (`reward_extra_means`)."""
        tok = self.loaded.tokenizer
        judged = judge_batch([(r.task, tok.decode(c.token_ids, skip_special_tokens=True), r.answer,
                               with_completion_ids(r.metadata, c.token_ids))
                              for r, group in zip(prompts, groups) for c in group])
        rewards = np.array([j.reward for j in judged]).reshape(len(prompts), -1)
        return rewards, reward_extra_means([j.extra for j in judged], logged_metrics())

    def _apply(self, exp: Experience, deferral: Deferral) -> dict:
        """The update, the sparse actor's step, the metrics row, the eval (which an interrupt stops:
        `deferral`) and the step's logs."""
        cfg = self.cfg
        t0 = time.perf_counter()
        self.on_phase("update")
        update = self.learner.update(exp)
        if self.sparse_actor is not None:  # the learner frozen, the sparse adapter's step
            self.sparse_history.append({"step": global_step(exp),
                                        **self.sparse_actor.update(exp, self.loss_cfg)})
        self.rollouts.updated()
        t_update = time.perf_counter() - t0

        self.step = global_step(exp)
        row = metrics_row(self.run_dir.name, exp, update, t_update, cfg, self.loss_cfg,
                          self.rollouts.sync_seconds)
        last = self.step == cfg.steps  # the final eval is never left blank (else `_missing_eval` runs it)
        if self.eval_prompts and self.world.main and (self.step % cfg.eval_every == 0 or last):
            try:
                with deferral.allowed():
                    row.update(self._step_eval())
            except KeyboardInterrupt:
                pass  # the step is logged without its eval; the deferral's end interrupts
        self.history.append(row)
        row["collapse"] = collapse(self.history, self.initial_eval)
        if self.world.main:
            write_mismatch(self.run_dir, exp, cfg)
            write_completions(self.run_dir, exp, cfg, self.loaded.tokenizer)
            write_metrics(self.run_dir, self.history, cfg, self.initial_eval)
        self.rng_at_step = rng_states()
        return row

    def _step_eval(self) -> dict[str, float]:
        """A step's eval numbers: greedy dense accuracy and, in a sparse run, under the run's sampler too."""
        self.on_phase("eval")
        out = {"eval_accuracy": self.evaluate()}
        if self.policy.sparse:
            out["eval_accuracy_sparse"] = self.evaluate(sparse=True)
            out["sampler_gap"] = out["eval_accuracy"] - out["eval_accuracy_sparse"]
        return out

    def _missing_eval(self) -> None:
        """The eval of the last logged step when it was due (every --eval-every steps, and the last) and its
        row has none: a run interrupted during that eval, resumed, or a resume whose --steps ends at the
        steps done. The checkpoint holds that step's weights, so the numbers are an uninterrupted run's;
        they go into the metrics, the checkpoint and the trackers (the step's row again, with its eval)."""
        h = self.history
        if not (self.eval_prompts and self.world.main and h) or h[-1].get("eval_accuracy") is not None:
            return
        if self.step % self.cfg.eval_every and self.step != self.cfg.steps:
            return
        self.on_phase("eval" if self.step < self.cfg.steps else "final eval")
        h[-1].update(self._step_eval())
        h[-1]["collapse"] = collapse(h, self.initial_eval)
        with interrupts_deferred():
            write_metrics(self.run_dir, h, self.cfg, self.initial_eval)
            self._save_checkpoint(self.rng_at_step)
            if self.trackers is not None:
                self.trackers.log(h[-1])

    def evaluate(self, sparse: bool = False, sampled: bool = False) -> float:
        """Accuracy of greedy completions of the eval prompts (reward 1 counts as correct), dense or, with
        `sparse`, under the run's sparsity (the released recipe validates under both); with `sampled`, the
        mean reward of the run's samples per prompt at its temperature instead (one seed, no training
        step's, for both samplers, so their gap is not the seeds')."""
        cfg = self.cfg
        params = (SamplingParams(max_new_tokens=cfg.max_new_tokens, n=cfg.samples,
                                 temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                 seed=cfg.seed * 1_000_003 + 1_000_002, ignore_eos=cfg.ignore_eos) if sampled
                  else SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0))
        self.model.eval()
        rows = self.eval_prompts
        engine = self.rollouts.run_engine(cfg.prompts_per_step, cfg.oversample or cfg.samples)
        out = engine.generate([r.token_ids for r in rows], params,
                              policy=self.policy if sparse else Dense())
        tok = self.loaded.tokenizer
        rewards = score_batch([(r.task, tok.decode(c.token_ids, skip_special_tokens=True), r.answer,
                                with_completion_ids(r.metadata, c.token_ids))
                               for r, group in zip(rows, out) for c in group[:params.n]])
        logged_metrics()  # what the reward logged on the eval prompts is not the next step's
        return float(np.mean(rewards) if sampled else np.mean([x >= 1.0 - 1e-9 for x in rewards]))

    def evaluate_start(self) -> InitialEval:
        """Step 0: the dense and the run's sampler, greedy and sampled (InitialEval); each pass named to
        `on_phase` as it starts."""
        passes = [(sparse, sampled) for sampled in (False, True) for sparse in (False, True)
                  if self.policy.sparse or not sparse]  # InitialEval's order
        out: dict[tuple[bool, bool], float] = {}
        for i, (sparse, sampled) in enumerate(passes, 1):
            name = f"{'sampled' if sampled else 'greedy'}, {'sparse' if sparse else 'dense'}"
            self.on_phase(f"initial eval {i}/{len(passes)}: {name}")
            out[sparse, sampled] = self.evaluate(sparse=sparse, sampled=sampled)
        return InitialEval(out[False, False], out.get((True, False)), out[False, True], out.get((True, True)))

    # ------------------------------------------------------------------ what the run leaves

    def _write_schedule(self) -> None:
        """The block top-k schedule the rollouts used (an eviction policy has none; the config names it)."""
        if self.policy.evicts:
            return
        schedule = planned_schedule(self.policy) or Schedule.constant(self.policy.read_budget(0))
        write_schedule(self.run_dir, schedule, self.cfg.sparsity)
        self.schedule_written = True

    def summary(self) -> dict:
        """The run's numbers and where its outputs go (`adapter`: the LoRA, `model`: a --full run's
        Hugging Face checkpoint, `sparse_adapter`: DistillSparse's; None: not this run's kind)."""
        h = self.history
        outputs = run_outputs(self.cfg)
        out = {"steps": len(h), **label(h),
               "reward_first": h[0]["reward_mean"] if h else None,
               "reward_last": h[-1]["reward_mean"] if h else None,
               "initial_eval_accuracy": self.initial_eval.accuracy if self.initial_eval else None,
               "initial_sampler_gap": self.initial_eval.sampler_gap if self.initial_eval else None,
               "final_eval_accuracy": next((r["eval_accuracy"] for r in reversed(h)
                                           if r.get("eval_accuracy") is not None), None),
               "final_eval_accuracy_sparse": next((r["eval_accuracy_sparse"] for r in reversed(h)
                                                  if r.get("eval_accuracy_sparse") is not None), None),
               "skipped_updates": sum(r.get("update_skipped") is not None for r in h),
               "seconds": sum(r["seconds"] for r in h), **step_means(h),
               **{name: str(self.run_dir / name) if name in outputs else None
                  for name in ("adapter", MODEL_DIR)}}
        if "sparse_adapter" in outputs:
            out["sparse_adapter"] = str(self.run_dir / "sparse_adapter")
        return out

    def _finish(self) -> dict:
        """The outputs written (rank 0), then the summary recorded in the metrics metadata: written last,
        it is what marks the run finished (a resume of all its steps writes what is missing)."""
        summary = self.summary()
        if self.world.main:
            try:
                self._write_outputs()
            except ArtifactError as e:
                hint = (f"{self.run_dir}/checkpoint holds the last step ({self.step}), so once it can be "
                        "written, --resume with the same --steps writes it")
                raise ArtifactError(f"{e}; {hint}") from None
            record_summary(self.run_dir, summary)
        return summary

    def _write_outputs(self) -> None:
        """RUN/adapter/ (a LoRA, peft format) or RUN/model/ (--full: a Hugging Face checkpoint), and
        RUN/sparse_adapter/ with DistillSparse; each replaced whole."""
        cfg = self.cfg
        base = adapter_base(cfg.model, cfg.random_weights)  # what AutoPeftModelForCausalLM loads
        if self.lora_config is not None:
            save_adapter(self.model, self.lora_config, self.run_dir / "adapter", base)
        else:
            export_model(self.model, self.loaded.tokenizer, self.run_dir / MODEL_DIR,
                         {"written_by": "sparrow train --full", "base_model": cfg.model, "steps": self.step,
                          "sparsity": cfg.sparsity})
        if self.sparse_actor is not None:
            folder = save_adapter(self.model, self.sparse_actor.config, self.run_dir / "sparse_adapter",
                                  base, adapter=self.sparse_actor.ADAPTER)
            write_bytes(folder / "sparrow_distill.json", json.dumps(
                {"mode": "joint (sparrow train --distill-sparse)", "sparsity": cfg.sparsity,
                 "history": self.sparse_history}, indent=2).encode())

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, rng: tuple | None = None) -> None:
        """RUN/checkpoint/ at this step, with now's RNG states or `rng` (rank 0's: the ranks hold the same
        weights and optimizer state)."""
        if not self.world.main:
            return
        weights = (lora_state(self.model) if self.lora_config is not None
                   else {k: v.detach().clone() for k, v in self.model.state_dict().items()})
        sparse = None if self.sparse_actor is None else {
            "weights": lora_state(self.model, self.sparse_actor.ADAPTER),
            "optimizer": self.sparse_actor.optimizer.state_dict(), "history": self.sparse_history}
        state = {"step": self.step, "weights": weights, "optimizer": self.optimizer.state_dict(),
                 "history": self.history, "initial_eval": self.initial_eval, "sparse": sparse}
        save_checkpoint(self.run_dir, state, self.cfg, rng or rng_states())

    def _restore(self, state: dict) -> None:
        if self.lora_config is not None:
            load_lora_state(self.model, state["weights"])
        else:
            self.model.load_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.sparse_actor is not None:
            sparse = state["sparse"]
            load_lora_state(self.model, sparse["weights"], self.sparse_actor.ADAPTER)
            self.sparse_actor.optimizer.load_state_dict(sparse["optimizer"])
            self.sparse_history = sparse["history"]
        set_rng_states(state)
        self.step, self.history = state["step"], state["history"]
        initial = state["initial_eval"]  # an InitialEval, or the dense accuracy alone (a float)
        self.initial_eval = InitialEval(initial) if isinstance(initial, float) else initial
        if self.world.main:
            drop_mismatch_after(self.run_dir, self.step)
            write_metrics(self.run_dir, self.history, self.cfg, self.initial_eval)


def step_means(history: list[dict]) -> dict[str, float | None]:
    """mean_<name> over the steps that logged <name>, for each of SUMMARY_MEANS (None: none did)."""
    out = {}
    for key in SUMMARY_MEANS:
        values = [r[key] for r in history if r.get(key) is not None]
        out[f"mean_{key}"] = sum(values) / len(values) if values else None
    return out


def _check_launch(cfg: TrainConfig, world: World, pool: RolloutPool | None) -> None:
    if pool is not None and world.distributed:
        raise ValueError("Ray rollout workers and torchrun ranks cannot be combined; use one of them")
    if cfg.distill_sparse and (pool is not None or world.distributed):
        raise ValueError("--distill-sparse runs in one process for now: it cannot be combined with Ray "
                         "rollout workers or torchrun ranks")
    if cfg.prompts_per_step * cfg.samples < world.size:
        raise ValueError(f"--prompts-per-step x --samples ({cfg.prompts_per_step * cfg.samples} sequences) "
                         f"must be at least the world size ({world.size}), so that every rank has a share of "
                         "the update")


__all__ = ["SUMMARY_MEANS", "RunOptions", "Trainer"]

