// The kernels' own persistent worker threads (both ISA builds; plain C++, no intrinsics).
//
// Why not at::parallel_for (torch's OpenMP team): a decode step of a small model runs ~120 small
// matmuls, each a few microseconds per thread. An OpenMP region ends in a barrier that every
// team thread must reach, so one worker the OS has not yet run (a loaded machine, or a worker
// that went to sleep) stalls the whole op, and the region's fork and join are paid per op. Here
// the caller publishes a job and starts claiming its chunks at once; a worker claims chunks only
// when it gets there, and the caller waits only for chunks another thread actually took. A
// worker that comes late finds nothing left and the op costs what one thread costs; workers that
// are spinning between the ops of a step join within a cache-line transfer.
//
// Workers spin for a short while after each job (the gaps between a step's ops are shorter),
// yielding now and then, then sleep on a condition variable until the next job. The number of
// threads is torch's (torch.set_num_threads / OMP_NUM_THREADS), read at every call.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace qp {

class ThreadPool {
 public:
  // The process's pool (one per loaded library); a forked child starts a fresh one.
  static ThreadPool& get() {
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, [] { instance() = new ThreadPool(); });
      return true;
    }();
    (void)registered;
    return *instance();
  }

  // f(b0, b1) over [begin, end) in at most `threads` * per_thread contiguous chunks of at least
  // `grain` items each; returns when every chunk has run. Runs inline for a single chunk, inside
  // torch's parallel regions, and when another thread is using the pool. per_thread > 1 for
  // long jobs: a worker that comes late (asleep, or its core busy) still takes a share.
  template <typename F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f,
                    int64_t per_thread = 1) {
    if (begin >= end) return;
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), kMaxChunks);
    const int64_t g = std::max<int64_t>(grain, 1);
    const int64_t chunks = std::min({threads * std::max<int64_t>(per_thread, 1), kMaxChunks,
                                     (end - begin + g - 1) / g});
    if (threads <= 1 || chunks <= 1 || in_pool() || at::in_parallel_region()) {
      f(begin, end);
      return;
    }
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) {  // another caller thread has the pool
      f(begin, end);
      return;
    }
    in_pool() = true;  // a nested parallel_for from a chunk runs inline
    start_workers(threads - 1);
    call_ = [](const void* ctx, int64_t b0, int64_t b1) {
      (*static_cast<const F*>(ctx))(b0, b1);
    };
    ctx_ = &f;
    begin_ = begin;
    end_ = end;
    done_.store(0, std::memory_order_relaxed);
    epoch_ = (epoch_ + 1) & 0xFFFFFFFFu;  // 32 bits of the claim word
    // publishing the claim word releases the fields above to whoever claims a chunk
    claim_.store(pack(epoch_, chunks, 0), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(sleep_mutex_);
      wake_.notify_all();
    }
    work(epoch_);
    // wait for the chunks other threads claimed (only those: an absent worker claimed none)
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < 4096) __builtin_ia32_pause();
      else std::this_thread::yield();  // the thread we wait for may need this core
    }
    in_pool() = false;
  }

 private:
  static constexpr int64_t kMaxChunks = 64;
  // how long a worker spins for the next job before it sleeps
  static constexpr std::chrono::microseconds kSpin{200};

  // true on the pool's workers and on a caller while its job runs
  static bool& in_pool() {
    thread_local bool inside = false;
    return inside;
  }

  static ThreadPool*& instance() {
    static ThreadPool* pool = new ThreadPool();  // never destroyed: workers outlive statics
    return pool;
  }

  // claim word: epoch (32 bits) | number of chunks (16) | next unclaimed chunk (16)
  static uint64_t pack(uint64_t epoch, int64_t chunks, int64_t next) {
    return (epoch << 32) | (static_cast<uint64_t>(chunks) << 16) | static_cast<uint64_t>(next);
  }

  void start_workers(int64_t n) {
    while (static_cast<int64_t>(workers_) < n) {
      std::thread([this] { worker_loop(); }).detach();
      ++workers_;
    }
  }

  // Claims and runs chunks of job `epoch` until none is left (or a newer job replaced it).
  void work(uint64_t epoch) {
    uint64_t s = claim_.load(std::memory_order_acquire);
    for (;;) {
      const int64_t chunks = static_cast<int64_t>((s >> 16) & 0xFFFF);
      const int64_t next = static_cast<int64_t>(s & 0xFFFF);
      if ((s >> 32) != epoch || next >= chunks) return;
      if (!claim_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
        continue;
      // claimed chunk `next` of job `epoch`: its fields stay put until done_ reaches chunks
      const int64_t n = end_ - begin_;
      const int64_t b0 = begin_ + n * next / chunks, b1 = begin_ + n * (next + 1) / chunks;
      call_(ctx_, b0, b1);
      done_.fetch_add(1, std::memory_order_acq_rel);
      s = claim_.load(std::memory_order_acquire);
    }
  }

  void worker_loop() {
    in_pool() = true;
    uint64_t seen = claim_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      uint64_t epoch = claim_.load(std::memory_order_acquire) >> 32;
      const auto until = std::chrono::steady_clock::now() + kSpin;
      for (int i = 1; epoch == seen; ++i) {
        __builtin_ia32_pause();
        // now and then give the core to a runnable thread (the caller, on a loaded machine)
        if (i % 256 == 0) std::this_thread::yield();
        if (i % 256 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lk(sleep_mutex_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lk, [&] { return (claim_.load(std::memory_order_seq_cst) >> 32) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
        epoch = claim_.load(std::memory_order_acquire) >> 32;
      }
      seen = epoch;
      work(epoch);
    }
  }

  std::mutex run_mutex_;  // one caller at a time
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};  // chunks of the current job that have run
  uint64_t epoch_ = 0;  // the caller's (under run_mutex_)
  // the current job, written by the caller before it publishes claim_
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0;
  size_t workers_ = 0;
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
};

// at::parallel_for's signature, on quantpipe's pool
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f,
                         int64_t per_thread = 1) {
  ThreadPool::get().parallel_for(begin, end, grain, f, per_thread);
}

}  // namespace qp
