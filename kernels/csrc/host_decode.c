/* Decode attention over host-memory pages: the compiled kernel of tierattn.kernels.host.
 *
 * host_decode_{f32,bf16,f16}: one query token per sequence over the pages a CSR page table
 * lists in a pool [S, 2, P, H_kv, D] (K then V of a page, every KV head). Tasks are (sequence,
 * split of its pages), run by OpenMP threads; a task reads each of its pages once and folds it
 * into an online softmax per query head; the splits' partial states are merged at the end.
 * The arithmetic is what bounds it (a decode query spends G multiply-adds, G query heads per KV
 * head, on each KV element it reads), so the inner loops are register tiles that load each
 * element once per tile: scores for 4 keys x up to 4 query heads of a group, values for up to 4
 * heads x 64 elements of the head dim; a bf16 query on a bf16 pool is scored with bf16 pair
 * products (vdpbf16ps) where the CPU has them. The next page (at a random slot: the hardware
 * prefetchers stop at page boundaries) is fetched into L2 a few lines per tile. The vector code
 * uses GCC's generic vectors of 16 floats (AVX-512, AVX2 or NEON alike); head dims that are not
 * a multiple of 16 and pages not a multiple of 16 tokens take simpler loops. The body is
 * written once (host_decode_body.h), instantiated per dtype.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define V 16
typedef float vf __attribute__((vector_size(4 * V)));
typedef int32_t vi __attribute__((vector_size(4 * V)));
typedef uint16_t vu16 __attribute__((vector_size(2 * V)));
typedef uint32_t vu32 __attribute__((vector_size(4 * V)));
typedef _Float16 vh __attribute__((vector_size(2 * V)));

static inline vf load_f32(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void store_f32(float *p, vf x) { memcpy(p, &x, sizeof x); }
static inline vf load_bf16(const uint16_t *p) {  /* bf16 is the high half of an fp32 word */
    vu16 x; memcpy(&x, p, sizeof x);
    vu32 w = __builtin_convertvector(x, vu32) << 16;
    vf f; memcpy(&f, &w, sizeof f); return f;
}
static inline vf load_f16(const _Float16 *p) {
    vh x; memcpy(&x, p, sizeof x); return __builtin_convertvector(x, vf);
}
/* 64 elements as four fp32 vectors in "pair order": f32 and f16 in memory order; bf16 per
   32-element block its even elements, then its odd ones -- an element pair is one 32-bit word
   whose high half is the odd element's fp32 bits and whose low half, shifted up, the even
   one's: two integer operations per 32 elements where widening takes a shuffle and a shift
   per 16. Accumulators kept in pair order are put back by from_pairs. */
