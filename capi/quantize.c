// Blockwise rounding with error feedback: the local work of the PyTorch
// plugin's quantized allreduce (plugins/pytorch/oktopk/quantized.py), each
// in one pass over its values. Plain C, no Go: the calls are short and
// numerous (two per chunk per call), and C needs no runtime entry.
//
// Why here: written as tensor operations, one rounding is about ten passes
// over the bucket (the sums, the block maxima, the division, the rounding,
// the clamp, the codes, the packing, the residual), and on the CPU a
// gradient-sized pass is memory traffic the cores share with backward.
// Here a block of `block` values is read once, rounded in cache, and its
// codes, scale and new residual written once.
//
// The arithmetic is the tensor version's, operation by operation, so the
// results are the same bits (tests/python/test_quantized.py checks that):
//   scale  = bfloat16(max |acc|) over the block (round to nearest even)
//   s      = max(float(scale), FLT_MIN)
//   step   = s / half,               half = 2^(bits-1) - 1
//   level  = clamp(rint(acc / step), -half, half)
//   code   = level + half            (bits wide; 8/bits codes a byte,
//                                     the first in the low bits)
//   sent   = level * step
//   new residual = acc - sent
// and decoding gives level * (s / half): sent, bitwise. One difference,
// in a residual's zeros only: a value of -0 leaves a residual of -0 here and
// +0 there (rint keeps the sign of a rounded -0.3, the integer level does
// not); the codes, scales and results are the same bits.
//
// Floating point contraction must stay off: acc - level * step as one
// fused multiply-add would round once where the tensors round twice (cgo
// refuses -ffp-contract=off as a flag, so the pragmas say it).

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <float.h>
#include <stdint.h>
#include <string.h>

#include "../include/oktopk.h"

#define MAX_BLOCK 4096

static uint16_t bfloat16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; // NaN, as torch rounds it
  u += 0x7fffu + ((u >> 16) & 1u);                      // to nearest, ties to even
  return (uint16_t)(u >> 16);
}

