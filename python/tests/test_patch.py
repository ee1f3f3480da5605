"""transformers' Qwen3_5ForCausalLM on the HF tiny fixture (tests/fixtures/hf_qwen35_tiny_a: 3 Gated DeltaNet +
1 attention layer, fp32, CPU) patched with deltastack.torch against the same model unpatched: logits, loss and
every parameter gradient within 1e-4; the patcher's bookkeeping (what it returns, unpatch, the knobs, the
patch-at-import form); and 5 AdamW steps of a plain torch loop."""

import copy

import pytest
from conftest import require

require()
import torch  # noqa: E402
from conftest import FIXTURE, rel_l2  # noqa: E402
from safetensors.torch import load_file
from transformers.models.qwen3_5 import modeling_qwen3_5 as M

import deltastack.torch as dt
from deltastack.torch import ops as ds_ops

ORIG_FUNCS = {"torch_chunk_gated_delta_rule": M.torch_chunk_gated_delta_rule, "causal_conv1d_fn": M.causal_conv1d_fn}
ORIG_CLASS_FORWARDS = {c: c.__dict__["forward"] for c in (M.Qwen3_5RMSNorm, M.Qwen3_5RMSNormGated, M.Qwen3_5MLP,
                                                          M.Qwen3_5ForCausalLM)}
TOL = 1e-4


