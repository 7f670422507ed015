/* Paged attention on the CPU (decode, shared-prefix decode, prefill), reading K/V where they lie in the pages.
 *
 * Built by hf_paged_attn/kernels/cpu_native.py with the system C compiler and called through ctypes (no
 * Python or torch headers). One algorithm serves every entry point: a *row set* (the query heads of one KV
 * head for one query, or for a tile of queries of one prompt, or for every request of a shared-prefix group)
 * walks its visible keys in chunks of KC tokens straight from the pages, flash-attention style: scores,
 * scale, softcap, causal/window mask, an online fp32 softmax (running max and sum), then the
 * probability-weighted values into fp32 accumulators. Sinks join the denominator at the end.
 *
 * Two shapes of the inner kernels, chosen by the number of rows M:
 *   few rows (decode): S[M][KC], each score a dot product over D, 16 keys reduced at once;
 *   many rows (prefill tiles, shared prefixes): S^T[KC][Mp], the queries transposed once per row set so that
 *   a key's scores for 16 rows are one vector (no horizontal sums), Mp = M rounded up to 16.
 * Each shape has a portable version (plain loops that the compiler vectorises for the machine) and, on x86-64,
 * AVX2 versions (cpu_attention_avx2.c), AVX-512 versions (fp32 arithmetic; bf16 pages converted once per
 * chunk) and AVX-512 BF16 versions (q.k and p.v as bf16 pair dot products with fp32 accumulation: vdpbf16ps),
 * in cpu_attention_avx512.c. Which one runs is decided per call from the CPU (cpuid) and ``Args.isa``. The
 * online softmax between them is plain C for every set, vectorised by the compiler (cpu_native.FLAGS).
 *
 * Layouts (element strides where a tensor may be a view):
 *   q: decode [B, 1, H, D], prefill [total_q, H, D] (strides q_s0 per token, q_s1 per head, 1);
 *   out: the same shape (strides o_s0, o_s1, 1);
 *   k_cache, v_cache [num_blocks, block_size, H_kv, D] contiguous;
 *   k_new [B, H_kv, D] (strides new_sb, new_sh, 1), v_new likewise (strides new_v_sb, new_v_sh, 1), or both NULL
 *     (decode only): written at seqlens[b];
 *   seqlens int32 [B]: decode: tokens before k_new (with k_new NULL: tokens to attend to); prefill: keys;
 *   cu_q int32 [B + 1] (prefill) or NULL (decode: one query per request);
 *   table int32 [B, W] block ids (< 0 or >= num_blocks: no page, its keys are invisible); sinks fp32 [H] or NULL.
 * dtype: 0 float32, 1 bfloat16 (q, caches, new K/V and out share it; softmax and accumulation in fp32).
 * page_dtype: 0 the pages are in ``dtype``; 2 fp8 e4m3 (OCP "fn": no infinities), 3 fp8 e5m2: one byte per element,
 *   widened to fp32 a chunk at a time through a 256-entry table into the chunk buffers kf / vf (as bf16 pages are),
 *   never a gathered copy of the pages. fp8 pages are never appended to here (k_new must be NULL): the caller
 *   rounds the new K/V into them (kernels/kv_dtype.py). Their scales are folded in by the caller.
 */
#define _POSIX_C_SOURCE 200809L /* posix_memalign under -std=c11 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *q;
    void *out;
    void *k_cache;
    void *v_cache;
    const void *k_new;
    const void *v_new;
    const int32_t *seqlens;
    const int32_t *cu_q;
    const int32_t *table;
    const float *sinks;
    int64_t batch, heads, kv_heads, dim, block_size, width, num_blocks;
    int64_t q_s0, q_s1, o_s0, o_s1, new_sb, new_sh;
    int64_t window_left; /* keys older than a query's position - window_left are invisible; < 0: unbounded */
    float scale, softcap;
    int32_t dtype;
    int32_t num_threads;
    int32_t isa; /* 0: the best this CPU has; 1: portable; 2: AVX2; 3: AVX-512 (fp32 arithmetic); 4: AVX-512 BF16 */
    int32_t causal;  /* prefill: bottom-right causal mask (decode is always causal) */
    int32_t cascade; /* decode: group requests that share leading blocks and read those once per group */
    int32_t num_groups; /* out: shared-prefix groups the last decode call formed (for tests and benchmarks) */
    int64_t new_v_sb, new_v_sh; /* v_new's strides (a view of another tensor than k_new's, e.g. a fused projection) */
    int32_t page_dtype; /* 0: dtype; FP8_E4M3 / FP8_E5M2: one-byte pages */
} Args;

enum { F32 = 0, BF16 = 1, FP8_E4M3 = 2, FP8_E5M2 = 3 };
enum { ISA_BEST = 0, ISA_PORTABLE = 1, ISA_AVX2 = 2, ISA_AVX512 = 3, ISA_AVX512BF16 = 4 };

#define KC 32          /* keys per chunk */
#define DMAX 512       /* largest head dim */
#define ROWS_TILE 32   /* rows of a prefill / shared-prefix row set (queries x the heads of one KV head) */
#define MANY_ROWS 12   /* row sets of at least this many rows use the transposed ("many rows") kernels */
#define MAX_THREADS 64
#define CASCADE_MIN_TOKENS 32 /* shared tokens below which a group is not formed */

static const float ZERO_ROW[DMAX] __attribute__((aligned(64))); /* a padding key: reads as zeros */

/* ------------------------------------------------------------------------------------------- scalars */

/* Every fp8 byte as a float, [0] e4m3 and [1] e5m2, filled when the library loads. */
static float FP8_TO_F32[2][256];

__attribute__((constructor)) static void fp8_tables(void) {
    for (int x = 0; x < 256; x++) {
        const float sign = x & 0x80 ? -1.0f : 1.0f;
        const int e4 = (x >> 3) & 0xf, m3 = x & 7, e5 = (x >> 2) & 0x1f, m2 = x & 3;
        /* e4m3fn: bias 7, subnormals m/8 * 2^-6, S.1111.111 the only NaN (no infinities) */
        FP8_TO_F32[0][x] = e4 == 15 && m3 == 7 ? NAN
                           : e4 == 0           ? sign * ldexpf((float)m3, -9)
                                               : sign * ldexpf(1.0f + m3 / 8.0f, e4 - 7);
        /* e5m2: bias 15, subnormals m/4 * 2^-14, exponent 31 infinities and NaNs (IEEE-like) */
        FP8_TO_F32[1][x] = e5 == 31 ? (m2 ? NAN : sign * INFINITY)
                           : e5 == 0 ? sign * ldexpf((float)m2, -16)
                                     : sign * ldexpf(1.0f + m2 / 4.0f, e5 - 15);
    }
}

