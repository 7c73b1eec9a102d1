import pytest
import torch

from xformer.errors import XformerError
from xformer.runtime import resolve_runtime


def test_cpu_defaults_to_fp32_without_a_scaler():
    rt = resolve_runtime("cpu", "auto")
    assert (rt.device.type, rt.precision, rt.scaler) == ("cpu", "fp32", None)


def test_bf16_on_the_cpu_autocasts_matmuls():
    rt = resolve_runtime("cpu", "bf16")
    with rt.autocast():
        out = torch.ones(2, 3) @ torch.ones(3, 2)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("device,precision,message", [
    ("cpu", "fp16", "--precision fp16: needs a CUDA device"),
    ("tpu", "auto", "--device tpu: expected auto, cpu, cuda or cuda:N"),
    ("cpu", "fp8", "--precision fp8: expected auto, fp32, bf16 or fp16"),
])
def test_bad_device_or_precision_is_one_line(device, precision, message):
    with pytest.raises(XformerError, match=message):
        resolve_runtime(device, precision)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(XformerError, match="--device cuda: CUDA is not available here"):
        resolve_runtime("cuda", "auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_precision_is_mixed():
    rt = resolve_runtime("auto", "auto")
    assert rt.device.type == "cuda" and rt.precision in ("bf16", "fp16")
    assert (rt.scaler is not None) == (rt.precision == "fp16")
