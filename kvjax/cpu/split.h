// Work split over XLA's FFI thread pool, shared by kvjax's CPU kernels.
//
// fn(begin, end) runs over units [0, units) in `chunks` ranges. The calling thread takes
// ranges until none are left, and tasks scheduled on the pool help where a pool thread is
// free. The caller waits only for ranges another thread has already taken (they are
// running), never for a task to start: XLA runs independent ops at once, so two kernels can
// be called from all of the pool's threads together, and had each waited for helpers of its
// own, none would ever run (a deadlock seen with two attention calls on two threads). A
// range's result does not depend on the thread that computes it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace kvjax {

template <typename Fn>
void split(xla::ffi::ThreadPool& pool, int64_t units, int64_t chunks, Fn fn) {
  if (units <= 0) return;
  chunks = std::clamp<int64_t>(chunks, 1, units);
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();  // a helper that starts late touches only this
  auto work = [state, units, chunks, fn] {
    for (int64_t c = state->next.fetch_add(1); c < chunks; c = state->next.fetch_add(1)) {
      fn(units * c / chunks, units * (c + 1) / chunks);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    auto helper = work;  // each task owns its copy (Schedule takes it by rvalue)
    pool.Schedule(std::move(helper));
  }
  work();
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

}  // namespace kvjax
