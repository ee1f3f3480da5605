"""deltastack's kernels inside PyTorch (docs/torch.md).

``deltastack.torch.ops``: the custom ops (``torch.ops.deltastack.*``) and their public functions;
``deltastack.torch.patch(model)`` / ``unpatch(model)``: transformers' Qwen3.5 text models on those ops;
``import deltastack.torch.autopatch``: the patch-at-import form (transformers' Qwen3.5 module patched, so every model
built afterwards uses the ops).
"""

from . import ops
from .ops import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_rms_norm,
    has_cuda,
    l2norm,
    linear_cross_entropy,
    rms_norm,
    swiglu,
)
from .patch import PATCHABLE_OPS, patch, patch_transformers, unpatch, unpatch_transformers

__all__ = [
    "ops",
    "chunk_gated_delta_rule",
    "causal_conv1d",
    "rms_norm",
    "gated_rms_norm",
    "swiglu",
    "linear_cross_entropy",
    "l2norm",
    "has_cuda",
    "patch",
    "unpatch",
    "patch_transformers",
    "unpatch_transformers",
    "PATCHABLE_OPS",
]
