"""A user's own reward function (`--reward-fn path.py:function`): the file imported as a script, the
function's convention (verl's `compute_score` or TRL's batch function) read from its signature and checked
before any work, then called in this process as that trainer calls it, each result held to a finite
number; it is registered beside the built-in rewards (`rewards.REWARDS`) as `reward-fn:<file>:<function>`.

Design decisions:
- `--reward-fn` names a file and a function in it, `path.py:function`; a file named alone means its
  `compute_score`, as verl's `custom_reward_function.name` defaults to it. A module's dotted import path
  (TRL's `reward_funcs="my_lib.rewards.fn"`) is not taken: a file is, imported as a script.
- A user's function runs in this process, as verl and TRL run theirs. Which convention it follows is read
  from its signature: a `solution_str` parameter is verl's `compute_score(data_source, solution_str,
  ground_truth, extra_info)`, called once per completion with keyword arguments, and so is a function of
  **kwargs alone named compute_score (verl's default name); else a `completions` parameter (or **kwargs)
  is TRL's `f(prompts, completions, **columns) -> list[float]`, called once per
  batch with the dataset's other columns as lists, but for `completion` and `completion_ids`, which
  GRPOTrainer leaves out as it does `prompt` (it passes its own completions). A verl function may return
  a number (a bool, a numpy scalar, or a 0-d array or tensor, whose `.item()` verl's reward manager
  takes) or a dict with a numeric `score` (the dict's other fields are kept as the completion's
  `extra`); anything else, a non-finite number (an int too large for a float is one), or a TRL result of
  the wrong length is refused in one sentence, a dict without `score` naming the keys it has. A function
  that raises (any exception, a BaseException too), or exits (SystemExit: sys.exit() in a script's scorer
  would otherwise end the command silently, with nothing written), is named with the dataset row of the
  completion (a TRL batch that raises is called again one item at a time to find it); KeyboardInterrupt
  still interrupts. Importing the file is held to the same rule. Code that closes its stdout or stderr
  closes a stand-in (`Unclosable`), not the command's.
- A verl function's `extra_info` is what verl's reward manager passes: a copy of the row's extra_info
  as a dict (`{}` where the column is missing or null, as verl's RLHFDataset reads it) with the keys the
  manager adds: `num_turns` 2 (a prompt and its completion, as verl's single-turn agent loop counts them)
  and `rollout_reward_scores` {} (no tool scored the rollout). So a function written for verl's trainer
  runs here unchanged, and what it changes in the dict does not reach another sample.
- The signature is checked before any work, with `inspect.signature(...).bind` of what will be passed:
  verl's four keywords when the file is loaded; for TRL, prompts and completions when it is loaded, and
  the dataset's columns as each row is checked (`Task.check_metadata`, which rollout, train and reward
  run before any work). A parameter TRL fills and Sparrow does not (trainer_state) must
  have a default. `completion_ids` (each completion's token ids, which TRL's length rewards read) is
  passed where the completions' token ids are known: always in rollout and train, in `sparrow reward` for
  a rollouts artifact or a file with a `completion_ids` column; a function that needs them and gets
  completions of text alone is refused in one sentence.
- TRL's `log_metric(name, value)` and `log_extra(column, values)` are passed as GRPOTrainer passes them,
  to a function that names them or takes **kwargs. What a call logs is kept with the completions it
  scored, in each one's extra fields (`reward_extra` in rollouts and rewards): a column's own value, and
  the call's mean of each metric. `logged_metrics` also gives the metrics' means since it was last read,
  for a command that reports them per step (TRL averages them over a logging step).
- A TRL function's result is any sequence, as TRL iterates it: a list, a tuple, a 1-d numpy array or
  tensor. TRL reads a None reward as "not applicable" and sums the other reward functions' rewards
  without it; Sparrow scores with one function, where that sum is empty (a NaN would spoil the group's
  advantage, a 0 would be a reward the function never gave), so None is refused in one sentence that
  says so.
- An async function (TRL accepts them) is awaited: each call's coroutine runs to its end in its own
  event loop (`asyncio.run`), one call at a time.
- The file is imported as `python file.py` would run it, with its folder first on sys.path, so it can
  import the modules beside it; the folder is on sys.path while the file is imported and while the
  function runs (it may import lazily), not after. A relative import fails there as in a script, and the
  refusal says to import the module by its name.
- User code's output goes to stderr while it runs (imported or called): the command's stdout may be
  carrying its data (`-o -` Parquet, `-f json`), and verl's reward functions print. Python's sys.stdout
  is redirected, and so is descriptor 1 (C extensions, child processes) where it is open.
- `--reward-kwargs` (verl's `custom_reward_function.reward_kwargs`): a JSON object of keywords passed to
  every call, verl's and TRL's functions alike, beside what the trainer passes; a key that is one of those
  (verl's four keywords, TRL's prompts, completions, loggers, completion_ids or a dataset column) is refused
  rather than overriding it, and the function must take every key (by name, or **kwargs). The keywords are
  part of the reward's name (`reward-fn:file.py:fn(k=v)`) and of what artifacts record (`reward_kwargs`).
- Rows reach the function in the users' dataset layout (`core/user_data.py`, `rewards.py`), its
  columns as the Python values `datasets` gives (a datetime, a Decimal, bytes: `extras.column_value`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .base import COMPLETION_IDS, Judgement, RewardError, TaskError, row_of
from .extras import column_value, shown_as
from .rewards import REWARDS, cut, dataset_reward

Item = tuple[str, "str | None", dict[str, Any]]  # (completion, answer, metadata)
Style = Literal["verl", "trl"]

VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_ONLY = ("trainer_state",)  # what TRL passes its functions and Sparrow does not
TRL_UNPASSED = ("prompt", "completion", "completion_ids")  # dataset columns GRPOTrainer does not pass
DEFAULT_FUNCTION = "compute_score"  # verl's custom_reward_function.name default
TRL_LOGGERS = ("log_metric", "log_extra")  # what TRL passes its functions for logging, and so does Sparrow
TRL_PASSED = ("prompts", "completions", COMPLETION_IDS, *TRL_LOGGERS, *TRL_ONLY)  # besides the columns

_LOADED: dict[tuple[str, str, str | None], str] = {}  # (spec, its file's sha256, kwargs) -> task name


def register_function(spec: str, kwargs: Mapping[str, Any] | None = None) -> str:
    """The task name of a user's reward function called with `kwargs` besides what its trainer passes,
    loaded once per process, version of its file and keywords (`--reward-fn`, `--reward-kwargs`): a notebook
    that edits the file and runs again scores with the edited function, the one whose sha256 the provenance
    records."""
    key = (spec, reward_fn_sha256(spec), reward_kwargs_text(kwargs))
    if key not in _LOADED:
        reward = load_reward_function(spec, kwargs)
        REWARDS[reward.task_name] = dataset_reward(reward.task_name, f"the user's function {spec}",
                                                   judge_many=reward.judge_many, clamp=False,
                                                   needs_answer=False, check_metadata=reward.check_row)
        shown_as(reward.task_name, spec)
        _LOADED[key] = reward.task_name
    return _LOADED[key]


# ---------------------------------------------------------------- what names the function and its file


def reward_fn_spec(spec: str) -> str:
    """A --reward-fn as path.py:function: a file named alone (or whose name holds a colon) means its
    DEFAULT_FUNCTION, as in verl; anything else as given (`load_reward_function` names what is wrong)."""
    path_text, sep, name = spec.rpartition(":")
    if sep and path_text and name.isidentifier():
        return spec
    if not sep or Path(spec).expanduser().is_file():
        return f"{spec}:{DEFAULT_FUNCTION}"
    return spec


def reward_fn_sha256(spec: str | None) -> str:
    """The sha256 of the file that a --reward-fn path.py:function names; "" for none, or for a file that
    cannot be read (loading the reward names it). Modules the file imports are not part of it."""
    if not spec:
        return ""
    import hashlib

    file = Path(reward_fn_spec(spec).rpartition(":")[0]).expanduser()
    try:
        return hashlib.sha256(file.read_bytes()).hexdigest()
    except OSError:
        return ""


def reward_kwargs_text(kwargs: Mapping[str, Any] | None) -> str | None:
    """--reward-kwargs as artifacts record it: compact JSON, keys sorted; None for none."""
    return json.dumps(dict(kwargs), sort_keys=True, separators=(",", ":")) if kwargs else None


def parse_reward_kwargs(text: str) -> dict[str, Any]:
    """--reward-kwargs: a JSON object whose keys are Python names; RewardError in one sentence."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise RewardError(f"--reward-kwargs {cut(text)!r} is not JSON ({e}); give an object of keywords, "
                          "e.g. '{\"min_words\": 5}'") from None
    if not isinstance(value, dict):
        raise RewardError(f"--reward-kwargs {cut(text)!r} is a JSON {type(value).__name__}, not an object of "
                          "keywords, e.g. '{\"min_words\": 5}'")
    bad = next((k for k in value if not k.isidentifier()), None)
    if bad is not None:
        raise RewardError(f"--reward-kwargs key {bad!r} is not a Python name, so no function can take it "
                          "as a keyword")
    return value


