// The machine's streaming read bandwidth, the wall a one-stream decode step runs into: two
// OpenMP threads (by default) each read half of a 512 MB buffer with 256-bit loads, the
// hardware prefetchers alone, or with software prefetches `distance` lines ahead (NTA, as
// loom's few-row GEMMs issue them). Best of 6 passes.
//
//   g++ -O3 -mavx2 -fopenmp -o /tmp/stream_read benchmarks/stream_read.cpp
//   OMP_NUM_THREADS=2 /tmp/stream_read [distance]
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  const size_t n = (size_t)512 << 20;
  const int distance = argc > 1 ? atoi(argv[1]) : 0;
  uint8_t* a = (uint8_t*)aligned_alloc(64, n);
  memset(a, 1, n);
  double best = 0;
  long long sink = 0;
  for (int rep = 0; rep < 6; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : sink)
    {
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
      const size_t lo = n / T * t, hi = n / T * (t + 1);
      __m256i s = _mm256_setzero_si256();
      for (size_t i = lo; i < hi; i += 128) {
        if (distance) {
          _mm_prefetch((const char*)a + i + distance * 64, _MM_HINT_NTA);
          _mm_prefetch((const char*)a + i + distance * 64 + 64, _MM_HINT_NTA);
        }
        for (int j = 0; j < 128; j += 32) s = _mm256_add_epi8(s, _mm256_load_si256((const __m256i*)(a + i + j)));
      }
      sink += _mm256_extract_epi8(s, 0);
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (n / dt / 1e9 > best) best = n / dt / 1e9;
  }
  printf("%d threads, prefetch distance %d lines: %.1f GB/s (%lld)\n", omp_get_max_threads(), distance, best, sink);
  free(a);
}
