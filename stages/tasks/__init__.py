"""Tasks with verifiable rewards: a registry, prompt building and scoring.

`make_prompts` turns a task's examples into rows of the `prompts` artifact. Every prompt is
formatted with the model's own chat template (an optional system message first) and stored both
as text and as token ids, so later stages never re-tokenise and never disagree about the prompt.
A tokenizer without a chat template gets the plain text (system message, blank line, user
message). Prompt ids are `<task>-<seed>-<index>`: stable for a seed, distinct across seeds; a task
with splits adds the split's name (`humaneval-test-<seed>-<index>`) unless it is `all`.

`score_batch` scores many completions at once (`judge_batch` also says why each got its reward):
tasks whose scorer runs the completion's program (`Task.runs_code`) are scored by a pool of threads,
each waiting on its own sandboxed process, so a step's rewards take about the longest program's time
rather than the sum; every completion is scored on its own, so the rewards do not depend on the pool's
size.

Rewards for users' datasets (`rewards.py`: math-verify, code tests from the dataset; `reward_function.py`:
a user's function) are looked up beside the tasks (`get_task`), never listed as tasks to generate; a
reward with `judge_many` scores a batch's items of it in one call, as the trainers call such functions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sparrow.schemas.footer import file_json

from . import code, humaneval, learnable, longcontext, reasoning, rewards
from .base import COMPLETION_IDS, Example, Judgement, RewardError, Task, TaskError

__all__ = ["TASKS", "Example", "Judgement", "RewardError", "Task", "TaskError", "chat_format", "get_task",
           "has_scorer", "judge", "judge_batch", "make_prompts", "score", "score_batch"]

TASKS: dict[str, Task] = {t.name: t for t in [*reasoning.tasks(), *longcontext.tasks(), *learnable.tasks(),
                                                *code.tasks(), *humaneval.tasks()]}


def get_task(name: str) -> Task:
    """The task, or the users' dataset reward (`rewards.REWARDS`), of that name."""
    task = TASKS.get(name) or rewards.REWARDS.get(name)
    if task is None:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return task


def has_scorer(name: str | None) -> bool:
    return name in TASKS or name in rewards.REWARDS


def no_scorer(task: str | None) -> str:
    """Why a prompt of `task` cannot be scored, after its name ("prompt 'p0' ..."): a verl or TRL
    dataset's row (whose task is its format until a reward is named), or an unknown task."""
    if task in ("verl", "trl"):
        return (f"is a row of a {'verl' if task == 'verl' else 'TRL'} dataset, which names no reward of its "
                "own; score it with --reward math|code or --reward-fn path.py:function")
    return f"has task {task!r}, which has no scorer (known: {', '.join(TASKS)})"


