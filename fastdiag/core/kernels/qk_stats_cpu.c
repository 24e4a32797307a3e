/* Head statistics from Q and K on the CPU in one fused pass: the native twin of `qk_stats_torch`
 * (same arguments, same sums, the same float64 reference in the tests). Built on first use by
 * `qk_stats_cpu.py` (cc -O3 -march=native; -fopenmp only where PyTorch itself runs on GNU OpenMP, so
 * the threads are PyTorch's own pool; plain pthreads elsewhere, never a second OpenMP pool).
 *
 * Why fused: the torch path makes ~8 passes over every chunk of scores (product, max, x, its floor,
 * 2^x, mass, moment, p, Gram), each an op with its own dispatch and its own trip through memory. Here a
 * tile of RB query rows × all heads is scored into a thread's cache-sized buffer and finished there:
 * scores, row maximum, x = s − max, 2^x, the row's float64 mass and moment, p and the heads' Gram.
 *
 * Precision, as on the torch path (its docstring says why each step is there):
 * - scores in log2 units (q pre-scaled by scale·log2 e), each row shifted by its own maximum, so the top
 *   key's 2^0 is exactly 1 and log Σ exp x = log1p(mass off the top);
 * - the mass, Σ 2^x·x and the Gram's products summed in float32 lanes over blocks of 64 keys (terms of one
 *   sign: 8 roundings at most, relative, ~5e-7) and the blocks in float64; the entropy finished in
 *   float64 per row;
 * - float32 scores only where they cannot be off by more than SCORE_ERROR_BOUND (log2 units, worst case
 *   for this row and head: 2u·(D+2)·max|q_scaled|·max|k|); elsewhere the row is scored again in float64,
 *   as the torch path scores every float32 row. A randomly initialised GPT-2 layer is at ~2^-16; sharp
 *   trained rows (|s| ~ 1e3) take the float64 road, row by row, with no host read.
 * - an additive mask is added in float64 (its own rounding never enters x).
 * NaN and inf propagate into the row's mass (the caller counts a non-finite result as invalid).
 */
#include <math.h>
#include <pthread.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RB 6            /* query rows per register tile */
#define MAX_RT 4        /* register tiles per work item: a key panel loaded from L2 serves them all */
#define KB 16           /* keys per register tile (two 8-float vectors) */
#define LANES 8
#define MAX_THREADS 64

static const double LOG2E = 1.4426950408889634;
static const double LN2 = 0.6931471805599453;

typedef struct {
    const float *q; int64_t q_sb, q_sh, q_st;        /* [B, H, Tq, D], last dim contiguous */
    const float *k; int64_t k_sb, k_sh, k_st;        /* [B, Hk, Tk, D], last dim contiguous */
    const void *mask; int mask_kind;                 /* 0 none, 1 bool (1 = may attend), 2 float32, 3 float64 */
    int64_t m_sb, m_sh, m_st, m_sk;                  /* broadcast dims have stride 0 */
    const uint8_t *rows_ok; int64_t r_sb, r_st;      /* NULL: every row valid */
    const float *lse; int64_t l_sb, l_sh, l_st;      /* NULL: no check; natural-log units */
    int64_t B, H, Hk, Tq, Tk, D;
    int causal;
    double scale;
    double floor2;                                   /* the floor of x = s − max, log2 units */
    double masked;                                   /* a masked key's score (MASKED_SCORE) */
    double mass_tolerance;
    double score_error_bound;
    int nthreads;
} Args;

typedef struct {
    const Args *a;
    int tid;
    const float *kt;      /* shared: [B, Hk, D, ldk] keys transposed, zero-padded to ldk */
    const float *kmax;    /* shared: [B, Hk] max |k| */
    int64_t ldk;
    int64_t rt;           /* register tiles of RB rows per work item */
    double *gram;         /* this thread's [H, H] (upper triangle) */
    double *entropy;      /* [H] */
    float *qs;            /* [rt·RB][D] its query rows, scaled */
    float *p;             /* [H][rt·RB][ldk]: scores, then 2^x, then p */
    double *sd;           /* [ldk] a row's scores in float64 */
    double *qd;           /* [D] a query row in float64, scaled */
    double invalid;
    double f64_rows;
} Work;

