/* Native CPU kernels of the codecs (embedded, sign_tail; fp32 and bf16 as plain copies):
 * one pass per span while it is in cache — prescale, sign flip, Walsh–Hadamard butterflies, per-packet scale,
 * quantization, plane packing — and the inverse.
 *
 * Bit-exact with the torch reference (trimlab.codec.*), which defines the arithmetic:
 *   - butterflies stage by stage, h = 1, 2, 4, ... (a+b, a-b), then × (float)(1/√n);
 *   - per-packet sums in 32 lanes, row after row, then folded 16, 8, 4, 2, 1;
 *   - embedded: q = number of thresholds T[j] ≤ z (one shared table), found from a guess
 *     (a cubic per cell; with AVX-512 a polynomial per half-unit of |z|) and corrected by
 *     comparisons, so the guess's rounding never shows;
 *   - no contraction into FMA (built with -ffp-contract=off), no fast-math; the FMAs
 *     written out either cannot change a result (v·(±1) + w: the product is exact) or
 *     only feed a guess that comparisons correct.
 * Built by trimlab.native at first use; loaded with ctypes by trimlab.codec.kernels. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define TL_AVX512 1
#if defined(__GFNI__) && defined(__AVX512VBMI__)
#define TL_GFNI 1 /* 8×8 bit transposes (gf2p8affineqb) and byte permutes (vpermb) */
#endif
#endif

/* One vector width for the span passes (butterflies, flips, scales): 16 floats a register
   with AVX-512, 8 with AVX2; TL_IN_REGISTER butterfly stages inside a register. */
#if defined(TL_AVX512)
#define TL_VEC 16
#define TL_IN_REGISTER 4
#define TL_FIRST_STAGES 4
#define TL_PASS_STAGES 2
typedef __m512 vf;
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
#define TL_VEC 8
#define TL_IN_REGISTER 3
#define TL_FIRST_STAGES 3
#define TL_PASS_STAGES 3
typedef __m256 vf;
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
#endif

/* the wire's codec ids (the header's codec field; each Codec's codec_id) */
#define FP32 1
#define BF16 2
#define SIGN_TAIL 3
#define EMBEDDED 4
#define QBITS 16
#define POLY_LO (-8.0f)
#define POLY_PER_UNIT 16
#define POLY_CELLS 256

typedef struct {
    int codec;             /* EMBEDDED or SIGN_TAIL */
    int rotated, prescaled, planes, unbiased;
    uint64_t seed, step, bucket;
    int64_t first_span, count, filled, size, coords;
    const float *thresholds; /* embedded encode: T[0..2^16], T[0] = -inf, T[2^16] = +inf */
    const float *poly;       /* embedded encode: 4 coefficients per cell */
    const float *table;      /* embedded decode: centroid of v = (q << 1) | marker */
    const float *fine;       /* embedded decode: the finest level's, fine[q] = table[2q + 1] (one
                                cache line holds 16 of them, not 8: whole packets gather here) */
    /* encode */
    const float *x;          /* the group's first coordinate */
    uint8_t *body;           /* packet rows */
    int64_t width;           /* body bytes per row (encode zero-fills a row to it) */
    int64_t stride;          /* bytes from one row to the next (≥ width: rows may sit in frames) */
    int64_t row_full, row_tail; /* first row of the full-packet block, of the tail block */
    float *scale;            /* per row, the header scale */
    /* decode */
    const int64_t *slots;    /* per (span, packet in span): its row, or -1 */
    const int64_t *length;   /* per row: body bytes present */
    const float *row_scale;  /* per row: the header scale, ÷ 2^(span exponent) if exps is given */
    const int32_t *exps;     /* per span of the group: that exponent; NULL: the kernel derives it */
    float *out;              /* the group's first output coordinate */
} job_t;

/* -- the RHT's signs: splitmix64 span keys, murmur3's fmix32 per 32 coordinates ---------- */
static uint64_t splitmix64(uint64_t h) {
    h += 0x9E3779B97F4A7C15ull;
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    return h ^ (h >> 31);
}

uint64_t tl_span_key(uint64_t seed, uint64_t step, uint64_t bucket, uint64_t span) {
    uint64_t h = 0;
    h = splitmix64(h ^ seed);
    h = splitmix64(h ^ step);
    h = splitmix64(h ^ bucket);
    return splitmix64(h ^ span);
}

static uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

static void scale_by(float *y, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) y[i] *= s;
}

static void flip_signs(float *y, int64_t n, uint64_t key) {
    uint32_t k1 = (uint32_t)key, k2 = (uint32_t)(key >> 32);
    uint32_t *w = (uint32_t *)y;
    for (int64_t word = 0; word < n / 32; word++) {
        uint32_t h = fmix32(fmix32((uint32_t)word * 0x9E3779B1u ^ k1) ^ k2);
        uint32_t *v = w + 32 * word;
#ifdef TL_AVX512
        /* bit t of h flips coordinate t: the hash word is the two registers' lane mask */
        const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
        __m512i a = _mm512_loadu_si512(v), b = _mm512_loadu_si512(v + 16);
        _mm512_storeu_si512(v, _mm512_mask_xor_epi32(a, (__mmask16)h, a, sign));
        _mm512_storeu_si512(v + 16, _mm512_mask_xor_epi32(b, (__mmask16)(h >> 16), b, sign));
#else
        for (int t = 0; t < 32; t++) v[t] ^= ((h >> t) & 1u) << 31;
#endif
    }
}

/* -- Walsh–Hadamard butterflies, stage order fixed ---------------------------------------- */
#ifdef TL_VEC
/* The in-register stages (h = 1 .. TL_VEC/2): lane i pairs with lane i ^ h; the lower
   lane gets a + b, the upper a − b (a the lower lane's value), as the scalar loop does:
   partner + v·(±1), one rounding, the product exact. Each partner comes from the cheapest
   shuffle that reaches it (within 128-bit blocks for h = 1, 2; whole blocks above): a full
   lane permute for every stage made the AVX-512 butterflies 10–15 % slower. */
#ifdef TL_AVX512
static inline vf bfly_in_register(vf v, const vf sign[TL_IN_REGISTER]) {
    v = _mm512_fmadd_ps(v, sign[0], _mm512_permute_ps(v, 0xB1));
    v = _mm512_fmadd_ps(v, sign[1], _mm512_permute_ps(v, 0x4E));
    v = _mm512_fmadd_ps(v, sign[2], _mm512_shuffle_f32x4(v, v, 0xB1));
    return _mm512_fmadd_ps(v, sign[3], _mm512_shuffle_f32x4(v, v, 0x4E));
}

/* ±1 per lane for stage h: −1 where bit h of the lane index is set. */
static inline vf stage_sign(int h) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h));
    return _mm512_mask_blend_ps(upper, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
}

/* one register's sign flips, a bit a lane: a halfword of flip_words' uint32 words (read
   through this type, which may alias them) */
typedef uint16_t __attribute__((__may_alias__)) lanes_t;

static inline vf flip_by(vf v, lanes_t mask) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    return _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(v), (__mmask16)mask, _mm512_castps_si512(v), sign));
}
#else
static inline vf bfly_in_register(vf v, const vf sign[TL_IN_REGISTER]) {
    v = _mm256_fmadd_ps(v, sign[0], _mm256_permute_ps(v, 0xB1));
    v = _mm256_fmadd_ps(v, sign[1], _mm256_permute_ps(v, 0x4E));
    return _mm256_fmadd_ps(v, sign[2], _mm256_permute2f128_ps(v, v, 1));
}

static inline vf stage_sign(int h) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vh = _mm256_set1_epi32(h);
    __m256i upper = _mm256_cmpeq_epi32(_mm256_and_si256(lane, vh), vh);
    return _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(-1.0f), _mm256_castsi256_ps(upper));
}

/* FLIP8[m]: lane t's sign bit set where bit t of m is. Bit t of the mask flips lane t
   with one xor from this 8 KiB table: expanding the mask in registers (broadcast, shift,
   and) made the sign flips cost as much as the in-register butterflies. */
static uint32_t FLIP8[256][8] __attribute__((aligned(32)));

__attribute__((constructor)) static void flip8_init(void) {
    for (unsigned m = 0; m < 256; m++)
        for (int t = 0; t < 8; t++) FLIP8[m][t] = ((m >> t) & 1u) << 31;
}

typedef uint8_t lanes_t;

static inline vf flip_by(vf v, lanes_t mask) {
    return _mm256_xor_ps(v, _mm256_load_ps((const float *)FLIP8[mask]));
}
#endif

/* A span's sign-flip hash words (as flip_signs), computed once per span, eight at a time.
   Register k's lane masks are lanes_t k of them (little-endian: bits TL_VEC·k onwards). */
static inline __m256i fmix32x8(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x85EBCA6Bu));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0xC2B2AE35u));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