def chat_messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    """One user message (after a system one, if any) as chat messages."""
    return [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": user}]


def chat_format(tokenizer, user: str, system: str | None = None) -> tuple[str, list[int]]:
    """The prompt text a model sees for one user message, and its token ids: rendered by the chat
    template (which writes its own special tokens), or for a model without one the plain text with the
    tokenizer's special tokens (a BOS where it adds one), as vLLM and TRL tokenize a text prompt."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(chat_messages(user, system), add_generation_prompt=True,
                                             tokenize=False)
        return text, list(tokenizer(text, add_special_tokens=False).input_ids)
    text = f"{system}\n\n{user}" if system else user
    return text, list(tokenizer(text, add_special_tokens=True).input_ids)


VARIANT_TAGS = {"level": "L", "tests": "T"}  # options that change a seed's prompts: named in their ids


def make_prompts(task: str | Task, n: int, seed: int, tokenizer, *, system: str | None = None,
                 progress: Callable[[int], None] | None = None, messages: bool = False,
                 **options: Any) -> list[dict]:
    """`n` rows of the prompts artifact for `task`; `progress(done)` is called after each row. With
    `messages`, each row also holds the chat messages its prompt renders (`messages`), as a dataset's do."""
    task = get_task(task) if isinstance(task, str) else task
    if tokenizer is None:
        raise TaskError(
            f"task {task.name} needs a tokenizer to format prompts, and this model has none "
            "(a checkpoint without tokenizer files?)"
        )
    if n < 1:
        raise TaskError(f"the number of prompts must be at least 1, got {n}")
    unknown = sorted(k for k, v in options.items() if v is not None and k not in task.options)
    if unknown:
        accepted = ", ".join(task.options) or "none"
        raise TaskError(f"task {task.name} does not take {', '.join(unknown)} (its options: {accepted})")
    options = {k: v for k, v in options.items() if v is not None}
    if task.check is not None:
        task.check(n, **options)
    split = [options["split"]] if options.get("split", "all") != "all" else []
    variant = [f"{tag}{options[name]}" for name, tag in VARIANT_TAGS.items() if name in options]
    prefix = "-".join([task.name, *split, *variant, str(seed)])
    measure = lambda user: len(chat_format(tokenizer, user, system)[1])
    rows = []
    for i, example in enumerate(task.generate(n, seed, measure, **options)):
        text, ids = chat_format(tokenizer, example.user, system)
        rows.append({
            "prompt_id": f"{prefix}-{i}",
            "task": task.name,
            "prompt": text,
            "prompt_token_ids": ids,
            "answer": example.answer,
            "metadata": json.dumps(example.metadata, sort_keys=True),
            **({"messages": chat_messages(example.user, system)} if messages else {}),
        })
        if progress is not None:
            progress(i + 1)
    return rows


def _meta(metadata: str | dict | None) -> dict[str, Any]:
    return file_json(metadata) if isinstance(metadata, str) and metadata else (metadata or {})


def with_completion_ids(metadata: str | dict | None, token_ids: Sequence[int] | None) -> str | dict | None:
    """An item's metadata with its completion's token ids, which a user's TRL function takes as
    `completion_ids`; as it is where they are not known."""
    if token_ids is None:
        return metadata
    return {**_meta(metadata), COMPLETION_IDS: token_ids}


def _clamped(task: Task, reward: float) -> float:
    return float(min(1.0, max(0.0, reward))) if task.clamp else float(reward)


def score(task_name: str, completion_text: str, answer: str | None, metadata: str | dict | None) -> float:
    """Reward in [0, 1] for a completion (a user's reward function's, as it returned it); `metadata` is the
    artifact's JSON string or a dict."""
    return judge(task_name, completion_text, answer, metadata).reward


def judge(task_name: str, completion_text: str, answer: str | None, metadata: str | dict | None) -> Judgement:
    """The reward and why (`base.Judgement`): a code task's own verdict (status, tests passed), a user's
    reward function's extra fields, for the others correct / incorrect / unparsed by the answer the scorer
    reads."""
    task = get_task(task_name)
    if answer is None and task.needs_answer:
        return Judgement(0.0, "unparsed")
    if task.judge_many is not None:
        return task.judge_many([(completion_text, answer, _meta(metadata))])[0]
    if task.judge is not None:
        j = task.judge(completion_text, answer, _meta(metadata))
        return Judgement(_clamped(task, j.reward), j.status, j.tests_passed, j.tests_total, j.extra)
    reward = _clamped(task, task.score(completion_text, answer, _meta(metadata)))
    if reward >= 1.0:
        return Judgement(reward, "correct")
    given = task.given(completion_text) if task.given is not None else True
    return Judgement(reward, "incorrect" if given not in (None, "") else "unparsed")


Item = tuple[str, str, "str | None", "str | dict | None"]  # (task, completion text, answer, metadata)
T = TypeVar("T")


REWARD_WORKERS_ENV = "SPARROW_REWARD_WORKERS"


def reward_workers() -> int:
    """Default pool size for programs' rewards: $SPARROW_REWARD_WORKERS, else the CPU count. A value that is
    not a whole number of at least 1 is refused (TaskError)."""
    given = os.environ.get(REWARD_WORKERS_ENV, "").strip()
    if not given:
        return os.cpu_count() or 1
    if not given.isdecimal() or int(given) < 1:
        raise TaskError(f"${REWARD_WORKERS_ENV} must be a whole number of at least 1 (the programs run at "
                        f"once for code rewards), got {given!r}")
    return int(given)


def _batch(fn: Callable[..., T], items: Sequence[Item], workers: int | None,
           many: Callable[[Judgement], T]) -> list[T]:
    """`fn(*item)` of each item, in order; items of tasks that run code go through a pool of `workers`;
    those of a reward with `judge_many` are judged in one call per reward (`many` maps its judgements)."""
    out: dict[int, T] = {}
    batched: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        task = get_task(it[0]) if has_scorer(it[0]) else None
        if task is not None and task.judge_many is not None and (it[2] is not None or not task.needs_answer):
            batched.setdefault(it[0], []).append(i)
    for name, indices in batched.items():
        judged = get_task(name).judge_many([(items[i][1], items[i][2], _meta(items[i][3])) for i in indices])
        out.update(zip(indices, map(many, judged)))
    pooled = [i for i, it in enumerate(items)
              if i not in out and has_scorer(it[0]) and get_task(it[0]).runs_code]
    if pooled:
        n = min(workers or reward_workers(), len(pooled))
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sparrow-reward") as pool:
            out.update(zip(pooled, pool.map(lambda i: fn(*items[i]), pooled)))
    for i, it in enumerate(items):
        if i not in out:
            out[i] = fn(*it)
    return [out[i] for i in range(len(items))]


def score_batch(items: Sequence[Item], workers: int | None = None) -> list[float]:
    """`score` of each item, in order; items of tasks that run code go through a pool of `workers`."""
    return _batch(score, items, workers, lambda j: j.reward)


def judge_batch(items: Sequence[Item], workers: int | None = None) -> list[Judgement]:
    """`judge` of each item, in order, pooled like `score_batch`."""
    return _batch(judge, items, workers, lambda j: j)
