// Work split between the calling thread and one helper from XLA:CPU's pool.
//
// fn(phase, item) runs for every item of every phase, once the phase before is
// done. Items are claimed from a shared counter, so the caller runs them all if
// no helper comes, and no result depends on the thread. A helper starting after
// RunPhases returns finds nothing to claim; its reference keeps the state alive.

#ifndef CHT_JAX_KERNELS_CPU_THREADS_H_
#define CHT_JAX_KERNELS_CPU_THREADS_H_

#include <atomic>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace cht_jax {

class PhaseRunner {
 public:
  PhaseRunner(int num_phases, int items_per_phase, std::function<void(int, int)> fn)
      : num_phases_(num_phases), items_(items_per_phase), fn_(std::move(fn)),
        done_(new std::atomic<int>[num_phases]) {
    for (int i = 0; i < num_phases; ++i) done_[i].store(0);
  }

  void Work() {
    for (int claimed; (claimed = next_.fetch_add(1)) < num_phases_ * items_;) {
      const int phase = claimed / items_;
      if (phase > 0) WaitFor(phase - 1);
      fn_(phase, claimed % items_);
      done_[phase].fetch_add(1, std::memory_order_release);
    }
  }

  void WaitFor(int phase) const {
    for (int spins = 0; done_[phase].load(std::memory_order_acquire) < items_; ++spins) {
      if (spins > 1000) std::this_thread::yield();
    }
  }

 private:
  const int num_phases_, items_;
  const std::function<void(int, int)> fn_;
  std::atomic<int> next_{0};
  std::unique_ptr<std::atomic<int>[]> done_;  // Items finished, per phase.
};

// Runs fn over the phases, with a helper from `pool` if `use_helper`.
inline void RunPhases(xla::ffi::ThreadPool& pool, bool use_helper, int num_phases,
                      int items_per_phase, std::function<void(int, int)> fn) {
  auto runner = std::make_shared<PhaseRunner>(num_phases, items_per_phase, std::move(fn));
  if (use_helper && pool.num_threads() > 1) pool.Schedule([runner] { runner->Work(); });
  runner->Work();
  runner->WaitFor(num_phases - 1);
}

}  // namespace cht_jax

#endif  // CHT_JAX_KERNELS_CPU_THREADS_H_
