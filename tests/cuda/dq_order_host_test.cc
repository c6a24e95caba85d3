// The rotated deterministic dQ order (src/cuda/sm90/dq_order.h), on the
// host: for key-block counts N and iteration counts I >= N, every
// iteration's turns are a permutation of 0 .. N - 1 in the order the walks
// reach it (so a tile in step never waits), and a simulation of the turn
// counters with the tiles started at random times always finishes (no
// deadlock). Needs no GPU; tests/test_dq_order.py builds and runs it.
//
//   c++ -std=c++17 -O2 -I. tests/cuda/dq_order_host_test.cc -o build/dq_order_host_test
#include "src/cuda/sm90/dq_order.h"

#include <cstdio>
#include <random>
#include <vector>

namespace {

using jax_flash2::cuda::sm90::RotatedDqTurn;
using jax_flash2::cuda::sm90::RotatedDqVisit;

int failures = 0;

void Fail(const char* what, int n_blocks, int iters, int a, int b) {
  if (++failures <= 20) std::printf("FAIL %s: N %d I %d (%d, %d)\n", what, n_blocks, iters, a, b);
}

// Key block n reaches iteration w at step (w - n) mod I; the turns at w
// must rank the key blocks by that step.
void CheckOrder(int n_blocks, int iters) {
  for (int w = 0; w < iters; ++w) {
    std::vector<int> seen(n_blocks, 0);
    for (int n = 0; n < n_blocks; ++n) {
      const int step = (w - n + iters) % iters;
      if (RotatedDqVisit(step, n, iters) != w) Fail("visit", n_blocks, iters, n, w);
      const int turn = RotatedDqTurn(n, w, n_blocks);
      if (turn < 0 || turn >= n_blocks) {
        Fail("turn range", n_blocks, iters, n, w);
        continue;
      }
      ++seen[turn];
      for (int m = 0; m < n_blocks; ++m) {
        const int other = (w - m + iters) % iters;
        if ((other < step) != (RotatedDqTurn(m, w, n_blocks) < turn)) {
          Fail("turn order", n_blocks, iters, n, m);
        }
      }
    }
    for (int t = 0; t < n_blocks; ++t) {
      if (seen[t] != 1) Fail("turn permutation", n_blocks, iters, w, t);
    }
  }
}

// The kernels' protocol: a tile at step s of its walk waits until the
// counter of the iteration it visits equals its turn there, then adds 1.
// Tiles start at random ticks and move at random; returns false on a tick
// where every started tile waits and none is left to start.
bool Simulate(int n_blocks, int iters, std::mt19937& rng) {
  std::vector<int> counter(iters, 0), step(n_blocks, 0), start(n_blocks);
  for (int& s : start) s = static_cast<int>(rng() % (2 * iters + 1));
  int done = 0;
  for (int tick = 0; done < n_blocks; ++tick) {
    bool moved = false, waiting_to_start = false;
    for (int n = 0; n < n_blocks; ++n) {
      if (tick < start[n]) {
        waiting_to_start = true;
        continue;
      }
      if (step[n] == iters || rng() % 3 == 0) continue;  // finished, or slow this tick
      const int w = RotatedDqVisit(step[n], n, iters);
      if (counter[w] != RotatedDqTurn(n, w, n_blocks)) continue;
      ++counter[w];
      moved = true;
      if (++step[n] == iters) ++done;
    }
    if (!moved && !waiting_to_start) {
      // A tick where nobody moved by chance (the random slow-downs) is not a
      // deadlock; one where every unfinished tile waits on its counter is.
      bool any_ready = false;
      for (int n = 0; n < n_blocks; ++n) {
        if (step[n] == iters) continue;
        const int w = RotatedDqVisit(step[n], n, iters);
        any_ready |= counter[w] == RotatedDqTurn(n, w, n_blocks);
      }
      if (!any_ready) return false;
    }
  }
  for (int w = 0; w < iters; ++w) {
    if (counter[w] != n_blocks) return false;
  }
  return true;
}

}  // namespace

int main() {
  std::mt19937 rng(12345);
  int configs = 0;
  for (int n_blocks = 1; n_blocks <= 40; ++n_blocks) {
    for (int iters = n_blocks; iters <= 3 * n_blocks + 5; ++iters) {
      CheckOrder(n_blocks, iters);
      if (!Simulate(n_blocks, iters, rng)) Fail("deadlock", n_blocks, iters, 0, 0);
      ++configs;
    }
  }
  for (int n_blocks : {64, 128}) {  // T = S = 8k, 16k; GQA 1 and 4
    for (int iters : {n_blocks, 2 * n_blocks, 4 * n_blocks}) {
      CheckOrder(n_blocks, iters);
      if (!Simulate(n_blocks, iters, rng)) Fail("deadlock", n_blocks, iters, 0, 0);
      ++configs;
    }
  }
  std::printf("%d configurations, %d failures\n", configs, failures);
  return failures == 0 ? 0 : 1;
}
