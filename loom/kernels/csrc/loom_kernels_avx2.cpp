// loom's CPU kernels, AVX2 + FMA + F16C variant (and, compiled with AVX-VNNI, the avxvnni one): the functions of the AVX-512 variant with the
// same signatures, semantics and packed weight layout, for CPUs without AVX-512 VNNI. The loops
// are shared (loom_kernels_loops.h over the 256-bit traits of loom_kernels_simd.h); this file
// adds the integer dot products, per 8-row half of a block (a 64-byte chunk is rows 0-7, then
// rows 8-15):
//
//   4-bit codes  VPMADDUBSW (u8 x s8 -> s16 pair sums) on the nibbles directly; the int16 sums
//                over a group stay below 8 * 2 * 15 * 127 = 30480, then VPMADDWD to int32.
//   5-bit codes  (Q5_0's 0..31, zero point 16, in five bits or in bytes) like the nibbles:
//                VPMADDUBSW on the codes, four chunks summed in int16 (< 4 * 2 * 31 * 128 =
//                31744), VPMADDWD each half. In five bits, the fifth bits come from a plane of
//                32 bytes per half (fifth_bit: a shift, a mask and an OR per code vector).
//   8-bit codes  q - 128 = c as signed bytes, and <q, x> = <|c|, sign(x, c)> + 128 sum(x):
//                one VPMADDUBSW on |c| <= 128 with c's sign moved onto the activation (pair
//                sums <= 2 * 128 * 127 = 32512, no saturation), VPMADDWD to int32 per chunk;
//                sum(x), the group's int8 code sum, comes from the quantization. With two or
//                more activation rows a tile instead widens the codes q to 16 bits once (rows
//                0-3 and 4-7 of the half) and takes each row's codes as int16: one VPMADDWD
//                per 16 products, lanes (row, input pair) summed over the group, then paired
//                by VPHADDD. As many instructions per product, but no sign moves, and the
//                widening is shared by the tile's rows: the 8-bit output matrices at 32 rows
//                ran 1.12-1.16x (Zen 4, one core, benchmarks/gemm_rate.py).
// All are exact, so the results equal the AVX-512 variant's integer dot products.
//
// Built for a CPU with AVX-VNNI (the avxvnni variant: Intel's cores since Alder Lake, Zen 5),
// every width takes one VPDPBUSD per 32 products instead, the AVX-512 variant's dot products
// on 256 bits; its outputs then equal that variant's bit for bit, Q8_0's too.

#include <cstring>

#include "loom_kernels_simd.h"

