#!/usr/bin/env python3
"""Times full training steps of the PyTorch stack at the shapes `deltastack bench step` times ours, for a ratio.

The peer is Hugging Face transformers' own Qwen3.5 text model (Qwen3_5ForCausalLM, model_type qwen3_5_text) with
flash-linear-attention (fla) for its Gated DeltaNet layers (transformers 5.17 takes fla's chunk_gated_delta_rule when
`import fla` works, else its torch reference code; its conv1d comes from the causal_conv1d package when installed,
else torch's conv1d; its gated RMSNorm is torch's; the line names what was picked; scripts/device_test.sh stage
`peer-step` puts fla in .peers/site on PYTHONPATH: scripts/fetch_peers.sh), attention by PyTorch SDPA, and with
--liger on, liger-kernel's Qwen3.5 patch (fused linear cross-entropy, RMSNorm, SwiGLU; or its fused linear
cross-entropy alone where it has no qwen3_5 patch).
The model is deltastack's own: --preset P runs `deltastack plan --model P --hf-config FILE` and builds the model
from that file (or --config FILE, e.g. one written so), so the two configurations cannot drift apart; with --preset
the transformers model's parameter count must equal deltastack's (checked on the meta device before anything runs).
One step, as bench step's: zero_grad(set_to_none=True), forward on random token ids [B, S] (seed 0, one document per
row, no attention mask) with labels = the inputs (transformers shifts them), loss.backward(), grad-norm clip at 1.0
(HF Trainer's default; ours computes the norm too), AdamW (lr 1e-5, weight decay 0.1, fused) step.
--optimizer-state fp32: fp32 weights, gradients and AdamW state, bf16 compute by torch.autocast (our default, "bf16
compute, fp32 master"); bf16: weights, gradients and AdamW state in bf16 (what people do to fit 9B).
Timing: 2 warm-up steps, then --steps timed steps, each between two CUDA events; the median is reported. Peak is
torch.cuda.max_memory_allocated() over the whole run (warm-up included, no reset), i.e. PyTorch's allocations, not
the CUDA context.
fla refuses its gated backward on Hopper with Triton 3.4 .. 3.7.0 (its issue #640): --bypass-640 lifts that guard
for timing only (scripts/peer_common.py), and the line says so.
Output: `peer step <preset> seq S x B: <ms> ms/step, <tok/s> tokens/s, peak <GiB> GiB (<stack>)`, or
`peer step <preset> seq S x B: out of memory (<GiB> GiB peak) (<stack>)` with exit 0 when the step does not fit.
--dry-run: builds the model on --device (cpu works; --tiny shrinks it to 2 layers of width 64 keeping the layer
kinds and head dims) and runs one step without CUDA events, for testing this script without a GPU.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from peer_common import bypass_fla_640  # noqa: E402  scripts/peer_common.py

GiB = float(1 << 30)


def find_deltastack(given):
    """The deltastack binary: --deltastack, $DELTASTACK, then the build dirs of this checkout."""
    cands = [given, os.environ.get("DELTASTACK")] + [os.path.join(HERE, "..", d, "deltastack")
                                                      for d in ("build-device", "build")]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("peer_step: no deltastack binary to write the preset's config (--deltastack PATH, $DELTASTACK, or "
             "build/ or build-device/ of this checkout); or pass --config FILE from `deltastack plan --model P "
             "--hf-config FILE`")


def preset_config(preset, binary):
    """deltastack's own HF config.json for a preset (`plan --hf-config`), as a dict, and its parameter count."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.json")
        r = subprocess.run([binary, "plan", "--model", preset, "--hf-config", path], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"peer_step: `{binary} plan --model {preset} --hf-config` failed:\n{r.stdout}{r.stderr}")
        with open(path) as f:
            cfg = json.load(f)
    m = re.search(r"(\d+) parameters\) written", r.stdout)
    if not m:
        print(f"peer_step: no parameter count in `plan --hf-config`'s output ({r.stdout.strip()}): not compared",
              flush=True)
    return cfg, int(m[1]) if m else None


def tiny(cfg):
    """The same kinds of layer at a CPU-sized width: 2 layers (the first GDN, the last full attention), width 64."""
    cfg = dict(cfg)
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512,
               layer_types=["linear_attention", "full_attention"])
    cfg.pop("eos_token_id", None)  # outside the small vocabulary
    return cfg


