/* Paged decode attention on the CPU, reading K/V where they lie in the pages.
 *
 * The torch backend's decode gathers each request's pages into a padded tensor at every layer and
 * hands it to SDPA; for the small batches and short contexts of CPU serving, the copies and the
 * per-(request, head) overhead of those calls cost more than the arithmetic. This kernel does one
 * pass per (request, kv head): the new token is appended in place, then every query head that
 * shares the kv head scores the visible keys straight from their pages, takes an fp32 softmax
 * (max-subtracted, softcap and attention sinks as in the reference) and sums the values.
 *
 * Built by hf_paged_attn/kernels/cpu_native.py with the system C compiler and called through ctypes
 * (no Python or torch headers). Layouts (element strides given where a tensor may be a view):
 *   q [B, H, D] (strides q_sb, q_sh, 1); out [B, H, D] contiguous;
 *   k_cache, v_cache [num_blocks, block_size, H_kv, D] contiguous;
 *   k_new, v_new [B, H_kv, D] (strides new_sb, new_sh, 1) or NULL: written at position seqlens[b];
 *   seqlens int32 [B]: tokens in the cache before k_new (with k_new NULL: tokens to attend to);
 *   table int32 [B, W] block ids; sinks fp32 [H] or NULL.
 * dtype: 0 float32, 1 bfloat16 (q, caches, new K/V and out share it; arithmetic in fp32).
 */
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
    const int32_t *table;
    const float *sinks;
    int64_t batch, heads, kv_heads, dim, block_size, width, num_blocks;
    int64_t q_sb, q_sh, new_sb, new_sh;
    int64_t window_left; /* keys older than position - window_left are invisible; < 0: unbounded */
    float scale, softcap;
    int32_t dtype;
    int32_t num_threads;
} DecodeArgs;

typedef struct {
    const DecodeArgs *a;
    int64_t first, last; /* (request, kv head) tasks [first, last) */
    int32_t status;      /* 1: no scratch memory */
} Work;

