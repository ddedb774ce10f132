// Row loops that never wait for a thread that lost its core.
//
// A call's rows are shared between the calling thread and helper threads: each takes the next row
// from a shared counter. With torch's parallel regions (OpenMP), the call ends when its slowest
// thread does: when another process holds one of the cores, the region waits for the thread that
// lost it, a scheduler slice (about 3-8 ms) for a call of 1-6 ms. Here the caller, once the counter
// is spent, gives a row a helper still holds a grace of twice its own mean row time, then computes
// it itself; whichever thread finishes a row first publishes it (a compare-and-swap on the row's state),
// the other's result is dropped. So a late helper costs the caller at most the rows it held, never a
// wait.
//
// A helper may therefore still be computing after the call returned. It holds the job (`RowTask`:
// the tensors it reads are references the task owns, so their memory stays valid), never publishes
// into a finished row, and must stay memory-safe if the inputs change under it: a helper's worker
// (`RowTask::worker(true)`) reads what can change (a logits row, a mask) from a copy it made, or
// reads it only in ways whose indices do not depend on the values.
//
// Helpers are plain threads that sleep on a condition variable between calls; after a job, or when a
// step wakes them ahead of its passes (`Pool::warm`), they watch for the next job for a bounded time,
// yielding the core to any other thread that wants it (OpenMP's default policy spins on it for some
// milliseconds). A call asks for up to its torch thread count less one; they are started on first use. Inside the rows every thread runs torch operations on itself alone
// (`omp_set_num_threads(1)`, and MKL's thread-local count where torch is built with MKL: ATen's exp
// calls MKL's vector exp, which opens a parallel region of its own outside one), so an ATen call in a
// row never opens a parallel region. After a fork the child starts a new pool (its parent's threads
// are not there).
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// MKL's per-thread thread count, its C interface (in libtorch_cpu where torch is built with MKL; weak: absent elsewhere)
extern "C" int MKL_Set_Num_Threads_Local(int threads) __attribute__((weak));

namespace tokensampler_rows {

// This thread's ATen and MKL calls on one thread; returns MKL's previous local count (0: MKL's global).
inline int one_thread_for_math() {
  omp_set_num_threads(1);
  return MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0;
}

// One thread's work on a call: a row computed into the worker's own result, then (by the thread that
// wins the row) published into the call's outputs.
class RowWorker {
 public:
  virtual ~RowWorker() = default;
  // false: the row is given up (a helper that found its input unusable); the caller computes it
  virtual bool compute(int64_t row) = 0;
  virtual void publish(int64_t row) = 0;
};

// A call's rows: it owns everything a late helper may still read (tensor references, outputs).
class RowTask {
 public:
  virtual ~RowTask() = default;
  // `helper`: the worker may run after the call returned (see the header)
  virtual std::unique_ptr<RowWorker> worker(bool helper) = 0;
};

enum : uint8_t { kFree = 0, kClaimed = 1, kTaken = 2, kDone = 3 };

// Test hooks (tests/torch_step/test_wait_free_rows.py): a delay each helper sleeps after claiming a
// row, before reading it (a helper that lost its core, on demand); the rows callers took over from
// helpers, and the rows helpers published.
inline std::atomic<int64_t> helper_delay_us{0};
inline std::atomic<int64_t> rows_taken_over{0};
inline std::atomic<int64_t> helper_rows{0};

struct Job {
  std::shared_ptr<RowTask> task;
  const int64_t rows;
  std::atomic<int64_t> next{0};
  std::unique_ptr<std::atomic<uint8_t>[]> state;
  std::atomic<int> seats;  // helpers still wanted

  Job(std::shared_ptr<RowTask> t, int64_t n, int helpers)
      : task(std::move(t)), rows(n), state(new std::atomic<uint8_t>[n]), seats(helpers) {
    for (int64_t i = 0; i < n; ++i) state[i].store(kFree, std::memory_order_relaxed);
  }
};

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// A helper's share: rows from the counter until it is spent or the caller took a row over.
inline void help(Job& job) {
  if (job.seats.fetch_sub(1) <= 0) return;
  std::unique_ptr<RowWorker> worker;
  for (int64_t b = job.next.fetch_add(1); b < job.rows; b = job.next.fetch_add(1)) {
    uint8_t s = kFree;
    if (!job.state[b].compare_exchange_strong(s, kClaimed)) return;  // the caller took it first
    if (const int64_t delay = helper_delay_us.load(std::memory_order_relaxed); delay > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(delay));
    }
    if (!worker) worker = job.task->worker(true);
    if (!worker->compute(b)) return;  // left claimed: the caller computes it
    s = kClaimed;
    if (!job.state[b].compare_exchange_strong(s, kTaken)) return;  // the caller took it over meanwhile
    worker->publish(b);
    job.state[b].store(kDone, std::memory_order_release);
    helper_rows.fetch_add(1, std::memory_order_relaxed);
  }
}

class Pool {
 public:
  static Pool& get() {
    static std::atomic<Pool*> pool{nullptr};
    static std::mutex create;
    Pool* p = pool.load(std::memory_order_acquire);
    if (p == nullptr || p->pid_ != getpid()) {
      std::lock_guard<std::mutex> lock(create);
      p = pool.load(std::memory_order_acquire);
      if (p == nullptr || p->pid_ != getpid()) {  // first use, or a forked child: a new pool
        p = new Pool();                            // never destroyed: its threads outlive statics
        pool.store(p, std::memory_order_release);
      }
    }
    return *p;
  }