static inline size_t page_elem(const Args *a) {
    return a->page_dtype >= FP8_E4M3 ? 1 : a->dtype == F32 ? sizeof(float) : sizeof(uint16_t);
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);                                            /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

static inline float load(const void *p, int64_t i, int32_t dtype) {
    return dtype == F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void store(void *p, int64_t i, float f, int32_t dtype) {
    if (dtype == F32)
        ((float *)p)[i] = f;
    else
        ((uint16_t *)p)[i] = f32_to_bf16(f);
}

/* e^x for x <= 0 (scores minus their maximum), vectorisable: 2^(x log2 e) split into an integer power of two
 * and a degree-6 polynomial of the fraction in [-0.5, 0.5] (Cephes' exp2f coefficients, ~2e-7 relative
 * error). Below -87 (and for -inf) the result is 0. */
static inline float exp_nonpositive(float x) {
    float t = (x < -87.0f ? -87.0f : x) * 1.4426950408889634f;
    /* round to nearest with 1.5 * 2^23 (floorf would not vectorise without -fno-trapping-math) */
    float whole = (t + 12582912.0f) - 12582912.0f, f = t - whole;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union {
        int32_t i;
        float f;
    } power = {.i = ((int32_t)whole + 127) << 23}; /* a union, not memcpy: GCC vectorises this */
    return x < -87.0f ? 0.0f : p * power.f;
}

/* cap * tanh(x / cap) through e^(-2|x|/cap) (vectorisable; libm's tanhf is not). The absolute error of a
 * score is what the softmax feels, and it stays ~cap * 1e-7. */
static inline float soft_cap(float x, float cap) {
    float e = exp_nonpositive(-2.0f * fabsf(x) / cap);
    float t = (1.0f - e) / (1.0f + e);
    return copysignf(cap * t, x);
}

/* ------------------------------------------------------------------------------------------- row sets */

/* A row set's working memory (one per thread, reused across calls). Sizes for M rows, Mp = M rounded up to
 * 16, Dp = D rounded up to 32. */
typedef struct {
    int64_t m, mp, d, dp;
    int32_t many;       /* the transposed kernels */
    float *qf;          /* few: [M][Dp] fp32 queries (zero-padded) */
    uint16_t *qb;       /* few, bf16 pairs kernels: [M][Dp] bf16 queries */
    float *qt;          /* many: [Dp][Mp] fp32 queries transposed */
    uint32_t *qtp;      /* many, bf16 pairs kernels: [Dp / 2][Mp] pairs (q[2i], q[2i+1]) */
    float *s;           /* scores then probabilities: few [M][KC], many [KC][Mp] */
    uint32_t *pp;       /* bf16 pairs kernels: probabilities as (p_t, p_t+1) pairs: few [M][KC/2], many [KC/2][Mp] */
    float *kf, *vf;     /* [KC][Dp] a bf16 chunk converted to fp32 (fp32 kernels) */
    uint32_t *vp;       /* [KC/2][Dp] value pairs (v_t[d], v_t+1[d]) (bf16 pairs kernels) */
    float *acc;         /* [Mp][Dp] output accumulators */
    float *mx, *l;      /* [Mp] running max and sum of each row */
    float *top, *base, *total; /* [Mp] the many-rows softmax's per-row temporaries */
    int64_t *tok, *head, *qpos; /* [Mp] each row's query token, head and position */
    const float *krow[KC], *vrow[KC];     /* fp32 kernels: the chunk's key / value rows (pages or kf / vf) */
    const uint16_t *kb[KC], *vb[KC];      /* bf16 pages of the chunk's keys / values */
    uint8_t invisible[KC];                /* key without a page */
} Rows;

/* The inner kernels of one instruction set. */
typedef struct {
    /* few: s[r][t] = qf[r] . krow[t] for t < n (rounded up to 16: krow is padded with ZERO_ROW) */
    void (*scores_few)(Rows *r, int64_t n);
    /* many: s[t][r] = qt[:, r] . krow[t] */
    void (*scores_many)(Rows *r, int64_t n);
    /* acc[r] += sum_t p(r, t) vrow[t], p(r, t) = s[r * rs + t * ts] */
    void (*values)(Rows *r, int64_t n, int64_t rs, int64_t ts);
    /* bf16 pairs variants (NULL when this instruction set has none): from kb / qb / qtp, pp / vp */
    void (*scores_few_bf16)(Rows *r, int64_t n);
    void (*scores_many_bf16)(Rows *r, int64_t n);
    void (*values_bf16)(Rows *r, int64_t n, int64_t rs, int64_t ts);
    void (*pack_values_bf16)(Rows *r, int64_t n);                 /* vb -> vp */
    void (*pack_probs_bf16)(Rows *r, int64_t n);                  /* s -> pp */
    void (*convert_chunk)(Rows *r, int64_t n, int32_t values_too); /* kb (vb) -> kf (vf) */
} Kernels;

/* --------------------------------------------------------------------------------- portable kernels */

static void scores_few_portable(Rows *r, int64_t n) {
    const int64_t d = r->d, dp = r->dp;
    for (int64_t i = 0; i < r->m; i++)
        for (int64_t t = 0; t < n; t++) {
            const float *q = r->qf + i * dp, *k = r->krow[t];
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t x = 0; x < d; x++) s += q[x] * k[x];
            r->s[i * KC + t] = s;
        }
}

static void scores_many_portable(Rows *r, int64_t n) {
    const int64_t d = r->d, mp = r->mp;
    for (int64_t t = 0; t < n; t++) {
        float *s = r->s + t * mp;
        const float *k = r->krow[t];
        for (int64_t i = 0; i < mp; i++) s[i] = 0.0f;
        for (int64_t x = 0; x < d; x++) {
            const float kx = k[x], *q = r->qt + x * mp;
#pragma omp simd
            for (int64_t i = 0; i < mp; i++) s[i] += q[i] * kx;
        }
    }
}

static void values_portable(Rows *r, int64_t n, int64_t rs, int64_t ts) {
    const int64_t d = r->d, dp = r->dp;
    for (int64_t i = 0; i < r->m; i++) {
        float *o = r->acc + i * dp;
        for (int64_t t = 0; t < n; t++) {
            const float p = r->s[i * rs + t * ts], *v = r->vrow[t];
#pragma omp simd
            for (int64_t x = 0; x < d; x++) o[x] += p * v[x];
        }
    }
}

static void convert_chunk_portable(Rows *r, int64_t n, int32_t values_too) {
    const int64_t d = r->d, dp = r->dp;
    for (int64_t t = 0; t < n; t++) {
        float *kf = r->kf + t * dp;
        const uint16_t *k = r->kb[t];
#pragma omp simd
        for (int64_t x = 0; x < d; x++) kf[x] = bf16_to_f32(k[x]);
        r->krow[t] = kf;
        if (values_too) {
            float *vf = r->vf + t * dp;
            const uint16_t *v = r->vb[t];
#pragma omp simd
            for (int64_t x = 0; x < d; x++) vf[x] = bf16_to_f32(v[x]);
            r->vrow[t] = vf;
        }
    }
}

