// Worker threads for calls that block a thread for their whole life (a remote prefill and its
// KV transfer, a replica's token stream): a queue, a fixed pool, and the calls in flight kept
// so that shutting down can cancel them. Used by DisaggregatedDeployment and
// ReplicatedDeployment.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tessera {

template <class Call>
class BlockingCallWorkers {
 public:
  using Run = std::function<void(const std::shared_ptr<Call>&)>;

  // Starts max(1, num_workers) threads, each running `run` on one queued call at a time.
  BlockingCallWorkers(int num_workers, Run run) : run_(std::move(run)) {
    for (int i = 0; i < std::max(1, num_workers); ++i) threads_.emplace_back([this] { work(); });
  }
  ~BlockingCallWorkers() {
    stop([](Call&) {}, [](Call&) {});
  }
  BlockingCallWorkers(const BlockingCallWorkers&) = delete;
  BlockingCallWorkers& operator=(const BlockingCallWorkers&) = delete;

  // Queues a call; false once stop() began (the call is not queued).
  bool push(std::shared_ptr<Call> call) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return false;
      queue_.push_back(std::move(call));
    }
    cv_.notify_one();
    return true;
  }

  // Stops taking calls: `cancel` runs on every call in flight (so its blocking call returns),
  // `abandon` on every queued one (never run), and the threads are joined. Idempotent.
  void stop(const std::function<void(Call&)>& cancel, const std::function<void(Call&)>& abandon) {
    std::deque<std::shared_ptr<Call>> queued;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
      queued.swap(queue_);
      for (auto& c : in_flight_) cancel(*c);
    }
    cv_.notify_all();
    for (auto& c : queued) abandon(*c);
    for (auto& t : threads_) t.join();
  }

 private:
  void work() {
    for (;;) {
      std::shared_ptr<Call> call;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        call = std::move(queue_.front());
        queue_.pop_front();
        in_flight_.push_back(call);
      }
      run_(call);
      std::lock_guard<std::mutex> lock(mutex_);
      std::erase(in_flight_, call);
    }
  }

  Run run_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Call>> queue_;
  bool stopping_ = false;
  std::vector<std::shared_ptr<Call>> in_flight_;
  std::vector<std::thread> threads_;
};

}  // namespace tessera
