#!/usr/bin/env python3
"""Times full training steps of the strongest PyTorch stack at the shapes `deltastack bench step` times ours.

The peer is Hugging Face transformers' own Qwen3.5 text model (Qwen3_5ForCausalLM, model_type qwen3_5_text), run the
way its users get the most from it (the configuration measured on the H200 on 2026-12-02):
  gated delta rule  fla's chunk_gated_delta_rule (q/k l2norm in the kernel), in place of transformers' module function
  short conv        fla's causal_conv1d (Triton) with SiLU, in place of transformers' causal_conv1d_fn
  gated RMSNorm     fla's FusedRMSNormGated (silu gate), in place of transformers' Qwen3_5RMSNormGated
  loss, norms, MLP  liger-kernel's Qwen3.5 patch: fused linear cross-entropy (no logits), RMSNorm, SwiGLU
  attention         PyTorch SDPA
  optimizer         torch.optim.AdamW(fused=True), lr 1e-5, weight decay 0.1; no gradient checkpointing
Rows (each in its own process, so one's memory or out-of-memory does not touch the other):
  peer-bf16         bf16 parameters, gradients and AdamW state (measured 2026-12-02: 2B seq 8192 x 2 460.9 ms/step,
                    44.9 GiB; 9B seq 8192 x 1 825.6 ms/step, 94.9 GiB)
  peer-fp32master   fp32 parameters, gradients and AdamW state, bf16 torch.autocast (deltastack's default state)
The kernels are installed into transformers' modeling_qwen3_5 before the model is built (the GatedDeltaNet forward
looks the two functions up at call time and builds its gated norm from the module's class); Liger's patch is applied
to the built model. Each installed kernel counts its calls, and a row whose first step did not call all three stops
with an error: a peer that silently fell back to transformers' torch code is never reported.
fla refuses its gated backward on Hopper with Triton 3.4 .. 3.7.0 (its issue #640): the guard is lifted by default
for timing only (scripts/peer_common.py; the gradients are the ones #640 says are wrong) and the line says so;
--no-bypass-640 keeps it.
The model is deltastack's own: --preset P runs `deltastack plan --model P --hf-config FILE` and builds the model
from that file (or --config FILE, e.g. one written so), so the two configurations cannot drift apart; with --preset
the transformers model's parameter count must equal deltastack's (checked on the meta device before anything runs).
One step: forward on random token ids [B, S] (seed 0, one document per row, no attention mask, use_cache=False)
with labels = the inputs (transformers shifts them), loss.backward(), optional grad-norm clip (--max-grad-norm; off,
as measured on 2026-12-02), optimizer step, zero_grad(set_to_none=True).
Timing: --warmup steps (2), then --steps timed steps (5), each between two CUDA events; the median is reported.
Peak is torch.cuda.max_memory_allocated() from just before the first step (the model and the optimizer built) to
the end, i.e. PyTorch's allocations, not the CUDA context. The result line also gives reserved_gib
(torch.cuda.max_memory_reserved) and device_used_gib: total minus free device memory after the timed steps
(torch.cuda.mem_get_info; the context, the libraries and the allocator's reserve included), the measure deltastack's
own peak uses.
Output per row: `peer step <preset> seq S x B <row>: <ms> ms/step, <tok/s> tokens/s, peak <GiB> GiB (<stack>)` (or
`... <row>: out of memory (<GiB> GiB peak) (<stack>)`, exit 0), and one machine-readable line
`step_result {"label": ..., "row": ..., "ms_per_step": ..., "tokens_per_s": ..., "peak_gib": ..., ...}` (JSON;
status "ok" or "out of memory").
--dry-run builds the model and runs one step without timing (with --tiny: 2 layers of width 64 keeping the layer
kinds and head dims), on CUDA: the peer's kernels are Triton kernels.

  python3 scripts/peer_step.py --preset 2b --seq-len 8192 --micro-batch 2      # both rows
  python3 scripts/peer_step.py --preset 9b --seq-len 8192 --micro-batch 1 --rows peer-bf16
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
ROWS = {"peer-bf16": "bf16", "peer-fp32master": "fp32"}  # row -> optimizer state (parameters, gradients, AdamW)


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
    """The same kinds of layer at a small width: 2 layers (the first GDN, the last full attention), width 64."""
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


def resolve_config(args, prog):
    """The HF config file of --preset (written by `deltastack plan --hf-config` into a temporary file, checked against
    deltastack's parameter count) or --config, as (path, name, temporary path to delete or None)."""
    if args.config:
        return os.path.abspath(args.config), os.path.basename(args.config), None
    cfg, want = preset_config(args.preset, find_deltastack(args.deltastack))
    if want is not None:  # the same model as ours: parameter counts equal (on the meta device: no memory)
        from transformers import Qwen3_5ForCausalLM

        with torch.device("meta"):
            got = sum(p.numel() for p in Qwen3_5ForCausalLM(build_config(cfg)[0]).parameters())
        if got != want:
            sys.exit(f"{prog}: transformers' model of {args.preset} has {got} parameters, deltastack's {want}")
    fd, tmp = tempfile.mkstemp(suffix=".json", prefix=f"{prog}_")
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f)
    return tmp, args.preset, tmp


