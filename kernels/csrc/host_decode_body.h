/* The kernel body, instantiated by host_decode.c with T (the pool's element type) and NAME. */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define LOAD CAT(load_, NAME)
#define ONE CAT(one_, NAME)
#define DP CAT(DP_, NAME)
#define LOAD4 CAT(load4_, NAME)
#define PAIRED CAT(PAIRED_, NAME)
#define LOADN CAT(loadn_, NAME)

/* One key row against gn query heads (gn a constant where inlined, so the accumulators live in
   registers): x[g] = q_g . k. */
static inline __attribute__((always_inline)) void CAT(qk_, NAME)(
        int gn, const float *restrict qg, const T *restrict kr, int D, float *restrict x) {
    vf a[MAXG];
    for (int g = 0; g < gn; g++) a[g] = (vf){0};
    for (int d = 0; d < D; d += V) {
        vf kv = LOAD(kr + d);
        for (int g = 0; g < gn; g++) a[g] += load_f32(qg + g * D + d) * kv;
    }
    for (int g = 0; g < gn; g++) x[g] = hsum(a[g]);
}

/* Scores of 4 tokens (key rows kr + t * tok) against gn <= 4 query heads: 4 gn dot products
   held in registers, each key vector loaded (and widened) once and each query vector once per
   4 tokens -- 8 loads per 16 multiply-adds where one token against one head takes 2 per 1.
   Writes x[4 g + t] (gn a constant where inlined). */
static inline __attribute__((always_inline)) void CAT(qk4_, NAME)(
        int gn, const float *restrict qg, const T *restrict kr, int64_t tok, int D,
        float *restrict x) {
    vf a[V];
    for (int i = 0; i < V; i++) a[i] = (vf){0};
    for (int d = 0; d < D; d += V) {
        vf k0 = LOAD(kr + d), k1 = LOAD(kr + tok + d), k2 = LOAD(kr + 2 * tok + d),
           k3 = LOAD(kr + 3 * tok + d);
        for (int g = 0; g < gn; g++) {
            vf qv = load_f32(qg + g * D + d);
            a[4 * g] += qv * k0;
            a[4 * g + 1] += qv * k1;
            a[4 * g + 2] += qv * k2;
            a[4 * g + 3] += qv * k3;
        }
    }
    store_f32(x, hsum16(a));
}

/* Scores of nc native vectors of tokens whose keys are stored transposed (kt[d * P + t]: vLLM's
   CPU block layout) against gn query heads: lane t of a[g][c] is token c * VN + t's score, so
   no horizontal sums; each key vector is loaded once for the gn heads and each query element
   once per nc vectors (gn, nc constants where inlined). Writes x[g * nc * VN + t]. */
static inline __attribute__((always_inline)) void CAT(qkt_, NAME)(
        int gn, const float *restrict qg, const T *restrict kt, int P, int D, int nc,
        float *restrict x) {
    vn a[MAXG][2];
    for (int g = 0; g < gn; g++)
        for (int c = 0; c < nc; c++) a[g][c] = (vn){0};
    for (int d = 0; d < D; d++) {
        vn k[2];
        for (int c = 0; c < nc; c++) k[c] = LOADN(kt + (int64_t)d * P + c * VN);
        for (int g = 0; g < gn; g++) {
            float qd = qg[g * D + d];
            for (int c = 0; c < nc; c++) a[g][c] += qd * k[c];
        }
    }
    for (int g = 0; g < gn; g++)
        for (int c = 0; c < nc; c++) storen_f32(x + (g * nc + c) * VN, a[g][c]);
}

/* acc[g] += sum_t w[g][t] v_t for gn <= 4 heads, two native vectors of the head dim per pass:
   pv4_'s tile in registers of VN floats (no pair order), for machines without AVX-512. */
