"""Each deltastack op against torch autograd of transformers' own Qwen3.5 math (its functions and modules, called on
the same inputs): outputs and every input gradient. CPU: deltastack's fp32 reference; CUDA (where present): the
kernels, bf16 inside, with bf16 tolerances."""

import pytest
from conftest import require

require()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import assert_close, devices  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as M

import deltastack.torch as dt

# transformers' functions as they are before any patch (a patch test replaces the module attributes).
HF_CHUNK = M.torch_chunk_gated_delta_rule
HF_CONV = M.causal_conv1d_fn
HF_L2NORM = M.l2norm


def leaves(*ts, device="cpu", dtype=torch.float32):
    return [t.detach().to(device=device, dtype=dtype).requires_grad_() for t in ts]


def grads(out, inputs, upstream):
    return torch.autograd.grad(out, inputs, upstream, allow_unused=True)


def gdn_inputs(B, T, Hk, Hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, dk, generator=gen)
    k = torch.randn(B, T, Hk, dk, generator=gen)
    v = torch.randn(B, T, Hv, dv, generator=gen)
    g = -F.softplus(torch.randn(B, T, Hv, generator=gen)) * 0.5  # log decay < 0, as -exp(A_log) * softplus(.)
    beta = torch.rand(B, T, Hv, generator=gen)
    return q, k, v, g, beta


def hf_gdn(q, k, v, g, beta, initial_state=None, output_final_state=False):
    # transformers repeats q / k to the value heads before its torch_chunk_gated_delta_rule (Qwen3_5GatedDeltaNet).
    r = v.shape[2] // q.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    return HF_CHUNK(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("gva", [1, 2])
def test_chunk_gated_delta_rule(device, gva):
    dk = dv = 128 if device == "cuda" else 16
    q, k, v, g, beta = gdn_inputs(2, 70, 2, 2 * gva, dk, dv)  # 70 tokens: a partial second chunk
    h0 = torch.randn(2, 2 * gva, dk, dv) * 0.1
    do = torch.randn(2, 70, 2 * gva, dv)
    dfs = torch.randn(2, 2 * gva, dk, dv)
    ref_in = leaves(q, k, v, g, beta, h0)
    o_ref, fs_ref = hf_gdn(*ref_in[:5], initial_state=ref_in[5], output_final_state=True)
    ref_g = grads((o_ref, fs_ref), ref_in, (do, dfs))
    ds_in = leaves(q, k, v, g, beta, h0, device=device)
    o, fs = dt.chunk_gated_delta_rule(*ds_in[:5], initial_state=ds_in[5], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    ds_g = grads((o, fs), ds_in, (do.to(device), dfs.to(device)))
    assert o.dtype == q.dtype and fs.dtype == torch.float32
    assert_close(o, o_ref, device, "o")
    assert_close(fs, fs_ref, device, "final_state")
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dinitial_state"], ds_g, ref_g):
        assert_close(a, b, device, name, rtol=2e-4, atol=2e-5, bf16_rel=5e-2)


@pytest.mark.parametrize("device", devices())
def test_chunk_gated_delta_rule_no_state(device):
    dk = dv = 128 if device == "cuda" else 32
    q, k, v, g, beta = gdn_inputs(1, 130, 1, 2, dk, dv, seed=1)
    do = torch.randn(1, 130, 2, dv)
    ref_in = leaves(q, k, v, g, beta)
    o_ref, _ = hf_gdn(*ref_in)
    ref_g = grads(o_ref, ref_in, do)
    ds_in = leaves(q, k, v, g, beta, device=device)
    o, fs = dt.chunk_gated_delta_rule(*ds_in, use_qk_l2norm_in_kernel=True)
    assert fs is None
    ds_g = grads(o, ds_in, do.to(device))
    assert_close(o, o_ref, device, "o")
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], ds_g, ref_g):
        assert_close(a, b, device, name, rtol=2e-4, atol=2e-5, bf16_rel=5e-2)


