#!/usr/bin/env python3
"""transformers' Qwen3.5 training step at a deltastack preset shape: unpatched, with Liger, and patched with deltastack.torch.

Three runs, each in its own process (so one's memory or an out-of-memory does not touch the other), of the step
scripts/peer_step.py times (same model from `deltastack plan --model P --hf-config`, same step: zero_grad, forward
on random ids [B, S] with labels = ids, backward, clip 1.0, fused AdamW; fp32 master weights with bf16 autocast, or
--optimizer-state bf16):
  unpatched   transformers as installed (fla's chunk_gated_delta_rule when `import fla` works, else its torch code;
              Dao's causal_conv1d when installed, else torch's conv1d);
  liger       the same with liger-kernel's Qwen3.5 patch (fused linear cross-entropy, RMSNorm, SwiGLU), applied
              before the model is built (scripts/peer_step.py apply_liger);
  deltastack  the unpatched model after deltastack.torch.patch(model) (DELTASTACK_TORCH_<OP>=0|1 choose the ops).
--bypass-640 lifts fla's Hopper guard (fla issue #640, scripts/peer_common.py) in the fla runs, for timing only.
Each prints one result line: `torch step <preset> seq S x B <which>: <ms> ms/step, <tok/s> tokens/s, peak <GiB>
GiB (<stack>)` (or `out of memory`), after peer_step's two `peer:` lines (model, per-step times); peak is
torch.cuda.max_memory_allocated() over the run. Needs the built extension
(pip install --no-build-isolation ./python, docs/torch.md) and a deltastack binary for --preset (or --config FILE).
--dry-run --device cpu --tiny runs one step of each on the CPU (no timing), to test the script without a GPU.

  python3 scripts/torch_step.py --preset 2b --seq-len 8192 --micro-batch 2 --bypass-640
A liger run when liger-kernel does not import prints `... liger: skipped, ...` and counts as a success (exit 0).
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "python"))  # an in-place build of the extension (setup.py build_ext -i)

import torch  # noqa: E402

GiB = float(1 << 30)


def stack_desc(which, args):
    import transformers

    from peer_step import kernel_modules

    gdn, conv = kernel_modules()
    out = [f"transformers {transformers.__version__}", f"torch {torch.__version__}"]
    if which == "deltastack":
        out.append("deltastack.torch (GDN, conv1d, RMSNorm, gated RMSNorm, SwiGLU, fused linear CE; knobs: "
                   + (", ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                if k.startswith("DELTASTACK_TORCH_")) or "defaults") + ")")
    else:
        out.append("fla GDN" if gdn.startswith("fla") else "torch GDN (no fla)")
        out.append("causal_conv1d conv" if conv.startswith("causal_conv1d") else "torch conv1d")
        if gdn.startswith("fla") and getattr(args, "bypassed_640", False):
            out.append("fla #640 guard lifted (timing only)")
    out.append("sdpa")
    out.append("bf16 weights + AdamW state" if args.optimizer_state == "bf16"
               else "fp32 master + AdamW state, bf16 autocast")
    return ", ".join(out)


def one(args, which):
    """One run: peer_step.run (its model, step, timing and output line), the model patched first for deltastack."""
    from peer_step import build_config, run, tiny

    with open(args.config_file) as f:
        cfg = json.load(f)
    if args.tiny:
        cfg = tiny(cfg)
    config, _ = build_config(cfg)
    label = f"torch step {args.name} seq {args.seq_len} x {args.micro_batch} {which}"
    if which != "deltastack" and args.bypass_640:
        from peer_common import bypass_fla_640

        try:
            args.bypassed_640 = bypass_fla_640()  # False: this fla has no such guard
        except ImportError:  # no fla: transformers' torch GDN, nothing to lift
            args.bypassed_640 = False
    desc = stack_desc(which, args)
    prepare, own_loss = None, None
    if which == "liger":
        from peer_step import apply_liger

        try:
            what, own_loss = apply_liger()  # before the model is built: it patches transformers' Qwen3.5 classes
        except ImportError as e:
            print(f"{label}: skipped, liger-kernel is not importable ({e}; put it on PYTHONPATH, e.g. .peers/site)",
                  flush=True)
            return
        desc = f"{desc}, {what}"
    if which == "deltastack":
        import deltastack.torch as dt

        os.environ.setdefault("DELTASTACK_LOG", "quiet")
        prepare = dt.patch
    args.grad_checkpointing = False
    try:
        run(args, config, own_loss, label, desc, "", prepare=prepare)
    except torch.cuda.OutOfMemoryError:
        print(f"{label}: out of memory ({torch.cuda.max_memory_allocated() / GiB:.1f} GiB peak) ({desc})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="deltastack's preset (0.8b, 2b, 9b, ...; its config via plan --hf-config)")
    src.add_argument("--config", help="an HF text config.json (`deltastack plan --model P --hf-config FILE`)")
    ap.add_argument("--deltastack", help="the deltastack binary for --preset (default: $DELTASTACK, build-device/, build/)")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps, after 2 warm-up steps")
    ap.add_argument("--optimizer-state", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--which", default="all",
                    help="all (= unpatched,liger,deltastack), or a comma-separated list of those, run in the order given")
    ap.add_argument("--bypass-640", action="store_true", help="lift fla's #640 guard in the fla runs (timing only)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="one step each, no timing (CPU works)")
    ap.add_argument("--tiny", action="store_true", help="with --dry-run: a 2-layer width-64 model of the same kinds")
    ap.add_argument("--config-file", help=argparse.SUPPRESS)  # internal: the resolved config for the child runs
    ap.add_argument("--name", help=argparse.SUPPRESS)
    args = ap.parse_args()
    variants = ("unpatched", "liger", "deltastack")
    which = list(variants) if args.which == "all" else args.which.split(",")
    bad = [w for w in which if w not in variants]
    if bad or not which:
        ap.error(f"--which: {', '.join(bad) or 'empty'}: not one of all, {', '.join(variants)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("torch_step: no CUDA device (--device cpu --dry-run --tiny tests the script without one)")
    if not args.dry_run and not args.device.startswith("cuda"):
        sys.exit("torch_step: timing needs --device cuda (use --dry-run on a CPU)")

    from peer_step import find_deltastack, preset_config

    tmp = None
    if args.config_file:
        cfg_path, name = args.config_file, args.name
    elif args.config:
        cfg_path, name = os.path.abspath(args.config), os.path.basename(args.config)
    else:
        import tempfile

        cfg, _ = preset_config(args.preset, find_deltastack(args.deltastack))
        fd, tmp = tempfile.mkstemp(suffix=".json", prefix="torch_step_")
        with os.fdopen(fd, "w") as f:
            json.dump(cfg, f)
        cfg_path, name = tmp, args.preset
    args.config_file, args.name = cfg_path, name
    if len(which) == 1:  # one variant (also each child run): in this process
        try:
            one(args, which[0])
        finally:
            if tmp:
                os.unlink(tmp)
        return
    base = [sys.executable, os.path.abspath(__file__), "--config", cfg_path, "--config-file", cfg_path, "--name", name,
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
            "--optimizer-state", args.optimizer_state, "--device", args.device]
    base += ["--dry-run"] if args.dry_run else []
    base += ["--tiny"] if args.tiny else []
    base += ["--bypass-640"] if args.bypass_640 else []
    rc = 0
    try:
        for w in which:
            rc |= subprocess.run(base + ["--which", w]).returncode
    finally:
        if tmp:
            os.unlink(tmp)
    sys.exit(rc)


if __name__ == "__main__":
    main()