/* Eight floats (or ints, or four doubles) as one value: GCC/clang vector extensions, AVX2 where
 * -march=native has it, plain code elsewhere. Loads and stores through memcpy (unaligned). */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline v8f as_f(v8i v) { v8f f; memcpy(&f, &v, sizeof f); return f; }
static inline v8i as_i(v8f v) { v8i i; memcpy(&i, &v, sizeof i); return i; }
static inline v8f select8(v8i m, v8f a, v8f b) { return as_f((as_i(a) & m) | (as_i(b) & ~m)); }
static inline v4d lo4(v8f v) { return __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), v4d); }
static inline v4d hi4(v8f v) { return __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), v4d); }

/* The running largest |x|, lane by lane (abs_max8) or of one value (abs_max1): NaN once any x is NaN. */
static inline v8f abs_max8(v8f x, v8f m) {
    const v8f ax = as_f(as_i(x) & 0x7fffffff);
    return select8((ax > m) | (ax != ax), ax, m);
}

static inline float abs_max1(float x, float m) {
    const float ax = fabsf(x);
    return ax > m || ax != ax ? ax : m;
}

/* The largest of m and v's lanes, NaN when any of them is NaN: a tree of three selects (a loop over the
 * lanes was a chain of eight compare-and-branch steps for every query row and head). */
static inline float max_lanes(v8f v, float m) {
    v8f s = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v = select8((s > v) | (s != s), s, v);
    s = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v = select8((s > v) | (s != s), s, v);
    s = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    v = select8((s > v) | (s != s), s, v);
    return v[0] > m || v[0] != v[0] ? v[0] : m;
}

/* 2^x for x in [floor, 0], finite (the callers track NaN and inf per row): n = x rounded to the nearest
 * integer by the float32 magic-number add (its low bits are n), f = x − n in [−½, ½], 2^f by a
 * polynomial fitted with p(0) = 1 exactly (the top key's term is exactly 1; 1.7 ulp at most), 2^n from
 * n's bits. One scalar and one 8-lane form of the same arithmetic. */
#define EXP2_MAGIC 0x1.8p23f
#define EXP2_POLY(f) (1.0f + (f) * (6.931471824645996e-1f + (f) * (2.4022647738456726e-1f + (f) * \
    (5.550329014658928e-2f + (f) * (9.618373587727547e-3f + (f) * (1.339985174126923e-3f + (f) * 1.537070784252137e-4f))))))

static inline float exp2_one(float x) {
    const float y = x + EXP2_MAGIC, f = x - (y - EXP2_MAGIC);
    int32_t bits;
    memcpy(&bits, &y, sizeof bits);
    bits = (bits - (0x4B400000 - 127)) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return EXP2_POLY(f) * two_n;
}

static inline v8f exp2_v8(v8f x) {
    const v8f y = x + EXP2_MAGIC;
    const v8f f = x - (y - EXP2_MAGIC);
    const v8i two_n = (as_i(y) - (0x4B400000 - 127)) << 23;
    return EXP2_POLY(f) * as_f(two_n);
}

/* out[r][j0 .. j0+KB) = Σ_d qs[r][d] · panel[d][j]: RB × KB float32 sums held in registers, from
 * one panel of KB keys laid out [D][KB] (contiguous: the prefetcher streams it). */
static inline void score_tile(const float *restrict qs, const float *restrict panel, int64_t D,
                              int64_t j0, float *restrict out, int64_t ldo) {
    v8f acc[RB][2];
    for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = (v8f){0};
    const float *kr = panel;
    for (int64_t d = 0; d < D; d++, kr += KB) {
        const v8f k0 = load8(kr), k1 = load8(kr + 8);
        for (int r = 0; r < RB; r++) {
            const float qv = qs[r * D + d];
            acc[r][0] += qv * k0;
            acc[r][1] += qv * k1;
        }
    }
    for (int r = 0; r < RB; r++) {
        store8(out + r * ldo + j0, acc[r][0]);
        store8(out + r * ldo + j0 + 8, acc[r][1]);
    }
}

