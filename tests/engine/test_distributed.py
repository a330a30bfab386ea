"""Device selection: --gpus parsing and errors, CPU fallback, torchrun environment handling."""
from __future__ import annotations

import datetime
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from syncseg.engine import distributed
from syncseg.engine.devices import inference_device, parse_gpus
from syncseg.engine.distributed import DistInfo, Launch, assign_sync_groups, setup_distributed, wrap_for_training
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)


class FakeCuda:
    """torch.cuda's device bookkeeping without a GPU, as strict as torch: `set_device` rejects a device
    without an index (torch's _get_device_index(optional=False): "Expected a torch.device with a specified
    index or an integer") and an index past the count; `current_device` is what was set (0 at start)."""

    def __init__(self, count: int) -> None:
        self.count, self.current, self.set_calls = count, 0, []

    def set_device(self, device) -> None:
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda" or device.index is None:
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
            device = device.index
        if not 0 <= device < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {device}")
        self.set_calls.append(device)
        self.current = device


def _fake_cuda(monkeypatch, count: int) -> FakeCuda:
    fake = FakeCuda(count)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
    return fake


@pytest.mark.parametrize("text,expected", [("0", (0,)), ("0,1,3", (0, 1, 3)), (" 2 , 1 ", (2, 1))])
def test_parse_gpus(text, expected):
    assert parse_gpus(text) == expected


@pytest.mark.parametrize("text,fragment", [("a,b", "'a' is not a GPU id"), ("", "expected"), ("1,1", "twice"),
                                           ("-1", "'-1' is not a GPU id")])
def test_parse_gpus_rejects(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_gpus(text)


def test_no_gpus_without_cuda_is_cpu(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    info = setup_distributed(None)
    assert info == DistInfo() and info.device == torch.device("cpu") and info.mode == "cpu" and info.is_main


def test_explicit_cpu_even_with_cuda(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    assert setup_distributed("cpu").mode == "cpu"


def test_gpus_without_cuda_is_an_error(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    with pytest.raises(ValueError, match="no CUDA device"):
        setup_distributed("0")


def test_missing_gpu_id_is_named(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"GPU id\(s\) 5 do not exist.*2 GPU\(s\)"):
        setup_distributed("0,5")


def test_gpus_select_data_parallel_and_make_the_first_one_current(monkeypatch):
    """--gpus 2,3 sets GPU 2 current at once, before any loader or pin-memory thread starts: otherwise every
    tensor made without a device (and the pin-memory thread) opens a context on GPU 0."""
    fake = _fake_cuda(monkeypatch, 4)
    info = setup_distributed("2,3")
    assert info.mode == "dp" and info.device_ids == (2, 3) and info.device == torch.device("cuda", 2)
    assert info.num_replicas == 2
    assert fake.set_calls == [2] and torch.cuda.current_device() == 2


def test_default_with_cuda_is_gpu0(monkeypatch):
    fake = _fake_cuda(monkeypatch, 1)
    info = setup_distributed(None)
    assert info.mode == "dp" and info.device_ids == (0,) and fake.set_calls == [0]


def test_torchrun_with_gpus_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="cannot be combined with torchrun"):
        setup_distributed("0,1")


def _as_torchrun_rank_1_of_2(monkeypatch) -> tuple[DistInfo, list[dict]]:
    """setup_distributed under torchrun's variables for rank 1 of 2, the process-group call intercepted:
    the DistInfo and the keyword arguments of each init_process_group call."""
    calls: list[dict] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: calls.append(kw))
    return setup_distributed(None, timeout_s=20), calls


def test_torchrun_env_initializes_gloo_on_cpu(monkeypatch):
    """WORLD_SIZE>1 goes the DDP way; the process-group call is intercepted (a real 2-process run is in
    tests/e2e/test_elastic_resume.py)."""
    _fake_cuda(monkeypatch, 0)
    info, calls = _as_torchrun_rank_1_of_2(monkeypatch)
    assert calls == [{"backend": "gloo", "init_method": "env://", "rank": 1, "world_size": 2,
                      "timeout": datetime.timedelta(seconds=20)}]
    assert info.mode == "ddp" and info.rank == 1 and info.world_size == 2 and not info.is_main
    assert info.device == torch.device("cpu") and info.num_replicas == 2 and info.launch.launcher == "torchrun"


def test_torchrun_env_with_cuda_pairs_nccl_with_gloo_for_cpu_tensors(monkeypatch):
    """NCCL carries the model's tensors; the stop agreement (syncseg.engine.signals) all-reduces a CPU tensor, which
    needs a CPU backend in the same group: torch's own default pairing, cpu:gloo,cuda:nccl."""
    fake = _fake_cuda(monkeypatch, 2)
    info, calls = _as_torchrun_rank_1_of_2(monkeypatch)
    assert [call["backend"] for call in calls] == ["cpu:gloo,cuda:nccl"]
    assert calls[0]["device_id"] == torch.device("cuda", 1) and fake.set_calls == [1]
    assert info.device == torch.device("cuda", 1) and info.device_ids == (1,)


def test_slurm_tasks_get_ranks_and_a_rendezvous_address_from_slurm():
    environ = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4",
               "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_NUM_NODES": "2",
               "SLURM_JOB_ID": "123456"}
    launch = distributed.detect_launch(environ)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("slurm", 3, 4, 1)
    assert launch.num_nodes == 2 and launch.local_world_size == 2
    assert launch.init_method == "tcp://gpu07:23456"  # first node; a port of the job's own
    assert distributed.detect_launch({**environ, "MASTER_ADDR": "head", "MASTER_PORT": "29400"}).init_method == \
        "tcp://head:29400"
    # srun without a node list: the hint is for srun (an address to meet at), not a torchrun command line
    bare = {key: value for key, value in environ.items() if key not in ("SLURM_STEP_NODELIST",)}
    with pytest.raises(ValueError, match="set MASTER_ADDR") as raised:
        distributed.detect_launch(bare)
    assert "torchrun" not in str(raised.value) and "srun started 4 tasks" in str(raised.value)
    # a python process in an sbatch script (no srun step) or a one-task step is one process
    assert distributed.detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).launcher == "none"
    assert distributed.detect_launch({**environ, "SLURM_STEP_NUM_TASKS": "1"}).world_size == 1
    # torchrun's variables win (srun torchrun ...)
    assert distributed.detect_launch({**environ, "WORLD_SIZE": "2", "RANK": "0",
                                      "TORCHELASTIC_RUN_ID": "x"}).launcher == "torchrun"


