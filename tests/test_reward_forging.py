"""A program cannot forge its reward: every known way for the code under test to reach the verdict scores
what its function's own return values earn, which for these programs is 0.

Each forging program solves `has_close_elements` (HumanEval/0: 7 asserts, 3 of them expect False) with a
function that raises, so without the forgery it scores 0; the forgery tries to make the tests look
passed. A correct solution still scores 1 next to them. Expected rewards come from the problem's test
text (which asserts expect True or False), not from the scorer.

The last section raises exceptions named as the host's own verdicts (`passed`, `wrong`, `AssertionError`,
`_Timeout`) on every code reward (`code`, `humaneval`, `--reward code` call and stdin/stdout tests): a
function that raises passes nothing and has no runnable-function credit, so each scores 0, status failed.
"""

from __future__ import annotations

import json
import time

import pytest

from sparrow.stages.tasks import code, rewards
from sparrow.stages.tasks import sandbox as sb
from sparrow.stages.tasks.humaneval import problems, verdict

pytestmark = pytest.mark.skipif(sb.sandbox_problem(sb.bwrap_binary()) is not None, reason="no sandbox here")

WRONG = "def has_close_elements(numbers, threshold):\n    raise ValueError('not solved')\n"

# Each route runs at import time, before the function is defined, unless it is inside the function.
ROUTES = {
    "calling every function of __main__ as a reporter": """\
import __main__
for _o in list(vars(__main__).values()):
    if callable(_o) and not isinstance(_o, type):
        for _i in range(50):
            for _args in ((_i, "passed"), (_i, "passed", None), (_i, "returned", True)):
                try:
                    _o(*_args)
                except BaseException:
                    pass
""",
    "reporters and channels found in sys.modules": """\
import json, sys
for _m in list(sys.modules.values()):
    for _name in ("_say", "_report", "_answers", "_out", "_channel"):
        _o = getattr(_m, _name, None)
        for _i in range(50):
            try:
                if hasattr(_o, "write"):
                    _o.write(json.dumps([_i, "passed", None]) + "\\n")
                    _o.flush()
                elif callable(_o):
                    _o(_i, "passed")
            except BaseException:
                pass
""",
    "functions and files found by gc.get_objects": """\
import gc, json, re, types
_nonces = set()
for _o in gc.get_objects():
    if isinstance(_o, types.FunctionType):
        for _c in _o.__code__.co_consts:
            if isinstance(_c, str) and _c.startswith("@@sparrow-"):
                _nonces.add(_c)
                for _i in range(50):
                    try:
                        _o(_i, "passed")
                    except BaseException:
                        pass
for _o in gc.get_objects():
    if hasattr(_o, "write") and "w" in str(getattr(_o, "mode", "")):
        for _i in range(50):
            for _n in [*_nonces, ""]:
                try:
                    _o.write(_n + json.dumps([_i, "passed", None]) + "\\n")
                    _o.flush()
                except BaseException:
                    pass
""",
    "the caller's frames, from inside the function": """\
import json, sys
def _forge():
    frame = sys._getframe(1)
    while frame is not None:
        for scope in (frame.f_globals, frame.f_locals):
            for _name, _o in list(scope.items()):
                for _i in range(50):
                    try:
                        if _name == "_say":
                            _o(_i, "passed")
                        elif _name in ("_report", "_answers"):
                            _o.write(json.dumps([_i, "passed", None]) + "\\n")
                            _o.flush()
                    except BaseException:
                        pass
        frame = frame.f_back
def has_close_elements(numbers, threshold):
    _forge()
    raise ValueError('not solved')
""",
    "result lines with the harness's nonce on fds 1 to 19": """\
import json, os, re
import __main__
_here = os.path.dirname(os.path.abspath(__main__.__file__))
_nonces = {""}
for _f in os.listdir(_here):
    try:
        _nonces |= set(re.findall(r"@@sparrow-[0-9a-f]+@@", open(os.path.join(_here, _f)).read()))
    except OSError:
        pass
for _fd in range(1, 20):
    for _i in range(50):
        for _n in _nonces:
            for _line in ([_i, "passed", None], [_i, "returned", {"eq": "anything"}], [_i, "passed"]):
                try:
                    os.write(_fd, (_n + json.dumps(_line) + "\\n").encode())
                except OSError:
                    pass
""",
    "os._exit(0) before the tests": "import os\nos._exit(0)\n",
    "os._exit(0) from the function": """\
import os
def has_close_elements(numbers, threshold):
    os._exit(0)
""",
    "SystemExit before the tests": "raise SystemExit(0)\n",
    "SystemExit from the function": """\
def has_close_elements(numbers, threshold):
    raise SystemExit(0)
""",
    "exit 0 at exit, before the tests": "import atexit, os, sys\natexit.register(os._exit, 0)\nsys.exit()\n",
    "builtins.exec made a no-op": """\
import builtins
builtins.exec = lambda *a, **k: None
""",
    "assert and AssertionError patched": """\
import builtins
class _Never(BaseException):
    pass
builtins.AssertionError = _Never
builtins.BaseException = _Never
""",
    "the test function patched through ast.parse": """\
import ast
_parse = ast.parse
ast.parse = lambda *a, **k: _parse("def check(candidate):\\n" + "    assert True\\n" * 7)
def check(candidate):
    pass
""",
    "a return value equal to everything": """\
class _Equal:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def has_close_elements(numbers, threshold):
    return _Equal()
""",
}