static inline float load(const void *p, int64_t i, int32_t dtype) {
    if (dtype == 0) return ((const float *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void store(void *p, int64_t i, float f, int32_t dtype) {
    if (dtype == 0) {
        ((float *)p)[i] = f;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN stays NaN */
        ((uint16_t *)p)[i] = (uint16_t)((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

static inline void copy_row(void *dst, int64_t di, const void *src, int64_t si, int64_t n, int32_t dtype) {
    size_t size = dtype == 0 ? 4 : 2;
    memcpy((char *)dst + di * size, (const char *)src + si * size, n * size);
}

/* Block holding token ``pos`` of request b, or -1 when the table has none (never read or written). */
static inline int64_t block_of(const DecodeArgs *a, int64_t b, int64_t pos) {
    int64_t column = pos / a->block_size;
    if (pos < 0 || column >= a->width) return -1;
    int64_t block = a->table[b * a->width + column];
    return block < a->num_blocks ? block : -1;
}

/* Appends every request's new token at position seqlens[b] of its pages. Returns 2 if a request
 * has no block for it (nothing is written then). */
static int append(const DecodeArgs *a) {
    for (int64_t b = 0; b < a->batch; b++)
        if (block_of(a, b, a->seqlens[b]) < 0) return 2;
    for (int64_t b = 0; b < a->batch; b++) {
        int64_t pos = a->seqlens[b];
        int64_t block = block_of(a, b, pos);
        int64_t slot = block * a->block_size + pos % a->block_size;
        for (int64_t h = 0; h < a->kv_heads; h++) {
            int64_t dst = (slot * a->kv_heads + h) * a->dim, src = b * a->new_sb + h * a->new_sh;
            copy_row(a->k_cache, dst, a->k_new, src, a->dim, a->dtype);
            copy_row(a->v_cache, dst, a->v_new, src, a->dim, a->dtype);
        }
    }
    return 0;
}

/* e^x for x <= 0 (scores minus their maximum), vectorisable: 2^(x log2 e) split into an integer
 * power of two and a degree-6 polynomial of the fraction in [-0.5, 0.5] (Cephes' exp2f
 * coefficients, ~2e-7 relative error). Below -87 the result is flushed to 0. */
static inline float exp_nonpositive(float x) {
    float t = (x < -87.0f ? -87.0f : x) * 1.4426950408889634f;
    float whole = floorf(t + 0.5f), f = t - whole;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)whole + 127) << 23;
    float power;
    memcpy(&power, &bits, sizeof power);
    return x < -87.0f ? 0.0f : p * power;
}

/* Scores of the keys of one page run: tokens [pos, end) of a request, all in one block. */
static inline __attribute__((always_inline)) void score_run(const DecodeArgs *a, const float *qf, float *scores,
                                                            int64_t max_len, int64_t base, int64_t t0, int64_t n,
                                                            int64_t group, int32_t dtype) {
    const int64_t d = a->dim, step = a->kv_heads * d;
    for (int64_t t = 0; t < n; t++, base += step) {
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qf + g * d;
            float s = 0.0f;
            if (dtype == 0) {
                const float *k = (const float *)a->k_cache + base;
#pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < d; i++) s += qg[i] * k[i];
            } else {
#pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < d; i++) s += qg[i] * load(a->k_cache, base + i, 1);
            }
            scores[g * max_len + t0 + t] = s;
        }
    }
}

/* Adds the probability-weighted values of one page run to the accumulators. */
static inline __attribute__((always_inline)) void value_run(const DecodeArgs *a, float *acc, const float *scores,
                                                            int64_t max_len, int64_t base, int64_t t0, int64_t n,
                                                            int64_t group, int32_t dtype) {
    const int64_t d = a->dim, step = a->kv_heads * d;
    for (int64_t t = 0; t < n; t++, base += step) {
        for (int64_t g = 0; g < group; g++) {
            float p = scores[g * max_len + t0 + t];
            float *o = acc + g * d;
            if (dtype == 0) {
                const float *v = (const float *)a->v_cache + base;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) o[i] += p * v[i];
            } else {
#pragma omp simd
                for (int64_t i = 0; i < d; i++) o[i] += p * load(a->v_cache, base + i, 1);
            }
        }
    }
}

/* One (request b, kv head hk): its group of query heads. scratch: group * (dim + max_len) floats.
 * Keys are visited page run by page run (consecutive tokens of one block are Hk * D apart). */
static inline __attribute__((always_inline)) void attend_as(const DecodeArgs *a, int64_t b, int64_t hk,
                                                            float *scratch, int64_t max_len, int32_t dtype) {
    const int64_t d = a->dim, group = a->heads / a->kv_heads, bs = a->block_size;
    int64_t len = a->seqlens[b] + (a->k_new != NULL);
    int64_t start = 0;
    if (a->window_left >= 0 && len - 1 - a->window_left > 0) start = len - 1 - a->window_left;
    int64_t n = len > start ? len - start : 0;
    float *qf = scratch;                 /* [group, d] */
    float *scores = scratch + group * d; /* [group, max_len] */
    float prescale = a->softcap > 0.0f ? 1.0f : a->scale; /* softcap needs the scaled score itself */
    for (int64_t g = 0; g < group; g++) {
        int64_t h = hk * group + g;
        for (int64_t i = 0; i < d; i++) qf[g * d + i] = prescale * load(a->q, b * a->q_sb + h * a->q_sh + i, dtype);
    }
    for (int64_t pos = start; pos < len;) {
        int64_t block = block_of(a, b, pos), end = (pos / bs + 1) * bs;
        end = end < len ? end : len;
        if (block < 0) { /* no page (a released block): its keys are invisible */
            for (int64_t g = 0; g < group; g++)
                for (int64_t t = pos; t < end; t++) scores[g * max_len + t - start] = -INFINITY;
        } else {
            int64_t base = ((block * bs + pos % bs) * a->kv_heads + hk) * d;
            score_run(a, qf, scores, max_len, base, pos - start, end - pos, group, dtype);
        }
        pos = end;
    }
    for (int64_t g = 0; g < group; g++) {
        int64_t h = hk * group + g;
        float *sc = scores + g * max_len;
        if (a->softcap > 0.0f)
            for (int64_t t = 0; t < n; t++) sc[t] = a->softcap * tanhf(sc[t] * a->scale / a->softcap);
        float top = -INFINITY;
        for (int64_t t = 0; t < n; t++) top = sc[t] > top ? sc[t] : top;
        float sink = a->sinks != NULL ? a->sinks[h] : -INFINITY;
        if (sink > top) top = sink;
        if (top == -INFINITY) { /* nothing visible: zeros, as flash-attn */
            for (int64_t t = 0; t < n; t++) sc[t] = 0.0f;
            continue;
        }
        float total = a->sinks != NULL ? exp_nonpositive(sink - top) : 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < n; t++) {
            sc[t] = exp_nonpositive(sc[t] - top);
            total += sc[t];
        }
        float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < n; t++) sc[t] *= inv;
    }
    float *acc = qf; /* the queries are no longer needed: [group, d] output accumulators */
    for (int64_t i = 0; i < group * d; i++) acc[i] = 0.0f;
    for (int64_t pos = start; pos < len;) {
        int64_t block = block_of(a, b, pos), end = (pos / bs + 1) * bs;
        end = end < len ? end : len;
        if (block >= 0) {
            int64_t base = ((block * bs + pos % bs) * a->kv_heads + hk) * d;
            value_run(a, acc, scores, max_len, base, pos - start, end - pos, group, dtype);
        }
        pos = end;
    }
    for (int64_t g = 0; g < group; g++) {
        int64_t h = hk * group + g;
        for (int64_t i = 0; i < d; i++) store(a->out, (b * a->heads + h) * d + i, acc[g * d + i], dtype);
    }
}

static void attend(const DecodeArgs *a, int64_t b, int64_t hk, float *scratch, int64_t max_len) {
    if (a->dtype == 0)
        attend_as(a, b, hk, scratch, max_len, 0); /* specialised: float32 pages read directly */
    else
        attend_as(a, b, hk, scratch, max_len, 1);
}

static int64_t longest(const DecodeArgs *a) {
    int64_t top = 1;
    for (int64_t b = 0; b < a->batch; b++) {
        int64_t len = a->seqlens[b] + (a->k_new != NULL);
        if (len > top) top = len;
    }
    return top;
}

static void *run(void *arg) {
    Work *w = (Work *)arg;
    const DecodeArgs *a = w->a;
    int64_t max_len = longest(a), group = a->heads / a->kv_heads;
    float *scratch = malloc(sizeof(float) * group * (a->dim + max_len));
    if (scratch == NULL) {
        w->status = 1;
        return NULL;
    }
    for (int64_t task = w->first; task < w->last; task++)
        attend(a, task / a->kv_heads, task % a->kv_heads, scratch, max_len);
    free(scratch);
    return NULL;
}

#define MAX_THREADS 64

/* Appends the new tokens, then attends; (request, kv head) tasks are split over ``num_threads``
 * threads (the caller asks for one unless the work outweighs starting threads). Returns 0; 1 when a
 * thread's scratch memory could not be allocated (its outputs are then unset); 2 when a request has no
 * block for its new token (nothing is written). */
int paged_decode(const DecodeArgs *a) {
    if (a->k_new != NULL && append(a) != 0) return 2;
    int64_t tasks = a->batch * a->kv_heads;
    if (tasks == 0) return 0;
    int64_t threads = a->num_threads < 1 ? 1 : a->num_threads;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > tasks) threads = tasks;
    int64_t chunk = (tasks + threads - 1) / threads;
    Work work[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int created[MAX_THREADS] = {0};
    for (int64_t i = 0; i < threads; i++) {
        int64_t first = i * chunk, last = first + chunk < tasks ? first + chunk : tasks;
        work[i] = (Work){a, first, last, 0};
    }
    for (int64_t i = 1; i < threads; i++) created[i] = pthread_create(&ids[i], NULL, run, &work[i]) == 0;
    run(&work[0]);
    int status = work[0].status;
    for (int64_t i = 1; i < threads; i++) {
        if (created[i]) pthread_join(ids[i], NULL);
        else run(&work[i]); /* no thread to be had: this one does the work */
        status |= work[i].status;
    }
    return status;
}