/* fp8 pages (kb / vb hold their byte pointers) -> kf / vf through ``table``; the loop compiles to table gathers. */
static void convert_chunk_fp8(Rows *r, int64_t n, const float *restrict table) {
    const int64_t d = r->d, dp = r->dp;
    for (int64_t t = 0; t < n; t++) {
        float *restrict kf = r->kf + t * dp, *restrict vf = r->vf + t * dp;
        const uint8_t *k = (const uint8_t *)r->kb[t], *v = (const uint8_t *)r->vb[t];
#pragma omp simd
        for (int64_t x = 0; x < d; x++) kf[x] = table[k[x]];
#pragma omp simd
        for (int64_t x = 0; x < d; x++) vf[x] = table[v[x]];
        r->krow[t] = kf;
        r->vrow[t] = vf;
    }
}

static const Kernels PORTABLE = {scores_few_portable, scores_many_portable, values_portable, NULL, NULL, NULL,
                                 NULL, NULL, convert_chunk_portable};

#include "cpu_attention_avx512.c" /* defines HAVE_X86_KERNELS, AVX512 and AVX512BF16 when the compiler can */
#ifdef HAVE_X86_KERNELS
#include "cpu_attention_avx2.c" /* AVX2 */
#endif

/* Whether a call takes the bf16 pairs kernels (they read pairs of dims: an even head dim). */
static inline int32_t use_pairs(const Args *a, const Kernels *kern) {
    return a->dtype == BF16 && a->page_dtype == 0 && kern->scores_few_bf16 != NULL && a->dim % 2 == 0;
}

/* The kernels a call runs: ``isa`` (Args.isa) clamped to what the CPU and the compiler have. */
static const Kernels *kernels_for(int32_t isa) {
#ifdef HAVE_X86_KERNELS
    int32_t best = cpu_isa();
    if (isa == ISA_BEST || isa > best) isa = best;
    if (isa == ISA_AVX512BF16) return &AVX512BF16;
    if (isa == ISA_AVX512) return &AVX512;
    if (isa == ISA_AVX2) return &AVX2;
#endif
    (void)isa;
    return &PORTABLE;
}

/* The best instruction set this CPU and build have (ISA_* values): for tests and logs. */
int attention_best_isa(void) {
#ifdef HAVE_X86_KERNELS
    return cpu_isa();
#else
    return ISA_PORTABLE;
#endif
}

/* ------------------------------------------------------------------------------------------ scratch */

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* Carves the thread's Rows buffers for up to ``max_rows`` rows of head dim d. The memory is the thread's and
 * grows only: a fresh multi-hundred-KiB allocation per call would be mmap'd and page-faulted every time. */
static __thread char *tls_buffer;
static __thread size_t tls_capacity;

static int rows_init(Rows *r, int64_t max_rows, int64_t d) {
    const size_t mp = round_up((size_t)max_rows, 16), dp = round_up((size_t)d, 32);
    const size_t sizes[] = {
        mp * dp * 4,      /* qf */
        mp * dp * 2,      /* qb */
        dp * mp * 4,      /* qt */
        dp / 2 * mp * 4,  /* qtp */
        KC * mp * 4,      /* s */
        KC / 2 * mp * 4,  /* pp */
        KC * dp * 4,      /* kf */
        KC * dp * 4,      /* vf */
        KC / 2 * dp * 4,  /* vp */
        mp * dp * 4,      /* acc */
        mp * 4, mp * 4,   /* mx, l */
        mp * 4, mp * 4, mp * 4, /* top, base, total */
        mp * 8, mp * 8, mp * 8,
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += round_up(sizes[i], 64);
    if (tls_capacity < total) {
        free(tls_buffer);
        tls_buffer = NULL;
        tls_capacity = 0;
        if (posix_memalign((void **)&tls_buffer, 64, total) != 0) return 1;
        tls_capacity = total;
    }
    char *p = tls_buffer;
    void **slots[] = {(void **)&r->qf, (void **)&r->qb, (void **)&r->qt, (void **)&r->qtp, (void **)&r->s,
                      (void **)&r->pp, (void **)&r->kf, (void **)&r->vf, (void **)&r->vp, (void **)&r->acc,
                      (void **)&r->mx, (void **)&r->l, (void **)&r->top, (void **)&r->base, (void **)&r->total,
                      (void **)&r->tok, (void **)&r->head, (void **)&r->qpos};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        *slots[i] = p;
        p += round_up(sizes[i], 64);
    }
    r->d = d;
    r->dp = (int64_t)dp;
    return 0;
}

/* ------------------------------------------------------------------------------------------- the walk */

/* Block holding token ``pos`` of table row b, or -1 when there is none. */
static inline int64_t block_of(const Args *a, int64_t b, int64_t pos) {
    int64_t column = pos / a->block_size;
    if (pos < 0 || column >= a->width) return -1;
    int64_t block = a->table[b * a->width + column];
    return block < a->num_blocks ? block : -1;
}

/* Loads the queries of rows [0, m) (r->tok, r->head set) in the layouts the kernels read. */
static void rows_load(Rows *r, const Args *a, const Kernels *kern, int64_t m) {
    const int64_t d = a->dim, dp = r->dp;
    r->m = m;
    r->mp = (int64_t)round_up((size_t)m, 16);
    r->many = m >= MANY_ROWS;
    const int32_t pairs = use_pairs(a, kern);
    for (int64_t i = 0; i < r->mp; i++) {
        float *qf = r->qf + i * dp;
        uint16_t *qb = r->qb + i * dp;
        if (i < m) {
            const int64_t at = r->tok[i] * a->q_s0 + r->head[i] * a->q_s1;
            for (int64_t x = 0; x < d; x++) qf[x] = load(a->q, at + x, a->dtype);
            if (pairs) memcpy(qb, (const uint16_t *)a->q + at, d * 2);
        } else {
            for (int64_t x = 0; x < d; x++) qf[x] = 0.0f;
            if (pairs) memset(qb, 0, d * 2);
        }
        for (int64_t x = d; x < dp; x++) qf[x] = 0.0f;
        if (pairs) memset(qb + d, 0, (dp - d) * 2);
    }
    if (r->many) {
        for (int64_t x = 0; x < dp; x++)
            for (int64_t i = 0; i < r->mp; i++) r->qt[x * r->mp + i] = r->qf[i * dp + x];
        if (pairs)
            for (int64_t x = 0; x < dp / 2; x++)
                for (int64_t i = 0; i < r->mp; i++) {
                    const uint16_t *q = r->qb + i * dp + 2 * x;
                    r->qtp[x * r->mp + i] = (uint32_t)q[0] | (uint32_t)q[1] << 16;
                }
    }
}

