#!/usr/bin/env python3
"""Times LoRA training steps of the strongest PyTorch stack at the shapes `deltastack bench step --lora-rank R` times
ours (issue 26, item 5).

The peer is scripts/peer_step.py's (transformers' Qwen3_5ForCausalLM of deltastack's own config, with fla's gated
delta rule, causal conv1d and gated RMSNorm, and Liger's fused linear cross-entropy, RMSNorm and SwiGLU, PyTorch
SDPA; its helpers are used here, not copied) with Hugging Face PEFT's LoRA on the same targets as deltastack's
`--lora-rank R` (all ten linear modules of the decoder: linear_attn.in_proj_qkv, in_proj_z, out_proj;
self_attn.q_proj, k_proj, v_proj, o_proj; mlp.gate_proj, up_proj, down_proj), rank --rank (16), lora_alpha 8 and no
dropout (PEFT's defaults, as `bench step --lora-rank`), PEFT's init:
  base       bf16 parameters, frozen (requires_grad False: no gradient, no AdamW state)
  adapters   fp32 (PEFT's autocast_adapter_dtype, its default), under bf16 torch.autocast
  optimizer  torch.optim.AdamW(fused=True) over the adapters, lr 1e-5, weight decay 0.1; no gradient checkpointing
             (--gradient-checkpointing: transformers' non-reentrant checkpointing of every decoder layer, what LoRA
             fine-tuners turn on where the activations do not fit, e.g. 27B at seq 8192; the row is then
             `peer-lora-gc`)
The row `peer-lora` runs in its own process; its lines are peer_step.py's (`peer lora step <preset> seq S x B
peer-lora: <ms> ms/step, ...` and `step_result {...}`), the stack naming PEFT's version and the rank.
Liger's patch goes on the built model first, PEFT's LoRA layers then replace the targeted nn.Linear modules in place
(Liger's SwiGLU calls gate_proj / up_proj / down_proj as modules, so their LoRA terms run); a first step that did not
run a LoRA layer of every target, or fla's kernels, stops with an error.
Needs (scripts/fetch_peers.sh puts them in .peers/site): peft (0.21.2, PEFT_VERSION) and accelerate, which peft
imports, beside peer_step.py's liger-kernel and fla-core.

  python3 scripts/peer_lora_step.py --preset 9b --seq-len 8192 --micro-batch 1 --rank 16
  python3 scripts/peer_lora_step.py --preset 2b --dry-run --tiny
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import peer_step  # noqa: E402  scripts/peer_step.py: the peer's model, kernels, timing and result lines

# deltastack's all-linear targets (src/model/lora.h LoraModule), PEFT's short names
TARGETS = ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
           "down_proj"]


def lora_prepare(args, base_prepare, base_check):
    """(description, prepare, check): peer_step's stack on the built model, then PEFT's LoRA on the targets (in
    place; the base frozen); check() after the first step also checks every target's LoRA layers ran."""
    import peft
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    calls = {t: 0 for t in TARGETS}

    def count(name):
        def hook(module, inputs, output):
            calls[name] += 1
        return hook

    def prepare(model):
        base_prepare(model)
        if args.gradient_checkpointing:  # before PEFT wraps the model; non-reentrant: no input_require_grads needed
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        cfg = LoraConfig(r=args.rank, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, bias="none",
                         task_type="CAUSAL_LM")
        get_peft_model(model, cfg)  # injects the LoRA layers into `model` itself and freezes the rest
        n = 0
        for name, mod in model.named_modules():
            if isinstance(mod, LoraLinear):
                mod.register_forward_hook(count(name.rsplit(".", 1)[-1]))
                n += 1
        if n == 0:
            sys.exit("peer_lora_step: PEFT put no LoRA layer on the model")
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(f"peer_lora_step: {n} LoRA layers, {trainable} trainable of {total} parameters "
              f"({next(p.dtype for p in model.parameters() if p.requires_grad)} adapters)", flush=True)

    def check():
        base_check()
        missing = [t for t, n in calls.items() if n == 0]
        if missing:
            sys.exit(f"peer_lora_step: the first step ran no LoRA layer of {', '.join(missing)} (calls {calls})")

    desc = f"PEFT {peer_step.version_of(peft, 'peft')} LoRA r={args.rank} alpha 8 on {len(TARGETS)} linear modules"
    if args.gradient_checkpointing:
        desc += ", gradient checkpointing (non-reentrant, every decoder layer)"
    return desc, prepare, check


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=["0.8b", "2b", "9b", "27b"],
                     help="deltastack's preset (its config via plan --hf-config)")
    src.add_argument("--config", help="an HF config.json deltastack wrote (`deltastack plan --model P --hf-config FILE`)")
    ap.add_argument("--deltastack", help="the deltastack binary for --preset (default: $DELTASTACK, build-device/, build/)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--bypass-640", action=argparse.BooleanOptionalAction, default=True,
                    help="lift fla's #640 Hopper guard, timing only (default: lifted; scripts/peer_common.py)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="checkpoint every decoder layer (transformers, non-reentrant); the row is peer-lora-gc")
    ap.add_argument("--dry-run", action="store_true", help="build the model and run one step, no timing")
    ap.add_argument("--tiny", action="store_true", help="with --dry-run: a 2-layer width-64 model of the same kinds")
    args = ap.parse_args()
    if args.rank < 1:
        ap.error("--rank must be at least 1")
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1 (the first warm-up step checks the kernels ran)")
    if args.tiny and not args.dry_run:
        ap.error("--tiny is for --dry-run only")
    if not torch.cuda.is_available():
        sys.exit("peer_lora_step: no CUDA device")
    try:
        import peft  # noqa: F401
    except ImportError as e:
        sys.exit(f"peer_lora_step: cannot import peft ({e}); scripts/fetch_peers.sh fetches it (and accelerate) "
                 "into .peers/site, which scripts/device_test.sh puts on PYTHONPATH")
    os.environ.setdefault("FLA_TILELANG", "0")
    # peer_step.run's fields: the frozen bf16 base (optimizer_state 'bf16': bf16 parameters) under bf16 autocast
    args.device, args.optimizer_state, args.autocast, args.max_grad_norm = "cuda", "bf16", True, 0.0
    args.row = "peer-lora-gc" if args.gradient_checkpointing else "peer-lora"
    cfg_path, name, tmp = peer_step.resolve_config(args, "peer_lora_step")
    try:
        with open(cfg_path) as f:
            cfg_dict = json.load(f)
        if args.tiny:
            cfg_dict = peer_step.tiny(cfg_dict)
        config, unknown = peer_step.build_config(cfg_dict)
        if unknown:
            print(f"peer_lora_step: keys transformers' {type(config).__name__} does not know: {', '.join(unknown)}",
                  flush=True)
        stack, base_prepare, base_check = peer_step.peer_stack(args)
        lora_desc, prepare, check = lora_prepare(args, base_prepare, base_check)
        # peer_stack's description ends with peer_step's state words (bf16 parameters + AdamW state): say LoRA's
        desc = stack.replace("bf16 parameters + AdamW state", "frozen bf16 base, fp32 adapters + AdamW state, bf16 "
                             "autocast") + ", " + lora_desc
        label = f"peer lora step {name} seq {args.seq_len} x {args.micro_batch} {args.row}"
        peer_step.run_or_report_oom(args, config, label, desc, prepare, check)
    finally:
        if tmp:
            os.unlink(tmp)


if __name__ == "__main__":
    main()
