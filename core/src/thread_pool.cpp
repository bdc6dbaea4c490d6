#include "tessera/thread_pool.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <system_error>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tessera {

namespace {

// Busy-wait step `spin` of a waiter: a pause for the first kPauseIterations steps (the next
// job or the other ranges usually arrive within microseconds on an idle machine), then
// sched_yield, which costs a fast syscall when the core is otherwise idle but hands the core
// to another runnable thread (often the very thread being waited for) when the machine is
// oversubscribed, where pure spinning would burn the time slice it waits on.
constexpr int kPauseIterations = 256;

inline void cpu_relax(int spin) {
#if defined(__x86_64__) || defined(__i386__)
  if (spin < kPauseIterations) {
    _mm_pause();
    return;
  }
#endif
  std::this_thread::yield();
}

// Sleeps while *word == expected (spurious returns are fine: callers re-check).
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
#else
  word->wait(expected, std::memory_order_seq_cst);
#endif
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
          nullptr, 0);
#else
  word->notify_all();
#endif
}

// Busy-wait steps before a waiter falls back to a futex sleep: a few hundred microseconds,
// longer than the gap between two parallel_for calls of one forward pass, short enough that
// an idle engine soon sleeps.
constexpr int kSpinIterations = 1 << 11;

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  if (num_threads > kMaxThreadPoolThreads)
    throw std::runtime_error("a thread pool of " + std::to_string(num_threads) +
                             " threads was asked for; at most " +
                             std::to_string(kMaxThreadPoolThreads) + " are supported");
  num_threads_ = std::max(1, num_threads);
  try {
    for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  } catch (const std::system_error& e) {
    // Destroying a joinable std::thread calls std::terminate: stop the started ones first.
    const size_t started = workers_.size();
    stop_workers();
    throw std::runtime_error("could not start thread " + std::to_string(started + 1) + " of " +
                             std::to_string(num_threads_) + ": " + e.what());
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() {
  stopping_.store(true, std::memory_order_seq_cst);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&generation_);
  for (auto& t : workers_) t.join();
  workers_.clear();
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
  // The previous job has fully completed (pending_ reached 0 before it returned), so no
  // worker reads the job fields while they are rewritten here.
  job_n_ = n;
  job_fn_ = fn;
  job_context_ = context;
  pending_.store(static_cast<uint32_t>(num_threads_ - 1), std::memory_order_relaxed);
  // seq_cst pairs with the workers' sleeping_workers_ increment: either we see a sleeper and
  // wake it, or the sleeper sees the new generation before it sleeps.
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleeping_workers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&generation_);
  run_range(0);
  for (int spin = 0;; ++spin) {
    const uint32_t left = pending_.load(std::memory_order_acquire);
    if (left == 0) return;
    if (spin < kSpinIterations) {
      cpu_relax(spin);
      continue;
    }
    caller_sleeping_.store(1, std::memory_order_seq_cst);
    if (pending_.load(std::memory_order_seq_cst) == left) futex_wait(&pending_, left);
    caller_sleeping_.store(0, std::memory_order_relaxed);
  }
}

void ThreadPool::worker_loop(int index) {
  uint32_t seen = 0;
  for (;;) {
    uint32_t gen = generation_.load(std::memory_order_acquire);
    for (int spin = 0; gen == seen; ++spin) {
      if (spin < kSpinIterations) {
        cpu_relax(spin);
      } else {
        sleeping_workers_.fetch_add(1, std::memory_order_seq_cst);
        if (generation_.load(std::memory_order_seq_cst) == seen) futex_wait(&generation_, seen);
        sleeping_workers_.fetch_sub(1, std::memory_order_relaxed);
        spin = 0;
      }
      gen = generation_.load(std::memory_order_acquire);
    }
    seen = gen;
    if (stopping_.load(std::memory_order_acquire)) return;
    run_range(index);
    if (pending_.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
        caller_sleeping_.load(std::memory_order_seq_cst) != 0)
      futex_wake_all(&pending_);
  }
}

}  // namespace tessera
