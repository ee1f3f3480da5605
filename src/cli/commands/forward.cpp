#include <algorithm>
#include <memory>
#include <utility>

#include "cli/commands/commands.h"
#include "cli/commands/outputs.h"
#include "core/error.h"
#include "core/fs_safety.h"
#include "model/engine.h"
#include "model/forward_inputs.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "train/lora_train.h"

namespace ds::cli {

int cmd_forward(const std::string& model_dir, const std::string& inputs, const std::string& output,
                const std::string& grads, const std::string& device, bool overwrite, const std::string& precision,
                const std::string& adapter) {
  const Precision prec = parse_precision(precision);
  check_outputs({{"--output", output}, {"--grads", grads}}, {inputs, model_dir, adapter}, overwrite);
  // All that the final renames may replace: a file that appears there meanwhile (another forward's output, the
  // user's) stays, and this run fails naming it.
  const FileIdentity output_before = file_identity(output);
  const FileIdentity grads_before = grads.empty() ? FileIdentity{} : file_identity(grads);
  Qwen35Model model(ModelConfig::from_file(model_dir));
  model.load(model_dir);
  if (!adapter.empty()) model.set_adapter(load_adapter(adapter, model, model_dir));
  const ModelConfig c = model.config();
  SafetensorsReader in(inputs);
  ForwardInputs fi = read_forward_inputs(in, c.vocab_size);
  const int64_t B = fi.B, T = fi.T;
  PackedBatch& batch = fi.batch;
  DS_CHECK(grads.empty() || fi.has_labels, "--grads needs labels in {}", inputs);
  int64_t valid = batch.num_targets();
  ForwardCapture cap;
  cap.hidden_states = true;
  cap.logits = true;
  double scale = (!grads.empty() && valid > 0) ? 1.0 / static_cast<double>(valid) : 0.0;
  GpuPlan plan;  // exactly this batch (the GPU engine's plan; the CPU engine reads only its precision)
  plan.precision = prec;
  plan.max_tokens = batch.size();
  plan.max_seqs = static_cast<int64_t>(batch.cu_seqlens.size()) - 1;
  for (size_t i = 0; i + 1 < batch.cu_seqlens.size(); ++i)
    plan.max_seqlen = std::max<int64_t>(plan.max_seqlen, batch.cu_seqlens[i + 1] - batch.cu_seqlens[i]);
  std::unique_ptr<Engine> engine = make_engine(device, std::move(model), plan);
  engine->zero_grads();
  const LossResult r = engine->forward_backward(batch, scale, 0.0, &cap);

  std::vector<SaveTensor> out;
  std::vector<int64_t> shape_v = {B, T, c.vocab_size}, shape_h = {B, T, c.hidden_size};
  out.push_back(make_tensor_f32("logits", shape_v, cap.logits_values.data()));
  if (fi.has_labels) {
    float loss = valid > 0 ? static_cast<float>(r.loss_sum / static_cast<double>(valid)) : NAN;
    out.push_back(make_tensor_f32("loss", {1}, &loss));
  }
  for (size_t i = 0; i < cap.hidden.size(); ++i)
    out.push_back(make_tensor_f32("hidden_states_" + std::to_string(i), shape_h, cap.hidden[i].data()));
  test_replace_gate();
  write_safetensors(output, out, {{"format", "pt"}}, output_before, "--output " + output);
  if (!grads.empty())
    write_safetensors(grads, engine->grad_tensors(), {{"format", "pt"}}, grads_before, "--grads " + grads);
  return 0;
}

}  // namespace ds::cli