@pytest.mark.parametrize("device", devices())
def test_chunk_gated_delta_rule_cu_seqlens(device):
    # Packed sequences (fla's cu_seqlens, B = 1): each one equals transformers' function on that sequence alone,
    # from its own initial state, with its own final state.
    dk = dv = 128 if device == "cuda" else 16
    lengths = [5, 64, 0, 71]
    T = sum(lengths)
    q, k, v, g, beta = gdn_inputs(1, T, 2, 4, dk, dv, seed=2)
    h0 = torch.randn(len(lengths), 4, dk, dv) * 0.1
    do = torch.randn(1, T, 4, dv)
    dfs = torch.randn(len(lengths), 4, dk, dv)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    ref_in = leaves(q, k, v, g, beta, h0)
    outs, states = [], []
    for s, (a, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        seg = [t[:, a:a + n] for t in ref_in[:5]]
        if n == 0:
            outs.append(seg[2] * 0)
            states.append(ref_in[5][s:s + 1] * 1)
            continue
        o_s, fs_s = hf_gdn(*seg, initial_state=ref_in[5][s:s + 1], output_final_state=True)
        outs.append(o_s)
        states.append(fs_s)
    o_ref, fs_ref = torch.cat(outs, 1), torch.cat(states, 0)
    ref_g = grads((o_ref, fs_ref), ref_in, (do, dfs))
    ds_in = leaves(q, k, v, g, beta, h0, device=device)
    o, fs = dt.chunk_gated_delta_rule(*ds_in[:5], initial_state=ds_in[5], output_final_state=True,
                                      cu_seqlens=cu.to(device), use_qk_l2norm_in_kernel=True)
    ds_g = grads((o, fs), ds_in, (do.to(device), dfs.to(device)))
    assert_close(o, o_ref, device, "o")
    assert_close(fs, fs_ref, device, "final_state")
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dinitial_state"], ds_g, ref_g):
        assert_close(a, b, device, name, rtol=2e-4, atol=2e-5, bf16_rel=5e-2)


@pytest.mark.parametrize("device", devices())
def test_l2norm(device):
    x = torch.randn(3, 7, 2, 16, dtype=torch.float64)
    dy = torch.randn_like(x)
    (xr,) = leaves(x, dtype=torch.float64)
    yr = HF_L2NORM(xr, dim=-1, eps=1e-6)
    (gr,) = grads(yr, [xr], dy)
    (xd,) = leaves(x, device=device)
    y = dt.l2norm(xd)
    (gd,) = grads(y, [xd], dy.to(device, torch.float32))
    assert_close(y, yr, device, "y")
    assert_close(gd, gr, device, "dx")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("packed", [False, True])
def test_causal_conv1d(device, packed):
    B, T, C, K = (1, 37, 24, 4) if packed else (2, 19, 24, 4)
    x = torch.randn(B, T, C, dtype=torch.float64)
    w = torch.randn(C, K, dtype=torch.float64) * 0.5
    dy = torch.randn_like(x)
    xr, wr = leaves(x, w, dtype=torch.float64)
    if packed:
        cu = torch.tensor([0, 10, 10, 30, 37], dtype=torch.int32)
        parts = [HF_CONV(xr[:, a:b].transpose(1, 2), wr, None, activation="silu").transpose(1, 2)
                 for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
        yr = torch.cat(parts, 1)
    else:
        cu = None
        yr = HF_CONV(xr.transpose(1, 2), wr, None, activation="silu").transpose(1, 2)
    gr = grads(yr, [xr, wr], dy)
    xd, wd = leaves(x, w, device=device)
    y = dt.causal_conv1d(xd, wd, cu_seqlens=None if cu is None else cu.to(device))
    gd = grads(y, [xd, wd], dy.to(device, torch.float32))
    assert_close(y, yr, device, "y")
    assert_close(gd[0], gr[0], device, "dx")
    assert_close(gd[1], gr[1], device, "dweight")


@pytest.mark.parametrize("device", devices())
def test_rms_norm(device):
    x = torch.randn(4, 9, 64)
    dy = torch.randn_like(x)
    ref = M.Qwen3_5RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64) * 0.3)
    (xr,) = leaves(x)
    yr = ref(xr)
    gr = grads(yr, [xr, ref.weight], dy)
    xd, wd = leaves(x, ref.weight, device=device)
    y = dt.rms_norm(xd, wd, eps=1e-6)
    gd = grads(y, [xd, wd], dy.to(device))
    assert_close(y, yr, device, "y")
    assert_close(gd[0], gr[0], device, "dx")
    assert_close(gd[1], gr[1], device, "dweight", rtol=2e-4, atol=1e-4)


