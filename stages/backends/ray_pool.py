"""Data-parallel work on Ray: one actor per worker, each a process that loads the model once; shards
of a list go to idle workers and a dead worker's shard is redone by a replacement, so every shard's
result is taken exactly once. A shard's work is a worker method or a stage's function, so the pool
imports no stage. docs/ray-workers.md gives the design.

Ray is kept to Sparrow's conventions in the driver: `ray.init` installs its own SIGTERM handler
(sys.exit), so the handlers in place before it are put back after it (SIGTERM then stops a run as it
does without workers); Ray's start-up log lines below ERROR are not shown; the messages Ray's driver
prints about its workers (a `(raylet)` line when one dies) go to stderr, not to stdout, which carries
data; and the pool says itself, in one line each, when it starts, when workers would have nothing to do,
and when a worker died and its shard is redone. An exception raised inside a worker comes out as that
exception (its type and sentence), not as Ray's wrapper with the worker's traceback.

A worker is gone, and its shard redone by a replacement, whatever Ray says took it: the process died
(RayActorError), Ray's memory monitor killed it (OutOfMemoryError), it crashed (WorkerCrashedError) or its
node died (NodeDiedError). Every other failure of Ray's, and a shard that took `max_attempts` workers with
it, is a `WorkersFailed`: one sentence, never Ray's report. A cluster given by address (--ray-address, or
Ray's RAY_ADDRESS) is checked before `ray.init`, which would otherwise retry an address where nothing
listens for ever: `auto` must find a cluster and a host:port (or ray://host:port) must answer as a gRPC
server does (a cluster's GCS and Ray Client's server both are one: HTTP/2's client preface is answered
with a SETTINGS frame) within `PROBE_SECONDS`; otherwise `RayUnreachable` says so in one sentence."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa

OBJECT_STORE_MB = 500
HANDLERS_KEPT = (signal.SIGINT, signal.SIGTERM)
PROBE_SECONDS = 10.0  # how long a cluster's address may take to answer a TCP connection and HTTP/2
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5)  # + an empty SETTINGS
SETTINGS_FRAME = 4  # the type byte of an HTTP/2 frame header (length 3 bytes, type, flags, stream 4 bytes)


def say(line: str) -> None:
    """One line of the pool's on stderr (stdout carries the command's data)."""
    print(line, file=sys.stderr, flush=True)


class RayMissing(RuntimeError):
    pass


class WorkersFailed(RuntimeError):
    """The pool could not do its work (workers that keep dying, an error of Ray's): one sentence."""


class RayUnreachable(WorkersFailed):
    """No Ray cluster where the address says, or one that Ray could not connect to."""


def require_ray():
    try:
        import ray
    except ImportError:
        raise RayMissing("--workers needs Ray, which is not installed: install it with "
                         "`pip install -e '.[ray]'` in the checkout (or `pip install ray`)") from None
    return ray


@dataclass(frozen=True)
class ClusterAddress:
    """Where `ray.init` connects: `value` None (or Ray's `local`) starts a local Ray; `named` is how the
    user gave it, for messages."""
    value: str | None
    named: str

    @property
    def local(self) -> bool:
        return self.value in (None, "local")

    @property
    def instead(self) -> str:
        """What to do without a cluster."""
        leave_out = "unset RAY_ADDRESS" if self.named.startswith("RAY_ADDRESS") else "leave out --ray-address"
        return f"start one with `ray start --head`, or {leave_out} for a local one"


def cluster_address(address: str | None) -> ClusterAddress:
    """--ray-address as Ray reads it: RAY_ADDRESS, when set, stands for a missing or `auto` address."""
    env = os.environ.get("RAY_ADDRESS")
    if env and address in (None, "auto"):
        return ClusterAddress(env, f"RAY_ADDRESS={env}")
    return ClusterAddress(address, f"--ray-address {address}")


def check_cluster(address: str | None) -> None:
    """A cluster given by address answers: `auto` finds one and its (or a given) host:port answers HTTP/2
    as a gRPC server, within PROBE_SECONDS. A local start, a process already connected to Ray and a Ray
    Client scheme other than ray:// are not checked. Raises RayUnreachable."""
    ray = require_ray()
    target = cluster_address(address)
    if target.local or ray.is_initialized():
        return
    host_port = _host_port(ray, target)
    if host_port is None:
        return
    host, port = host_port
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS) as connection:
            grpc = _tls() or _answers_http2(connection)  # under TLS, HTTP/2 comes after a handshake
    except OSError as e:
        raise RayUnreachable(f"{target.named}: no Ray cluster answered at {host}:{port} ({_refusal(e)}); "
                             f"{target.instead}") from None
    if not grpc:
        raise RayUnreachable(f"{target.named}: what listens at {host}:{port} is not a Ray cluster (it does "
                             f"not answer as a gRPC server); {target.instead}")