def reward_provenance(reward: str | None, reward_fn: str | None,
                      reward_kwargs: Mapping[str, Any] | None = None) -> dict[str, str | None]:
    """What scored rewards, under the keys every artifact and run config records it by: `reward`
    (--reward's name), `reward_fn` (--reward-fn's path.py:function), `reward_fn_sha256` and
    `reward_kwargs` (`reward_kwargs_text`). Both None: each prompt's own task scorer. The file is named by
    its absolute path."""
    if reward_fn:
        file, _, function = reward_fn_spec(reward_fn).rpartition(":")
        reward_fn = f"{Path(file).expanduser().absolute()}:{function}"
    return {"reward": reward, "reward_fn": reward_fn, "reward_fn_sha256": reward_fn_sha256(reward_fn),
            "reward_kwargs": reward_kwargs_text(reward_kwargs)}


# ---------------------------------------------------------------- loading


def load_reward_function(spec: str, kwargs: Mapping[str, Any] | None = None) -> RewardFunction:
    """`path.py:function` loaded, its convention read from its signature and the keywords it will be
    called with (`kwargs` among them) checked (module docstring); RewardError in one sentence."""
    spec = reward_fn_spec(spec)
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise RewardError(f"--reward-fn {spec!r} is not path.py:function (a Python file and the name of a "
                          "function in it)")
    path = Path(path_text).expanduser()
    if path.is_dir():
        raise RewardError(f"--reward-fn {spec}: {path} is a folder; name a Python file in it and the "
                          "function (path/to/module.py:function)")
    if not path.is_file():
        dotted = "" if path.suffix == ".py" or "/" in path_text else (
            "; --reward-fn takes a file, not a module's dotted import path (give path/to/module.py:function)")
        raise RewardError(f"--reward-fn {spec}: no such file {path}{dotted}")
    module = _import(spec, path)
    fn = getattr(module, name, None)
    if fn is None and not hasattr(module, name):
        raise RewardError(f"--reward-fn {spec}: {path} has no function {name!r}")
    if not callable(fn):
        raise RewardError(f"--reward-fn {spec}: {name!r} in {path} is {_a(type(fn).__name__)} "
                          f"({_shown(fn)}), not a function")
    style = _style(fn, spec, name)
    kwargs = dict(kwargs or {})
    _check_own_keywords(kwargs, VERL_KEYWORDS if style == "verl" else TRL_PASSED, style)
    if style == "verl":
        _check_verl_keywords(fn, spec, kwargs)
    else:
        _check_trl_keywords(fn, spec, kwargs)
    trl = style == "trl"
    return RewardFunction(spec, path, name, fn, style, _loggers(fn) if trl else (), trl and _takes_ids(fn),
                          kwargs)