static void flip_words(uint64_t key, int64_t n, uint32_t *w) {
    const __m256i k1 = _mm256_set1_epi32((int)(uint32_t)key), k2 = _mm256_set1_epi32((int)(uint32_t)(key >> 32));
    const __m256i golden = _mm256_set1_epi32((int)0x9E3779B1u);
    int64_t word = 0;
    for (; word + 8 <= n / 32; word += 8) {
        __m256i i = _mm256_add_epi32(_mm256_set1_epi32((int)word), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256i h = fmix32x8(_mm256_xor_si256(fmix32x8(_mm256_xor_si256(_mm256_mullo_epi32(i, golden), k1)), k2));
        _mm256_storeu_si256((__m256i *)(w + word), h);
    }
    for (; word < n / 32; word++)
        w[word] = fmix32(fmix32((uint32_t)word * 0x9E3779B1u ^ (uint32_t)key) ^ (uint32_t)(key >> 32));
}

/* What the first pass does to each register as it loads it from `in`: × pre (0: nothing),
   the RHT's sign flips (`flip` masks, or NULL), then the in-register stages. `ahead`
   (or NULL): as many floats fetched into L2 line by line as `in` is read (encode: the next
   span's input, on its way while this span's butterflies and packing compute; into L1 it
   would meet this span's scratch and packets there and be evicted before use. Decode: the
   next span's output, so that its last pass's stores find their lines in L2: waiting on
   them, an AVX2 decode took 1.3× as long). */
typedef struct {
    const float *in;
    float pre;
    const lanes_t *flip;
    const float *ahead;
} start_t;

/* What the last pass does to each register after the butterflies: × scale (the RHT's
   1/√n), then for the inverse RHT flip signs and × post (2^e of a prescaled span, 0:
   none), stored to `out` (NULL: in place) — the same operations, in the same order, as the
   separate passes of the plain path. Ordinary stores, not streaming ones: what reads a
   decoded bucket next (the collector's sum over ranks) finds it in the cache, and whatever
   is allocated there next is not fetched back from memory (streamed, a ps's reduce of four
   ranks' 1 Mi buckets took 6.8–7.0 ms against 5.5–5.9). */
typedef struct {
    float scale, post;
    const lanes_t *flip; /* flip_words, or NULL */
    float *out;
} finish_t;

/* Stages h = TL_VEC·s, 2·TL_VEC·s, ... (r ≤ 4 of them) over registers s apart, all r while
   the 2^r registers are loaded; S (the first pass only, s = 1) starts each register as it
   is loaded, F (the last pass only) finishes each one. Each value goes through the same
   additions in the same order as stage after stage would. */
static inline __attribute__((always_inline)) void fwht_pass(float *y, int64_t nv, int64_t s, int r,
                                                            const start_t *S, const finish_t *F) {
    /* S's and F's fields in locals: read through the pointers, every store to y could
       alias them, and the compiler reloaded each one for every register */
    const float *src = S ? S->in : y, *ahead = S ? S->ahead : NULL;
    const lanes_t *flip_in = S ? S->flip : NULL, *flip_out = F ? F->flip : NULL;
    const float pre = S ? S->pre : 0.0f, scale = F ? F->scale : 1.0f, post = F ? F->post : 0.0f;
    float *dst = F && F->out ? F->out : y;
    vf sign[TL_IN_REGISTER];
    for (int t = 0; t < TL_IN_REGISTER; t++) sign[t] = stage_sign(1 << t);
    for (int64_t b = 0; b < nv; b += s << r)
        for (int64_t j = 0; j < s; j++) {
            vf v[16];
#pragma GCC unroll 16
            for (int k = 0; k < (1 << r); k++) {
                int64_t vi = b + j + k * s;
                v[k] = vload(src + TL_VEC * vi);
                if (S) {
                    if (ahead) __builtin_prefetch(ahead + TL_VEC * vi, 0, 2);
                    if (pre != 0.0f) v[k] = vmul(v[k], vset1(pre));
                    if (flip_in) v[k] = flip_by(v[k], flip_in[vi]);
                    v[k] = bfly_in_register(v[k], sign);
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < r; t++)
#pragma GCC unroll 16
                for (int k = 0; k < (1 << r); k++)
                    if (!(k & (1 << t))) {
                        vf a = v[k], c = v[k | (1 << t)];
                        v[k] = vadd(a, c);
                        v[k | (1 << t)] = vsub(a, c);
                    }
#pragma GCC unroll 16
            for (int k = 0; k < (1 << r); k++) {
                int64_t vi = b + j + k * s;
                if (F) {
                    v[k] = vmul(v[k], vset1(scale));
                    if (flip_out) v[k] = flip_by(v[k], flip_out[vi]);
                    if (post != 0.0f) v[k] = vmul(v[k], vset1(post));
                }
                vstore(dst + TL_VEC * vi, v[k]);
            }
        }
}

/* One pass of r stages (1 ≤ r ≤ 4), the constant r unrolled. */
static void fwht_pass_r(float *y, int64_t nv, int64_t s, int r, const start_t *S, const finish_t *F) {
    if (S) {
        if (r == 1) fwht_pass(y, nv, s, 1, S, F);
        else if (r == 2) fwht_pass(y, nv, s, 2, S, F);
        else if (r == 3) fwht_pass(y, nv, s, 3, S, F);
        else fwht_pass(y, nv, s, 4, S, F);
    } else if (r == 1) {
        fwht_pass(y, nv, s, 1, NULL, F);
    } else if (r == 2) {
        fwht_pass(y, nv, s, 2, NULL, F);
    } else if (r == 3) {
        fwht_pass(y, nv, s, 3, NULL, F);
    } else {
        fwht_pass(y, nv, s, 4, NULL, F);
    }
}

/* The butterflies of n ≥ 32 floats from `in` (started by S) into y, finished by F: the
   in-register stages and up to TL_FIRST_STAGES more in the first pass, then
   TL_PASS_STAGES a pass. AVX-512 (4, then 2: three passes over a 4096-float span):
   paired against in-register then three a time (four passes) in an interleaved copy of
   the codec bench, 0.2–0.3 ms off each direction of 4 Mi coordinates; four stages in the
   last pass too made decode slower (16 registers 1 KiB apart stored to the output at once,
   their lines missing together). AVX2 (3, then 3): eight registers a pass leave room for
   the sign constants in its sixteen. */
static void fwht_vec(float *y, int64_t n, const start_t *S, const finish_t *F) {
    int64_t nv = n / TL_VEC, s = 1;
    int left = 0;
    for (int64_t m = nv; m > 1; m >>= 1) left++;
    if (left <= TL_FIRST_STAGES) {
        fwht_pass_r(y, nv, 1, left, S, F);
        return;
    }
    fwht_pass_r(y, nv, 1, TL_FIRST_STAGES, S, NULL);
    for (s = 1 << TL_FIRST_STAGES, left -= TL_FIRST_STAGES; left > TL_PASS_STAGES; s <<= TL_PASS_STAGES, left -= TL_PASS_STAGES)
        fwht_pass_r(y, nv, s, TL_PASS_STAGES, NULL, NULL);
    fwht_pass_r(y, nv, s, left, NULL, F);
}
#endif

/* The butterflies, then × `scale` (the RHT's 1/√n). */
static void fwht_scaled(float *y, int64_t n, float scale) {
    int64_t h = 1;
#ifdef TL_VEC
    if (n >= 32) {
        const start_t S = {y, 0.0f, NULL, NULL};
        const finish_t F = {scale, 0.0f, NULL, NULL};
        fwht_vec(y, n, &S, &F);
        return;
    }
#endif
    for (; h < n; h <<= 1) {
        if (h < 8) {
            for (int64_t i = 0; i < n; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        } else {
            for (int64_t i = 0; i < n; i += 2 * h) {
                float *restrict lo = y + i, *restrict hi = y + i + h;
                for (int64_t j = 0; j < h; j++) {
                    float a = lo[j], b = hi[j];
                    lo[j] = a + b;
                    hi[j] = a - b;
                }
            }
        }
    }
    scale_by(y, n, scale);
}

/* -- 8×8 bit-matrix reflection about the anti-diagonal (as trimlab.codec.bits) ------------ */
static uint64_t antitranspose8(uint64_t x) {
    uint64_t t;
    t = ((x >> 36) ^ x) & 0x000000000F0F0F0Full; x ^= t; x ^= t << 36;
    t = ((x >> 18) ^ x) & 0x0000333300003333ull; x ^= t; x ^= t << 18;
    t = ((x >> 9) ^ x) & 0x0055005500550055ull; x ^= t; x ^= t << 9;
    return x;
}

/* Sums of the c values (c a multiple of 32) in 32 lanes, row after row, folded. */
static float lane_sum_sq_f32(const float *y, int64_t c) {
    float acc[32] = {0};
    for (int64_t r = 0; r < c; r += 32)
        for (int t = 0; t < 32; t++) acc[t] += y[r + t] * y[r + t];
    for (int w = 16; w; w >>= 1)
        for (int t = 0; t < w; t++) acc[t] = acc[t] + acc[t + w];
    return acc[0];
}

static double lane_sum_f64(const float *y, int64_t c, int square) {
#ifdef TL_AVX512
    /* the 32 lanes as 4 registers of 8 doubles; the fold pairs the same lanes */
    __m512d a[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int64_t r = 0; r < c; r += 32)
        for (int q = 0; q < 4; q++) {
            __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(y + r + 8 * q));
            a[q] = _mm512_add_pd(a[q], square ? _mm512_mul_pd(v, v) : _mm512_abs_pd(v));
        }
    __m512d s8 = _mm512_add_pd(_mm512_add_pd(a[0], a[2]), _mm512_add_pd(a[1], a[3]));
    __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
    __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
#elif defined(__AVX2__)
    /* the 32 lanes as 8 registers of 4 doubles, folded lane t + w onto lane t as below */
    __m256d a[8];
    for (int q = 0; q < 8; q++) a[q] = _mm256_setzero_pd();
    const __m256d magnitude = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFll));
    for (int64_t r = 0; r < c; r += 32)
        for (int q = 0; q < 8; q++) {
            __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(y + r + 4 * q));
            a[q] = _mm256_add_pd(a[q], square ? _mm256_mul_pd(v, v) : _mm256_and_pd(v, magnitude));
        }
    for (int q = 0; q < 4; q++) a[q] = _mm256_add_pd(a[q], a[q + 4]);
    for (int q = 0; q < 2; q++) a[q] = _mm256_add_pd(a[q], a[q + 2]);
    __m256d s4 = _mm256_add_pd(a[0], a[1]);
    __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
#else
    double acc[32] = {0};
    for (int64_t r = 0; r < c; r += 32)
        for (int t = 0; t < 32; t++) {
            double v = (double)y[r + t];
            acc[t] += square ? v * v : fabs(v);
        }
    for (int w = 16; w; w >>= 1)
        for (int t = 0; t < w; t++) acc[t] = acc[t] + acc[t + w];
    return acc[0];
#endif
}

/* -- embedded: one packet ----------------------------------------------------------------- */
/* q16 = #{j : T[j] ≤ z}: the cubic's guess, then one step down or up by comparison. */
static inline uint32_t quantize_one(const job_t *J, float z) {
    const float *T = J->thresholds, *P = J->poly;
    if (z != z) z = 0.0f;
    float zc = z < POLY_LO ? POLY_LO : (z > -POLY_LO ? -POLY_LO : z);
    float u = (zc - POLY_LO) * (float)POLY_PER_UNIT;
    int m = (int)u;
    m = m < 0 ? 0 : (m > POLY_CELLS - 1 ? POLY_CELLS - 1 : m);
    float t = u - (float)m;
    const float *a = P + 4 * m;
    float g = a[0] + t * (a[1] + t * (a[2] + t * a[3]));
    int q0 = (int)g;
    q0 = q0 < 0 ? 0 : (q0 > (1 << QBITS) - 1 ? (1 << QBITS) - 1 : q0);
    return (uint32_t)(q0 - (z < T[q0]) + (z >= T[q0 + 1]));
}

/* z = y/σ (0 where σ is not positive), quantized; the high and low bytes of q16 apart. */
static void quantize(const job_t *J, const float *y, int64_t c, float sigma, uint8_t *qhi, uint8_t *qlo) {
    int ok = sigma > 0;
    int64_t i = 0;
    for (; i < c; i++) {
        uint32_t q = quantize_one(J, ok ? y[i] / sigma : 0.0f);
        qhi[i] = (uint8_t)(q >> 8);
        qlo[i] = (uint8_t)q;
    }
}

/* What of an embedded packet's body arrived: `whole` complete planes, then `part` bytes of
   the next. */
typedef struct { int64_t plane, whole, part; } arrived_t;

static arrived_t planes_arrived(int k, int64_t c, int64_t len) {
    int64_t plane = c / 8, full = (int64_t)k * plane;
    if (len > full) len = full;
    if (len < 0) len = 0;
    int64_t whole = len / plane;
    if (whole > k) whole = k;
    return (arrived_t){plane, whole, whole < k ? len - whole * plane : 0};
}

#ifdef TL_VEC
/* 2^16·Φ(z/√3) = 2^15·erfc(−z/√6): for |z| < 8, 2^15·erfc(|z|/√6) from a degree-6
   polynomial per half-unit segment of |z| (least squares at Chebyshev nodes, off by under
   0.001 of a step before rounding; coefficients picked from registers by vpermps), and for
   z ≥ 0 its complement to 2^16 — truncated, the exact count or one off, which the
   comparisons then make exact (or, away from the cell's ends, the count itself). From
   |z| = 8 on (past the last threshold, √3·Φ⁻¹(1 − 2^−16) ≈ 7.22) the segment of [7.5, 8)
   at its end. Segment k covers |z| in [k/2, k/2 + 1/2), t = |z| − (k/2 + 1/4); the
   coefficients (fitted in double, rounded to float) need no proof of their own: the
   exhaustive tests below prove the cells. n ≤ 4 registers at once, step by step, so that
   their chains overlap. */
