#include <algorithm>
#include <memory>
#include <utility>

#include "cli/commands/commands.h"
#include "cli/commands/outputs.h"
#include "core/error.h"
#include "model/engine.h"
#include "model/model.h"
#include "model/safetensors.h"

namespace ds::cli {

int cmd_forward(const std::string& model_dir, const std::string& inputs, const std::string& output,
                const std::string& grads, const std::string& device, bool overwrite, const std::string& precision) {
  const Precision prec = parse_precision(precision);
  check_outputs({{"--output", output}, {"--grads", grads}}, {inputs, model_dir}, overwrite);
  Qwen35Model model(ModelConfig::from_file(model_dir));
  model.load(model_dir);
  const ModelConfig c = model.config();
  SafetensorsReader in(inputs);
  const TensorInfo* ids_info = in.find("input_ids");
  DS_CHECK(ids_info, "{}: missing tensor \"input_ids\"", inputs);
  DS_CHECK(ids_info->shape.size() == 2 || ids_info->shape.size() == 1, "{}: input_ids must be [B, T] or [T]", inputs);
  const int64_t B = ids_info->shape.size() == 2 ? ids_info->shape[0] : 1;
  const int64_t T = ids_info->shape.back();
  DS_CHECK(B >= 1 && T >= 1, "{}: input_ids is empty", inputs);
  std::vector<int64_t> ids = in.read_i64("input_ids");
  std::vector<int64_t> labels;
  if (in.has("labels")) {
    DS_CHECK(in.find("labels")->shape == ids_info->shape, "{}: labels shape differs from input_ids", inputs);
    labels = in.read_i64("labels");
  }
  DS_CHECK(grads.empty() || !labels.empty(), "--grads needs labels in {}", inputs);

  // Segments: one per batch row, or the given cu_seqlens inside a single row.
  std::vector<int64_t> cu;
  if (in.has("cu_seqlens")) {
    DS_CHECK(B == 1, "{}: cu_seqlens needs a single row (B = 1), got B = {}", inputs, B);
    cu = in.read_i64("cu_seqlens");
    DS_CHECK(cu.size() >= 2 && cu.front() == 0 && cu.back() == T, "{}: cu_seqlens must run from 0 to T = {}", inputs, T);
  } else {
    for (int64_t b = 0; b <= B; ++b) cu.push_back(b * T);
  }
  PackedBatch batch;
  for (int64_t x : ids) {
    DS_CHECK(x >= 0 && x < c.vocab_size, "{}: input id {} outside the vocabulary [0, {})", inputs, x, c.vocab_size);
    batch.input_ids.push_back(static_cast<int32_t>(x));
  }
  batch.targets.assign(ids.size(), -100);
  for (int64_t x : cu) batch.cu_seqlens.push_back(static_cast<int32_t>(x));
  // HF shift inside each segment: position t predicts labels[t + 1]; nothing crosses a segment.
  if (!labels.empty())
    for (size_t s = 0; s + 1 < cu.size(); ++s)
      for (int64_t t = cu[s]; t + 1 < cu[s + 1]; ++t) {
        int64_t y = labels[static_cast<size_t>(t + 1)];
        DS_CHECK(y == -100 || (y >= 0 && y < c.vocab_size), "{}: label {} outside the vocabulary", inputs, y);
        batch.targets[static_cast<size_t>(t)] = static_cast<int32_t>(y);
      }
  batch.finalize(inputs);
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
  if (!labels.empty()) {
    float loss = valid > 0 ? static_cast<float>(r.loss_sum / static_cast<double>(valid)) : NAN;
    out.push_back(make_tensor_f32("loss", {1}, &loss));
  }
  for (size_t i = 0; i < cap.hidden.size(); ++i)
    out.push_back(make_tensor_f32("hidden_states_" + std::to_string(i), shape_h, cap.hidden[i].data()));
  write_safetensors(output, out, {{"format", "pt"}});
  if (!grads.empty()) write_safetensors(grads, engine->grad_tensors(), {{"format", "pt"}});
  return 0;
}

}  // namespace ds::cli
