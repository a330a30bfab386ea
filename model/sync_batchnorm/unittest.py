"""Test support, as in the original package (`from sync_batchnorm.unittest import TorchTestCase`), plus thread
replicas on CPU: the DataParallel replica protocol without GPUs, to test a model's synchronized layers.

Importing this module imports the standard library's unittest (absolute imports: this file's name does not
shadow it, unless the folder holding it is itself on sys.path, e.g. as the current directory).
"""
from __future__ import annotations

import copy
import threading
import unittest
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .replicate import AbortingReplica, execute_replication_callbacks

__all__ = ["TorchTestCase", "make_replicas", "run_replicas"]


class TorchTestCase(unittest.TestCase):
    """unittest.TestCase with `assertTensorClose` (torch.allclose, by default atol 1e-5 and rtol 1e-3)."""

    def assertTensorClose(self, actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5,  # noqa: N802
                          rtol: float = 1e-3) -> None:
        absolute = float((actual - expected).abs().max()) if actual.numel() else 0.0
        nonzero = expected != 0
        relative = float(((actual - expected)[nonzero] / expected[nonzero]).abs().max()) if nonzero.any() else "n/a"
        self.assertTrue(torch.allclose(actual, expected, atol=atol, rtol=rtol),
                        f"tensors differ: max absolute difference {absolute}, max relative difference {relative} "
                        f"(atol {atol}, rtol {rtol})")


def make_replicas(module: nn.Module, count: int) -> list[nn.Module]:
    """`count` deep copies of `module`, each with its own parameters (sum their gradients to compare with
    one module trained on the whole batch)."""
    return [copy.deepcopy(module) for _ in range(count)]


def run_replicas(replicas: Sequence[nn.Module], inputs: Sequence, *, join_timeout: float = 60.0,
                 call: Callable[..., Any] | None = None, guard: bool = True) -> list:
    """One DataParallel-style step on CPU: the replication callbacks, then replica i on inputs[i] (a tensor
    or a tuple of arguments) in its own thread, like torch's parallel_apply.

    `guard` (default): DataParallelWithCallback's guard (AbortingReplica): a failing replica aborts the
    others' waits, and a forward that ends while others wait at an exchange it never made raises
    SyncDivergenceError; False runs the bare replicas, to test what the layers do by themselves.
    `call(replica, index, *arguments)` replaces `replica(*arguments)`. Raises the first replica's exception
    (in replica order) like parallel_apply, and AssertionError if a thread still runs after `join_timeout`
    seconds (a hang).
    """
    replicas = list(replicas)
    ledger = execute_replication_callbacks(replicas)
    results: list = [None] * len(inputs)
    grad_enabled = torch.is_grad_enabled()

    def forward(index: int, *arguments: Any) -> Any:
        return call(replicas[index], index, *arguments) if call else replicas[index](*arguments)

    def worker(index: int) -> None:
        torch.set_grad_enabled(grad_enabled)
        arguments = inputs[index] if isinstance(inputs[index], tuple) else (inputs[index],)
        try:
            if guard:
                guarded = AbortingReplica(lambda *a: forward(index, *a), replicas[0], copy_id=index, ledger=ledger)
                results[index] = guarded(*arguments)
            else:
                results[index] = forward(index, *arguments)
        except BaseException as error:  # noqa: BLE001 - re-raised below, like parallel_apply
            results[index] = error

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_timeout)
    hung = [i for i, thread in enumerate(threads) if thread.is_alive()]
    assert not hung, f"replicas {hung} still running after {join_timeout} s"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