static inline __attribute__((always_inline)) void CAT(pvn_, NAME)(
        int gn, const float *restrict w, int P, const T *restrict vh, int64_t tok, int f0, int n,
        int d0, int D, float *restrict acc) {
    vn a[4][2];
    for (int g = 0; g < gn; g++)
        for (int j = 0; j < 2; j++) a[g][j] = loadn_f32(acc + g * D + d0 + j * VN);
    for (int t = f0; t < n; t++) {
        vn v0 = LOADN(vh + t * tok + d0), v1 = LOADN(vh + t * tok + d0 + VN);
        for (int g = 0; g < gn; g++) {
            float x = w[g * P + t];
            a[g][0] += x * v0;
            a[g][1] += x * v1;
        }
    }
    for (int g = 0; g < gn; g++)
        for (int j = 0; j < 2; j++) storen_f32(acc + g * D + d0 + j * VN, a[g][j]);
}

/* acc[g][:L] += sum_t w[g][t] v_t[:L] over the page's tokens (acc rows D apart), gn heads at
   once, two vectors of the head dim per pass (the last alone when their count is odd); gn a
   constant where inlined: the accumulators live in registers. */
static inline __attribute__((always_inline)) void CAT(pv_, NAME)(
        int gn, const float *restrict w, int P, const T *restrict vh, int64_t tok, int f0, int n,
        int L, int D, float *restrict acc) {
    int d = 0;
    for (; d + 2 * V <= L; d += 2 * V) {
        vf a[MAXG], b[MAXG];
        for (int g = 0; g < gn; g++) {
            a[g] = load_f32(acc + g * D + d);
            b[g] = load_f32(acc + g * D + d + V);
        }
        for (int t = f0; t < n; t++) {
            vf va = LOAD(vh + t * tok + d), vb = LOAD(vh + t * tok + d + V);
            for (int g = 0; g < gn; g++) {
                float x = w[g * P + t];
                a[g] += x * va;
                b[g] += x * vb;
            }
        }
        for (int g = 0; g < gn; g++) {
            store_f32(acc + g * D + d, a[g]);
            store_f32(acc + g * D + d + V, b[g]);
        }
    }
    if (d < L) {  /* a head dim of an odd number of vectors: the last one alone */
        vf a[MAXG];
        for (int g = 0; g < gn; g++) a[g] = load_f32(acc + g * D + d);
        for (int t = f0; t < n; t++) {
            vf va = LOAD(vh + t * tok + d);
            for (int g = 0; g < gn; g++) a[g] += w[g * P + t] * va;
        }
        for (int g = 0; g < gn; g++) store_f32(acc + g * D + d, a[g]);
    }
}

/* acc[g] += sum_t w[g][t] v_t over the page's tokens for gn <= 4 heads, four vectors (64
   elements) of the head dim per pass, in pair order (load4: bf16's even elements, then odd,
   per 32): each value vector loaded once for the gn heads, 16 accumulators in registers (gn a
   constant where inlined). */
static inline __attribute__((always_inline)) void CAT(pv4_, NAME)(
        int gn, const float *restrict w, int P, const T *restrict vh, int64_t tok, int f0, int n,
        int d0, int D, float *restrict acc) {
    vf a[4][4];
    for (int g = 0; g < gn; g++)
        for (int j = 0; j < 4; j++) a[g][j] = load_f32(acc + g * D + d0 + j * V);
    for (int t = f0; t < n; t++) {
        vf v[4];
        LOAD4(vh + t * tok + d0, v);
        for (int g = 0; g < gn; g++) {
            float x = w[g * P + t];
            for (int j = 0; j < 4; j++) a[g][j] += x * v[j];
        }
    }
    for (int g = 0; g < gn; g++)
        for (int j = 0; j < 4; j++) store_f32(acc + g * D + d0 + j * V, a[g][j]);
}

#define CASES(F, ...)                                                                            \
    switch (gn) {                                                                                \
    case 1: F(1, __VA_ARGS__); break;                                                            \
    case 2: F(2, __VA_ARGS__); break;                                                            \
    case 3: F(3, __VA_ARGS__); break;                                                            \
    case 4: F(4, __VA_ARGS__); break;                                                            \
    case 5: F(5, __VA_ARGS__); break;                                                            \
    case 6: F(6, __VA_ARGS__); break;                                                            \
    case 7: F(7, __VA_ARGS__); break;                                                            \
    default: F(8, __VA_ARGS__); break;                                                           \
    }
#define CASES4(F, ...)                                                                           \
    switch (gn) {                                                                                \
    case 1: F(1, __VA_ARGS__); break;                                                            \
    case 2: F(2, __VA_ARGS__); break;                                                            \
    case 3: F(3, __VA_ARGS__); break;                                                            \
    default: F(4, __VA_ARGS__); break;                                                           \
    }