def build_config(cfg_dict):
    """transformers' config object of that dict; the keys it does not know (deltastack's are all known) are returned."""
    from transformers import AutoConfig

    mt = cfg_dict.get("model_type")
    if mt != "qwen3_5_text":
        sys.exit(f"peer_step: model_type {mt!r}: expected deltastack's text config 'qwen3_5_text'")
    kwargs = {k: v for k, v in cfg_dict.items() if k != "model_type"}
    config = AutoConfig.for_model(mt, **kwargs)
    known = set(type(config)().to_dict()) | {"architectures", "dtype", "torch_dtype"}
    return config, sorted(set(cfg_dict) - known)


def kernel_modules():
    """The modules of the implementations transformers' Qwen3.5 picked for its gated delta rule and its conv1d."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    def impl(fn, depth=0):  # the `implementation` its hub-kernel fallback wrapper closes over
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        if code is None or depth > 4:
            return None
        free = dict(zip(code.co_freevars, cells))
        if "implementation" in free:
            return free["implementation"].cell_contents
        for c in cells:
            try:
                v = c.cell_contents
            except ValueError:
                continue
            if callable(v) and (r := impl(v, depth + 1)) is not None:
                return r
        return None

    out = []
    for fn in (m.torch_chunk_gated_delta_rule, m.causal_conv1d_fn):
        f = impl(fn)
        out.append("?" if f is None else f"{f.__module__}.{f.__name__}")
    return out


def apply_liger():
    """Liger's Qwen3.5 patch (before the model is built); else its fused linear cross-entropy alone (our loss)."""
    import liger_kernel
    from liger_kernel.transformers import monkey_patch

    ver = getattr(liger_kernel, "__version__", None)
    if ver is None:
        try:
            from importlib.metadata import version
            ver = version("liger-kernel")
        except Exception:
            ver = "?"
    fn = getattr(monkey_patch, "apply_liger_kernel_to_qwen3_5", None)
    if fn is not None:
        fn(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True)
        return f"liger {ver}: fused linear CE, RMSNorm, SwiGLU", None
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    return f"liger {ver}: fused linear CE only (no qwen3_5 patch)", LigerFusedLinearCrossEntropyLoss()