static inline double mask_at(const Args *a, int64_t b, int64_t h, int64_t i, int64_t j) {
    int64_t off = b * a->m_sb + h * a->m_sh + i * a->m_st + j * a->m_sk;
    if (a->mask_kind == 2) return (double)((const float *)a->mask)[off];
    return ((const double *)a->mask)[off];
}

/* keys per float32 block of a sum whose blocks are then added in float64 */
#define SUM_BLOCK 64

/* One row's x = s − max (floored), 2^x into e (in place of the scores), and its float64 mass and
 * Σ 2^x·x, from float32 scores (no additive mask). Returns the row maximum through *top. */
static void row_from_float(float *e, const uint8_t *allow, int64_t allow_sk, int64_t n, float floor2, float masked,
                           double *top, double *mass, double *moment) {
    if (allow)
        for (int64_t j = 0; j < n; j++) e[j] = allow[j * allow_sk] ? e[j] : masked;
    const int64_t n8 = n / LANES * LANES;
    v8f mx = (v8f){0} - INFINITY;
    v8i nan8 = {0};
    for (int64_t j = 0; j < n8; j += LANES) {
        v8f v = load8(e + j);
        mx = select8(v > mx, v, mx);
        nan8 |= v != v;
    }
    float m = -INFINITY;
    int nan = 0;
    for (int l = 0; l < LANES; l++) { m = mx[l] > m ? mx[l] : m; nan |= nan8[l]; }
    for (int64_t j = n8; j < n; j++) { m = e[j] > m ? e[j] : m; nan |= e[j] != e[j]; }
    /* a NaN score, or an infinite top (inf − inf): the row is NaN, whatever 2^x gave below */
    nan |= !(m < INFINITY);
    /* the mass and moment in float32 lanes over blocks of SUM_BLOCK keys (terms of one sign: 8 roundings
     * at most per block, relative), the blocks in float64 */
    v4d ms = {0}, mo = {0};
    const v8f fl = (v8f){0} + floor2;
    for (int64_t j0 = 0; j0 < n8; j0 += SUM_BLOCK) {
        const int64_t end = j0 + SUM_BLOCK < n8 ? j0 + SUM_BLOCK : n8;
        v8f msf = {0}, mof = {0};
        for (int64_t j = j0; j < end; j += LANES) {
            v8f x = load8(e + j) - m;
            x = select8(x < fl, fl, x);
            const v8f ex = exp2_v8(x);
            store8(e + j, ex);
            msf += ex;
            mof += ex * x;
        }
        ms += lo4(msf) + hi4(msf);
        mo += lo4(mof) + hi4(mof);
    }
    double msum = (ms[0] + ms[1]) + (ms[2] + ms[3]), mom = (mo[0] + mo[1]) + (mo[2] + mo[3]);
    for (int64_t j = n8; j < n; j++) {
        float x = e[j] - m;
        x = x < floor2 ? floor2 : x;
        float ex = exp2_one(x);
        e[j] = ex;
        msum += (double)ex;
        mom += (double)(ex * x);
    }
    *top = (double)m; *mass = nan ? NAN : msum; *moment = nan ? NAN : mom;
}

static inline v4d load4d(const float *p) { v4f v; memcpy(&v, p, sizeof v); return __builtin_convertvector(v, v4d); }

/* Σ_j x_j y_j over `width` (a multiple of LANES) floats, all terms ≥ 0: fused multiply-adds into
 * float32 lanes over blocks of SUM_BLOCK keys (each block's sum within SUM_BLOCK / LANES float32
 * roundings, relative: 8 u ≈ 5e-7), the blocks summed in float64. Converting every product to float64
 * instead cost twice the instructions. */
static inline double dot_f64(const float *x, const float *y, int64_t width) {
    double total = 0.0;
    for (int64_t j0 = 0; j0 < width; j0 += SUM_BLOCK) {
        const int64_t end = j0 + SUM_BLOCK < width ? j0 + SUM_BLOCK : width;
        v8f acc0 = {0}, acc1 = {0};
        int64_t j = j0;
        for (; j + 2 * LANES <= end; j += 2 * LANES) {
            acc0 += load8(x + j) * load8(y + j);
            acc1 += load8(x + j + LANES) * load8(y + j + LANES);
        }
        if (j < end) acc0 += load8(x + j) * load8(y + j);
        const v4d s = (lo4(acc0) + hi4(acc0)) + (lo4(acc1) + hi4(acc1));
        total += (s[0] + s[1]) + (s[2] + s[3]);
    }
    return total;
}

