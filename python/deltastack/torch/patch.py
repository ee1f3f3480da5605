"""transformers' Qwen3.5 text models on deltastack's ops (docs/torch.md).

``patch(model)`` rebinds, on the model's own module instances, the forward of every ``Qwen3_5RMSNorm``
(zero-centered RMSNorm), ``Qwen3_5RMSNormGated`` (gated RMSNorm), ``Qwen3_5MLP`` (SwiGLU) and
``Qwen3_5ForCausalLM`` (fused linear cross-entropy when labels are given), and any function reference a
``Qwen3_5GatedDeltaNet`` instance holds (``chunk_gated_delta_rule``, ``causal_conv1d_fn``: attributes some
transformers versions set at init); and it replaces the module-level functions the GatedDeltaNet forward calls
(``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn`` of ``transformers.models.qwen3_5.modeling_qwen3_5``; in
transformers 5.17 the forward looks them up there at call time). ``patch_transformers()`` (and
``import deltastack.torch.autopatch``) is the patch-at-import form: the module-level functions and the classes'
``forward``, so every model built afterwards is covered. ``unpatch`` / ``unpatch_transformers`` put back exactly
what was replaced.

Per op, ``DELTASTACK_TORCH_<OP>=0|1`` (default 1) with OP one of ``PATCHABLE_OPS`` (upper-cased), or the
``enable={op: bool}`` argument, which wins over the environment. Each replacement logs one line (logger
``deltastack.torch``; ``DELTASTACK_LOG=quiet`` silences it) and the functions return the list of those lines.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Optional

import torch
import torch.nn.functional as F

from . import ops

PATCHABLE_OPS = (
    "chunk_gated_delta_rule",
    "causal_conv1d",
    "rms_norm",
    "gated_rms_norm",
    "swiglu",
    "linear_cross_entropy",
)

_log = logging.getLogger("deltastack.torch")


def _emit(line: str) -> str:
    if os.environ.get("DELTASTACK_LOG", "info").lower() != "quiet":
        if not _log.handlers and not logging.getLogger().handlers:
            print(f"[deltastack.torch] {line}", file=sys.stderr, flush=True)
        else:
            _log.info(line)
    return line


def _enabled(op: str, enable: Optional[dict]) -> bool:
    if enable is not None and op in enable:
        return bool(enable[op])
    var = f"DELTASTACK_TORCH_{op.upper()}"
    val = os.environ.get(var, "1").strip()
    if val not in ("0", "1"):
        raise ValueError(f"{var}={val!r}: expected 0 or 1")
    return val == "1"


def _check_enable(enable: Optional[dict]) -> None:
    for op in enable or {}:
        if op not in PATCHABLE_OPS:
            raise ValueError(f"deltastack.torch.patch: unknown op {op!r} (known: {', '.join(PATCHABLE_OPS)})")
    for op in PATCHABLE_OPS:
        _enabled(op, None)  # a bad environment value is an error even where `enable` overrides it


def _qwen35():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


# ------------------------------------------------------------------------------------- the replacement functions
# Originals of the module-level functions, for the cases deltastack's ops do not take (they run unchanged there).
_ORIGINALS: dict = {}


def _original(name: str):
    return _ORIGINALS.get(name) or getattr(_qwen35(), name)


def _supported_device(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or (t.device.type == "cuda" and ops.has_cuda())


def ds_torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                    output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                    **kwargs):
    """Drop-in for transformers' torch_chunk_gated_delta_rule (same arguments; cu_seqlens, which transformers
    passes from cu_seq_lens_q and its torch version ignores, is honoured as fla does)."""
    dk = key.shape[-1]
    cuda_state_ok = not query.is_cuda or (initial_state is None and not output_final_state) or (
        dk == 128 and value.shape[-1] == 128)
    if not _supported_device(query) or not cuda_state_ok:
        return _original("torch_chunk_gated_delta_rule")(query, key, value, g, beta, chunk_size=chunk_size,
                                                         initial_state=initial_state,
                                                         output_final_state=output_final_state,
                                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    return ops.chunk_gated_delta_rule(query, key, value, g, beta, scale=dk ** -0.5, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def ds_causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """Drop-in for transformers' causal_conv1d_fn (x: [B, C, T], weight: [C, K]) for bias None and SiLU; packed
    sequences through cu_seq_lens_q / cu_seqlens in kwargs (the taps then stop at each boundary, as Dao's
    seq_idx). Anything else runs the original."""
    K = weight.shape[-1]
    if (bias is not None or activation not in ("silu", "swish") or not _supported_device(hidden_states)
            or (hidden_states.is_cuda and K > 4) or weight.dim() != 2):
        return _original("causal_conv1d_fn")(hidden_states, weight, bias, activation=activation, **kwargs)
    cu = kwargs.get("cu_seqlens", kwargs.get("cu_seq_lens_q"))
    y = ops.causal_conv1d(hidden_states.transpose(1, 2), weight, None, "silu", cu_seqlens=cu)
    return y.transpose(1, 2)


# Each factory takes the forward it replaces (the fallback for what deltastack's op does not take) and returns the
# replacement: bound per instance by patch(model), set on the class by patch_transformers().


def _rmsnorm_forward(original):
    def forward(self, hidden_states):
        """Qwen3_5RMSNorm.forward on deltastack's zero-centered RMSNorm."""
        if not _supported_device(hidden_states):
            return original(self, hidden_states)
        return ops.rms_norm(hidden_states, self.weight, self.eps, zero_centered=True)

    return forward