@pytest.mark.parametrize("hostlist,hosts", [("node1", ["node1"]), ("gpu[01-03,7],login2", ["gpu01", "gpu02", "gpu03",
                                                                                           "gpu7", "login2"]),
                                           ("a[8-10]", ["a8", "a9", "a10"])])
def test_expand_hostlist(hostlist, hosts):
    assert distributed.expand_hostlist(hostlist) == hosts


def test_inference_device_parses_and_checks_the_device(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    assert inference_device(None) == torch.device("cpu")
    assert inference_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="--device cuda:1: CUDA is not available"):
        inference_device("cuda:1")
    with pytest.raises(ValueError, match="--device 'gpu0' is not a device"):
        inference_device("gpu0")
    with pytest.raises(ValueError, match="--device 'meta': expected cpu, cuda or cuda:N"):
        inference_device("meta")
    fake = _fake_cuda(monkeypatch, 2)
    # no --device and --device cuda mean the current GPU, with its index (set_device rejects plain "cuda")
    assert inference_device(None) == torch.device("cuda", 0)
    assert inference_device("cuda") == torch.device("cuda", 0)
    assert inference_device("cuda:1") == torch.device("cuda", 1)
    assert fake.set_calls == [0, 0, 1]
    assert inference_device("cuda") == torch.device("cuda", 1)  # now the current one
    with pytest.raises(ValueError, match="--device cuda:2: this machine has 2 CUDA device"):
        inference_device("cuda:2")
    assert inference_device(None, torchrun_device=torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="cannot be combined with torchrun"):
        inference_device("cpu", torchrun_device=torch.device("cpu"))


class Torch211DDP(nn.Module):
    """DistributedDataParallel's constructor as torch 2.11 (the GPU image's) declares it, as far as the
    releases before 2.14 share it: no forward_sync_buffers, no **kwargs, so a keyword it lacks is a
    TypeError as with the real class. Records what it was built with."""

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True, init_sync=True,
                 process_group=None, bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False, delay_all_reduce_named_params=None,
                 param_to_hook_all_reduce=None, mixed_precision=None, device_mesh=None,
                 skip_all_reduce_unused_params=False):
        super().__init__()
        self.module = module
        self.built_with = {"device_ids": device_ids, "broadcast_buffers": broadcast_buffers,
                           "gradient_as_bucket_view": gradient_as_bucket_view}


def test_the_buffer_sync_keyword_follows_the_installed_ddp_signature():
    """torch 2.14 renamed DDP's broadcast_buffers to forward_sync_buffers (warning on the old name); torch
    2.11, on the GPU image, has only broadcast_buffers and raised TypeError on the new one."""

    class Torch214DDP:
        def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                     gradient_as_bucket_view=False, forward_sync_buffers=None):
            pass

    class Unknown:
        def __init__(self, module, device_ids=None):
            pass

    assert distributed.no_buffer_sync_option(Torch211DDP) == {"broadcast_buffers": False}
    assert distributed.no_buffer_sync_option(Torch214DDP) == {"forward_sync_buffers": False}
    with pytest.raises(ValueError, match="neither forward_sync_buffers nor broadcast_buffers"):
        distributed.no_buffer_sync_option(Unknown)