@pytest.mark.parametrize("device", devices())
def test_rms_norm_plain(device):
    x = torch.randn(5, 32, dtype=torch.float64)
    w = torch.randn(32, dtype=torch.float64)
    dy = torch.randn_like(x)
    xr, wr = leaves(x, w, dtype=torch.float64)
    yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
    gr = grads(yr, [xr, wr], dy)
    xd, wd = leaves(x, w, device=device)
    y = dt.rms_norm(xd, wd, eps=1e-6, zero_centered=False)
    gd = grads(y, [xd, wd], dy.to(device, torch.float32))
    assert_close(y, yr, device, "y")
    assert_close(gd[0], gr[0], device, "dx")
    assert_close(gd[1], gr[1], device, "dweight")


@pytest.mark.parametrize("device", devices())
def test_gated_rms_norm(device):
    x = torch.randn(6, 4, 16)
    z = torch.randn(6, 4, 16)
    dy = torch.randn_like(x)
    ref = M.Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(1 + torch.randn(16) * 0.3)
    xr, zr = leaves(x, z)
    yr = ref(xr, zr)
    gr = grads(yr, [xr, zr, ref.weight], dy)
    xd, zd, wd = leaves(x, z, ref.weight, device=device)
    y = dt.gated_rms_norm(xd, zd, wd, eps=1e-6)
    gd = grads(y, [xd, zd, wd], dy.to(device))
    assert_close(y, yr, device, "y")
    for name, a, b in zip(["dx", "dgate", "dweight"], gd, gr):
        assert_close(a, b, device, name, rtol=2e-4, atol=1e-4)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("width", [40, 37])  # CUDA: 8-wide loads, and the scalar path (37 % 8 != 0)
def test_swiglu(device, width):
    gate = torch.randn(3, 11, width, dtype=torch.float64) * 3
    up = torch.randn(3, 11, width, dtype=torch.float64)
    dh = torch.randn_like(gate)
    gr_, ur = leaves(gate, up, dtype=torch.float64)
    act = M.ACT2FN["silu"]
    hr = act(gr_) * ur
    gr = grads(hr, [gr_, ur], dh)
    gd_, ud = leaves(gate, up, device=device)
    h = dt.swiglu(gd_, ud)
    gd = grads(h, [gd_, ud], dh.to(device, torch.float32))
    assert_close(h, hr, device, "h")
    assert_close(gd[0], gr[0], device, "dgate")
    assert_close(gd[1], gr[1], device, "dup")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction,z_loss,ignore_index", [("mean", 0.0, -100), ("sum", 0.0, -100),
                                                            ("mean", 1e-2, -1), ("sum", 3e-3, -100)])
def test_linear_cross_entropy(device, reduction, z_loss, ignore_index):
    N, H, V = 45, 32, 97
    h = torch.randn(N, H, dtype=torch.float64)
    W = torch.randn(V, H, dtype=torch.float64) * 0.2
    labels = torch.randint(0, V, (N,))
    labels[::4] = ignore_index
    hr, wr = leaves(h, W, dtype=torch.float64)
    logits = hr @ wr.T
    ce = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)
    valid = labels != ignore_index
    lse2 = torch.logsumexp(logits, -1).pow(2)[valid]
    ref = ce + z_loss * (lse2.mean() if reduction == "mean" else lse2.sum())
    gr = grads(ref, [hr, wr], torch.tensor(1.7, dtype=torch.float64))
    hd, wd = leaves(h, W, device=device)
    loss = dt.linear_cross_entropy(hd, wd, labels.to(device), ignore_index=ignore_index, z_loss=z_loss,
                                   reduction=reduction, chunk_tokens=16)  # several chunks
    gd = grads(loss, [hd, wd], torch.tensor(1.7, device=device))
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert_close(loss, ref, device, "loss", bf16_rel=1e-2)
    assert_close(gd[0], gr[0], device, "dhidden")
    assert_close(gd[1], gr[1], device, "dweight")