static void rows_reset(Rows *r) {
    for (int64_t i = 0; i < r->mp; i++) {
        r->mx[i] = -INFINITY;
        r->l[i] = 0.0f;
    }
    memset(r->acc, 0, sizeof(float) * r->mp * r->dp);
}

/* exp(s[t] - base) in place for t < n, zeros up to KC; returns their sum. */
static inline float exp_row(float *restrict s, int64_t n, float base) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; t++) {
        const float p = exp_nonpositive(s[t] - base);
        s[t] = p;
        total += p;
    }
    for (int64_t t = n; t < KC; t++) s[t] = 0.0f;
    return total;
}

static inline void scale_row(float *restrict s, int64_t n, float scale, float cap) {
    if (cap > 0.0f) {
#pragma omp simd
        for (int64_t t = 0; t < n; t++) s[t] = soft_cap(s[t] * scale, cap);
    } else {
#pragma omp simd
        for (int64_t t = 0; t < n; t++) s[t] *= scale;
    }
}

static inline void rescale(float *restrict o, int64_t n, float alpha) {
#pragma omp simd
    for (int64_t x = 0; x < n; x++) o[x] *= alpha;
}

/* Scales (softcaps) and masks the chunk's scores [pos0, pos0 + n) and folds them into the running softmax:
 * afterwards s holds probabilities relative to the new running max (0 past n) and acc is rescaled.
 * Few-rows layout: s[i][t]. */
static void rows_softmax(Rows *r, const Args *a, int64_t pos0, int64_t n, int32_t masked) {
    const int64_t wl = a->window_left;
    const int32_t causal = a->cu_q == NULL || a->causal;
    for (int64_t i = 0; i < r->m; i++) {
        float *restrict s = r->s + i * KC;
        scale_row(s, n, a->scale, a->softcap);
        if (masked) {
            const int64_t qpos = r->qpos[i];
            for (int64_t t = 0; t < n; t++) {
                const int64_t pos = pos0 + t;
                if (r->invisible[t] || (causal && pos > qpos) || (wl >= 0 && pos < qpos - wl)) s[t] = -INFINITY;
            }
        }
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t t = 0; t < n; t++) top = s[t] > top ? s[t] : top;
        const float old = r->mx[i], fresh = old > top ? old : top;
        const float base = fresh == -INFINITY ? 0.0f : fresh; /* nothing visible yet: every p is 0 */
        const float total = exp_row(s, n, base);
        const float alpha = exp_nonpositive(old - base);
        r->l[i] = r->l[i] * alpha + total;
        r->mx[i] = fresh;
        if (alpha != 1.0f) rescale(r->acc + i * r->dp, r->dp, alpha);
    }
}

/* The many-rows layout (s[t][i]): as above, vectorised over the rows. */
static void rows_softmax_many(Rows *r, const Args *a, int64_t pos0, int64_t n, int32_t masked) {
    const int64_t wl = a->window_left, mp = r->mp;
    const int32_t causal = a->cu_q == NULL || a->causal;
    float *restrict top = r->top, *restrict base = r->base, *restrict total = r->total;
    for (int64_t i = 0; i < mp; i++) {
        top[i] = -INFINITY;
        total[i] = 0.0f;
    }
    for (int64_t t = 0; t < n; t++) {
        float *restrict s = r->s + t * mp;
        scale_row(s, mp, a->scale, a->softcap);
        if (masked) {
            const int64_t pos = pos0 + t;
            if (r->invisible[t]) {
                for (int64_t i = 0; i < mp; i++) s[i] = -INFINITY;
            } else {
                for (int64_t i = 0; i < r->m; i++) {
                    const int64_t qpos = r->qpos[i];
                    if ((causal && pos > qpos) || (wl >= 0 && pos < qpos - wl)) s[i] = -INFINITY;
                }
            }
        }
#pragma omp simd
        for (int64_t i = 0; i < mp; i++) top[i] = s[i] > top[i] ? s[i] : top[i];
    }
    for (int64_t i = 0; i < mp; i++) {
        const float fresh = r->mx[i] > top[i] ? r->mx[i] : top[i];
        base[i] = fresh == -INFINITY ? 0.0f : fresh;
        top[i] = fresh;
    }
    for (int64_t t = 0; t < n; t++) {
        float *restrict s = r->s + t * mp;
#pragma omp simd
        for (int64_t i = 0; i < mp; i++) {
            const float p = exp_nonpositive(s[i] - base[i]);
            s[i] = p;
            total[i] += p;
        }
    }
    for (int64_t t = n; t < KC; t++) memset(r->s + t * mp, 0, sizeof(float) * mp);
    for (int64_t i = 0; i < mp; i++) {
        const float alpha = exp_nonpositive(r->mx[i] - base[i]);
        r->l[i] = r->l[i] * alpha + total[i];
        r->mx[i] = top[i];
        if (alpha != 1.0f) rescale(r->acc + i * r->dp, r->dp, alpha);
    }
}

#if defined(__x86_64__)
/* GCC 12's dead-code elimination drops a loop of __builtin_prefetch (it has no effect the compiler sees). Into L2
 * (prefetcht1), not L1: a chunk's rows fetched into L1 (prefetcht0) evicted the rows the current chunk was reading
 * (32 keys x K and V per head are 16 KiB in fp32, half an L1); decode calls with their pages out of the caches ran
 * 1.1-2x faster on a Zen 4 EPYC, 1.0-1.1x on pages in the caches (``python benchmarks/cpu_attention.py --cold
 * --old-rev 692f436``: the kernels before against these). */
#define PREFETCH(p) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(p)))
#else
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#endif

/* Asks the caches for the key and value rows of keys [pos, pos + n) of table row b, KV head hk. A chunk's rows
 * lie on scattered pages, one row per token at a stride of the KV heads, and decode reads each from memory
 * once: its kernels stalled on those loads. Fetching the next chunk's rows while one computes made a decode
 * call ~5% faster on a Zen 1 EPYC (49 requests x 250 keys; it still ran at half its speed on cached pages). */
static inline void prefetch_rows(const Args *a, int64_t b, int64_t hk, int64_t pos, int64_t n, size_t elem) {
    const int64_t bs = a->block_size, bytes = a->dim * (int64_t)elem;
    int64_t slot = pos % bs, block = block_of(a, b, pos);
    for (int64_t t = 0; t < n; t++, slot++) {
        if (slot == bs) {
            slot = 0;
            block = block_of(a, b, pos + t);
        }
        if (block < 0) continue;
        const int64_t at = (((block * bs + slot) * a->kv_heads + hk) * a->dim) * (int64_t)elem; /* bytes */
        for (int64_t x = 0; x < bytes; x += 64) {
            PREFETCH((const char *)a->k_cache + at + x);
            PREFETCH((const char *)a->v_cache + at + x);
        }
    }
}