/* The same from float64 scores (scored again in float64, or with an additive mask added). */
static void row_from_double(const double *restrict s, int64_t n, double floor2, float *restrict e,
                            double *top, double *mass, double *moment) {
    double m = -INFINITY;
    int nan = 0;
    for (int64_t j = 0; j < n; j++) { m = s[j] > m ? s[j] : m; nan |= s[j] != s[j]; }
    double msum = 0.0, mom = 0.0;
    for (int64_t j = 0; j < n; j++) {
        double xd = s[j] - m;
        float x = (float)(xd < floor2 ? floor2 : xd);
        float ex = exp2_one(x);
        e[j] = ex;
        msum += (double)ex;
        mom += (double)(ex * x);
    }
    nan |= !isfinite(m);          /* a NaN score, or an infinite top (inf − inf) */
    *top = nan ? NAN : m; *mass = nan ? NAN : msum; *moment = nan ? NAN : mom;
}

/* K [Tk, D] of each (batch, key head) as panels [ldk / KB][D][KB] (zero keys past Tk), and its
 * largest |k| (NaN if any is NaN). The maximum runs 8 lanes wide: a scalar running maximum is one
 * compare-and-select chain through every element, which made this copy a fifth of the kernel's time. */
static void transpose_keys(const Args *a, float *kt_all, float *kmax_all, int64_t ldk, int64_t first,
                           int64_t step) {
    const int64_t D = a->D, d8 = D / LANES * LANES;
    for (int64_t bh = first; bh < a->B * a->Hk; bh += step) {
        int64_t b = bh / a->Hk, hk = bh % a->Hk;
        const float *k = a->k + b * a->k_sb + hk * a->k_sh;
        float *kt = kt_all + bh * D * ldk;
        v8f mx8 = {0};
        float kmax = 0.0f;
        for (int64_t j = 0; j < a->Tk; j++) {
            float *panel = kt + (j / KB) * D * KB + j % KB;
            const float *kr = k + j * a->k_st;
            for (int64_t d = 0; d < d8; d += LANES) {
                mx8 = abs_max8(load8(kr + d), mx8);
            }
            for (int64_t d = d8; d < D; d++) kmax = abs_max1(kr[d], kmax);
            for (int64_t d = 0; d < D; d++) panel[d * KB] = kr[d];
        }
        kmax = max_lanes(mx8, kmax);
        for (int64_t j = a->Tk; j < ldk; j++)
            for (int64_t d = 0; d < D; d++) kt[(j / KB) * D * KB + d * KB + j % KB] = 0.0f;
        kmax_all[bh] = kmax;
    }
}

/* The keys scored for row r of the work item starting at row i0: all of them, or under a causal mask
 * those up to the end of the row's register tile (a whole number of tiles; the row's own future keys
 * among them are cut at n, below). */
static inline int64_t tile_keys(const Args *a, int64_t i0, int64_t r) {
    if (!a->causal) return a->Tk;
    const int64_t end = i0 + (r / RB + 1) * RB;
    return end < a->Tk ? end : a->Tk;
}