def _gated_rmsnorm_forward(original):
    def forward(self, hidden_states, gate=None):
        """Qwen3_5RMSNormGated.forward on deltastack's gated RMSNorm."""
        if gate is None or not _supported_device(hidden_states):
            return original(self, hidden_states, gate)
        return ops.gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon)

    return forward


def _mlp_forward(original):
    def forward(self, x):
        """Qwen3_5MLP.forward with deltastack's SwiGLU between the projections (hidden_act silu)."""
        if getattr(self.config, "hidden_act", None) not in ("silu", "swish") or not _supported_device(x):
            return original(self, x)
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))

    return forward


def _make_causal_lm_forward(original):
    """Qwen3_5ForCausalLM.forward with the loss from deltastack's fused linear + cross-entropy when labels are
    given (logits are then None: they are never materialised). ForCausalLMLoss's semantics: labels shifted inside
    (or shift_labels given), ignore_index -100, mean over valid labels, or sum / num_items_in_batch."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils.generic import can_return_tuple

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        args = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
        shift_labels = kwargs.get("shift_labels")
        if ((labels is None and shift_labels is None) or logits_to_keep not in (0, None)
                or getattr(self.lm_head, "bias", None) is not None or not _supported_device(self.lm_head.weight)):
            return original(self, labels=labels, logits_to_keep=logits_to_keep, **args, **kwargs)
        kwargs = dict(kwargs)
        kwargs.pop("shift_labels", None)
        num_items = kwargs.get("num_items_in_batch")
        outputs = self.model(**args, **kwargs)
        hidden = outputs.last_hidden_state
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = ops.linear_cross_entropy(hidden, self.lm_head.weight, shift_labels.to(hidden.device),
                                        ignore_index=-100, reduction="mean" if num_items is None else "sum")
        if num_items is not None:
            if torch.is_tensor(num_items):
                num_items = num_items.to(loss.device)
            loss = loss / num_items
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    forward.__doc__ = _make_causal_lm_forward.__doc__
    return forward


# ------------------------------------------------------------------------------------------------ bookkeeping
# Module-level replacements: (owner, attribute) -> original value. Shared by patch(model) (refcounted) and
# patch_transformers().
_module_saved: dict = {}
_module_users = 0
_module_global = False
# Per model: id(model) -> list of (object, attribute, had_own_attribute, old_value).
_instance_saved: dict = {}

_FUNCTIONS = (("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule", ds_torch_chunk_gated_delta_rule),
              ("causal_conv1d", "causal_conv1d_fn", ds_causal_conv1d_fn))


def _class_forwards(M):
    """(op, class, factory of its replacement forward)."""
    return (("rms_norm", M.Qwen3_5RMSNorm, _rmsnorm_forward),
            ("gated_rms_norm", M.Qwen3_5RMSNormGated, _gated_rmsnorm_forward),
            ("swiglu", M.Qwen3_5MLP, _mlp_forward),
            ("linear_cross_entropy", M.Qwen3_5ForCausalLM, _make_causal_lm_forward))


def _set_module_attr(owner, name, value, op, lines, what):
    key = (owner, name)
    if key not in _module_saved:
        _module_saved[key] = owner.__dict__.get(name, _MISSING)
    setattr(owner, name, value)
    lines.append(_emit(f"{op}: {what}"))


_MISSING = object()


def _patch_module_functions(enable, lines):
    M = _qwen35()
    for op, name, fn in _FUNCTIONS:
        if _enabled(op, enable) and (M, name) not in _module_saved:
            _ORIGINALS[name] = getattr(M, name)
            _set_module_attr(M, name, fn, op, lines, f"{M.__name__}.{name} -> deltastack")


def _restore_module(keys=None):
    for key in list(_module_saved if keys is None else keys):
        if key not in _module_saved:
            continue
        owner, name = key
        old = _module_saved.pop(key)
        if old is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, old)
    for _, name, _ in _FUNCTIONS:
        if (_qwen35(), name) not in _module_saved:
            _ORIGINALS.pop(name, None)


# ------------------------------------------------------------------------------------------------ public API


def patch(model: torch.nn.Module, enable: Optional[dict] = None) -> list:
    """Run `model` (a transformers Qwen3.5 text model: Qwen3_5ForCausalLM, Qwen3_5TextModel, or any module holding
    Qwen3.5 layers) on deltastack's ops. Returns one line per replacement. Patching a patched model again first
    unpatches it."""
    global _module_users
    _check_enable(enable)
    M = _qwen35()
    if not any(type(m).__module__ == M.__name__ for m in model.modules()):
        raise ValueError(f"deltastack.torch.patch: {type(model).__name__} holds no module of {M.__name__} (transformers' "
                         "Qwen3.5 text models only)")
    if id(model) in _instance_saved:
        unpatch(model)
    lines: list = []
    _patch_module_functions(enable, lines)
    _module_users += 1
    saved: list = []
    counts: dict = {}
    for op, cls, factory in _class_forwards(M):
        if not _enabled(op, enable):
            continue
        forwards: dict = {}  # per module type: its own forward is the fallback
        for mod in model.modules():
            if not isinstance(mod, cls):
                continue
            if op == "swiglu" and getattr(mod.config, "hidden_act", None) not in ("silu", "swish"):
                continue
            forward = forwards.setdefault(type(mod), factory(type(mod).forward))
            saved.append((mod, "forward", "forward" in mod.__dict__, mod.__dict__.get("forward")))
            mod.forward = types.MethodType(forward, mod)
            counts[(op, cls.__name__)] = counts.get((op, cls.__name__), 0) + 1
    for (op, cname), n in counts.items():
        lines.append(_emit(f"{op}: {cname}.forward rebound on {n} instance(s)"))
    # Function references held by GatedDeltaNet instances (attributes set at init by some transformers versions).
    for op, name, fn in _FUNCTIONS:
        if not _enabled(op, enable):
            continue
        attrs = (name, "chunk_gated_delta_rule") if op == "chunk_gated_delta_rule" else (name,)
        n = 0
        for mod in model.modules():
            if isinstance(mod, M.Qwen3_5GatedDeltaNet):
                for attr in attrs:
                    if attr in mod.__dict__ and callable(mod.__dict__[attr]):
                        saved.append((mod, attr, True, mod.__dict__[attr]))
                        setattr(mod, attr, fn)
                        n += 1
        if n:
            lines.append(_emit(f"{op}: {n} Qwen3_5GatedDeltaNet function reference(s) rebound"))
    _instance_saved[id(model)] = saved
    return lines


def unpatch(model: torch.nn.Module) -> list:
    """Undo patch(model): every rebound attribute back as it was; the module-level functions too once no patched
    model is left (and patch_transformers() is not in force). Returns what was restored."""
    global _module_users
    saved = _instance_saved.pop(id(model), None)
    if saved is None:
        return []
    for obj, attr, had, old in reversed(saved):
        if had:
            setattr(obj, attr, old)
        else:
            obj.__dict__.pop(attr, None)
    lines = [f"restored {len(saved)} attribute(s) of the model"]
    _module_users -= 1
    if _module_users == 0 and not _module_global:
        _restore_module()
        lines.append("restored transformers' Qwen3.5 module functions")
    return lines


def patch_transformers(enable: Optional[dict] = None) -> list:
    """The patch-at-import form: transformers' Qwen3.5 module functions and the classes' forward replaced, so every
    Qwen3.5 text model (built before or after) runs deltastack's ops. Returns one line per replacement."""
    global _module_global
    _check_enable(enable)
    M = _qwen35()
    lines: list = []
    _patch_module_functions(enable, lines)
    for op, cls, factory in _class_forwards(M):
        if _enabled(op, enable) and (cls, "forward") not in _module_saved:
            _set_module_attr(cls, "forward", factory(cls.__dict__["forward"]), op, lines,
                             f"{cls.__name__}.forward -> deltastack")
    _module_global = True
    return lines


def unpatch_transformers() -> list:
    """Undo patch_transformers(): the classes' forward back; the module functions too unless a patch(model) is still
    in force."""
    global _module_global
    M = _qwen35()
    _module_global = False
    class_keys = [(cls, "forward") for _, cls, _ in _class_forwards(M)]
    _restore_module(class_keys)
    if _module_users == 0:
        _restore_module()
    return ["restored transformers' Qwen3.5 module"]
