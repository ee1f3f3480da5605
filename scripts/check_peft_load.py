#!/usr/bin/env python3
"""Loads a LoRA adapter written by `deltastack export` with Hugging Face PEFT onto transformers' own
Qwen3_5ForCausalLM and compares its outputs with deltastack's (`deltastack forward --adapter`) on the same inputs:
proof that our adapters are PEFT adapter directories that PEFT loads as they are (issue 26, item 3).

usage: check_peft_load.py BASE_DIR ADAPTER_DIR INPUTS.safetensors OURS.safetensors [--band fp32|bf16]
       check_peft_load.py --write-inputs INPUTS.safetensors --text FILE --tokenizer tokenizer.json
                          [--batch B] [--seq-len T]

BASE_DIR: the base model, an HF model directory (config.json + model.safetensors); ADAPTER_DIR: the adapter
(adapter_config.json + adapter_model.safetensors); INPUTS: input_ids and labels [B, T] (int64, docs/parity.md);
OURS: what `deltastack forward --model BASE_DIR --adapter ADAPTER_DIR --inputs INPUTS --output OURS` writes: loss [1],
logits [B, T, V] and hidden_states_0 .. hidden_states_L [B, T, H] (the last one after the final norm).

The reference is transformers + PEFT in fp32 on the CPU. Checks, each printed; any failure exits 1:
- PEFT's view of the loaded adapter (get_peft_model_state_dict) has exactly the file's keys and values (bitwise):
  no key missing, none unexpected, none reshaped or converted;
- the adapter changes the reference's logits by more than the band (else the comparison below could not tell a
  loaded adapter from an ignored one);
- rel. L2 (||ours - ref|| / ||ref||) of loss, logits and the final hidden states within the band:
  fp32 (1e-4): ours from `forward --device cpu`, the fp32 CPU engine, as scripts/check_hf_load.py;
  bf16 (1e-2): ours from `forward --device cuda`, whose base and activations are bf16: the whole-model pass mark of
  docs/cuda_backend.md "Numerics contract" (scripts/compare_safetensors.py, the CudaLora tests' loss / logits band);
  for scale, the same line then gives transformers + PEFT run in bf16 against their fp32 (not a pass mark).
--write-inputs makes INPUTS: B windows of T token ids from the start of FILE's text (labels = input_ids).
"""
import argparse
import sys

import torch
from safetensors.torch import load_file, save_file

# transformers takes fla's (and causal-conv1d's) GPU kernels for Qwen3.5 whenever they import, and the device
# machine's PYTHONPATH for peft (.peers/site) holds fla: hide them, so the fp32 CPU reference is transformers' own
# torch code (the path scripts/check_hf_load.py and the fixtures use).
for _kernels in ("fla", "causal_conv1d"):
    sys.modules[_kernels] = None

BANDS = {"fp32": 1e-4, "bf16": 1e-2}


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def write_inputs(path, text_file, tokenizer_file, batch, seq_len):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(tokenizer_file).encode(open(text_file, encoding="utf-8").read(200_000)).ids
    need = batch * seq_len
    if len(ids) < need:
        sys.exit(f"check_peft_load: {text_file} gives {len(ids)} tokens, fewer than --batch x --seq-len = {need}")
    x = torch.tensor(ids[:need], dtype=torch.int64).reshape(batch, seq_len)
    save_file({"input_ids": x, "labels": x.clone()}, path)
    print(f"wrote {path}: input_ids and labels [{batch}, {seq_len}] from {text_file}")
    return 0