def _meta(p: dict) -> dict:
    return {"task_id": p["task_id"], "function": p["entry_point"], "stub": p["prompt"], "test": p["test"]}


def _program(route: str) -> str:
    code = ROUTES[route]
    return code if "def has_close_elements" in code else code + WRONG


@pytest.fixture(scope="module")
def problem() -> dict:
    p = problems()[0]
    assert p["task_id"] == "HumanEval/0" and p["entry_point"] == "has_close_elements"
    return p


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_forging_program_scores_0(problem, route):
    got = verdict(f"```python\n{_program(route)}```", _meta(problem))
    assert (got.reward, got.passed) == (0.0, 0), got


def test_a_correct_solution_still_scores_1(problem):
    got = verdict(f"```python\n{problem['prompt']}{problem['canonical_solution']}```", _meta(problem))
    assert (got.reward, got.status, got.passed, got.tests) == (1.0, "passed", 7, 7)


def _asserts_expecting(problem: dict, value: str) -> int:
    return sum(line.strip().startswith("assert") and line.rstrip().endswith(f"== {value}")
               for line in problem["test"].splitlines())


def test_answers_written_ahead_count_as_return_values_and_no_more(problem):
    """Lines that look like the server's answers are at most what the function could have returned:
    writing "returned True" for every call scores what `return True` scores."""
    forged = ("import json, os\n_fd = os.dup(1)\n"  # fd 1 is stderr by now; its answer channel is a copy
              "for _fd in range(1, 20):\n    for _i in range(1, 300):\n        try:\n"
              "            os.write(_fd, (json.dumps([_i, 'returned', True]) + '\\n').encode())\n"
              "        except OSError:\n            pass\n")
    got = verdict(f"```python\n{forged}{WRONG}```", _meta(problem))
    honest = verdict("```python\ndef has_close_elements(numbers, threshold):\n    return True\n```",
                     _meta(problem))
    expecting_true = _asserts_expecting(problem, "True")
    assert expecting_true == 4
    assert got.reward <= honest.reward == pytest.approx(0.9 * expecting_true / 7 + 0.1)


def test_an_int_that_equals_everything_crosses_as_its_plain_value(problem):
    program = ("class _Zero(int):\n    def __eq__(self, other):\n        return True\n"
               "    __hash__ = int.__hash__\n"
               "def has_close_elements(numbers, threshold):\n    return _Zero(0)\n")
    got = verdict(f"```python\n{program}```", _meta(problem))
    # 0 == False holds for the built-in int, 0 == True does not
    assert got.passed == _asserts_expecting(problem, "False") == 3


def test_the_tests_never_enter_the_sandbox(problem):
    """The function looks for the test's text everywhere it can (its folder, /tmp, every object in its
    interpreter, its callers' frames) and solves the problem only where it finds nothing."""
    program = problem["prompt"] + problem["canonical_solution"] + """
import gc, os, sys
_MARKERS = ("def check(", "candidate(", "assert ")
def _seen():
    import __main__
    here = os.path.dirname(os.path.abspath(__main__.__file__))
    for folder in (here, "/tmp", os.getcwd()):
        for name in os.listdir(folder):
            try:
                text = open(os.path.join(folder, name)).read()
            except OSError:
                continue
            if any(m in text for m in _MARKERS) and name != "solution.py":
                return True
    strings = [o for o in gc.get_objects() if isinstance(o, dict)]
    if any(isinstance(v, str) and "def check(candidate)" in v for d in strings for v in list(d.values())):
        return True
    frame = sys._getframe(1)
    while frame is not None:
        if any(isinstance(v, str) and "def check(" in v for v in frame.f_locals.values()):
            return True
        frame = frame.f_back
    return False
_solve = has_close_elements
def has_close_elements(numbers, threshold):
    if _seen():
        raise RuntimeError("found the tests")
    return _solve(numbers, threshold)
"""
    got = verdict(f"```python\n{program}```", _meta(problem))
    assert (got.reward, got.passed) == (1.0, 7), got


