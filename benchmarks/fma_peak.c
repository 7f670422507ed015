/* This CPU's peak fp32 multiply-add rate with AVX2 (8 lanes, an FMA = 2 flops), one and two threads: the roof
 * the matmul rates in docs/performance.md are read against.
 *
 *     gcc -O3 -funroll-all-loops -fopenmp benchmarks/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 *
 * Ten independent accumulators per thread cover the FMA latency (4-5 cycles) at its throughput. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#define CHAINS 10

__attribute__((target("avx2,fma"))) static float run(long iterations) {
    __m256 acc[CHAINS];
    const __m256 b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_set1_ps((float)i);
    for (long n = 0; n < iterations; n++)
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_fmadd_ps(acc[i], b, c);
    float sum = 0.0f; /* a result the compiler must compute */
    for (int i = 0; i < CHAINS; i++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[i]);
        sum += lanes[0];
    }
    return sum;
}

int main(void) {
    const long iterations = 200000000;
    for (int threads = 1; threads <= 2; threads++) {
        const double start = omp_get_wtime();
        double sum = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : sum)
        sum += run(iterations);
        const double seconds = omp_get_wtime() - start;
        printf("%d thread(s): %.1f GFLOP/s (checksum %g)\n", threads,
               threads * (double)iterations * CHAINS * 16 / seconds / 1e9, sum);
    }
    return 0;
}