static void *run(void *arg) {
    Work *w = (Work *)arg;
    const Args *a = w->a;
    const int64_t H = a->H, D = a->D, Tq = a->Tq, Tk = a->Tk, ldk = w->ldk, group = a->H / a->Hk;
    const double c = a->scale * LOG2E;
    const float cf = (float)c;      /* scores in log2 units; its rounding is one more u in the bound's D + 2 */
    const float floor2 = (float)a->floor2;
    const float u = 0x1p-24f;
    const int64_t RI = w->rt * RB;                          /* query rows per work item */
    float *qs = w->qs, *p = w->p;
    double *sd = w->sd, *qd = w->qd;
    const int64_t blocks = (Tq + RI - 1) / RI;
    for (int64_t item = w->tid; item < a->B * blocks; item += a->nthreads) {
        /* the last blocks first across threads: under a causal mask they hold the most keys */
        const int64_t blk = blocks - 1 - item / a->B, b = item % a->B;
        const int64_t i0 = blk * RI, rows = Tq - i0 < RI ? Tq - i0 : RI;
        const int64_t tiles = (tile_keys(a, i0, RI - 1) + KB - 1) / KB;
        float qmax[MAX_RT * RB];
        for (int64_t h = 0; h < H; h++) {
            const int64_t hk = h / group;
            for (int64_t r = 0; r < RI; r++) {
                float mx = 0.0f;
                if (r < rows) {
                    const float *qr = a->q + b * a->q_sb + h * a->q_sh + (i0 + r) * a->q_st;
                    float *qd = qs + r * D;
                    const int64_t d8 = D / LANES * LANES;
                    v8f mx8 = {0};
                    for (int64_t d = 0; d < d8; d += LANES) {
                        const v8f v = load8(qr + d) * cf;
                        store8(qd + d, v);
                        mx8 = abs_max8(v, mx8);
                    }
                    mx = max_lanes(mx8, mx);
                    for (int64_t d = d8; d < D; d++) {
                        const float v = qr[d] * cf;
                        qd[d] = v;
                        mx = abs_max1(v, mx);
                    }
                } else {
                    for (int64_t d = 0; d < D; d++) qs[r * D + d] = 0.0f;
                }
                qmax[r] = mx;
            }
            float *ph = p + h * RI * ldk;
            const float *kt = w->kt + (b * a->Hk + hk) * D * ldk;
            for (int64_t t = 0; t < tiles; t++)
                for (int64_t g = 0; g * RB < rows; g++)
                    if (t * KB < tile_keys(a, i0, g * RB))
                        score_tile(qs + g * RB * D, kt + t * D * KB, D, t * KB, ph + g * RB * ldk, ldk);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t i = i0 + r;
                const int64_t width = (tile_keys(a, i0, r) + LANES - 1) / LANES * LANES;   /* zero past the row's keys */
                float *e = ph + r * ldk;
                const int ok = a->rows_ok ? a->rows_ok[b * a->r_sb + i * a->r_st] != 0 : 1;
                const int64_t n = a->causal ? (i + 1 < Tk ? i + 1 : Tk) : Tk;
                if (!ok) {
                    for (int64_t j = 0; j < width; j++) e[j] = 0.0f;
                    continue;
                }
                /* worst-case error of a float32 score here, log2 units (both scores of x = s − max) */
                const double bound = 2.0 * u * (double)(D + 2) * (double)qmax[r] * (double)w->kmax[b * a->Hk + hk];
                const int wide = !(bound <= a->score_error_bound);
                double top, mass, moment;
                if (!wide && a->mask_kind <= 1) {
                    const uint8_t *allow = a->mask_kind == 1
                        ? (const uint8_t *)a->mask + b * a->m_sb + h * a->m_sh + i * a->m_st : NULL;
                    row_from_float(e, allow, a->m_sk, n, floor2, (float)a->masked, &top, &mass, &moment);
                } else {
                    if (wide) {        /* this row scored again in float64 */
                        const float *qr = a->q + b * a->q_sb + h * a->q_sh + i * a->q_st;
                        const float *kh = a->k + b * a->k_sb + hk * a->k_sh;
                        const int64_t d8 = D / LANES * LANES;
                        for (int64_t d = 0; d < D; d++) qd[d] = (double)qr[d] * c;
                        for (int64_t j = 0; j < n; j++) {
                            const float *kr = kh + j * a->k_st;
                            v4d acc0 = {0}, acc1 = {0};
                            for (int64_t d = 0; d < d8; d += LANES) {
                                v4d q0, q1;
                                memcpy(&q0, qd + d, sizeof q0);
                                memcpy(&q1, qd + d + 4, sizeof q1);
                                acc0 += q0 * load4d(kr + d);
                                acc1 += q1 * load4d(kr + d + 4);
                            }
                            const v4d acc = acc0 + acc1;
                            double sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
                            for (int64_t d = d8; d < D; d++) sum += qd[d] * (double)kr[d];
                            sd[j] = sum;
                        }
                        w->f64_rows += 1.0;
                    } else {
                        for (int64_t j = 0; j < n; j++) sd[j] = (double)e[j];
                    }
                    if (a->mask_kind == 1) {
                        const uint8_t *allow = (const uint8_t *)a->mask + b * a->m_sb + h * a->m_sh + i * a->m_st;
                        for (int64_t j = 0; j < n; j++) if (!allow[j * a->m_sk]) sd[j] = a->masked;
                    } else if (a->mask_kind >= 2) {
                        for (int64_t j = 0; j < n; j++) {
                            double m = mask_at(a, b, h, i, j) * LOG2E;
                            sd[j] += m < a->masked ? a->masked : m;   /* NaN stays NaN */
                        }
                    }
                    row_from_double(sd, n, a->floor2, e, &top, &mass, &moment);
                }
                const float inv = (float)(1.0 / mass);
                for (int64_t j = 0; j < n; j++) e[j] *= inv;            /* e is p now */
                for (int64_t j = n; j < width; j++) e[j] = 0.0f;
                const double log_mass = log1p(mass - 1.0);              /* L = lse − max, nats */
                w->entropy[h] += log_mass - moment * (LN2 / mass);      /* Σ p (L − x), x in nats */
                if (a->lse) {
                    const double lse = (double)a->lse[b * a->l_sb + h * a->l_sh + i * a->l_st];
                    const double off_mass = exp(top * LN2 + log_mass - lse);   /* Σ exp(s − lse) */
                    if (!(fabs(off_mass - 1.0) <= a->mass_tolerance)) w->invalid += 1.0;
                }
            }
        }
        /* the heads' Gram over this tile's rows: Σ_j p_h p_h' (float32 blocks, float64 across them) */
        for (int64_t r = 0; r < rows; r++) {
            const int64_t width = (tile_keys(a, i0, r) + LANES - 1) / LANES * LANES;
            for (int64_t h = 0; h < H; h++) {
                const float *x = p + (h * RI + r) * ldk;
                for (int64_t g = h; g < H; g++) {
                    const float *y = p + (g * RI + r) * ldk;
                    const double sum = dot_f64(x, y, width);
                    w->gram[h * H + g] += sum;
                }
            }
        }
    }
    return NULL;
}