static inline void load4_f32(const float *p, vf *v) {
    for (int j = 0; j < 4; j++) v[j] = load_f32(p + j * V);
}
static inline void load4_f16(const _Float16 *p, vf *v) {
    for (int j = 0; j < 4; j++) v[j] = load_f16(p + j * V);
}
static inline void load4_bf16(const uint16_t *p, vf *v) {
    for (int j = 0; j < 2; j++) {
        vu32 w, e, o;
        memcpy(&w, p + j * 2 * V, sizeof w);
        e = w << 16;
        o = w & 0xffff0000u;
        memcpy(&v[2 * j], &e, sizeof e);
        memcpy(&v[2 * j + 1], &o, sizeof o);
    }
}
enum { PAIRED_f32 = 0, PAIRED_f16 = 0, PAIRED_bf16 = 1 };
static void from_pairs(float *x, int n) {  /* n elements (a multiple of 32) back in order */
    float y[2 * V];
    for (int d = 0; d < n; d += 2 * V) {
        for (int i = 0; i < V; i++) { y[2 * i] = x[d + i]; y[2 * i + 1] = x[d + V + i]; }
        memcpy(x + d, y, sizeof y);
    }
}
static inline float one_f32(float x) { return x; }
static inline float one_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline float one_f16(_Float16 x) { return (float)x; }
static inline float hsum(vf x) {  /* a tree: four shuffles and adds */
    x += __builtin_shuffle(x, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

static inline vf vsel(vi mask, vf a, vf b) {  /* mask ? a : b, per lane */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* exp of 16 lanes (Cephes' expf: x = k ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r,
   within 2 ulp); lanes below -87.3 (-inf included) give 0, NaN stays NaN. */
static inline vf vexp(vf x) {
    const vf zero = (vf){0}, lo = zero - 87.3f, hi = zero + 88.7f;
    vi under = x < lo;
    x = vsel(x > hi, hi, x);
    vf xs = x * 1.44269504088896341f;
    vf half = vsel(xs < zero, zero - 0.5f, zero + 0.5f);
    vi k = __builtin_convertvector(xs + half, vi);  /* rounded half away from zero */
    vf kf = __builtin_convertvector(k, vf);
    vf r = x - kf * 0.693359375f;
    r = r + kf * 2.12194440e-4f;
    vf z = r * r;
    vf y = 1.9875691500e-4f * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    vi bits = (k + 127) << 23;
    y = y * (vf)bits;
    return vsel(under, zero, y);
}

static inline vf vmax(vf a, vf b) { return vsel(a > b, a, b); }
static inline float hmax(vf x) {  /* the largest lane: the same tree as hsum */
    x = vmax(x, __builtin_shuffle(x, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    x = vmax(x, __builtin_shuffle(x, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    x = vmax(x, __builtin_shuffle(x, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    x = vmax(x, __builtin_shuffle(x, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return x[0];
}

/* The lane sums of 16 vectors, as one vector (lane t = the sum of x[t]): a transposing tree
   of 15 adds and 30 two-source shuffles, where 16 separate hsums take 64 of each. */
static inline vf hsum16(vf *x) {
    static const vi l1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    static const vi l1b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    static const vi l2a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    static const vi l2b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    static const vi l3a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    static const vi l3b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    static const vi l4a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    static const vi l4b = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf u[8], v[4], w[2];
    for (int i = 0; i < 8; i++)
        u[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], l1a) +
               __builtin_shuffle(x[2 * i], x[2 * i + 1], l1b);
    for (int i = 0; i < 4; i++)
        v[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], l2a) +
               __builtin_shuffle(u[2 * i], u[2 * i + 1], l2b);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], l3a) +
               __builtin_shuffle(v[2 * i], v[2 * i + 1], l3b);
    return __builtin_shuffle(w[0], w[1], l4a) + __builtin_shuffle(w[0], w[1], l4b);
}

#ifndef PF_LOCALITY
#define PF_LOCALITY 2  /* software prefetches of the next page go to L2 (prefetcht1) */
#endif
/* bf16 scores by vdpbf16ps (AVX512-BF16): 32 products of bf16 pairs summed into 16 fp32 lanes in
   one instruction, half the multiply-adds of widening the keys -- used when the query itself is
   bf16 (every fp32 query element's low 16 bits zero), so each product is exact as before */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_DPBF16 1
static inline __attribute__((always_inline)) void qk4_dp(
        int gn, const uint16_t *restrict qh, const float *restrict qg,
        const uint16_t *restrict kr, int64_t tok, int D, float *restrict x) {
    __m512 a[V];
    for (int i = 0; i < V; i++) a[i] = _mm512_setzero_ps();
    int d = 0;
    for (; d + 2 * V <= D; d += 2 * V) {
        __m512bh k[4];
        for (int t = 0; t < 4; t++) k[t] = (__m512bh)_mm512_loadu_si512(kr + t * tok + d);
        for (int g = 0; g < gn; g++) {
            __m512bh qv = (__m512bh)_mm512_loadu_si512(qh + g * D + d);
            for (int t = 0; t < 4; t++) a[4 * g + t] = _mm512_dpbf16_ps(a[4 * g + t], qv, k[t]);
        }
    }
    vf b[V];
    memcpy(b, a, sizeof b);
    if (d < D)  /* a tail of 16: widened */
        for (int g = 0; g < gn; g++) {
            vf qv = load_f32(qg + g * D + d);
            for (int t = 0; t < 4; t++) b[4 * g + t] += qv * load_bf16(kr + t * tok + d);
        }
    store_f32(x, hsum16(b));
}
#else
#define HAVE_DPBF16 0
#endif
enum { DP_f32 = 0, DP_f16 = 0, DP_bf16 = HAVE_DPBF16 };  /* which pools may take qk4_dp */

#define MAXG 8  /* query heads of a group scored per pass over a key (vector registers) */
/* The native vector: VN floats in one register (AVX-512: 16, of 32 registers; else 8: AVX2's
   16 registers, NEON's pairs). The generic 16-float vectors above serve AVX-512 well; elsewhere
   a tile of them spills (GCC emulates a 64-byte vector in two halves and memory), so the
   transposed-key scores and, without AVX-512, the value sums are tiled in native vectors. */
#if defined(__AVX512F__)
#define VN 16
#define WIDE_REGS 1
#else
#define VN 8
#define WIDE_REGS 0
#endif
#define QKT_G (WIDE_REGS ? 8 : 4)  /* query heads per transposed-key score tile */
typedef float vn __attribute__((vector_size(4 * VN)));
typedef uint16_t vn16 __attribute__((vector_size(2 * VN)));
typedef uint32_t vn32 __attribute__((vector_size(4 * VN)));
typedef _Float16 vnh __attribute__((vector_size(2 * VN)));
static inline vn loadn_f32(const float *p) { vn x; memcpy(&x, p, sizeof x); return x; }
static inline void storen_f32(float *p, vn x) { memcpy(p, &x, sizeof x); }
static inline vn loadn_bf16(const uint16_t *p) {
    vn16 x; memcpy(&x, p, sizeof x);
    vn32 w = __builtin_convertvector(x, vn32) << 16;
    vn f; memcpy(&f, &w, sizeof f); return f;
}
static inline vn loadn_f16(const _Float16 *p) {
    vnh x; memcpy(&x, p, sizeof x); return __builtin_convertvector(x, vn);
}

#define T float
#define NAME f32
#include "host_decode_body.h"
#undef T
#undef NAME
#define T uint16_t
#define NAME bf16
#include "host_decode_body.h"
#undef T
#undef NAME
#define T _Float16
#define NAME f16
#include "host_decode_body.h"

/* The plain read the host kernel is measured against: every byte of the pages a table lists,
   with the same tasks and threads, summed as 32-bit words (no arithmetic worth the name). */
uint32_t host_read(const uint8_t *pool, const int32_t *idx, const int32_t *row_start,
                   const int32_t *row_count, int B, int64_t page_bytes, int splits,
                   int threads) {
    uint32_t total = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(^ : total)
    for (int task = 0; task < B * splits; task++) {
        int s_i = task % splits, b = task / splits, count = row_count[b];
        int per = (count + splits - 1) / splits, lo = s_i * per;
        int hi = lo + per < count ? lo + per : count;
        vu32 acc = (vu32){0};
        for (int j = lo; j < hi; j++) {
            const uint8_t *p = pool + (int64_t)idx[row_start[b] + j] * page_bytes;
            int64_t n = page_bytes / sizeof(vu32), i = 0;
            for (; i < n; i++) { vu32 x; memcpy(&x, p + i * sizeof x, sizeof x); acc += x; }
        }
        for (int i = 0; i < V; i++) total ^= acc[i];
    }
    return total;
}