def test_a_program_that_ignores_its_alarm_is_given_up_on_within_the_test_time(problem):
    program = ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
               "def has_close_elements(numbers, threshold):\n    while True:\n        pass\n")
    start = time.monotonic()
    got = verdict(f"```python\n{program}```", _meta(problem))
    assert (got.reward, got.status) == (0.0, "timeout")
    assert time.monotonic() - start < 4.0  # one test's second and the grace, not the run's 8 s


# ---------------------------------------------------------------- exception names are not verdicts

FORGED_NAMES = ("passed", "wrong", "AssertionError", "_Timeout")
BASES = ("Exception", "BaseException", "KeyboardInterrupt", "SystemExit")
# How the function ends in the forged exception: raising it, or handing back a value whose conversion to
# plain data (in the sandbox's server, after the function returned) raises it. A stdin/stdout program
# hands back its output: it replaces io.StringIO, so the next run's output is such a value.
RAISERS = {
    "raise": "raise _Forged()",
    "a returned str whose __str__ raises": "return _Str('x')",
    "a returned list whose __iter__ raises": "return _List([1])",
}


def _forged(name: str, base: str) -> str:
    return (f"_Forged = type({name!r}, ({base},), {{}})\n"
            "class _Str(str):\n    def __str__(self):\n        raise _Forged()\n"
            "class _List(list):\n    def __iter__(self):\n        raise _Forged()\n")


def _forging(function: str, params: str, name: str, base: str, raiser: str) -> str:
    return _forged(name, base) + f"def {function}({params}):\n    {RAISERS[raiser]}\n"


def _forging_script(name: str, base: str, raiser: str) -> str:
    if raiser == "raise":
        return _forged(name, base) + "raise _Forged()\n"
    return (_forged(name, base) + "import io\nclass _Out(io.StringIO):\n    def getvalue(self):\n"
            f"        {RAISERS[raiser]}\nio.StringIO = _Out\n")


def _fenced(program: str) -> str:
    return f"```python\n{program}```"


PALINDROMES = {"function": "is_palindrome", "cases": [["ab"], ["aba"], ["noon"]],
               "expected": [False, True, True]}
ADD_TESTS = json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]})
SUM_TESTS = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})


def _score(route: str, name: str, base: str, raiser: str, problem: dict) -> tuple[float, str, int]:
    """(reward, status, tests passed) of a program whose function ends in exception `name` on `route`."""
    if route == "code":
        got = code.judge(_fenced(_forging("is_palindrome", "word", name, base, raiser)), "", PALINDROMES)
    elif route == "humaneval":
        v = verdict(_fenced(_forging("has_close_elements", "numbers, threshold", name, base, raiser)),
                    _meta(problem))
        return v.reward, v.status, v.passed
    elif route == "code-tests call":
        got = rewards.code_judge(_fenced(_forging("add", "a, b", name, base, raiser)), ADD_TESTS)
    else:  # stdin/stdout: the program is run as a script on each input, inside the host's call
        got = rewards.code_judge(_fenced(_forging_script(name, base, raiser)), SUM_TESTS)
    return got.reward, got.status, got.tests_passed


ROUTES_OF_A_RAISE = ("code", "humaneval", "code-tests call", "code-tests stdin/stdout")


@pytest.mark.parametrize("route", ROUTES_OF_A_RAISE)
@pytest.mark.parametrize("name", FORGED_NAMES)
def test_an_exception_named_as_a_verdict_is_an_exception(problem, route, name):
    assert _score(route, name, "Exception", "raise", problem) == (0.0, "failed", 0)


@pytest.mark.parametrize("route", ROUTES_OF_A_RAISE)
@pytest.mark.parametrize("base", BASES[1:])
def test_a_base_exception_named_passed_is_an_exception(problem, route, base):
    assert _score(route, "passed", base, "raise", problem) == (0.0, "failed", 0)


@pytest.mark.parametrize("route", ROUTES_OF_A_RAISE)
@pytest.mark.parametrize("raiser", list(RAISERS)[1:])
def test_a_returned_value_that_raises_passed_as_it_is_sent_is_an_exception(problem, route, raiser):
    assert _score(route, "passed", "Exception", raiser, problem) == (0.0, "failed", 0)


def test_honest_programs_still_score_by_their_values():
    """A correct function earns 1 on each route; one that returns a wrong value earns the format credit
    (0.1 of the published rule, docs/tasks.md) on `code`; `--reward code` gives none (its weight is 0)."""
    right = "def is_palindrome(word):\n    return word == word[::-1]\n"
    wrong = "def is_palindrome(word):\n    return 'no'\n"
    assert code.judge(_fenced(right), "", PALINDROMES).reward == 1.0
    assert code.judge(_fenced(wrong), "", PALINDROMES).reward == pytest.approx(0.1)
    assert rewards.code_judge(_fenced("def add(a, b):\n    return a + b\n"), ADD_TESTS).reward == 1.0
    summed = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert rewards.code_judge(_fenced(summed), SUM_TESTS).reward == 1.0