def each_in_own_process(script, argv, flag, values):
    """Runs `python3 script argv flag value` for each value, one process each, in order; the OR of their exit codes."""
    rc = 0
    for v in values:
        rc |= subprocess.run([sys.executable, os.path.abspath(script)] + argv + [flag, v]).returncode
    return rc


def version_of(module, dist):
    """A package's version: module.__version__, else its installed distribution's metadata, else '?'."""
    ver = getattr(module, "__version__", None)
    if ver is None:
        try:
            from importlib.metadata import version
            ver = version(dist)
        except Exception:
            ver = "?"
    return ver


# Calls of the installed fla kernels (install_fla_kernels): a row checks each is non-zero after its first step.
FLA_CALLS = {"chunk_gated_delta_rule": 0, "causal_conv1d": 0, "FusedRMSNormGated": 0}


def install_fla_kernels():
    """fla's gated delta rule, causal conv1d and gated RMSNorm in transformers' Qwen3.5 module (before the model is
    built: the gated norm is built from the module's class). Returns the stack's description and bind(model), which
    puts the functions on a built model's instances too. Needs fla >= 0.5 (grouped value heads: 9B's 16 key heads for
    32 value heads)."""
    import fla
    from fla.modules import FusedRMSNormGated
    from fla.modules.conv import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    def gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        # transformers' arguments: q, k [B, T, Hk, dk], v [B, T, Hv, dv], g, beta [B, T, Hv]; scale dk^-0.5 (fla's
        # default, as transformers' own code). chunk_size is fla's own (64).
        FLA_CALLS["chunk_gated_delta_rule"] += 1
        return chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)

    def conv1d(hidden_states, weight, bias=None, activation=None, **kwargs):
        # transformers passes x [B, C, T] and the depthwise weight [C, K]; fla takes x [B, T, C] and returns
        # (y, final state). The weight is cast to x's dtype, as torch.autocast casts a conv's weight (a no-op in bf16).
        FLA_CALLS["causal_conv1d"] += 1
        y = causal_conv1d(hidden_states.transpose(1, 2), weight=weight.to(hidden_states.dtype),
                          bias=None if bias is None else bias.to(hidden_states.dtype), activation=activation)
        y = y[0] if isinstance(y, tuple) else y
        return y.transpose(1, 2)

    class GatedRMSNorm(FusedRMSNormGated):
        """fla's fused RMSNorm(x) * weight * silu(gate) with transformers' Qwen3_5RMSNormGated constructor."""

        def __init__(self, hidden_size, eps=1e-6, **kwargs):
            super().__init__(hidden_size, eps=eps, activation="silu")

        def forward(self, x, gate):
            FLA_CALLS["FusedRMSNormGated"] += 1
            return super().forward(x, gate)

    m.torch_chunk_gated_delta_rule = gated_delta_rule
    m.causal_conv1d_fn = conv1d
    m.Qwen3_5RMSNormGated = GatedRMSNorm

    def bind(model):
        """The same functions on a built model's GatedDeltaNet instances, for transformers versions that keep
        references to them as instance attributes set at init."""
        for mod in model.modules():
            if isinstance(mod, m.Qwen3_5GatedDeltaNet):
                for attr, fn in (("chunk_gated_delta_rule", gated_delta_rule),
                                 ("torch_chunk_gated_delta_rule", gated_delta_rule), ("causal_conv1d_fn", conv1d)):
                    if callable(mod.__dict__.get(attr)):
                        setattr(mod, attr, fn)

    return f"fla {version_of(fla, 'fla-core')} chunk_gated_delta_rule + causal_conv1d + FusedRMSNormGated", bind