def test_linear_cross_entropy_batched_and_no_grad():
    h = torch.randn(2, 5, 8)
    W = torch.randn(11, 8)
    labels = torch.randint(0, 11, (2, 5))
    ref = F.cross_entropy((h @ W.T).reshape(-1, 11), labels.reshape(-1))
    with torch.no_grad():
        loss = dt.linear_cross_entropy(h, W, labels)
    assert abs(loss.item() - ref.item()) < 1e-5
    all_ignored = torch.full((2, 5), -100)
    assert torch.isnan(dt.linear_cross_entropy(h, W, all_ignored))  # a mean over nothing, as torch


def test_bf16_on_cpu_keeps_dtype():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(64, dtype=torch.bfloat16)
    y = dt.rms_norm(x, w)
    assert y.dtype == torch.bfloat16
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert (y.float() - ref.float()).abs().max() <= 1e-2


@pytest.mark.parametrize("call,match", [
    (lambda: dt.rms_norm(torch.randn(3, 8), torch.randn(7)), "weight must have shape"),
    (lambda: dt.gated_rms_norm(torch.randn(3, 8), torch.randn(3, 9), torch.randn(8)), "gate must have shape"),
    (lambda: dt.swiglu(torch.randn(3, 8), torch.randn(3, 7)), "up must have shape"),
    (lambda: dt.causal_conv1d(torch.randn(1, 5, 8), torch.randn(9, 4)), "weight must be"),
    (lambda: dt.causal_conv1d(torch.randn(2, 5, 8), torch.randn(8, 4), cu_seqlens=torch.tensor([0, 5])),
     "batch size 1"),
    (lambda: dt.causal_conv1d(torch.randn(1, 5, 8), torch.randn(8, 4), cu_seqlens=torch.tensor([0, 4])),
     r"cu_seqlens\[1\] = 4, the last entry, must be the token count 5"),
    # An interior entry past T (issue 25): refused before any entry is used as an index.
    (lambda: dt.causal_conv1d(torch.randn(1, 5, 8), torch.randn(8, 4), cu_seqlens=torch.tensor([0, 100000, 5])),
     r"cu_seqlens\[1\] = 100000 is outside \[0, 5\]"),
    (lambda: dt.chunk_gated_delta_rule(*gdn_inputs(1, 8, 2, 2, 16, 16), cu_seqlens=torch.tensor([0, -5, 8])),
     r"cu_seqlens\[1\] = -5 is outside \[0, 8\]"),
    (lambda: dt.chunk_gated_delta_rule(*gdn_inputs(1, 8, 2, 2, 16, 16)[:4], torch.rand(1, 8, 3)), "beta"),
    (lambda: dt.chunk_gated_delta_rule(*gdn_inputs(1, 8, 2, 3, 16, 16)), "multiple of the key heads"),
    (lambda: dt.chunk_gated_delta_rule(*gdn_inputs(1, 8, 2, 2, 16, 16), initial_state=torch.zeros(2, 2, 16, 16)),
     "initial_state must have shape"),
    (lambda: dt.chunk_gated_delta_rule(torch.randn(1, 8, 2, 16, dtype=torch.float64).int(),
                                       *gdn_inputs(1, 8, 2, 2, 16, 16)[1:]), "q must be a floating"),
    (lambda: dt.linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.tensor([0, 1, 5, -100])),
     "labels must be ignore_index"),
    (lambda: dt.linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 7), torch.zeros(4, dtype=torch.long)),
     "weight must be"),
])
def test_argument_errors_name_the_argument(call, match):
    with pytest.raises((RuntimeError, ValueError), match=match):
        call()


