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
    if (!attached_) return;
    attached_ = false;
    callback = std::move(on_release_);
    on_release_ = nullptr;
  }
  if (callback) callback();
}

void KvExport::set_ready(PrefillResult result, const ForwardRunner* runner, std::vector<int32_t> block_table,
                         size_t k_token_bytes, size_t v_token_bytes, std::function<void()> on_release) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
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

Status KvImport::wait_target(double timeout_seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!target_cv_.wait_for(lock, seconds(timeout_seconds), [this] { return decided_; }))
    return deadline_exceeded("the decode engine did not allocate KV blocks within " +
                             std::to_string(timeout_seconds) + " s");
  if (!attached_) return refusal_.is_ok() ? Status(StatusCode::kCancelled, "the request ended") : refusal_;
  return Status::ok();
}

Status KvImport::write_layer(int32_t layer, std::span<const uint8_t> k, std::span<const uint8_t> v) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!attached_) return refusal_.is_ok() ? Status(StatusCode::kCancelled, "the request ended") : refusal_;
  const auto n = static_cast<size_t>(prefilled_.num_kv_tokens);
  if (k.size() != n * k_token_bytes_ || v.size() != n * v_token_bytes_)
    return data_loss("KV layer " + std::to_string(layer) + ": " + std::to_string(k.size()) + " K and " +
                     std::to_string(v.size()) + " V bytes for " + std::to_string(n) + " tokens, expected " +
                     std::to_string(n * k_token_bytes_) + " and " + std::to_string(n * v_token_bytes_));
  Status st = runner_->write_kv_layer(layer, block_table_, prefilled_.num_kv_tokens, k.data(), v.data());
  if (st.is_ok()) bytes_written_ += static_cast<int64_t>(k.size() + v.size());
  return st;
}

void KvImport::complete(const Status& status) {
  std::function<void(const Status&)> callback;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return;
    completed_ = true;
    callback = std::move(on_complete_);
    on_complete_ = nullptr;
  }
  if (callback) callback(status);
}

void KvImport::set_target(ForwardRunner* runner, std::vector<int32_t> block_table, size_t k_token_bytes,
                          size_t v_token_bytes, std::function<void(const Status&)> on_complete) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    runner_ = runner;
    block_table_ = std::move(block_table);
    k_token_bytes_ = k_token_bytes;
    v_token_bytes_ = v_token_bytes;
    on_complete_ = std::move(on_complete);
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
    decided_ = true;
  }
  target_cv_.notify_all();
}

void KvImport::detach() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    attached_ = false;
    on_complete_ = nullptr;
    if (refusal_.is_ok()) refusal_ = Status(StatusCode::kCancelled, "the request ended");
    decided_ = true;
  }
  target_cv_.notify_all();
}

int64_t KvImport::bytes_written() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_written_;
}

}  // namespace tessera
