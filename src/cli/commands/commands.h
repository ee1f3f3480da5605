// Subcommand entry points. Each returns the process exit code; ds::Error escapes to main(), which prints it
// and exits 1.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/lora.h"

namespace ds::cli {

// `deltastack tokenize`: one {"text": ...} JSON object per input line -> one {"ids": [...]} per output line.
// An existing output is replaced only with `overwrite` (never an input: outputs.h).
int cmd_tokenize(const std::string& tokenizer_path, const std::string& input_jsonl, const std::string& output_jsonl,
                 bool overwrite = false);
// `deltastack tokenize --format dataset`: data files (.txt / .jsonl, as `train --data` reads them) -> a
// pre-tokenized dataset directory (data/token_dataset.h), written atomically; shards of `shard_tokens` ids. Each
// input is read in pieces of about `block_bytes` bytes (0: DocumentReader's default, 32 MiB; the hidden option
// --block-bytes, for tests) whatever its size; the output is the same for any piece size.
int cmd_tokenize_dataset(const std::string& tokenizer_path, const std::vector<std::string>& inputs,
                         const std::string& output_dir, const std::string& txt_split = "paragraph",
                         int64_t shard_tokens = 16 << 20, bool overwrite = false, int64_t block_bytes = 0);

// `deltastack forward`: HF-parity forward (and backward) on a safetensors input file. IN holds input_ids
// (int [B, T]) and optionally labels (int [B, T], HF convention: shifted inside, -100 ignored), cu_seqlens
// (int [S+1], packed documents in a single row, B must be 1), position_ids and an all-ones attention_mask
// (model/forward_inputs.h reads and checks them all). OUT gets logits fp32 [B, T, V], loss fp32 [1]
// (mean over valid shifted labels; only with labels) and hidden_states_0..L fp32 [B, T, H] (HF
// output_hidden_states). GRADS (needs labels) gets d loss / d parameter under HF names. device "cuda" runs the
// bf16 GPU engine (fp32 master weights) instead of the fp32 CPU reference. OUT and GRADS never replace an input, each
// other or a checkpoint's files, and replace an existing file only with `overwrite` (outputs.h). precision "fp8":
// the decoder's matrix GEMMs in FP8 (the CPU engine emulates the casts exactly; docs/fp8.md). adapter: a PEFT LoRA
// adapter directory (model/lora.h, docs/lora.md) applied to the model (either engine; the GPU's: model/gpu_lora.h); GRADS
// then gets d loss / d every adapter tensor under PEFT's keys (the base is frozen).
int cmd_forward(const std::string& model_dir, const std::string& inputs, const std::string& output,
                const std::string& grads, const std::string& device = "cpu", bool overwrite = false,
                const std::string& precision = "bf16", const std::string& adapter = "");

// `deltastack generate`: samples a continuation of `prompt` from a checkpoint (tokenizer.json from the
// checkpoint dir unless given), printed as it comes (the prompt first, then each token's text). temperature 0 =
// greedy; otherwise among the top_k most likely ids (0: all), then the smallest set of them whose probability
// reaches top_p (nucleus sampling, Holtzman et al. 2020; 1: off): sample_token, model/generate.h. chat: the prompt
// is a user turn rendered by the bundled chat template with the generation prompt (data/chat.h), and the reply
// stops at <|im_end|>. device "auto" (the GPU engine when a GPU is present and takes the model, else the CPU),
// "cpu" (fp32, the carried decode state: O(1) per token in the GDN layers) or "cuda" (bf16, the forward over the
// whole prefix again for every token: O(n) per token; its plan sized once for the prompt + max_new_tokens).
// ds::Error naming the flag for a bad value, for a prompt + max_new_tokens past max_position_embeddings, and for
// --device cuda without a usable device.
int cmd_generate(const std::string& model_dir, const std::string& tokenizer, const std::string& prompt,
                 int64_t max_new_tokens, double temperature, int64_t top_k, uint64_t seed, double top_p = 1.0,
                 bool chat = false, const std::string& device = "auto", const std::string& adapter = "");

// `deltastack eval`: mean loss and perplexity of a checkpoint on data files, packed into seq_len windows, as one
// JSON object; a non-finite value is null, and a non-finite loss adds "error" and returns 1. device
// "auto" (the GPU engine when a GPU is present), "cpu" (fp32 reference) or "cuda".
// precision: "bf16" or "fp8" (the GEMMs of `--precision fp8`, emulated exactly on the CPU engine).
// adapter (eval and generate): a PEFT LoRA adapter directory (or a LoRA run's checkpoint) applied to the model, on
// the engine `device` chooses.
int cmd_eval(const std::string& model_dir, const std::string& tokenizer, const std::vector<std::string>& data,
             int64_t seq_len, int64_t micro_batch, const std::string& txt_split, const std::string& device = "auto",
             const std::string& precision = "bf16", const std::string& adapter = "");

// `deltastack plot`: an SVG of each run's metrics.jsonl (a run directory of `train`, or the file itself): loss, eval
// loss, learning rate, grad norm and tokens/s against the step, five panels, every run a <polyline data-run="NAME">
// in every panel (NAME: the run directory's name, or the paths as given when two names are the same), and a legend.
// `out` defaults to RUN_DIR/metrics.svg for one run (needed for several); an existing file is replaced only with
// `overwrite`, never an input (outputs.h). ds::Error naming file:line for a line that is not a JSON object with a
// numeric "step", or a run without metrics.jsonl.
int cmd_plot(const std::vector<std::string>& runs, const std::string& out, bool overwrite = false);

// `deltastack inspect`: config summary and tensor list of a checkpoint.
int cmd_inspect(const std::string& path);

// `deltastack export`: a checkpoint as an HF release-style model dir (config.json, weights as `dtype` "bf16" or
// "f32" with A_log and linear_attn.norm.weight fp32, shards past max_shard_mb MB, tokenizer.json). `out` must not
// exist or be empty; the checkpoint is validated by loading it. A LoRA checkpoint (train --lora-rank / --adapter)
// exports as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors fp32, tokenizer.json) that
// peft.PeftModel.from_pretrained loads; with `merge`, as the model directory of its base with the adapter merged
// (W += scaling * lora_B lora_A; the base's fingerprint checked). `merge` of a full checkpoint: ds::Error.
int cmd_export(const std::string& checkpoint, const std::string& out, const std::string& dtype, int64_t max_shard_mb,
               bool merge = false);

// The GPU memory modes as given on a command line (`--memory`, `--optimizer-state`, `--recompute`; model/engine.h
// apply_memory_flags).
struct MemoryFlags {
  std::string memory = "auto", optimizer_state = "auto", recompute = "auto";
  std::string precision = "bf16";  // --precision: the decoder's GEMMs, bf16 or fp8 (model/engine.h Precision)
  bool fp8_lm_head = false;        // --fp8-lm-head (GpuPlan::fp8_lm_head)
  std::string gradients = "auto";  // --gradients: auto, fp32 or in-backward (model/engine.h Gradients)
  double clip = 0;                 // bench step --clip: the max grad norm (in-backward: its norm pass); 0 off
  int64_t lora_rank = 0;           // --lora-rank: a LoRA run of that rank (all-linear, PEFT's defaults); 0 off
  double max_memory_gib = 0;       // bench step --max-memory: GiB the run may use (GpuPlan::memory_limit); 0 all
  bool offload_activations = false;  // --offload-activations (GpuPlan::offload_activations)
};
// The LoRA config of --lora-rank in `plan` and `bench step` (GpuPlan::lora): all ten linear modules, PEFT's defaults
// (lora_alpha 8, no dropout), as `train --lora-rank R` without the other LoRA flags; r 0 when lora_rank is 0.
// ds::Error for a negative rank.
LoraConfig memory_flags_lora(const MemoryFlags& m);

// `deltastack bench ops`: per op and shape, forward and forward+backward ms, rate and roofline fraction (GPU).
// only "loss" (the fused loss at the 2B shape with the FP8 head) or "adamw" (the optimizer updates): those rows
// alone; "": every row.
int cmd_bench_ops(const std::string& only = "");
// `deltastack bench step`: tokens/s, MFU and peak memory of full training steps of a preset (GPU). profile: also
// ms per step by op family and role from CUDA events, their sum against the wall time, and each one's roofline
// fraction (core/profile.h).
int cmd_bench_step(const std::string& preset, int64_t seq_len, int64_t micro_batch, int64_t steps,
                   const MemoryFlags& memory, bool profile = false);

// `deltastack bench tokenizer`: encode speed of a tokenizer.json on a text file, one core (MB/s).
int cmd_bench_tokenizer(const std::string& tokenizer_path, const std::string& text_path, int repeats);

// `deltastack probe`: the backend chosen per op and its self-probe error against the reference.
int cmd_probe();
// `deltastack plan`: prints the CUDA engine's memory plan (parameters, gradients, optimizer state, activations,
// workspaces, the modes) for `model` (a preset, config.json or checkpoint dir) and batches of micro_batch windows of
// seq_len tokens, ending with `total X GiB of Y GiB: fits` or `... does not fit`; exit 0 either way. No GPU needed.
// device_memory_gib: Y. attention: "cudnn" or "simple". Modes left "auto" are chosen as the engine would on a
// device of Y GiB. ds::Error for bad arguments or a CPU-only build.
int cmd_plan(const std::string& model, int64_t seq_len, int64_t micro_batch, int64_t docs_per_window,
             double device_memory_gib, const std::string& attention, const MemoryFlags& memory);
// `deltastack plan --hf-config OUT`: writes `model`'s configuration as the HF config.json deltastack itself writes
// (ModelConfig::to_json: model_type "qwen3_5_text", which transformers loads as Qwen3_5ForCausalLM) to OUT, without
// the plan, so peer benchmarks (scripts/peer_step.py --config) build exactly the same model. Works on a CPU build.
// An existing OUT is replaced only with `overwrite` (outputs.h).
int cmd_plan_hf_config(const std::string& model, const std::string& out, bool overwrite);

}  // namespace ds::cli
