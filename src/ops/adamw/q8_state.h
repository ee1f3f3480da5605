// The 8-bit AdamW state (`--optimizer-state 8bit`, docs/memory.md): bf16 GEMM weights updated with stochastic
// rounding exactly as the bf16 state's (bf16_state.h), and the moments m and r = sqrt(v) stored as 8-bit codes with
// one fp32 scale (absmax) per block. Shared by the CPU reference (cpu.cpp, built with -ffp-contract=off) and the
// CUDA kernel (cuda.cu): both run the same fp32 operations in the same order and agree bitwise.
//
// Blocks. The flat parameter vector (ParamSpec offsets) is cut into 256-element chunks [256c, 256c + 256); a block is
// a chunk's part inside one parameter (blocks never span two parameters, so a parameter's first and last blocks may
// be shorter). Block boundaries are a function of the flat offsets only: a --shard optimizer share, whose bounds are
// multiples of 256 (model/gpu_params.h), holds whole blocks, and a sharded run takes the unsharded run's steps.
//
// Codes (tables below, generated exactly by scripts/gen_q8_tables.py): bitsandbytes' dynamic-tree quantization map
// (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"; create_dynamic_map), values in [-1, 1]:
//   m: sign bit (0x80) + a 7-bit index into kMMagnitudes (0, then bnb's 127 positive signed-map values, 5.5e-7 ...
//      0.979, 1.0: bnb's largest, 0.99297, is replaced by 1.0 so that the map is symmetric and +-1 exact). 0x80
//      (-0) decodes to 0 and is never written.
//   r = sqrt(v): an index into kRValues (0, bnb's 254 unsigned-map values 3.25e-7 ... 0.9965, 1.0).
//   Storing sqrt(v) instead of v (bnb stores v) halves the decades v needs: an element whose gradient is 1e-4 of its
//   block's largest has v 1e-8 of the block's v (below the code's 3.25e-7: v would round to 0), but r only 1e-4.
// Quantization: x / absmax (IEEE division; 0 when absmax is 0), then the nearest code: the index is the number of
// thresholds (fp32 means of neighbouring values) strictly below |x|, a binary search that both sides run with the
// same comparisons. r's first threshold is 0, so a positive r never quantizes to 0: a dequantized v is 0 only where
// v was, and where the true r is below the smallest code it is rounded up to 3.25e-7 * absmax (a floor like eps),
// so m / sqrt(v) cannot blow up (AdamW8bitState.ATinySecondMomentNeverBlowsUpTheUpdate). A block whose absmax is
// below kMinAbsmax (2^-40) is stored as zero: every dequantized m and v (= r * r) is then a normal fp32 number, which
// re-quantizes to the same code (the checkpoint round trip below), and such a moment moves its weight by at most
// step_size * 1e-12 / eps.
// NaN quantizes to 0 (the trainer skips steps with non-finite gradients before they reach the update).
//
// One step (update_element + the block's absmax + encode): per element, with k from bf16_state::consts:
//   m = decode_m(code) * absmax_m;  v = r * r, r = decode_r(code) * absmax_r          (the old moments, fp32)
//   mm = fma(b1, m, (1-b1) g);  vv = fma(b2, v, ((1-b2) g) g);  rr = sqrt(vv)         (as bf16_state.h)
//   p' = bf16_state::new_weight(p, mm, vv): the bf16 state's update and stochastic rounding, the same random bits
// then absmax_m' = max |mm|, absmax_r' = max rr over the block (fmaxf: exact, order-free) and the new codes.
// The weight update uses the fresh fp32 mm, vv (as bitsandbytes): quantization only touches the stored state.
//
// Checkpoint round trip (bitwise resume through dequantized fp32, GpuAdamW::read_state / write_state): the block's
// largest element has code 1.0 (x / absmax = 1 exactly), so the dequantized block's absmax is absmax again; every
// other dequantized value d = fl(t * absmax) re-quantizes as fl(d / absmax) = t (1 + e), |e| <= 2^-23, far inside
// t's rounding interval; sqrt(fl(r * r)) = r for normal r (Boldo). Tests: AdamW8bitState.*.
#pragma once
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/adamw/bf16_state.h"

