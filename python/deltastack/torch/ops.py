"""deltastack's kernels as torch custom ops (namespace ``torch.ops.deltastack``), with autograd and fake kernels.

Each op is a pair of custom ops (``<op>_fwd``, ``<op>_bwd``) over the C++ glue (python/csrc/deltastack_torch.cpp);
the forward registers its backward with ``torch.library.register_autograd`` and both have fake (meta) kernels, so
``torch.compile`` traces them as single nodes. CPU tensors run deltastack's fp32 CPU reference (src/ops/<op>/cpu.cpp),
CUDA tensors its CUDA kernels (bf16 activations, fp32 gates, statistics and small weights, as the GPU engine).

The public functions below take the layouts and arguments of the functions they replace:

=========================  =========================================================================================
``chunk_gated_delta_rule``  fla ``chunk_gated_delta_rule`` / transformers ``torch_chunk_gated_delta_rule``
``causal_conv1d``           transformers ``causal_conv1d_fn(..., activation="silu")`` (token-major, fla's layout)
``rms_norm``                transformers ``Qwen3_5RMSNorm`` (zero-centered: ``* (1 + weight)``)
``gated_rms_norm``          transformers ``Qwen3_5RMSNormGated`` / fla ``FusedRMSNormGated``
``swiglu``                  ``silu(gate) * up`` of transformers ``Qwen3_5MLP``
``linear_cross_entropy``    ``cross_entropy(hidden @ weight.T, labels)`` (+ z-loss) of ``ForCausalLMLoss``
``l2norm``                  transformers / fla ``l2norm`` (``use_qk_l2norm_in_kernel``)
=========================  =========================================================================================
"""


from typing import Optional

import torch
from torch import Tensor

from . import _C

__all__ = [
    "chunk_gated_delta_rule",
    "causal_conv1d",
    "rms_norm",
    "gated_rms_norm",
    "swiglu",
    "linear_cross_entropy",
    "l2norm",
    "has_cuda",
]


_HAS_CUDA = bool(_C.has_cuda())


def has_cuda() -> bool:
    """Whether the extension was built with the CUDA kernels."""
    return _HAS_CUDA


def _empty(like: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    return like.new_empty((n,), dtype=dtype)


def _y_and_row_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """Fake outputs of a row-wise norm: y like x, fp32 per-row statistics (rstd, rnorm)."""
    return torch.empty_like(x), x.new_empty((x.numel() // x.shape[-1],), dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ gated delta rule


@torch.library.custom_op("deltastack::gdn_fwd", mutates_args=())
def _gdn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    output_final_state: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    o, fs, batch, saved = _C.gdn_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state)
    return o, fs, batch, saved


@_gdn_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state):
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[-2:]
    S = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    cuda = q.device.type == "cuda"
    nb = ns = 0
    if cuda:  # the CUDA plan's buffer sizes depend on the shapes (specialised: int() guards on them)
        nb, ns = _C.gdn_buffer_bytes(True, int(B), int(T), int(Hk), int(Hv), int(dk), int(dv), int(S), scale,
                                     initial_state is not None or output_final_state)
    o = q.new_empty((B, T, Hv, dv))
    fs = q.new_empty((S, Hv, dk, dv) if output_final_state else (0,), dtype=torch.float32)
    return o, fs, _empty(q, max(nb, 1) if cuda else 0, torch.uint8), _empty(q, max(ns, 1) if cuda else 0, torch.uint8)


@torch.library.custom_op("deltastack::gdn_bwd", mutates_args=())
def _gdn_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    batch: Tensor,
    saved: Tensor,
    do: Tensor,
    dfinal_state: Optional[Tensor],
    output_final_state: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    r = _C.gdn_backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, batch, saved, do, dfinal_state,
                        output_final_state)
    return tuple(r)


@_gdn_bwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, batch, saved, do, dfinal_state, output_final_state):
    dh0 = (initial_state.new_empty(initial_state.shape, dtype=torch.float32) if initial_state is not None
           else q.new_empty((0,), dtype=torch.float32))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _gdn_setup(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state = inputs
    _, _, batch, saved = output
    ctx.scale, ctx.output_final_state = scale, output_final_state
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, batch, saved)


