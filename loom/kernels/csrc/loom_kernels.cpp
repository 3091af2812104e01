// loom's CPU kernels, AVX-512 + VNNI variant: quantized GEMM over GGUF-derived codes, RoPE
// with KV-cache store, and decode attention over the paged cache. The loops are shared with
// the AVX2 variant (loom_kernels_loops.h, over the vector traits of loom_kernels_simd.h);
// this file adds the integer dot products. Compiled at install time with -march=native;
// loom falls back to plain torch ops where this cannot be built.

#include "loom_kernels_simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>

#include <strings.h>

#include <cstdlib>
#define LOOM_AMX 1
#endif

namespace loom {

struct Isa : Vec512 {
#ifdef LOOM_AMX
  // AMX (built where the CPU has AMX-INT8): in a GEMM of AMX_ROWS rows or more, each tile of
  // AMX_ROWS activation rows over 8-bit codes (Q5_0's five bits and 4-bit codes widened to them)
  // takes each group's 16 x 16 dot products from one TDPBSUD (s8 activations x u8 codes -> s32)
  // instead of 128 VPDPBUSD, four groups in flight in tiles 0-3 (activations in 4-5, codes in
  // 6-7: a block's 8-bit codes are already the B tile's layout, 8 rows of 4 inputs x 16 outputs);
  // the activations are quantized in panels of AMX_ROWS rows so that a group's rows are one tile.
  // The sums are the same integers, scaled as before, so the outputs equal the VNNI tiles' bit
  // for bit. Each group's sums pass through memory to be scaled (a tile has no move to vector
  // registers), which bounds the gain. Tiles of 16 rows against the 8 of before (one TDPBSUD of
  // 16 rows takes about as long as one of 8 on a Xeon with AMX): 1.08-1.32x on Gemma 3's and SmolLM2's
  // matrices at 32 rows, 1.15-1.30x at 128; whole decode steps of 32 sequences 1.17x (Gemma 3) and
  // 1.09x (SmolLM2). Issuing the next groups' products before scaling the last ones' gained
  // nothing. 4-bit codes are widened to bytes a block column at a time first (gemm_widened),
  // from AMX_ROWS4 rows on. Off with LOOM_AMX=0, or where the kernel does not grant the tile
  // state (arch_prctl).
  static constexpr bool kAmx = true;
  static constexpr int AMX_GROUPS = 4, AMX_ROWS = 16, AMX_ROWS4 = 32;

  // LDTILECFG's 64 bytes: palette 1; tiles 0-5 of 16 rows (64 bytes a row, 32 for the
  // activations in 4, 5), the codes' 6-7 of 8; the rest zero. A constant in memory: GCC's
  // _tile_loadconfig names only 8 bytes as read, so a configuration built on the stack loses the
  // stores it thinks unread (and the instruction faults on the garbage in their place).
  struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
  static constexpr TileConfig kTileConfig = {1, 0, {}, {64, 64, 64, 64, GROUP, GROUP, 64, 64}, {16, 16, 16, 16, 16, 16, 8, 8}};
  static inline thread_local bool tiles_on = false;

  static bool amx_allowed() {
    static const bool ok = [] {
      const char* e = std::getenv("LOOM_AMX");   // 0, false, off, no: off (as loom's other switches)
      if (e)
        for (const char* off : {"0", "false", "off", "no"})
          if (strcasecmp(e, off) == 0) return false;
      return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }();
    return ok;
  }

  // whether a GEMM of M rows runs AMX tiles (for codes of this width)
  static bool amx_rows(int64_t M, int bits) { return M >= (bits == 4 ? AMX_ROWS4 : AMX_ROWS) && amx_allowed(); }

  // a GEMM chunk of M rows: the tiles configured where M is AMX_ROWS or more (configured per
  // chunk: other code on this thread, oneDNN's, may configure them its own way)
  static void tiles_begin(int64_t M) {
    tiles_on = amx_rows(M, 8);
    if (!tiles_on) return;
    _tile_loadconfig(&kTileConfig);
  }

  static void tiles_end() {
    if (tiles_on) _tile_release();
    tiles_on = false;
  }

  // out[j][i][r] = <activation row i, codes of output row r> of groups j < n (n <= 4): group j's
  // codes at wp + j block, its AMX_ROWS activation rows of 32 bytes at xq + j xstep
  static void amx_dots(int n, const uint8_t* wp, int64_t block, const int8_t* xq, int64_t xstep,
                       int32_t (*out)[AMX_ROWS][16]) {
    if (n == 4) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      _tile_loadd(4, xq, GROUP);
      _tile_loadd(6, wp, 64);
      _tile_dpbsud(0, 4, 6);
      _tile_loadd(5, xq + xstep, GROUP);
      _tile_loadd(7, wp + block, 64);
      _tile_dpbsud(1, 5, 7);
      _tile_loadd(4, xq + 2 * xstep, GROUP);
      _tile_loadd(6, wp + 2 * block, 64);
      _tile_dpbsud(2, 4, 6);
      _tile_loadd(5, xq + 3 * xstep, GROUP);
      _tile_loadd(7, wp + 3 * block, 64);
      _tile_dpbsud(3, 5, 7);
      _tile_stored(0, out[0], 64);
      _tile_stored(1, out[1], 64);
      _tile_stored(2, out[2], 64);
      _tile_stored(3, out[3], 64);
      return;
    }
    for (int j = 0; j < n; ++j) {
      _tile_zero(0);
      _tile_loadd(4, xq + j * xstep, GROUP);
      _tile_loadd(6, wp + j * block, 64);
      _tile_dpbsud(0, 4, 6);
      _tile_stored(0, out[j], 64);
    }
  }

  // one activation row's 16 sums from amx_dots, with the zero point's term -Z sum(xq) (xs)
  template <int Z>
  LOOM_INLINE static I amx_row(const int32_t* p, int32_t xs) {
    const I v = _mm512_load_si512(p);
    return Z ? _mm512_add_epi32(v, _mm512_set1_epi32(xs)) : v;
  }
#endif

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
    vnni_rows<Isa, MT, Z>(code, xp, xs, dot);
  }
};

}  // namespace loom

#include "loom_kernels_host.h"   // qgemm, rope_store, attn_decode, add_rmsnorm and the module table
