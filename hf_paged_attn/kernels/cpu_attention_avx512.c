/* AVX-512 and AVX-512 BF16 inner kernels of cpu_attention.c (included there; not a translation unit of its own).
 *
 * Each function carries its own target attribute, so the library builds with any flags and these run only
 * where cpu_isa() found the instructions (and the OS saves the zmm state). A compiler too old for the
 * intrinsics (or HF_PAGED_ATTN_PORTABLE_ONLY) leaves only the portable kernels.
 *
 *   AVX512:     fp32 arithmetic; bf16 pages are converted to fp32 once per chunk of keys.
 *   AVX512BF16: bf16 pages read as they are: q.k and p.v are bf16 pair dot products (vdpbf16ps) accumulated
 *               in fp32. q, k and v are bf16 already, so q.k is exact up to fp32 accumulation; the
 *               probabilities are rounded to bf16 for p.v (relative 2^-9 each), which keeps the output
 *               within a bf16 step of its largest value.
 */
#if defined(__x86_64__) && !defined(HF_PAGED_ATTN_PORTABLE_ONLY) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define HAVE_X86_KERNELS 1
#include <cpuid.h>
#include <immintrin.h>

#define T512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")))
#define T512BF __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

typedef uint32_t u32_unaligned __attribute__((aligned(2), may_alias));

/* ISA_* of this CPU: AVX2 with FMA and OS support for the ymm state; AVX-512 F/BW/VL/DQ with the zmm state too;
 * and AVX512_BF16. */
static int cpu_isa(void) {
    static int known = -1;
    if (known >= 0) return known;
    unsigned a, b, c, d;
    int isa = ISA_PORTABLE;
    if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27)) && (c & (1u << 12))) { /* OSXSAVE, FMA */
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        const unsigned need = (1u << 5) | (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31); /* AVX2 F DQ BW VL */
        if ((lo & 0x6) == 0x6 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 5))) { /* ymm, AVX2 */
            isa = ISA_AVX2;
            if ((lo & 0xe6) == 0xe6 && (b & need) == need) {
                isa = ISA_AVX512;
                if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5))) isa = ISA_AVX512BF16;
            }
        }
    }
    known = isa;
    return isa;
}

/* Lane j of the result is the sum of a[PERM16[j]]'s lanes (PERM16 is its own inverse): callers put key j's
 * partial sums in a[PERM16[j]] to read the 16 scores in order. */
static const int PERM16[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

static inline T512 __m512 reduce16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44), _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

static inline __mmask16 mask16(int64_t left) { return left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1); }
static inline __mmask32 mask32(int64_t left) {
    return left >= 32 ? 0xffffffffu : left <= 0 ? 0 : (__mmask32)((1u << left) - 1);
}

/* ---------------------------------------------------------------------------------------- fp32 (AVX512) */

T512 static void scores_few_avx512(Rows *r, int64_t n) {
    const int64_t d = r->d, dp = r->dp, nd = (d + 15) / 16;
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const float *k[16];
        for (int j = 0; j < 16; j++) k[j] = r->krow[t0 + PERM16[j]];
        for (int64_t i = 0; i < r->m; i++) {
            const float *q = r->qf + i * dp;
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t x = 0; x < nd; x++) {
                const __mmask16 mk = mask16(d - 16 * x);
                const __m512 qv = _mm512_loadu_ps(q + 16 * x);
                for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(mk, k[j] + 16 * x), acc[j]);
            }
            _mm512_storeu_ps(r->s + i * KC + t0, reduce16(acc));
        }
    }
}

static inline __attribute__((always_inline)) T512 void scores_many_strip(Rows *r, int64_t n, int64_t s0, const int two) {
    const int64_t d = r->d, mp = r->mp;
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const float *k[8];
        for (int j = 0; j < 8; j++) k[j] = r->krow[t0 + j];
        __m512 a0[8], a1[8];
        for (int j = 0; j < 8; j++) a0[j] = a1[j] = _mm512_setzero_ps();
        for (int64_t x = 0; x < d; x++) {
            const __m512 q0 = _mm512_loadu_ps(r->qt + x * mp + s0);
            const __m512 q1 = two ? _mm512_loadu_ps(r->qt + x * mp + s0 + 16) : q0;
            for (int j = 0; j < 8; j++) {
                const __m512 kv = _mm512_set1_ps(k[j][x]);
                a0[j] = _mm512_fmadd_ps(q0, kv, a0[j]);
                if (two) a1[j] = _mm512_fmadd_ps(q1, kv, a1[j]);
            }
        }
        for (int j = 0; j < 8; j++) {
            _mm512_storeu_ps(r->s + (t0 + j) * mp + s0, a0[j]);
            if (two) _mm512_storeu_ps(r->s + (t0 + j) * mp + s0 + 16, a1[j]);
        }
    }
}

T512 static void scores_many_avx512(Rows *r, int64_t n) {
    int64_t s0 = 0;
    for (; s0 + 32 <= r->mp; s0 += 32) scores_many_strip(r, n, s0, 1);
    if (s0 < r->mp) scores_many_strip(r, n, s0, 0);
}