def _gdn_backward(ctx, do, dfs, _dbatch, _dsaved):
    q, k, v, g, beta, h0, cu, batch, saved = ctx.saved_tensors
    if do is None:
        do = q.new_zeros(q.shape[:2] + v.shape[2:], dtype=v.dtype)
    if not ctx.output_final_state or dfs is None or dfs.numel() == 0:
        dfs = None
    dq, dk, dv, dg, db, dh0 = torch.ops.deltastack.gdn_bwd(
        q, k, v, g, beta, ctx.scale, h0, cu, batch, saved, do.contiguous(), dfs, ctx.output_final_state)
    dh0 = dh0.to(h0.dtype) if h0 is not None else None
    return dq, dk, dv, dg, db, None, dh0, None, None


torch.library.register_autograd("deltastack::gdn_fwd", _gdn_backward, setup_context=_gdn_setup)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[Tensor, Optional[Tensor]]:
    """The gated delta rule with fla's signature (fla.ops.gated_delta_rule.chunk_gated_delta_rule).

    q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv] (Hv a multiple of Hk); g (log decay, <= 0), beta: [B, T, Hv];
    scale: default dk ** -0.5; initial_state: [N, Hv, dk, dv]; cu_seqlens: [N + 1] int32/int64 with B = 1 (the
    sequences packed along T; the state restarts at each boundary), else N = B. Returns (o [B, T, Hv, dv] in q's
    dtype, the final state fp32 [N, Hv, dk, dv] or None). Same math as transformers' torch_chunk_gated_delta_rule
    (which ignores cu_seqlens). On CUDA, q, k, v are used in bf16 and initial_state / output_final_state need
    dk = dv = 128 (the chunked kernel); other keyword arguments (chunk_size, ...) are ignored.
    """
    if use_qk_l2norm_in_kernel:
        q = l2norm(q, eps=1e-6)
        k = l2norm(k, eps=1e-6)
    if scale is None:
        scale = k.shape[-1] ** -0.5
    o, fs, _, _ = torch.ops.deltastack.gdn_fwd(q, k, v, g, beta, float(scale), initial_state, cu_seqlens,
                                               bool(output_final_state))
    return o, (fs if output_final_state else None)


# ---------------------------------------------------------------------------------------------------------- l2norm


@torch.library.custom_op("deltastack::l2norm_fwd", mutates_args=())
def _l2norm_fwd(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    y, rn = _C.l2norm_forward(x, eps)
    return y, rn


@_l2norm_fwd.register_fake
def _(x, eps):
    return _y_and_row_stats(x)


@torch.library.custom_op("deltastack::l2norm_bwd", mutates_args=())
def _l2norm_bwd(y: Tensor, rnorm: Tensor, dy: Tensor) -> Tensor:
    return _C.l2norm_backward(y, rnorm, dy)


@_l2norm_bwd.register_fake
def _(y, rnorm, dy):
    return torch.empty_like(dy)


def _l2norm_setup(ctx, inputs, output):
    ctx.save_for_backward(*output)


def _l2norm_backward(ctx, dy, _drn):
    y, rn = ctx.saved_tensors
    return torch.ops.deltastack.l2norm_bwd(y, rn, dy.contiguous()), None


torch.library.register_autograd("deltastack::l2norm_fwd", _l2norm_backward, setup_context=_l2norm_setup)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x * rsqrt(sum(x ** 2, -1) + eps) (transformers / fla l2norm), in x's dtype."""
    return torch.ops.deltastack.l2norm_fwd(x, float(eps))[0]


# ---------------------------------------------------------------------------------------------- causal conv1d + SiLU


@torch.library.custom_op("deltastack::conv1d_fwd", mutates_args=())
def _conv1d_fwd(x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor]) -> Tensor:
    return _C.conv1d_forward(x, weight, cu_seqlens)


@_conv1d_fwd.register_fake
def _(x, weight, cu_seqlens):
    return torch.empty_like(x)


@torch.library.custom_op("deltastack::conv1d_bwd", mutates_args=())
def _conv1d_bwd(x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor], dy: Tensor) -> tuple[Tensor, Tensor]:
    dx, dw = _C.conv1d_backward(x, weight, cu_seqlens, dy)
    return dx, dw


@_conv1d_bwd.register_fake
def _(x, weight, cu_seqlens, dy):
    return torch.empty_like(x), torch.empty_like(weight)


def _conv1d_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # a None cu_seqlens comes back as None