def _tls() -> bool:
    """Whether Ray connects over TLS (RAY_USE_TLS, as Ray reads it)."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def _answers_http2(connection: socket.socket) -> bool:
    """Whether the server at the other end answers HTTP/2's client preface with a SETTINGS frame."""
    connection.sendall(HTTP2_PREFACE)
    head = b""
    while len(head) < 9:
        chunk = connection.recv(9 - len(head))
        if not chunk:
            break
        head += chunk
    return len(head) == 9 and head[3] == SETTINGS_FRAME


def _host_port(ray, target: ClusterAddress) -> tuple[str, int] | None:
    """The host and port `target` connects to: `auto` resolved as ray.init resolves it (the cluster of
    the last `ray start` on this machine, else a running one), ray:// stripped; None where that cannot be
    told (another scheme, a Ray without its resolver)."""
    value = target.value
    if value == "auto":
        services = getattr(getattr(ray, "_private", None), "services", None)
        resolve = getattr(services, "canonicalize_bootstrap_address", None)
        if resolve is None:
            return None
        try:
            value = resolve("auto")
        except ConnectionError:
            raise RayUnreachable(f"{target.named}: no running Ray cluster was found on this machine; "
                                 f"{target.instead}") from None
    if "://" in value:
        scheme, _, rest = value.partition("://")
        if scheme != "ray":
            return None
        value = rest.split("/")[0]
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise RayUnreachable(f"{target.named}: expected auto, local (a new Ray here), HOST:PORT (a "
                             f"cluster's GCS) or ray://HOST:PORT (Ray Client), got {target.value!r}")
    return host.strip("[]"), int(port)


def _refusal(error: OSError) -> str:
    if isinstance(error, TimeoutError):
        return f"no answer within {PROBE_SECONDS:.0f} s"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, socket.gaierror):
        return "unknown host"
    return error.strerror or type(error).__name__


class RolloutWorker:
    """The body of a Ray actor: a model loaded once, rollouts of the shards it is given."""

    def __init__(self, model: str, device: str = "cpu", threads: int = 1, random_weights: bool = False,
                 dtype: str = "auto"):
        import torch

        from ..model.loading import load_model, resolve_dtype

        torch.set_num_threads(threads)
        self.loaded = load_model(model, device=device, random_weights=random_weights,
                                 dtype=resolve_dtype(dtype, device))
        self.engine = None  # the trainer's rollout engine, kept across steps

    def pid(self) -> int:
        return os.getpid()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [list(self.loaded.tokenizer(t, add_special_tokens=False).input_ids) for t in texts]

    def work(self, task: str | Callable, shard: int, items: list, indices: list[int], *args
             ) -> tuple[object, int]:
        """The result of `task` (a method's name, or fn(loaded, items, indices, *args)) on one shard
        (items with their global indices), and this process's pid."""
        if isinstance(task, str):
            return getattr(self, task)(items, indices, *args), os.getpid()
        return task(self.loaded, items, indices, *args), os.getpid()

    def generate(self, prompts: list[list[int]], indices: list[int], params, sparsity, max_batch: int,
                 gpu_memory_utilization: float = 0.9):
        """The trainer's rollout phase: the engine's completions of each prompt. One engine serves every
        step (made again only if the batch size changes or a LoRA is injected)."""
        from ..core.sparsity import as_policy
        from ..engine.engine import Engine, EngineConfig

        self.loaded.model.eval()
        if self.engine is None or self.engine.max_batch != max_batch:
            self._drop_engine()
            self.engine = Engine(self.loaded.model, None, EngineConfig(
                max_batch=max_batch, gpu_memory_utilization=gpu_memory_utilization))
        return self.engine.generate(prompts, params, request_ids=indices, policy=as_policy(sparsity))

    def _drop_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def load_weights(self, state: dict, lora: bool) -> None:
        """Weight sync: the learner's LoRA tensors (peft names) into this worker's injected LoRA, or a
        full state dict."""
        from ..model.adapter import load_lora_state

        if lora:
            load_lora_state(self.loaded.model, state)
        else:
            self.loaded.model.load_state_dict(state)
        if self.engine is not None:
            self.engine.update_weights()

    def add_lora(self, rank: int, alpha: float) -> None:
        from ..model.adapter import add_lora

        self._drop_engine()  # its packed weights and graphs belong to the modules the LoRA wraps
        add_lora(self.loaded.model, rank, alpha)


