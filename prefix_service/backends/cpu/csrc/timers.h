// Kernel timers: while they are on (ps_timers), each kernel's entry point adds its wall time to the
// total of its kind. They time the calls that serve (a profile reads them; nothing else changes);
// off, a scope costs one load and a branch. The engine calls the kernels from one thread.
#pragma once
#include <chrono>
#include <cstdint>

namespace ps {

enum TimerKind { kLinear = 0, kAttention = 1, kElementwise = 2, kTimerKinds = 3 };

extern bool timers_on;
extern int64_t timer_ns[kTimerKinds];

class TimerScope {
 public:
  explicit TimerScope(TimerKind kind) : kind_(kind), on_(timers_on) {
    if (on_) start_ = now();
  }
  ~TimerScope() {
    if (on_) timer_ns[kind_] += now() - start_;
  }
  TimerScope(const TimerScope&) = delete;
  TimerScope& operator=(const TimerScope&) = delete;

 private:
  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  TimerKind kind_;
  bool on_;
  int64_t start_ = 0;
};

}  // namespace ps
