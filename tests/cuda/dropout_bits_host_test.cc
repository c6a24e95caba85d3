// The dropout keep-bit layouts of src/cuda/dropout_bits.cuh, built for the
// host with each lane of a warp a thread (the shuffles exchange through
// shared slots between barriers), against DropoutMask's own bits: the
// forward's FwdKeepPack + FwdKeepTranspose or FwdKeepBitsByWords with
// FwdKeepPairMask, and the backward's BwdKeepBits / BwdKept, for every
// accumulator size the kernels use, random seeds, rows, key offsets and
// thresholds; and KeepBytesMajority against KeepBytes. Needs no GPU;
// tests/test_dropout.py builds and runs it.
//
//   c++ -std=c++17 -O2 -pthread -I. tests/cuda/dropout_bits_host_test.cc -o build/dropout_bits_host_test
//   build/dropout_bits_host_test
#define JF2_DROPOUT_BITS_HOST_LANES
#include "src/cuda/dropout_bits.cuh"

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace {

using jax_flash2::DropoutMask;

constexpr int kLanes = 32;

// A reusable barrier for the 32 lane threads.
class LaneBarrier {
 public:
  void Wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == kLanes) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

LaneBarrier barrier;
uint32_t slots[kLanes];
thread_local int this_lane = 0;

// Runs body(lane) on 32 threads at once.
void RunWarp(const std::function<void(int)>& body) {
  std::vector<std::thread> lanes;
  for (int lane = 0; lane < kLanes; ++lane) {
    lanes.emplace_back([&body, lane] {
      this_lane = lane;
      body(lane);
    });
  }
  for (std::thread& t : lanes) t.join();
}

// Mismatches reported from any lane thread; the first few are printed.
class Mismatches {
 public:
  template <typename... Args>
  void Add(const char* format, Args... args) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (count_++ < 5) std::printf(format, args...);
  }
  int count() const { return count_; }

 private:
  std::mutex mutex_;
  int count_ = 0;
};

bool Keep(const DropoutMask& mask, int64_t query, int64_t key) {
  return (mask.Keep16(query, key / 16) >> (key % 16)) & 1u;
}

// Forward slab: lane (g, t4) holds rows row0 + g (+ 8), keys key0 + 8 j + 2 t4 + e;
// by_words: FwdKeepBitsByWords, else FwdKeepPack then FwdKeepTranspose.
template <int kAcc>
int CheckForward(const DropoutMask& mask, int64_t row0, int64_t key0, bool by_words) {
  Mismatches bad;
  RunWarp([&](int lane) {
    const int g = lane / 4, t4 = lane % 4;
    uint32_t keep[jax_flash2::cuda::KeepWords<kAcc>()];
    if (by_words) {
      jax_flash2::cuda::FwdKeepBitsByWords<kAcc>(keep, mask, row0 + g, key0, t4);
    } else {
      jax_flash2::cuda::FwdKeepPack<kAcc>(keep, mask, row0 + g, key0, t4);
      jax_flash2::cuda::FwdKeepTranspose<kAcc>(keep, t4);
    }
    for (int i = 0; i < kAcc; i += 2) {
      const uint32_t pair = jax_flash2::cuda::FwdKeepPairMask<kAcc>(keep, i);
      for (int e = 0; e < 2; ++e) {
        const int64_t row = row0 + g + 8 * ((i / 2) % 2);
        const int64_t key = key0 + 8 * (i / 4) + 2 * t4 + e;
        const uint32_t half = (pair >> (16 * e)) & 0xFFFFu;
        const uint32_t want = Keep(mask, row, key) ? 0xFFFFu : 0u;
        if (half != want) {
          bad.Add("forward%s kAcc %d lane %d element %d (row %lld key %lld): %04x, want %04x\n",
                  by_words ? " by words" : "", kAcc, lane, i + e, static_cast<long long>(row),
                  static_cast<long long>(key), half, want);
        }
      }
    }
  });
  return bad.count();
}

