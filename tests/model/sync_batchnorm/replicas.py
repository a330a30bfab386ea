"""Run DataParallel-style replicas in threads on CPU: the replica protocol without GPUs.

Replicas are made with copy.deepcopy (so each owns its parameters, whose gradients are summed to
compare with a single module), wired with execute_replication_callbacks and run in threads like
torch's parallel_apply, with the same failure guard as DataParallelWithCallback.
"""
from __future__ import annotations

import copy
import threading
from typing import Sequence

import torch
from torch import nn

from model.sync_batchnorm.replicate import abort_synchronization, execute_replication_callbacks


def make_replicas(module: nn.Module, count: int) -> list[nn.Module]:
    return [copy.deepcopy(module) for _ in range(count)]


def run_replicas(replicas: Sequence[nn.Module], inputs: Sequence, *, join_timeout: float = 60.0, call=None,
                 guard: bool = True) -> list:
    """One DataParallel-style step: callbacks, then every replica on its input in its own thread.

    Raises the first replica's exception (in replica order) like parallel_apply; raises
    AssertionError if a thread is still running after `join_timeout` seconds (a hang). `guard=False`
    leaves out DataParallelWithCallback's abort-on-failure, to test what the layers do by themselves.
    """
    replicas = list(replicas)
    execute_replication_callbacks(replicas)
    results: list = [None] * len(inputs)
    grad_enabled = torch.is_grad_enabled()

    def worker(index: int) -> None:
        torch.set_grad_enabled(grad_enabled)
        replica = replicas[index]
        try:
            arguments = inputs[index] if isinstance(inputs[index], tuple) else (inputs[index],)
            results[index] = call(replica, index, *arguments) if call else replica(*arguments)
        except BaseException as error:  # noqa: BLE001 - re-raised below, like parallel_apply
            if guard:  # the same guard as DataParallelWithCallback.parallel_apply (AbortingReplica)
                abort_synchronization(replicas[0], error)
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