def liger_patch():
    """liger-kernel's Qwen3.5 patch: (description, apply(model)) where apply patches the built model with fused linear
    cross-entropy, RMSNorm (offset 1) and SwiGLU, and exits when the patch did not take. Exits at once when this
    liger-kernel has no Qwen3.5 patch (before 0.8.5: scripts/fetch_peers.sh fetches 0.8.5)."""
    import liger_kernel
    from liger_kernel.transformers import monkey_patch

    ver = version_of(liger_kernel, "liger-kernel")
    fn = getattr(monkey_patch, "apply_liger_kernel_to_qwen3_5", None)
    if fn is None:
        sys.exit(f"peer_step: liger-kernel {ver} has no apply_liger_kernel_to_qwen3_5 (scripts/fetch_peers.sh: 0.8.5)")

    def apply(model):
        fn(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=model)
        if not getattr(getattr(model.forward, "__func__", None), "__module__", "").startswith("liger_kernel"):
            sys.exit("peer_step: Liger's fused linear cross-entropy forward is not on the model after its patch")

    return f"liger {ver}: fused linear CE, RMSNorm, SwiGLU", apply


def run(args, config, label, desc, prepare=None, check=None):
    """Builds the model and the optimizer on args.device, times the steps (or, with --dry-run, runs one) and prints
    the result lines. args: device, optimizer_state ('bf16' | 'fp32'), micro_batch, seq_len, steps, warmup,
    max_grad_norm (0: no clip), dry_run, row, and optionally autocast (bf16 autocast on or off; default: with the
    fp32 state). The optimizer takes the parameters that get gradients (all, or a LoRA run's adapters). prepare(model) runs on the built model before the optimizer is made
    (Liger's patch; scripts/torch_step.py: the deltastack.torch patch); check() runs after the first step (raises
    or exits when what should have run did not)."""
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
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.1, fused=cuda, foreach=None if cuda else True)
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, S = args.micro_batch, args.seq_len
    ids = torch.randint(0, config.vocab_size, (B, S), generator=gen).to(dev)
    # bf16 autocast with the fp32 state; args.autocast (scripts/peer_lora_step.py: fp32 adapters on a bf16 base) sets it
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=getattr(args, "autocast", not bf16_state))

    def step():
        with autocast:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    result = {"label": label, "row": args.row, "seq_len": S, "micro_batch": B, "params": n_params,
              "optimizer_state": args.optimizer_state, "stack": desc}
    if args.dry_run:
        loss = step()
        if check is not None:
            check()
        print(f"{label}: dry run on {dev}: {n_params / 1e9:.4f}B parameters ({dtype}), {config.num_hidden_layers} "
              f"layers {''.join('A' if t == 'full_attention' else 'L' for t in config.layer_types)}, loss "
              f"{loss.item():.4f}, built and stepped in {time.time() - t0:.1f} s ({desc})", flush=True)
        return
    print(f"peer: {type(model).__name__} {n_params / 1e9:.2f}B parameters, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}; built in {time.time() - t0:.1f} s", flush=True)
    for i in range(args.warmup):
        t_step = time.time()
        loss = step()
        if i == 0 and check is not None:
            check()
        torch.cuda.synchronize()
        # a run stopped by a timeout then shows how far it got (the first step compiles and autotunes Triton kernels)
        print(f"peer: warm-up step {i + 1} of {args.warmup} took {time.time() - t_step:.1f} s", flush=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss = step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ms = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / GiB
    # What the process holds on the device, as deltastack's own peak counts it (cudaMemGetInfo: the CUDA context,
    # cuBLAS / cuDNN and the caching allocator's reserve included); the allocator gives nothing back during the run.
    free_b, total_b = torch.cuda.mem_get_info()
    device_used = (total_b - free_b) / GiB
    reserved = torch.cuda.max_memory_reserved() / GiB
    print(f"peer: last step loss {loss.item():.4f}; steps (ms) {' '.join(f'{t:.1f}' for t in times)}; device memory "
          f"in use {device_used:.1f} GiB (max reserved {reserved:.1f})", flush=True)
    print(f"{label}: {ms:.1f} ms/step, {B * S / (ms / 1e3):.0f} tokens/s, peak {peak:.1f} GiB ({desc})", flush=True)
    result.update(status="ok", ms_per_step=round(ms, 2), tokens_per_s=round(B * S / (ms / 1e3)),
                  peak_gib=round(peak, 2), reserved_gib=round(reserved, 2), device_used_gib=round(device_used, 2),
                  steps=args.steps, warmup=args.warmup, loss=round(loss.item(), 4))
    print("step_result " + json.dumps(result), flush=True)


def run_or_report_oom(args, config, label, desc, prepare=None, check=None):
    """run(), with an out-of-memory (building the model, or a step) reported in both forms instead of raised."""
    try:
        run(args, config, label, desc, prepare, check)
    except torch.cuda.OutOfMemoryError:
        peak = torch.cuda.max_memory_allocated() / GiB
        print(f"{label}: out of memory ({peak:.1f} GiB peak) ({desc})", flush=True)
        print("step_result " + json.dumps({"label": label, "row": args.row, "seq_len": args.seq_len,
                                           "micro_batch": args.micro_batch, "status": "out of memory",
                                           "peak_gib": round(peak, 2), "stack": desc}), flush=True)


def peer_stack(args):
    """Installs the peer's kernels (fla's now, Liger's on the built model through the returned prepare) and returns
    (description, prepare, check). args: optimizer_state ('bf16' | 'fp32'), bypass_640, max_grad_norm."""
    import transformers

    fla_desc, bind_fla = install_fla_kernels()
    stack = [f"transformers {transformers.__version__}", f"torch {torch.__version__}", fla_desc]
    if args.bypass_640 and bypass_fla_640():
        stack.append("fla #640 guard lifted (timing only)")
    liger_desc, apply_liger = liger_patch()

    def prepare(model):
        bind_fla(model)
        apply_liger(model)

    def check():
        missing = [k for k, n in FLA_CALLS.items() if n == 0]
        if missing:
            sys.exit(f"peer_step: the first step did not call fla's {', '.join(missing)} (calls {FLA_CALLS}): "
                     "transformers' Qwen3.5 no longer looks these up where install_fla_kernels puts them")

    return ", ".join(stack + [liger_desc] + step_desc(args)), prepare, check


def step_desc(args):
    """What every row shares, for its line: attention, optimizer, state layout, clip."""
    return (["sdpa", "fused AdamW", "bf16 parameters + AdamW state" if args.optimizer_state == "bf16"
             else "fp32 master + AdamW state, bf16 autocast"]
            + ([f"clip {args.max_grad_norm:g}"] if args.max_grad_norm > 0 else []))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=["0.8b", "2b", "9b"], help="deltastack's preset (its config via plan --hf-config)")
    src.add_argument("--config", help="an HF config.json deltastack wrote (`deltastack plan --model P --hf-config FILE`)")
    ap.add_argument("--deltastack", help="the deltastack binary for --preset (default: $DELTASTACK, build-device/, build/)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)} (default: both, in order)")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--max-grad-norm", type=float, default=0.0,
                    help="clip the gradient norm to this (HF Trainer's default is 1.0); 0: no clip, as measured")
    ap.add_argument("--bypass-640", action=argparse.BooleanOptionalAction, default=True,
                    help="lift fla's #640 Hopper guard, timing only (default: lifted)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="build the model and run one step, no timing")
    ap.add_argument("--tiny", action="store_true", help="with --dry-run: a 2-layer width-64 model of the same kinds")
    ap.add_argument("--config-file", help=argparse.SUPPRESS)  # internal: the resolved config for the row processes
    ap.add_argument("--name", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = args.rows.split(",")
    bad = [r for r in rows if r not in ROWS]
    if bad or not args.rows:
        ap.error(f"--rows: {', '.join(bad) or 'empty'}: not one of {', '.join(ROWS)}")
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1 (the first warm-up step checks the kernels ran)")
    if not args.device.startswith("cuda"):
        ap.error("--device: the peer's kernels (fla, Liger) are Triton kernels: cuda only")
    if not torch.cuda.is_available():
        sys.exit("peer_step: no CUDA device")
    if args.tiny and not args.dry_run:
        ap.error("--tiny is for --dry-run only")
    os.environ.setdefault("FLA_TILELANG", "0")

    tmp = None
    if args.config_file:
        cfg_path, name = args.config_file, args.name
    else:
        cfg_path, name, tmp = resolve_config(args, "peer_step")
    try:
        if len(rows) > 1:  # each row in its own process
            argv = ["--config", cfg_path, "--config-file", cfg_path, "--name", name, "--seq-len", str(args.seq_len),
                    "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                    "--max-grad-norm", str(args.max_grad_norm), "--device", args.device,
                    "--bypass-640" if args.bypass_640 else "--no-bypass-640"]
            argv += (["--dry-run"] if args.dry_run else []) + (["--tiny"] if args.tiny else [])
            sys.exit(each_in_own_process(__file__, argv, "--rows", rows))
        args.row = rows[0]
        args.optimizer_state = ROWS[args.row]
        with open(cfg_path) as f:
            cfg_dict = json.load(f)
        if args.tiny:
            cfg_dict = tiny(cfg_dict)
        config, unknown = build_config(cfg_dict)
        if unknown:
            print(f"peer_step: keys transformers' {type(config).__name__} does not know: {', '.join(unknown)}",
                  flush=True)
        desc, prepare, check = peer_stack(args)
        label = f"peer step {name} seq {args.seq_len} x {args.micro_batch} {args.row}"
        run_or_report_oom(args, config, label, desc, prepare, check)
    finally:
        if tmp:
            os.unlink(tmp)


if __name__ == "__main__":
    main()