/* Walks keys [lo, hi) of table row b, KV head hk, for rows already loaded (and reset or carried over).
 * ``always_visible``: every row sees every key of the range (no per-row mask needed). */
static void rows_walk(Rows *r, const Args *a, const Kernels *kern, int64_t b, int64_t hk, int64_t lo, int64_t hi,
                      int32_t always_visible) {
    const int64_t bs = a->block_size, d = a->dim;
    const size_t elem = page_elem(a);
    const int32_t pairs = use_pairs(a, kern);
    const float *fp8 = a->page_dtype >= FP8_E4M3 ? FP8_TO_F32[a->page_dtype - FP8_E4M3] : NULL;
    const int32_t many = r->many;
    int64_t first_masked = INT64_MAX, last_masked = INT64_MIN; /* keys [first, last] every row sees */
    if (!always_visible) {
        const int32_t causal = a->cu_q == NULL || a->causal;
        int64_t qmin = INT64_MAX, qmax = INT64_MIN;
        for (int64_t i = 0; i < r->m; i++) {
            qmin = r->qpos[i] < qmin ? r->qpos[i] : qmin;
            qmax = r->qpos[i] > qmax ? r->qpos[i] : qmax;
        }
        first_masked = a->window_left >= 0 ? qmax - a->window_left : INT64_MIN; /* keys before: masked for some */
        last_masked = causal ? qmin : INT64_MAX;                                 /* keys after: masked for some */
    }
    if (lo < hi) prefetch_rows(a, b, hk, lo, hi - lo < KC ? hi - lo : KC, elem);
    for (int64_t pos0 = lo; pos0 < hi; pos0 += KC) {
        const int64_t n = hi - pos0 < KC ? hi - pos0 : KC;
        if (pos0 + KC < hi) /* the next chunk's rows arrive while this one computes */
            prefetch_rows(a, b, hk, pos0 + KC, hi - pos0 - KC < KC ? hi - pos0 - KC : KC, elem);
        int32_t masked = !always_visible && (pos0 < first_masked || pos0 + n - 1 > last_masked);
        /* The page of key pos0 + t, looked up once per block (not a division per key). */
        int64_t slot = pos0 % bs, block = block_of(a, b, pos0);
        for (int64_t t = 0; t < KC; t++) {
            const void *k = ZERO_ROW, *v = ZERO_ROW;
            r->invisible[t] = 0;
            if (t < n) {
                if (slot == bs) {
                    slot = 0;
                    block = block_of(a, b, pos0 + t);
                }
                if (block < 0) {
                    r->invisible[t] = 1;
                    masked = 1;
                } else {
                    const int64_t at = ((block * bs + slot) * a->kv_heads + hk) * d; /* elements */
                    k = (const char *)a->k_cache + at * elem;
                    v = (const char *)a->v_cache + at * elem;
                }
                slot++;
            }
            r->krow[t] = (const float *)k;
            r->vrow[t] = (const float *)v;
            r->kb[t] = (const uint16_t *)k;
            r->vb[t] = (const uint16_t *)v;
        }
        if (pairs) {
            (many ? kern->scores_many_bf16 : kern->scores_few_bf16)(r, n);
        } else {
            if (fp8 != NULL)
                convert_chunk_fp8(r, n, fp8);
            else if (a->dtype == BF16)
                kern->convert_chunk(r, n, 1);
            (many ? kern->scores_many : kern->scores_few)(r, n);
        }
        if (many)
            rows_softmax_many(r, a, pos0, n, masked);
        else
            rows_softmax(r, a, pos0, n, masked);
        const int64_t rs = many ? 1 : KC, ts = many ? r->mp : 1;
        if (pairs) {
            kern->pack_values_bf16(r, n);
            kern->pack_probs_bf16(r, n);
            kern->values_bf16(r, n, many ? 1 : KC / 2, many ? r->mp : 1);
        } else {
            kern->values(r, n, rs, ts);
        }
    }
}

/* Writes rows [0, m): acc / (sum + e^(sink - max)), zeros for a row that saw no key. */
static void rows_store(Rows *r, const Args *a) {
    const int64_t d = a->dim;
    for (int64_t i = 0; i < r->m; i++) {
        const int64_t at = r->tok[i] * a->o_s0 + r->head[i] * a->o_s1;
        const float *o = r->acc + i * r->dp;
        float top = r->mx[i], denom = r->l[i], factor = 0.0f;
        if (top != -INFINITY) {
            if (a->sinks != NULL) {
                const float sink = a->sinks[r->head[i]];
                const float both = sink > top ? sink : top;
                const float keep = exp_nonpositive(top - both);
                denom = denom * keep + exp_nonpositive(sink - both);
                factor = keep / denom;
            } else {
                factor = 1.0f / denom;
            }
        }
        for (int64_t x = 0; x < d; x++) store(a->out, at + x, o[x] * factor, a->dtype);
    }
}

/* ------------------------------------------------------------------------------------------- threads */

typedef void (*JobFn)(void *ctx);

#ifdef _OPENMP
/* Built with -fopenmp, the library needs libgomp.so.1, and the loader hands it the copy torch loaded (the same
 * soname): the kernels run on the threads torch's matmuls and inductor's kernels run on, awake or spinning as
 * those left them. A pool of the library's own was a third thread on two cores: while OpenMP's worker spun
 * after a matmul (GOMP_SPINCOUNT), the pool's worker waited for its core. Runs fn(ctx) on ``threads``
 * threads (this one included) and returns when all are done. */
static void parallel(JobFn fn, void *ctx, int64_t threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) {
        fn(ctx);
        return;
    }
#pragma omp parallel num_threads((int)threads)
    fn(ctx);
}
#else
/* Without OpenMP: a pool of workers that sleep on a condition variable between calls (never spinning: the
 * machine is shared with the rest of the model's threads). One parallel call at a time; a forked child starts
 * with none. */

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t pool_call = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_done = PTHREAD_COND_INITIALIZER;
static int pool_size, pool_active, pool_pending;
static uint64_t pool_generation;
static JobFn pool_fn;
static void *pool_ctx;
static uint64_t pool_born[MAX_THREADS]; /* the generation each worker was started at: it joins the next one */

static void *pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool_mu);
    uint64_t seen = pool_born[id];
    for (;;) {
        while (pool_generation == seen) pthread_cond_wait(&pool_wake, &pool_mu);
        seen = pool_generation;
        if (id < pool_active) {
            JobFn fn = pool_fn;
            void *ctx = pool_ctx;
            pthread_mutex_unlock(&pool_mu);
            fn(ctx);
            pthread_mutex_lock(&pool_mu);
            if (--pool_pending == 0) pthread_cond_signal(&pool_done);
        }
    }
    return NULL;
}

