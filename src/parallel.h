// A static parallel-for over the host's threads. Items go to workers round-robin, so which
// worker handles which item does not depend on timing: results reduced per worker in worker
// order are the same on every run.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace flash_dmattn::host {

// Threads worth starting for `items` independent items costing about `flops` in all: starting a
// thread costs tens of microseconds, so small problems (most of the test suites) run on one.
inline int worker_count(std::int64_t items, double flops) {
  constexpr double kFlopsPerThread = 1 << 20;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const double by_work = std::max(1.0, flops / kFlopsPerThread);
  return static_cast<int>(std::max<double>(1, std::min<double>({static_cast<double>(items), static_cast<double>(hw), by_work})));
}

// Calls fn(item, worker) for every item in [0, items), `workers` threads at a time.
template <typename Fn>
void parallel_for(std::int64_t items, int workers, Fn fn) {
  if (workers <= 1) {
    for (std::int64_t i = 0; i < items; ++i) fn(i, 0);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(workers);
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([=, &fn] {
      for (std::int64_t i = w; i < items; i += workers) fn(i, w);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace flash_dmattn::host