def _check_own_keywords(kwargs: Mapping[str, Any], passed: Sequence[str], style: Style) -> None:
    """RewardError for a --reward-kwargs key that the trainer's call passes itself (module docstring)."""
    taken = [k for k in kwargs if k in passed]
    if taken:
        them = "it" if len(taken) == 1 else "them"
        trainer = "verl" if style == "verl" else "TRL"
        raise RewardError(f"--reward-kwargs {', '.join(taken)}: {trainer} passes {them} to the function "
                          f"itself ({', '.join(passed)}); give your keywords other names")


def _import(spec: str, path: Path) -> Any:
    """The module of a reward file, imported with its folder on sys.path (module docstring)."""
    module_name = f"sparrow_reward_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"--reward-fn {spec}: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        with stdout_to_stderr(), working_directory_kept(), folder_on_path(path.resolve().parent):
            module_spec.loader.exec_module(module)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: still the command's
        raise
    except BaseException as e:  # anything else the user's file ends with, named
        sys.modules.pop(module_name, None)
        relative = isinstance(e, ImportError) and "relative import" in str(e)
        advice = ("; a reward file is imported as a script, with its folder on sys.path, so import the "
                  "modules beside it by their names (from helper import f, not from .helper import f)"
                  if relative else "")
        raise RewardError(f"--reward-fn {spec}: importing {path} {_ended(e)}{advice}") from None
    return module