static void pool_after_fork(void) {
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
    pool_mu = mu;
    pool_call = mu;
    pool_wake = cond;
    pool_done = cond;
    pool_size = pool_active = pool_pending = 0;
}

__attribute__((constructor)) static void pool_register(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Runs fn(ctx) on ``threads`` threads (this one included) and returns when all are done. */
static void parallel(JobFn fn, void *ctx, int64_t threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) {
        fn(ctx);
        return;
    }
    pthread_mutex_lock(&pool_call);
    pthread_mutex_lock(&pool_mu);
    while (pool_size < threads - 1) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool_born[pool_size] = pool_generation;
        const int failed = pthread_create(&id, &attr, pool_worker, (void *)(intptr_t)pool_size);
        pthread_attr_destroy(&attr);
        if (failed) break; /* fewer helpers: the tasks are shared dynamically, so the work still gets done */
        pool_size++;
    }
    const int helpers = (int)(threads - 1) < pool_size ? (int)(threads - 1) : pool_size;
    if (helpers > 0) {
        pool_fn = fn;
        pool_ctx = ctx;
        pool_active = helpers;
        pool_pending = helpers;
        pool_generation++;
        pthread_cond_broadcast(&pool_wake);
    }
    pthread_mutex_unlock(&pool_mu);
    fn(ctx);
    pthread_mutex_lock(&pool_mu);
    while (pool_pending > 0) pthread_cond_wait(&pool_done, &pool_mu);
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&pool_call);
}
#endif

/* ------------------------------------------------------------------------------------------- tasks */

/* One unit of work: rows of one table row / KV head over one key range. */
typedef struct {
    int32_t kind;   /* 0: queries [i0, i1) of request b; 1: members [i0, i1) of group b, shared keys only */
    int32_t hk;
    int64_t b, i0, i1;
    int64_t cost;   /* rows x keys, to schedule the longest first */
} Task;

typedef struct {
    const Args *a;
    const Kernels *kern;
    Task *tasks;
    int64_t num_tasks, max_rows;
    int64_t next; /* atomic: the next task to take */
    int32_t status;
    /* shared-prefix decode */
    const int64_t *group_of;     /* [B] group of each request or -1 */
    const int64_t *group_first;  /* [G + 1] span of each group in ``members`` */
    const int64_t *members;      /* requests, group after group */
    const int64_t *group_shared; /* [G] shared leading keys */
    float *states;               /* [B][H_kv][G_heads][2 + Dp]: (max, sum, acc) after the shared keys */
    int64_t dp;
} Work;

/* Tokens request b attends to, and its number of queries and first query's token. */
static inline void request_shape(const Args *a, int64_t b, int64_t *keys, int64_t *queries, int64_t *first) {
    if (a->cu_q == NULL) {
        *keys = a->seqlens[b] + (a->k_new != NULL);
        *queries = 1;
        *first = b;
    } else {
        *keys = a->seqlens[b];
        *first = a->cu_q[b];
        *queries = a->cu_q[b + 1] - a->cu_q[b];
    }
}

static float *state_of(const Work *w, int64_t b, int64_t hk) {
    const int64_t group = w->a->heads / w->a->kv_heads;
    return w->states + ((b * w->a->kv_heads + hk) * group) * (2 + w->dp);
}

/* The keys [lo, hi) that ``task`` walks, of table row *b (a group's task: its leader's shared keys). */
static void task_keys(const Work *w, const Task *task, int64_t *b, int64_t *lo, int64_t *hi) {
    const Args *a = w->a;
    if (task->kind == 1) {
        *b = w->members[w->group_first[task->b]];
        *lo = 0;
        *hi = w->group_shared[task->b];
        return;
    }
    int64_t keys, queries, first;
    request_shape(a, task->b, &keys, &queries, &first);
    const int64_t qmin = keys - queries + task->i0, qmax = keys - queries + task->i1 - 1;
    int64_t l = a->window_left >= 0 ? qmin - a->window_left : 0;
    int64_t h = (a->cu_q == NULL || a->causal) ? qmax + 1 : keys;
    l = l < 0 ? 0 : l;
    h = h > keys ? keys : h;
    const int64_t g_id = w->group_of != NULL ? w->group_of[task->b] : -1;
    if (g_id >= 0) l = w->group_shared[g_id]; /* the group walks the shared keys */
    *b = task->b;
    *lo = l;
    *hi = h;
}

/* Asks the caches for the first chunk of ``task``'s keys, to arrive while the task before it runs. rows_walk
 * fetches each next chunk ahead, but a task's first one only just before reading it, and a decode task has few
 * chunks (157 keys a request on average in the 30M Llama's row of ``hf-paged-attn bench vllm``: 5). Taking the
 * next task one task early made that row's decode attention 1.09x (float32) and 1.11x (bfloat16) faster in the
 * engine (docs/performance.md). */
static void prefetch_task(const Work *w, const Task *task) {
    int64_t b, lo, hi;
    task_keys(w, task, &b, &lo, &hi);
    if (lo < hi) prefetch_rows(w->a, b, task->hk, lo, hi - lo < KC ? hi - lo : KC, page_elem(w->a));
}

static void run_task(Work *w, Rows *r, const Task *task) {
    const Args *a = w->a;
    const int64_t group = a->heads / a->kv_heads, hk = task->hk;
    if (task->kind == 1) { /* a group's shared keys, for all its members' rows at once: state saved */
        int64_t m = 0;
        for (int64_t j = task->i0; j < task->i1; j++)
            for (int64_t g = 0; g < group; g++, m++) {
                r->tok[m] = w->members[j];
                r->head[m] = hk * group + g;
                r->qpos[m] = INT64_MAX;
            }
        rows_load(r, a, w->kern, m);
        rows_reset(r);
        int64_t leader, lo, hi;
        task_keys(w, task, &leader, &lo, &hi);
        rows_walk(r, a, w->kern, leader, hk, lo, hi, 1);
        m = 0;
        for (int64_t j = task->i0; j < task->i1; j++) {
            float *state = state_of(w, w->members[j], hk);
            for (int64_t g = 0; g < group; g++, m++, state += 2 + w->dp) {
                state[0] = r->mx[m];
                state[1] = r->l[m];
                memcpy(state + 2, r->acc + m * r->dp, sizeof(float) * r->dp);
            }
        }
        return;
    }
    int64_t keys, queries, first;
    request_shape(a, task->b, &keys, &queries, &first);
    int64_t m = 0;
    for (int64_t i = task->i0; i < task->i1; i++)
        for (int64_t g = 0; g < group; g++, m++) {
            r->tok[m] = first + i;
            r->head[m] = hk * group + g;
            r->qpos[m] = keys - queries + i; /* bottom-right aligned */
        }
    rows_load(r, a, w->kern, m);
    rows_reset(r);
    int64_t b, lo, hi;
    task_keys(w, task, &b, &lo, &hi);
    if (w->group_of != NULL && w->group_of[task->b] >= 0) { /* the group walked the shared keys: carry its state */
        const float *state = state_of(w, task->b, hk);
        for (int64_t i = 0; i < m; i++, state += 2 + w->dp) {
            r->mx[i] = state[0];
            r->l[i] = state[1];
            memcpy(r->acc + i * r->dp, state + 2, sizeof(float) * r->dp);
        }
    }
    rows_walk(r, a, w->kern, b, hk, lo, hi, 0);
    rows_store(r, a);
}

