"""The one reading of a sparsity spec into a `KVPolicy` (stages/kv_policies), which the engine and
teacher-forced scoring ask.

A spec is text ("dense", "budget:B", "schedule:PATH", "snapkv:B", "rkv:B": the form artifacts and run
configs store, `spec_of`), the flags --dense / --budget / --schedule, or a value (None, an int budget,
a `Schedule`, a budget function). The CLI parses it once, at its boundary, into a policy; `as_policy`
also serves benches and tests that pass plain values. Budgets are validated for the page size and a
schedule planned for another model shape is refused, so a wrong spec is one sentence before any work.
"""

from __future__ import annotations

import numbers
from pathlib import Path

from sparrow.schemas import input_path

from ..kv_policies import EVICTION_POLICIES, BlockTopK, BudgetFn, Dense, Eviction, KVPolicy, parse_eviction
from ..model.config import SHAPE_KEYS, ModelConfig, shape_of
from .definitions import PAGE_SIZE, validate_budget
from .schedule import Schedule

Sparsity = KVPolicy | BudgetFn | Schedule | int | str | None  # None / 0 / "dense": dense


def load_schedule(path: str | Path, page_size: int = PAGE_SIZE, model: ModelConfig | None = None) -> Schedule:
    """A schedule artifact, checked against the engine's page size (and `model`'s shape, when the schedule
    records the shape it was planned for), its budgets validated."""
    import json

    from sparrow.schemas import artifact_metadata


    schedule = Schedule.from_artifact(path)
    planned = artifact_metadata(path).get("model_config")
    if model is not None and planned:
        theirs, ours = shape_of(ModelConfig.from_dict(json.loads(planned))), shape_of(model)
        diff = [k for k in SHAPE_KEYS if theirs[k] != ours[k]]
        if diff:
            shown = ", ".join(f"{k} {theirs[k]} vs {ours[k]}" for k in diff[:3])
            name = artifact_metadata(path).get("model", "another model")
            raise ValueError(f"{path}: the schedule was planned for {name}, whose shape differs from this "
                             f"model's ({shown}); plan one for this model with `sparrow plan-schedule`")
    if schedule.page_size != page_size:
        raise ValueError(f"{path}: the schedule was planned for pages of {schedule.page_size} tokens, but "
                         f"the engine uses pages of {page_size}")
    for b in schedule.budgets:
        if b:
            try:
                validate_budget(b, page_size)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
    return schedule


def parse_sparsity(spec: str, page_size: int = PAGE_SIZE, model: ModelConfig | None = None
                   ) -> Schedule | int | Eviction | None:
    """'dense' | 'budget:B' | 'schedule:PATH' | 'snapkv:B[,window=W][,buffer=N][,sink=S]' | 'rkv:B[,...]'
    -> None | B | the loaded schedule | the eviction policy (checked against `model`'s context)."""
    if spec == "dense":
        return None
    kind, _, value = spec.partition(":")
    if kind in EVICTION_POLICIES:
        policy = parse_eviction(spec)
        return policy.validate(model.max_position_embeddings) if model is not None else policy
    if kind == "budget":
        try:
            budget = int(value)
        except ValueError:
            raise ValueError(f"sparsity {spec!r}: the budget must be an integer number of tokens") from None
        if budget == 0:
            raise ValueError(f"sparsity {spec!r} is dense attention, not a block top-k budget; say 'dense'")
        validate_budget(budget, page_size)
        return budget
    if kind == "schedule":
        if not value.strip():
            raise ValueError(f"sparsity {spec!r} is an empty path; give a schedule file, as in "
                             "schedule:run/schedule.parquet")
        return load_schedule(value, page_size, model)
    raise ValueError(f"unknown sparsity {spec!r}: expected dense, budget:B, schedule:FILE, snapkv:B or rkv:B")


def sparsity_from_flags(schedule: Path | None, budget: int | None, dense: bool,
                        page_size: int = PAGE_SIZE, model: ModelConfig | None = None
                        ) -> Schedule | int | None:
    """The one of --schedule / --budget / --dense a user gave (none: dense), validated."""
    given = [f for f, v in (("--schedule", schedule), ("--budget", budget), ("--dense", dense)) if v]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} were given together; pick one of --schedule, --budget and "
                         "--dense")
    if budget is not None:
        try:
            validate_budget(budget, page_size)
        except ValueError as e:
            raise ValueError(f"--budget: {e}") from None
        return budget
    if schedule is not None:
        if not Path(schedule).exists():
            raise ValueError(f"{schedule}: no such schedule file")
        return load_schedule(schedule, page_size, model)
    return None


def spec_of(sparsity: Schedule | int | KVPolicy | None, schedule_path: Path | None = None) -> str:
    """The text form of a sparsity value or policy, as artifacts and run configs store it (a schedule
    needs the path it was read from)."""
    if sparsity is None or isinstance(sparsity, Dense):
        return "dense"
    if isinstance(sparsity, KVPolicy) and schedule_path is None:
        return sparsity.spec()
    if isinstance(sparsity, int):
        return f"budget:{sparsity}"
    return f"schedule:{input_path(schedule_path)}"


def as_policy(sparsity: Sparsity, page_size: int = PAGE_SIZE) -> KVPolicy:
    """Any sparsity spec or value -> its `KVPolicy`, budgets validated for the page size. A number that
    is not a whole budget (64.5, True, 0: dense is None or 'dense') is refused rather than truncated."""
    if isinstance(sparsity, KVPolicy):
        return sparsity
    if sparsity is None:
        return Dense()
    if isinstance(sparsity, str):
        return as_policy(parse_sparsity(sparsity, page_size), page_size)
    if isinstance(sparsity, Schedule):
        if sparsity.page_size != page_size:
            raise ValueError(f"the schedule is for pages of {sparsity.page_size} tokens, "
                             f"the engine uses {page_size}")
        for b in sparsity.budgets:
            if b:
                validate_budget(b, page_size)
        return BlockTopK(sparsity.budget_at, "schedule", sparsity)
    if callable(sparsity):
        return BlockTopK(sparsity)
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Integral):
        raise TypeError(f"sparsity {sparsity!r} is not a whole number of tokens; give an int budget, a "
                        "spec ('dense', 'budget:B', 'schedule:PATH', 'snapkv:B', 'rkv:B'), a Schedule, a "
                        "KVPolicy, a budget function or None (dense)")
    budget = int(sparsity)
    if budget == 0:
        raise ValueError("budget 0 is dense attention, not a block top-k budget; dense is None or 'dense'")
    validate_budget(budget, page_size)
    return BlockTopK(lambda _: budget, f"budget:{budget}")


def budget_fn(sparsity: Sparsity, page_size: int = PAGE_SIZE) -> BudgetFn | None:
    """Any block top-k (or dense) sparsity spec or value -> the budget function (None = dense)."""
    policy = as_policy(sparsity, page_size)
    if policy.evicts:
        raise ValueError(f"{policy.spec()} evicts KV tokens; it has no block top-k budget function")
    return policy.budget_at if isinstance(policy, BlockTopK) else None
