// The CPU's peak rate of the 256-bit integer multiplies loom's AVX2 GEMM tiles issue (VPMADDUBSW:
// u8 x s8 -> s16 pair sums; VPMADDWD: s16 x s16 -> s32 pair sums) and of 256-bit FMA, one core:
// twelve independent chains of each instruction (the AVX2 counterpart of vnni_peak.cpp).
//
//   g++ -O3 -march=native -o /tmp/avx2_peak benchmarks/avx2_peak.cpp && /tmp/avx2_peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <class Op>
double rate(Op op) {
  constexpr long kIters = 20000000;
  __m256i a[12], c = _mm256_set1_epi8(5);
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_epi32(i);
  auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = op(a[i], c);
    __asm__ volatile("" : "+x"(c));
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m256i r = a[0];
  for (int i = 1; i < 12; ++i) r = _mm256_xor_si256(r, a[i]);
  volatile int sink = _mm256_extract_epi32(r, 0);
  (void)sink;
  return kIters * 12 / s / 1e9;
}

int main() {
  std::printf("VPMADDUBSW ymm: %.2f G/s\n", rate([](__m256i a, __m256i c) { return _mm256_maddubs_epi16(a, c); }));
  std::printf("VPMADDWD ymm:   %.2f G/s\n", rate([](__m256i a, __m256i c) { return _mm256_madd_epi16(a, c); }));
  std::printf("VFMADD ymm:     %.2f G/s\n", rate([](__m256i a, __m256i c) {
    const __m256 f = _mm256_castsi256_ps(a), g = _mm256_castsi256_ps(c);
    return _mm256_castps_si256(_mm256_fmadd_ps(f, g, g));
  }));
}
