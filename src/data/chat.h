// Supervised fine-tuning samples: chat conversations rendered with the bundled Qwen3 chat template, and
// prompt / completion pairs, each as text plus the byte ranges whose tokens are labelled (trained on).
//
// The renderer implements the semantics of one template, the chat_template of
// data/qwen3_tokenizer/tokenizer_config.json (Qwen's ChatML with <think> blocks), not a general Jinja engine; what
// that template does with tools (a "tools" list, "tool" messages, "tool_calls") is not supported and is an error.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "data/tokenizer.h"

namespace ds {

// Bytes [begin, end) of a text.
struct ByteSpan {
  size_t begin = 0, end = 0;
};

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
  std::optional<std::string> reasoning_content;  // assistant only: the thinking, rendered inside <think>...</think>
};

// The template variables transformers' apply_chat_template passes (add_generation_prompt, enable_thinking).
struct ChatTemplateOptions {
  bool add_generation_prompt = false;  // end with "<|im_start|>assistant\n" (never labelled)
  bool enable_thinking = true;         // false: the generation prompt also gets an empty "<think>\n\n</think>\n\n"
  // Assistant turns at message index >= label_from are labelled (0: all of them; a prompt / completion pair
  // labels the completion's only).
  size_t label_from = 0;
};

// A sample as text and its labelled bytes; `masked` false means every token is labelled (plain text).
struct LabelledText {
  std::string text;
  bool masked = false;
  std::vector<ByteSpan> labels;  // sorted, disjoint
  // Tokenized span by span (the text between and inside the labels each on its own), so that no token straddles a
  // label boundary: a string prompt / completion pair, where the boundary is plain text (a completion "lo" after
  // "Hel" would otherwise merge into one unlabelled token). Conversations keep one pass: their boundaries are
  // special tokens.
  bool split_at_labels = false;
};

// Renders `messages` as the bundled template does (tokenizer_config.json's chat_template, tools absent):
// an optional leading system turn, then "<|im_start|>ROLE\nCONTENT<|im_end|>\n" per turn; an assistant turn after the
// last user turn gets "<think>\nREASONING\n</think>\n\n" before its content when it is the last message or has
// reasoning (reasoning_content, else the text before "</think>" in its content); earlier assistant turns keep only
// the text after "</think>". Labels: each assistant turn's bytes after its "<|im_start|>assistant\n" header through
// its "<|im_end|>". ds::Error (no location: the caller adds file and line) for no messages or an unknown role.
LabelledText render_qwen3_chat(const std::vector<ChatMessage>& messages, const ChatTemplateOptions& options);

// One SFT / pre-training sample from a parsed .jsonl object, which holds exactly one of:
//   "text": string                         -> the text, every token labelled;
//   "messages": [{role, content, reasoning_content?}, ...] with optional "add_generation_prompt" and
//               "enable_thinking" (booleans, as transformers' apply_chat_template takes them) -> render_qwen3_chat;
//   "prompt" and "completion": strings     -> prompt + completion, the completion's bytes labelled (TRL's standard
//               prompt-completion form); or message lists -> rendered as one conversation, labels on the
//               completion's assistant turns (TRL's conversational form).
// ds::Error naming the field (e.g. `messages[2].role`) for anything else: a missing or non-string field, an unknown
// role, tools ("tools", "tool" messages, "tool_calls"), more than one of the forms. No file or line in the message:
// the caller adds them.
LabelledText parse_sample(const nlohmann::json& line);

// A tokenized sample: ids and, when masked, loss_mask[i] = 1 where token i is labelled (its bytes lie wholly inside
// a label span: tokenizer offsets, as transformers' return_offsets_mapping), else 0. Unmasked: loss_mask empty.
struct TokenizedSample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> loss_mask;  // [ids.size()] or empty (all labelled)
};
// Tokenizes `sample.text` (ids = Tokenizer::encode) and builds its mask. Errors as Tokenizer::encode, and
// check_chat_tokens' for a rendered conversation (masked, not split_at_labels).
TokenizedSample tokenize_sample(const Tokenizer& tok, const LabelledText& sample);

// ds::Error naming the tokenizer's file and the token when it lacks <|im_start|> or <|im_end|> as added tokens: the
// chat template's turns would be encoded as plain text, and the labels would cut through merged tokens.
void check_chat_tokens(const Tokenizer& tok);

}  // namespace ds
