// A persistent pool of worker threads behind the SDK's Executor. The calling thread takes
// the first range itself, so a pool of N threads starts N-1 workers.
//
// A forward pass issues hundreds of parallel_for calls per token (several per layer), each
// only microseconds long at batch 1, so dispatch must cost far less than a mutex + condition
// variable round trip. Jobs are published through an atomic generation counter; workers spin
// on it for a short while (the next job usually arrives within microseconds) and only then
// sleep in a futex wait (std::atomic::wait). Completion is an atomic countdown the caller
// spins on the same way.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "tessera/sdk/executor.h"

namespace tessera {

// The most threads a pool (and so model.threads or a backend's threads) may have: llama.cpp's
// bound too. Far past any useful count on today's CPUs, and low enough that asking for it
// cannot exhaust the process's thread or stack limits.
inline constexpr int kMaxThreadPoolThreads = 512;

class ThreadPool final : public Executor {
 public:
  // num_threads <= 0 means std::thread::hardware_concurrency(). Throws std::runtime_error
  // (having joined the workers it started) when num_threads exceeds kMaxThreadPoolThreads or
  // the system refuses a thread.
  explicit ThreadPool(int num_threads);
  ~ThreadPool() override;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const override { return num_threads_; }
  void parallel_for(int64_t n, RangeFn fn, void* context) override;

 private:
  void stop_workers();
  void worker_loop(int index);
  void run_range(int index);

  int num_threads_ = 1;
  std::vector<std::thread> workers_;
  // Bumped after the job fields below are written; workers wake on change. 32 bits so it can
  // be a futex word (wrap-around is harmless: workers only compare for inequality).
  alignas(64) std::atomic<uint32_t> generation_{0};
  std::atomic<int> sleeping_workers_{0};  // workers in (or entering) a futex wait
  // Workers still running the current generation; the caller waits for 0.
  alignas(64) std::atomic<uint32_t> pending_{0};
  std::atomic<int> caller_sleeping_{0};
  std::atomic<bool> stopping_{false};
  // The current job, written before generation_ is bumped.
  int64_t job_n_ = 0;
  RangeFn job_fn_ = nullptr;
  void* job_context_ = nullptr;
};

}  // namespace tessera
