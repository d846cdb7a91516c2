// The clock of the standalone g++-built benchmarks (fwd_kernel.cpp, prep_kernel.cpp,
// prep_head_view.cpp): process CPU time in seconds, so time lost to other processes on a shared
// box is not counted.
#pragma once
#include <ctime>

inline double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