def _style(fn: Callable, spec: str, name: str) -> Style:
    """verl's where the function names solution_str, or takes only **kwargs under verl's default name
    compute_score; TRL's where it names completions or takes **kwargs otherwise."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise RewardError(f"--reward-fn {spec} has no signature Python can read, so which keywords it takes "
                          "is unknown; define it with def") from None
    if "solution_str" in params:
        return "verl"
    if "completions" in params:
        return "trl"
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "verl" if name == DEFAULT_FUNCTION else "trl"
    raise RewardError(f"--reward-fn {spec} takes ({_parameters(fn)}), neither verl's compute_score("
                      "data_source, solution_str, ground_truth, extra_info) nor TRL's "
                      "f(prompts, completions, **kwargs)")


def _check_verl_keywords(fn: Callable, spec: str, kwargs: Mapping[str, Any]) -> None:
    """RewardError when a verl function cannot take verl's four keywords and --reward-kwargs'."""
    try:
        inspect.signature(fn).bind(**dict.fromkeys(VERL_KEYWORDS), **kwargs)
    except TypeError as e:
        given = f" and --reward-kwargs' {', '.join(kwargs)}" if kwargs else ""
        raise RewardError(f"--reward-fn {spec} takes ({_parameters(fn)}), which cannot be called as verl "
                          f"calls compute_score, with the keywords {', '.join(VERL_KEYWORDS)}{given} "
                          f"({e})") from None


def _check_trl_keywords(fn: Callable, spec: str, kwargs: Mapping[str, Any]) -> None:
    """RewardError when a TRL function cannot take prompts, completions and --reward-kwargs, or needs what
    TRL passes and Sparrow does not (each row's columns are checked as it is read: `check_row`)."""
    signature = inspect.signature(fn)
    try:
        signature.bind_partial(**kwargs)
    except TypeError as e:
        raise RewardError(f"--reward-fn {spec} takes ({_parameters(fn)}), which cannot take --reward-kwargs' "
                          f"{', '.join(kwargs)} ({e}); a function takes **kwargs for keywords it does not "
                          "name") from None
    try:
        signature.bind_partial(prompts=None, completions=None)
    except TypeError as e:
        raise RewardError(f"--reward-fn {spec} takes ({_parameters(fn)}), which cannot take the keywords TRL "
                          f"passes, prompts, completions and the dataset's columns ({e}); a TRL reward "
                          "function takes **kwargs for those it does not read") from None
    unfilled = [p.name for p in signature.parameters.values() if p.name in TRL_ONLY and p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unfilled:
        raise RewardError(f"--reward-fn {spec} needs {', '.join(unfilled)}, which TRL passes and Sparrow "
                          "does not (it passes prompts, completions and the dataset's columns); give "
                          f"{'it a default' if len(unfilled) == 1 else 'them defaults'}")


def _takes_ids(fn: Callable) -> bool:
    """Whether a TRL function takes completion_ids: by name, or through **kwargs (TRL passes it to all)."""
    params = inspect.signature(fn).parameters
    return COMPLETION_IDS in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _loggers(fn: Callable) -> tuple[str, ...]:
    """The TRL_LOGGERS a TRL function takes: those it names, or all of them through **kwargs (TRL passes
    them to every function; Sparrow passes none to a function that could not take them)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return TRL_LOGGERS
    return tuple(name for name in TRL_LOGGERS if name in params)


# ---------------------------------------------------------------- calling


@dataclass(frozen=True)
class RewardFunction:
    """A user's reward function, loaded from `path` (`spec` is how the command line named it)."""

    spec: str
    path: Path
    name: str
    fn: Callable
    style: Style
    loggers: tuple[str, ...] = ()  # the TRL_LOGGERS it takes (by name or through **kwargs)
    takes_ids: bool = False  # a TRL function that takes completion_ids (`_takes_ids`)
    kwargs: dict[str, Any] = field(default_factory=dict)  # --reward-kwargs, passed to every call
    checked: set[frozenset[str]] = field(default_factory=set, compare=False, repr=False)  # TRL columns

    @property
    def task_name(self) -> str:
        bound = ", ".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in sorted(self.kwargs.items()))
        return f"reward-fn:{self.path.name}:{self.name}" + (f"({bound})" if bound else "")

    def where(self, metadata: dict[str, Any]) -> str:
        row, file = metadata.get("row"), metadata.get("file")
        return f"{row_of(row)} of {file}" if row is not None else "a row"

    def check_row(self, metadata: dict[str, Any]) -> None:
        """TaskError in one phrase when a TRL function cannot take a row's columns as keywords (verl's
        keywords are checked when the file loads); each set of columns is checked once."""
        columns = _passed(metadata.get("columns") or {})
        if self.style != "trl" or frozenset(columns) in self.checked:
            return
        both = [k for k in self.kwargs if k in columns]
        if both:
            named = "a column" if len(both) == 1 else "columns"
            raise TaskError(f"--reward-kwargs {', '.join(both)}: the dataset has {named} of that name, which "
                            "TRL passes the function as a keyword; give your keywords other names")
        try:
            inspect.signature(self.fn).bind(prompts=None, completions=None, **self.kwargs,
                                            **dict.fromkeys([*columns, *self.loggers,
                                                             *[COMPLETION_IDS] * self.takes_ids]))
        except TypeError as e:
            shown = ", ".join(columns) or "none"
            advice = ("a TRL reward function takes **kwargs for the columns it does not read"
                      if "unexpected keyword" in str(e) else "TRL fills each parameter beyond prompts and "
                      "completions from the dataset's column of that name, or with its own "
                      f"{', '.join(TRL_LOGGERS + TRL_ONLY)}, of which Sparrow passes all but "
                      f"{' and '.join(TRL_ONLY)}")
            raise TaskError(f"--reward-fn {self.spec} takes ({_parameters(self.fn)}), which cannot take "
                            "what TRL passes it for this row: prompts, completions and the dataset's "
                            f"columns ({shown}) as keywords ({e}); {advice}") from None
        self.checked.add(frozenset(columns))

    def judge_many(self, items: list[Item]) -> list[Judgement]:
        with stdout_to_stderr(), working_directory_kept(), folder_on_path(self.path.resolve().parent):
            return self._verl(items) if self.style == "verl" else self._trl(items)

    def _verl(self, items: list[Item]) -> list[Judgement]:
        out = []
        for completion, answer, meta in items:
            columns = column_value(meta.get("columns") or {})
            try:
                value = _awaited(self.fn(data_source=columns.get("data_source"), solution_str=completion,
                                         ground_truth=column_value(answer),
                                         extra_info=verl_extra_info(columns.get("extra_info")),
                                         **self.kwargs))
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # the user's error, named with its row
                raise self._raised(e, meta) from None
            out.append(self._judgement(value, meta))
        return out

    def _trl(self, items: list[Item]) -> list[Judgement]:
        """One call for the batch (module docstring); what it logged lands in each completion's extra
        fields, and only a call that returned counts (a batch called again item by item logs again)."""
        logged, ids = Logged(), self._ids(items)
        try:
            values = _awaited(self._call_trl(items, logged, ids))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # named with its row: the batch's items again, one at a time
            if len(items) == 1:
                raise self._raised(e, items[0][2]) from None
            return [j for item in items for j in self._trl([item])]
        listed = self._listed(values, items)
        judged = [self._judgement(v, meta) for v, (_, _, meta) in zip(listed, items)]
        extras = logged.extras(len(items), self.spec)
        return [Judgement(j.reward, j.status, j.tests_passed, j.tests_total,
                          {**(j.extra or {}), **extra} or None) for j, extra in zip(judged, extras)]

    def _call_trl(self, items: list[Item], logged: Logged, ids: dict[str, list]) -> Any:
        """The function called as GRPOTrainer calls it: prompts, completions, each column it passes as a
        list of the batch's values (as `datasets` gives them, `column_value`), the loggers it takes and
        `ids` (completion_ids, where known)."""
        prompts, completions, columns = [], [], {}
        keys = list(dict.fromkeys(k for _, _, meta in items for k in _passed(meta.get("columns") or {})))
        for completion, _, meta in items:
            prompt = column_value(meta.get("prompt"))
            prompts.append(prompt)
            conversational = isinstance(prompt, list)
            completions.append([{"role": "assistant", "content": completion}] if conversational
                               else completion)
            row = column_value(meta.get("columns") or {})
            for k in keys:
                columns.setdefault(k, []).append(row.get(k))
        loggers = {name: getattr(logged, name) for name in self.loggers}
        return self.fn(prompts=prompts, completions=completions,
                       **{**columns, **loggers, **ids, **self.kwargs})

    def _ids(self, items: list[Item]) -> dict[str, list]:
        """The batch's completion_ids where the function takes them and every completion's are known;
        RewardError where it needs them and they are not (completions of text alone)."""
        if not self.takes_ids:
            return {}
        ids = [meta.get(COMPLETION_IDS) for _, _, meta in items]
        if all(i is not None for i in ids):
            return {COMPLETION_IDS: [[int(t) for t in i] for i in ids]}  # as TRL passes them: lists of ints
        param = inspect.signature(self.fn).parameters.get(COMPLETION_IDS)
        if param is not None and param.default is param.empty:
            raise RewardError(f"--reward-fn {self.spec} needs completion_ids, and these completions are "
                              "text alone; score a rollouts artifact (it keeps each completion's token ids) "
                              "or give a completion_ids column")
        return {}

    def _listed(self, values: Any, items: list[Item]) -> list:
        """A TRL call's result as one value per completion (`_as_list`); RewardError for a result of
        another length or kind, or a None."""
        listed = _as_list(values)
        if listed is None or len(listed) != len(items):
            shape = getattr(values, "shape", None)
            got = f"a {type(values).__name__}" + (f" of {len(listed)}" if listed is not None else
                                                  f" of shape {tuple(shape)}" if shape is not None else "")
            raise RewardError(f"--reward-fn {self.spec} returned {got} for {len(items)} completions; a TRL "
                              "reward function returns a list of one number per completion")
        for v, (_, _, meta) in zip(listed, items):
            if v is None:
                raise RewardError(f"--reward-fn {self.spec} returned None on {self.where(meta)}; TRL reads "
                                  "None as 'not applicable' and leaves the completion to its other reward "
                                  "functions, but Sparrow scores with this one function alone, so it must "
                                  "return a number for every completion")
        return listed

    def _raised(self, e: BaseException, meta: dict[str, Any]) -> RewardError:
        exited = isinstance(e, SystemExit)
        advice = "; a reward function returns its score instead of exiting" if exited else ""
        return RewardError(f"--reward-fn {self.spec} {_ended(e)} on {self.where(meta)}{advice}")

    def _judgement(self, value: Any, meta: dict[str, Any]) -> Judgement:
        returned = value
        extra = None
        if isinstance(value, dict):
            if "score" not in value:
                keys = cut(", ".join(map(_shown, value))) or "none"
                raise RewardError(f"--reward-fn {self.spec} returned a dict without a 'score' key (its keys: "
                                  f"{keys}) on {self.where(meta)}; a verl reward function returns a finite "
                                  "number or a dict with a numeric 'score'")
            extra = {k: v for k, v in value.items() if k != "score"}
            value = value["score"]
        value = _scalar(value)
        if not isinstance(value, numbers.Real) or not _finite(value):
            expected = ("a TRL reward function returns a list of one finite number per completion"
                        if self.style == "trl" else
                        "a verl reward function returns a finite number or a dict with a numeric 'score'")
            raise RewardError(f"--reward-fn {self.spec} returned {_shown(returned)} on {self.where(meta)}; "
                              f"{expected}")
        return Judgement(float(value), None, extra=extra)


def verl_extra_info(value: Any) -> Any:
    """The `extra_info` verl's naive reward manager passes for a row's extra_info column (module
    docstring): a struct, or a map (Arrow's key-value pairs), as a dict; anything else as it is."""
    if _pairs(value):
        value = {k: v for k, v in value}
    if value is not None and not isinstance(value, Mapping):
        return value
    return {**(value or {}), "num_turns": 2, "rollout_reward_scores": {}}


def _pairs(value: Any) -> bool:
    """An Arrow map column's value as Python reads it: a list of (text key, value) pairs."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str) for p in value)


def _passed(columns: Mapping[str, Any]) -> list[str]:
    """The dataset columns a TRL function gets as keywords: all but TRL_UNPASSED."""
    return [c for c in columns if c not in TRL_UNPASSED]


# ---------------------------------------------------------------- what a TRL function logs


@dataclass
class _Tally:
    """A metric's sum and count since `logged_metrics` was last read."""

    total: float = 0.0
    count: int = 0


_METRICS: dict[str, _Tally] = {}  # what log_metric logged, by the metric's name


@dataclass
class Logged:
    """What a TRL function logged in one call through the `log_metric(name, value)` and
    `log_extra(column, values)` keywords, as GRPOTrainer takes them: scalars by name (several in one call
    are averaged, as TRL averages them over a logging step), and per-completion columns."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    columns: dict[str, list] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.columns.setdefault(str(column), []).extend(values)

    def extras(self, n: int, spec: str) -> list[dict[str, Any]]:
        """The logged values as `n` completions' extra fields: a metric's mean on each of them, a column's
        own value on each; RewardError when a column does not have one value per completion."""
        for column, values in self.columns.items():
            if len(values) != n:
                raise RewardError(f"--reward-fn {spec} logged {len(values)} values for column {column!r} "
                                  f"with log_extra, for a batch of {n} completions; log_extra takes one "
                                  "value per completion")
        means = {name: sum(v) / len(v) for name, v in self.metrics.items()}
        for name, values in self.metrics.items():
            tally = _METRICS.setdefault(name, _Tally())
            tally.total += sum(values)
            tally.count += len(values)
        return [{**means, **{c: v[i] for c, v in self.columns.items()}} for i in range(n)]


def logged_metrics() -> dict[str, float]:
    """The mean of each metric users' reward functions logged with log_metric since the last call (as TRL
    averages them over a logging step), then forgotten; for a command's step metrics or summary."""
    means = {name: tally.total / tally.count for name, tally in _METRICS.items() if tally.count}
    _METRICS.clear()
    return means