static const float ERFC_SEGMENTS[7][16] = { /* [d][k]: the coefficient of t^d in segment k */
    {29007.3457f, 21790.9023f, 15416.8994f, 10234.1484f, 6354.72607f, 3681.52393f, 1985.8053f, 995.58429f,
     463.27298f, 199.850266f, 79.8469238f, 29.5218582f, 10.0940084f, 3.18982315f, 0.931190133f, 0.251012772f},
    {-14938.4473f, -13744.0352f, -11634.0742f, -9060.62695f, -6492.22266f, -4279.93701f, -2595.91284f, -1448.6106f,
     -743.741516f, -351.318604f, -152.682434f, -61.0500221f, -22.4590492f, -7.60161209f, -2.367167f, -0.678204834f},
    {622.435303f, 1718.00439f, 2423.76562f, 2642.68262f, 2434.5835f, 1961.6377f, 1406.11951f, 905.381653f,
     526.816895f, 278.127228f, 133.597137f, 58.5062675f, 23.3948402f, 8.55181217f, 2.86032605f, 0.876014292f},
    {812.618652f, 620.388062f, 309.704681f, -10.4831257f, -247.963089f, -361.612976f, -363.547913f, -296.765106f,
     -207.45697f, -127.272552f, -69.4496613f, -33.9873428f, -14.9985609f, -5.99141216f, -2.1725502f, -0.716618001f},
    {-51.508831f, -134.217773f, -166.913193f, -145.285934f, -88.7612305f, -26.1105022f, 20.3425598f, 42.4395332f,
     44.2063522f, 34.9270515f, 22.9621716f, 13.0353355f, 6.51212502f, 2.8951335f, 1.15371394f, 0.414167672f},
    {-39.6042099f, -24.2304592f, -1.61759484f, 17.355566f, 25.5925617f, 22.8017445f, 13.7672138f, 4.26380014f,
     -2.11083317f, -4.66847372f, -4.55289507f, -3.29733133f, -1.96767282f, -1.00757992f, -0.451949f, -0.179742143f},
    {2.82705116f, 6.94429588f, 7.49681091f, 4.74696589f, 0.74043113f, -2.31423473f, -3.37485933f, -2.7611115f,
     -1.45842755f, -0.317877024f, 0.306491435f, 0.471866995f, 0.391833514f, 0.247831136f, 0.130009055f, 0.0586224198f},
};

/* The guess's own cell where it is unambiguous: a lane whose guess (before truncation)
   lies more than FAST_MARGIN of a step from both ends of its cell is in that cell. Proved,
   not sampled: `tl_fast_cell_misses` walks every finite float32 and finds no exception
   (the guess is off by under 0.001 of a step: a margin of 0.0005 has 333). The margin is
   set by z_times' proof instead: at 0.01 every float within 4 steps of a threshold is
   ambiguous, at 0.008 56 are not. Only the other 1/50 of Gaussian lanes fetch thresholds
   (with the earlier erfc-based guess, off by 0.0176, it took a margin of 0.02 and 1/25). */
#define FAST_MARGIN 0.01f
#endif

#ifdef TL_AVX512
static inline __attribute__((always_inline)) void guess16_floats(const __m512 *z, __m512 *g, int n) {
    __m512 a[4], t[4], p[4];
    __m512i seg[4];
#define TL_EACH for (int k = 0; k < n; k++)
#pragma GCC unroll 4
    TL_EACH {
        a[k] = _mm512_min_ps(_mm512_abs_ps(z[k]), _mm512_set1_ps(0x1.fffffep2f)); /* below 8 */
        seg[k] = _mm512_cvttps_epi32(_mm512_add_ps(a[k], a[k]));
        t[k] = _mm512_sub_ps(a[k], _mm512_fmadd_ps(_mm512_cvtepi32_ps(seg[k]), _mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f)));
        p[k] = _mm512_permutexvar_ps(seg[k], _mm512_loadu_ps(ERFC_SEGMENTS[6]));
    }
#pragma GCC unroll 6
    for (int d = 5; d >= 0; d--) {
#pragma GCC unroll 4
        TL_EACH p[k] = _mm512_fmadd_ps(p[k], t[k], _mm512_permutexvar_ps(seg[k], _mm512_loadu_ps(ERFC_SEGMENTS[d])));
    }
#pragma GCC unroll 4
    TL_EACH g[k] = _mm512_mask_sub_ps(p[k], _mm512_cmp_ps_mask(z[k], _mm512_setzero_ps(), _CMP_GE_OQ),
                                      _mm512_set1_ps(65536.0f), p[k]);
#undef TL_EACH
}

static inline __m512i truncate16(__m512 g) {
    __m512i q = _mm512_cvttps_epi32(g);
    return _mm512_min_epi32(_mm512_max_epi32(q, _mm512_setzero_si512()), _mm512_set1_epi32((1 << QBITS) - 1));
}

/* q16 of 16 values z (NaN already 0): the guess, then (T[q], T[q+1]) fetched as one 8-byte
   element and compared. */
static inline __m512i quantize_x16(const float *T, __m512 z) {
    __m512 g;
    guess16_floats(&z, &g, 1);
    __m512i q = truncate16(g);
    __m512i pa = _mm512_i32gather_epi64(_mm512_castsi512_si256(q), T, 4);
    __m512i pb = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(q, 1), T, 4);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512 tq = _mm512_castsi512_ps(_mm512_permutex2var_epi32(pa, even, pb));
    __m512 tq1 = _mm512_castsi512_ps(_mm512_permutex2var_epi32(pa, odd, pb));
    const __m512i one = _mm512_set1_epi32(1);
    q = _mm512_mask_sub_epi32(q, _mm512_cmp_ps_mask(z, tq, _CMP_LT_OQ), q, one);
    return _mm512_mask_add_epi32(q, _mm512_cmp_ps_mask(z, tq1, _CMP_GE_OQ), q, one);
}

/* z for the guess as y·(1/σ): a multiplication where the exact z = y/σ is a division
   (several times its cost here). 1/σ, the product and the quotient each round once
   (relative error ≤ 2^−24, all three normal): product and quotient differ by less than
   3.000001·2^−24 of the smaller, which is under 3.000001 of its float steps — at most 3
   steps apart. So the product's cell is the quotient's unless a threshold lies within 3
   steps of it, and `tl_threshold_neighbours_unambiguous` proves every float within 4
   steps of a threshold ambiguous (8 would not be, at this margin). Below 2^−100, where
   roundings may be subnormal and the error is not relative, every float's guess is
   ambiguous (z ≈ 0, a guess ≈ 2^15): `tl_fast_cell_misses` proves that too. */
static inline __m512 z_times(const float *y, __m512 vr) {
    __m512 z = _mm512_mul_ps(_mm512_loadu_ps(y), vr);
    return _mm512_mask_mov_ps(z, _mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q), _mm512_setzero_ps());
}

static inline __mmask16 ambiguous16(__m512 g) {
    __m512 frac = _mm512_sub_ps(g, _mm512_roundscale_ps(g, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
    return _mm512_cmp_ps_mask(frac, _mm512_set1_ps(FAST_MARGIN), _CMP_LT_OQ) |
           _mm512_cmp_ps_mask(frac, _mm512_set1_ps(1.0f - FAST_MARGIN), _CMP_GT_OQ);
}

/* q16 of c values (c a multiple of 16) into q: the guess's cell where unambiguous; the
   ambiguous lanes' indices queued (`queue`: c + 16 ints) and then quantized 16 at a time
   with the thresholds. A gather of (T[q], T[q+1]) for every lane was 45 % of embedded's
   encode (perf): gathers from a 256 KiB table are slow here, and 24 lanes in 25 need none. */
static void quantize_fast16(const float *T, const float *y, int64_t c, float sigma, int ok, uint16_t *q,
                            int32_t *queue) {
    /* the guess at y·(1/σ) where 1/σ is a normal float; otherwise (σ = 0 among them, where
       every lane's guess is ambiguous anyway) every lane is queued */
    int times = ok && sigma >= 0x1p-125f && sigma <= 0x1p125f;
    const __mmask16 all = times ? 0 : 0xFFFF;
    const __m512 vs = _mm512_set1_ps(sigma), vr = _mm512_set1_ps(times ? 1.0f / sigma : 0.0f);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t waiting = 0;
    for (int64_t i = 0; i < c;) {
        int n = c - i >= 64 ? 4 : 1; /* c is a multiple of 16 */
        __m512 z[4], g[4];
        for (int k = 0; k < n; k++) z[k] = z_times(y + i + 16 * k, vr);
        if (n == 4) guess16_floats(z, g, 4);
        else guess16_floats(z, g, 1);
        for (int k = 0; k < n; k++, i += 16) {
            __mmask16 amb = ambiguous16(g[k]) | all;
            _mm256_storeu_si256((__m256i *)(q + i), _mm512_cvtepi32_epi16(truncate16(g[k])));
            _mm512_storeu_si512(queue + waiting,
                                _mm512_maskz_compress_epi32(amb, _mm512_add_epi32(lane, _mm512_set1_epi32((int)i))));
            waiting += __builtin_popcount(amb);
        }
    }
    for (int64_t j = 0; j < waiting; j += 16) { /* lanes past `waiting`: z = 0, computed, not stored */
        __mmask16 live = waiting - j >= 16 ? 0xFFFF : (__mmask16)((1u << (waiting - j)) - 1);
        __m512i at = _mm512_maskz_loadu_epi32(live, queue + j);
        __m512 z = ok ? _mm512_div_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at, y, 4), vs)
                      : _mm512_setzero_ps();
        z = _mm512_mask_mov_ps(z, _mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q), _mm512_setzero_ps());
        int32_t exact[16];
        _mm512_storeu_si512(exact, quantize_x16(T, z));
        int32_t where[16];
        _mm512_storeu_si512(where, at);
        for (int64_t l = 0; l < 16 && j + l < waiting; l++) q[where[l]] = (uint16_t)exact[l];
    }
}

/* Within each 8 coordinates, lane t ↔ lane 7 − t: a plane's byte holds coordinate t at
   bit 7 − t, a register's lane mask holds lane t at bit t. */
static inline __m512i reverse8_epi16(__m512i v) {
    const __m512i rev = _mm512_set_epi16(24, 25, 26, 27, 28, 29, 30, 31, 16, 17, 18, 19, 20, 21, 22, 23,
                                         8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_permutexvar_epi16(rev, v);
}

#ifdef TL_GFNI
/* 32 q16 (16-bit lanes) ↔ 16 dwords, dword P = plane P's 4 bytes (bit 15 − P of each q16,
   coordinate t of each 8 at bit 7 − t): bytes regrouped so each qword is one 8×8 bit
   matrix (8 coordinates' high or low bytes), transposed by gf2p8affineqb against the
   anti-diagonal unit vectors, regrouped by plane. The transpose is its own inverse. */
/* Byte i of a register in each layout: q16 (byte 2c + 1 the high, 2c the low byte of
   coordinate c), rows (qword 2g + h: the high (h = 0) or low bytes of coordinates
   8g .. 8g+7), planes (dword P: plane P's bytes for the 4 groups g). */
#define TL_I64(f) f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), f(8), f(9), f(10), f(11), f(12), f(13), \
    f(14), f(15), f(16), f(17), f(18), f(19), f(20), f(21), f(22), f(23), f(24), f(25), f(26), f(27), f(28), \
    f(29), f(30), f(31), f(32), f(33), f(34), f(35), f(36), f(37), f(38), f(39), f(40), f(41), f(42), f(43), \
    f(44), f(45), f(46), f(47), f(48), f(49), f(50), f(51), f(52), f(53), f(54), f(55), f(56), f(57), f(58), \
    f(59), f(60), f(61), f(62), f(63)
#define TL_ROW_FROM_Q16(i) (16 * ((i) >> 4) + 2 * ((i) & 7) + 1 - (((i) >> 3) & 1))
#define TL_Q16_FROM_ROW(j) (16 * ((j) >> 4) + 8 * (1 - ((j) & 1)) + (((j) >> 1) & 7))
#define TL_PLANE_FROM_ROW(i) (16 * ((i) & 3) + ((i) >> 2))
#define TL_ROW_FROM_PLANE(j) (4 * ((j) & 15) + ((j) >> 4))
static const uint8_t Q16_TO_ROWS[64] = {TL_I64(TL_ROW_FROM_Q16)};
static const uint8_t ROWS_TO_Q16[64] = {TL_I64(TL_Q16_FROM_ROW)};
static const uint8_t ROWS_TO_PLANES[64] = {TL_I64(TL_PLANE_FROM_ROW)};
static const uint8_t PLANES_TO_ROWS[64] = {TL_I64(TL_ROW_FROM_PLANE)};

static inline __m512i bit_transpose8(__m512i rows) {
    return _mm512_gf2p8affine_epi64_epi8(_mm512_set1_epi64(0x0102040810204080LL), rows, 0);
}

static inline __m512i q16_to_planes(__m512i q) {
    __m512i rows = _mm512_permutexvar_epi8(_mm512_loadu_si512(Q16_TO_ROWS), q);
    return _mm512_permutexvar_epi8(_mm512_loadu_si512(ROWS_TO_PLANES), bit_transpose8(rows));
}

static inline __m512i planes_to_q16(__m512i planes) {
    __m512i rows = bit_transpose8(_mm512_permutexvar_epi8(_mm512_loadu_si512(PLANES_TO_ROWS), planes));
    return _mm512_permutexvar_epi8(_mm512_loadu_si512(ROWS_TO_Q16), rows);
}

/* 4×4 dword transpose in each 128-bit lane: v[u] dword 4L + j ↔ v[j] dword 4L + u. With
   v[u] the planes of coordinates 32u.. (dword P = plane P), lane L of v[j] becomes plane
   4L + j's 16 bytes for 128 coordinates, and back. */
static inline void transpose4_lanes(__m512i v[4]) {
    __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
    __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2);
    v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3);
    v[3] = _mm512_unpackhi_epi64(t1, t3);
}
#endif