def test_unsupported_arguments_are_value_errors():
    with pytest.raises(ValueError, match="bias"):
        dt.causal_conv1d(torch.randn(1, 5, 8), torch.randn(8, 4), bias=torch.zeros(8))
    with pytest.raises(ValueError, match="activation"):
        dt.causal_conv1d(torch.randn(1, 5, 8), torch.randn(8, 4), activation=None)
    with pytest.raises(ValueError, match="reduction"):
        dt.linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long),
                                reduction="none")


# torch.library.opcheck: schema, fake kernels, autograd registration and AOT dispatch of every custom op.
def _opcheck_cases(device):
    q, k, v, g, beta = [t.to(device).requires_grad_() for t in gdn_inputs(1, 20, 1, 2, 16, 16)]
    x3 = torch.randn(2, 6, 8, device=device, requires_grad=True)
    w = torch.randn(8, device=device, requires_grad=True)
    return [
        ("gdn_fwd", (q, k, v, g, beta, 0.25, None, None, False)),
        ("l2norm_fwd", (x3, 1e-6)),
        ("conv1d_fwd", (x3, torch.randn(8, 4, device=device, requires_grad=True), None)),
        ("rmsnorm_fwd", (x3, w, 1e-6, True)),
        ("gated_rmsnorm_fwd", (x3, torch.randn(2, 6, 8, device=device, requires_grad=True), w, 1e-6)),
        ("swiglu_fwd", (x3, torch.randn(2, 6, 8, device=device, requires_grad=True))),
        # A backward op on its own too: its schema check catches outputs that alias each other or an input.
        ("swiglu_bwd", tuple(torch.randn(2, 6, 8, device=device) for _ in range(3))),
        ("linear_ce_fwd", (torch.randn(6, 8, device=device, requires_grad=True),
                           torch.randn(5, 8, device=device, requires_grad=True),
                           torch.tensor([0, 1, 4, -100, 2, 3], device=device), -100, 0.0, True, True, 1024)),
    ]


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    for name, args in _opcheck_cases(device):
        op = getattr(torch.ops.deltastack, name).default
        # Every check (schema, autograd registration, fake kernel, AOT dispatch with static and dynamic shapes), but
        # for the CUDA gated delta rule's dynamic-shape check: its fake kernel asks the C++ plan for its buffer sizes,
        # which specialises the shapes.
        utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")
        if device == "cuda" and name == "gdn_fwd":
            torch.library.opcheck(op, args, test_utils=utils)
        else:
            torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", devices())
def test_torch_compile_traces_the_ops(device):
    # fullgraph: each op must trace as one node through its fake kernel (no graph break), forward and backward.
    def block(x, w, gate, up, wg):
        h = dt.rms_norm(x, w)
        h = dt.gated_rms_norm(h, gate, wg)
        return dt.swiglu(h, up)

    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    gate = torch.randn(4, 16, device=device)
    up = torch.randn(4, 16, device=device)
    wg = torch.randn(16, device=device, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out_c = compiled(x, w, gate, up, wg)
    g_c = torch.autograd.grad(out_c.sum(), [x, w, wg])
    out_e = block(x, w, gate, up, wg)
    g_e = torch.autograd.grad(out_e.sum(), [x, w, wg])
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)

    q, k, v, gg, beta = [t.to(device).requires_grad_() for t in gdn_inputs(1, 20, 1, 2, 16, 16)]
    f = torch.compile(lambda *a: dt.chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True)[0],
                      backend="aot_eager", fullgraph=True)
    o_c = f(q, k, v, gg, beta)
    o_e = dt.chunk_gated_delta_rule(q, k, v, gg, beta, use_qk_l2norm_in_kernel=True)[0]
    torch.testing.assert_close(o_c, o_e)
    torch.testing.assert_close(torch.autograd.grad(o_c.sum(), [q, v]), torch.autograd.grad(o_e.sum(), [q, v]))