# ---------------------------------------------------------------- where user code runs


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While user code runs, what it writes to stdout goes to stderr (module docstring)."""
    if sys.stdout is not None:
        sys.stdout.flush()  # the command's own pending output stays ahead, on stdout
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 or 2: Python's stdout is still redirected
        saved = None
    stream = Unclosable(sys.stderr)
    try:
        with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


class Unclosable:
    """The command's stderr as user code's sys.stdout and sys.stderr: closing it only flushes it, so that
    code which closes its stdout leaves the command its stderr."""

    def __init__(self, stream: Any):
        self._stream = stream

    def close(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def working_directory_kept() -> Iterator[None]:
    """User code that changes the working directory (os.chdir) has it changed back when it returns, so
    the command's relative paths (its outputs, the run folder) still name what the user gave."""
    cwd = os.getcwd()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.chdir(cwd)


@contextlib.contextmanager
def folder_on_path(folder: Path) -> Iterator[None]:
    """The reward file's folder first on sys.path while user code runs, as `python file.py` has it."""
    entry = str(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


# ---------------------------------------------------------------- the values user code gives


def _scalar(value: Any) -> Any:
    """A 0-d numpy array or tensor as its Python number (`.item()`, as verl's reward manager reads a
    score); any other value as it is."""
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return value.item()
    return value


def _awaited(value: Any) -> Any:
    """An async function's result, awaited to its end (module docstring); any other value as it is."""
    if not inspect.isawaitable(value):
        return value

    async def result() -> Any:
        return await value

    return asyncio.run(result())


def _as_list(values: Any) -> list | None:
    """A TRL function's result as a list: any sequence TRL can iterate (a list, a tuple, a 1-d numpy array
    or tensor, whose numbers become Python's); None for text, a dict, an iterator or a scalar."""
    if isinstance(values, str | bytes | Mapping):
        return None
    if getattr(values, "ndim", None) == 1 and callable(getattr(values, "tolist", None)):
        return values.tolist()
    return list(values) if isinstance(values, Sequence) else None


def _finite(value: numbers.Real) -> bool:
    """Whether a real number is a finite float: an int or fraction too large for a float is not."""
    try:
        return math.isfinite(value)
    except (OverflowError, ValueError, TypeError):
        return False


def _ended(e: BaseException) -> str:
    """How user code ended: "exited (sys.exit(0))" or "raised ValueError (its message's first line)"."""
    if isinstance(e, SystemExit):
        return f"exited (sys.exit({'' if e.code is None else repr(e.code)}))"
    try:
        message = (str(e).strip().splitlines() or [""])[0]
    except Exception:  # an exception whose __str__ raises is named by its type alone
        message = ""
    return f"raised {type(e).__name__}" + (f" ({message})" if message else "")


def _shown(value: Any) -> str:
    """A returned value as a message shows it: its repr, cut (a repr that fails names the type)."""
    try:
        return cut(repr(value))
    except Exception:  # an int of more digits than Python prints, an object whose __repr__ raises
        if isinstance(value, int):
            return f"an int of {math.floor(abs(value).bit_length() * math.log10(2)) + 1:,} digits or so"
        return f"{_a(type(value).__name__)} that cannot be shown"


def _a(noun: str) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _parameters(fn: Callable) -> str:
    """A function's parameter names as its def lists them (*args, **kwargs marked)."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return ", ".join(stars.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values())