def adapter_keys_match(model, adapter_dir):
    """Problems (a list of strings, empty when none) between the adapter file and PEFT's loaded state."""
    from peft import get_peft_model_state_dict

    want = load_file(f"{adapter_dir}/adapter_model.safetensors")
    got = get_peft_model_state_dict(model)
    bad = [f"missing in PEFT's model: {k}" for k in sorted(set(want) - set(got))]
    bad += [f"not in the file: {k}" for k in sorted(set(got) - set(want))]
    for k in sorted(set(want) & set(got)):
        g, w = got[k].detach().cpu(), want[k]
        if g.shape != w.shape or g.dtype != w.dtype or not torch.equal(g, w):
            bad.append(f"{k}: PEFT holds {g.dtype} {list(g.shape)}, the file {w.dtype} {list(w.shape)}"
                       + ("" if g.shape != w.shape or g.dtype != w.dtype else ", values differ"))
    return len(want), bad


def check(base_dir, adapter_dir, inputs, ours, band_name):
    import peft
    import transformers
    from peft import PeftModel
    from transformers import Qwen3_5ForCausalLM

    band = BANDS[band_name]
    base = Qwen3_5ForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    n, bad = adapter_keys_match(model, adapter_dir)
    for b in bad[:10]:
        print(f"  adapter key: {b}")
    print(f"PEFT {peft.__version__} on transformers {transformers.__version__} loaded {adapter_dir} onto {base_dir}: "
          f"{n} adapter tensors, {'all bitwise as in the file' if not bad else f'{len(bad)} problems'}")

    x = load_file(inputs)
    o = load_file(ours)
    with torch.no_grad():
        out = model(input_ids=x["input_ids"], labels=x["labels"], output_hidden_states=True)
        with model.disable_adapter():
            plain = model(input_ids=x["input_ids"])
    last = max(int(k[len("hidden_states_"):]) for k in o if k.startswith("hidden_states_"))
    effect = rel(plain.logits, out.logits)
    errs = {"loss": rel(o["loss"], out.loss.reshape(1)),
            "logits": rel(o["logits"], out.logits),
            "final hidden": rel(o[f"hidden_states_{last}"], out.hidden_states[-1])}
    ok_errs = all(e <= band for e in errs.values())
    if band_name == "bf16":  # for scale: transformers + PEFT themselves in bf16 against the same fp32 reference
        model16 = PeftModel.from_pretrained(
            Qwen3_5ForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16), adapter_dir).to(torch.bfloat16).eval()
        with torch.no_grad():
            out16 = model16(input_ids=x["input_ids"], labels=x["labels"])
        e_loss, e_logits = rel(out16.loss.reshape(1), out.loss.reshape(1)), rel(out16.logits, out.logits)
        scale = f"(for scale, transformers + PEFT in bf16 vs fp32: loss {e_loss:.2e}, logits {e_logits:.2e})"
    print(f"reference loss {out.loss.item():.6f}, ours {o['loss'].item():.6f}; the adapter moves the logits by "
          f"rel. L2 {effect:.2e} ({'above' if effect > band else 'NOT above'} the band)")
    print(f"rel L2 of ours ({ours}) vs PEFT: " + ", ".join(f"{k} {e:.2e}" for k, e in errs.items())
          + f"; {band_name} band {band:.0e}: {'ok' if ok_errs else 'FAIL'}")
    if band_name == "bf16":
        print(scale)
    return 0 if ok_errs and not bad and effect > band else 1


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", help="BASE_DIR ADAPTER_DIR INPUTS OURS")
    p.add_argument("--band", choices=sorted(BANDS), default="fp32",
                   help="fp32 (1e-4) for a CPU forward of ours, bf16 (1e-2) for a GPU one")
    p.add_argument("--write-inputs", metavar="INPUTS")
    p.add_argument("--text")
    p.add_argument("--tokenizer")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    a = p.parse_args(argv)
    if a.write_inputs:
        if not (a.text and a.tokenizer) or a.paths:
            p.error("--write-inputs takes --text and --tokenizer and no positional paths")
        return write_inputs(a.write_inputs, a.text, a.tokenizer, a.batch, a.seq_len)
    if len(a.paths) != 4:
        p.error("expected BASE_DIR ADAPTER_DIR INPUTS OURS")
    return check(*a.paths, a.band)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
