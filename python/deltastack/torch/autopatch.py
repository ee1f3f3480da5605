"""Patch-at-import: ``import deltastack.torch.autopatch`` before building a model patches transformers' Qwen3.5
module (``deltastack.torch.patch_transformers()``), so every Qwen3.5 text model made afterwards runs deltastack's
ops (per-op ``DELTASTACK_TORCH_<OP>=0|1`` as for ``patch``)."""

from .patch import patch_transformers

PATCHED = patch_transformers()
