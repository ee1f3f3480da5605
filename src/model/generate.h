// Token generation (`deltastack generate`) on either engine: one sampling rule (temperature, top-k, top-p) and
// one loop, over two sources of next-token logits:
//   - decode_logits: the CPU model's carried state (Qwen35Model::decode: the prompt once, then O(1) work per token
//     in the GDN layers and one row of scores in the attention layers);
//   - prefix_logits: any engine's Engine::last_logits of the whole sequence so far, the forward run again over the
//     prefix for every token (O(n) per token: the GPU engine keeps no decode state).
// Both give the logits of the same model on the same sequence (fp32 on the CPU, bf16 compute on the GPU).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/rng.h"

namespace ds {

class Engine;       // model/engine.h
class Qwen35Model;  // model/model.h

struct SamplingOptions {
  double temperature = 0.8;  // 0: greedy (the first most likely id)
  int64_t top_k = 50;        // sample among the k most likely ids; 0: all
  double top_p = 1.0;        // then the most likely of those whose probability reaches p (nucleus); 1: off
};
// ds::Error naming the flag (--temperature, --top-k, --top-p) for a value outside its range.
void check_sampling(const SamplingOptions& o);

// The next id from logits[0, usable) (fp32; 1 <= usable <= logits.size(): the ids the tokenizer knows). Greedy
// when temperature is 0 (the lowest id of the largest logit); else softmax(logits / temperature) over the top_k
// most likely ids, cut to the shortest most-likely prefix whose mass reaches top_p (at least one id; Holtzman et
// al. 2020, "The Curious Case of Neural Text Degeneration"), renormalised, one draw of rng.uniform(). ds::Error
// for usable outside [1, logits.size()].
int32_t sample_token(const std::vector<float>& logits, int64_t usable, const SamplingOptions& o, Rng& rng);

// ds::Error when any of logits[0, usable) (the ids that may be sampled) is NaN or infinite: sampling from them
// would print tokens of garbage (greedy picks the first NaN, a softmax of inf is NaN). `position` is the number of
// tokens the logits follow (for the message).
void check_finite_logits(const std::vector<float>& logits, int64_t usable, int64_t position);

// The logits [vocab_size] after the last of `ids` (the whole sequence so far: prompt + generated; each call's ids
// extend the previous call's by the tokens generated since).
using NextLogits = std::function<std::vector<float>(const std::vector<int32_t>& ids)>;
// The CPU model's decode on a state carried between calls (feeds only the ids not seen yet). The model must
// outlive the function.
NextLogits decode_logits(Qwen35Model& model);
// engine.last_logits of one document holding all of `ids` (prefix recompute). The engine must outlive the function.
NextLogits prefix_logits(Engine& engine);

struct GenerateOptions {
  SamplingOptions sampling;
  int64_t max_new_tokens = 100;
  int64_t usable = 0;              // ids that may be sampled: [0, usable) (min of model and tokenizer vocabularies)
  std::vector<int32_t> stop_ids;   // generation ends at the first of these (not returned): <|endoftext|>, <|im_end|>
  uint64_t seed = 0;
};
// Samples up to max_new_tokens ids after `prompt` (not empty) and returns them; on_token (if set) sees the ids
// generated so far after each one (streaming); ds::Error (check_finite_logits) at the first step whose logits are
// not finite, after the tokens already streamed. The same seed, logits and options give the same ids on either source.
std::vector<int32_t> generate_tokens(const NextLogits& next, const std::vector<int32_t>& prompt,
                                     const GenerateOptions& o,
                                     const std::function<void(const std::vector<int32_t>&)>& on_token = {});

}  // namespace ds