/* With GFNI, 128 coordinates at a time (bit transposes, 16 bytes of a plane a store);
   otherwise, and for what is left, 32 at a time: q16 as 16-bit lanes, plane j (bit
   15 − j) the lanes' top bits after j shifts, 4 bytes of the plane a store. */
static float embedded_encode_packet(const job_t *J, const float *y, int64_t c, uint8_t *body,
                                    uint8_t *scratch) {
    float sigma = sqrtf(lane_sum_sq_f32(y, c) / (float)c);
    int k = J->planes;
    int64_t plane = c / 8;
    uint16_t *q = (uint16_t *)scratch;
    quantize_fast16(J->thresholds, y, c, sigma, sigma > 0, q, (int32_t *)(scratch + 2 * J->coords));
    int64_t i = 0;
#ifdef TL_GFNI
    /* 128 coordinates at a time: each plane's 16 bytes in one store */
    for (; i + 128 <= c; i += 128) {
        __m512i v[4];
        for (int u = 0; u < 4; u++) v[u] = q16_to_planes(_mm512_loadu_si512(q + i + 32 * u));
        transpose4_lanes(v);
#define TL_STORE_PLANE(j) \
    if ((j) < k) _mm_storeu_si128((__m128i *)(body + (j) * plane + i / 8), _mm512_extracti32x4_epi32(v[(j) & 3], (j) >> 2));
        TL_STORE_PLANE(0) TL_STORE_PLANE(1) TL_STORE_PLANE(2) TL_STORE_PLANE(3) TL_STORE_PLANE(4) TL_STORE_PLANE(5)
        TL_STORE_PLANE(6) TL_STORE_PLANE(7) TL_STORE_PLANE(8) TL_STORE_PLANE(9) TL_STORE_PLANE(10)
        TL_STORE_PLANE(11) TL_STORE_PLANE(12) TL_STORE_PLANE(13) TL_STORE_PLANE(14) TL_STORE_PLANE(15)
#undef TL_STORE_PLANE
    }
#endif
    for (; i < c; i += 32) {
        __m512i v = reverse8_epi16(_mm512_loadu_si512(q + i));
        for (int j = 0; j < k; j++) {
            uint32_t m = (uint32_t)_mm512_movepi16_mask(v);
            memcpy(body + j * plane + i / 8, &m, 4);
            v = _mm512_slli_epi16(v, 1);
        }
    }
    return sigma;
}

/* What decoding a packet's coordinates needs besides their q16: the marker bit of the
   level that arrived (one level finer for the partial plane's prefix) and the scale. */
typedef struct {
    __m512i vmark, vref, nref;
    __m128i drop;
    __m512 vscale;
} levels_t;

/* 32 coordinates from i on: v = 2·(q16 ≫ (16 − k)) | marker into the centroid table, × scale. */
static inline void centroids32(const float *table, const levels_t *L, __m512i q, int64_t i, float *y) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int h = 0; h < 2; h++) {
        __m512i q32 = _mm512_cvtepu16_epi32(h ? _mm512_extracti64x4_epi64(q, 1) : _mm512_castsi512_si256(q));
        __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(i + 16 * h)));
        __m512i mark = _mm512_mask_mov_epi32(L->vmark, _mm512_cmpgt_epi32_mask(L->nref, idx), L->vref);
        __m512i v = _mm512_or_si512(_mm512_slli_epi32(_mm512_srl_epi32(q32, L->drop), 1), mark);
        _mm512_storeu_ps(y + i + 16 * h, _mm512_mul_ps(_mm512_i32gather_ps(v, table, 4), L->vscale));
    }
}

/* 32 coordinates of a whole 16-plane packet: its finest level's centroids, × scale. The
   centroids are antisymmetric by construction (trimlab.codec.embedded mirrors the lower
   half: fine[q] = −fine[q ^ 0xFFFF], exactly), so the upper half's come from the lower's,
   negated, and only 128 KiB of the table is gathered from: it stays in L2 as packets and
   output stream past (decode 0.2–0.29 ms faster for 4 Mi coordinates, paired). */
static inline void fine32(const float *fine, __m512 vscale, __m512i q, int64_t i, float *y) {
    for (int h = 0; h < 2; h++) {
        __m512i q32 = _mm512_cvtepu16_epi32(h ? _mm512_extracti64x4_epi64(q, 1) : _mm512_castsi512_si256(q));
        __m512i upper = _mm512_srai_epi32(_mm512_slli_epi32(q32, 16), 31); /* q ≥ 2^15: all ones */
        __m512i half = _mm512_xor_si512(q32, _mm512_and_si512(upper, _mm512_set1_epi32(0xFFFF)));
        __m512 c = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_i32gather_ps(half, fine, 4)),
                                                        _mm512_slli_epi32(upper, 31)));
        _mm512_storeu_ps(y + i + 16 * h, _mm512_mul_ps(c, vscale));
    }
}

/* The inverse: q16's known bits from whole planes and the partial plane's prefix, then
   the centroids. */
static void embedded_decode_packet(const job_t *J, const uint8_t *body, int64_t len, float scale,
                                   int64_t c, float *y) {
    int k = J->planes;
    arrived_t got = planes_arrived(k, c, len);
    int64_t plane = got.plane, whole = got.whole, part = got.part;
    uint32_t marker = 1u << (k - whole), refined = marker >> 1;
    const levels_t L = {_mm512_set1_epi32((int)marker), _mm512_set1_epi32((int)refined),
                        _mm512_set1_epi32((int)(8 * part)), _mm_cvtsi32_si128(QBITS - k), _mm512_set1_ps(scale)};
    int64_t i = 0;
#ifdef TL_GFNI
    /* all 16 planes (an untrimmed packet): 128 coordinates at a time, each plane's 16 bytes
       in one load */
    for (; whole == 16 && i + 128 <= c; i += 128) {
        __m512i v[4];
        const uint8_t *at = body + i / 8;
        for (int j = 0; j < 4; j++) {
            __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(at + j * plane))),
                                                 _mm_loadu_si128((const __m128i *)(at + (4 + j) * plane)), 1);
            __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(at + (8 + j) * plane))),
                                                 _mm_loadu_si128((const __m128i *)(at + (12 + j) * plane)), 1);
            v[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        transpose4_lanes(v);
        for (int u = 0; u < 4; u++) fine32(J->fine, L.vscale, planes_to_q16(v[u]), i + 32 * u, y);
    }
#endif
    for (; i < c; i += 32) {
        __m512i q = _mm512_setzero_si512();
        for (int j = 0; j < whole; j++) {
            uint32_t m;
            memcpy(&m, body + j * plane + i / 8, 4);
            q = _mm512_mask_add_epi16(q, (__mmask32)m, q, _mm512_set1_epi16((short)(1u << (15 - j))));
        }
        if (i / 8 < part) {
            uint32_t m = 0;
            int64_t n = part - i / 8 < 4 ? part - i / 8 : 4;
            memcpy(&m, body + whole * plane + i / 8, (size_t)n);
            q = _mm512_mask_add_epi16(q, (__mmask32)m, q, _mm512_set1_epi16((short)(1u << (15 - whole))));
        }
        centroids32(J->table, &L, reverse8_epi16(q), i, y);
    }
}
#elif defined(TL_VEC)
/* AVX2: the AVX-512 path's arithmetic 8 lanes at a time, without hardware gathers where
   a path runs for every coordinate (microcoded and slow on AMD Zen 2/3, and on Intel
   cores with the Gather Data Sampling mitigation): the guess's coefficients come from
   registers, a plane's bits from byte shuffles, the centroids from scalar loads. */

/* ERFC_SEGMENTS[d][seg] for 8 lanes: vpermps picks within each 8-float half, bit 3 of the
   segment (shifted to the sign bit) chooses the half. */
static inline __m256 segment_coef(__m256i seg, const float *coef) {
    __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(coef), seg);
    __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(coef + 8), seg);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(seg, 28)));
}

/* The AVX-512 guess (guess16_floats), lane for lane the same operations: the same floats.
   Where every lane has |z| < 4 (segments 0-7: all but about 1 in 10^4 lanes of Gaussian
   input, z = y/σ) one vpermps a coefficient picks it, instead of two and a blend — the
   same coefficient, with a third of the shuffles, which on Intel share one port. */
static inline __attribute__((always_inline)) void guess8_floats(const __m256 *z, __m256 *g, int n) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 t[4], p[4];
    __m256i seg[4], high = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < n; k++) {
        __m256 a = _mm256_min_ps(_mm256_and_ps(z[k], magnitude), _mm256_set1_ps(0x1.fffffep2f)); /* below 8 */
        seg[k] = _mm256_cvttps_epi32(_mm256_add_ps(a, a));
        t[k] = _mm256_sub_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(seg[k]), _mm256_set1_ps(0.5f), _mm256_set1_ps(0.25f)));
        high = _mm256_or_si256(high, seg[k]);
    }
    if (_mm256_testz_si256(high, _mm256_set1_epi32(8))) { /* no lane's segment has bit 3 */
#pragma GCC unroll 4
        for (int k = 0; k < n; k++) p[k] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(ERFC_SEGMENTS[6]), seg[k]);
#pragma GCC unroll 6
        for (int d = 5; d >= 0; d--) {
#pragma GCC unroll 4
            for (int k = 0; k < n; k++)
                p[k] = _mm256_fmadd_ps(p[k], t[k], _mm256_permutevar8x32_ps(_mm256_loadu_ps(ERFC_SEGMENTS[d]), seg[k]));
        }
    } else {
#pragma GCC unroll 4
        for (int k = 0; k < n; k++) p[k] = segment_coef(seg[k], ERFC_SEGMENTS[6]);
#pragma GCC unroll 6
        for (int d = 5; d >= 0; d--) {
#pragma GCC unroll 4
            for (int k = 0; k < n; k++) p[k] = _mm256_fmadd_ps(p[k], t[k], segment_coef(seg[k], ERFC_SEGMENTS[d]));
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < n; k++)
        g[k] = _mm256_blendv_ps(p[k], _mm256_sub_ps(_mm256_set1_ps(65536.0f), p[k]),
                                _mm256_cmp_ps(z[k], _mm256_setzero_ps(), _CMP_GE_OQ));
}

