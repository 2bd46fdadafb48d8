"""Data parallelism for `sparrow train` under `torchrun --nproc-per-node N`; without torchrun nothing is
initialised (docs/training.md, design notes)."""

from __future__ import annotations

import os
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


def init_world(device: str = "cpu") -> World:
    """Join the torchrun job described by the environment (nothing to do without one)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return current_world()
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return current_world()


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
