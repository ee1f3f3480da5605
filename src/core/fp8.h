// FP8 (OCP 8-bit floating point, as Hopper's tensor cores read it): the two formats, the cast from fp32 with
// round-to-nearest-even and saturation to the largest finite value (PTX `cvt.rn.satfinite.{e4m3,e5m2}x2.f32`,
// cuda_fp8.h's __NV_SATFINITE), the decode, and the per-tensor scale of "current scaling" (the scale comes from
// the amax of the very tensor being cast). This header is the CPU emulation that the tests and the CPU engine's
// `--precision fp8` use as the reference for the CUDA kernels (ops/linear/fp8.h): every function here is exact
// integer / power-of-two arithmetic or one IEEE fp32 operation, so the GPU's casts equal it bit for bit.
//
//   E4M3 ("fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN;
//                largest finite 448 (S.1111.110), smallest subnormal 2^-9, normals from 2^-6.
//   E5M2:        1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like infinities and NaNs;
//                largest finite 57344 (S.11110.11), smallest subnormal 2^-16, normals from 2^-14.
// Source: the OCP 8-bit Floating Point Specification (OFP8) rev. 1.0, and the PTX ISA's cvt (satfinite: a value
// beyond the largest finite one, infinities included, becomes the largest finite one of its sign; NaN stays NaN).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__CUDACC__)
#define DS_FP8_HD __host__ __device__
#else
#define DS_FP8_HD
#endif

namespace ds {

enum class Fp8Format : uint8_t { E4M3 = 0, E5M2 = 1 };

inline const char* fp8_format_name(Fp8Format f) { return f == Fp8Format::E4M3 ? "e4m3" : "e5m2"; }

// Largest finite value: 448 (E4M3), 57344 (E5M2).
DS_FP8_HD inline constexpr float fp8_max(Fp8Format f) { return f == Fp8Format::E4M3 ? 448.0f : 57344.0f; }

namespace detail {
struct Fp8Spec {
  int mant_bits, bias, emin;  // emin: exponent of the smallest normal
  uint8_t max_code, nan_code;
};
inline constexpr Fp8Spec fp8_spec(Fp8Format f) {
  return f == Fp8Format::E4M3 ? Fp8Spec{3, 7, -6, 0x7e, 0x7f} : Fp8Spec{2, 15, -14, 0x7b, 0x7f};
}
}  // namespace detail

// fp32 -> fp8 code: round to nearest, ties to even; |x| past the largest finite value (infinities too) saturates
// to it with x's sign; NaN -> 0x7f (the positive NaN code the hardware writes); -0 -> 0x80.
inline uint8_t fp8_encode(float x, Fp8Format f) {
  const detail::Fp8Spec s = detail::fp8_spec(f);
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return s.nan_code;
  const double v = std::fabs(static_cast<double>(x));
  if (v == 0.0) return sign;
  // The quantum at v: 2^(e - mant_bits) for normals, 2^(emin - mant_bits) below the normals. v / quantum is exact in
  // double (a power-of-two scaling of a float), and so is rounding it to an integer by hand.
  int e = 0;
  std::frexp(v, &e);  // v = m 2^e, m in [0.5, 1): floor(log2 v) = e - 1
  const int qexp = (e - 1 < s.emin ? s.emin : e - 1) - s.mant_bits;
  const double r = std::ldexp(v, -qexp);
  double n = std::floor(r);
  const double frac = r - n;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(n, 2.0) != 0.0)) n += 1.0;
  double val = std::ldexp(n, qexp);
  const double maxv = fp8_max(f);
  if (val >= maxv) return static_cast<uint8_t>(sign | s.max_code);
  if (val == 0.0) return sign;
  // Encode val (exactly representable now; rounding may have carried it into the next binade).
  std::frexp(val, &e);
  const int ex = e - 1;
  if (ex < s.emin) {  // subnormal: exponent field 0, mantissa val / 2^(emin - mant_bits)
    const int mant = static_cast<int>(std::ldexp(val, s.mant_bits - s.emin));
    return static_cast<uint8_t>(sign | mant);
  }
  const int mant = static_cast<int>(std::ldexp(val, s.mant_bits - ex)) - (1 << s.mant_bits);
  return static_cast<uint8_t>(sign | ((ex + s.bias) << s.mant_bits) | mant);
}

// fp8 code -> fp32 (exact). E4M3: S.1111.111 is NaN. E5M2: exponent field 31 is infinity (mantissa 0) or NaN.
inline float fp8_decode(uint8_t c, Fp8Format f) {
  const detail::Fp8Spec s = detail::fp8_spec(f);
  const bool neg = (c & 0x80u) != 0;
  const int mant = c & ((1 << s.mant_bits) - 1);
  const int ef = (c & 0x7f) >> s.mant_bits;
  float v;
  if (f == Fp8Format::E4M3 && (c & 0x7f) == 0x7f) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (f == Fp8Format::E5M2 && ef == 31) {
    v = mant == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  } else if (ef == 0) {
    v = std::ldexp(static_cast<float>(mant), s.emin - s.mant_bits);
  } else {
    v = std::ldexp(static_cast<float>((1 << s.mant_bits) + mant), ef - s.bias - s.mant_bits);
  }
  return neg ? -v : v;
}

// Current scaling's multiplier for a tensor whose largest |value| is amax: the tensor is cast as
// fp8_encode(x * inv) and read back as decode(code) * (1 / inv), so that amax lands on the format's largest finite
// value. inv = fp8_max / amax (one IEEE fp32 division); amax 0 (an all-zero tensor) gives 1; a subnormal amax whose
// quotient overflows gives the largest finite float; a NaN or infinite amax gives NaN, so the cast tensor is NaN
// and the step's NaN guard sees it (never silently finite garbage).
DS_FP8_HD inline float fp8_inv_scale(float amax, Fp8Format f) {
  if (!(amax <= 3.402823466e38f)) return std::numeric_limits<float>::quiet_NaN();  // NaN or +inf (amax >= 0 by construction)
  if (amax == 0.0f) return 1.0f;
  const float inv = fp8_max(f) / amax;
  return inv <= 3.402823466e38f ? inv : 3.402823466e38f;
}

// The dequantization scale handed to the GEMM (cuBLASLt's A/B scale): 1 / inv (one IEEE fp32 division).
DS_FP8_HD inline float fp8_dequant_scale(float inv) { return 1.0f / inv; }

// Largest |x| over n floats (NaN if any is NaN): the amax current scaling reads. Order-free (max is exact).
inline float fp8_amax(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (std::isnan(a)) return a;
    m = a > m ? a : m;
  }
  return m;
}

// In place: x[i] = decode(encode(x[i] * inv)) * (1 / inv) with inv = fp8_inv_scale(amax), amax over all n values:
// the values a per-tensor-scaled FP8 GEMM multiplies (the CPU engine's `--precision fp8`). Returns inv.
inline float fp8_fake_quantize(float* x, int64_t n, Fp8Format f, float amax) {
  const float inv = fp8_inv_scale(amax, f), s = fp8_dequant_scale(inv);
  for (int64_t i = 0; i < n; ++i) x[i] = fp8_decode(fp8_encode(x[i] * inv, f), f) * s;
  return inv;
}

}  // namespace ds
