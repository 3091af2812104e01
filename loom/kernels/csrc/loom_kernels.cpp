// loom's CPU kernels, AVX-512 + VNNI variant: quantized GEMM over GGUF-derived codes, RoPE
// with KV-cache store, and decode attention over the paged cache. The loops are shared with
// the AVX2 variant (loom_kernels_loops.h, over the vector traits of loom_kernels_simd.h);
// this file adds the integer dot products. Compiled at install time with -march=native;
// loom falls back to plain torch ops where this cannot be built.

#include "loom_kernels_simd.h"

namespace loom {

struct Isa : Vec512 {
  // every matrix with a zero point takes the integer zero-point path, 8-bit codes too
  template <int BITS, int ZL>
  static constexpr bool zero_path() { return true; }

  // the codes as bytes only
  template <int BITS, int MT, int Z>
  static constexpr bool wide_codes() { return false; }

  // dot[i] = <codes of block wp - Z, activation row i> over one 32-group, one int32 per output
  // row (row i's 32 codes at xp + 8 i; with Z, xs[i] = -Z times their sum): VPDPBUSD (u8 x s8
  // -> s32) covers 16 rows x 4 inputs, eight of them a group. Each row's sum starts at xs[i],
  // broadcast from memory (not a multiply and a move from an integer register in every tile).
  template <int BITS, int MT, int Z>
  LOOM_INLINE static void dots(const uint8_t* wp, int, const int32_t* xp, const int16_t*, const int32_t* xs, I* dot) {
    I code[8];
    if constexpr (BITS == 4 || BITS == 5) {
      const I low = _mm512_set1_epi8(0x0F);
      for (int c = 0; c < 4; ++c) {
        const I v = _mm512_loadu_si512(wp + c * 64);
        code[2 * c] = _mm512_and_si512(v, low);
        code[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      if constexpr (BITS == 5) {   // the fifth bits from their plane (fifth_bit)
        const I plane = _mm512_loadu_si512(wp + 256);
        for (int c = 0; c < 8; ++c) code[c] = _mm512_or_si512(code[c], fifth_bit(plane, c));
      }
    } else {
      for (int c = 0; c < 8; ++c) code[c] = _mm512_loadu_si512(wp + c * 64);
    }
    for (int i = 0; i < MT; ++i) {
      const I init = Z ? _mm512_set1_epi32(xs[i]) : _mm512_setzero_si512();   // the zero point's term, -Z sum(xq)
      if constexpr (MT >= 4) {   // one chain per row: the rows' chains hide each other's latency
        I s = init;
        for (int c = 0; c < 8; ++c) s = _mm512_dpbusd_epi32(s, code[c], _mm512_set1_epi32(xp[8 * i + c]));
        dot[i] = s;
      } else {                   // two chains per row, added at the end
        I s0 = _mm512_dpbusd_epi32(init, code[0], _mm512_set1_epi32(xp[8 * i]));
        I s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), code[1], _mm512_set1_epi32(xp[8 * i + 1]));
        for (int c = 2; c < 8; c += 2) {
          s0 = _mm512_dpbusd_epi32(s0, code[c], _mm512_set1_epi32(xp[8 * i + c]));
          s1 = _mm512_dpbusd_epi32(s1, code[c + 1], _mm512_set1_epi32(xp[8 * i + c + 1]));
        }
        dot[i] = _mm512_add_epi32(s0, s1);
      }
    }
  }
};

}  // namespace loom

#include "loom_kernels_host.h"   // qgemm, rope_store, attn_decode, add_rmsnorm and the module table
