#include "tessera/kv_transfer.h"

#include <chrono>
#include <string>

namespace tessera {
namespace {
std::chrono::duration<double> seconds(double s) { return std::chrono::duration<double>(s); }
}  // namespace

bool KvExport::wait_ready(double timeout_seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  return ready_cv_.wait_for(lock, seconds(timeout_seconds), [this] { return ready_; });
}

Status KvExport::read_layer(int32_t layer, std::vector<uint8_t>* k, std::vector<uint8_t>* v) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!attached_) return Status(StatusCode::kCancelled, "the prefill's blocks were released");
  const auto n = static_cast<size_t>(result_.num_kv_tokens);
  k->resize(n * k_token_bytes_);
  v->resize(n * v_token_bytes_);
  // Held under the mutex: release() cannot hand the blocks back to the engine meanwhile.
  return runner_->read_kv_layer(layer, block_table_, result_.num_kv_tokens, k->data(), v->data());
}

void KvExport::release() {
  std::function<void()> callback;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    released_ = true;
    if (!attached_) return;
    attached_ = false;
    callback = std::move(on_release_);
    on_release_ = nullptr;
  }
  if (callback) callback();
}

bool KvExport::set_ready(PrefillResult result, const ForwardRunner* runner, std::vector<int32_t> block_table,
                         size_t k_token_bytes, size_t v_token_bytes, std::function<void()> on_release) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // The host gave up on this prefill (its call was cancelled or timed out) before it
    // finished: holding the blocks would keep them until the engine stops.
    if (released_) {
      ready_ = true;
      return false;
    }
    result_ = std::move(result);
    runner_ = runner;
    block_table_ = std::move(block_table);
    k_token_bytes_ = k_token_bytes;
    v_token_bytes_ = v_token_bytes;
    on_release_ = std::move(on_release);
    attached_ = true;
    ready_ = true;
  }
  ready_cv_.notify_all();
  return true;
}

void KvExport::set_failed(PrefillResult result) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (ready_) return;
    result_ = std::move(result);
    attached_ = false;
    ready_ = true;
  }
  ready_cv_.notify_all();
}

void KvExport::detach() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    attached_ = false;
    on_release_ = nullptr;
    if (!ready_) {
      result_.finish = FinishReason::kError;
      result_.error = Status(StatusCode::kUnavailable, "the prefill engine stopped");
      ready_ = true;
    }
  }
  ready_cv_.notify_all();
}

KvImport::KvImport(PrefillResult prefilled, Options options)
    : prefilled_(std::move(prefilled)), options_(options) {}

Status KvImport::wait_target(double timeout_seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!target_cv_.wait_for(lock, seconds(timeout_seconds), [this] { return decided_; }))
    return deadline_exceeded("the decode engine did not allocate KV blocks within " +
                             std::to_string(timeout_seconds) + " s");
  if (!attached_) return refusal_.is_ok() ? Status(StatusCode::kCancelled, "the request ended") : refusal_;
  return Status::ok();
}

Status KvImport::write_layer(int32_t layer, std::span<const uint8_t> k, std::span<const uint8_t> v) {
  std::function<void()> first_layer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!attached_) return refusal_.is_ok() ? Status(StatusCode::kCancelled, "the request ended") : refusal_;
    // A pipelined step reads layer L once layers 0..L landed: they must come in order.
    if (layer != layers_landed_)
      return data_loss("KV layer " + std::to_string(layer) + " arrived, expected layer " +
                       std::to_string(layers_landed_) + " (layers come in order)");
    const auto n = static_cast<size_t>(prefilled_.num_kv_tokens);
    if (k.size() != n * k_token_bytes_ || v.size() != n * v_token_bytes_)
      return data_loss("KV layer " + std::to_string(layer) + ": " + std::to_string(k.size()) + " K and " +
                       std::to_string(v.size()) + " V bytes for " + std::to_string(n) + " tokens, expected " +
                       std::to_string(n * k_token_bytes_) + " and " + std::to_string(n * v_token_bytes_));
    Status st = runner_->write_kv_layer(layer, block_table_, prefilled_.num_kv_tokens, k.data(), v.data());
    if (!st.is_ok()) return st;
    bytes_written_ += static_cast<int64_t>(k.size() + v.size());
    ++layers_landed_;
    if (layers_landed_ == 1) first_layer = std::move(on_first_layer_);
    on_first_layer_ = nullptr;
  }
  layer_cv_.notify_all();
  if (first_layer) first_layer();
  return Status::ok();
}

void KvImport::complete(const Status& status) {
  std::function<void(const Status&)> callback;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return;
    completed_ = true;
    if (!status.is_ok()) failed_ = true;
    callback = std::move(on_complete_);
    on_complete_ = nullptr;
  }
  layer_cv_.notify_all();
  if (callback) callback(status);
}

void KvImport::set_target(ForwardRunner* runner, std::vector<int32_t> block_table, size_t k_token_bytes,
                          size_t v_token_bytes, std::function<void(const Status&)> on_complete,
                          std::function<void()> on_first_layer) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    runner_ = runner;
    block_table_ = std::move(block_table);
    k_token_bytes_ = k_token_bytes;
    v_token_bytes_ = v_token_bytes;
    on_complete_ = std::move(on_complete);
    on_first_layer_ = std::move(on_first_layer);
    attached_ = true;
    decided_ = true;
  }
  target_cv_.notify_all();
}

void KvImport::refuse(const Status& why) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    refusal_ = why;
    attached_ = false;
    on_first_layer_ = nullptr;
    decided_ = true;
  }
  target_cv_.notify_all();
  layer_cv_.notify_all();
}

void KvImport::detach() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    attached_ = false;
    on_complete_ = nullptr;
    on_first_layer_ = nullptr;
    if (refusal_.is_ok()) refusal_ = Status(StatusCode::kCancelled, "the request ended");
    decided_ = true;
  }
  target_cv_.notify_all();
  layer_cv_.notify_all();
}

KvImport::LayerState KvImport::wait_layer(int32_t layer, double timeout_seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto ready = [&] { return layers_landed_ > layer || failed_ || !attached_; };
  if (!layer_cv_.wait_for(lock, seconds(timeout_seconds), ready)) {
    // Stalled: stop the transfer writing here, so the step may go on over these blocks.
    attached_ = false;
    on_first_layer_ = nullptr;
    refusal_ = deadline_exceeded("KV layer " + std::to_string(layer) + " did not land within " +
                                 std::to_string(timeout_seconds) + " s of the decode step that needed it");
    return LayerState::kFailed;
  }
  return layers_landed_ > layer ? LayerState::kLanded : LayerState::kFailed;
}

bool KvImport::all_layers_landed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layers_landed_ >= prefilled_.num_layers;
}

int32_t KvImport::layers_landed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return layers_landed_;
}

int64_t KvImport::bytes_written() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_written_;
}

}  // namespace tessera