def test_training_builds_its_ddp_with_keywords_torch_2_11_takes(monkeypatch):
    """Only the keyword helper was checked against 2.11's signature, not the call that builds the DDP:
    wrap_for_training builds it through distributed_data_parallel, with torch 2.11's class in place."""
    model = nn.Linear(2, 2)
    built = distributed.distributed_data_parallel(model, device_ids=[3], ddp_class=Torch211DDP)
    assert built.module is model
    assert built.built_with == {"device_ids": [3], "broadcast_buffers": False, "gradient_as_bucket_view": True}
    monkeypatch.setattr(nn.parallel, "DistributedDataParallel", Torch211DDP)  # the call site's own lookup
    wrapped = wrap_for_training(model, DistInfo(mode="ddp"))
    assert isinstance(wrapped, Torch211DDP) and wrapped.built_with == {
        "device_ids": None, "broadcast_buffers": False, "gradient_as_bucket_view": True}


def test_ddp_wrapping_uses_no_deprecated_argument_and_bucket_views(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch 2.14 warns (FutureWarning) on broadcast_buffers=
            wrapped = wrap_for_training(nn.Linear(4, 2), DistInfo(mode="ddp"))
        assert isinstance(wrapped, nn.parallel.DistributedDataParallel)
        assert wrapped.gradient_as_bucket_view
        wrapped(torch.randn(3, 4)).sum().backward()
        grad = wrapped.module.weight.grad
        assert grad is not None and grad.abs().sum() > 0
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# model.syncbn_group_size: synchronized BatchNorm within groups of consecutive ranks.
# --------------------------------------------------------------------------------------------------
def _ddp_info(rank: int, world_size: int) -> DistInfo:
    return DistInfo(rank=rank, world_size=world_size, mode="ddp",
                    launch=Launch(launcher="torchrun", rank=rank, world_size=world_size))


@pytest.mark.parametrize("group_size, world_size", [(3, 4), (2, 1), (8, 4)])
def test_a_sync_group_size_that_does_not_divide_the_world_is_named(group_size, world_size):
    with pytest.raises(ValueError, match=rf"model.syncbn_group_size={group_size} does not divide the world size "
                                         rf"{world_size}"):
        assign_sync_groups(SynchronizedBatchNorm2d(2), _ddp_info(0, world_size), group_size=group_size, timeout_s=5)


@pytest.mark.parametrize("group_size", [0, 4])
def test_group_size_zero_or_the_world_keeps_the_whole_world(group_size):
    layer = SynchronizedBatchNorm2d(2)
    assign_sync_groups(layer, _ddp_info(1, 4), group_size=group_size, timeout_s=5)  # no group made: no collective
    assert layer.process_group is None


def _groups_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = nn.Sequential(nn.Identity(), SynchronizedBatchNorm2d(3).double())
        assign_sync_groups(model, _ddp_info(rank, 4), group_size=2, timeout_s=60)
        x = torch.arange(rank * 2 + 2, dtype=torch.float64).view(-1, 1, 1, 1).expand(-1, 3, 2, 2) * (rank + 1)
        torch.save({"ranks": dist.get_process_group_ranks(model[1].process_group), "x": x, "y": model(x).detach()},
                   f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_four_gloo_ranks_in_groups_of_two_reduce_within_their_group(tmp_path):
    from tests.gloo import free_port, start_ranks

    context = start_ranks(_groups_worker, (free_port(), str(tmp_path)), 4, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("4 gloo ranks did not finish within 120 s")
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(4)]
    assert [r["ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for first in (0, 2):
        group = results[first:first + 2]
        expected = nn.BatchNorm2d(3).double()(torch.cat([r["x"] for r in group]))
        torch.testing.assert_close(torch.cat([r["y"] for r in group]), expected, rtol=1e-10, atol=1e-10)


def test_nccl_leaves_a_hung_peer_to_the_one_line_error(monkeypatch):
    """torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1: NCCL's watchdog then killed the process at the step's
    timed-out all-reduce, queued before the gloo stop agreement with the same dist.timeout_s, so the
    documented 'lost contact' line and exit 1 never came. The variable is read when the NCCL group is made:
    it must say 2 (abort the communicators, keep the process) by then. The process-group call is faked."""
    _fake_cuda(monkeypatch, 2)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # as torchrun's agent sets it
    seen = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda **kw: seen.append((kw["backend"], os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    setup_distributed(None, timeout_s=20)
    assert seen == [("cpu:gloo,cuda:nccl", "2")]


def test_gloo_alone_leaves_the_nccl_variable_alone(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    _as_torchrun_rank_1_of_2(monkeypatch)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
