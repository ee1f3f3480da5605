"""Shared helpers of deltastack.torch's tests: `python -m pytest python/tests` where torch, transformers and the
built extension are (docs/torch.md). Without torch or the extension every test module skips."""

import importlib
import os
import sys
from pathlib import Path

import pytest

_WHY = None
try:
    import torch
    import transformers  # noqa: F401
except ImportError as e:  # CI has no torch: every test module skips (require below)
    torch = None
    _WHY = f"{e}"
if torch is not None:
    # transformers wraps torch_chunk_gated_delta_rule and causal_conv1d_fn (integrations/hub_kernels.py,
    # use_kernel_func_from_hub_with_fallback) so that they call fla / Dao's causal-conv1d whenever those import. The
    # tests compare against transformers' own torch math, so for this session the module's functions are the torch
    # functions those wrappers wrap (functools.wraps: __wrapped__). On the H200 with fla importable the wrapped
    # reference was fla itself: its Triton kernels on CPU tensors, and its gated backward refusing Hopper with
    # Triton 3.6 (fla issue #640); every gated delta rule test failed there, and later tests crashed.
    import inspect

    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as _M
    except ImportError as e:  # a transformers without Qwen3.5 (older than 5.x)
        torch, _WHY = None, f"transformers has no Qwen3.5 ({e})"
    else:
        for _name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            _f = inspect.unwrap(getattr(_M, _name))
            # A wrapper without __wrapped__ would stay a wrapper (and the reference fla again): refuse that.
            assert inspect.getsourcefile(_f) == inspect.getsourcefile(_M) and _f.__name__ == _name, (
                f"{_name}: transformers' torch function not found under its wrapper ({_f!r})")
            setattr(_M, _name, _f)
if torch is not None:
    try:
        import deltastack.torch as dt
    except ImportError as e:  # not installed: the source tree, after an in-place build (setup.py build_ext -i)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        for name in [m for m in sys.modules if m == "deltastack" or m.startswith("deltastack.")]:
            del sys.modules[name]
        try:
            dt = importlib.import_module("deltastack.torch")
        except ImportError:
            dt = None
            _WHY = f"deltastack.torch is not built ({e}): pip install --no-build-isolation ./python"


def require():
    """At the top of each test module: skips the module (cleanly, exit status 0) without torch, transformers or
    the built extension."""
    if _WHY is not None:
        pytest.skip(_WHY, allow_module_level=True)


REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "hf_qwen35_tiny_a"


def devices():
    out = ["cpu"]
    if torch.cuda.is_available() and dt.has_cuda():
        out.append("cuda")
    return out


def rel_l2(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(actual, expected, device, name, rtol=1e-4, atol=1e-5, bf16_rel=3e-2):
    """CPU: elementwise within rtol / atol (the fp32 reference against an fp64 or fp32 torch reference). CUDA: the
    kernels compute in bf16, so a relative L2 error below bf16_rel."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    if device == "cpu":
        torch.testing.assert_close(actual.detach().double(), expected.detach().double(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")
    else:
        err = rel_l2(actual, expected)
        assert err < bf16_rel, f"{name}: relative L2 error {err:.3g} >= {bf16_rel}"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("DELTASTACK_TORCH_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("DELTASTACK_LOG", "quiet")
    yield
