// The engine's two ends of a KV transfer (prefill/decode disaggregation). Each object is
// shared between the engine thread and one transfer thread (a kv_connector's); the engine
// side methods are for the engine alone.
//
//  KvExport  prefill engine: a request's prompt is computed and its first token sampled;
//            the engine keeps the sequence's blocks and hands their rows out layer by layer
//            until the transfer thread releases them.
//  KvImport  decode engine: a request arrives with its first token; the engine allocates
//            blocks for the prompt and keeps the sequence "waiting for KV" while the transfer
//            thread writes the rows in; complete() lets it decode, or (on a failed transfer)
//            makes the engine compute the prompt itself, like a preempted sequence.
//
// Blocks are touched by the transfer thread only while the object is attached: the engine
// detaches it (under the object's mutex) before it frees or reuses them, so a late write or
// read never lands in another sequence's memory.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <vector>

#include "tessera/sdk/forward.h"
#include "tessera/sdk/kv_connector.h"
#include "tessera/sdk/status.h"

namespace tessera {

class KvExport {
 public:
  // Transfer thread. Waits until the prefill is done (or failed); false on timeout.
  bool wait_ready(double timeout_seconds);
  // Valid once wait_ready returned true.
  const PrefillResult& result() const { return result_; }
  // Layer `layer`'s payloads (tessera/sdk/kv_connector.h). Fails once released.
  Status read_layer(int32_t layer, std::vector<uint8_t>* k, std::vector<uint8_t>* v);
  // The transfer is over (acknowledged or abandoned): the engine frees the blocks. Idempotent.
  // Called before the prefill is ready (the caller gave up waiting), it also makes the later
  // set_ready refuse to hold the blocks.
  void release();

  // Engine thread.
  // False when the export was released already (nobody will read or release it): the engine
  // frees the blocks at once instead of holding them.
  bool set_ready(PrefillResult result, const ForwardRunner* runner, std::vector<int32_t> block_table,
                 size_t k_token_bytes, size_t v_token_bytes, std::function<void()> on_release);
  void set_failed(PrefillResult result);  // no KV to hand out (an error, or the first token ended it)
  void detach();  // the engine goes away: refuse further reads, call nothing back

 private:
  std::mutex mutex_;
  std::condition_variable ready_cv_;
  bool ready_ = false;
  bool attached_ = false;
  bool released_ = false;  // release() was called: the transfer side is gone
  PrefillResult result_;
  const ForwardRunner* runner_ = nullptr;
  std::vector<int32_t> block_table_;
  size_t k_token_bytes_ = 0, v_token_bytes_ = 0;
  std::function<void()> on_release_;
};

class KvImport {
 public:
  // Layer-pipelined decode start: the engine may schedule the sequence once its first layer
  // landed, running its first step while later layers still arrive; before that step reads
  // layer L it waits (at most `layer_wait_seconds` per layer) for layer L. A stalled or
  // failed transfer makes the engine discard that step's result for the sequence and compute
  // the prompt itself. Off: the sequence waits until every layer landed.
  struct Options {
    bool pipelined_start = true;
    double layer_wait_seconds = 2.0;
  };
  enum class LayerState { kLanded, kFailed };

  // `prefilled`: the remote prefill's result (first token, random stream, num_kv_tokens).
  explicit KvImport(PrefillResult prefilled) : KvImport(std::move(prefilled), Options{}) {}
  KvImport(PrefillResult prefilled, Options options);
  const PrefillResult& prefilled() const { return prefilled_; }
  const Options& options() const { return options_; }

  // Transfer thread. Waits until the engine allocated the blocks (ok), or decided it will
  // not take the rows (the error says why: no free blocks, the request was cancelled).
  Status wait_target(double timeout_seconds);
  // Writes one layer's payloads; kDataLoss when a size is wrong (naming the layer).
  Status write_layer(int32_t layer, std::span<const uint8_t> k, std::span<const uint8_t> v);
  // Every layer landed (ok), or the transfer failed: the engine decodes, or recomputes the
  // prompt itself. Only the first call counts.
  void complete(const Status& status);

  // Engine thread. `on_first_layer` (may be empty) runs on the transfer thread after the
  // first layer landed: the engine may schedule the sequence from then on.
  void set_target(ForwardRunner* runner, std::vector<int32_t> block_table, size_t k_token_bytes,
                  size_t v_token_bytes, std::function<void(const Status&)> on_complete,
                  std::function<void()> on_first_layer = nullptr);
  void refuse(const Status& why);  // no blocks will be given (before or instead of set_target)
  void detach();                   // the blocks are about to be freed: no write lands after this
  int64_t bytes_written() const;
  // Engine thread, inside a step's forward: waits until layer `layer` landed (kLanded), or
  // the transfer failed or was detached (kFailed). After waiting `timeout_seconds` the
  // import detaches itself, so no row lands in the blocks after a kFailed answer.
  LayerState wait_layer(int32_t layer, double timeout_seconds);
  bool all_layers_landed() const;
  int32_t layers_landed() const;

 private:
  PrefillResult prefilled_;
  Options options_;
  mutable std::mutex mutex_;
  std::condition_variable target_cv_;
  std::condition_variable layer_cv_;
  int32_t layers_landed_ = 0;  // layers 0..layers_landed_-1 are written (they arrive in order)
  bool failed_ = false;        // complete() with an error
  std::function<void()> on_first_layer_;
  bool decided_ = false;   // set_target or refuse happened
  bool attached_ = false;
  bool completed_ = false;
  Status refusal_;
  ForwardRunner* runner_ = nullptr;
  std::vector<int32_t> block_table_;
  size_t k_token_bytes_ = 0, v_token_bytes_ = 0;
  int64_t bytes_written_ = 0;
  std::function<void(const Status&)> on_complete_;
};

}  // namespace tessera
