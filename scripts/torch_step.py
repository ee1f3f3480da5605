#!/usr/bin/env python3
"""transformers' Qwen3.5 training step at a deltastack preset shape: the strongest peer, and patched with deltastack.torch.

Runs, each in its own process (so one's memory or an out-of-memory does not touch the other), of scripts/peer_step.py's
step (same model from `deltastack plan --model P --hf-config`, same step: forward on random ids [B, S] with labels =
ids, backward, optional clip (--max-grad-norm, off), fused AdamW, zero_grad; fp32 master weights with bf16 autocast,
or --optimizer-state bf16: bf16 parameters and AdamW state):
  peer        the strongest PyTorch stack, peer_step.py's (fla's chunk_gated_delta_rule, causal_conv1d and
              FusedRMSNormGated in transformers' Qwen3.5 layers, Liger's fused linear CE, RMSNorm and SwiGLU): the row
              peer-fp32master at the default --optimizer-state fp32, peer-bf16 at bf16. Needs CUDA (Triton kernels).
  deltastack  transformers' model after deltastack.torch.patch(model) (DELTASTACK_TORCH_<OP>=0|1 choose the ops).
fla's Hopper guard (fla issue #640, scripts/peer_common.py) is lifted in the peer runs, for timing only, as in
peer_step.py (--no-bypass-640 keeps it).
Each prints one result line: `torch step <preset> seq S x B <which>: <ms> ms/step, <tok/s> tokens/s, peak <GiB>
GiB (<stack>)` (or `out of memory`) and peer_step's machine-readable `step_result {...}` line, after its two `peer:`
lines (model, per-step times); peak is torch.cuda.max_memory_allocated() from the first step on. Needs the built
extension for `deltastack` (pip install --no-build-isolation ./python, docs/torch.md) and a deltastack binary for
--preset (or --config FILE). --dry-run --device cpu --tiny runs one step of `deltastack` on the CPU (no timing;
`peer` says it is skipped there), to test the script without a GPU.

  python3 scripts/torch_step.py --preset 2b --seq-len 8192 --micro-batch 2 --bypass-640
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "python"))  # an in-place build of the extension (setup.py build_ext -i)

import torch  # noqa: E402

VARIANTS = ("peer", "deltastack")


def one(args, which):
    """One run: peer_step's stack (`peer`) or the deltastack.torch patch, then peer_step.run (its model, step, timing
    and output lines)."""
    import transformers

    from peer_step import build_config, peer_stack, run_or_report_oom, step_desc, tiny

    with open(args.config_file) as f:
        cfg = json.load(f)
    if args.tiny:
        cfg = tiny(cfg)
    config, _ = build_config(cfg)
    label = f"torch step {args.name} seq {args.seq_len} x {args.micro_batch} {which}"
    args.row = which
    check = None
    if which == "peer":
        if not args.device.startswith("cuda"):
            print(f"{label}: skipped, the peer's kernels (fla, Liger) need CUDA", flush=True)
            return
        desc, prepare, check = peer_stack(args)
    else:
        import deltastack.torch as dt

        os.environ.setdefault("DELTASTACK_LOG", "quiet")
        knobs = ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("DELTASTACK_TORCH_"))
        desc = ", ".join([f"transformers {transformers.__version__}", f"torch {torch.__version__}",
                          "deltastack.torch (GDN, conv1d, RMSNorm, gated RMSNorm, SwiGLU, fused linear CE; knobs: "
                          + (knobs or "defaults") + ")"] + step_desc(args))
        prepare = dt.patch
    run_or_report_oom(args, config, label, desc, prepare, check)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="deltastack's preset (0.8b, 2b, 9b, ...; its config via plan --hf-config)")
    src.add_argument("--config", help="an HF text config.json (`deltastack plan --model P --hf-config FILE`)")
    ap.add_argument("--deltastack", help="the deltastack binary for --preset (default: $DELTASTACK, build-device/, build/)")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--max-grad-norm", type=float, default=0.0, help="clip the gradient norm to this; 0: no clip")
    ap.add_argument("--optimizer-state", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--which", default="all",
                    help="all (= peer,deltastack), or a comma-separated list of those, run in the order given")
    ap.add_argument("--bypass-640", action=argparse.BooleanOptionalAction, default=True,
                    help="lift fla's #640 Hopper guard in the peer runs, timing only (default: lifted)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="one step each, no timing (CPU works for deltastack)")
    ap.add_argument("--tiny", action="store_true", help="with --dry-run: a 2-layer width-64 model of the same kinds")
    ap.add_argument("--config-file", help=argparse.SUPPRESS)  # internal: the resolved config for the child runs
    ap.add_argument("--name", help=argparse.SUPPRESS)
    args = ap.parse_args()
    which = list(VARIANTS) if args.which == "all" else args.which.split(",")
    bad = [w for w in which if w not in VARIANTS]
    if bad or not which:
        ap.error(f"--which: {', '.join(bad) or 'empty'}: not one of all, {', '.join(VARIANTS)}")
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("torch_step: no CUDA device (--device cpu --dry-run --tiny tests the script without one)")
    if not args.dry_run and not args.device.startswith("cuda"):
        sys.exit("torch_step: timing needs --device cuda (use --dry-run on a CPU)")
    os.environ.setdefault("FLA_TILELANG", "0")

    from peer_step import each_in_own_process, resolve_config

    tmp = None
    if args.config_file:
        cfg_path, name = args.config_file, args.name
    else:
        cfg_path, name, tmp = resolve_config(args, "torch_step")
    args.config_file, args.name = cfg_path, name
    try:
        if len(which) == 1:  # one variant (also each child run): in this process
            one(args, which[0])
            return
        argv = ["--config", cfg_path, "--config-file", cfg_path, "--name", name, "--seq-len", str(args.seq_len),
                "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--max-grad-norm", str(args.max_grad_norm), "--optimizer-state", args.optimizer_state,
                "--device", args.device]
        argv += (["--dry-run"] if args.dry_run else []) + (["--tiny"] if args.tiny else [])
        argv += ["--bypass-640" if args.bypass_640 else "--no-bypass-640"]
        sys.exit(each_in_own_process(__file__, argv, "--which", which))
    finally:
        if tmp:
            os.unlink(tmp)


if __name__ == "__main__":
    main()
