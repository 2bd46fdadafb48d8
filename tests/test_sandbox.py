"""Hostile programs through the real sandbox (bubblewrap): each scores 0 within its time limit, and after
each the test process is alive, no process of the run is left, and no file appeared outside the sandbox.

Every program is a "solution" of `add(a, b)` scored by the code task's scorer (`run_tests`), with small
limits so that a fork bomb or a memory hog is stopped by its limits long before it could hurt the machine.
Where an attack would succeed without isolation (reading files, the network), a control run without the
sandbox (`SPARROW_BWRAP=none`, unsafe) shows that the program does get the secret there: the test would
catch an escape.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from sparrow.stages.tasks import sandbox as sb
from sparrow.stages.tasks.code import run_tests

LIMITS = sb.Limits(seconds=2.0, cpu_seconds=2, memory_mb=256, processes=6, file_mb=1, open_files=32,
                   output_kb=64, tmp_mb=4)
CASES = [[1, 2], [3, 4]]
EXPECTED = [3, 7]
REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(sb.sandbox_problem(sb.bwrap_binary()) is not None,
                                reason=f"no sandbox here: {sb.sandbox_problem(sb.bwrap_binary())}")


@pytest.fixture
def world(tmp_path):
    """A private, world-readable place on the host (so only the sandbox, not file permissions, keeps a
    program out of it) holding the sandboxes' folders, a fake home with ~/.ssh and a run directory."""
    root = Path(tempfile.mkdtemp(prefix="sparrow-hostile-"))
    os.chmod(root, 0o755)
    runs = root / "sandboxes"
    home, run = root / "home", root / "run"
    for d in (runs, home / ".ssh", run):
        d.mkdir(parents=True)
        os.chmod(d, 0o755)
    secrets = ((home / ".ssh" / "id_ed25519", "ssh-secret-7391"), (run / "metrics.jsonl", "run-secret-4410"))
    for f, text in secrets:
        f.write_text(text)
        os.chmod(f, 0o644)
    yield {"root": root, "runs": runs, "home": home, "run": run}
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _processes_mentioning(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def _children() -> list[int]:
    kids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                kids.append(int(pid))
    return kids


def hostile(world, program: str, limits: sb.Limits = LIMITS, unsafe: bool = False):
    """Score `program` in a fresh sandbox; check the time limit and that nothing is left behind."""
    before = _files(world["root"]), _files(REPO / "tests")
    box = sb.Sandbox(limits, unsafe=unsafe, tmp_root=str(world["runs"]))
    verdict = run_tests(program, "add", CASES, EXPECTED, box)
    assert verdict.outcome.seconds < limits.seconds + 1.5
    assert _processes_mentioning(str(world["runs"])) == [], "a process of the run outlived it"
    assert _children() == []
    assert not list(world["runs"].iterdir()), "the sandbox's folder was left behind"
    assert (_files(world["root"]), _files(REPO / "tests")) == before, "a file appeared outside the sandbox"
    return verdict


def test_a_correct_program_scores_1_and_a_wrong_one_its_fraction(world):
    assert hostile(world, "def add(a, b):\n    return a + b\n").reward == pytest.approx(1.0)
    # 1 + 2 == 3 passes, 3 + 4 != 3 * 4: half the tests, plus the format credit for a clean run
    verdict = hostile(world, "def add(a, b):\n    return a * b if a > 1 else a + b\n")
    assert (verdict.passed, verdict.clean) == (1, True)
    assert verdict.reward == pytest.approx(0.9 * 1 / 2 + 0.1)


def test_fork_bomb(world):
    verdict = hostile(world, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                      "        pass\ndef add(a, b):\n    return a + b\n")
    assert verdict.reward == 0 and verdict.outcome.status == "timeout"


def test_infinite_loop_and_sleep(world):
    for program in ("while True:\n    pass\n", "import time\ntime.sleep(1e9)\n",
                    "def add(a, b):\n    while True:\n        pass\n"):
        verdict = hostile(world, program + "def add(a, b):\n    return a + b\n" * ("def add" not in program))
        assert verdict.reward == 0


def test_64_gb_allocation(world):
    verdict = hostile(world, "x = bytearray(64 << 30)\ndef add(a, b):\n    return a + b\n")
    assert verdict.reward == 0 and b"MemoryError" in verdict.outcome.stderr


def test_printing_1_gb(world):
    verdict = hostile(world, "import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * (1 << 16))\n"
                      "def add(a, b):\n    return a + b\n")
    assert verdict.reward == 0 and verdict.outcome.status == "output_limit"
    assert len(verdict.outcome.stdout) + len(verdict.outcome.stderr) <= LIMITS.output_kb << 10


@pytest.fixture
def server():
    """A TCP server on 127.0.0.1 that sends a secret to whoever connects."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conn.sendall(b"net-secret-5521")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    listener.close()


def _secret_program(expression: str) -> str:
    """`add` returns what the attack got; it raises where the attack fails."""
    return f"def add(a, b):\n    return {expression}\n"


def test_no_network(world, server, monkeypatch):
    program = _secret_program(f"__import__('socket').create_connection(('127.0.0.1', {server}), "
                              "timeout=1).recv(64).decode()")
    secret = ["net-secret-5521"] * 2
    verdict = hostile(world, program)
    assert verdict.reward == 0 and verdict.passed == 0
    monkeypatch.setenv("SPARROW_BWRAP", "none")  # the control: without the sandbox the attack works
    box = sb.Sandbox(LIMITS, unsafe=True, tmp_root=str(world["runs"]))
    assert run_tests(program, "add", CASES, secret, box).passed == 2


@pytest.mark.parametrize("target", ["home", "run"])
def test_no_reading_the_home_or_the_run_directory(world, target, monkeypatch):
    path, secret = ((world["home"] / ".ssh" / "id_ed25519", "ssh-secret-7391") if target == "home" else
                    (world["run"] / "metrics.jsonl", "run-secret-4410"))
    program = _secret_program(f"open({str(path)!r}).read()")
    assert run_tests(program, "add", CASES, [secret] * 2,
                     sb.Sandbox(LIMITS, tmp_root=str(world["runs"]))).passed == 0
    assert hostile(world, program).reward == 0
    listing = _secret_program(f"__import__('os').listdir({str(Path.home())!r})")
    assert hostile(world, listing).reward == 0
    monkeypatch.setenv("SPARROW_BWRAP", "none")
    box = sb.Sandbox(LIMITS, unsafe=True, tmp_root=str(world["runs"]))
    assert run_tests(program, "add", CASES, [secret] * 2, box).passed == 2


def test_no_reading_our_environment(world, monkeypatch):
    monkeypatch.setenv("SPARROW_TEST_SECRET", "env-secret-8812")
    for source in ("/proc/1/environ", f"/proc/{os.getpid()}/environ", "/proc/self/environ"):
        program = _secret_program(f"[v for v in open({source!r}).read().split(chr(0)) "
                                  "if v.startswith('SPARROW_TEST_SECRET=')][0].split('=', 1)[1]")
        box = sb.Sandbox(LIMITS, tmp_root=str(world["runs"]))
        assert run_tests(program, "add", CASES, ["env-secret-8812"] * 2, box).passed == 0
        assert hostile(world, program).reward == 0


def test_no_writing_outside(world):
    name = f"sparrow-escape-{os.getpid()}"
    targets = [Path(tempfile.gettempdir()) / name, REPO / name, world["root"] / name, world["home"] / name]
    attempt = "    try:\n        open({!r}, 'w').write('x')\n    except OSError:\n        pass\n"
    writes = "".join(attempt.format(str(t)) for t in targets)
    verdict = hostile(world, f"def add(a, b):\n{writes}    raise RuntimeError('wrote')\n")
    assert verdict.reward == 0
    assert not any(t.exists() for t in targets)


def test_a_daemon_does_not_outlive_the_program(world):
    program = ("import os, time\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               "    if os.fork() == 0:\n"
               "        time.sleep(60)\n"
               "    os._exit(0)\n"
               "time.sleep(0.3)\n"
               "def add(a, b):\n    raise RuntimeError('not solved')\n")
    verdict = hostile(world, program)
    assert verdict.reward == 0 and verdict.outcome.status == "exited"


def test_killing_the_parent_kills_nothing_outside(world):
    program = ("import os, signal\n"
               "for pid in (os.getppid(), 1, " + str(os.getpid()) + ", " + str(os.getppid()) + "):\n"
               "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
               "def add(a, b):\n    raise RuntimeError('not solved')\n")
    assert hostile(world, program).reward == 0
    assert os.getppid() > 1  # pytest's parent (and we) are alive


def test_refused_without_a_sandbox_unless_unsafe(world, monkeypatch):
    monkeypatch.setenv("SPARROW_BWRAP", "/nonexistent/bwrap")
    with pytest.raises(sb.SandboxUnavailable, match="--unsafe-code-execution"):
        sb.Sandbox(LIMITS)
    box = sb.Sandbox(LIMITS, unsafe=True, tmp_root=str(world["runs"]))
    assert not box.isolated
    assert run_tests("def add(a, b):\n    return a + b\n", "add", CASES, EXPECTED, box).reward == 1.0
    # the limits still hold without the sandbox
    verdict = run_tests("x = bytearray(64 << 30)\ndef add(a, b):\n    return a + b\n", "add", CASES, EXPECTED,
                        box)
    assert verdict.reward == 0 and b"MemoryError" in verdict.outcome.stderr