/* acc rows [i0, i0 + MR) x dims [x0, x0 + 16 ND) += sum_t p v_t, fp32 values from vrow. */
static inline __attribute__((always_inline)) T512 void values_block(Rows *r, int64_t n, int64_t rs, int64_t ts,
                                                                   int64_t i0, const int mr, int64_t x0, const int nd) {
    const int64_t d = r->d, dp = r->dp;
    __m512 a[4][4];
    __mmask16 mk[4];
    for (int c = 0; c < nd; c++) mk[c] = mask16(d - x0 - 16 * c);
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < nd; c++) a[i][c] = _mm512_loadu_ps(r->acc + (i0 + i) * dp + x0 + 16 * c);
    for (int64_t t = 0; t < n; t++) {
        __m512 v[4];
        for (int c = 0; c < nd; c++) v[c] = _mm512_maskz_loadu_ps(mk[c], r->vrow[t] + x0 + 16 * c);
        for (int i = 0; i < mr; i++) {
            const __m512 p = _mm512_set1_ps(r->s[(i0 + i) * rs + t * ts]);
            for (int c = 0; c < nd; c++) a[i][c] = _mm512_fmadd_ps(p, v[c], a[i][c]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < nd; c++) _mm512_storeu_ps(r->acc + (i0 + i) * dp + x0 + 16 * c, a[i][c]);
}

#define ROW_BLOCKS(BLOCK, ...)                                                \
    for (int64_t i0 = 0; i0 < r->m; i0 += 4) {                                \
        const int64_t mr = r->m - i0 < 4 ? r->m - i0 : 4;                     \
        for (int64_t x0 = 0; x0 < r->dp; x0 += 64) {                          \
            const int nd4 = r->dp - x0 >= 64;                                 \
            switch (mr * 2 + nd4) {                                           \
            case 2: BLOCK(__VA_ARGS__, i0, 1, x0, 2); break;                  \
            case 3: BLOCK(__VA_ARGS__, i0, 1, x0, 4); break;                  \
            case 4: BLOCK(__VA_ARGS__, i0, 2, x0, 2); break;                  \
            case 5: BLOCK(__VA_ARGS__, i0, 2, x0, 4); break;                  \
            case 6: BLOCK(__VA_ARGS__, i0, 3, x0, 2); break;                  \
            case 7: BLOCK(__VA_ARGS__, i0, 3, x0, 4); break;                  \
            case 8: BLOCK(__VA_ARGS__, i0, 4, x0, 2); break;                  \
            default: BLOCK(__VA_ARGS__, i0, 4, x0, 4); break;                 \
            }                                                                 \
        }                                                                     \
    }

T512 static void values_avx512(Rows *r, int64_t n, int64_t rs, int64_t ts) { ROW_BLOCKS(values_block, r, n, rs, ts) }

T512 static void convert_chunk_avx512(Rows *r, int64_t n, int32_t values_too) {
    const int64_t d = r->d, dp = r->dp;
    for (int64_t t = 0; t < n; t++) {
        for (int64_t x = 0; x < dp; x += 16) {
            const __mmask16 mk = mask16(d - x);
            const __m256i k = _mm256_maskz_loadu_epi16(mk, r->kb[t] + x);
            _mm512_storeu_ps(r->kf + t * dp + x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(k), 16)));
            if (values_too) {
                const __m256i v = _mm256_maskz_loadu_epi16(mk, r->vb[t] + x);
                _mm512_storeu_ps(r->vf + t * dp + x,
                                 _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
            }
        }
        r->krow[t] = r->kf + t * dp;
        if (values_too) r->vrow[t] = r->vf + t * dp;
    }
}

static const Kernels AVX512 = {scores_few_avx512, scores_many_avx512, values_avx512, NULL, NULL, NULL,
                               NULL, NULL, convert_chunk_avx512};

/* --------------------------------------------------------------------------------- bf16 pairs (AVX512BF16) */

T512BF static void scores_few_bf16(Rows *r, int64_t n) {
    const int64_t d = r->d, dp = r->dp, nd = (d + 31) / 32;
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const uint16_t *k[16];
        for (int j = 0; j < 16; j++) k[j] = r->kb[t0 + PERM16[j]];
        for (int64_t i = 0; i < r->m; i++) {
            const uint16_t *q = r->qb + i * dp;
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t x = 0; x < nd; x++) {
                const __mmask32 mk = mask32(d - 32 * x);
                const __m512i qv = _mm512_loadu_si512(q + 32 * x);
                for (int j = 0; j < 16; j++)
                    acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qv, (__m512bh)_mm512_maskz_loadu_epi16(mk, k[j] + 32 * x));
            }
            _mm512_storeu_ps(r->s + i * KC + t0, reduce16(acc));
        }
    }
}

