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

// Storage type of K or V rows in the KV cache (since SDK ABI 2.0 K and V each have their
// own, see KvLayout and AttentionShape).
//  - kF32, kF16: one float / IEEE half per element.
//  - kQ8_0: ggml's block_q8_0 (KvBlockQ8_0) — each run of 32 consecutive elements of a
//    head's row is one f16 scale d and 32 int8 values q, element = d * q. A head's row of
//    head_dim elements is head_dim / 32 blocks (head_dim must be a multiple of 32); a token's
//    row of all KV heads is those rows back to back, so blocks never straddle heads. The
//    core's runner stores each head's row Hadamard-rotated where head_dim is a multiple of 64
//    (Q rotated alike for K, the attention output rotated back for V: core
//    tessera/kv_rotation.h), which attention kernels need not know about.
enum class KvDtype { kF32, kF16, kQ8_0 };

inline constexpr int32_t kKvQ8BlockElems = 32;
struct KvBlockQ8_0 {
  uint16_t d;                     // IEEE half scale
  int8_t qs[kKvQ8BlockElems];     // element i = d * qs[i]
};
static_assert(sizeof(KvBlockQ8_0) == 34, "ggml's block_q8_0 layout");

// Bytes of `elems` consecutive elements of one row (elems a multiple of 32 for kQ8_0).
inline size_t kv_row_bytes(KvDtype t, int64_t elems) {
  switch (t) {
    case KvDtype::kF32: return static_cast<size_t>(elems) * 4;
    case KvDtype::kF16: return static_cast<size_t>(elems) * 2;
    case KvDtype::kQ8_0: return static_cast<size_t>(elems / kKvQ8BlockElems) * sizeof(KvBlockQ8_0);
  }
  return 0;
}
// Whether rows of head_dim elements can be stored in `t` (kQ8_0: head_dim % 32 == 0).
inline bool kv_dtype_fits(KvDtype t, int32_t head_dim) {
  return t != KvDtype::kQ8_0 || head_dim % kKvQ8BlockElems == 0;
}
// Bytes per element of the float types; 0 for block types (use kv_row_bytes).
inline size_t kv_dtype_size(KvDtype t) {
  return t == KvDtype::kF32 ? 4 : t == KvDtype::kF16 ? 2 : 0;
}
inline const char* kv_dtype_name(KvDtype t) {
  return t == KvDtype::kF32 ? "f32" : t == KvDtype::kF16 ? "f16" : "q8_0";
}

}  // namespace tessera