/* Task (b, s_i): pages [lo, hi) of sequence b. Scratch: s [Hq, P] scores, acc [Hq, D], m, l. */
static void CAT(task_, NAME)(const float *restrict q, const T *restrict pool,
        const T *restrict pool2, int layout, const int32_t *idx,
        const int32_t *row_start, const int32_t *row_count, const int32_t *last_len,
        const int32_t *first, float *page_lse, const int32_t *lse_row, int Hkv, int G, int D,
        int P, float scale, float softcap, int splits, int task, float *out_o, float *out_m,
        float *out_l, float *restrict s, float *restrict acc, float *restrict m,
        float *restrict l, uint16_t *restrict qh) {
    int s_i = task % splits, b = task / splits, Hq = Hkv * G;
    int count = row_count[b], per = (count + splits - 1) / splits;
    int lo = s_i * per, hi = lo + per < count ? lo + per : count;
    for (int i = 0; i < Hq; i++) { m[i] = -INFINITY; l[i] = 0.f; }
    memset(acc, 0, sizeof(float) * Hq * D);
    const float *qb = q + (int64_t)b * Hq * D;
    int64_t tok = (int64_t)Hkv * D, half = (int64_t)P * tok;
    /* where a page keeps key (t, h, d) and value (t, h, d): layout 0, tierattn's pages
       [2, P, H_kv, D]: k = page + t tok + h D + d, v = k + half; layout 1, vLLM's CPU blocks
       [H_kv, P, 2 D] (per KV head its keys transposed [D, P], then its values [P, D]):
       k = page + h 2PD + d P + t, v = page + h 2PD + PD + t D + d */
    int64_t vbase = layout ? (int64_t)P * D : half, vhead = layout ? 2 * (int64_t)P * D : D,
            vtok = layout ? D : tok;
    int vec = D % V == 0, blocked = vec && P % V == 0, dp = 0, nc = P % (2 * VN) ? 1 : 2;
    /* a bf16 query (every element's low half zero) on layout 0 is scored by qk4_dp */
    if (DP && blocked && !layout) {
        uint32_t low = 0, u;
        for (int i = 0; i < Hq * D; i++) {
            memcpy(&u, qb + i, 4);
            low |= u & 0xffffu;
            qh[i] = (uint16_t)(u >> 16);
        }
        dp = low == 0;
    }
    for (int j = lo; j < hi; j++) {
        int e = row_start[b] + j;
        int n = j == count - 1 ? last_len[b] : P, f0 = first ? first[e] : 0;
        float *pl = page_lse ? page_lse + (int64_t)lse_row[e] * Hq : 0;
        if (f0 >= n) {  /* padding only: no key */
            if (pl) for (int i = 0; i < Hq; i++) pl[i] = -INFINITY;
            continue;
        }
        /* an entry e >= 0 is page e of the pool, e < 0 page ~e of the second pool */
        const T *kp = idx[e] >= 0 ? pool + (int64_t)idx[e] * 2 * half
                                  : pool2 + (int64_t)~idx[e] * 2 * half, *vp = kp + vbase;
        /* the next page, at a random slot, is fetched into L2 while this one is computed (the
           hardware prefetchers do not cross pages): a few lines per tile of the score and
           value loops, so the fetches overlap the arithmetic instead of stalling it. The
           untiled loops (pages or head dims not a multiple of 16) fetch it after the page:
           they are bound by their arithmetic (8-token pages at 32K: the same rate with the
           fetch before the page, ab_build.txt) */
        const char *pf = 0, *pf_end = 0;
        int64_t pf_n = 0;
        if (j + 1 < hi) {
            pf = (const char *)(idx[e + 1] >= 0 ? pool + (int64_t)idx[e + 1] * 2 * half
                                                : pool2 + (int64_t)~idx[e + 1] * 2 * half);
            pf_end = pf + 2 * half * (int64_t)sizeof(T);
            int64_t steps = blocked ? (int64_t)Hkv * ((G + 3) / 4) * (P / 4 + D / (4 * V))
                                    : 1;
            pf_n = (2 * half * (int64_t)sizeof(T) / 64 + steps - 1) / steps;
        }
#define PF_STEP() do { for (int64_t c_ = 0; c_ < pf_n && pf < pf_end; c_++, pf += 64) \
                           __builtin_prefetch(pf, 0, PF_LOCALITY); } while (0)
        /* scores s[h*G + g][t]: full pages of 16k tokens in tiles of 4 tokens x up to 4 query
           heads of a group (the head's keys stay in L1 across its group); else each key read
           once, scored by its group's query heads */
        if (blocked && layout)  /* transposed keys: tiles of 1-2 vectors x QKT_G heads */
            for (int h = 0; h < Hkv; h++)
                for (int g0 = 0; g0 < G; g0 += QKT_G) {
                    int gn = G - g0 < QKT_G ? G - g0 : QKT_G, i0 = h * G + g0;
                    const float *qg = qb + (int64_t)i0 * D;
                    for (int t0 = 0; t0 < P; t0 += nc * VN) {
                        float x[MAXG * 2 * VN];
                        const T *kt = kp + h * vhead + t0;
                        if (nc == 2) {
                            CASES(CAT(qkt_, NAME), qg, kt, P, D, 2, x)
                        } else {
                            CASES(CAT(qkt_, NAME), qg, kt, P, D, 1, x)
                        }
                        for (int g = 0; g < gn; g++)
                            for (int t = 0; t < nc * VN; t++) {
                                float y = x[g * nc * VN + t] * scale;
                                if (softcap > 0.f) y = softcap * tanhf(y / softcap);
                                s[(i0 + g) * P + t0 + t] = y;
                            }
                        PF_STEP();
                    }
                }
        else if (blocked)
            for (int h = 0; h < Hkv; h++)
                for (int g0 = 0; g0 < G; g0 += 4) {
                    int gn = G - g0 < 4 ? G - g0 : 4, i0 = h * G + g0;
                    const float *qg = qb + (int64_t)i0 * D;
                    for (int t0 = 0; t0 < P; t0 += 4) {
                        float x[V];
#if HAVE_DPBF16
                        if (dp) {
                            CASES4(qk4_dp, qh + (int64_t)i0 * D, qg,
                                   (const uint16_t *)(kp + t0 * tok + h * D), tok, D, x)
                        } else
#endif
                        CASES4(CAT(qk4_, NAME), qg, kp + t0 * tok + h * D, tok, D, x)
                        for (int g = 0; g < gn; g++)
                            for (int t = 0; t < 4; t++) {
                                float y = x[4 * g + t] * scale;
                                if (softcap > 0.f) y = softcap * tanhf(y / softcap);
                                s[(i0 + g) * P + t0 + t] = y;
                            }
                        PF_STEP();
                    }
                }
        for (int t = blocked ? n : f0; t < n; t++)
            for (int h = 0; h < Hkv; h++) {
                if (layout) {  /* transposed keys, a page not a multiple of 16 tokens */
                    const T *kt = kp + h * vhead + t;
                    for (int g = 0; g < G; g++) {
                        const float *qg = qb + (int64_t)(h * G + g) * D;
                        float y = 0.f;
                        for (int d = 0; d < D; d++) y += qg[d] * ONE(kt[(int64_t)d * P]);
                        y *= scale;
                        if (softcap > 0.f) y = softcap * tanhf(y / softcap);
                        s[(h * G + g) * P + t] = y;
                    }
                    continue;
                }
                const T *kr = kp + t * tok + h * D;
                for (int g0 = 0; g0 < G; g0 += MAXG) {
                    int gn = G - g0 < MAXG ? G - g0 : MAXG;
                    const float *qg = qb + (int64_t)(h * G + g0) * D;
                    float x[MAXG];
                    if (vec) {
                        CASES(CAT(qk_, NAME), qg, kr, D, x)
                    } else {
                        for (int g = 0; g < gn; g++) {
                            float y = 0.f;
                            for (int d = 0; d < D; d++) y += qg[g * D + d] * ONE(kr[d]);
                            x[g] = y;
                        }
                    }
                    for (int g = 0; g < gn; g++) {
                        float y = x[g] * scale;
                        if (softcap > 0.f) y = softcap * tanhf(y / softcap);
                        s[(h * G + g0 + g) * P + t] = y;
                    }
                }
            }
        /* the page's softmax per query head, folded into the running state: on whole
           vectors of 16 tokens where the scores came in them (lanes outside [f0, n) set to
           -inf: they weigh 0), else token by token */
        float pm[Hq];
        if (blocked) {
            for (int i = 0; i < Hq; i++) {
                float *si = s + i * P;
                for (int t = 0; t < f0; t++) si[t] = -INFINITY;
                for (int t = n; t < P; t++) si[t] = -INFINITY;
                vf mx = load_f32(si);
                for (int c = V; c < P; c += V) mx = vmax(mx, load_f32(si + c));
                float x = hmax(mx);
                vf sum = (vf){0};
                for (int c = 0; c < P; c += V) {
                    vf e = vexp(load_f32(si + c) - x);
                    sum += e;
                    store_f32(si + c, e);
                }
                float ps = hsum(sum);
                if (pl) pl[i] = x + logf(ps);
                float mn = m[i] > x ? m[i] : x;
                float alpha = expf(m[i] - mn), beta = expf(x - mn);  /* alpha 0 on a first page */
                l[i] = l[i] * alpha + ps * beta;
                m[i] = mn;
                if (beta != 1.f)
                    for (int c = 0; c < P; c += V) store_f32(si + c, load_f32(si + c) * beta);
                if (alpha != 1.f)
                    for (int d = 0; d < D; d += V)
                        store_f32(acc + i * D + d, load_f32(acc + i * D + d) * alpha);
            }
        } else {
        for (int i = 0; i < Hq; i++) {
            float *si = s + i * P, x = -INFINITY;
            for (int t = f0; t < n; t++) x = si[t] > x ? si[t] : x;
            for (int t = f0; t < n; t++) si[t] -= x;
            pm[i] = x;
        }
        int all = Hq * P, full = all - all % V;  /* lanes outside [f0, n) are never read */
        for (int c = 0; c < full; c += V) store_f32(s + c, vexp(load_f32(s + c)));
        for (int c = full; c < all; c++) s[c] = expf(s[c]);
        for (int i = 0; i < Hq; i++) {
            float *si = s + i * P, ps = 0.f;
            for (int t = f0; t < n; t++) ps += si[t];
            if (pl) pl[i] = pm[i] + logf(ps);
            float mn = m[i] > pm[i] ? m[i] : pm[i];
            float alpha = expf(m[i] - mn), beta = expf(pm[i] - mn);  /* alpha 0 on a first page */
            l[i] = l[i] * alpha + ps * beta;
            m[i] = mn;
            for (int t = f0; t < n; t++) si[t] *= beta;
            if (alpha != 1.f) for (int d = 0; d < D; d++) acc[i * D + d] *= alpha;
        }
        }
        /* acc += p V, the group's accumulators held in registers over the page's tokens */
        for (int h = 0; h < Hkv; h++) {
            const T *vh0 = vp + h * vhead;
            if (blocked && !WIDE_REGS) {  /* native-width tiles: 2 VN x <= 4 heads */
                for (int g0 = 0; g0 < G; g0 += 4) {
                    int gn = G - g0 < 4 ? G - g0 : 4, i0 = h * G + g0;
                    for (int d0 = 0; d0 < D; d0 += 2 * VN) {
                        CASES4(CAT(pvn_, NAME), s + i0 * P, P, vh0, vtok, f0, n, d0, D,
                               acc + i0 * D)
                        PF_STEP();
                    }
                }
                continue;
            }
            if (blocked) {
                for (int g0 = 0; g0 < G; g0 += 4) {
                    int gn = G - g0 < 4 ? G - g0 : 4, i0 = h * G + g0, d0 = 0;
                    for (; d0 + 4 * V <= D; d0 += 4 * V) {
                        CASES4(CAT(pv4_, NAME), s + i0 * P, P, vh0, vtok, f0, n, d0, D,
                               acc + i0 * D)
                        PF_STEP();
                    }
                    if (d0 < D)  /* the head dim's last 1-3 vectors */
                        CASES(CAT(pv_, NAME), s + i0 * P, P, vh0 + d0, vtok, f0, n, D - d0, D,
                              acc + i0 * D + d0)
                }
                continue;
            }
            for (int g0 = 0; g0 < G; g0 += MAXG) {
                int gn = G - g0 < MAXG ? G - g0 : MAXG, i0 = h * G + g0;
                if (vec) {
                    CASES(CAT(pv_, NAME), s + i0 * P, P, vh0, vtok, f0, n, D, D, acc + i0 * D)
                } else {
                    for (int t = f0; t < n; t++)
                        for (int g = 0; g < gn; g++) {
                            float w = s[(i0 + g) * P + t], *ag = acc + (i0 + g) * D;
                            for (int d = 0; d < D; d++) ag[d] += w * ONE(vh0[t * vtok + d]);
                        }
                }
            }
        }
        for (; pf < pf_end; pf += 64) __builtin_prefetch(pf, 0, PF_LOCALITY);  /* the rest */
#undef PF_STEP
    }
    int64_t o = ((int64_t)b * splits + s_i) * Hq;
    if (PAIRED && blocked && WIDE_REGS)  /* pv4's 64-element chunks accumulated in pair order */
        for (int i = 0; i < Hq; i++) from_pairs(acc + (int64_t)i * D, D - D % (4 * V));
    memcpy(out_m + o, m, sizeof(float) * Hq);
    memcpy(out_l + o, l, sizeof(float) * Hq);
    memcpy(out_o + o * D, acc, sizeof(float) * Hq * D);
}

