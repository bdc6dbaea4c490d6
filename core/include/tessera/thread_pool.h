// A persistent pool of worker threads behind the SDK's Executor. The calling thread takes
// the first range itself, so a pool of N threads starts N-1 workers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "tessera/sdk/executor.h"

namespace tessera {

class ThreadPool final : public Executor {
 public:
  // num_threads <= 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
  ~ThreadPool() override;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const override { return num_threads_; }
  void parallel_for(int64_t n, RangeFn fn, void* context) override;

 private:
  void worker_loop(int index);
  void run_range(int index);

  int num_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  uint64_t generation_ = 0;     // bumped per parallel_for; workers wake on change
  int pending_ = 0;             // workers still running the current generation
  bool stopping_ = false;
  // The current job, written under mutex_ before generation_ is bumped.
  int64_t job_n_ = 0;
  RangeFn job_fn_ = nullptr;
  void* job_context_ = nullptr;
};

}  // namespace tessera
