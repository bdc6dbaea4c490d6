// Parallel execution on the backend's threads. The CPU backend runs a persistent pool;
// plugins that compute on the CPU (attention, quantized matmul) split their work through it.
#pragma once

#include <cstdint>
#include <utility>

namespace tessera {

class Executor {
 public:
  using RangeFn = void (*)(void* context, int64_t begin, int64_t end, int thread_index);

  virtual ~Executor() = default;
  virtual int num_threads() const = 0;
  // Calls fn over [0, n) split into contiguous ranges, one per thread at most, and returns
  // when all ranges are done. Not reentrant: do not call from inside fn.
  virtual void parallel_for(int64_t n, RangeFn fn, void* context) = 0;

  // Convenience for lambdas: f(begin, end, thread_index).
  template <class F>
  void run(int64_t n, F&& f) {
    auto trampoline = [](void* ctx, int64_t b, int64_t e, int t) {
      (*static_cast<std::remove_reference_t<F>*>(ctx))(b, e, t);
    };
    parallel_for(n, trampoline, const_cast<void*>(static_cast<const void*>(&f)));
  }
};

}  // namespace tessera
