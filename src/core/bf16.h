// bfloat16 conversion. Rounding is round-to-nearest-even (as torch's .to(torch.bfloat16));
// NaN stays NaN (quiet), infinities stay infinite.
#pragma once
#include <cstdint>
#include <cstring>

namespace ds {

inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// dst[i] = f32_to_bf16_bits(src[i]) / bf16_bits_to_f32(src[i]) for i < n, each element on its own, on all cores
// past 64k elements (the same values for any thread count; a 27B checkpoint's weights are 27 G elements).
inline void to_bf16_bits(const float* src, int64_t n, uint16_t* dst) {
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16_bits(src[i]);
}
inline void from_bf16_bits(const uint16_t* src, int64_t n, float* dst) {
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_f32(src[i]);
}

// The fp32 value nearest to f that bf16 can hold (round-to-nearest-even).
inline float round_bf16(float f) { return bf16_bits_to_f32(f32_to_bf16_bits(f)); }

// IEEE half precision -> fp32 (for reading F16 safetensors).
inline float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace ds