@dataclass
class ShardResult:
    shard: int
    value: object  # what the worker method returned
    worker_pid: int
    attempts: int

    @property
    def table(self) -> pa.Table:  # rollouts: (table, summary)
        return self.value[0]

    @property
    def summary(self):  # rollouts: (table, summary)
        return self.value[1]


class RolloutPool:
    """N rollout workers on Ray; `map` shards a list over them and returns one result per shard."""

    worker_class = RolloutWorker  # what each actor runs (a subclass may extend it)

    def __init__(self, model: str, workers: int, *, address: str | None = None, device: str = "cpu",
                 threads: int = 1, max_attempts: int = 3, random_weights: bool = False, dtype: str = "auto"):
        if workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        ray = require_ray()
        self._noted_idle = False
        self.started_ray = not ray.is_initialized()
        check_cluster(address)
        say(f"starting {workers} Ray worker{'s' * (workers != 1)} (loading the model in each)")
        _driver_messages_to_stderr(ray)
        if self.started_ray:
            self._init_ray(ray, cluster_address(address), workers * threads)
        gpus = 1 if device == "cuda" else 0
        self._actor_cls = ray.remote(num_cpus=threads, num_gpus=gpus, max_restarts=0)(self.worker_class)
        self._args = (model, device, threads, random_weights, dtype)
        self.max_attempts = max_attempts
        self._pid_refs: dict[int, object] = {}  # id(worker) -> its pid() call, to name a dead worker
        self.workers = [self._new_worker() for _ in range(workers)]
        self.replaced = 0

    @staticmethod
    def _init_ray(ray, target: ClusterAddress, cpus: int) -> None:
        """ray.init: a local Ray of `cpus` CPUs and a small object store, or the cluster at `target`; a
        failure to start or to connect in one sentence. The local one is asked for as `local`: ray.init
        without an address would join the cluster of the last `ray start` on this machine instead."""
        local = dict(address="local", num_cpus=cpus, include_dashboard=False,
                     object_store_memory=OBJECT_STORE_MB * 2**20)
        try:
            init_keeping_handlers(ray.init, log_to_driver=False, logging_level=logging.ERROR,
                                  **(local if target.local else {"address": target.value}))
        except Exception as e:  # a refused connection, a version mismatch (RuntimeError), Ray's own errors
            if target.local:
                raise WorkersFailed(f"a local Ray could not start: {_last_line(e)}") from None
            if str(e).startswith("Version mismatch"):
                raise RayUnreachable(f"{target.named}: this process's Ray or Python differs from the "
                                     f"cluster's ({_one_line(e)}); run with the cluster's versions") from None
            raise RayUnreachable(f"{target.named}: Ray could not connect to the cluster ({_last_line(e)}); "
                                 f"{target.instead}") from None

    def _new_worker(self):
        """A worker in the pool's current state: the LoRA injected and the last weights pushed (calls
        on an actor run in order, so its first task sees them)."""
        worker = self._actor_cls.remote(*self._args)
        self._pid_refs[id(worker)] = worker.pid.remote()
        if getattr(self, "_lora", None):
            worker.add_lora.remote(*self._lora)
        if getattr(self, "_weights", None):
            worker.load_weights.remote(*self._weights)
        return worker

    def pids(self) -> list[int]:
        ray = require_ray()
        with ray_errors(ray, "the workers said their pids"):
            return ray.get([w.pid.remote() for w in self.workers])

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        ray = require_ray()
        with ray_errors(ray, "a worker tokenized the prompts"):
            return ray.get(self.workers[0].tokenize.remote(texts))

    def map(self, task: str | Callable, items: Sequence, *args,
            on_shard: Callable[[ShardResult], None] | None = None) -> list[ShardResult]:
        """`task` (see `RolloutWorker.work`) over contiguous shards of `items`, one per worker but never
        an empty one (`plan_shards`), in shard order. An exception the task raises comes out as itself."""
        ray = require_ray()
        shards = plan_shards(len(items), len(self.workers))
        n = len(shards)
        if n < len(self.workers) and not self._noted_idle:
            say(idle_note(len(items), len(self.workers)))
            self._noted_idle = True
        pending, idle = deque(range(n)), list(self.workers)
        running: dict = {}
        attempts = [0] * n
        results: dict[int, ShardResult] = {}
        with ray_errors(ray, "the workers ran their shards"):
            while pending or running:
                while pending and idle:
                    k, worker = pending.popleft(), idle.pop(0)
                    attempts[k] += 1
                    fut = worker.work.remote(task, k, list(items[shards[k]]),
                                             list(range(len(items)))[shards[k]], *args)
                    running[fut] = (k, worker)
                done, _ = ray.wait(list(running), num_returns=1)
                k, worker = running.pop(done[0])
                try:  # an error the task itself raised (the same on any worker) is ray_errors' to report
                    value, pid = ray.get(done[0])
                except worker_gone(ray) as e:
                    pending.append(k)  # redone by another worker
                    idle.append(self._replace(worker, e, k, n, attempts[k]))
                    continue
                results[k] = ShardResult(k, value, pid, attempts[k])
                idle.append(worker)
                if on_shard is not None:
                    on_shard(results[k])
        return [results[k] for k in range(n)]

    def _replace(self, worker, error: Exception, k: int, n: int, attempt: int):
        """A new worker in the place of one that Ray says is gone with shard k's `attempt`-th try, and
        the warning that says so; WorkersFailed where a new one would fare no better (the worker could not
        start) or the shard has taken `max_attempts` workers."""
        ray = require_ray()
        if getattr(error, "actor_init_failed", False):  # its model load failed: so would a new one's
            raise WorkersFailed(f"a Ray worker could not start: {_last_line(error)}")
        cause = loss_cause(ray, error)
        if attempt >= self.max_attempts:
            last = (cause or "{its} process died").format(it="the last one", its="the last one's")
            raise WorkersFailed(f"shard {k} of {n} failed on {attempt} Ray workers; giving up ({last})")
        dead = self._dead_pid(worker)
        try:
            ray.kill(worker)  # in case Ray lost only its task: it is not given another
        except ray.exceptions.RayError:
            pass
        self.workers[self.workers.index(worker)] = replacement = self._new_worker()
        self.replaced += 1
        why = f" ({cause.format(it='it', its='its')})" if cause else ""
        say(f"warning: Ray worker {dead} died during shard {k} of {n}{why}; shard {k} is redone on a new "
            f"worker (attempt {attempt + 1} of {self.max_attempts})")
        return replacement

    def _dead_pid(self, worker) -> str:
        """The pid of a worker that died, for the warning ("pid unknown" if it died before saying it)."""
        try:
            return f"pid {require_ray().get(self._pid_refs.pop(id(worker)), timeout=5)}"
        except Exception:  # noqa: BLE001 - only a name for a message
            return "(pid unknown)"

    def push_weights(self, state: dict, lora: bool) -> float:
        """Weight sync: every worker loads `state` (LoRA tensors, or a full state dict) from one copy
        in the object store; returns the seconds until all have it. Replacement workers started later
        get the last state pushed."""
        ray = require_ray()
        t0 = time.perf_counter()
        with ray_errors(ray, "the workers loaded the learner's weights"):
            self._weights = (ray.put(state), lora)
            ray.get([w.load_weights.remote(*self._weights) for w in self.workers])
        return time.perf_counter() - t0

    def add_lora(self, rank: int, alpha: float) -> None:
        ray = require_ray()
        self._lora = (rank, alpha)
        with ray_errors(ray, "the workers added the LoRA"):
            ray.get([w.add_lora.remote(rank, alpha) for w in self.workers])

    def close(self) -> None:
        """Stop the workers, and the local Ray this pool started. Called on the way out of a failed run too,
        where a Ray that is already gone must not replace the run's own error with its traceback."""
        ray = require_ray()
        for w in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(w)
        self.workers, self._pid_refs = [], {}
        if self.started_ray:
            with contextlib.suppress(Exception):
                ray.shutdown()


