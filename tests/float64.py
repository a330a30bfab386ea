"""Float64 training for tests that compare different splits of one batch (processes, thread replicas,
micro-batches).

In float32 a different split rounds differently (other kernels, other summation orders), and a ReLU
input within round-off of zero then passes its gradient in one run and blocks it in the other: whole
channels' gradients moved ~2% apart on an AVX2 CPU while they matched on an AVX-512 one. In float64 the
splits agree to ~1e-13, so these comparisons assert ~1e-6 on any CPU, with a negative control each.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import syncseg.engine.build


@contextlib.contextmanager
def trainers_in_float64() -> Iterator[None]:
    """Trainers built inside convert their model to float64 before DDP / DataParallel wraps it (the model
    casts its float32 inputs; the loss stays float64)."""
    wrap = syncseg.engine.build.wrap_for_training
    syncseg.engine.build.wrap_for_training = lambda model, dist_info: wrap(model.double(), dist_info)
    try:
        yield
    finally:
        syncseg.engine.build.wrap_for_training = wrap
