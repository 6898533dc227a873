"""Tests for mha.lab.hardware: the device report and which of torch's SDPA backends run."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mha.lab import hardware

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's answers")
BACKEND_NAMES = [name for name in SDPBackend.__members__ if name != "ERROR"]


def _qkv(shape=(2, 4, 32, 16), dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(3))


# ---------------------------------------------------------------------------------------- device


def test_device_report_cpu():
    r = hardware.device_report("cpu")
    assert r.device == "cpu" and r.name == "CPU"
    assert r.compute_capability is None and r.total_memory_gib is None
    assert r.torch_version == torch.__version__
    assert r.cuda_version == torch.version.cuda
    assert r.cpu_capability == torch.backends.cpu.get_cpu_capability()
    assert r.num_threads == torch.get_num_threads()
    dtypes = {d.name: d for d in r.dtypes}
    assert list(dtypes) == ["float16", "bfloat16", "tf32"]
    # the CPU runs both 16-bit formats (torch has CPU kernels for them); TF32 is CUDA-only
    assert dtypes["float16"].supported and dtypes["bfloat16"].supported
    assert not dtypes["tf32"].supported


def test_device_report_text_is_fixed_and_machine_independent_on_cpu():
    r = hardware.device_report("cpu")
    text = r.to_text()
    assert text == str(r) == hardware.device_report("cpu").to_text()
    lines = text.splitlines()
    assert lines[0] == "device:             cpu (CPU)"
    assert lines[1] == f"torch:              {torch.__version__}"
    assert "tf32:               no (a CUDA tensor-core format, compute capability >= 8.0)" in lines
    # what differs between CPU machines is kept as attributes, never printed
    assert "CPU instruction set" not in text and "torch threads" not in text


def test_device_report_bad_device():
    with pytest.raises(ValueError, match="device must name a torch device, got 'gpu0'"):
        hardware.device_report("gpu0")


@CPU_ONLY
def test_device_report_cuda_unavailable():
    with pytest.raises(ValueError, match="CUDA is not available"):
        hardware.device_report("cuda")


# -------------------------------------------------------------------------------------- backends


def test_backends_listed_in_torch_order():
    r = hardware.sdpa_backends(*_qkv())
    assert [s.backend for s in r.backends] == BACKEND_NAMES
    assert r.status("MATH").runs and r.status("MATH").reason == ""
    assert "MATH" in r.runnable
    assert r.default in r.runnable  # torch's own choice is one that runs
    with pytest.raises(ValueError, match="unknown backend 'FAST'"):
        r.status("FAST")


def test_report_agrees_with_forcing_each_backend_in_torch():
    q, k, v = _qkv()
    r = hardware.sdpa_backends(q, k, v, is_causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for s in r.backends:
        backend = SDPBackend.__members__[s.backend]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if s.runs:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
            else:
                with pytest.raises(RuntimeError), sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)


@CPU_ONLY
def test_cpu_has_a_flash_kernel_but_no_cuda_kernels():
    for kwargs in (
        {},
        {"is_causal": True},
        {"attn_mask": torch.ones(32, 32, dtype=torch.bool).tril()},
    ):
        r = hardware.sdpa_backends(*_qkv(), **kwargs)
        assert r.status("FLASH_ATTENTION").runs, kwargs
        assert r.default == "FLASH_ATTENTION", kwargs
    r = hardware.sdpa_backends(*_qkv(dtype=torch.bfloat16), is_causal=True)
    assert r.status("FLASH_ATTENTION").runs
    for name in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        s = r.status(name)
        assert not s.runs
        assert s.reason.endswith("kernel for cpu tensors in this torch build")


@CPU_ONLY
def test_reasons_are_torchs_without_source_locations():
    r = hardware.sdpa_backends(*_qkv(), dropout_p=0.1)
    flash = r.status("FLASH_ATTENTION")
    assert not flash.runs
    assert "dropout" in flash.reason
    assert "Triggered internally" not in flash.reason and "not used because" not in flash.reason
    assert r.default == "MATH"
    q, k, v = _qkv(shape=(4, 32, 16))  # no head dimension
    flash = hardware.sdpa_backends(q, k, v).status("FLASH_ATTENTION")
    assert not flash.runs and "4 dimensional" in flash.reason


def test_repeated_calls_give_the_same_report_and_print_nothing(capfd):
    args = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning escaping the report would fail here
        first = hardware.sdpa_backends(*args, dropout_p=0.1)
        second = hardware.sdpa_backends(*args, dropout_p=0.1)
    assert first == second
    out = capfd.readouterr()
    assert out.err == "" and out.out == ""


def test_backend_report_text():
    q, k, v = _qkv()
    r = hardware.sdpa_backends(q, k, v, attn_mask=torch.ones(32, 32, dtype=torch.bool), scale=0.5)
    lines = str(r).splitlines()
    assert lines[0] == (
        "SDPA backends for query (2, 4, 32, 16) float32, key (2, 4, 32, 16) float32, "
        "value (2, 4, 32, 16) float32, attn_mask (32, 32) bool, dropout_p 0.0, is_causal False, "
        f"scale 0.5 on {q.device.type}"
    )
    assert lines[1] == f"torch picks: {r.default}"
    assert lines[2] == "MATH                 runs"
    assert len(lines) == 2 + len(BACKEND_NAMES)


def test_sdpa_backends_bad_input():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="query must be a torch.Tensor, got list"):
        hardware.sdpa_backends([1.0], k, v)
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor, got list"):
        hardware.sdpa_backends(q, k, v, attn_mask=[[True]])
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.5"):
        hardware.sdpa_backends(q, k, v, dropout_p=1.5)
    with pytest.raises(TypeError, match=r"dropout_p must be a float, got str \('0.1'\)"):
        hardware.sdpa_backends(q, k, v, dropout_p="0.1")
    with pytest.raises(TypeError, match=r"is_causal must be a bool, got int \(1\)"):
        hardware.sdpa_backends(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match="scale must be a float or None, got str"):
        hardware.sdpa_backends(q, k, v, scale="big")
    with pytest.raises(ValueError, match="scale must be finite, got inf"):
        hardware.sdpa_backends(q, k, v, scale=float("inf"))


def test_inputs_that_no_backend_accepts_are_reported_not_raised():
    q, k, v = _qkv()
    r = hardware.sdpa_backends(q, k[..., :8], v)  # head dims differ: even MATH fails
    assert r.runnable == []
    assert r.status("MATH").reason  # torch's error message, recorded


# ---------------------------------------------------------------------------------------- report


def test_default_cases_are_valid_sdpa_arguments():
    cases = hardware.default_cases("cpu")
    assert len(cases) >= 5
    for name, kwargs in cases.items():
        out = F.scaled_dot_product_attention(**kwargs)  # torch accepts every case
        assert out.shape[-2] == kwargs["query"].shape[-2], name


def test_hardware_report_matrix():
    report = hardware.hardware_report("cpu")
    assert list(report.cases) == list(hardware.default_cases("cpu"))
    text = str(report)
    assert text == report.to_text() == str(hardware.hardware_report("cpu"))  # stable
    assert text.startswith(report.device.to_text())
    block = text.split("SDPA backends that run:\n")[1].split("\n\n")[0].splitlines()
    header = block[0].split()
    assert header[:3] == ["case", "torch", "picks"]
    assert (
        header[3:] == ["math", "flash", "efficient", "cudnn", "overrideable"][: len(BACKEND_NAMES)]
    )
    assert len(block) == 1 + len(report.cases)
    for line, (case, r) in zip(block[1:], report.cases.items()):
        assert line.startswith(case)
        cells = line[len(case) :].split()
        assert cells[1:] == ["yes" if s.runs else "no" for s in r.backends]
    assert "Why not:" in text


@CPU_ONLY
def test_hardware_report_on_cpu_names_the_dropout_limit():
    report = hardware.hardware_report("cpu")
    assert not report.cases["float32, dropout 0.1"].status("FLASH_ATTENTION").runs
    assert report.cases["float32, causal"].status("FLASH_ATTENTION").runs
    assert "- flash (float32, dropout 0.1): " in str(report)
    assert (
        "- efficient (all cases): no efficient kernel for cpu tensors in this torch build"
        in str(report)
    )


def test_hardware_report_custom_cases_and_bad_input():
    q, k, v = _qkv()
    report = hardware.hardware_report("cpu", cases={"tiny": {"query": q, "key": k, "value": v}})
    assert list(report.cases) == ["tiny"]
    with pytest.raises(TypeError, match="cases must be a mapping"):
        hardware.hardware_report("cpu", cases=[q, k, v])
    with pytest.raises(TypeError, match=r"cases\['x'\] must be a mapping of keyword arguments"):
        hardware.hardware_report("cpu", cases={"x": (q, k, v)})