def make_model(device="cpu", dtype=torch.float32):
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig.from_json_file(str(FIXTURE / "config.json"))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = M.Qwen3_5ForCausalLM(config)
    missing, unexpected = model.load_state_dict(load_file(str(FIXTURE / "model.safetensors")), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model.to(device=device, dtype=dtype).train()


def inputs(device="cpu"):
    t = load_file(str(FIXTURE / "inputs.safetensors"))
    return t["input_ids"].to(device), t["labels"].to(device)


def run(model, ids, labels, **kw):
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits, out.loss.detach(), grads


def assert_model_close(a, b, tol=TOL):
    (la, lossa, ga), (lb, lossb, gb) = a, b
    assert (la - lb).abs().max().item() <= tol * max(1.0, lb.abs().max().item()), "logits"
    assert abs(lossa.item() - lossb.item()) <= tol, (lossa.item(), lossb.item())
    assert ga.keys() == gb.keys()
    for n in gb:
        scale = max(1.0, gb[n].abs().max().item())
        err = (ga[n] - gb[n]).abs().max().item()
        assert err <= tol * scale, f"grad {n}: max abs error {err:.3g}"


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of each deltastack op the patched model makes."""
    counts = {}
    for name in dt.PATCHABLE_OPS:
        fn = getattr(ds_ops, name)

        def wrapper(*a, _fn=fn, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*a, **k)

        monkeypatch.setattr(ds_ops, name, wrapper)
    return counts


def assert_restored(model):
    for name, fn in ORIG_FUNCS.items():
        assert getattr(M, name) is fn, name
    for cls, fwd in ORIG_CLASS_FORWARDS.items():
        assert cls.__dict__["forward"] is fwd, cls.__name__
    for mod in model.modules():
        assert "forward" not in mod.__dict__, type(mod).__name__


def test_patched_model_matches_unpatched(counted):
    ids, labels = inputs()
    ref_model = make_model()
    ref = run(ref_model, ids, labels)
    gold = load_file(str(FIXTURE / "outputs.safetensors"))
    assert abs(ref[1].item() - gold["loss"].item()) < 1e-4  # the unpatched model is the fixture's
    model = make_model()
    lines = dt.patch(model)
    try:
        assert len(lines) >= 6 and all(any(line.startswith(op) for line in lines) for op in dt.PATCHABLE_OPS), lines
        got = run(model, ids, labels)
        # 3 GDN layers x 2 forwards (logits, loss); norms in every layer; one loss
        assert counted.get("chunk_gated_delta_rule") == 6 and counted.get("causal_conv1d") == 6, counted
        assert counted.get("gated_rms_norm") == 6 and counted.get("swiglu") == 8, counted
        assert counted.get("rms_norm", 0) >= 18 and counted.get("linear_cross_entropy") == 1, counted
        with torch.no_grad():
            assert model(input_ids=ids, labels=labels).logits is None  # the fused loss never makes the logits
    finally:
        dt.unpatch(model)
    assert_model_close(got, ref)
    assert_restored(model)
    # unpatched again: HF's own path, the same numbers as the reference model
    assert_model_close(run(model, ids, labels), ref, tol=1e-6)


def test_num_items_in_batch_and_tuple_output():
    ids, labels = inputs()
    ref_model, model = make_model(), make_model()
    n = torch.tensor(150)
    ref = ref_model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    dt.patch(model)
    try:
        got = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
        as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
        assert isinstance(as_tuple, tuple) and torch.is_tensor(as_tuple[0])
    finally:
        dt.unpatch(model)
    assert abs(got.item() - ref.item()) <= TOL


def test_knobs_select_ops(monkeypatch, counted):
    ids, labels = inputs()
    monkeypatch.setenv("DELTASTACK_TORCH_RMS_NORM", "0")
    monkeypatch.setenv("DELTASTACK_TORCH_LINEAR_CROSS_ENTROPY", "0")
    model = make_model()
    lines = dt.patch(model, enable={"swiglu": False})
    try:
        assert not any(line.startswith(("rms_norm", "linear_cross_entropy", "swiglu")) for line in lines), lines
        assert all(not isinstance(m, (M.Qwen3_5RMSNorm, M.Qwen3_5MLP, M.Qwen3_5ForCausalLM))
                   or "forward" not in m.__dict__ for m in model.modules())
        got = run(model, ids, labels)
        assert counted.get("chunk_gated_delta_rule") and counted.get("gated_rms_norm")
        assert not counted.get("rms_norm") and not counted.get("swiglu") and not counted.get("linear_cross_entropy")
    finally:
        dt.unpatch(model)
    assert_model_close(got, run(make_model(), ids, labels))
    monkeypatch.setenv("DELTASTACK_TORCH_SWIGLU", "yes")
    with pytest.raises(ValueError, match="DELTASTACK_TORCH_SWIGLU"):
        dt.patch(make_model())
    with pytest.raises(ValueError, match="unknown op"):
        dt.patch(make_model(), enable={"softmax": True})
    monkeypatch.delenv("DELTASTACK_TORCH_SWIGLU")
    with pytest.raises(ValueError, match="holds no module"):
        dt.patch(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert_restored(model)


def test_patch_twice_and_two_models():
    a, b = make_model(), make_model()
    dt.patch(a)
    dt.patch(a)  # again: unpatched first, so one set of saved attributes
    dt.patch(b)
    dt.unpatch(a)
    assert M.torch_chunk_gated_delta_rule is not ORIG_FUNCS["torch_chunk_gated_delta_rule"]  # b still patched
    dt.unpatch(b)
    assert dt.unpatch(b) == []
    assert_restored(a)
    assert_restored(b)


def test_instance_function_references_are_rebound():
    # Some transformers versions keep the functions they took at init on the GatedDeltaNet instance.
    model = make_model()
    gdns = [m for m in model.modules() if isinstance(m, M.Qwen3_5GatedDeltaNet)]
    sentinel = object()
    for m in gdns:
        m.chunk_gated_delta_rule = ORIG_FUNCS["torch_chunk_gated_delta_rule"]
        m.causal_conv1d_fn = ORIG_FUNCS["causal_conv1d_fn"]
        m.other = sentinel
    lines = dt.patch(model)
    assert any("function reference" in line for line in lines), lines
    for m in gdns:
        assert m.chunk_gated_delta_rule is not ORIG_FUNCS["torch_chunk_gated_delta_rule"]
        assert m.causal_conv1d_fn is not ORIG_FUNCS["causal_conv1d_fn"]
    dt.unpatch(model)
    for m in gdns:
        assert m.chunk_gated_delta_rule is ORIG_FUNCS["torch_chunk_gated_delta_rule"]
        assert m.causal_conv1d_fn is ORIG_FUNCS["causal_conv1d_fn"] and m.other is sentinel


def test_patch_at_import_form(counted):
    import importlib
    import sys

    ids, labels = inputs()
    ref = run(make_model(), ids, labels)
    sys.modules.pop("deltastack.torch.autopatch", None)
    try:
        auto = importlib.import_module("deltastack.torch.autopatch")
        assert len(auto.PATCHED) >= 6
        model = make_model()  # built after the patch
        got = run(model, ids, labels)
        assert counted.get("chunk_gated_delta_rule") and counted.get("rms_norm") and counted.get("swiglu")
        assert counted.get("linear_cross_entropy") == 1
    finally:
        dt.unpatch_transformers()
    assert_model_close(got, ref)
    assert_restored(model)


def train(model, ids, labels, steps=5, adam=True):
    if adam:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("adam", [True, False], ids=["adamw", "sgd"])
def test_five_optimizer_steps(adam):
    ids, labels = inputs()
    ref_model, model = make_model(), make_model()
    ref = train(ref_model, ids, labels, adam=adam)
    dt.patch(model)
    try:
        got = train(model, ids, labels, adam=adam)
    finally:
        dt.unpatch(model)
    assert got[-1] < got[0] - 0.05, got  # it learns
    for a, b in zip(got, ref):
        assert abs(a - b) <= TOL, (got, ref)
    if adam:
        # AdamW normalises each update (m / sqrt(v)): where a gradient is ~1e-6 (layer 0's A_log, dt_bias on this
        # fixture, where HF's own fp32 gradient is 5e-3 (rel. L2) off the float64 golden grads_f64.safetensors and
        # deltastack's 4e-7) the step follows rounding noise, so the weights are compared after SGD below.
        return
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        err = (p - q).abs().max().item()
        assert err <= TOL * max(1.0, q.abs().max().item()), (n, err)


@pytest.mark.skipif(not (torch.cuda.is_available() and dt.has_cuda()), reason="needs a GPU and the CUDA build")
def test_patched_model_on_cuda_bf16():
    ids, labels = inputs("cuda")
    ref_model = make_model("cuda", torch.bfloat16)
    model = copy.deepcopy(ref_model)
    ref = run(ref_model, ids, labels)
    dt.patch(model)
    try:
        got = run(model, ids, labels)
        losses = train(model, ids, labels)
    finally:
        dt.unpatch(model)
    assert abs(got[1].item() - ref[1].item()) <= 2e-2 * abs(ref[1].item())
    assert rel_l2(got[0], ref[0]) < 3e-2
    for n in ref[2]:
        assert rel_l2(got[2][n], ref[2][n]) < 1e-1, n
    assert losses[-1] < losses[0]


def test_torch_compile_of_the_patched_model():
    ids, labels = inputs()
    model = make_model()
    dt.patch(model)
    try:
        eager = run(model, ids, labels)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        model.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=labels).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
    finally:
        dt.unpatch(model)
        torch._dynamo.reset()
    assert abs(loss.item() - eager[1].item()) <= 1e-5
    for n, g in eager[2].items():
        assert (grads[n] - g).abs().max().item() <= 1e-5 * max(1.0, g.abs().max().item()), n


def test_patched_model_bf16_on_cpu():
    # The dtype plumbing of every op (bf16 in, bf16 out, gradients in the parameters' dtypes) through the whole
    # model, on the CPU (fp32 math inside, so closer to the fp32 model than transformers' bf16 run is).
    ids, labels = inputs()
    fp32 = run(make_model(), ids, labels)
    ref = run(make_model(dtype=torch.bfloat16), ids, labels)
    model = make_model(dtype=torch.bfloat16)
    dt.patch(model)
    try:
        got = run(model, ids, labels)
    finally:
        dt.unpatch(model)
    assert all(g.dtype == torch.bfloat16 for g in got[2].values())
    assert abs(got[1].item() - fp32[1].item()) <= max(2 * abs(ref[1].item() - fp32[1].item()), 1e-2)
    assert rel_l2(got[0], fp32[0]) <= max(2 * rel_l2(ref[0], fp32[0]), 1e-2)
    for n in fp32[2]:
        assert rel_l2(got[2][n], fp32[2][n]) <= max(3 * rel_l2(ref[2][n], fp32[2][n]), 5e-2), n