/* Returns 0, or 1 when a thread could not allocate its scratch (nothing is then valid). */
int CAT(host_decode_, NAME)(const float *q, const T *pool, const T *pool2, int layout,
        const int32_t *idx,
        const int32_t *row_start, const int32_t *row_count, const int32_t *last_len,
        const int32_t *first, float *page_lse, const int32_t *lse_row, int B, int Hkv, int G,
        int D, int P, float scale, float softcap, int splits, int threads, float *out_o,
        float *out_m, float *out_l, float *out, float *lse) {
    int Hq = Hkv * G, tasks = B * splits, failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        /* scratch: scores, acc, m, l, and the query in bf16 for qk4_dp (Hq * D halves) */
        size_t floats = (size_t)Hq * P + (size_t)Hq * D + 2 * (size_t)Hq +
                        ((size_t)Hq * D + 1) / 2;
        float *buf = malloc(sizeof(float) * floats);
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; t++)
            if (buf)
                CAT(task_, NAME)(q, pool, pool2, layout, idx, row_start, row_count, last_len,
                                 first, page_lse, lse_row, Hkv, G, D, P, scale, softcap,
                                 splits, t, out_o, out_m, out_l, buf, buf + Hq * P,
                                 buf + Hq * P + Hq * D, buf + Hq * P + Hq * D + Hq,
                                 (uint16_t *)(buf + Hq * P + Hq * D + 2 * Hq));
        free(buf);
        /* the splits merged: lse = log sum_k l_k e^{m_k}, out = sum_k acc_k e^{m_k} / sum */
        #pragma omp for
        for (int r = 0; r < B * Hq; r++) {
            int bb = r / Hq, i = r % Hq;
            float mx = -INFINITY, den = 0.f, *od = out + (int64_t)r * D;
            for (int k = 0; k < splits; k++) {
                int64_t o = ((int64_t)bb * splits + k) * Hq + i;
                if (out_l[o] > 0.f && out_m[o] > mx) mx = out_m[o];
            }
            memset(od, 0, sizeof(float) * D);
            if (mx == -INFINITY) { lse[r] = -INFINITY; continue; }
            for (int k = 0; k < splits; k++) {
                int64_t o = ((int64_t)bb * splits + k) * Hq + i;
                if (!(out_l[o] > 0.f)) continue;
                float w = expf(out_m[o] - mx);
                den += w * out_l[o];
                const float *a = out_o + o * D;
                for (int d = 0; d < D; d++) od[d] += w * a[d];
            }
            for (int d = 0; d < D; d++) od[d] /= den;
            lse[r] = mx + logf(den);
        }
    }
    return failed;
}

#undef LOAD
#undef ONE
#undef DP
#undef LOAD4
#undef PAIRED
#undef LOADN
#undef CASES