static float bfloat16_value(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// rint() in the default rounding mode (to nearest, ties to even) for
// |v| <= 2^22: adding 1.5 * 2^23 leaves no bits below the unit. Inlined and
// vectorized where rintf() would be a library call without SSE4.1.
static inline float round_even(float v) {
  const float magic = 12582912.0f;
  return (v + magic) - magic;
}

static int valid_bits(int bits) { return bits == 2 || bits == 4 || bits == 8; }

// The largest |a| of a block as the bits of a non-negative float: their
// order as integers is the floats' order, and a NaN or an Inf is at least
// 0x7f800000, so one integer maximum (which vectorizes, where a float one
// must keep NaN's order) gives both the scale and whether the block is
// finite.
static inline uint32_t magnitude_bits(float a) {
  uint32_t u;
  memcpy(&u, &a, sizeof u);
  return u & 0x7fffffffu;
}

// One block: acc (block values) rounded, codes packed into out, new
// residual written. Inlined with bits a constant, so the loops vectorize.
static inline __attribute__((always_inline)) int round_block(const float *restrict x, const float *restrict residual,
                                                             float *restrict acc, size_t block, int bits, uint8_t *restrict out,
                                                             uint8_t *restrict scale_out, float *new_residual) {
  const int half = (1 << (bits - 1)) - 1;
  const int per_byte = 8 / bits;
  uint32_t m = 0;
  if (residual != NULL) {
    for (size_t i = 0; i < block; i++) acc[i] = x[i] + residual[i];
  } else {
    for (size_t i = 0; i < block; i++) acc[i] = x[i];
  }
  for (size_t i = 0; i < block; i++) {
    uint32_t u = magnitude_bits(acc[i]);
    m = u > m ? u : m;
  }
  int bad = m >= 0x7f800000u;
  if (bad) {
    // What torch.nan_to_num makes of the block: NaN 0, +-Inf +-FLT_MAX.
    // The call then fails on every rank; the codes only need to be codes.
    m = 0;
    for (size_t i = 0; i < block; i++) {
      float a = acc[i];
      a = a != a ? 0 : a > FLT_MAX ? FLT_MAX : a < -FLT_MAX ? -FLT_MAX : a;
      acc[i] = a;
      uint32_t u = magnitude_bits(a);
      m = u > m ? u : m;
    }
  }
  float largest;
  memcpy(&largest, &m, sizeof largest);
  const uint16_t scale_bits = bfloat16_bits(largest);
  memcpy(scale_out, &scale_bits, 2);
  float s = bfloat16_value(scale_bits);
  s = s < FLT_MIN ? FLT_MIN : s; // clamp_min: a NaN stays NaN
  const float step = s / (float)half;
  uint8_t codes[MAX_BLOCK];
  for (size_t i = 0; i < block; i++) {
    // A quotient is at most a little above half (the scale rounds to
    // bfloat16), or 0 in a block that held an Inf (FLT_MAX / Inf): well
    // inside round_even's range, and its rounding an exact integer. The
    // clamp is the tensors' (a clamp of the rounded float), done on the
    // integer, where it vectorizes.
    int q = (int)round_even(acc[i] / step);
    q = q < -half ? -half : q;
    q = q > half ? half : q;
    new_residual[i] = acc[i] - (float)q * step;
    codes[i] = (uint8_t)(q + half);
  }
  for (size_t i = 0; i < block / per_byte; i++) {
    unsigned byte = 0;
    for (int j = 0; j < per_byte; j++) byte |= (unsigned)codes[i * per_byte + j] << (bits * j);
    out[i] = (uint8_t)byte;
  }
  return bad;
}

static int round_blocks(const float *x, const float *residual, size_t n, int bits, size_t block, uint8_t *codes,
                        uint8_t *scales, float *new_residual) {
  float acc[MAX_BLOCK];
  int bad = 0;
  const int per_byte = 8 / bits;
  for (size_t at = 0; at < n; at += block) {
    const float *r = residual != NULL ? residual + at : NULL;
    uint8_t *c = codes + at / per_byte, *s = scales + 2 * (at / block);
    if (bits == 4 && block == 32) { // the plugin's default: the loops unrolled
      bad |= round_block(x + at, r, acc, 32, 4, c, s, new_residual + at);
      continue;
    }
    switch (bits) {
      case 2: bad |= round_block(x + at, r, acc, block, 2, c, s, new_residual + at); break;
      case 4: bad |= round_block(x + at, r, acc, block, 4, c, s, new_residual + at); break;
      default: bad |= round_block(x + at, r, acc, block, 8, c, s, new_residual + at); break;
    }
  }
  return bad;
}

oktopk_result_t oktopk_quantize_blocks(const float *x, const float *residual, size_t n, int bits, size_t block,
                                       uint8_t *codes, void *scales, float *new_residual, int *nonfinite) {
  if (!valid_bits(bits) || block == 0 || block > MAX_BLOCK || block % 8 != 0 || n % block != 0) return oktopkInvalidArgument;
  if (n > 0 && (x == NULL || codes == NULL || scales == NULL || new_residual == NULL)) return oktopkInvalidArgument;
  int bad = round_blocks(x, residual, n, bits, block, codes, scales, new_residual);
  if (nonfinite != NULL) *nonfinite = bad;
  return oktopkSuccess;
}

static inline __attribute__((always_inline)) void decode_block(const uint8_t *restrict in, uint16_t scale_bits, size_t block, int bits,
                                                               float *restrict out) {
  const int half = (1 << (bits - 1)) - 1;
  const int per_byte = 8 / bits;
  const unsigned mask = (1u << bits) - 1;
  float s = bfloat16_value(scale_bits);
  s = s < FLT_MIN ? FLT_MIN : s;
  const float unit = s / (float)half;
  for (size_t i = 0; i < block / per_byte; i++) {
    const unsigned byte = in[i];
    for (int j = 0; j < per_byte; j++) out[i * per_byte + j] = (float)((int)((byte >> (bits * j)) & mask) - half) * unit;
  }
}

oktopk_result_t oktopk_dequantize_blocks(const uint8_t *codes, const void *scales, size_t n, int bits, size_t block,
                                         float *out) {
  if (!valid_bits(bits) || block == 0 || block > MAX_BLOCK || block % 8 != 0 || n % block != 0) return oktopkInvalidArgument;
  if (n > 0 && (codes == NULL || scales == NULL || out == NULL)) return oktopkInvalidArgument;
  const int per_byte = 8 / bits;
  for (size_t at = 0; at < n; at += block) {
    uint16_t scale_bits;
    memcpy(&scale_bits, (const uint8_t *)scales + 2 * (at / block), 2);
    const uint8_t *c = codes + at / per_byte;
    if (bits == 4 && block == 32) {
      decode_block(c, scale_bits, 32, 4, out + at);
      continue;
    }
    switch (bits) {
      case 2: decode_block(c, scale_bits, block, 2, out + at); break;
      case 4: decode_block(c, scale_bits, block, 4, out + at); break;
      default: decode_block(c, scale_bits, block, 8, out + at); break;
    }
  }
  return oktopkSuccess;
}
