/* A grammar's token bitmask applied to float32 logits on the CPU, in one pass (kernels/cpu_bitmask.py).
 *
 * Built by cpu_native.build (the attention kernels' flags: -O3 -march=native, no fast-math: -inf and NaN keep
 * IEEE semantics) and called through ctypes with the GIL released. Plain C that the compiler vectorises: each
 * 32-bit word becomes 32 lanes of a 0 / -inf bias added in place, no temporaries.
 *
 *   logits: rows of ``vocab`` floats, ``row_stride`` floats apart (rows[i], or i when rows is NULL, for bits row i);
 *   bits:   n rows of ``words`` uint32 words, bit t % 32 of word t / 32 set where token t is allowed.
 * Adding -inf (not storing it) is the torch and numpy ways' semantics: a NaN logit stays NaN, a forbidden +inf
 * becomes NaN. The caller checks every shape and index: this code trusts them.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

void apply_bitmask_f32(float *logits, int64_t row_stride, int64_t vocab, const uint32_t *bits, int64_t words,
                       const int64_t *rows, int64_t n) {
    const int64_t full = vocab / 32;
    for (int64_t i = 0; i < n; i++) {
        float *row = logits + (rows != NULL ? rows[i] : i) * row_stride;
        const uint32_t *w = bits + i * words;
        for (int64_t k = 0; k < full; k++) {
            const uint32_t m = w[k];
            float *p = row + 32 * k;
            for (int b = 0; b < 32; b++) p[b] += ((m >> b) & 1u) ? 0.0f : -INFINITY;
        }
        for (int64_t t = 32 * full; t < vocab; t++) row[t] += ((w[t >> 5] >> (t & 31)) & 1u) ? 0.0f : -INFINITY;
    }
}