static inline __m256i truncate8(__m256 g) {
    __m256i q = _mm256_cvttps_epi32(g);
    return _mm256_min_epi32(_mm256_max_epi32(q, _mm256_setzero_si256()), _mm256_set1_epi32((1 << QBITS) - 1));
}

/* lanes (bit t: lane t) whose guess lies within FAST_MARGIN of its cell's ends */
static inline int ambiguous8(__m256 g) {
    __m256 frac = _mm256_sub_ps(g, _mm256_floor_ps(g));
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(FAST_MARGIN), _CMP_LT_OQ),
                                           _mm256_cmp_ps(frac, _mm256_set1_ps(1.0f - FAST_MARGIN), _CMP_GT_OQ)));
}

/* y·(1/σ), NaN as 0 (the AVX-512 path's z_times and its proof) */
static inline __m256 z_times8(const float *y, __m256 vr) {
    __m256 z = _mm256_mul_ps(_mm256_loadu_ps(y), vr);
    return _mm256_and_ps(z, _mm256_cmp_ps(z, z, _CMP_ORD_Q));
}

/* LEFT_PACK[m]: the lanes set in m, in order, one byte each (AVX2 has no compress: a
   register's ambiguous lanes are queued with a permute from this table, branch-free). */
static uint64_t LEFT_PACK[256];

__attribute__((constructor)) static void left_pack_init(void) {
    for (unsigned m = 0; m < 256; m++) {
        uint64_t v = 0;
        int n = 0;
        for (int l = 0; l < 8; l++)
            if (m & (1u << l)) v |= (uint64_t)l << (8 * n++);
        LEFT_PACK[m] = v;
    }
}

/* q16 of c values (c a multiple of 32): the guess's cell where unambiguous; the ambiguous
   lanes' indices queued (`queue`: c + 8 ints), then each the exact count (quantize_one of
   y/σ, scalar: 1 lane in 50 of Gaussian input). Fixed on the spot instead, their branches
   mispredicted and their threshold loads waited one by one. */
static void quantize_fast8(const job_t *J, const float *y, int64_t c, float sigma, int ok, uint16_t *q,
                           int32_t *queue) {
    int times = ok && sigma >= 0x1p-125f && sigma <= 0x1p125f;
    const __m256 vr = _mm256_set1_ps(times ? 1.0f / sigma : 0.0f);
    const unsigned all = times ? 0 : 0xFFu;
    int64_t waiting = 0;
    for (int64_t i = 0; i < c; i += 32) {
        __m256 z[4], g[4];
        for (int k = 0; k < 4; k++) z[k] = z_times8(y + i + 8 * k, vr);
        guess8_floats(z, g, 4);
        __m256i a = _mm256_packus_epi32(truncate8(g[0]), truncate8(g[1])); /* 32-bit lanes to 16, in order */
        __m256i b = _mm256_packus_epi32(truncate8(g[2]), truncate8(g[3]));
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(a, 0xD8));
        _mm256_storeu_si256((__m256i *)(q + i + 16), _mm256_permute4x64_epi64(b, 0xD8));
        for (int k = 0; k < 4; k++) {
            unsigned amb = (unsigned)ambiguous8(g[k]) | all;
            __m256i at = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)LEFT_PACK[amb]));
            _mm256_storeu_si256((__m256i *)(queue + waiting), _mm256_add_epi32(at, _mm256_set1_epi32((int)(i + 8 * k))));
            waiting += __builtin_popcount(amb);
        }
    }
    if (!times) { /* every lane queued, its guess that of 0: each counted from scratch */
        for (int64_t j = 0; j < waiting; j++) {
            int32_t at = queue[j];
            q[at] = (uint16_t)quantize_one(J, ok ? y[at] / sigma : 0.0f);
        }
        return;
    }
    /* an ambiguous lane's guess is within a cell of its count: thresholds from there on
       (re-guessing each with quantize_one's cubic first, this loop took about 1.5× as long) */
    const float *T = J->thresholds;
    for (int64_t j = 0; j < waiting; j++) {
        int32_t at = queue[j], cell = q[at];
        float z = y[at] / sigma;
        if (z != z) z = 0.0f;
        while (cell > 0 && z < T[cell]) cell--;
        while (cell < (1 << QBITS) - 1 && z >= T[cell + 1]) cell++;
        q[at] = (uint16_t)cell;
    }
}

/* Plane j (bit 15 − j of q16), coordinate t of each 8 at bit 7 − t: 32 coordinates' high
   and low bytes, each 8 reversed, in two registers; a plane is a byte mask of one, the
   next plane that register's bytes doubled. */
static float embedded_encode_packet(const job_t *J, const float *y, int64_t c, uint8_t *body,
                                    uint8_t *scratch) {
    float sigma = sqrtf(lane_sum_sq_f32(y, c) / (float)c);
    int k = J->planes;
    int64_t plane = c / 8;
    uint16_t *q = (uint16_t *)scratch;
    quantize_fast8(J, y, c, sigma, sigma > 0, q, (int32_t *)(scratch + 2 * J->coords));
    /* per 128-bit lane (8 coordinates): their low bytes reversed, then their high bytes */
    const __m256i split = _mm256_setr_epi8(14, 12, 10, 8, 6, 4, 2, 0, 15, 13, 11, 9, 7, 5, 3, 1,
                                           14, 12, 10, 8, 6, 4, 2, 0, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int64_t i = 0; i < c; i += 32) {
        __m256i a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(q + i)), split), 0xD8);
        __m256i b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(q + i + 16)), split), 0xD8);
        __m256i hi = _mm256_permute2x128_si256(a, b, 0x31), lo = _mm256_permute2x128_si256(a, b, 0x20);
        for (int j = 0; j < k && j < 8; j++, hi = _mm256_add_epi8(hi, hi)) {
            uint32_t m = (uint32_t)_mm256_movemask_epi8(hi);
            memcpy(body + j * plane + i / 8, &m, 4);
        }
        for (int j = 8; j < k; j++, lo = _mm256_add_epi8(lo, lo)) {
            uint32_t m = (uint32_t)_mm256_movemask_epi8(lo);
            memcpy(body + j * plane + i / 8, &m, 4);
        }
    }
    return sigma;
}

/* The bits of one plane's 4 bytes (32 coordinates) as 32 bytes, 0xFF where set, in
   coordinate order (bit 7 − t of byte b is coordinate 8b + t). */
static inline __m256i plane_bytes(uint32_t m) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x0102040810204080ull);
    __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread), bit);
    return _mm256_cmpeq_epi8(b, bit);
}

/* A plane's 4 bytes at `at`, of which `n` arrived (the partial plane's prefix: the rest 0). */
static inline uint32_t plane_word(const uint8_t *at, int64_t n) {
    uint32_t m = 0;
    if (n >= 4) memcpy(&m, at, 4);
    else memcpy(&m, at, (size_t)n);
    return m;
}

/* table[idx] for 8 lanes, scalar loads: a lane's bits xor (sign ≪ 31) */
static inline __m256 lookup8(const float *table, __m256i idx, __m256i sign) {
    uint32_t at[8], out[8], s[8];
    _mm256_storeu_si256((__m256i *)at, idx);
    _mm256_storeu_si256((__m256i *)s, sign);
    const uint32_t *t = (const uint32_t *)table;
    for (int l = 0; l < 8; l++) out[l] = t[at[l]] ^ s[l];
    return _mm256_loadu_ps((const float *)out);
}

/* 8 coordinates' centroids at the finest level from their q16: fine[q] = −fine[q ^ 0xFFFF],
   the lower half, negated for the upper; × scale, stored. */
static inline void fine8(const float *fine, __m128i q16, __m256 vscale, float *y) {
    __m256i q = _mm256_cvtepu16_epi32(q16);
    __m256i upper = _mm256_srai_epi32(_mm256_slli_epi32(q, 16), 31);
    __m256i half = _mm256_xor_si256(q, _mm256_and_si256(upper, _mm256_set1_epi32(0xFFFF)));
    _mm256_storeu_ps(y, _mm256_mul_ps(lookup8(fine, half, _mm256_slli_epi32(upper, 31)), vscale));
}

/* antitranspose8 of each 64-bit lane */
static inline __m256i antitranspose8x4(__m256i x) {
    __m256i t = _mm256_and_si256(_mm256_xor_si256(_mm256_srli_epi64(x, 36), x), _mm256_set1_epi64x(0x000000000F0F0F0FLL));
    x = _mm256_xor_si256(_mm256_xor_si256(x, t), _mm256_slli_epi64(t, 36));
    t = _mm256_and_si256(_mm256_xor_si256(_mm256_srli_epi64(x, 18), x), _mm256_set1_epi64x(0x0000333300003333LL));
    x = _mm256_xor_si256(_mm256_xor_si256(x, t), _mm256_slli_epi64(t, 18));
    t = _mm256_and_si256(_mm256_xor_si256(_mm256_srli_epi64(x, 9), x), _mm256_set1_epi64x(0x0055005500550055LL));
    return _mm256_xor_si256(_mm256_xor_si256(x, t), _mm256_slli_epi64(t, 9));
}

/* A whole 16-plane packet's 64 coordinates from i: as the plain path, byte b of the eight
   high (low) planes gathered into a word and anti-transposed gives the high (low) bytes
   of coordinates 8b .. 8b + 7 — four words a register, the high planes' in the lower
   128-bit lane, the low planes' in the upper. Per plane a byte spread to 32 (shuffle,
   and, compare, and, or) took 2.4 of a 4 Mi-coordinate decode's 7.7 ms here. */
static void fine64(const float *fine, const uint8_t *body, int64_t plane, int64_t i, __m256 vscale, float *y) {
    __m256i p[8], a[4], b[4];
    for (int j = 0; j < 8; j++) /* plane j's 8 bytes, plane j + 8's in the upper lane */
        p[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(body + j * plane + i / 8))),
                                       _mm_loadl_epi64((const __m128i *)(body + (j + 8) * plane + i / 8)), 1);
    for (int j = 0; j < 4; j++) a[j] = _mm256_unpacklo_epi8(p[2 * j], p[2 * j + 1]);
    b[0] = _mm256_unpacklo_epi16(a[0], a[1]), b[1] = _mm256_unpackhi_epi16(a[0], a[1]);
    b[2] = _mm256_unpacklo_epi16(a[2], a[3]), b[3] = _mm256_unpackhi_epi16(a[2], a[3]);
    /* words of bytes 0-1, 2-3, 4-5, 6-7: byte j of a word is plane j's (j + 8's) */
    __m256i w[4] = {_mm256_unpacklo_epi32(b[0], b[2]), _mm256_unpackhi_epi32(b[0], b[2]),
                    _mm256_unpacklo_epi32(b[1], b[3]), _mm256_unpackhi_epi32(b[1], b[3])};
    /* per 128-bit lane, coordinate t's low byte then its high byte: q16 little-endian */
    const __m256i interleave = _mm256_setr_epi8(8, 0, 9, 1, 10, 2, 11, 3, 12, 4, 13, 5, 14, 6, 15, 7,
                                                8, 0, 9, 1, 10, 2, 11, 3, 12, 4, 13, 5, 14, 6, 15, 7);
    for (int m = 0; m < 4; m++) {
        __m256i q = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(antitranspose8x4(w[m]), 0xD8), interleave);
        fine8(fine, _mm256_castsi256_si128(q), vscale, y + i + 16 * m);
        fine8(fine, _mm256_extracti128_si256(q, 1), vscale, y + i + 16 * m + 8);
    }
}

