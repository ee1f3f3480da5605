"""deltastack's kernels inside PyTorch (docs/torch.md).

``deltastack.torch.ops``: the custom ops (``torch.ops.deltastack.*``) and their public functions;
``deltastack.torch.patch(model)`` / ``unpatch(model)``: transformers' Qwen3.5 text models on those ops;
``import deltastack.torch.autopatch``: the patch-at-import form (transformers' Qwen3.5 module patched, so every model
built afterwards uses the ops).
"""

from . import ops
from .ops import *  # noqa: F401,F403  (the op functions: ops.__all__)
from .patch import PATCHABLE_OPS, patch, patch_transformers, unpatch, unpatch_transformers

__all__ = ["ops", *ops.__all__, "patch", "unpatch", "patch_transformers", "unpatch_transformers", "PATCHABLE_OPS"]
