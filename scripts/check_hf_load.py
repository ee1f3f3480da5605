#!/usr/bin/env python3
"""Loads a deltastack checkpoint with Hugging Face transformers' own Qwen3_5ForCausalLM and compares its outputs
with deltastack's (`deltastack forward`, CPU fp32) on the same inputs: proof that checkpoints are HF directories
that transformers loads as they are.

usage: check_hf_load.py CHECKPOINT_DIR INPUTS.safetensors OURS.safetensors
OURS holds loss [1], hidden_states_4 [B,T,H] (after the final norm) and logits_first4 [B,4,V].
"""
import sys

import torch
from safetensors.torch import load_file
from transformers import Qwen3_5ForCausalLM


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def main(ckpt, inputs, ours):
    model = Qwen3_5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    x = load_file(inputs)
    o = load_file(ours)
    with torch.no_grad():
        out = model(input_ids=x["input_ids"], labels=x["labels"], output_hidden_states=True)
    e_loss = rel(out.loss.reshape(1), o["loss"])
    e_hidden = rel(out.hidden_states[-1], o["hidden_states_4"])
    e_logits = rel(out.logits[:, :4, :], o["logits_first4"])
    print(f"transformers {__import__('transformers').__version__} loaded {ckpt}: loss {out.loss.item():.6f}; "
          f"rel L2 vs deltastack: loss {e_loss:.2e}, final hidden {e_hidden:.2e}, logits {e_logits:.2e}")
    return 0 if max(e_loss, e_hidden, e_logits) <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