/* The inverse: q16's known bits from whole planes and the partial plane's prefix, then
   the centroids; a whole 16-plane packet's from the lower half of `fine` (fine64). */
static void embedded_decode_packet(const job_t *J, const uint8_t *body, int64_t len, float scale,
                                   int64_t c, float *y) {
    int k = J->planes;
    arrived_t got = planes_arrived(k, c, len);
    int64_t plane = got.plane, whole = got.whole, part = got.part;
    uint32_t marker = 1u << (k - whole), refined = marker >> 1;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vmark = _mm256_set1_epi32((int)marker);
    const __m256i vref = _mm256_set1_epi32((int)refined), nref = _mm256_set1_epi32((int)(8 * part));
    const __m128i drop = _mm_cvtsi32_si128(QBITS - k);
    const __m256 vscale = _mm256_set1_ps(scale);
    const int finest = k == 16 && whole == 16;
    int64_t i = 0;
    if (finest)
        for (; i + 64 <= c; i += 64) fine64(J->fine, body, plane, i, vscale, y);
    for (; i < c; i += 32) {
        /* the high bytes from planes 0-7, the low from 8-15, plane j's bit 0x80 ≫ (j mod 8)
           (halved a plane: a byte's bit 0 is clear until the eighth) */
        __m256i hi = _mm256_setzero_si256(), lo = _mm256_setzero_si256(), bit = _mm256_set1_epi8((char)0x80);
        int64_t have = whole + (i / 8 < part); /* planes with bits here: whole ones, then the partial one's */
        for (int j = 0; j < have && j < 8; j++, bit = _mm256_srli_epi16(bit, 1))
            hi = _mm256_or_si256(hi, _mm256_and_si256(plane_bytes(plane_word(body + j * plane + i / 8, j < whole ? 4 : part - i / 8)), bit));
        bit = _mm256_set1_epi8((char)0x80);
        for (int j = 8; j < have; j++, bit = _mm256_srli_epi16(bit, 1))
            lo = _mm256_or_si256(lo, _mm256_and_si256(plane_bytes(plane_word(body + j * plane + i / 8, j < whole ? 4 : part - i / 8)), bit));
        /* q16 per 128-bit lane: unpacklo holds coordinates 0-7 and 16-23, unpackhi 8-15 and 24-31 */
        __m256i lo16 = _mm256_unpacklo_epi8(lo, hi), hi16 = _mm256_unpackhi_epi8(lo, hi);
        __m128i parts[4] = {_mm256_castsi256_si128(lo16), _mm256_castsi256_si128(hi16),
                            _mm256_extracti128_si256(lo16, 1), _mm256_extracti128_si256(hi16, 1)};
        for (int h = 0; h < 4; h++) {
            if (finest) {
                fine8(J->fine, parts[h], vscale, y + i + 8 * h);
                continue;
            }
            __m256i q = _mm256_cvtepu16_epi32(parts[h]);
            __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32((int)(i + 8 * h)));
            __m256i mark = _mm256_blendv_epi8(vmark, vref, _mm256_cmpgt_epi32(nref, idx));
            __m256 v = lookup8(J->table, _mm256_or_si256(_mm256_slli_epi32(_mm256_srl_epi32(q, drop), 1), mark),
                               _mm256_setzero_si256());
            _mm256_storeu_ps(y + i + 8 * h, _mm256_mul_ps(v, vscale));
        }
    }
}
#else
static float embedded_encode_packet(const job_t *J, const float *y, int64_t c, uint8_t *body,
                                    uint8_t *q) {
    float sigma = sqrtf(lane_sum_sq_f32(y, c) / (float)c);
    uint8_t *qhi = q, *qlo = q + J->coords;
    quantize(J, y, c, sigma, qhi, qlo);
    /* plane j is bit 15-j of q16 (the top K bits of q16 are the K-bit index) */
    int64_t plane = c / 8;
    int k = J->planes;
    for (int64_t g8 = 0; g8 < plane; g8++) {
        uint64_t hi, lo;
        memcpy(&hi, qhi + 8 * g8, 8);
        memcpy(&lo, qlo + 8 * g8, 8);
        hi = antitranspose8(hi);
        lo = antitranspose8(lo);
        for (int j = 0; j < k && j < 8; j++) body[j * plane + g8] = (uint8_t)(hi >> (8 * j));
        for (int j = 8; j < k; j++) body[j * plane + g8] = (uint8_t)(lo >> (8 * (j - 8)));
    }
    return sigma;
}

static void embedded_decode_packet(const job_t *J, const uint8_t *body, int64_t len, float scale,
                                   int64_t c, float *y) {
    int k = J->planes;
    arrived_t got = planes_arrived(k, c, len);
    int64_t plane = got.plane, whole = got.whole, part = got.part;
    uint32_t marker = 1u << (k - whole), refined = marker >> 1;
    int64_t refined_coords = 8 * part;
    const float *table = J->table;
    for (int64_t g8 = 0; g8 < plane; g8++) {
        uint64_t hi = 0, lo = 0;
        for (int j = 0; j < whole; j++) { /* complete planes */
            uint64_t b = body[j * plane + g8];
            if (j < 8) hi |= b << (8 * j);
            else lo |= b << (8 * (j - 8));
        }
        if (g8 < part) { /* the partial plane's prefix */
            uint64_t b = body[whole * plane + g8];
            if (whole < 8) hi |= b << (8 * whole);
            else lo |= b << (8 * (whole - 8));
        }
        hi = antitranspose8(hi);
        lo = antitranspose8(lo);
        for (int t = 0; t < 8; t++) {
            int64_t i = 8 * g8 + t;
            uint32_t q16 = (uint32_t)((hi >> (8 * t)) & 0xFF) << 8 | (uint32_t)((lo >> (8 * t)) & 0xFF);
            uint32_t v = ((q16 >> (QBITS - k)) << 1) | (i < refined_coords ? refined : marker);
            y[i] = table[v] * scale;
        }
    }
}

#endif

/* q16 of n values z as the encoder computes them (σ = 1), for tests of the guess. */
void tl_quantize16(const float *thresholds, const float *poly, const float *z, int64_t n, uint16_t *out) {
    job_t J = {.thresholds = thresholds, .poly = poly};
    int64_t i = 0;
#ifdef TL_AVX512
    int32_t *queue = malloc((size_t)(n / 16 * 16 + 16) * sizeof(int32_t));
    if (queue) { /* as the encoder quantizes (σ = 1) */
        i = n / 16 * 16;
        quantize_fast16(thresholds, z, i, 1.0f, 1, out, queue);
        free(queue);
    }
#elif defined(TL_VEC)
    int32_t *queue = malloc((size_t)(n / 32 * 32 + 8) * sizeof(int32_t));
    if (queue) { /* as the encoder quantizes (σ = 1) */
        i = n / 32 * 32;
        quantize_fast8(&J, z, i, 1.0f, 1, out, queue);
        free(queue);
    }
#endif
    uint8_t hi[64], lo[64];
    for (; i < n; i += 64) {
        int64_t m = n - i < 64 ? n - i : 64;
        quantize(&J, z + i, m, 1.0f, hi, lo);
        for (int64_t t = 0; t < m; t++) out[i + t] = (uint16_t)(hi[t] << 8 | lo[t]);
    }
}

/* For tests: over every `stride`-th finite float32 z (NaN and ±∞ never reach the guess:
   z_times makes NaN 0, and its product of a finite y and a normal 1/σ is finite — an
   infinite y makes σ infinite and queues the packet), the lanes where quantize_fast16
   would take the guess's cell and that cell is not the thresholds' (quantize_x16's), or
   |z| < 2^−100 (where z_times' error bound does not hold); stride 1 is the proof that
   there are none (stride < 2^27: the bit patterns stay in 32 bits). −1 in a build without
   that path. */
int64_t tl_fast_cell_misses(const float *thresholds, int64_t stride) {
#ifdef TL_AVX512
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i last = _mm512_set1_epi32(0x7F7FFFFF); /* the largest finite float */
    int64_t misses = 0;
    for (uint32_t sign = 0; sign < 2; sign++)
        for (uint64_t b = 0; b <= 0x7F7FFFFFu; b += 16 * (uint64_t)stride) {
            __m512i bits = _mm512_add_epi32(_mm512_set1_epi32((int)b), _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)stride)));
            bits = _mm512_or_si512(_mm512_min_epu32(bits, last), _mm512_set1_epi32((int)(sign << 31)));
            __m512 z = _mm512_castsi512_ps(bits);
            __m512 g;
            guess16_floats(&z, &g, 1);
            __mmask16 wrong = _mm512_cmpneq_epi32_mask(truncate16(g), quantize_x16(thresholds, z)) |
                              _mm512_cmp_ps_mask(_mm512_abs_ps(z), _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ);
            misses += __builtin_popcount((unsigned)(wrong & (__mmask16)~ambiguous16(g)));
        }
    return misses;
#elif defined(TL_VEC)
    /* the AVX2 guess's own proof (the same floats as AVX-512's, here checked, not assumed):
       its cell is right where T[q] ≤ z < T[q + 1] */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i last = _mm256_set1_epi32(0x7F7FFFFF); /* the largest finite float */
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    int64_t misses = 0;
    for (uint32_t sign = 0; sign < 2; sign++)
        for (uint64_t b = 0; b <= 0x7F7FFFFFu; b += 8 * (uint64_t)stride) {
            __m256i bits = _mm256_add_epi32(_mm256_set1_epi32((int)b), _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)stride)));
            bits = _mm256_or_si256(_mm256_min_epu32(bits, last), _mm256_set1_epi32((int)(sign << 31)));
            __m256 z = _mm256_castsi256_ps(bits), g;
            guess8_floats(&z, &g, 1);
            __m256i q = truncate8(g);
            __m256 tq = _mm256_i32gather_ps(thresholds, q, 4), tq1 = _mm256_i32gather_ps(thresholds + 1, q, 4);
            __m256 wrong = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(z, tq, _CMP_LT_OQ), _mm256_cmp_ps(z, tq1, _CMP_GE_OQ)),
                                        _mm256_cmp_ps(_mm256_and_ps(z, magnitude), _mm256_set1_ps(0x1p-100f), _CMP_LT_OQ));
            misses += __builtin_popcount((unsigned)(_mm256_movemask_ps(wrong) & ~ambiguous8(g)));
        }
    return misses;
#else
    (void)thresholds;
    (void)stride;
    return -1;
#endif
}

/* For tests: of the floats w within `steps` float steps of a finite threshold, how many the
   encoder would take as unambiguous (ambiguous16 false). 0 with steps = 4 is the proof
   that the guess may start from y·(1/σ) (z_times). −1 in a build without that path. */
int64_t tl_threshold_neighbours_unambiguous(const float *thresholds, int steps) {
#ifdef TL_VEC
    int64_t taken = 0;
    float w[TL_VEC];
    int filled = 0;
    for (int64_t j = 1; j < (1 << QBITS); j++) {
        float lo = thresholds[j], hi = thresholds[j];
        for (int d = 0; d < steps; d++) {
            lo = nextafterf(lo, -INFINITY);
            hi = nextafterf(hi, INFINITY);
        }
        for (float v = lo;; v = nextafterf(v, INFINITY)) {
            w[filled++] = v;
            if (filled == TL_VEC || v == hi) { /* (a partial last register repeats its lanes) */
                for (int t = filled; t < TL_VEC; t++) w[t] = w[0];
#ifdef TL_AVX512
                __m512 z = _mm512_loadu_ps(w), g;
                guess16_floats(&z, &g, 1);
                unsigned amb = (unsigned)ambiguous16(g);
#else
                __m256 z = _mm256_loadu_ps(w), g;
                guess8_floats(&z, &g, 1);
                unsigned amb = (unsigned)ambiguous8(g);
#endif
                taken += __builtin_popcount(~amb & ((1u << filled) - 1));
                filled = 0;
            }
            if (v == hi) break;
        }
    }
    return taken;
#else
    (void)thresholds;
    (void)steps;
    return -1;
#endif
}

