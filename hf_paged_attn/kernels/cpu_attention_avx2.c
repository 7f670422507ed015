/* AVX2 (with FMA) inner kernels of cpu_attention.c, for x86-64 CPUs without AVX-512 (AMD Zen 1-3, older
 * Intel). Included there after cpu_attention_avx512.c, inside its HAVE_X86_KERNELS (cpu_isa() picks them).
 *
 * fp32 arithmetic, as the AVX512 set: bf16 pages are converted to fp32 once per chunk. What they do that the
 * portable loops (which the compiler vectorises for AVX2 too) do not: scores of 8 keys reduced together
 * (one horizontal-add tree per 8 keys instead of one per key), and the values' accumulators held in
 * registers across the whole chunk instead of loaded and stored once per key. A head dim that is not a
 * multiple of 8 reads its last dims through masked loads (a page row is never read past its end).
 */
#define T256 __attribute__((target("avx2,fma")))

/* Lane j: -1 (load) for j < left. */
static inline T256 __m256i mask8(int64_t left) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int32_t n = left >= 8 ? 8 : left <= 0 ? 0 : (int32_t)left;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes);
}

/* The 8 lanes' sums of a[0..8): lane j = sum of a[j]'s lanes. */
static inline T256 __m256 reduce8(const __m256 *a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123: [k0..k3 over dims 0-3 of each lane half | the same over dims 4-7]; likewise s4567 */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* few: s[i][t] = qf[i] . krow[t], 8 keys at a time (krow is padded with ZERO_ROW up to KC). */
T256 static void scores_few_avx2(Rows *r, int64_t n) {
    const int64_t d = r->d, dp = r->dp, full = d / 8;
    const __m256i tail = mask8(d - 8 * full);
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const float *k[8];
        for (int j = 0; j < 8; j++) k[j] = r->krow[t0 + j];
        for (int64_t i = 0; i < r->m; i++) {
            const float *q = r->qf + i * dp; /* zero-padded to dp: the tail's q lanes past d are 0 */
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t x = 0; x < full; x++) {
                const __m256 qv = _mm256_loadu_ps(q + 8 * x);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + 8 * x), acc[j]);
            }
            if (full * 8 < d) {
                const __m256 qv = _mm256_loadu_ps(q + 8 * full);
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k[j] + 8 * full, tail), acc[j]);
            }
            _mm256_storeu_ps(r->s + i * KC + t0, reduce8(acc));
        }
    }
}

/* many: s[t][i] = qt[:, i] . krow[t] for 16 rows [s0, s0 + 16) (two vectors) and 4 keys at a time. */
T256 static void scores_many_avx2(Rows *r, int64_t n) {
    const int64_t d = r->d, mp = r->mp;
    for (int64_t s0 = 0; s0 < mp; s0 += 16)
        for (int64_t t0 = 0; t0 < n; t0 += 4) {
            const float *k[4];
            for (int j = 0; j < 4; j++) k[j] = r->krow[t0 + j];
            __m256 a0[4], a1[4];
            for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm256_setzero_ps();
            for (int64_t x = 0; x < d; x++) {
                const __m256 q0 = _mm256_loadu_ps(r->qt + x * mp + s0), q1 = _mm256_loadu_ps(r->qt + x * mp + s0 + 8);
                for (int j = 0; j < 4; j++) {
                    const __m256 kv = _mm256_broadcast_ss(k[j] + x);
                    a0[j] = _mm256_fmadd_ps(q0, kv, a0[j]);
                    a1[j] = _mm256_fmadd_ps(q1, kv, a1[j]);
                }
            }
            for (int j = 0; j < 4; j++) {
                _mm256_storeu_ps(r->s + (t0 + j) * mp + s0, a0[j]);
                _mm256_storeu_ps(r->s + (t0 + j) * mp + s0 + 8, a1[j]);
            }
        }
}

/* acc rows [i0, i0 + mr) x dims [x0, x0 + 16) += sum_t p(i, t) v_t: 2 x mr accumulators in registers. */
static inline __attribute__((always_inline)) T256 void values_block_avx2(Rows *r, int64_t n, int64_t rs, int64_t ts,
                                                                        int64_t i0, const int mr, int64_t x0) {
    const int64_t d = r->d, dp = r->dp;
    const __m256i m0 = mask8(d - x0), m1 = mask8(d - x0 - 8);
    const int whole = d - x0 >= 16; /* no masked loads (the usual case: d a multiple of 16) */
    __m256 a0[4], a1[4];
    for (int i = 0; i < mr; i++) {
        a0[i] = _mm256_loadu_ps(r->acc + (i0 + i) * dp + x0);
        a1[i] = _mm256_loadu_ps(r->acc + (i0 + i) * dp + x0 + 8);
    }
    for (int64_t t = 0; t < n; t++) {
        const float *v = r->vrow[t] + x0;
        const __m256 v0 = whole ? _mm256_loadu_ps(v) : _mm256_maskload_ps(v, m0);
        const __m256 v1 = whole ? _mm256_loadu_ps(v + 8) : _mm256_maskload_ps(v + 8, m1);
        for (int i = 0; i < mr; i++) {
            const __m256 p = _mm256_broadcast_ss(r->s + (i0 + i) * rs + t * ts);
            a0[i] = _mm256_fmadd_ps(p, v0, a0[i]);
            a1[i] = _mm256_fmadd_ps(p, v1, a1[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(r->acc + (i0 + i) * dp + x0, a0[i]);
        _mm256_storeu_ps(r->acc + (i0 + i) * dp + x0 + 8, a1[i]);
    }
}

T256 static void values_avx2(Rows *r, int64_t n, int64_t rs, int64_t ts) {
    for (int64_t i0 = 0; i0 < r->m; i0 += 4) {
        const int64_t mr = r->m - i0 < 4 ? r->m - i0 : 4;
        for (int64_t x0 = 0; x0 < r->d; x0 += 16) { /* acc is dp (d rounded up to 32) wide */
            switch (mr) {
            case 1: values_block_avx2(r, n, rs, ts, i0, 1, x0); break;
            case 2: values_block_avx2(r, n, rs, ts, i0, 2, x0); break;
            case 3: values_block_avx2(r, n, rs, ts, i0, 3, x0); break;
            default: values_block_avx2(r, n, rs, ts, i0, 4, x0); break;
            }
        }
    }
}

/* kb (vb) -> kf (vf): bf16 is the high half of an fp32. */
T256 static void convert_chunk_avx2(Rows *r, int64_t n, int32_t values_too) {
    const int64_t d = r->d, dp = r->dp, full = d / 8 * 8;
    for (int64_t t = 0; t < n; t++) {
        float *kf = r->kf + t * dp, *vf = r->vf + t * dp;
        const uint16_t *k = r->kb[t], *v = r->vb[t];
        for (int64_t x = 0; x < full; x += 8) {
            const __m128i kx = _mm_loadu_si128((const __m128i *)(k + x));
            _mm256_storeu_ps(kf + x, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(kx), 16)));
            if (values_too) {
                const __m128i vx = _mm_loadu_si128((const __m128i *)(v + x));
                _mm256_storeu_ps(vf + x, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(vx), 16)));
            }
        }
        for (int64_t x = full; x < d; x++) {
            kf[x] = bf16_to_f32(k[x]);
            if (values_too) vf[x] = bf16_to_f32(v[x]);
        }
        r->krow[t] = kf;
        if (values_too) r->vrow[t] = vf;
    }
}

static const Kernels AVX2 = {scores_few_avx2, scores_many_avx2, values_avx2, NULL, NULL, NULL,
                             NULL, NULL, convert_chunk_avx2};