static void work_loop(void *ctx) {
    Work *w = (Work *)ctx;
    Rows r;
    if (rows_init(&r, w->max_rows, w->a->dim) != 0) {
        __atomic_store_n(&w->status, 1, __ATOMIC_RELAXED);
        return;
    }
    /* Each thread takes its next task before it runs the one it holds, so that the next one's first keys can be
     * fetched meanwhile (``prefetch_task``). */
    int64_t i = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
    while (i < w->num_tasks) {
        const int64_t next = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (next < w->num_tasks) prefetch_task(w, &w->tasks[next]);
        run_task(w, &r, &w->tasks[i]);
        i = next;
    }
}

static int by_cost(const void *x, const void *y) {
    const int64_t a = ((const Task *)x)->cost, b = ((const Task *)y)->cost;
    return a < b ? 1 : a > b ? -1 : 0;
}

/* Runs tasks on the pool, longest first. Returns 0, or 1 when a thread had no scratch memory. */
static int run_tasks(Work *w, Task *tasks, int64_t n) {
    if (n == 0) return 0;
    qsort(tasks, (size_t)n, sizeof *tasks, by_cost);
    w->tasks = tasks;
    w->num_tasks = n;
    w->next = 0;
    int64_t threads = w->a->num_threads < 1 ? 1 : w->a->num_threads;
    if (threads > n) threads = n;
    parallel(work_loop, w, threads);
    return w->status;
}

/* ------------------------------------------------------------------------------------------- entry points */

/* Appends every request's new token at position seqlens[b] of its pages. Returns 2 if a request has no block
 * for it (nothing is written then). */
static int append(const Args *a) {
    const size_t size = a->dtype == F32 ? 4 : 2;
    for (int64_t b = 0; b < a->batch; b++)
        if (block_of(a, b, a->seqlens[b]) < 0) return 2;
    for (int64_t b = 0; b < a->batch; b++) {
        const int64_t pos = a->seqlens[b], block = block_of(a, b, pos);
        const int64_t slot = block * a->block_size + pos % a->block_size;
        for (int64_t h = 0; h < a->kv_heads; h++) {
            const int64_t dst = (slot * a->kv_heads + h) * a->dim;
            const int64_t k_src = b * a->new_sb + h * a->new_sh, v_src = b * a->new_v_sb + h * a->new_v_sh;
            memcpy((char *)a->k_cache + dst * size, (const char *)a->k_new + k_src * size, a->dim * size);
            memcpy((char *)a->v_cache + dst * size, (const char *)a->v_new + v_src * size, a->dim * size);
        }
    }
    return 0;
}

typedef struct {
    int64_t *group_of, *group_first, *members, *group_shared, *order;
    int64_t num_groups;
} Groups;

static const Args *sort_args; /* the comparator's context (sorting happens under the caller's lock) */
static int64_t sort_depth;
static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;

static int by_leading_blocks(const void *x, const void *y) {
    const int64_t r = *(const int64_t *)x, s = *(const int64_t *)y;
    const int32_t *p = sort_args->table + r * sort_args->width, *q = sort_args->table + s * sort_args->width;
    for (int64_t j = 0; j < sort_depth; j++)
        if (p[j] != q[j]) return p[j] < q[j] ? -1 : 1;
    return r < s ? -1 : r > s;
}

/* Groups of at least two requests whose first blocks are the same physical blocks, every member filling them
 * (a block id names its content: equal ids, equal keys). As the torch backend's ``_shared_prefixes``: rows
 * are bucketed by their first CASCADE_MIN_TOKENS worth of blocks; inside a bucket the first row leads, the
 * rows sharing its blocks to the depth that saves the most block reads form a group, the rest go again.
 * Returns 1 when out of memory (no groups then). */
static int find_groups(const Args *a, Groups *g) {
    const int64_t n = a->batch, bs = a->block_size;
    const int64_t least = (CASCADE_MIN_TOKENS + bs - 1) / bs;
    memset(g, 0, sizeof *g);
    if (n < 2 || a->width < least || a->window_left >= 0) return 0;
    int64_t *mem = malloc(sizeof(int64_t) * (5 * n + 2));
    if (mem == NULL) return 1;
    g->group_of = mem;
    g->order = mem + n;
    g->members = mem + 2 * n;
    g->group_shared = mem + 3 * n;
    g->group_first = mem + 4 * n; /* n + 2 slots */
    int64_t candidates = 0;
    for (int64_t b = 0; b < n; b++) {
        g->group_of[b] = -1;
        const int64_t full = (a->seqlens[b] + (a->k_new != NULL)) / bs;
        int ok = full >= least;
        for (int64_t j = 0; ok && j < least; j++) ok = block_of(a, b, j * bs) >= 0;
        if (ok) g->order[candidates++] = b;
    }
    pthread_mutex_lock(&sort_mu);
    sort_args = a;
    sort_depth = least;
    qsort(g->order, (size_t)candidates, sizeof(int64_t), by_leading_blocks);
    pthread_mutex_unlock(&sort_mu);
    int64_t placed = 0;
    int64_t *match = malloc(sizeof(int64_t) * (candidates + 1) * 2);
    if (match == NULL) {
        free(mem);
        memset(g, 0, sizeof *g);
        return 1;
    }
    int64_t *ranked = match + candidates + 1;
    for (int64_t lo = 0; lo < candidates;) {
        int64_t hi = lo + 1;
        const int32_t *head = a->table + g->order[lo] * a->width;
        while (hi < candidates && memcmp(a->table + g->order[hi] * a->width, head, least * 4) == 0) hi++;
        /* rows order[lo, hi) share their first ``least`` blocks; order[lo] leads (the lowest row) */
        int64_t left = hi - lo;
        int64_t *rows = g->order + lo;
        while (left >= 2) {
            const int32_t *lead = a->table + rows[0] * a->width;
            for (int64_t i = 0; i < left; i++) {
                const int32_t *row = a->table + rows[i] * a->width;
                const int64_t full = (a->seqlens[rows[i]] + (a->k_new != NULL)) / bs;
                int64_t k = 0;
                while (k < full && k < a->width && row[k] == lead[k]) k++;
                match[i] = k;
                ranked[i] = k;
            }
            for (int64_t i = 1; i < left; i++) /* descending insertion sort: groups are small */
                for (int64_t j = i; j > 0 && ranked[j] > ranked[j - 1]; j--) {
                    const int64_t t = ranked[j];
                    ranked[j] = ranked[j - 1];
                    ranked[j - 1] = t;
                }
            int64_t depth = 1;
            for (int64_t k = 2; k < left; k++)
                if (k * ranked[k] > depth * ranked[depth]) depth = k;
            const int64_t shared = ranked[depth];
            const int64_t id = g->num_groups++;
            g->group_first[id] = placed;
            g->group_shared[id] = shared * bs;
            int64_t kept = 0;
            for (int64_t i = 0; i < left; i++) {
                if (match[i] >= shared) {
                    g->members[placed++] = rows[i];
                    g->group_of[rows[i]] = id;
                } else {
                    rows[kept++] = rows[i];
                }
            }
            left = kept;
        }
        lo = hi;
    }
    g->group_first[g->num_groups] = placed;
    free(match);
    return 0;
}

