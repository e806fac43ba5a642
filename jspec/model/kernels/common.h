// What jspec's native kernels (matmul.cc, attention.cc) share: the AVX2 + FMA target, the
// horizontal sum of 8 lanes, and the way one call spreads its work over XLA's CPU thread pool.
//
// Only functions marked AVX2 are compiled for AVX2 + FMA (target attributes), so the library
// loads on any x86-64 CPU and jspec_cpu_supported() tells Python whether it may be used.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

#define AVX2 __attribute__((target("avx2,fma")))

namespace jspec {

AVX2 inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Runs body(item) for every item in [0, items), on the calling thread and on helpers from XLA's
// pool (one per further core), and returns when every item has run. Items are claimed from a
// counter, not split up front: the caller never waits for a helper that has not started (no
// deadlock when the pool is busy), and a core slowed by another process takes fewer. The state
// is shared through a shared_ptr: a helper the pool starts after the call has returned finds no
// item left and only drops its reference.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, Body body) {
  struct State {
    State(Body body, int64_t items) : body(std::move(body)), items(items) {}
    Body body;
    int64_t items;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};

    void Run() {
      for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        body(item);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(body), items);
  const int64_t threads = std::min<int64_t>(pool.num_threads(), std::thread::hardware_concurrency());
  for (int64_t i = 1; i < std::min(threads, items); ++i) pool.Schedule([state] { state->Run(); });
  state->Run();
  while (state->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace jspec
