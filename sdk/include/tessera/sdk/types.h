// Value types the plugin kinds exchange with the engine.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tessera {

using TokenId = int32_t;
using SeqId = uint64_t;

// Sampling parameters of one request (OpenAI/llama.cpp semantics). Plain data, copied freely.
struct SamplingParams {
  float temperature = 1.0f;   // 0 means greedy (argmax)
  int32_t top_k = 0;          // 0 disables
  float top_p = 1.0f;         // 1 disables
  float min_p = 0.0f;         // 0 disables
  float repetition_penalty = 1.0f;  // llama.cpp "repeat_penalty"; 1 disables
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int32_t penalty_last_n = 64;      // how many recent tokens the penalties see; -1 = all
  uint64_t seed = 0;                // used when has_seed; otherwise the engine picks one
  bool has_seed = false;
  int32_t max_tokens = 128;         // new tokens to generate at most
  int32_t num_logprobs = 0;         // top-N alternatives to report per token (0 = none)
  bool ignore_eos = false;
  std::vector<TokenId> stop_token_ids;  // besides the model's end-of-generation tokens

  bool is_greedy() const { return temperature <= 0.0f; }
};

enum class SequenceStatus { kWaiting, kRunning, kFinished };

enum class FinishReason { kNone, kStop, kLength, kCancelled, kError };

inline const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "unknown";
}

// What schedulers, KV managers and drafters may read of a sequence. The engine owns it and
// keeps it current; a pointer handed to a plugin stays valid until the engine tells the
// plugin the sequence is gone (Scheduler::remove, KvCacheManager::free). Not thread-safe:
// read only from the engine's step thread.
struct SequenceInfo {
  SeqId id = 0;
  uint64_t request_id = 0;
  int32_t priority = 0;            // larger runs first under the priority scheduler
  double arrival_time = 0.0;       // seconds on the engine's monotonic clock
  int32_t num_prompt_tokens = 0;
  int32_t max_new_tokens = 0;      // generation stops at num_prompt_tokens + max_new_tokens
  // Tokens whose K/V are in the cache. The next scheduled chunk starts here.
  int32_t num_computed_tokens = 0;
  // Draft tokens appended to `tokens` to be verified this step (speculative decoding).
  int32_t num_draft_tokens = 0;
  int32_t num_preemptions = 0;
  SequenceStatus status = SequenceStatus::kWaiting;
  // Prompt followed by the generated tokens, then any draft tokens.
  std::span<const TokenId> tokens;

  int32_t num_tokens() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_generated() const { return num_tokens() - num_draft_tokens - num_prompt_tokens; }
  // Tokens still to be fed through the model before the next token can be sampled.
  int32_t num_uncomputed() const { return num_tokens() - num_computed_tokens; }
  bool is_prefill() const { return num_computed_tokens < num_prompt_tokens; }
};

// Element type of the KV cache.
enum class KvDtype { kF32, kF16 };

inline size_t kv_dtype_size(KvDtype t) { return t == KvDtype::kF32 ? 4 : 2; }
inline const char* kv_dtype_name(KvDtype t) { return t == KvDtype::kF32 ? "f32" : "f16"; }

}  // namespace tessera
