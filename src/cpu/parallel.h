// Parallel loop over independent tasks on XLA's intra-op thread pool.
//
// The calling thread works too and takes any task no pool thread has started,
// so the loop finishes even if the pool never runs our helpers (a busy pool, or
// no pool at all): no deadlock when the handler itself runs on a pool thread.
// The shared state is reference-counted because a helper may start after the
// loop has returned.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

namespace jax_flash2::cpu {

// body(task, worker): worker in [0, num_workers) indexes per-worker scratch.
using TaskBody = std::function<void(int64_t task, int worker)>;

class ParallelRunner {
 public:
  virtual ~ParallelRunner() = default;
  virtual int num_workers() const = 0;
  virtual void Run(int64_t num_tasks, const TaskBody& body) = 0;
};

// Runs tasks on the caller and on up to num_workers - 1 pool threads scheduled
// through `schedule` (a function that runs its argument on some thread).
class SharedLoopRunner : public ParallelRunner {
 public:
  using Scheduler = std::function<void(std::function<void()>)>;

  SharedLoopRunner(Scheduler schedule, int num_workers)
      : schedule_(std::move(schedule)), num_workers_(std::max(1, num_workers)) {}

  int num_workers() const override { return num_workers_; }

  void Run(int64_t num_tasks, const TaskBody& body) override {
    if (num_tasks <= 0) return;
    struct State {
      std::atomic<int64_t> next{0};
      int64_t done = 0;
      int64_t total = 0;
      const TaskBody* body = nullptr;
      std::mutex mu;
      std::condition_variable cv;
    };
    auto state = std::make_shared<State>();
    state->total = num_tasks;
    state->body = &body;
    // Take tasks until none is left; count the finished ones.
    auto work = [](State* s, int worker) {
      int64_t finished = 0;
      for (int64_t t = s->next.fetch_add(1); t < s->total; t = s->next.fetch_add(1)) {
        (*s->body)(t, worker);
        ++finished;
      }
      if (finished > 0) {
        std::lock_guard<std::mutex> lock(s->mu);
        s->done += finished;
        if (s->done == s->total) s->cv.notify_all();
      }
    };
    const int helpers = static_cast<int>(std::min<int64_t>(num_workers_ - 1, num_tasks - 1));
    for (int w = 1; w <= helpers; ++w) {
      schedule_([state, work, w] { work(state.get(), w); });
    }
    work(state.get(), 0);
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done == state->total; });
  }

 private:
  Scheduler schedule_;
  int num_workers_;
};

}  // namespace jax_flash2::cpu