def run(args, config, own_loss, label, desc, mark, prepare=None):
    """Builds the model and the optimizer on args.device and times the steps (or, with --dry-run, runs one).
    prepare(model), when given, runs on the built model before the optimizer is made (scripts/torch_step.py: the
    deltastack.torch patch)."""
    from transformers import Qwen3_5ForCausalLM

    cuda = args.device.startswith("cuda")
    bf16_state = args.optimizer_state == "bf16"
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if bf16_state else torch.float32
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t0 = time.time()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with dev:
            model = Qwen3_5ForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.to(device=dev, dtype=dtype)
    model.config._attn_implementation = "sdpa"
    model.train()
    if prepare is not None:
        prepare(model)
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, fused=cuda, foreach=None if cuda else True)
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, S = args.micro_batch, args.seq_len
    ids = torch.randint(0, config.vocab_size, (B, S), generator=gen).to(dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not bf16_state)

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            if own_loss is None:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            else:  # Liger's fused linear CE on the final hidden states: no logits
                h = model.model(input_ids=ids, use_cache=False).last_hidden_state
                loss = own_loss(model.lm_head.weight, h[:, :-1].reshape(-1, h.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss, norm

    if args.dry_run:
        loss, norm = step()
        grads = sum(p.grad is not None for p in model.parameters())
        print(f"{label}: dry run on {dev}: {n_params / 1e9:.4f}B parameters ({dtype}), {config.num_hidden_layers} "
              f"layers {''.join('A' if t == 'full_attention' else 'L' for t in config.layer_types)}, loss "
              f"{loss.item():.4f}, grad norm {norm.item():.4f}, {grads} gradients, built and stepped in "
              f"{time.time() - t0:.1f} s ({desc})", flush=True)
        return

    print(f"peer: {type(model).__name__} {n_params / 1e9:.2f}B parameters, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}; built in {time.time() - t0:.1f} s", flush=True)
    for _ in range(2):
        loss, _ = step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss, norm = step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ms = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / GiB
    print(f"peer: last step loss {loss.item():.4f} grad_norm {norm.item():.3f}; steps (ms) "
          f"{' '.join(f'{t:.1f}' for t in times)}", flush=True)
    print(f"{label}: {ms:.1f} ms/step, {B * S / (ms / 1e3):.0f} tokens/s, peak {peak:.1f} GiB ({desc}){mark}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=["0.8b", "2b", "9b"], help="deltastack's preset (its config via plan --hf-config)")
    src.add_argument("--config", help="an HF config.json deltastack wrote (`deltastack plan --model P --hf-config FILE`)")
    ap.add_argument("--deltastack", help="the deltastack binary for --preset (default: $DELTASTACK, build-device/, build/)")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps, after 2 warm-up steps")
    ap.add_argument("--liger", nargs="?", choices=["on", "off"], default="off", const="on",
                    help="liger-kernel's Qwen3.5 kernels (--liger alone: on)")
    ap.add_argument("--optimizer-state", choices=["fp32", "bf16"], default="fp32",
                    help="fp32: fp32 master weights and AdamW state, bf16 autocast; bf16: all in bf16")
    ap.add_argument("--grad-checkpointing", action="store_true", help="transformers' gradient checkpointing (per layer)")
    ap.add_argument("--bypass-640", action="store_true", help="lift fla's #640 guard (timing only)")
    ap.add_argument("--allow-torch-fallback", action="store_true",
                    help="run without fla (transformers' torch GDN: slow, and out of memory at long sequences)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="build the model and run one step, no timing (CPU works)")
    ap.add_argument("--tiny", action="store_true", help="with --dry-run: a 2-layer width-64 model of the same kinds")
    args = ap.parse_args()
    name = args.preset or os.path.basename(args.config)
    label = f"peer step {name} seq {args.seq_len} x {args.micro_batch}"
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("peer_step: no CUDA device (--device cpu --dry-run tests the script without one)")
    if not args.dry_run and not cuda:
        sys.exit("peer_step: timing needs --device cuda (use --dry-run on a CPU)")
    if args.tiny and not args.dry_run:
        sys.exit("peer_step: --tiny is for --dry-run only")

    os.environ.setdefault("FLA_TILELANG", "0")
    import transformers

    if args.config:
        with open(args.config) as f:
            cfg_dict = json.load(f)
        want = None
    else:
        cfg_dict, want = preset_config(args.preset, find_deltastack(args.deltastack))
    if want is not None:  # the same model as ours: parameter counts equal (on the meta device: no memory)
        from transformers import Qwen3_5ForCausalLM

        with torch.device("meta"):
            got = sum(p.numel() for p in Qwen3_5ForCausalLM(build_config(cfg_dict)[0]).parameters())
        if got != want:
            sys.exit(f"peer_step: transformers' model of {args.preset} has {got} parameters, deltastack's {want}")
    if args.tiny:
        cfg_dict = tiny(cfg_dict)
    config, unknown = build_config(cfg_dict)
    if unknown:
        print(f"peer_step: keys transformers' {type(config).__name__} does not know: {', '.join(unknown)}", flush=True)

    # The stack: transformers takes chunk_gated_delta_rule from fla when `import fla` works (else its torch reference
    # code), causal_conv1d_fn from Dao's causal_conv1d package when installed (else torch's conv1d).
    gdn, conv = kernel_modules()
    stack = [f"transformers {transformers.__version__}"]
    if gdn.startswith("fla"):
        import fla
        stack.append(f"fla {getattr(fla, '__version__', '?')} GDN")
    elif args.allow_torch_fallback:
        stack.append("torch GDN (no fla)")
    else:
        sys.exit("peer_step: flash-linear-attention (fla) is not importable: transformers would silently run its torch "
                 "Gated DeltaNet, which runs out of memory at these shapes (put fla on PYTHONPATH, e.g. .peers/site; "
                 "or --allow-torch-fallback)")
    stack.append("causal_conv1d conv" if conv.startswith("causal_conv1d") else "torch conv1d")
    stack.append("sdpa")
    own_loss = None
    if args.liger == "on":
        what, own_loss = apply_liger()
        stack.append(what)
    bypassed = bool(args.bypass_640 and gdn.startswith("fla") and bypass_fla_640())
    bf16_state = args.optimizer_state == "bf16"
    stack.append("bf16 weights + AdamW state" if bf16_state else "fp32 master + AdamW state, bf16 autocast")
    if args.grad_checkpointing:
        stack.append("gradient checkpointing")
    stack.append("peak over the whole run")

    desc = ", ".join(stack)
    mark = " (#640 guard bypassed: timing only)" if bypassed else ""
    try:
        run(args, config, own_loss, label, desc, mark)
    except torch.cuda.OutOfMemoryError:  # building the model, or a step
        peak = torch.cuda.max_memory_allocated() / GiB
        print(f"{label}: out of memory ({peak:.1f} GiB peak) ({desc}){mark}", flush=True)


if __name__ == "__main__":
    main()