/* -- sign_tail: one packet ---------------------------------------------------------------- */
/* The head: coordinate t of each 8 at bit 7 − t of its byte. The tail: 32 coordinates' 31
   magnitude bits in 31 words, word j = the low 31 − j bits of coordinate j, then the top
   j + 1 bits of coordinate j + 1. */
static void sign_tail_pack(const float *y, int64_t c, uint8_t *body) {
    const uint32_t *raw = (const uint32_t *)y;
    int64_t g8 = 0, g = 0;
    uint32_t *tail = (uint32_t *)(body + c / 8); /* little-endian hosts only (checked at load) */
#ifdef TL_AVX512
    const __m512i rev = _mm512_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8);
    for (; 8 * g8 + 16 <= c; g8 += 2) {
        uint16_t m = (uint16_t)_mm512_movepi32_mask(_mm512_permutexvar_epi32(rev, _mm512_loadu_si512(raw + 8 * g8)));
        memcpy(body + g8, &m, 2);
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i one = _mm512_set1_epi32(1), mag = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i lsh[2], rsh[2], lo[2];
    for (int h = 0; h < 2; h++) { /* word j = 16h + lane */
        __m512i j = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * h));
        lsh[h] = _mm512_add_epi32(j, one);
        rsh[h] = _mm512_sub_epi32(_mm512_set1_epi32(30), j);
        lo[h] = _mm512_sub_epi32(_mm512_srlv_epi32(_mm512_set1_epi32((int)0x80000000u), j), one);
    }
    for (; g < c / 32; g++) {
        const uint32_t *v = raw + 32 * g;
        uint32_t *w = tail + 31 * g;
        for (int h = 0; h < 2; h++) {
            __mmask16 keep = h ? 0x7FFF : 0xFFFF; /* 31 words; coordinate 32 is the next group's */
            __m512i cur = _mm512_loadu_si512(v + 16 * h);
            __m512i next = _mm512_maskz_loadu_epi32(keep, v + 16 * h + 1);
            __m512i word = _mm512_or_si512(_mm512_sllv_epi32(_mm512_and_si512(cur, lo[h]), lsh[h]),
                                           _mm512_srlv_epi32(_mm512_and_si512(next, mag), rsh[h]));
            _mm512_mask_storeu_epi32(w + 16 * h, keep, word);
        }
    }
#elif defined(__AVX2__)
    /* 32 signs a time: saturating packs keep each value's sign in a byte, one dword permute
       and a byte shuffle put coordinate 8k + t at byte 8k + 7 − t, one movemask collects
       them (with a permute and a movemask per 8 coordinates, and the tail's words masked
       before their shift, a span's packing took 1.6× as long) */
    const __m256i dwords = _mm256_setr_epi32(4, 0, 5, 1, 6, 2, 7, 3);
    const __m256i reverse4 = _mm256_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12,
                                              3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12);
    for (; 8 * g8 + 32 <= c; g8 += 4) {
        const __m256i *at = (const __m256i *)(raw + 8 * g8);
        __m256i ab = _mm256_packs_epi32(_mm256_loadu_si256(at), _mm256_loadu_si256(at + 1));
        __m256i cd = _mm256_packs_epi32(_mm256_loadu_si256(at + 2), _mm256_loadu_si256(at + 3));
        __m256i bytes = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), dwords), reverse4);
        uint32_t m = (uint32_t)_mm256_movemask_epi8(bytes);
        memcpy(body + g8, &m, 4);
    }
    /* word j = v[j] ≪ (j + 1) | |v[j + 1]| ≫ (30 − j) (the shift drops v[j]'s top j + 1
       bits), 8 words a register: j from 0, 8, 16 and 23 (the last overlaps the third by one
       word, so that every load and store is a whole register inside the group: masked
       stores are slow on AMD) */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i one = _mm256_set1_epi32(1), mag = _mm256_set1_epi32(0x7FFFFFFF);
    const int first[4] = {0, 8, 16, 23};
    __m256i lsh[4], rsh[4];
    for (int h = 0; h < 4; h++) {
        __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(first[h]));
        lsh[h] = _mm256_add_epi32(j, one);
        rsh[h] = _mm256_sub_epi32(_mm256_set1_epi32(30), j);
    }
    for (; g < c / 32; g++) {
        const uint32_t *v = raw + 32 * g;
        uint32_t *w = tail + 31 * g;
        for (int h = 0; h < 4; h++) {
            __m256i cur = _mm256_loadu_si256((const __m256i *)(v + first[h]));
            __m256i next = _mm256_loadu_si256((const __m256i *)(v + first[h] + 1));
            __m256i word = _mm256_or_si256(_mm256_sllv_epi32(cur, lsh[h]),
                                           _mm256_srlv_epi32(_mm256_and_si256(next, mag), rsh[h]));
            _mm256_storeu_si256((__m256i *)(w + first[h]), word);
        }
    }
#endif
    for (; g8 < c / 8; g8++) {
        uint8_t b = 0;
        for (int t = 0; t < 8; t++) b |= (uint8_t)((raw[8 * g8 + t] >> 31) << (7 - t));
        body[g8] = b;
    }
    for (; g < c / 32; g++) {
        const uint32_t *v = raw + 32 * g;
        uint32_t *w = tail + 31 * g;
        for (int j = 0; j < 31; j++) {
            uint32_t lo = (v[j] & 0x7FFFFFFFu) & ((1u << (31 - j)) - 1u);
            w[j] = (lo << (j + 1)) | ((v[j + 1] & 0x7FFFFFFFu) >> (30 - j));
        }
    }
}

static float sign_tail_encode_packet(const job_t *J, const float *y, int64_t c, uint8_t *body) {
    sign_tail_pack(y, c, body);
    double l1 = lane_sum_f64(y, c, 0);
    double s;
    if (J->unbiased) s = l1 > 0 ? lane_sum_f64(y, c, 1) / l1 : 0.0;
    else s = l1 / (double)c;
    return (float)s;
}

/* Coordinate j of a group of 32 from tail words w[j−1] (its high bits) and w[j] (its low
   bits); its sign is bit 7 − j%8 of head byte j/8 (a little-endian load of 4 bytes). */
#define ST_J(f) f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), f(8), f(9), f(10), f(11), f(12), f(13), \
    f(14), f(15), f(16), f(17), f(18), f(19), f(20), f(21), f(22), f(23), f(24), f(25), f(26), f(27), f(28), \
    f(29), f(30), f(31)
#define ST_LO(j) ((j) == 0 ? 0u : (j) == 31 ? 0x7FFFFFFFu : (1u << (j)) - 1u)
#define ST_HI(j) ((j) == 31 ? 0u : (1u << (31 - (j))) - 1u)
#define ST_LS(j) (31u - (j))
#define ST_RS(j) ((j) == 31 ? 31u : (j) + 1u)
#define ST_SB(j) (8u * ((j) / 8) + 7u - (j) % 8)
static const uint32_t ST_LOMASK[32] = {ST_J(ST_LO)}, ST_HIMASK[32] = {ST_J(ST_HI)};
static const uint32_t ST_LSHIFT[32] = {ST_J(ST_LS)}, ST_RSHIFT[32] = {ST_J(ST_RS)};
static const uint32_t ST_SIGNBIT[32] = {ST_J(ST_SB)};

static void sign_tail_decode_packet(const uint8_t *body, int64_t len, float scale, int64_t c, float *y) {
    int64_t head = c / 8, full = 4 * c;
    if (len > full) len = full;
    if (len < 0) len = 0;
    int64_t words = len > head ? (len - head) / 4 : 0;
    int64_t exact = (words / 31) * 32 + words % 31;
    int64_t have_sign = 8 * len < c ? 8 * len : c;
    const uint8_t *tail = body + head;
    if (exact == c) { /* an untrimmed packet: 32 coordinates from 31 words, branch-free */
        for (int64_t g = 0; g < c / 32; g++) {
            uint32_t out[32], sgn;
            memcpy(&sgn, body + 4 * g, 4); /* coordinate 32g + j: bit 7 - j%8 of byte j/8 */
#if defined(TL_AVX512)
            /* straight from the packet: w[j−1] (for j = 0 the head's last word, masked off)
               and w[j] (lane 31 past the group, not read) */
            const uint8_t *w = tail + 4 * 31 * g;
            for (int j = 0; j < 32; j += 16) {
                __m512i p16 = _mm512_loadu_si512(w + 4 * (j - 1));
                __m512i c16 = _mm512_maskz_loadu_epi32(j ? 0x7FFF : 0xFFFF, w + 4 * j);
                __m512i lo = _mm512_sllv_epi32(_mm512_and_si512(p16, _mm512_loadu_si512(ST_LOMASK + j)),
                                               _mm512_loadu_si512(ST_LSHIFT + j));
                __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(c16, _mm512_loadu_si512(ST_RSHIFT + j)),
                                              _mm512_loadu_si512(ST_HIMASK + j));
                __m512i sb = _mm512_slli_epi32(_mm512_srlv_epi32(_mm512_set1_epi32((int)sgn),
                                                                 _mm512_loadu_si512(ST_SIGNBIT + j)), 31);
                _mm512_storeu_si512(y + 32 * g + j, _mm512_ternarylogic_epi32(lo, hi, sb, 0xFE));
            }
            continue;
#elif defined(__AVX2__)
            /* straight from the packet: w[j−1] (for j = 0 the head's last word, masked off)
               and w[j] (lane 31 past the group, not read) */
            const uint8_t *w = tail + 4 * 31 * g;
            for (int j = 0; j < 32; j += 8) {
                __m256i p8 = _mm256_loadu_si256((const __m256i *)(w + 4 * (j - 1)));
                __m256i c8 = j < 24 ? _mm256_loadu_si256((const __m256i *)(w + 4 * j))
                                    : _mm256_maskload_epi32((const int *)(w + 4 * j),
                                                            _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, -1, 0));
                __m256i lo = _mm256_sllv_epi32(_mm256_and_si256(p8, _mm256_loadu_si256((const __m256i *)(ST_LOMASK + j))),
                                               _mm256_loadu_si256((const __m256i *)(ST_LSHIFT + j)));
                __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(c8, _mm256_loadu_si256((const __m256i *)(ST_RSHIFT + j))),
                                              _mm256_loadu_si256((const __m256i *)(ST_HIMASK + j)));
                __m256i sb = _mm256_slli_epi32(_mm256_srlv_epi32(_mm256_set1_epi32((int)sgn),
                                                                 _mm256_loadu_si256((const __m256i *)(ST_SIGNBIT + j))), 31);
                _mm256_storeu_si256((__m256i *)(y + 32 * g + j), _mm256_or_si256(_mm256_or_si256(lo, hi), sb));
            }
            continue;
#else
            uint32_t prev[32], cur[32];
            prev[0] = 0;
            memcpy(prev + 1, tail + 4 * 31 * g, 31 * 4);
            memcpy(cur, tail + 4 * 31 * g, 31 * 4);
            cur[31] = 0;
            for (int j = 0; j < 32; j++)
                out[j] = ((prev[j] & ST_LOMASK[j]) << ST_LSHIFT[j]) | ((cur[j] >> ST_RSHIFT[j]) & ST_HIMASK[j])
                         | (((sgn >> ST_SIGNBIT[j]) & 1u) << 31);