  // wake `helpers` threads (starting any not yet there) on `job`
  void submit(const std::shared_ptr<Job>& job, int helpers) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      start(helpers);
      current_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
  }

  // wake `helpers` threads to watch for a job for up to kWarmSpin (a step calls this before the host
  // work that precedes its passes: a sleeping thread's wake-up, up to a millisecond on a virtual
  // machine whose idle core the host took back, then overlaps that work)
  void warm(int helpers) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      start(helpers);
      warm_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
  }

 private:
  // after a job, or woken by warm(), a helper watches for the next job this long before it sleeps:
  // a step's passes follow one another within it, and a busy core loses no more than this
  static constexpr auto kSpin = std::chrono::microseconds(200);
  static constexpr auto kWarmSpin = std::chrono::microseconds(2000);

  void start(int helpers) {  // under mu_
    for (; threads_ < helpers; ++threads_) std::thread([this] { loop(); }).detach();
  }

  void loop() {
    at::get_num_threads();  // torch's per-thread setup first, then one thread for ATen calls in rows
    one_thread_for_math();
    uint64_t seen = generation_.load(std::memory_order_acquire), seen_warm = warm_.load(std::memory_order_acquire);
    auto spin = std::chrono::microseconds(0);
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + spin;
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
        sched_yield();  // watching, but any other thread that wants this core gets it
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load() != seen || warm_.load() != seen_warm; });
        seen_warm = warm_.load();
        if (generation_.load() == seen) {  // woken to watch: no job yet
          spin = kWarmSpin;
          continue;
        }
        seen = generation_.load();
        job = current_.lock();  // expired: the caller has finished it already
      }
      if (job) {
        try {
          help(*job);
        } catch (...) {  // the caller computes the row and meets the error itself
        }
      }
      spin = kSpin;
    }
  }

  const pid_t pid_ = getpid();
  std::mutex mu_;
  std::condition_variable cv_;
  std::weak_ptr<Job> current_;  // weak: the pool never keeps a finished call's tensors alive
  std::atomic<uint64_t> generation_{0}, warm_{0};
  int threads_ = 0;
};

// The caller's torch thread count for the loop's duration, then the count it had.
class OneThread {
 public:
  OneThread() : threads_(omp_get_max_threads()), mkl_threads_(one_thread_for_math()) {}
  ~OneThread() {
    omp_set_num_threads(threads_);
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(mkl_threads_);
  }

 private:
  const int threads_, mkl_threads_;
};

// Run `rows` rows of `task` on the calling thread and up to `helpers` helper threads (at most one row
// each); returns when every row is published. Inside a parallel region the caller computes them all.
inline void run_rows(const std::shared_ptr<RowTask>& task, int64_t rows, int64_t most_helpers) {
  if (rows <= 0) return;
  const int helpers = at::in_parallel_region() ? 0 : static_cast<int>(std::min<int64_t>(most_helpers, rows - 1));
  OneThread one_thread;
  auto job = std::make_shared<Job>(task, rows, helpers);
  if (helpers > 0) Pool::get().submit(job, helpers);
  std::unique_ptr<RowWorker> worker = task->worker(false);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  int64_t mine = 0;
  for (int64_t b = job->next.fetch_add(1); b < rows; b = job->next.fetch_add(1), ++mine) {
    worker->compute(b);  // no helper touches a row it did not draw
    worker->publish(b);
    job->state[b].store(kDone, std::memory_order_relaxed);
  }
  if (helpers == 0) return;
  // rows a helper still holds: a grace of twice the caller's mean row (a helper on its core finishes
  // within it), then the caller takes the row over
  const auto now = Clock::now();
  const auto grace = std::max<Clock::duration>(std::chrono::microseconds(20), 2 * (now - start) / std::max<int64_t>(mine, 1));
  const auto deadline = now + grace;
  for (int64_t b = 0; b < rows; ++b) {
    for (;;) {
      uint8_t s = job->state[b].load(std::memory_order_acquire);
      if (s == kDone) break;
      if (s == kTaken || Clock::now() < deadline) {  // publishing (a few stores), or within the grace
        cpu_relax();
        continue;
      }
      if (job->state[b].compare_exchange_strong(s, kTaken)) {
        rows_taken_over.fetch_add(1, std::memory_order_relaxed);
        worker->compute(b);
        worker->publish(b);
        job->state[b].store(kDone, std::memory_order_release);
        break;
      }
    }
  }
}

// The same rows on torch's own threads: one parallel region (at::parallel_for) whose threads draw
// rows from a shared counter, every worker reading in place; the call ends when every thread has
// left the region. For a process whose threads an engine binds to cores and keeps spinning between
// its own regions (vLLM's CPU worker), where a thread of ours would share a core with them.
inline void run_rows_torch(const std::shared_ptr<RowTask>& task, int64_t rows) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, rows, 1, [&](int64_t, int64_t) {
    std::unique_ptr<RowWorker> worker;
    for (int64_t b = next.fetch_add(1); b < rows; b = next.fetch_add(1)) {
      if (!worker) worker = task->worker(false);
      worker->compute(b);
      worker->publish(b);
    }
  });
}

// `helpers` >= 0: run_rows with that many helpers at most; -1: run_rows_torch.
inline void run(const std::shared_ptr<RowTask>& task, int64_t rows, int64_t helpers) {
  if (helpers >= 0) {
    run_rows(task, rows, helpers);
  } else {
    run_rows_torch(task, rows);
  }
}

}  // namespace tokensampler_rows