/* Decode: appends the new tokens (k_new non-NULL), then attends each request's one query. Returns 0; 1 when
 * scratch memory could not be allocated (outputs unset); 2 when a request has no block for its new token
 * (nothing is written). */
int paged_decode(Args *a) {
    a->cu_q = NULL;
    a->num_groups = 0;
    if (a->k_new != NULL && (a->page_dtype != 0 || append(a) != 0)) return 2;
    const int64_t group = a->heads / a->kv_heads;
    Work w = {a, kernels_for(a->isa), NULL, 0, group, 0, 0, NULL, NULL, NULL, NULL, NULL, 0};
    w.dp = (int64_t)round_up((size_t)a->dim, 32);
    Groups g = {0};
    if (a->cascade && find_groups(a, &g) != 0) return 1;
    Task *tasks = malloc(sizeof(Task) * (a->batch * a->kv_heads + (size_t)a->batch * a->kv_heads + 1));
    if (tasks == NULL) {
        free(g.group_of);
        return 1;
    }
    int status = 0;
    if (g.num_groups > 0) {
        a->num_groups = (int32_t)g.num_groups;
        w.states = malloc(sizeof(float) * a->batch * a->heads * (2 + w.dp));
        if (w.states == NULL) {
            free(g.group_of);
            free(tasks);
            return 1;
        }
        const int64_t per_tile = ROWS_TILE / group > 0 ? ROWS_TILE / group : 1; /* members per row set */
        int64_t n = 0;
        for (int64_t id = 0; id < g.num_groups; id++)
            for (int64_t j = g.group_first[id]; j < g.group_first[id + 1]; j += per_tile)
                for (int64_t hk = 0; hk < a->kv_heads; hk++) {
                    const int64_t end = j + per_tile < g.group_first[id + 1] ? j + per_tile : g.group_first[id + 1];
                    tasks[n++] = (Task){1, (int32_t)hk, id, j, end, (end - j) * g.group_shared[id]};
                }
        w.group_first = g.group_first;
        w.members = g.members;
        w.group_shared = g.group_shared;
        w.max_rows = per_tile * group > group ? per_tile * group : group;
        status = run_tasks(&w, tasks, n);
        w.group_of = g.group_of;
        w.status = 0;
    }
    int64_t n = 0;
    for (int64_t b = 0; b < a->batch; b++)
        for (int64_t hk = 0; hk < a->kv_heads; hk++) {
            const int64_t keys = a->seqlens[b] + (a->k_new != NULL);
            const int64_t skip = g.group_of != NULL && g.group_of[b] >= 0 ? g.group_shared[g.group_of[b]] : 0;
            tasks[n++] = (Task){0, (int32_t)hk, b, 0, 1, keys - skip};
        }
    if (status == 0) status = run_tasks(&w, tasks, n);
    free(w.states);
    free(tasks);
    free(g.group_of);
    return status;
}

/* Prefill: packed queries (cu_q) against each request's first seqlens[b] keys, read from the pages (the step's
 * own K/V already written there). Rows of a request without keys, and any row past cu_q[B], are zeros.
 * Returns 0, or 1 when scratch memory could not be allocated. */
int paged_prefill(Args *a, int64_t total_q) {
    const int64_t group = a->heads / a->kv_heads, d = a->dim;
    const int64_t per_tile = ROWS_TILE / group > 0 ? ROWS_TILE / group : 1; /* queries per row set */
    const size_t size = a->dtype == F32 ? 4 : 2;
    int64_t num_tasks = 0;
    for (int64_t b = 0; b < a->batch; b++) {
        const int64_t queries = a->cu_q[b + 1] - a->cu_q[b];
        num_tasks += a->seqlens[b] > 0 && queries > 0 ? (queries + per_tile - 1) / per_tile * a->kv_heads : 0;
    }
    for (int64_t b = 0; b <= a->batch; b++) { /* rows no task writes */
        const int64_t from = b < a->batch ? a->cu_q[b] : a->cu_q[a->batch];
        const int64_t to = b < a->batch ? (a->seqlens[b] > 0 ? from : a->cu_q[b + 1]) : total_q;
        for (int64_t t = from; t < to; t++)
            for (int64_t h = 0; h < a->heads; h++)
                memset((char *)a->out + (t * a->o_s0 + h * a->o_s1) * size, 0, d * size);
    }
    Task *tasks = malloc(sizeof(Task) * (num_tasks + 1));
    if (tasks == NULL) return 1;
    int64_t n = 0;
    for (int64_t b = 0; b < a->batch; b++) {
        const int64_t keys = a->seqlens[b], queries = a->cu_q[b + 1] - a->cu_q[b];
        if (keys <= 0) continue;
        for (int64_t i0 = 0; i0 < queries; i0 += per_tile)
            for (int64_t hk = 0; hk < a->kv_heads; hk++) {
                const int64_t i1 = i0 + per_tile < queries ? i0 + per_tile : queries;
                int64_t seen = a->causal ? keys - queries + i1 : keys;
                if (a->window_left >= 0 && seen > a->window_left + (i1 - i0)) seen = a->window_left + (i1 - i0);
                tasks[n++] = (Task){0, (int32_t)hk, b, i0, i1, (i1 - i0) * (seen > 0 ? seen : 1)};
            }
    }
    Work w = {a, kernels_for(a->isa), NULL, 0, per_tile * group, 0, 0, NULL, NULL, NULL, NULL, NULL, 0};
    w.dp = (int64_t)round_up((size_t)d, 32);
    const int status = run_tasks(&w, tasks, n);
    free(tasks);
    return status;
}
