"""`--device`: auto takes a CUDA GPU when there is one (the one with the most free memory), else the CPU, and says
why; a device this machine lacks, or a name that is none, is an error naming it. GPUs are stood in for where
this machine has none."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hetpeer.peer.device import DeviceError, choose_device

GIB = 2**30


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    """cuda:0 with 10 GiB free, cuda:1 with 30, both of 40; cuda:1 without bf16 units."""
    free = {0: 10 * GIB, 1: 30 * GIB}
    current = {"index": 0}

    @contextlib.contextmanager
    def device(index):
        before, current["index"] = current["index"], index
        yield
        current["index"] = before

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (free[index], 40 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"Card {index}")
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: current["index"] == 0)


def test_auto_without_a_gpu_takes_the_cpu_and_says_why(no_cuda):
    choice = choose_device("auto", "bf16")
    assert choice.device == "cpu"
    assert "CUDA" in choice.reason and str(choice).startswith("cpu (")


def test_auto_takes_the_gpu_with_the_most_free_memory_and_says_what_it_is(two_gpus):
    choice = choose_device("auto", "fp32")
    assert choice.device == "cuda:1"
    assert choice.reason == "the GPU with the most free memory: Card 1, 30.0 of 40.0 GiB free"
    assert "bf16 emulated" in choose_device("auto", "bf16").reason  # cuda:1 has no bf16 units
    assert choose_device("cuda:0", "bf16").reason == "as asked: Card 0, 10.0 of 40.0 GiB free, bf16 native"
    assert choose_device("cuda", "fp32").device == "cuda:0"  # the current device


@pytest.mark.parametrize("requested", ["cuda", "cuda:0"])
def test_a_gpu_asked_for_on_a_machine_without_one_is_an_error(no_cuda, requested):
    with pytest.raises(DeviceError, match=f"--device {requested}: .*CUDA.*use --device cpu or auto"):
        choose_device(requested)


def test_a_gpu_past_the_last_is_an_error_naming_those_there_are(two_gpus):
    with pytest.raises(DeviceError, match=r"--device cuda:2: torch sees 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        choose_device("cuda:2")


@pytest.mark.parametrize("requested", ["gpu", "cuda:x", "cuda:", "CPU", "mps", ""])
def test_a_name_that_is_no_device_is_an_error_naming_it(requested):
    with pytest.raises(DeviceError, match=f"--device must be auto, cpu, cuda or cuda:N, got {requested!r}"):
        choose_device(requested)


def test_the_cpu_asked_for_is_taken():
    assert (choose_device("cpu").device, choose_device("cpu").reason) == ("cpu", "as asked")