static inline __attribute__((always_inline)) T512BF void scores_many_strip_bf16(Rows *r, int64_t n, int64_t s0,
                                                                               const int two) {
    const int64_t half = r->d / 2, mp = r->mp;
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const u32_unaligned *k[8];
        for (int j = 0; j < 8; j++) k[j] = (const u32_unaligned *)r->kb[t0 + j];
        __m512 a0[8], a1[8];
        for (int j = 0; j < 8; j++) a0[j] = a1[j] = _mm512_setzero_ps();
        for (int64_t x = 0; x < half; x++) {
            const __m512i q0 = _mm512_loadu_si512(r->qtp + x * mp + s0);
            const __m512i q1 = two ? _mm512_loadu_si512(r->qtp + x * mp + s0 + 16) : q0;
            for (int j = 0; j < 8; j++) {
                const __m512i kv = _mm512_set1_epi32((int)k[j][x]);
                a0[j] = _mm512_dpbf16_ps(a0[j], (__m512bh)q0, (__m512bh)kv);
                if (two) a1[j] = _mm512_dpbf16_ps(a1[j], (__m512bh)q1, (__m512bh)kv);
            }
        }
        for (int j = 0; j < 8; j++) {
            _mm512_storeu_ps(r->s + (t0 + j) * mp + s0, a0[j]);
            if (two) _mm512_storeu_ps(r->s + (t0 + j) * mp + s0 + 16, a1[j]);
        }
    }
}

T512BF static void scores_many_bf16(Rows *r, int64_t n) {
    int64_t s0 = 0;
    for (; s0 + 32 <= r->mp; s0 += 32) scores_many_strip_bf16(r, n, s0, 1);
    if (s0 < r->mp) scores_many_strip_bf16(r, n, s0, 0);
}

static const short PAIR_LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const short PAIR_HI[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
static const short INTERLEAVE[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* vp[t / 2][x] = (v_t[x], v_t+1[x]) for t even; a missing t + 1 reads ZERO_ROW (vb is padded). */
T512BF static void pack_values_bf16(Rows *r, int64_t n) {
    const int64_t d = r->d, dp = r->dp;
    const __m512i lo = _mm512_loadu_si512(PAIR_LO), hi = _mm512_loadu_si512(PAIR_HI);
    for (int64_t tp = 0; 2 * tp < n; tp++) {
        const uint16_t *va = r->vb[2 * tp], *vb = r->vb[2 * tp + 1];
        for (int64_t x = 0; x < dp; x += 32) {
            const __mmask32 mk = mask32(d - x);
            const __m512i a = _mm512_maskz_loadu_epi16(mk, va + x), b = _mm512_maskz_loadu_epi16(mk, vb + x);
            _mm512_storeu_si512(r->vp + tp * dp + x, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(r->vp + tp * dp + x + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/* pp = the probabilities as bf16 pairs (p_t, p_t+1): few rows [M][KC/2], many rows [KC/2][Mp]. */
T512BF static void pack_probs_bf16(Rows *r, int64_t n) {
    if (!r->many) {
        for (int64_t i = 0; i < r->m; i++) {
            const float *s = r->s + i * KC;
            const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 16), _mm512_loadu_ps(s));
            _mm512_storeu_si512(r->pp + i * (KC / 2), (__m512i)x);
        }
        return;
    }
    const __m512i il = _mm512_loadu_si512(INTERLEAVE);
    const int64_t mp = r->mp;
    for (int64_t tp = 0; 2 * tp < n; tp++)
        for (int64_t s0 = 0; s0 < mp; s0 += 16) {
            const __m512 a = _mm512_loadu_ps(r->s + 2 * tp * mp + s0), b = _mm512_loadu_ps(r->s + (2 * tp + 1) * mp + s0);
            const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* [a0..a15, b0..b15] */
            _mm512_storeu_si512(r->pp + tp * mp + s0, _mm512_permutexvar_epi16(il, x));
        }
}

static inline __attribute__((always_inline)) T512BF void values_block_bf16(Rows *r, int64_t n, int64_t rs, int64_t ts,
                                                                          int64_t i0, const int mr, int64_t x0,
                                                                          const int nd) {
    const int64_t dp = r->dp;
    __m512 a[4][4];
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < nd; c++) a[i][c] = _mm512_loadu_ps(r->acc + (i0 + i) * dp + x0 + 16 * c);
    for (int64_t tp = 0; 2 * tp < n; tp++) {
        __m512i v[4];
        for (int c = 0; c < nd; c++) v[c] = _mm512_loadu_si512(r->vp + tp * dp + x0 + 16 * c);
        for (int i = 0; i < mr; i++) {
            const __m512i p = _mm512_set1_epi32((int)r->pp[(i0 + i) * rs + tp * ts]);
            for (int c = 0; c < nd; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], (__m512bh)p, (__m512bh)v[c]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < nd; c++) _mm512_storeu_ps(r->acc + (i0 + i) * dp + x0 + 16 * c, a[i][c]);
}

T512BF static void values_bf16(Rows *r, int64_t n, int64_t rs, int64_t ts) { ROW_BLOCKS(values_block_bf16, r, n, rs, ts) }

static const Kernels AVX512BF16 = {scores_few_avx512, scores_many_avx512, values_avx512,     scores_few_bf16,
                                   scores_many_bf16,  values_bf16,        pack_values_bf16, pack_probs_bf16,
                                   convert_chunk_avx512};

#endif