namespace ds::ops::q8_state {

constexpr int64_t kBlock = 256;              // elements per block (at most; see above)
constexpr float kMinAbsmax = 0x1p-40f;       // smaller block absmax: the block is stored as zero

// Tables (scripts/gen_q8_tables.py): ascending values and the thresholds between neighbours.
#define DS_Q8_M_MAGNITUDES \
  0x0p+0f, 0x1.27476cp-21f, 0x1.b43526p-19f, 0x1.040bfep-17f, 0x1.64840ep-16f, 0x1.6f0068p-15f, 0x1.15df66p-14f, \
  0x1.743e96p-14f, 0x1.47ae14p-13f, 0x1.19ce08p-12f, 0x1.8fc504p-12f, 0x1.02dep-11f, 0x1.3dd98p-11f, 0x1.78d4fep-11f, \
  0x1.b3d07cp-11f, 0x1.eecbfcp-11f, 0x1.4fdf3cp-10f, 0x1.e353f8p-10f, 0x1.3b645ap-9f, 0x1.851eb8p-9f, 0x1.ced916p-9f, \
  0x1.0c49bap-8f, 0x1.3126eap-8f, 0x1.560418p-8f, 0x1.7ae148p-8f, 0x1.9fbe76p-8f, 0x1.c49ba6p-8f, 0x1.e978d4p-8f, \
  0x1.072b02p-7f, 0x1.19999ap-7f, 0x1.2c0832p-7f, 0x1.3e76c8p-7f, 0x1.75c29p-7f, 0x1.d1eb86p-7f, 0x1.170a3ep-6f, \
  0x1.451eb8p-6f, 0x1.733334p-6f, 0x1.a147aep-6f, 0x1.cf5c28p-6f, 0x1.fd70a4p-6f, 0x1.15c29p-5f, 0x1.2cccccp-5f, \
  0x1.43d70ap-5f, 0x1.5ae148p-5f, 0x1.71eb86p-5f, 0x1.88f5c2p-5f, 0x1.ap-5f, 0x1.b70a3ep-5f, 0x1.ce147ap-5f, \
  0x1.e51eb8p-5f, 0x1.fc28f6p-5f, 0x1.09999ap-4f, 0x1.151eb8p-4f, 0x1.20a3d8p-4f, 0x1.2c28f6p-4f, 0x1.37ae14p-4f, \
  0x1.433334p-4f, 0x1.4eb852p-4f, 0x1.5a3d7p-4f, 0x1.65c29p-4f, 0x1.7147aep-4f, 0x1.7cccccp-4f, 0x1.8851ecp-4f, \
  0x1.93d70ap-4f, 0x1.b66666p-4f, 0x1.fp-4f, 0x1.14ccccp-3f, 0x1.31999ap-3f, 0x1.4e6666p-3f, 0x1.6b3334p-3f, \
  0x1.88p-3f, 0x1.a4ccccp-3f, 0x1.c1999ap-3f, 0x1.de6666p-3f, 0x1.fb3334p-3f, 0x1.0cp-2f, 0x1.1a6666p-2f, \
  0x1.28ccccp-2f, 0x1.373334p-2f, 0x1.45999ap-2f, 0x1.54p-2f, 0x1.626666p-2f, 0x1.70ccccp-2f, 0x1.7f3334p-2f, \
  0x1.8d999ap-2f, 0x1.9cp-2f, 0x1.aa6666p-2f, 0x1.b8ccccp-2f, 0x1.c73334p-2f, 0x1.d5999ap-2f, 0x1.e4p-2f, \
  0x1.f26666p-2f, 0x1.006666p-1f, 0x1.07999ap-1f, 0x1.0eccccp-1f, 0x1.16p-1f, 0x1.1d3334p-1f, 0x1.246666p-1f, \
  0x1.2b999ap-1f, 0x1.32ccccp-1f, 0x1.3ap-1f, 0x1.413334p-1f, 0x1.486666p-1f, 0x1.4f999ap-1f, 0x1.56ccccp-1f, \
  0x1.5ep-1f, 0x1.653334p-1f, 0x1.6c6666p-1f, 0x1.73999ap-1f, 0x1.7accccp-1f, 0x1.82p-1f, 0x1.893334p-1f, \
  0x1.906666p-1f, 0x1.97999ap-1f, 0x1.9eccccp-1f, 0x1.a6p-1f, 0x1.ad3334p-1f, 0x1.b46666p-1f, 0x1.bb999ap-1f, \
  0x1.c2ccccp-1f, 0x1.cap-1f, 0x1.d13334p-1f, 0x1.d86666p-1f, 0x1.df999ap-1f, 0x1.e6ccccp-1f, 0x1.eep-1f, \
  0x1.f53334p-1f, 0x1p+0f

#define DS_Q8_M_THRESHOLDS \
  0x1.27476cp-22f, 0x1.fe07p-20f, 0x1.711948p-18f, 0x1.e68a0cp-17f, 0x1.10a138p-15f, 0x1.cd5f9ap-15f, \
  0x1.450efep-14f, 0x1.00e6bp-13f, 0x1.bda512p-13f, 0x1.54c986p-12f, 0x1.cac082p-12f, 0x1.205bcp-11f, 0x1.5b574p-11f, \
  0x1.9652bcp-11f, 0x1.d14e3cp-11f, 0x1.23a29cp-10f, 0x1.99999ap-10f, 0x1.16872cp-9f, 0x1.604188p-9f, 0x1.a9fbe8p-9f, \
  0x1.f3b644p-9f, 0x1.1eb852p-8f, 0x1.43958p-8f, 0x1.6872bp-8f, 0x1.8d4fep-8f, 0x1.b22d0ep-8f, 0x1.d70a3cp-8f, \
  0x1.fbe76cp-8f, 0x1.10624ep-7f, 0x1.22d0e6p-7f, 0x1.353f7cp-7f, 0x1.5a1cacp-7f, 0x1.a3d70cp-7f, 0x1p-6f, \
  0x1.2e147cp-6f, 0x1.5c28f6p-6f, 0x1.8a3d7p-6f, 0x1.b851ecp-6f, 0x1.e66666p-6f, 0x1.0a3d7p-5f, 0x1.2147aep-5f, \
  0x1.3851ecp-5f, 0x1.4f5c28p-5f, 0x1.666668p-5f, 0x1.7d70a4p-5f, 0x1.947aep-5f, 0x1.ab852p-5f, 0x1.c28f5cp-5f, \
  0x1.d99998p-5f, 0x1.f0a3d8p-5f, 0x1.03d70ap-4f, 0x1.0f5c28p-4f, 0x1.1ae148p-4f, 0x1.266668p-4f, 0x1.31eb84p-4f, \
  0x1.3d70a4p-4f, 0x1.48f5c4p-4f, 0x1.547aep-4f, 0x1.6p-4f, 0x1.6b852p-4f, 0x1.770a3cp-4f, 0x1.828f5cp-4f, \
  0x1.8e147cp-4f, 0x1.a51eb8p-4f, 0x1.d33334p-4f, 0x1.066666p-3f, 0x1.233334p-3f, 0x1.4p-3f, 0x1.5cccccp-3f, \
  0x1.79999ap-3f, 0x1.966666p-3f, 0x1.b33334p-3f, 0x1.dp-3f, 0x1.ecccccp-3f, 0x1.04ccccp-2f, 0x1.133334p-2f, \
  0x1.219998p-2f, 0x1.3p-2f, 0x1.3e6668p-2f, 0x1.4cccccp-2f, 0x1.5b3334p-2f, 0x1.699998p-2f, 0x1.78p-2f, \
  0x1.866668p-2f, 0x1.94ccccp-2f, 0x1.a33334p-2f, 0x1.b19998p-2f, 0x1.cp-2f, 0x1.ce6668p-2f, 0x1.dcccccp-2f, \
  0x1.eb3334p-2f, 0x1.f99998p-2f, 0x1.04p-1f, 0x1.0b3334p-1f, 0x1.126666p-1f, 0x1.19999ap-1f, 0x1.20ccccp-1f, \
  0x1.28p-1f, 0x1.2f3334p-1f, 0x1.366666p-1f, 0x1.3d999ap-1f, 0x1.44ccccp-1f, 0x1.4cp-1f, 0x1.533334p-1f, \
  0x1.5a6666p-1f, 0x1.61999ap-1f, 0x1.68ccccp-1f, 0x1.7p-1f, 0x1.773334p-1f, 0x1.7e6666p-1f, 0x1.85999ap-1f, \
  0x1.8cccccp-1f, 0x1.94p-1f, 0x1.9b3334p-1f, 0x1.a26666p-1f, 0x1.a9999ap-1f, 0x1.b0ccccp-1f, 0x1.b8p-1f, \
  0x1.bf3334p-1f, 0x1.c66666p-1f, 0x1.cd999ap-1f, 0x1.d4ccccp-1f, 0x1.dcp-1f, 0x1.e33334p-1f, 0x1.ea6666p-1f, \
  0x1.f1999ap-1f, 0x1.fa999ap-1f

#define DS_Q8_R_VALUES \
  0x0p+0f, 0x1.5cf752p-22f, 0x1.a0133p-21f, 0x1.1d3672p-19f, 0x1.2599eep-18f, 0x1.bc98a2p-18f, 0x1.29cbacp-17f, \
  0x1.0624dep-16f, 0x1.c2e33ep-16f, 0x1.3fd0dp-15f, 0x1.9e3002p-15f, 0x1.fc8f32p-15f, 0x1.2d7732p-14f, \
  0x1.5ca6cap-14f, 0x1.8bd662p-14f, 0x1.0cb296p-13f, 0x1.82a994p-13f, 0x1.f8a09p-13f, 0x1.374bc6p-12f, \
  0x1.724746p-12f, 0x1.ad42c4p-12f, 0x1.e83e42p-12f, 0x1.119cep-11f, 0x1.2f1aap-11f, 0x1.4c986p-11f, 0x1.6a161ep-11f, \
  0x1.8793dep-11f, 0x1.a5119cp-11f, 0x1.c28f5cp-11f, 0x1.e00d1cp-11f, 0x1.fd8adap-11f, 0x1.2b020cp-10f, \
  0x1.74bc6ap-10f, 0x1.be76c8p-10f, 0x1.041894p-9f, 0x1.28f5c2p-9f, 0x1.4dd2f2p-9f, 0x1.72b02p-9f, 0x1.978d5p-9f, \
  0x1.bc6a7ep-9f, 0x1.e147aep-9f, 0x1.03126ep-8f, 0x1.158106p-8f, 0x1.27ef9ep-8f, 0x1.3a5e36p-8f, 0x1.4cccccp-8f, \
  0x1.5f3b64p-8f, 0x1.71a9fcp-8f, 0x1.841894p-8f, 0x1.96872cp-8f, 0x1.a8f5c2p-8f, 0x1.bb645ap-8f, 0x1.cdd2f2p-8f, \
  0x1.e0418ap-8f, 0x1.f2b02p-8f, 0x1.028f5cp-7f, 0x1.0bc6a8p-7f, 0x1.14fdf4p-7f, 0x1.1e354p-7f, 0x1.276c8cp-7f, \
  0x1.30a3d8p-7f, 0x1.39db22p-7f, 0x1.43126ep-7f, 0x1.5eb852p-7f, 0x1.8cccccp-7f, 0x1.bae148p-7f, 0x1.e8f5c2p-7f, \
  0x1.0b851ep-6f, 0x1.228f5cp-6f, 0x1.39999ap-6f, 0x1.50a3d8p-6f, 0x1.67ae14p-6f, 0x1.7eb852p-6f, 0x1.95c29p-6f, \
  0x1.acccccp-6f, 0x1.c3d70ap-6f, 0x1.dae148p-6f, 0x1.f1eb86p-6f, 0x1.047ae2p-5f, 0x1.1p-5f, 0x1.1b851ep-5f, \
  0x1.270a3ep-5f, 0x1.328f5cp-5f, 0x1.3e147ap-5f, 0x1.49999ap-5f, 0x1.551eb8p-5f, 0x1.60a3d8p-5f, 0x1.6c28f6p-5f, \
  0x1.77ae14p-5f, 0x1.833334p-5f, 0x1.8eb852p-5f, 0x1.9a3d7p-5f, 0x1.a5c29p-5f, 0x1.b147aep-5f, 0x1.bcccccp-5f, \
  0x1.c851ecp-5f, 0x1.d3d70ap-5f, 0x1.df5c28p-5f, 0x1.eae148p-5f, 0x1.f66666p-5f, 0x1.00f5c2p-4f, 0x1.06b852p-4f, \
  0x1.0c7ae2p-4f, 0x1.123d7p-4f, 0x1.18p-4f, 0x1.1dc29p-4f, 0x1.23851ep-4f, 0x1.2947aep-4f, 0x1.2f0a3ep-4f, \
  0x1.34ccccp-4f, 0x1.3a8f5cp-4f, 0x1.4051ecp-4f, 0x1.46147ap-4f, 0x1.4bd70ap-4f, 0x1.51999ap-4f, 0x1.575c28p-4f, \
  0x1.5d1eb8p-4f, 0x1.62e148p-4f, 0x1.68a3d8p-4f, 0x1.6e6666p-4f, 0x1.7428f6p-4f, 0x1.79eb86p-4f, 0x1.7fae14p-4f, \
  0x1.8570a4p-4f, 0x1.8b3334p-4f, 0x1.90f5c2p-4f, 0x1.96b852p-4f, 0x1.a8p-4f, 0x1.c4ccccp-4f, 0x1.e1999ap-4f, \
  0x1.fe6666p-4f, 0x1.0d999ap-3f, 0x1.1cp-3f, 0x1.2a6666p-3f, 0x1.38ccccp-3f, 0x1.473334p-3f, 0x1.55999ap-3f, \
  0x1.64p-3f, 0x1.726666p-3f, 0x1.80ccccp-3f, 0x1.8f3334p-3f, 0x1.9d999ap-3f, 0x1.acp-3f, 0x1.ba6666p-3f, \
  0x1.c8ccccp-3f, 0x1.d73334p-3f, 0x1.e5999ap-3f, 0x1.f4p-3f, 0x1.013334p-2f, 0x1.086666p-2f, 0x1.0f999ap-2f, \
  0x1.16ccccp-2f, 0x1.1ep-2f, 0x1.253334p-2f, 0x1.2c6666p-2f, 0x1.33999ap-2f, 0x1.3accccp-2f, 0x1.42p-2f, \
  0x1.493334p-2f, 0x1.506666p-2f, 0x1.57999ap-2f, 0x1.5eccccp-2f, 0x1.66p-2f, 0x1.6d3334p-2f, 0x1.746666p-2f, \
  0x1.7b999ap-2f, 0x1.82ccccp-2f, 0x1.8ap-2f, 0x1.913334p-2f, 0x1.986666p-2f, 0x1.9f999ap-2f, 0x1.a6ccccp-2f, \
  0x1.aep-2f, 0x1.b53334p-2f, 0x1.bc6666p-2f, 0x1.c3999ap-2f, 0x1.caccccp-2f, 0x1.d2p-2f, 0x1.d93334p-2f, \
  0x1.e06666p-2f, 0x1.e7999ap-2f, 0x1.eeccccp-2f, 0x1.f6p-2f, 0x1.fd3334p-2f, 0x1.023334p-1f, 0x1.05ccccp-1f, \
  0x1.096666p-1f, 0x1.0dp-1f, 0x1.10999ap-1f, 0x1.143334p-1f, 0x1.17ccccp-1f, 0x1.1b6666p-1f, 0x1.1fp-1f, \
  0x1.22999ap-1f, 0x1.263334p-1f, 0x1.29ccccp-1f, 0x1.2d6666p-1f, 0x1.31p-1f, 0x1.34999ap-1f, 0x1.383334p-1f, \
  0x1.3bccccp-1f, 0x1.3f6666p-1f, 0x1.43p-1f, 0x1.46999ap-1f, 0x1.4a3334p-1f, 0x1.4dccccp-1f, 0x1.516666p-1f, \
  0x1.55p-1f, 0x1.58999ap-1f, 0x1.5c3334p-1f, 0x1.5fccccp-1f, 0x1.636666p-1f, 0x1.67p-1f, 0x1.6a999ap-1f, \
  0x1.6e3334p-1f, 0x1.71ccccp-1f, 0x1.756666p-1f, 0x1.79p-1f, 0x1.7c999ap-1f, 0x1.803334p-1f, 0x1.83ccccp-1f, \
  0x1.876666p-1f, 0x1.8bp-1f, 0x1.8e999ap-1f, 0x1.923334p-1f, 0x1.95ccccp-1f, 0x1.996666p-1f, 0x1.9dp-1f, \
  0x1.a0999ap-1f, 0x1.a43334p-1f, 0x1.a7ccccp-1f, 0x1.ab6666p-1f, 0x1.afp-1f, 0x1.b2999ap-1f, 0x1.b63334p-1f, \
  0x1.b9ccccp-1f, 0x1.bd6666p-1f, 0x1.c1p-1f, 0x1.c4999ap-1f, 0x1.c83334p-1f, 0x1.cbccccp-1f, 0x1.cf6666p-1f, \
  0x1.d3p-1f, 0x1.d6999ap-1f, 0x1.da3334p-1f, 0x1.ddccccp-1f, 0x1.e16666p-1f, 0x1.e5p-1f, 0x1.e8999ap-1f, \
  0x1.ec3334p-1f, 0x1.efccccp-1f, 0x1.f36666p-1f, 0x1.f7p-1f, 0x1.fa999ap-1f, 0x1.fe3334p-1f, 0x1p+0f

#define DS_Q8_R_THRESHOLDS \
  0x0p+0f, 0x1.27476cp-21f, 0x1.853b3ep-20f, 0x1.b43528p-19f, 0x1.711948p-18f, 0x1.040bfep-17f, 0x1.9b0ab4p-17f, \
  0x1.64840ep-16f, 0x1.10a138p-15f, 0x1.6f0068p-15f, 0x1.cd5f9ap-15f, 0x1.15df66p-14f, 0x1.450efep-14f, \
  0x1.743e96p-14f, 0x1.d29dc8p-14f, 0x1.47ae14p-13f, 0x1.bda512p-13f, 0x1.19ce08p-12f, 0x1.54c986p-12f, \
  0x1.8fc504p-12f, 0x1.cac084p-12f, 0x1.02dep-11f, 0x1.205bcp-11f, 0x1.3dd98p-11f, 0x1.5b574p-11f, 0x1.78d4fep-11f, \
  0x1.9652bcp-11f, 0x1.b3d07cp-11f, 0x1.d14e3cp-11f, 0x1.eecbfcp-11f, 0x1.14e3bcp-10f, 0x1.4fdf3cp-10f, \
  0x1.999998p-10f, 0x1.e353f8p-10f, 0x1.16872cp-9f, 0x1.3b645ap-9f, 0x1.604188p-9f, 0x1.851eb8p-9f, 0x1.a9fbe8p-9f, \
  0x1.ced916p-9f, 0x1.f3b644p-9f, 0x1.0c49bap-8f, 0x1.1eb852p-8f, 0x1.3126eap-8f, 0x1.43958p-8f, 0x1.560418p-8f, \
  0x1.6872bp-8f, 0x1.7ae148p-8f, 0x1.8d4fep-8f, 0x1.9fbe78p-8f, 0x1.b22d0ep-8f, 0x1.c49ba6p-8f, 0x1.d70a3ep-8f, \
  0x1.e978d4p-8f, 0x1.fbe76cp-8f, 0x1.072b02p-7f, 0x1.10624ep-7f, 0x1.19999ap-7f, 0x1.22d0e6p-7f, 0x1.2c0832p-7f, \
  0x1.353f7cp-7f, 0x1.3e76c8p-7f, 0x1.50e56p-7f, 0x1.75c29p-7f, 0x1.a3d70ap-7f, 0x1.d1eb84p-7f, 0x1p-6f, \
  0x1.170a3cp-6f, 0x1.2e147cp-6f, 0x1.451eb8p-6f, 0x1.5c28f6p-6f, 0x1.733334p-6f, 0x1.8a3d7p-6f, 0x1.a147aep-6f, \
  0x1.b851ecp-6f, 0x1.cf5c28p-6f, 0x1.e66668p-6f, 0x1.fd70a4p-6f, 0x1.0a3d7p-5f, 0x1.15c29p-5f, 0x1.2147aep-5f, \
  0x1.2cccccp-5f, 0x1.3851ecp-5f, 0x1.43d70ap-5f, 0x1.4f5c28p-5f, 0x1.5ae148p-5f, 0x1.666668p-5f, 0x1.71eb84p-5f, \
  0x1.7d70a4p-5f, 0x1.88f5c4p-5f, 0x1.947aep-5f, 0x1.ap-5f, 0x1.ab852p-5f, 0x1.b70a3cp-5f, 0x1.c28f5cp-5f, \
  0x1.ce147cp-5f, 0x1.d99998p-5f, 0x1.e51eb8p-5f, 0x1.f0a3d8p-5f, 0x1.fc28f4p-5f, 0x1.03d70ap-4f, 0x1.09999ap-4f, \
  0x1.0f5c28p-4f, 0x1.151eb8p-4f, 0x1.1ae148p-4f, 0x1.20a3d8p-4f, 0x1.266666p-4f, 0x1.2c28f6p-4f, 0x1.31eb84p-4f, \
  0x1.37ae14p-4f, 0x1.3d70a4p-4f, 0x1.433334p-4f, 0x1.48f5c2p-4f, 0x1.4eb852p-4f, 0x1.547aep-4f, 0x1.5a3d7p-4f, \
  0x1.6p-4f, 0x1.65c29p-4f, 0x1.6b852p-4f, 0x1.7147aep-4f, 0x1.770a3ep-4f, 0x1.7cccccp-4f, 0x1.828f5cp-4f, \
  0x1.8851ecp-4f, 0x1.8e147cp-4f, 0x1.93d70ap-4f, 0x1.9f5c28p-4f, 0x1.b66666p-4f, 0x1.d33334p-4f, 0x1.fp-4f, \
  0x1.066666p-3f, 0x1.14ccccp-3f, 0x1.233334p-3f, 0x1.319998p-3f, 0x1.4p-3f, 0x1.4e6668p-3f, 0x1.5cccccp-3f, \
  0x1.6b3334p-3f, 0x1.799998p-3f, 0x1.88p-3f, 0x1.966668p-3f, 0x1.a4ccccp-3f, 0x1.b33334p-3f, 0x1.c19998p-3f, \
  0x1.dp-3f, 0x1.de6668p-3f, 0x1.ecccccp-3f, 0x1.fb3334p-3f, 0x1.04ccccp-2f, 0x1.0cp-2f, 0x1.133334p-2f, \
  0x1.1a6666p-2f, 0x1.21999ap-2f, 0x1.28ccccp-2f, 0x1.3p-2f, 0x1.373334p-2f, 0x1.3e6666p-2f, 0x1.45999ap-2f, \
  0x1.4cccccp-2f, 0x1.54p-2f, 0x1.5b3334p-2f, 0x1.626666p-2f, 0x1.69999ap-2f, 0x1.70ccccp-2f, 0x1.78p-2f, \
  0x1.7f3334p-2f, 0x1.866666p-2f, 0x1.8d999ap-2f, 0x1.94ccccp-2f, 0x1.9cp-2f, 0x1.a33334p-2f, 0x1.aa6666p-2f, \
  0x1.b1999ap-2f, 0x1.b8ccccp-2f, 0x1.cp-2f, 0x1.c73334p-2f, 0x1.ce6666p-2f, 0x1.d5999ap-2f, 0x1.dcccccp-2f, \
  0x1.e4p-2f, 0x1.eb3334p-2f, 0x1.f26666p-2f, 0x1.f9999ap-2f, 0x1.006668p-1f, 0x1.04p-1f, 0x1.079998p-1f, \
  0x1.0b3334p-1f, 0x1.0eccccp-1f, 0x1.126668p-1f, 0x1.16p-1f, 0x1.199998p-1f, 0x1.1d3334p-1f, 0x1.20ccccp-1f, \
  0x1.246668p-1f, 0x1.28p-1f, 0x1.2b9998p-1f, 0x1.2f3334p-1f, 0x1.32ccccp-1f, 0x1.366668p-1f, 0x1.3ap-1f, \
  0x1.3d9998p-1f, 0x1.413334p-1f, 0x1.44ccccp-1f, 0x1.486668p-1f, 0x1.4cp-1f, 0x1.4f9998p-1f, 0x1.533334p-1f, \
  0x1.56ccccp-1f, 0x1.5a6668p-1f, 0x1.5ep-1f, 0x1.619998p-1f, 0x1.653334p-1f, 0x1.68ccccp-1f, 0x1.6c6668p-1f, \
  0x1.7p-1f, 0x1.739998p-1f, 0x1.773334p-1f, 0x1.7accccp-1f, 0x1.7e6668p-1f, 0x1.82p-1f, 0x1.859998p-1f, \
  0x1.893334p-1f, 0x1.8cccccp-1f, 0x1.906668p-1f, 0x1.94p-1f, 0x1.979998p-1f, 0x1.9b3334p-1f, 0x1.9eccccp-1f, \
  0x1.a26668p-1f, 0x1.a6p-1f, 0x1.a99998p-1f, 0x1.ad3334p-1f, 0x1.b0ccccp-1f, 0x1.b46668p-1f, 0x1.b8p-1f, \
  0x1.bb9998p-1f, 0x1.bf3334p-1f, 0x1.c2ccccp-1f, 0x1.c66668p-1f, 0x1.cap-1f, 0x1.cd9998p-1f, 0x1.d13334p-1f, \
  0x1.d4ccccp-1f, 0x1.d86668p-1f, 0x1.dcp-1f, 0x1.df9998p-1f, 0x1.e33334p-1f, 0x1.e6ccccp-1f, 0x1.ea6668p-1f, \
  0x1.eep-1f, 0x1.f19998p-1f, 0x1.f53334p-1f, 0x1.f8ccccp-1f, 0x1.fc6668p-1f, 0x1.ff199ap-1f

inline constexpr float kMMagnitudes[128] = {DS_Q8_M_MAGNITUDES};
inline constexpr float kMThresholds[127] = {DS_Q8_M_THRESHOLDS};
inline constexpr float kRValues[256] = {DS_Q8_R_VALUES};
inline constexpr float kRThresholds[255] = {DS_Q8_R_THRESHOLDS};

// The tables where the caller keeps them (host: the arrays above; CUDA: shared memory).
struct Tables {
  const float *m_mag, *m_thr, *r_val, *r_thr;
};
inline Tables host_tables() { return {kMMagnitudes, kMThresholds, kRValues, kRThresholds}; }

// The number of thresholds t[0..2^bits - 1) strictly below x (t ascending): binary lifting, `bits` comparisons.
template <int bits>
DS_ADAM_HD int count_below(const float* t, float x) {
  int i = 0;
  for (int step = 1 << (bits - 1); step >= 1; step >>= 1)
    if (t[i + step - 1] < x) i += step;
  return i;
}

DS_ADAM_HD float decode_m(uint8_t c, const Tables& t) {
  const float a = t.m_mag[c & 0x7f];
  return (c & 0x80) ? -a : a;
}
DS_ADAM_HD float decode_r(uint8_t c, const Tables& t) { return t.r_val[c]; }
// x = m / absmax in [-1, 1] (NaN: 0).
DS_ADAM_HD uint8_t encode_m(float x, const Tables& t) {
  const int j = count_below<7>(t.m_thr, fabsf(x));
  return static_cast<uint8_t>(j == 0 ? 0 : (x < 0.0f ? 0x80 | j : j));
}
// x = r / absmax in [0, 1] (NaN: 0; any x > 0: at least 1).
DS_ADAM_HD uint8_t encode_r(float x, const Tables& t) { return static_cast<uint8_t>(count_below<8>(t.r_thr, x)); }

// The same counts in O(1), for the CUDA kernel (a binary search costs it `bits` dependent shared-memory loads per
// code): the positive floats are cut into buckets by their top bits, bits(x) >> kBucketShift (the exponent and 6
// mantissa bits: 64 buckets per binade), counted from the bucket of the table's first positive threshold (bucket 0,
// which also takes every smaller positive x) up to the bucket of 1.0 (which also takes anything larger). lo[b] is the
// number of thresholds below bucket b's smallest value (below every positive float for b = 0); at most
// kBucketSpan thresholds lie inside any bucket (static_assert below), so count_below(x) = lo[b] + the number of
// t[lo[b] + j], j < kBucketSpan, below x (t padded with +inf). The same count for every x: 0 for NaN and x <= 0 as
// count_below (tests/test_adamw_8bit.cpp checks both ways at every bucket edge and threshold, and at random x).
inline constexpr int kBucketShift = 17;
inline constexpr int kBucketSpan = 2;
template <int NT>
constexpr uint32_t bucket_base(const float (&t)[NT]) {
  for (int i = 0; i < NT; ++i)
    if (t[i] > 0.0f) return std::bit_cast<uint32_t>(t[i]) >> kBucketShift;
  return 0;
}
template <int NT>
constexpr int bucket_count(const float (&t)[NT]) {
  return static_cast<int>((std::bit_cast<uint32_t>(1.0f) >> kBucketShift) - bucket_base(t)) + 1;
}
// The bucket of a positive x, and per bucket the number of the table's positive thresholds in it.
template <int NT>
constexpr int bucket_of(const float (&t)[NT], float x) {
  const int b = static_cast<int>(std::bit_cast<uint32_t>(x) >> kBucketShift) - static_cast<int>(bucket_base(t));
  return b < 0 ? 0 : (b >= bucket_count(t) ? bucket_count(t) - 1 : b);
}
template <int NT, int NB>
constexpr std::array<int, NB> bucket_sizes(const float (&t)[NT]) {
  std::array<int, NB> n{};
  for (int i = 0; i < NT; ++i)
    if (t[i] > 0.0f) ++n[static_cast<size_t>(bucket_of(t, t[i]))];
  return n;
}
// lo[b]: the thresholds <= 0 and those in the buckets before b (= the thresholds below every x of bucket b).
template <int NT, int NB>
constexpr std::array<uint8_t, NB> bucket_lo(const float (&t)[NT]) {
  const std::array<int, NB> n = bucket_sizes<NT, NB>(t);
  int below = 0;
  for (int i = 0; i < NT; ++i) below += !(t[i] > 0.0f);
  std::array<uint8_t, NB> lo{};
  for (int b = 0; b < NB; ++b) {
    lo[static_cast<size_t>(b)] = static_cast<uint8_t>(below);
    below += n[static_cast<size_t>(b)];
  }
  return lo;
}
template <int NT, int NB>
constexpr int bucket_span(const float (&t)[NT]) {
  int most = 0;
  for (int x : bucket_sizes<NT, NB>(t)) most = x > most ? x : most;
  return most;
}
inline constexpr int kMBuckets = bucket_count(kMThresholds), kRBuckets = bucket_count(kRThresholds);
inline constexpr uint32_t kMBucketBase = bucket_base(kMThresholds), kRBucketBase = bucket_base(kRThresholds);
inline constexpr std::array<uint8_t, kMBuckets> kMBucketLo = bucket_lo<127, kMBuckets>(kMThresholds);
inline constexpr std::array<uint8_t, kRBuckets> kRBucketLo = bucket_lo<255, kRBuckets>(kRThresholds);
static_assert(bucket_span<127, kMBuckets>(kMThresholds) <= kBucketSpan &&
                  bucket_span<255, kRBuckets>(kRThresholds) <= kBucketSpan,
              "a bucket holds more thresholds than the bucketed count compares");

// count_below(t, x) by the buckets: lo [nb] (kMBucketLo / kRBucketLo, where the caller keeps them), base, t padded
// with kBucketSpan values of +infinity.
DS_ADAM_HD int count_below_bucketed(const uint8_t* lo, int nb, uint32_t base, const float* t_padded, float x) {
  // Branch-free: NaN and negative x (their bits are large) land in the last bucket, and the select gives them 0.
  int b = static_cast<int>(bf16_state::f32_bits(x) >> kBucketShift) - static_cast<int>(base);
  b = b < 0 ? 0 : (b >= nb ? nb - 1 : b);
  const int i = lo[b];
  const int n = i + (t_padded[i] < x) + (t_padded[i + 1] < x);
  return x > 0.0f ? n : 0;
}
static_assert(kBucketSpan == 2, "count_below_bucketed compares two thresholds");

// encode_m / encode_r by the buckets (Tables' thresholds padded with kBucketSpan x +infinity).
struct BucketTables {
  const uint8_t *m_lo, *r_lo;
};
DS_ADAM_HD uint8_t encode_m(float x, const Tables& t, const BucketTables& bt) {
  const int j = count_below_bucketed(bt.m_lo, kMBuckets, kMBucketBase, t.m_thr, fabsf(x));
  return static_cast<uint8_t>(j == 0 ? 0 : (x < 0.0f ? 0x80 | j : j));
}
DS_ADAM_HD uint8_t encode_r(float x, const Tables& t, const BucketTables& bt) {
  return static_cast<uint8_t>(count_below_bucketed(bt.r_lo, kRBuckets, kRBucketBase, t.r_thr, x));
}

// The scale stored for a block whose largest |value| is absmax (0: the block is zero) and the value a code
// stands for.
DS_ADAM_HD float block_scale(float absmax) { return absmax >= kMinAbsmax ? absmax : 0.0f; }
DS_ADAM_HD float normalized(float x, float scale) { return scale > 0.0f ? x / scale : 0.0f; }
DS_ADAM_HD float dequantize_m(uint8_t c, float scale, const Tables& t) {
  return bf16_state::mul_rn(decode_m(c, t), scale);
}
DS_ADAM_HD float dequantize_r(uint8_t c, float scale, const Tables& t) {
  return bf16_state::mul_rn(decode_r(c, t), scale);
}

// One element's step (see the top): the weight p in place, the new m and r = sqrt(v) out (to be quantized with the
// block's new absmax). m_old, r_old: the dequantized old moments; index: the flat parameter index (random bits).
DS_ADAM_HD void update_element(uint16_t& p, float g, float m_old, float r_old, const bf16_state::Consts& k,
                               uint64_t index, float& mm, float& rr) {
  mm = bf16_state::new_exp_avg(m_old, g, k);
  const float vv = bf16_state::new_exp_avg_sq(bf16_state::mul_rn(r_old, r_old), g, k);
  rr = sqrtf(vv);
  p = bf16_state::new_weight(p, mm, vv, k, static_cast<uint32_t>(bf16_state::element_bits(k.key, index)));
}

// Blocks of the flat range [index0, index0 + n) (n > 0): block b of the range is chunk index0 / 256 + b, elements
// [max(index0, 256 c), min(index0 + n, 256 c + 256)).
DS_ADAM_HD int64_t num_blocks(int64_t index0, int64_t n) {
  return n <= 0 ? 0 : (index0 + n + kBlock - 1) / kBlock - index0 / kBlock;
}

// The update's chunks: runs of kPartialBlocks blocks of the range from its first block (ops/adamw/cuda.h: one
// gradient sum-of-squares partial, one CUDA block of the kernel, one byte of its chunk_mask each).
inline constexpr int64_t kPartialBlocks = 32;
inline int64_t num_chunks(int64_t index0, int64_t n) {
  return (num_blocks(index0, n) + kPartialBlocks - 1) / kPartialBlocks;
}
// For a parameter of n elements from flat index index0, cut into rows of `row` elements (the embedding's rows):
// mask[j] = 1 where chunk j holds an element of one of `rows` (ids in [0, n / row)), else 0; num_chunks(index0, n)
// bytes. The embedding's in-backward update split (model/gpu_model.cpp split_embed) updates the 0 chunks early.
inline std::vector<uint8_t> row_chunk_mask(int64_t index0, int64_t n, int64_t row, const std::vector<int32_t>& rows) {
  std::vector<uint8_t> mask(static_cast<size_t>(num_chunks(index0, n)), 0);
  const int64_t c0 = index0 / kBlock;
  for (const int32_t r : rows) {
    const int64_t e0 = index0 + r * row, e1 = e0 + row - 1;  // the row's first and last flat index
    for (int64_t j = (e0 / kBlock - c0) / kPartialBlocks; j <= (e1 / kBlock - c0) / kPartialBlocks; ++j)
      mask[static_cast<size_t>(j)] = 1;
  }
  return mask;
}

}  // namespace ds::ops::q8_state