namespace loom {

struct Isa : Vec256 {
  // The codes of rows 8h .. 8h+7 of block wp as bytes, code[j] pairing with input dword j: 4-bit,
  // the low, then high nibbles of chunk j / 2; 5-bit, those with the fifth bits of the plane
  // added (fifth_bit); 8-bit (Q5_0's in bytes too), chunk j's bytes.
  template <int BITS>
  LOOM_INLINE static void load_codes(const uint8_t* wp, int h, I* code) {
    if constexpr (BITS == 4 || BITS == 5) {
      const I low = _mm256_set1_epi8(0x0F);
      for (int c = 0; c < 4; ++c) {
        const I v = _mm256_loadu_si256((const I*)(wp + c * 64 + h * 32));
        code[2 * c] = _mm256_and_si256(v, low);
        code[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      if constexpr (BITS == 5) {
        const I plane = _mm256_loadu_si256((const I*)(wp + 256 + h * 32));
        for (int c = 0; c < 8; ++c) code[c] = _mm256_or_si256(code[c], fifth_bit(plane, c));
      }
    } else {
      for (int c = 0; c < 8; ++c) code[c] = _mm256_loadu_si256((const I*)(wp + c * 64 + h * 32));
    }
  }

#if defined(__AVXVNNI__)
  // With AVX-VNNI (the avxvnni build): VPDPBUSD on 256 bits, u8 codes x s8 activations -> s32,
  // as the AVX-512 variant does on 512: every zero point takes the integer path, no code is
  // widened, and the outputs equal the AVX-512 variant's bit for bit.
  template <int BITS, int ZL>
  static constexpr bool zero_path() { return true; }

  template <int BITS, int MT, int Z>
  static constexpr bool wide_codes() { return false; }

  template <int BITS, int MT, int Z>
  LOOM_INLINE static void dots(const uint8_t* wp, int h, const int32_t* xp, const int16_t*, const int32_t* xs, I* dot) {
    I code[8];
    load_codes<BITS>(wp, h, code);
    vnni_rows<Isa, MT, Z>(code, xp, xs, dot);
  }
#else
  // Whether a matrix of this code width and zero point takes the integer zero-point path. Full
  // 8-bit codes keep the affine one: with the zero point, a one-stream decode step ran 2-7%
  // slower on Zen 4 (the GEMM alone at M = 1, benchmarks/gemm_rate.py: 12-18%), where 8 and 32
  // rows gained 2-8%. 5-bit codes (zero point 16) take it: their dot products need no sign moves.
  template <int BITS, int ZL>
  static constexpr bool zero_path() { return BITS == 4 || ZL == 16; }   // 5-bit codes: ZL is 16

  // whether dots takes the activation codes widened to int16 (QuantActs::xw)
  template <int BITS, int MT, int Z>
  static constexpr bool wide_codes() { return BITS == 8 && Z == 0 && MT >= 2; }

  // dot[i] = <codes of rows 8h .. 8h+7 of block wp - Z, activation row i> over one 32-group, one
  // int32 per row (row i's 32 codes at xp + 8 i; their sum xs[i], with Z: -Z times it)
  template <int BITS, int MT, int Z>
  LOOM_INLINE static void dots(const uint8_t* wp, int h, const int32_t* xp, const int16_t* xw, const int32_t* xs,
                               I* dot) {
    const I ones = _mm256_set1_epi16(1);
    if constexpr (BITS == 4 || Z == 16) {
      I code[8];
      load_codes<BITS>(wp, h, code);
      for (int i = 0; i < MT; ++i) {
        I s0 = _mm256_maddubs_epi16(code[0], _mm256_set1_epi32(xp[8 * i]));
        I s1 = _mm256_maddubs_epi16(code[1], _mm256_set1_epi32(xp[8 * i + 1]));
        for (int c = 2; c < 8; c += 2) {
          s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(code[c], _mm256_set1_epi32(xp[8 * i + c])));
          s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(code[c + 1], _mm256_set1_epi32(xp[8 * i + c + 1])));
        }
        // 4-bit: s0 + s1 still fits int16; 5-bit: each of them only
        dot[i] = BITS == 4 ? _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones)
                           : _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
        if constexpr (Z != 0) dot[i] = _mm256_add_epi32(dot[i], _mm256_set1_epi32(xs[i]));   // -Z sum(xq)
      }
    } else if constexpr (wide_codes<BITS, MT, Z>()) {
      // chunk c: rows 0-3 and 4-7 of the half, 4 inputs each, as 16 u16 lanes apiece; row i's
      // 4 int16 codes of the chunk at xw + 32 i + 4 c, broadcast to both 128-bit lanes
      I lo[MT], hi[MT];
      for (int i = 0; i < MT; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const uint8_t* p = wp + c * 64 + h * 32;
        const I a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
        const I b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(p + 16)));
        for (int i = 0; i < MT; ++i) {
          int64_t x4;
          std::memcpy(&x4, xw + 32 * i + 4 * c, sizeof x4);
          const I xv = _mm256_set1_epi64x(x4);
          lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(a, xv));
          hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(b, xv));
          // chunk by chunk: left free, GCC computed all 64 products first and spilled them
          // (0.85x this path's rate at 32 rows)
          __asm__("" : "+x"(lo[i]), "+x"(hi[i]));
        }
      }
      // lanes [r0 r0 r1 r1 | r2 r2 r3 r3] and rows 4-7 likewise: VPHADDD gives [r0 r1 r4 r5 | r2 r3 r6 r7]
      for (int i = 0; i < MT; ++i) dot[i] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo[i], hi[i]), 0xD8);
    } else {
      static_assert(Z == 0, "full 8-bit codes take the affine path here (zero_path)");
      const I flip = _mm256_set1_epi8((char)0x80);
      for (int i = 0; i < MT; ++i) dot[i] = _mm256_set1_epi32(128 * xs[i]);
      for (int c = 0; c < 8; ++c) {
        const I q = _mm256_xor_si256(_mm256_loadu_si256((const I*)(wp + c * 64 + h * 32)), flip);   // q - 128
        const I aq = _mm256_abs_epi8(q);   // -128 -> 0x80, read as unsigned 128
        for (int i = 0; i < MT; ++i) {
          const I sx = _mm256_sign_epi8(_mm256_set1_epi32(xp[8 * i + c]), q);
          dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), ones));
        }
      }
    }
  }
#endif
};

}  // namespace loom

#include "loom_kernels_host.h"   // qgemm, rope_store, attn_decode, add_rmsnorm and the module table