def plan_shards(total: int, workers: int) -> list[slice]:
    """Contiguous shares of `total` items for `workers` workers, the first ones one larger (as
    `World.shard` splits): one per worker, but no empty one (a worker with nothing to do stays idle),
    and a single empty one when there are no items, so the task still returns its empty result."""
    n = max(1, min(workers, total))
    base, extra = divmod(total, n)
    starts = [k * base + min(k, extra) for k in range(n + 1)]
    return [slice(starts[k], starts[k + 1]) for k in range(n)]


def idle_note(items: int, workers: int) -> str:
    n = len(plan_shards(items, workers))
    idle = workers - n
    return (f"note: {workers} Ray workers for {items} work item{'s' * (items != 1)}, so the work goes in "
            f"{n} shard{'s' * (n != 1)} and {idle} worker{'s' * (idle != 1)} would have nothing to do")


def worker_exception(error: Exception) -> Exception:
    """What a task raised inside its worker (Ray's RayTaskError carries it as `cause`), so the command
    reports it as it does without workers; Ray's own error, in one line, when the cause cannot be had."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, Exception):
        return cause
    return WorkersFailed(f"a Ray worker failed: {_last_line(error)}")


def worker_gone(ray) -> tuple[type[Exception], ...]:
    """The errors by which Ray says a worker is gone with the task it ran (not that the task failed)."""
    named = ("RayActorError", "OutOfMemoryError", "WorkerCrashedError", "NodeDiedError")  # the last three
    return tuple(kind for name in named if (kind := getattr(ray.exceptions, name, None)))  # not in every Ray


def loss_cause(ray, error: Exception) -> str | None:
    """Why a worker is gone, in words with {it}/{its} for the worker; None for a process that died with no
    reason given."""
    def raised(name: str) -> bool:
        kind = getattr(ray.exceptions, name, None)
        return kind is not None and isinstance(error, kind)

    if raised("OutOfMemoryError") or "OUT_OF_MEMORY" in str(error):  # an actor's death says it so
        return "Ray's memory monitor killed {it}: the node ran low on memory"
    if raised("NodeDiedError") or getattr(error, "preempted", False):
        return "{its} node died"
    if raised("WorkerCrashedError"):
        return "{its} process crashed"
    return None


@contextmanager
def ray_errors(ray, during: str) -> Iterator[None]:
    """Ray's errors out of the pool as a command reports errors: what a task raised as itself, any other
    of Ray's in one sentence (Ray's own text is a report of many lines)."""
    try:
        yield
    except ray.exceptions.RayTaskError as e:
        raise worker_exception(e) from None
    except ray.exceptions.RayError as e:
        raise WorkersFailed(f"Ray failed while {during}: {type(e).__name__}: {_last_line(e)}") from None


def _one_line(error: Exception) -> str:
    """Ray's whole error text on one line: a version mismatch says both sides' versions over several."""
    return " ".join(str(error).split())


def _last_line(error: Exception) -> str:
    """The last line of Ray's error text (where a traceback ends in the exception's own sentence)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def init_keeping_handlers(init: Callable[..., object], **kwargs) -> None:
    """`init(**kwargs)` (ray.init) with this process's SIGINT and SIGTERM handlers put back after it:
    ray.init sets SIGTERM to sys.exit, which would go around the CLI's handler (checkpoint, `terminated`,
    exit 143). A SIGTERM that comes during the init is handed to the handler that was in place."""
    main = threading.current_thread() is threading.main_thread()
    kept = {s: signal.getsignal(s) for s in HANDLERS_KEPT} if main else {}
    try:
        init(**kwargs)
    except SystemExit as e:
        if e.code != signal.SIGTERM or not callable(kept.get(signal.SIGTERM)):
            raise
        _restore(kept)
        kept[signal.SIGTERM](signal.SIGTERM, None)  # the CLI's raises its interrupt here
        raise KeyboardInterrupt from None  # one that defers still stops: the init did not finish
    finally:
        _restore(kept)


def _restore(handlers: dict) -> None:
    for signum, handler in handlers.items():
        if handler is not None:  # None: set outside Python, which cannot be put back from here
            signal.signal(signum, handler)


def _driver_messages_to_stderr(ray) -> None:
    """Ray's driver prints the messages its cluster publishes about workers (a worker that died, one
    that could not start) on stdout, whatever `log_to_driver` says, and has no setting for it: the
    printer it calls is wrapped so that they go to stderr. Ray without that printer is left as it is."""
    module = getattr(getattr(ray, "_private", None), "worker", None)
    printer = getattr(module, "print_to_stdstream", None)
    if printer is None or getattr(printer, "to_stderr", False):
        return

    def to_stderr(data: dict, *args, **kwargs):
        return printer({**data, "is_err": True}, *args, **kwargs)

    to_stderr.to_stderr = True
    module.print_to_stdstream = to_stderr