// Backward slab (S^T): lane (g, t4) holds keys key0 + g (+ 8), queries m0 + 8 j + 2 t4 + e.
template <int kAcc>
int CheckBackward(const DropoutMask& mask, int64_t key0, int64_t m0) {
  Mismatches bad;
  RunWarp([&](int lane) {
    const int g = lane / 4, t4 = lane % 4;
    uint32_t keep[jax_flash2::cuda::KeepWords<kAcc>()];
    jax_flash2::cuda::BwdKeepBits<kAcc>(keep, mask, key0 + g, m0, g, t4);
    for (int i = 0; i < kAcc; ++i) {
      const int64_t key = key0 + g + 8 * ((i / 2) % 2);
      const int64_t query = m0 + 8 * (i / 4) + 2 * t4 + i % 2;
      const bool got = jax_flash2::cuda::BwdKept<kAcc>(keep, i);
      if (got != Keep(mask, query, key)) {
        bad.Add("backward kAcc %d lane %d element %d (query %lld key %lld): %d\n", kAcc, lane, i,
                static_cast<long long>(query), static_cast<long long>(key), static_cast<int>(got));
      }
    }
  });
  return bad.count();
}

}  // namespace

namespace jax_flash2::cuda {
uint32_t HostShflXor(uint32_t v, int lane_mask) {
  slots[this_lane] = v;
  barrier.Wait();
  const uint32_t theirs = slots[this_lane ^ lane_mask];
  barrier.Wait();
  return theirs;
}
}  // namespace jax_flash2::cuda

int main() {
  std::mt19937_64 rng(20261205);
  int failures = 0, cases = 0;
  for (int trial = 0; trial < 12; ++trial) {
    const uint32_t threshold = trial < 2 ? (trial == 0 ? 1u : 255u) : 1 + rng() % 255;
    const DropoutMask mask{static_cast<uint32_t>(rng()), static_cast<uint32_t>(rng()), threshold};
    // Rows and keys past 2^32 wrap in the counter as on the device.
    const int64_t row0 = static_cast<int64_t>(rng() % (int64_t{1} << 33)) * 16;
    const int64_t key0 = static_cast<int64_t>(rng() % (int64_t{1} << 33)) * 16;
    // Forward: the Hopper kernels' S accumulators (80, 128 and 176 keys) and
    // odd group counts; backward: the query blocks' (16 .. 128 queries).
    for (bool by_words : {false, true}) {
      failures += CheckForward<8>(mask, row0, key0, by_words) +
                  CheckForward<16>(mask, row0, key0, by_words) +
                  CheckForward<24>(mask, row0, key0, by_words) +
                  CheckForward<40>(mask, row0, key0, by_words) +
                  CheckForward<64>(mask, row0, key0, by_words) +
                  CheckForward<88>(mask, row0, key0, by_words) +
                  CheckForward<96>(mask, row0, key0, by_words);
      cases += 7;
    }
    failures += CheckBackward<8>(mask, key0, row0) + CheckBackward<16>(mask, key0, row0) +
                CheckBackward<32>(mask, key0, row0) + CheckBackward<40>(mask, key0, row0) +
                CheckBackward<64>(mask, key0, row0);
    cases += 5;
  }
  // The LOP3 form of the byte compare, every byte against every threshold
  // (the other three bytes of the word random).
  for (uint32_t t = 0; t < 256; ++t) {
    for (uint32_t a = 0; a < 256; ++a) {
      const uint32_t word = static_cast<uint32_t>(rng()) & ~0xFFu | a;
      if (jax_flash2::cuda::KeepBytesMajority(word, t * 0x01010101u) !=
          jax_flash2::KeepBytes(word, t * 0x01010101u)) {
        ++failures;
      }
    }
  }
  ++cases;
  std::printf("%d layout cases, %d mismatches\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
