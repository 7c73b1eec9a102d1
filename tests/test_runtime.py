import pytest
import torch

from xformer.errors import XformerError
from xformer.training.device import resolve_runtime


def test_the_cpu_never_gets_a_gradient_scaler(cpu):
    """Whatever auto picks on the CPU (fp32 where bf16 is emulated, bf16 where it is native),
    no fp16 scaler is made: the capability is pretended, never read off the machine at hand."""
    cpu([])
    assert (rt := resolve_runtime("cpu", "auto")).precision == "fp32" and rt.scaler is None
    cpu(["amx_bf16"], ratio=0.3)
    assert (rt := resolve_runtime("cpu", "auto")).precision == "bf16" and rt.scaler is None


def test_bf16_on_the_cpu_autocasts_matmuls():
    rt = resolve_runtime("cpu", "bf16")
    with rt.autocast():
        out = torch.ones(2, 3) @ torch.ones(3, 2)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("device,precision,message", [
    ("cpu", "fp16", "precision fp16: needs a CUDA device"),
    ("tpu", "auto", "device tpu: expected auto, cpu, cuda or cuda:N"),
    ("cpu", "fp8", "precision fp8: expected auto, fp32, bf16 or fp16"),
])
def test_bad_device_or_precision_is_one_line(device, precision, message):
    with pytest.raises(XformerError, match=message):
        resolve_runtime(device, precision)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(XformerError, match="device cuda: CUDA is not available here"):
        resolve_runtime("cuda", "auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_precision_is_mixed():
    rt = resolve_runtime("auto", "auto")
    assert rt.device.type == "cuda" and rt.precision in ("bf16", "fp16")
    assert (rt.scaler is not None) == (rt.precision == "fp16")


@pytest.fixture
def cpu(monkeypatch):
    """Pretend CPUs: which bf16 flags the hardware reports and what the matmul probe measures."""
    from xformer.training import device as runtime

    def pretend(flags, ratio=None, isa=None):
        """`isa`: ONEDNN_MAX_CPU_ISA as the environment sets it (None: unset)."""
        runtime._cpu_bf16_cached.cache_clear()
        monkeypatch.setattr(runtime, "_cpu_bf16_flags", lambda: list(flags))
        for name in runtime.ISA_LIMITS:
            monkeypatch.delenv(name, raising=False)
        if isa is not None:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        if ratio is not None:
            monkeypatch.setattr(runtime, "bf16_matmul_ratio", lambda: ratio)

    yield pretend
    runtime._cpu_bf16_cached.cache_clear()


def test_auto_precision_on_the_cpu_is_bf16_only_where_bf16_is_native(cpu):
    cpu([])  # AVX2 only: bf16 would be emulated
    rt = resolve_runtime("cpu", "auto")
    assert rt.precision == "fp32" and "no AMX or AVX512-BF16" in rt.reason and rt.warning is None
    cpu(["amx_bf16"], ratio=40.0)  # AMX: the hardware decides; a probe blurred by a busy machine is not read
    rt = resolve_runtime("cpu", "auto")
    assert rt.precision == "bf16" and "amx_bf16" in rt.reason and "natively" in rt.reason
    cpu(["amx_bf16"], ratio=0.3, isa="AVX512_CORE_AMX")  # oneDNN held, but not below AMX: the probe says so
    rt = resolve_runtime("cpu", "auto")
    assert rt.precision == "bf16" and "0.30x" in rt.reason and "ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX" in rt.reason
    cpu(["amx_bf16"], ratio=40.0, isa="AVX2")  # AMX, but oneDNN held below it
    rt = resolve_runtime("cpu", "auto")
    assert rt.precision == "fp32" and "40.0x the fp32 time" in rt.reason and "ONEDNN_MAX_CPU_ISA=AVX2" in rt.reason
    assert resolve_runtime("cpu", "auto", training=False).precision == "fp32"  # evaluation keeps fp32


def test_asking_for_bf16_where_it_is_emulated_warns_with_the_measured_slowdown(cpu):
    cpu([], ratio=37.0)  # no bf16 in the hardware: the probe measures the slowdown for the warning
    rt = resolve_runtime("cpu", "bf16")
    assert rt.precision == "bf16" and rt.reason == "asked for"
    assert "emulated" in rt.warning and "37x the fp32 time" in rt.warning
    cpu(["avx512_bf16"], ratio=0.5)
    assert resolve_runtime("cpu", "bf16").warning is None


def test_the_probe_measures_a_real_matmul():
    from xformer.training.device import bf16_matmul_ratio, cpu_bf16

    ratio = bf16_matmul_ratio(n=64, repeats=2)
    assert ratio > 0
    native, why, _ = cpu_bf16()
    assert isinstance(native, bool) and why


@pytest.mark.parametrize("fast_paths", [True, False])  # the fused Adam (no host sync) and the per-tensor one
@pytest.mark.parametrize("clip_norm", [0.0, 1.0])
def test_a_step_with_a_nonfinite_gradient_is_skipped_and_leaves_the_optimizer_as_it_was(fast_paths, clip_norm):
    from xformer.config.schema import TrainConfig
    from xformer.training.optim import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = build_optimizer(model, TrainConfig(lr=0.1, fast_paths=fast_paths, max_steps=1))
    rt = resolve_runtime("cpu", "fp32")

    def step(poison: float | None):
        model(torch.randn(5, 4)).sum().backward()
        if poison is not None:
            model[1].weight.grad[0, 0] = poison
        skipped = rt.step(optimizer, model, clip_norm)
        optimizer.zero_grad(set_to_none=True)
        return float(skipped)

    assert step(None) == 0.0
    before = [p.detach().clone() for p in model.parameters()]
    moments = {k: v.clone() for k, v in optimizer.state[model[0].weight].items()}
    for poison in (float("nan"), float("inf")):
        assert step(poison) == 1.0
        for p, q in zip(model.parameters(), before, strict=True):
            assert torch.equal(p, q)
        for k, v in optimizer.state[model[0].weight].items():
            assert torch.equal(v, moments[k]), k  # moments and the step count included
    assert step(None) == 0.0 and not torch.equal(model[0].weight, before[0])
    assert float(optimizer.state[model[0].weight]["step"]) == 2
