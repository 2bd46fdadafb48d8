"""A context in which the host may wait on a CUDA device only through events: torch.cuda.synchronize
raises, and torch's sync debug mode turns every implicit synchronisation (.item(), .tolist() or .cpu()
of a device tensor, a pageable copy) into an error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def no_host_sync(where: str) -> Iterator[None]:
    real_sync = torch.cuda.synchronize

    def forbidden(*a, **k):
        raise AssertionError(f"torch.cuda.synchronize in {where}")

    torch.cuda.synchronize = forbidden
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize = real_sync
