"""train.amp / eval.amp: auto by the device's capability, the probe, autocast for each precision."""
from __future__ import annotations

import pytest
import torch

from syncseg.engine import devices


@pytest.mark.parametrize("amp,dtype", [("off", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_for_each_precision(amp, dtype):
    layer = torch.nn.Linear(4, 4)
    with devices.autocast_for(torch.device("cpu"), amp):
        assert layer(torch.randn(2, 4)).dtype == dtype


CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("device,native,chosen", [
    (CPU, True, "bf16"), (CPU, False, "off"), (CUDA, True, "bf16"), (CUDA, False, "fp16")])
def test_auto_precision_follows_the_capability_probe(monkeypatch, device, native, chosen):
    probed = []
    monkeypatch.setattr(devices, "native_bf16", lambda d: probed.append(d) or native)
    assert devices.resolve_precision("auto", device)[0] == chosen
    assert probed == [device]
    for explicit in ("off", "fp16"):  # an explicit value runs as given
        assert devices.resolve_precision(explicit, device) == (explicit, "as configured")


@pytest.mark.parametrize("device,native,amp,expected", [
    (CPU, True, "auto", True), (CPU, False, "auto", False), (CPU, False, "bf16", True), (CPU, True, "off", False),
    (CUDA, False, "auto", True), (CUDA, True, "off", False)])
def test_auto_channels_last_follows_the_precision_that_runs(monkeypatch, device, native, amp, expected):
    monkeypatch.setattr(devices, "native_bf16", lambda d: native)
    assert devices.resolve_channels_last("auto", amp, device)[0] is expected
    for forced in (True, False):  # a configured layout is kept whatever runs
        assert devices.resolve_channels_last(forced, amp, device) == (forced, "as configured")
        assert devices.resolve_channels_last(forced, amp, device, "resnet50") == (forced, "as configured")


@pytest.mark.parametrize("backbone,expected", [("resnet50", True), ("resnet101", True), ("resnet18", False),
                                               ("resnet34", False), ("mobilenet_v3_large", False)])
def test_fp32_on_a_cpu_takes_channels_last_for_the_bottleneck_resnets_only(monkeypatch, backbone, expected):
    monkeypatch.setattr(devices, "native_bf16", lambda d: False)
    for amp in ("auto", "off", "tf32"):  # each runs as fp32 here
        layout, why = devices.resolve_channels_last("auto", amp, CPU, backbone)
        assert layout is expected and (backbone in why) is expected, (amp, why)
    assert devices.resolve_channels_last("auto", "off", CUDA, backbone)[0] is False  # cuDNN's fp32: unmeasured
    monkeypatch.setattr(devices, "native_bf16", lambda d: True)
    assert devices.resolve_channels_last("auto", "auto", CPU, backbone) == (True, "auto: bf16 kernels want channels-last")


def test_auto_precision_autocasts_by_capability_and_explicit_bf16_is_warned_when_emulated(monkeypatch, caplog):
    layer = torch.nn.Linear(4, 4)
    monkeypatch.setattr(devices, "native_bf16", lambda device: False)
    with devices.autocast_for(CPU, "auto"):
        assert layer(torch.randn(2, 4)).dtype == torch.float32
    with caplog.at_level("INFO", logger="syncseg.engine.devices"):
        assert devices.log_precision("train.amp", "auto", CPU) == "off"
        assert devices.log_precision("train.amp", "bf16", CPU) == "bf16"  # still runs, with a warning
    warnings_logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings_logged) == 1 and "emulated" in warnings_logged[0] and "14x slower" in warnings_logged[0]
    assert "train.amp=auto: fp32 (auto: cpu has no native bf16" in caplog.text
    monkeypatch.setattr(devices, "native_bf16", lambda device: True)
    with devices.autocast_for(CPU, "auto"):
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16


def test_the_cpu_probe_reads_the_flags_and_the_override(monkeypatch):
    monkeypatch.delenv(devices.NATIVE_BF16_VARIABLE, raising=False)
    monkeypatch.setattr(devices, "_cpu_flags", lambda: frozenset({"fpu", "avx2", "avx512f"}))
    assert devices.native_bf16(CPU) is False
    monkeypatch.setattr(devices, "_cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert devices.native_bf16(CPU) is True
    monkeypatch.setattr(devices, "_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert devices.native_bf16(CPU) is True
    monkeypatch.setenv(devices.NATIVE_BF16_VARIABLE, "0")
    assert devices.native_bf16(CPU) is False
    monkeypatch.setattr(devices, "_cpu_flags", lambda: frozenset())
    monkeypatch.setenv(devices.NATIVE_BF16_VARIABLE, "1")
    assert devices.native_bf16(CPU) is True
    assert devices.native_bf16(torch.device("meta")) is False


def test_the_cuda_probe_does_not_count_emulated_bf16(monkeypatch):
    calls = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:  # torch's signature since 2.3
        calls.append(including_emulation)
        return including_emulation  # an older GPU: bf16 only through emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert devices.native_bf16(CUDA) is False and calls == [False]


@pytest.fixture
def tf32_flags():
    """The process's TF32 flags, restored after the test (they are process-wide)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _tf32():
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def test_off_on_cuda_is_full_fp32_not_cudnns_default_tf32(tf32_flags, monkeypatch):
    """cuDNN computes fp32 convolutions in TF32 by default, so `amp: off` on an Ampere GPU ran TF32 while the
    log said fp32. The flags are host settings: a CUDA device object is all the test needs."""
    monkeypatch.setattr(devices, "native_tf32", lambda device: device.type == "cuda", raising=False)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = True, True  # torch 2.14: conv TF32
    with devices.autocast_for(CUDA, "off"):  # every forward: training, validation, eval.py, predict.py
        assert _tf32() == (False, False)
    assert _tf32() == (True, True)  # restored
    devices.apply_fp32_precision("off", CUDA)  # process-wide, for training's backward
    assert _tf32() == (False, False)
    with devices.autocast_for(CUDA, "tf32"):
        assert _tf32() == (True, True)
    assert _tf32() == (False, False)
    devices.apply_fp32_precision("tf32", CUDA)
    assert _tf32() == (True, True)
    devices.apply_fp32_precision("off", CPU)  # nothing to set off CUDA
    assert _tf32() == (True, True)
    # both views of torch's flags agree, so reading the legacy cuDNN flag does not raise (mixing APIs does)
    assert torch.backends.cudnn.conv.fp32_precision == torch.backends.cudnn.rnn.fp32_precision == "tf32"


def test_tf32_runs_where_the_device_has_it_and_the_log_names_it(monkeypatch, caplog):
    monkeypatch.setattr(devices, "native_tf32", lambda device: device.type == "cuda")
    assert devices.resolve_precision("tf32", CUDA) == ("tf32", "as configured")
    assert devices.resolve_precision("tf32", CPU)[0] == "off"
    monkeypatch.setattr(devices, "native_bf16", lambda device: True)
    with caplog.at_level("INFO", logger="syncseg.engine.devices"):
        assert devices.log_precision("train.amp", "off", CUDA) == "off"
        assert devices.log_precision("train.amp", "tf32", CUDA) == "tf32"
        assert devices.log_precision("train.amp", "auto", CUDA) == "bf16"
        assert devices.log_precision("eval.amp", "tf32", CPU) == "off"
    assert "train.amp=off: fp32 (TF32 off: matmuls and convolutions in full fp32)" in caplog.text
    assert "train.amp=tf32: tf32 (fp32 tensors, matmuls and convolutions in TF32)" in caplog.text
    assert "train.amp=auto: bf16 (TF32 off for what runs in fp32)" in caplog.text
    assert "eval.amp=tf32: fp32 (tf32 as configured, but cpu has no TF32, so fp32)" in caplog.text
    monkeypatch.setattr(devices, "native_tf32", lambda device: False)  # a pre-Ampere GPU
    assert devices.resolve_precision("tf32", CUDA)[0] == "off"


def test_tf32_is_fp32_tensors_and_the_usual_layout():
    layer = torch.nn.Linear(4, 4)
    with devices.autocast_for(CPU, "tf32"):  # runs as off on a CPU
        assert layer(torch.randn(2, 4)).dtype == torch.float32
    assert devices.resolve_channels_last("auto", "tf32", CPU)[0] is False
