#include "tessera/thread_pool.h"

#include <algorithm>

namespace tessera {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  num_threads_ = std::max(1, num_threads);
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_range(int index) {
  // Even split; the first `extra` ranges take one more element.
  const int64_t base = job_n_ / num_threads_;
  const int64_t extra = job_n_ % num_threads_;
  const int64_t begin = index * base + std::min<int64_t>(index, extra);
  const int64_t end = begin + base + (index < extra ? 1 : 0);
  if (begin < end) job_fn_(job_context_, begin, end, index);
}

void ThreadPool::parallel_for(int64_t n, RangeFn fn, void* context) {
  if (n <= 0) return;
  if (num_threads_ == 1 || n == 1) {
    fn(context, 0, n, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_n_ = n;
    job_fn_ = fn;
    job_context_ = context;
    pending_ = num_threads_ - 1;
    ++generation_;
  }
  work_ready_.notify_all();
  run_range(0);
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [this] { return pending_ == 0; });
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    run_range(index);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) work_done_.notify_one();
    }
  }
}

}  // namespace tessera
