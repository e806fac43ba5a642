// What jspec's native kernels (matmul.cc, attention.cc) share: the AVX2 + FMA and AVX-512
// targets and whether to take the latter, the horizontal sum of 8 lanes, and the way one call
// spreads its work over the CPU's cores.
//
// Only functions marked AVX2 or AVX512 are compiled for those instructions (target attributes),
// so the library loads on any x86-64 CPU and jspec_cpu_supported() tells Python whether it may be
// used.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl")))

namespace jspec {

inline bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

// Whether the kernels take their AVX-512 paths: the CPU's answer, unless a test turned them off
// (jspec_use_avx512 in matmul.cc) to run the AVX2 paths on a CPU that has both. Both paths give
// the same bits, except int8 products (16-lane sums where AVX2 has 8).
inline std::atomic<bool>& UseAvx512() {
  static std::atomic<bool> use{CpuHasAvx512()};
  return use;
}

inline bool HasAvx512() { return UseAvx512().load(std::memory_order_relaxed); }

AVX2 inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A call's work, claimed item by item by whoever runs it: the calling thread and the helpers.
class Job {
 public:
  virtual ~Job() = default;
  virtual void Run() = 0;
};

// The threads that help the kernels' calls, one per core beyond the caller's (as many as XLA's
// pool has, less one), started at the first call and kept for the process.
//
// Why threads of jspec's own and not XLA's pool, to which the kernels gave their work before: a
// helper that sleeps between calls wakes too late for a call of 20-80 microseconds, the most of
// a decode step's (a layer's four matrices at batch size 1), and the caller then reads the
// weight alone at half the memory's pace. So after each call a helper waits for the next by
// spinning for kSpinMicros (`jspec_set_spin_us` changes it, for benchmarks/probes/kernel_spin.py)
// before it sleeps; it yields its core while it spins, so a thread that wants the core (XLA's
// own, another process's) gets it. docs/design.md, "Helpers that spin", has the measurements.
class Helpers {
 public:
  static constexpr long kSpinMicros = 1000;

  // The process's helpers, as many as `threads` (XLA's pool) allows beside the caller.
  static Helpers& Get(int64_t threads) {
    static Helpers* helpers = new Helpers(threads);  // never destroyed: its threads outlive main
    return *helpers;
  }

  static std::atomic<long>& SpinMicros() {
    static std::atomic<long> spin{kSpinMicros};
    return spin;
  }

  int64_t count() const { return count_; }

  // Hands `job` to every helper (it replaces a job they have not taken: that one's caller runs
  // what is left of it itself).
  void Post(std::shared_ptr<Job> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = std::move(job);
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
  }

 private:
  explicit Helpers(int64_t threads)
      : count_(std::max<int64_t>(0, std::min<int64_t>(threads, std::thread::hardware_concurrency()) - 1)) {
    for (int64_t i = 0; i < count_; ++i) std::thread([this] { Work(); }).detach();
  }

  void Work() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto since = std::chrono::steady_clock::now();
      while (generation_.load(std::memory_order_acquire) == seen) {
        if (std::chrono::steady_clock::now() - since > std::chrono::microseconds(SpinMicros().load())) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1, std::memory_order_acq_rel);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_acq_rel);
          break;
        }
        std::this_thread::yield();
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
      }
      job->Run();
    }
  }

  const int64_t count_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};
};

// Runs body(item) for every item in [0, items), on the calling thread and on the helpers, and
// returns when every item has run. Items are claimed from a counter, not split up front: the
// caller never waits for a helper that has not started, and a core slowed by another process
// takes fewer. The job is shared through a shared_ptr: a helper that comes to it after the call
// has returned finds no item left and only drops its reference.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, Body body) {
  struct State : Job {
    State(Body body, int64_t items) : body(std::move(body)), items(items) {}
    Body body;
    int64_t items;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};

    void Run() override {
      for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        body(item);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(body), items);
  Helpers& helpers = Helpers::Get(pool.num_threads());
  if (items > 1 && helpers.count() > 0) helpers.Post(state);
  state->Run();
  while (state->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace jspec