def _conv1d_backward(ctx, dy):
    x, w, cu = ctx.saved_tensors
    dx, dw = torch.ops.deltastack.conv1d_bwd(x, w, cu, dy.contiguous())
    return dx, dw, None


torch.library.register_autograd("deltastack::conv1d_fwd", _conv1d_backward, setup_context=_conv1d_setup)


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = "silu",
    cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    """Causal depthwise conv1d + SiLU. x: [B, T, C] (token-major, as fla's causal_conv1d); weight: [C, K];
    cu_seqlens: [N + 1] with B = 1 (taps never cross a sequence boundary). Returns silu(conv(x)) [B, T, C] in x's
    dtype. The math of transformers' causal_conv1d_fn(x.transpose(1, 2), weight, activation="silu") transposed
    back; no bias, SiLU only (anything else is a ValueError)."""
    if bias is not None:
        raise ValueError("deltastack causal_conv1d: bias is not supported (Qwen3.5's conv has none)")
    if activation not in ("silu", "swish"):
        raise ValueError(f"deltastack causal_conv1d: activation must be 'silu', got {activation!r}")
    return torch.ops.deltastack.conv1d_fwd(x, weight, cu_seqlens)


# ---------------------------------------------------------------------------------------------------------- RMSNorm


@torch.library.custom_op("deltastack::rmsnorm_fwd", mutates_args=())
def _rmsnorm_fwd(x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> tuple[Tensor, Tensor]:
    y, rstd = _C.rmsnorm_forward(x, weight, eps, zero_centered)
    return y, rstd


@_rmsnorm_fwd.register_fake
def _(x, weight, eps, zero_centered):
    return _y_and_row_stats(x)


@torch.library.custom_op("deltastack::rmsnorm_bwd", mutates_args=())
def _rmsnorm_bwd(x: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor, zero_centered: bool) -> tuple[Tensor, Tensor]:
    dx, dw = _C.rmsnorm_backward(x, weight, rstd, dy, zero_centered)
    return dx, dw


@_rmsnorm_bwd.register_fake
def _(x, weight, rstd, dy, zero_centered):
    return torch.empty_like(x), torch.empty_like(weight)


def _rmsnorm_setup(ctx, inputs, output):
    x, weight, _, zero_centered = inputs
    ctx.zero_centered = zero_centered
    ctx.save_for_backward(x, weight, output[1])


def _rmsnorm_backward(ctx, dy, _drstd):
    x, w, rstd = ctx.saved_tensors
    dx, dw = torch.ops.deltastack.rmsnorm_bwd(x, w, rstd, dy.contiguous(), ctx.zero_centered)
    return dx, dw, None, None


torch.library.register_autograd("deltastack::rmsnorm_fwd", _rmsnorm_backward, setup_context=_rmsnorm_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, zero_centered: bool = True) -> Tensor:
    """transformers Qwen3_5RMSNorm: x * rsqrt(mean(x ** 2, -1) + eps) * (1 + weight), fp32 inside, in x's dtype
    (zero_centered=False: * weight). x: [..., D]; weight: [D]."""
    return torch.ops.deltastack.rmsnorm_fwd(x.contiguous(), weight, float(eps), bool(zero_centered))[0]


# ---------------------------------------------------------------------------------------------------- gated RMSNorm


@torch.library.custom_op("deltastack::gated_rmsnorm_fwd", mutates_args=())
def _grms_fwd(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    y, rstd = _C.gated_rmsnorm_forward(x, gate, weight, eps)
    return y, rstd


@_grms_fwd.register_fake
def _(x, gate, weight, eps):
    return _y_and_row_stats(x)


@torch.library.custom_op("deltastack::gated_rmsnorm_bwd", mutates_args=())
def _grms_bwd(x: Tensor, gate: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dx, dz, dw = _C.gated_rmsnorm_backward(x, gate, weight, rstd, dy)
    return dx, dz, dw


@_grms_bwd.register_fake
def _(x, gate, weight, rstd, dy):
    return torch.empty_like(x), torch.empty_like(gate), torch.empty_like(weight)


def _grms_setup(ctx, inputs, output):
    x, gate, weight, _ = inputs
    ctx.save_for_backward(x, gate, weight, output[1])


def _grms_backward(ctx, dy, _drstd):
    x, z, w, rstd = ctx.saved_tensors
    dx, dz, dw = torch.ops.deltastack.gated_rmsnorm_bwd(x, z, w, rstd, dy.contiguous())
    return dx, dz, dw, None


torch.library.register_autograd("deltastack::gated_rmsnorm_fwd", _grms_backward, setup_context=_grms_setup)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """transformers Qwen3_5RMSNormGated: x * rsqrt(mean(x ** 2, -1) + eps) * weight * silu(gate), fp32 inside,
    in x's dtype. x, gate: [..., D]; weight: [D]."""
    return torch.ops.deltastack.gated_rmsnorm_fwd(x.contiguous(), gate.contiguous(), weight, float(eps))[0]


# ----------------------------------------------------------------------------------------------------------- SwiGLU


@torch.library.custom_op("deltastack::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    return _C.swiglu_forward(gate, up)


@_swiglu_fwd.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("deltastack::swiglu_bwd", mutates_args=())
def _swiglu_bwd(gate: Tensor, up: Tensor, dh: Tensor) -> tuple[Tensor, Tensor]:
    dg, du = _C.swiglu_backward(gate, up, dh)
    return dg, du


@_swiglu_bwd.register_fake
def _(gate, up, dh):
    return torch.empty_like(gate), torch.empty_like(up)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dh):
    gate, up = ctx.saved_tensors
    return torch.ops.deltastack.swiglu_bwd(gate, up, dh.contiguous())


torch.library.register_autograd("deltastack::swiglu_fwd", _swiglu_backward, setup_context=_swiglu_setup)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up (transformers Qwen3_5MLP with hidden_act "silu"), same shape and dtype as gate."""
    return torch.ops.deltastack.swiglu_fwd(gate.contiguous(), up.contiguous())


# -------------------------------------------------------------------------------------- fused linear + cross-entropy


@torch.library.custom_op("deltastack::linear_ce_fwd", mutates_args=())
def _lce_fwd(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int,
    z_loss: float,
    mean: bool,
    want_grads: bool,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    loss, zpart, _count, dh, dw = _C.linear_cross_entropy_forward(hidden, weight, labels, ignore_index, z_loss, mean,
                                                                  want_grads, chunk_tokens)
    return loss, zpart, dh, dw


@_lce_fwd.register_fake
def _(hidden, weight, labels, ignore_index, z_loss, mean, want_grads, chunk_tokens):
    loss = hidden.new_empty((), dtype=torch.float32)
    if want_grads:
        return loss, torch.empty_like(loss), torch.empty_like(hidden), torch.empty_like(weight)
    return loss, torch.empty_like(loss), hidden.new_empty((0,)), weight.new_empty((0,))


def _lce_setup(ctx, inputs, output):
    ctx.want_grads = inputs[6]
    ctx.save_for_backward(output[2], output[3])


def _lce_backward(ctx, dloss, _dz, _ddh, _ddw):
    if not ctx.want_grads:
        raise RuntimeError("deltastack linear_cross_entropy: backward through a call made with want_grads=False")
    dh, dw = ctx.saved_tensors
    dl = dloss.to(torch.float32)
    return (dh * dl).to(dh.dtype), (dw * dl).to(dw.dtype), None, None, None, None, None, None


torch.library.register_autograd("deltastack::linear_ce_fwd", _lce_backward, setup_context=_lce_setup)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: str = "mean",
    chunk_tokens: int = 1024,
    return_z_loss: bool = False,
):
    """cross_entropy(hidden @ weight.T, labels, ignore_index, reduction) + z_loss * lse ** 2 (per valid token,
    reduced the same way), without materialising the [N, V] logits: the logits are made chunk_tokens rows at a time
    and the gradients of hidden and weight are computed in the forward pass (then scaled by the incoming gradient).
    hidden: [..., H]; weight: [V, H]; labels: [...] integer (already shifted for causal LM). reduction: "mean"
    (over valid labels; NaN when there is none, as torch) or "sum". Returns the loss (fp32 scalar), and with
    return_z_loss also its z-loss part."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"deltastack linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    H = hidden.shape[-1]
    h = hidden.reshape(-1, H)
    lab = labels.reshape(-1)
    want = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, zpart, _, _ = torch.ops.deltastack.linear_ce_fwd(h.contiguous(), weight.contiguous(), lab, int(ignore_index),
                                                           float(z_loss), reduction == "mean", bool(want),
                                                           int(chunk_tokens))
    return (loss, zpart) if return_z_loss else loss
