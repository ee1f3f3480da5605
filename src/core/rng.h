// Deterministic random numbers: a counter-based generator (SplitMix64 over (seed, stream, index)),
// so a value depends only on its seed, stream and position, never on thread count or call order.
#pragma once
#include <cmath>
#include <cstdint>

// Host and device (the GPU engine's LoRA dropout draws the CPU engine's masks: ops/elementwise/dropout.h).
#ifdef __CUDACC__
#define DS_RNG_HD __host__ __device__
#else
#define DS_RNG_HD
#endif

namespace ds {

DS_RNG_HD inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The key of stream `stream` of `seed`, and the value at `index` of a stream with key `key`: what Rng draws,
// counter by counter, without the object (any index at once: a GPU thread per element).
DS_RNG_HD inline uint64_t rng_stream_key(uint64_t seed, uint64_t stream) {
  return splitmix64(seed ^ splitmix64(stream + 0x51ed27));
}
DS_RNG_HD inline uint64_t rng_u64_at(uint64_t key, uint64_t index) {
  return splitmix64(key + index * 0x9e3779b97f4a7c15ull);
}
// Uniform in [0, 1) with 53 random bits (Rng::uniform's value at that counter).
DS_RNG_HD inline double rng_uniform_at(uint64_t key, uint64_t index) {
  return static_cast<double>(rng_u64_at(key, index) >> 11) * 0x1.0p-53;
}

// Dropout's draw (nn.Dropout with probability p): whether element `index` of the stream with key `key` is
// dropped. The CPU engine's LoRA masks (model/lora.h dropout_mask) and the GPU's (ops/elementwise/dropout.h) both
// decide with it, so they are the same masks.
DS_RNG_HD inline bool dropout_drops(uint64_t key, uint64_t index, double p) { return rng_uniform_at(key, index) < p; }

class Rng {
 public:
  explicit Rng(uint64_t seed, uint64_t stream = 0) : key_(rng_stream_key(seed, stream)) {}

  uint64_t next_u64() { return rng_u64_at(key_, counter_++); }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Standard normal (Box-Muller; one draw per call, the pair's second value is discarded for simplicity).
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return n ? next_u64() % n : 0; }

  uint64_t counter() const { return counter_; }
  void set_counter(uint64_t c) { counter_ = c; }

 private:
  uint64_t key_;
  uint64_t counter_ = 0;
};

}  // namespace ds
