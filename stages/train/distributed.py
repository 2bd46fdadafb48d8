"""Data parallelism for `sparrow train` under `torchrun --nproc-per-node N`; without torchrun nothing is
initialised (docs/training.md, design notes).

Joining the job waits for every rank. torch's own rendezvous waits 30 minutes (gloo) inside a C++ call
that no signal reaches, so `init_world` runs it in a thread and waits in Python: Ctrl-C and SIGTERM stop
the wait, a rank that waits more than a few seconds says so on stderr, and the wait is bounded by
SPARROW_RENDEZVOUS_TIMEOUT seconds (600 by default, torchrun's own rendezvous join timeout). The bound is
the join's only: the process group keeps torch's default timeout for its collectives, which wait while
rank 0 alone writes and evaluates."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class World:
    """This process's place in the job; World() is the single process."""

    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def shard(self, n: int, rank: int | None = None) -> slice:
        """Rank `rank`'s contiguous share of n items; the first n % size ranks get one more."""
        r = self.rank if rank is None else rank
        base, extra = divmod(n, self.size)
        start = r * base + min(r, extra)
        return slice(start, start + base + (1 if r < extra else 0))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (pickled; for small things: completions, logprob rows)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each key summed over the ranks (the loss statistics are shares of global aggregates)."""
        if not self.distributed or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def current_world() -> World:
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


TIMEOUT_VAR = "SPARROW_RENDEZVOUS_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
SAY_AFTER_S = 3.0  # a job whose ranks start together joins sooner and prints nothing


def init_world(device: str = "cpu") -> World:
    """Join the torchrun job described by the environment (nothing to do without one); ValueError in one
    sentence when the other ranks do not come within the bound (module docstring)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return current_world()
    if not dist.is_initialized():
        timeout = rendezvous_timeout()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device == "cuda":
            torch.cuda.set_device(local)
        backend = "nccl" if device == "cuda" else "gloo"

        def join() -> None:  # in the waiting thread, whose current CUDA device is its own setting
            if device == "cuda":
                torch.cuda.set_device(local)
            dist.init_process_group(backend)

        wait_for_ranks(join, Rendezvous.from_env(size), timeout)
    return current_world()


def rendezvous_timeout() -> float:
    """The join's bound in seconds, from SPARROW_RENDEZVOUS_TIMEOUT."""
    raw = os.environ.get(TIMEOUT_VAR, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{TIMEOUT_VAR}={raw!r}: expected the seconds to wait for the other ranks, a "
                         "positive number")
    return seconds


@dataclass(frozen=True)
class Rendezvous:
    """Where this rank meets the others (torchrun's env:// variables), for the messages."""

    rank: int
    size: int
    address: str  # MASTER_ADDR:MASTER_PORT

    @classmethod
    def from_env(cls, size: int) -> Rendezvous:
        return cls(int(os.environ.get("RANK", "0")), size,
                   f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}")

    def waiting(self, timeout: float) -> str:
        return (f"rank {self.rank}: waiting for {self.size} ranks at {self.address} (up to {timeout:g} s; "
                f"{TIMEOUT_VAR} sets it)")

    def missing(self, timeout: float) -> str:
        where = ("" if self.rank == 0 or _listening(self.address)
                 else f", and nothing listens at {self.address} (rank 0 has not started there)")
        return (f"rank {self.rank} waited {timeout:g} s at {self.address}, but not all of the {self.size} "
                f"ranks (WORLD_SIZE) joined{where}; start the missing ranks with the same MASTER_ADDR and "
                f"MASTER_PORT, or set WORLD_SIZE (torchrun --nnodes) to the ranks you start")


def wait_for_ranks(join: Callable[[], object], rendezvous: Rendezvous, timeout: float,
                   say_after: float = SAY_AFTER_S, say: Callable[[str], None] | None = None) -> None:
    """`join()` (the C++ rendezvous) in a daemon thread while this thread waits, where Python handles
    signals: KeyboardInterrupt (SIGINT, or SIGTERM as the CLI maps it) ends the wait, and so does
    `timeout` seconds, as ValueError. The join's own errors come out in one sentence."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    failed: list[BaseException] = []

    def run() -> None:
        try:
            join()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            failed.append(e)

    thread = threading.Thread(target=run, name="sparrow-rendezvous", daemon=True)
    start = time.monotonic()
    thread.start()
    said = False
    while thread.is_alive():
        waited = time.monotonic() - start
        if waited >= timeout:  # the thread stays blocked in C++; the process ends with this error
            raise ValueError(rendezvous.missing(timeout))
        if not said and waited >= say_after:
            say(rendezvous.waiting(timeout))
            said = True
        thread.join(min(0.2, timeout - waited))
    if failed:
        e = failed[0]
        if isinstance(e, dist.DistError) and any(w in str(e).lower() for w in ("timed out", "timeout")):
            raise ValueError(rendezvous.missing(timeout)) from None
        if isinstance(e, RuntimeError):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"rank {rendezvous.rank} could not join the torchrun job at "
                             f"{rendezvous.address}: {first}") from None
        raise e


def _listening(address: str) -> bool:
    """Whether something accepts TCP connections at host:port (rank 0's store, or torchrun's agent)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def shutdown_world() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _sum_hook(state, bucket):  # no annotations: DDP checks them against the real classes
    """DDP comm hook: the sum of the ranks' gradients (DDP's default divides it by the world size)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class PolicyLogprobs(nn.Module):
    """The policy's teacher-forced logprobs of completions as a module, so DDP can wrap its forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, prompts, completions, temperature: float) -> torch.Tensor:
        from .policy import completion_logprobs

        return completion_logprobs(self.model, prompts, completions, temperature, entropy=False).logp


def data_parallel(model: nn.Module, world: World) -> nn.Module:
    """`PolicyLogprobs(model)`, wrapped in DDP (gradients summed over ranks) when distributed."""
    module = PolicyLogprobs(model)
    if not world.distributed:
        return module
    device = next(model.parameters()).device
    ddp = nn.parallel.DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None,
        forward_sync_buffers=False)  # buffers (rotary tables) are equal on every rank
    ddp.register_comm_hook(None, _sum_hook)
    return ddp
