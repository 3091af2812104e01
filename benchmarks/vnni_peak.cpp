// The CPU's peak rate of 512-bit VPDPBUSD (u8 x s8 -> s32 dot products, what loom's AVX-512
// GEMM tiles issue) and of 512-bit FMA, one core: twelve independent accumulator chains.
//
//   g++ -O3 -march=native -o /tmp/vnni_peak benchmarks/vnni_peak.cpp && /tmp/vnni_peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  constexpr long kIters = 50000000;
  __m512i a[12], b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(5);
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
    __asm__ volatile("" : "+v"(b));
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512i r = a[0];
  for (int i = 1; i < 12; ++i) r = _mm512_add_epi32(r, a[i]);
  std::printf("VPDPBUSD zmm: %.2f G/s = %.0f G multiply-adds/s (sink %d)\n", kIters * 12 / s / 1e9,
              kIters * 12 * 64 / s / 1e9, _mm512_reduce_add_epi32(r));
  __m512 f[12], x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  for (int i = 0; i < 12; ++i) f[i] = _mm512_set1_ps(i);
  t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) f[i] = _mm512_fmadd_ps(f[i], x, y);
    __asm__ volatile("" : "+v"(x));
  }
  s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512 q = f[0];
  for (int i = 1; i < 12; ++i) q = _mm512_add_ps(q, f[i]);
  std::printf("FMA zmm: %.2f G/s (sink %g)\n", kIters * 12 / s / 1e9, _mm512_reduce_add_ps(q));
}