#endif
            memcpy(y + 32 * g, out, sizeof(out));
        }
        return;
    }
    for (int64_t i = 0; i < c; i++) {
        uint32_t sign = (body[i / 8] >> (7 - i % 8)) & 1u;
        if (i < exact) {
            int64_t g = i / 32, j = i % 32;
            uint32_t w_prev = 0, w_cur = 0, mag;
            if (j > 0) memcpy(&w_prev, tail + 4 * (31 * g + j - 1), 4);
            if (j < 31) memcpy(&w_cur, tail + 4 * (31 * g + j), 4);
            if (j == 31) mag = w_prev & 0x7FFFFFFFu;
            else mag = ((j ? (w_prev & ((1u << j) - 1u)) << (31 - j) : 0u)
                        | ((w_cur >> (j + 1)) & ((1u << (31 - j)) - 1u)));
            uint32_t bits = mag | (sign << 31);
            memcpy(y + i, &bits, 4);
        } else if (i < have_sign) {
            y[i] = (float)(1 - 2 * (int)sign) * scale;
        } else {
            y[i] = 0.0f;
        }
    }
}

/* -- fp32, bf16: raw values, little-endian; bf16 rounds to nearest even as torch does ----- */
static void raw_encode_packet(int codec, const float *y, int64_t c, uint8_t *body) {
    if (codec == FP32) {
        memcpy(body, y, (size_t)c * 4);
        return;
    }
    const uint32_t *u = (const uint32_t *)y;
    uint16_t *out = (uint16_t *)body;
    for (int64_t i = 0; i < c; i++) {
        uint32_t v = u[i];
        int nan = (v & 0x7FFFFFFFu) > 0x7F800000u;
        out[i] = nan ? 0x7FC0 : (uint16_t)((v + 0x7FFFu + ((v >> 16) & 1u)) >> 16);
    }
}

static void raw_decode_packet(int codec, const uint8_t *body, int64_t len, int64_t c, float *y) {
    int64_t width = codec == FP32 ? 4 : 2;
    int64_t have = len / width < c ? (len > 0 ? len / width : 0) : c;
    if (codec == FP32) {
        memcpy(y, body, (size_t)have * 4);
    } else {
        const uint16_t *in = (const uint16_t *)body;
        uint32_t *u = (uint32_t *)y;
        for (int64_t i = 0; i < have; i++) u[i] = (uint32_t)in[i] << 16;
    }
    memset(y + have, 0, (size_t)(c - have) * 4);
}

/* -- spans ------------------------------------------------------------------------------- */
/* e of the largest |value| = m·2^e, m in [0.5, 1), clamped to ±126; 0 for zero or a
   non-finite value, given the largest |value|'s bits (non-finite ones sort above the rest). */
static int32_t exponent_of_top(uint32_t top) {
    if (top >= 0x7F800000u || top == 0) return 0;
    float peak;
    memcpy(&peak, &top, 4);
    int e;
    frexpf(peak, &e);
    return e < -126 ? -126 : (e > 126 ? 126 : e);
}

static int32_t span_exponent(const float *x, int64_t n) {
    const uint32_t *b = (const uint32_t *)x;
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = b[i] & 0x7FFFFFFFu;
        top = a > top ? a : top;
    }
    return exponent_of_top(top);
}

static int64_t packets_in_span(const job_t *J) { return (J->size + J->coords - 1) / J->coords; }

static int64_t row_of(const job_t *J, int64_t s, int64_t p) {
    int64_t n_full = J->size / J->coords;
    return p < n_full ? J->row_full + s * n_full + p : J->row_tail + s;
}

/* A whole span that is neither rotated nor prescaled (fp32, bf16, sign_tail without rotation)
   needs no scratch: its packets are coded straight from the input and decoded straight into
   the output (through the scratch, fp32 copied every value twice each way: its encode took
   1.9× a clone). */
static int straight_through(const job_t *J) {
    return !J->rotated && !J->prescaled && J->filled == J->size;
}

static void encode_span(const job_t *J, int64_t s, float *buf, uint8_t *q, uint32_t *flips) {
    const float *x = J->x + s * J->filled;
    int64_t n = J->size;
    int32_t e = J->prescaled ? span_exponent(x, J->filled) : 0;
    uint64_t key = tl_span_key(J->seed, J->step, J->bucket, (uint64_t)(J->first_span + s));
    float inv_sqrt = (float)(1.0 / sqrt((double)n));
    int straight = straight_through(J);
#ifdef TL_VEC
    if (J->rotated && J->filled == n && n >= 32) { /* fewer passes: read x, prescale and flip in the first */
        const start_t S = {x, J->prescaled ? ldexpf(1.0f, -e) : 0.0f, (const lanes_t *)flips,
                           s + 1 < J->count ? x + J->filled : NULL};
        const finish_t F = {inv_sqrt, 0.0f, NULL, NULL};
        flip_words(key, n, flips);
        fwht_vec(buf, n, &S, &F);
    } else
#endif
    if (!straight) {
        memcpy(buf, x, (size_t)J->filled * sizeof(float));
        memset(buf + J->filled, 0, (size_t)(n - J->filled) * sizeof(float));
        if (J->prescaled) scale_by(buf, J->filled, ldexpf(1.0f, -e));
        if (J->rotated) {
            flip_signs(buf, n, key);
            fwht_scaled(buf, n, inv_sqrt);
        }
    }
    const float *span = straight ? x : buf; /* what the packets are coded from */
    float unit = ldexpf(1.0f, e);
    for (int64_t p = 0; p < packets_in_span(J); p++) {
        int64_t c = n - p * J->coords < J->coords ? n - p * J->coords : J->coords;
        int64_t row = row_of(J, s, p);
        uint8_t *body = J->body + row * J->stride;
        float sigma;
        int64_t used;
        if (J->codec == EMBEDDED) {
            sigma = embedded_encode_packet(J, span + p * J->coords, c, body, q);
            used = (int64_t)J->planes * c / 8;
        } else if (J->codec == SIGN_TAIL) {
            sigma = sign_tail_encode_packet(J, span + p * J->coords, c, body);
            used = 4 * c;
        } else {
            raw_encode_packet(J->codec, span + p * J->coords, c, body);
            sigma = 1.0f;
            used = (J->codec == FP32 ? 4 : 2) * c;
        }
        memset(body + used, 0, (size_t)(J->width - used));
        J->scale[row] = sigma * unit;
    }
}

/* A prescaled span's exponent from the largest scale of its packets that came (the rule
   of trimlab.codec.base.span_exponents: the collector's bookkeeping, done here). */
static int32_t scales_exponent(const job_t *J, const int64_t *slot, int64_t per_span) {
    uint32_t top = 0;
    for (int64_t p = 0; p < per_span; p++) {
        if (slot[p] < 0) continue;
        uint32_t a;
        memcpy(&a, J->row_scale + slot[p], 4);
        a &= 0x7FFFFFFFu;
        top = a > top ? a : top;
    }
    return exponent_of_top(top);
}

/* A packet's body (row < 0: none) fetched into L2: the next span's, while this span's
   are decoded (the reads otherwise wait on memory between spans). */
static void prefetch_row(const job_t *J, int64_t row) {
    if (row < 0) return;
    const uint8_t *b = J->body + row * J->stride;
    for (int64_t o = 0; o < J->length[row]; o += 64) __builtin_prefetch(b + o, 0, 2);
}

static void decode_span(const job_t *J, int64_t s, float *buf, uint32_t *flips) {
    int64_t n = J->size, per_span = packets_in_span(J);
    const int64_t *slot = J->slots + s * per_span;
    int32_t e = !J->prescaled ? 0 : (J->exps ? J->exps[s] : scales_exponent(J, slot, per_span));
    float down = J->exps ? 1.0f : ldexpf(1.0f, -e); /* row_scale ÷ 2^e, unless the caller did */
    int straight = straight_through(J);
    if (straight) buf = J->out + s * J->filled;
    for (int64_t p = 0; p < per_span; p++) {
        int64_t c = n - p * J->coords < J->coords ? n - p * J->coords : J->coords;
        float *y = buf + p * J->coords;
        int64_t row = slot[p];
        prefetch_row(J, s + 1 < J->count ? slot[per_span + p] : -1); /* the next span's packet p */
        if (row < 0) {
            memset(y, 0, (size_t)c * sizeof(float));
        } else if (J->codec == EMBEDDED) {
            embedded_decode_packet(J, J->body + row * J->stride, J->length[row], J->row_scale[row] * down, c, y);
        } else if (J->codec == SIGN_TAIL) {
            sign_tail_decode_packet(J->body + row * J->stride, J->length[row], J->row_scale[row] * down, c, y);
        } else {
            raw_decode_packet(J->codec, J->body + row * J->stride, J->length[row], c, y);
        }
    }
    uint64_t key = tl_span_key(J->seed, J->step, J->bucket, (uint64_t)(J->first_span + s));
    float inv_sqrt = (float)(1.0 / sqrt((double)n));
#ifdef TL_VEC
    if (J->rotated && J->filled == n && n >= 32) { /* the last pass scales, flips, unscales, writes out */
        const finish_t F = {inv_sqrt, J->prescaled ? ldexpf(1.0f, e) : 0.0f, (const lanes_t *)flips,
                            J->out + s * J->filled};
        const start_t S = {buf, 0.0f, NULL, s + 1 < J->count ? J->out + (s + 1) * J->filled : NULL};
        flip_words(key, n, flips);
        fwht_vec(buf, n, &S, &F);
        return;
    }
#endif
    if (straight) return;
    if (J->rotated) {
        fwht_scaled(buf, n, inv_sqrt);
        flip_signs(buf, n, key);
    }
    if (J->prescaled) scale_by(buf, J->filled, ldexpf(1.0f, e));
    memcpy(J->out + s * J->filled, buf, (size_t)J->filled * sizeof(float));
}

typedef struct {
    const job_t *job;
    int64_t first, last;
    int encode, status;
} part_t;

static void *run_part(void *arg) {
    part_t *P = arg;
    const job_t *J = P->job;
    float *buf = aligned_alloc(64, (size_t)((J->size * 4 + 63) / 64 * 64));
    /* embedded's q16 of a packet, then (vector builds) its queue of ambiguous lanes */
    uint8_t *q = malloc((size_t)J->coords * 2 + ((size_t)J->coords + 16) * 4);
    uint32_t *flips = malloc((size_t)(J->size / 32 + 1) * sizeof(uint32_t)); /* a span's sign flips */
    if (!buf || !q || !flips) {
        free(buf);
        free(q);
        free(flips);
        P->status = -1;
        return NULL;
    }
    for (int64_t s = P->first; s < P->last; s++) {
        if (P->encode) encode_span(J, s, buf, q, flips);
        else decode_span(J, s, buf, flips);
    }
    free(buf);
    free(q);
    free(flips);
    P->status = 0;
    return NULL;
}

/* Spans [0, count) split over up to `threads` threads (the caller's thread included). */
static int run_spans(const job_t *J, int encode, int threads) {
    if (threads < 1) threads = 1;
    if (threads > J->count) threads = (int)J->count;
    if (threads > 64) threads = 64;
    part_t parts[64];
    pthread_t tids[64];
    int started[64] = {0};
    for (int t = 0; t < threads; t++) {
        parts[t] = (part_t){J, J->count * t / threads, J->count * (t + 1) / threads, encode, -1};
        if (t > 0) started[t] = pthread_create(&tids[t], NULL, run_part, &parts[t]) == 0;
    }
    run_part(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
        else run_part(&parts[t]);
    }
    for (int t = 0; t < threads; t++)
        if (parts[t].status) return -1;
    return 0;
}

int tl_encode_group(const job_t *J, int threads) { return run_spans(J, 1, threads); }
int tl_decode_group(const job_t *J, int threads) { return run_spans(J, 0, threads); }
int tl_job_size(void) { return (int)sizeof(job_t); }