static pthread_mutex_t workspace_lock = PTHREAD_MUTEX_INITIALIZER;
static char *workspace_buf = NULL;
static size_t workspace_size = 0;

/* A whole number of 64-byte lines, at least one (aligned_alloc's contract; an empty batch). */
static inline size_t lines(size_t bytes) { return (bytes / 64 + 1) * 64; }

/* The kept workspace, grown to at least `bytes` (64-byte aligned); NULL when memory ran out. Called
 * with workspace_lock held. */
static char *workspace(size_t bytes) {
    if (bytes > workspace_size) {
        free(workspace_buf);
        workspace_buf = aligned_alloc(64, lines(bytes));
        workspace_size = workspace_buf ? lines(bytes) : 0;
    }
    return workspace_buf;
}

/* out: [H·H + H + 3] float64 = gram (row-major), entropy per head, rows counted, invalid, rows scored
 * again in float64. Returns 0, or −1 when memory ran out. */
int qk_stats_cpu(const Args *a, double *out) {
    const int n = a->nthreads < 1 ? 1 : (a->nthreads > MAX_THREADS ? MAX_THREADS : a->nthreads);
    Args args = *a;
    args.nthreads = n;
    const int64_t H = a->H;
    const int64_t ldk = (a->Tk + KB - 1) / KB * KB;
    /* register tiles per work item: as many as keep its probabilities ([H][rows][ldk]) within ~256 KB */
    int64_t rt = (int64_t)(262144 / (sizeof(float) * (size_t)(H * RB * ldk)));
    rt = rt < 1 ? 1 : (rt > MAX_RT ? MAX_RT : rt);
    const int64_t RI = rt * RB;
    /* every buffer carved from one workspace kept between calls (a call's ~1 MB of keys and tiles would
     * otherwise be mapped and unmapped by malloc each time: page faults, and a TLB shootdown on the
     * other threads' cores); one call at a time holds it */
    const size_t kt_bytes = lines(sizeof(float) * (size_t)(a->B * a->Hk * a->D * ldk));
    const size_t kmax_bytes = lines(sizeof(float) * (size_t)(a->B * a->Hk));
    const size_t works_bytes = lines(sizeof(Work) * (size_t)n);
    const size_t acc_bytes = lines(sizeof(double) * (size_t)n * (size_t)(H * H + H));
    const size_t qs_bytes = lines(sizeof(float) * (size_t)(RI * a->D)), p_bytes = lines(sizeof(float) * (size_t)(H * RI * ldk));
    const size_t sd_bytes = lines(sizeof(double) * (size_t)ldk), qd_bytes = lines(sizeof(double) * (size_t)a->D);
    const size_t per_thread = qs_bytes + p_bytes + sd_bytes + qd_bytes;
    pthread_mutex_lock(&workspace_lock);
    char *ws = workspace(kt_bytes + kmax_bytes + works_bytes + acc_bytes + (size_t)n * per_thread);
    int status = ws ? 0 : -1;
    float *kt = NULL, *kmax = NULL;
    Work *works = NULL;
    double *acc = NULL;
    if (ws) {
        kt = (float *)ws;
        kmax = (float *)(ws += kt_bytes);
        works = (Work *)(ws += kmax_bytes);
        acc = (double *)(ws += works_bytes);
        ws += acc_bytes;
        memset(acc, 0, acc_bytes);
    }
#ifndef _OPENMP
    pthread_t threads[MAX_THREADS];
#endif
    if (status == 0) {
#ifndef _OPENMP
        transpose_keys(&args, kt, kmax, ldk, 0, 1);
#endif
        for (int t = 0; t < n; t++, ws += per_thread)
            works[t] = (Work){.a = &args, .tid = t, .kt = kt, .kmax = kmax, .ldk = ldk, .rt = rt,
                              .gram = acc + (size_t)t * (H * H + H), .entropy = acc + (size_t)t * (H * H + H) + H * H,
                              .qs = (float *)ws, .p = (float *)(ws + qs_bytes),
                              .sd = (double *)(ws + qs_bytes + p_bytes), .qd = (double *)(ws + qs_bytes + p_bytes + sd_bytes)};
#ifdef _OPENMP
        /* PyTorch's own OpenMP pool (this library is loaded after torch, whose libgomp.so.1 the dynamic
         * linker then reuses): no thread is created and none spins beside ours. A smaller team than asked
         * runs the missing shares itself, so the partition (and the sums) depend on n only. */
#pragma omp parallel num_threads(n)
        {
            const int me = omp_get_thread_num(), team = omp_get_num_threads();
            transpose_keys(&args, kt, kmax, ldk, me, team);
#pragma omp barrier
            for (int t = me; t < n; t += team) run(&works[t]);
        }
#else
        int started = 1;
        while (started < n && pthread_create(&threads[started], NULL, run, &works[started]) == 0) started++;
        run(&works[0]);
        for (int t = started; t < n; t++) run(&works[t]);   /* a thread that could not start: its share here */
        for (int t = 1; t < started; t++) pthread_join(threads[t], NULL);
#endif
    }
    if (status == 0) {
        memset(out, 0, sizeof(double) * (size_t)(H * H + H + 3));
        for (int t = 0; t < n; t++) {       /* in thread order: the same sums for the same inputs */
            for (int64_t x = 0; x < H * H + H; x++) out[x] += works[t].gram[x];
            out[H * H + H + 1] += works[t].invalid;
            out[H * H + H + 2] += works[t].f64_rows;
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t g = 0; g < h; g++) out[h * H + g] = out[g * H + h];
        double rows = 0.0;
        if (a->rows_ok) {
            for (int64_t b = 0; b < a->B; b++)
                for (int64_t i = 0; i < a->Tq; i++) rows += a->rows_ok[b * a->r_sb + i * a->r_st] != 0;
        } else {
            rows = (double)(a->B * a->Tq);
        }
        out[H * H + H] = rows;
        int finite_gram = 1, finite_entropy = 1;
        for (int64_t x = 0; x < H * H; x++) finite_gram &= isfinite(out[x]) != 0;
        for (int64_t h = 0; h < H; h++) finite_entropy &= isfinite(out[H * H + h]) != 0;
        out[H * H + H + 1] += (double)!finite_gram + (double)!finite_entropy;
    }
    pthread_mutex_unlock(&workspace_lock);
    return status;
}
