/* kernels/kn_cache.cu — the incremental-decoding ops (kn_backend.h, "incremental decoding"): the
 * key/value cache write, attention over the cache, and the GDN short conv and gated delta rule
 * continued from per-slot states. All fp32 (no tensor cores), whatever the context's GEMM mode:
 * decoding reads few queries against a long cache, so these kernels are bound by the cache and
 * state traffic, not by arithmetic.
 *
 * - kv_cache_write: a copy, one thread per float4 (or float) of a token's [nkv, hd] row; grid y
 *   walks tokens, each finding its sequence by a binary search of cu_seqlens.
 * - attention_cached: split-K ("flash decoding"). A block (4 warps) takes up to R = 4·RW query
 *   rows of one sequence and one kv head (a row is a (token, q head of the group) pair, rows of
 *   a token adjacent) and one of ns splits of the keys those rows see. Tiles of 32 keys go to
 *   shared memory by cp.async (16 B when hd % 4 = 0, else plain loads), K with a row stride
 *   whose 16-byte count is odd so that a lane reading its key's float4s hits distinct banks;
 *   each warp owns RW rows: lane l scores key l of the tile against the rows' q (staged once,
 *   read as broadcasts), the warp takes max and sum by shuffles (online softmax, fp32, expf),
 *   then P·V with the probabilities broadcast by shuffles and lane l accumulating dims l, l+32,
 *   … of each row. One split (ns = 1) writes out, gate applied; more write (m, l, acc) partials
 *   to ctx->scratch and a combine kernel (a block per (token, head)) merges them in split order.
 *   Row tiles: the T·group rows of a kv head are cut into tiles of R; a tile's block serves the
 *   rows of the sequence its first row belongs to, and one extra block per sequence serves the
 *   rows from its start to the next tile boundary, so every row has one block and no block
 *   mixes sequences, whatever the lengths (the host does not know them). ns is chosen from the
 *   number of blocks and max_len (≥ 128 keys per split at max_len, ≤ 64 splits), so a lone
 *   sequence with a long cache still spreads over the GPU.
 * - conv1d_silu_cached: one thread per (token, channel) for out (taps from the state rows, then
 *   the sequence's rows), then one per (sequence, channel) for the state update, a second
 *   launch so that no output reads a state row already replaced.
 * - gdn_cached: the per-token recurrence of kn_gdn.cu's fp32 kernel from the slot's state: one
 *   block (8 warps) per (sequence, v-head, 32 columns of dv), the state tile S[dk, 32] in
 *   registers (lane = column, warp w rows w, w+8, …) across the sequence's tokens, read from the
 *   state once and written once, right after token n_adv − 1 (the later tokens' outputs still
 *   come from the evolving S).
 *
 * The sequence tables (cu_seqlens, slots, base, n_adv) are device memory and cannot be checked
 * on the host: a sequence that breaks a rule the cpu reference refuses (len < 1, rows outside
 * [0, T), slot < 0, base < 0 or base + len > max_len, n_adv outside [0, len]) gets NaN outputs and
 * no cache or state writes; slots[s] < n_slots and distinct slots are the caller's to keep. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include <math.h>
#include <stdint.h>

#define KVW_THREADS    128
#define ATTC_TK        32 /* keys per shared-memory tile: one per lane when scoring */
#define ATTC_WARPS     4
#define ATTC_MAX_HD    256
#define ATTC_MIN_SPLIT 128 /* keys a split covers at least, at max_len */
#define ATTC_MAX_SPLIT 64
#define CONVC_THREADS  128
#define GDNC_WARPS     8  /* row groups of the state tile */
#define GDNC_CH        16 /* tokens staged per shared-memory load */
#define GDNC_MAX_DK    256

// ----------------------------------------------------------------------------
// kernels

/* Sequence s's rows [*bos, *bos + *len) and slot; 0 when they break a rule (len < 1, rows
 * outside [0, T), slot < 0). */
static __device__ __forceinline__ int seq_rows(const int32_t *cu, const int32_t *slots, int s, int64_t T,
                                               int64_t *bos, int64_t *len, int64_t *slot) {
    *bos = cu[s];
    *len = (int64_t)cu[s + 1] - cu[s];
    *slot = slots[s];
    return *bos >= 0 && *len >= 1 && *bos + *len <= T && *slot >= 0;
}

/* grid (row chunks, min(T, 65535)), block KVW_THREADS; row = nkv·hd floats, vec: float4. */
static __global__ void kv_cache_write_kernel(float *kc, float *vc, const float *k, const float *v,
                                             const int32_t *slots, const int32_t *base, const int32_t *cu,
                                             int n_seq, int64_t T, int64_t row, int64_t max_len, int vec) {
    for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
        const int s = seq_of(cu, n_seq, t);
        int64_t   bos, len, slot;
        if (!seq_rows(cu, slots, s, T, &bos, &len, &slot) || t < bos || t >= bos + len || base[s] < 0 ||
            base[s] + len > max_len)
            continue;
        const int64_t dst = (slot * max_len + base[s] + (t - bos)) * row, src = t * row;
        const int64_t n = vec ? row / 4 : row, stride = (int64_t)gridDim.x * blockDim.x;
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
            if (vec) {
                ((float4 *)(kc + dst))[i] = ((const float4 *)(k + src))[i];
                ((float4 *)(vc + dst))[i] = ((const float4 *)(v + src))[i];
            } else {
                kc[dst + i] = k[src + i];
                vc[dst + i] = v[src + i];
            }
        }
    }
}

typedef struct attc_args {
    float         *out;
    float         *pacc, *pml; /* split partials: acc [T·nq, ns, hd], (m, l) [T·nq, ns, 2] */
    const float   *q, *kc, *vc, *gate;
    const int32_t *slots, *base, *cu;
    int64_t        T, max_len;
    int            n_seq, nq, nkv, hd;
    int            hdp, kst; /* hd rounded up to 4; K tile row stride (hdp or hdp + 4, kst/4 odd) */
    int            n_tiles;  /* row tiles of R per kv head: ceil(T·group / R) */
    int            ns, vec;  /* splits; 16-byte cp.async of K and V rows */
    float          scale;
} attc_args;

/* grid (nkv·(n_tiles + n_seq), ns), block 32·ATTC_WARPS; NJ·32 ≥ hd; R = ATTC_WARPS·RW rows.
 * Dynamic shared memory: K tile [ATTC_TK][kst], V tile [ATTC_TK][hdp], q rows [R][hdp]. */
template <int NJ, int RW>
static __global__ void __launch_bounds__(32 * ATTC_WARPS) attention_cached_kernel(attc_args a) {
    constexpr int            R = ATTC_WARPS * RW;
    extern __shared__ float4 smem4[]; /* 16-byte aligned: the cp.async destinations */
    float                   *ks = (float *)smem4, *vs = ks + ATTC_TK * a.kst, *qs = vs + ATTC_TK * a.hdp;
    const int                lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int                group = a.nq / a.nkv, kvh = blockIdx.x % a.nkv, b = blockIdx.x / a.nkv;
    const int                split = blockIdx.y;

    // the block's rows [g_lo, g_hi) of this kv head (row g: token g / group, head g % group)
    int64_t g_lo;
    int     s;
    if (b < a.n_tiles) {
        g_lo = (int64_t)b * R;
        s = seq_of(a.cu, a.n_seq, g_lo / group);
    } else {
        s = b - a.n_tiles;
        g_lo = (int64_t)a.cu[s] * group;
        if (g_lo % R == 0) /* the sequence starts a tile: the tile's block has its first rows */
            return;
    }
    const int64_t bos = a.cu[s], len = (int64_t)a.cu[s + 1] - bos, slot = a.slots[s];
    int64_t       g_hi = (g_lo / R + 1) * R;
    g_hi = g_hi < (bos + len) * group ? g_hi : (bos + len) * group;
    g_hi = g_hi < a.T * group ? g_hi : a.T * group;
    if (g_lo < 0 || g_lo < bos * group || g_lo >= g_hi) /* none, or a table too broken to tell */
        return;
    if (bos < 0 || len < 1 || bos + len > a.T || slot < 0 || a.base[s] < 0 || a.base[s] + len > a.max_len) {
        if (a.ns == 1) /* flag the rows (ns > 1: the combine kernel does) */
            for (int64_t i = threadIdx.x; i < (g_hi - g_lo) * a.hd; i += blockDim.x) {
                const int64_t g = g_lo + i / a.hd;
                a.out[((g / group) * a.nq + kvh * group + g % group) * a.hd + i % a.hd] = NAN;
            }
        return;
    }

    const int64_t b0 = a.base[s];
    int64_t       p[RW]; /* each warp row's position (−1: no row) */
#pragma unroll
    for (int w = 0; w < RW; w++) {
        const int64_t g = g_lo + warp + ATTC_WARPS * w;
        p[w] = g < g_hi ? b0 + g / group - bos : -1;
    }
    const int64_t p_last = b0 + (g_hi - 1) / group - bos; /* the block sees keys 0 .. p_last */
    int64_t       chunk = (p_last + 1 + a.ns - 1) / a.ns;
    chunk = (chunk + ATTC_TK - 1) / ATTC_TK * ATTC_TK;
    const int64_t lo = (int64_t)split * chunk;
    const int64_t hi = lo + chunk < p_last + 1 ? lo + chunk : p_last + 1;

    float m[RW], l[RW], acc[RW][NJ];
#pragma unroll
    for (int w = 0; w < RW; w++) {
        m[w] = -INFINITY;
        l[w] = 0.0f;
#pragma unroll
        for (int j = 0; j < NJ; j++)
            acc[w][j] = 0.0f;
    }
    if (lo < hi)
        for (int i = threadIdx.x; i < R * a.hdp; i += blockDim.x) {
            const int64_t g = g_lo + i / a.hdp;
            const int     d = i % a.hdp;
            qs[i] =
                g < g_hi && d < a.hd ? a.q[((g / group) * a.nq + kvh * group + g % group) * a.hd + d] : 0.0f;
        }

    const int64_t kstride = (int64_t)a.nkv * a.hd;
    const float  *kbase = a.kc + (slot * a.max_len * a.nkv + kvh) * a.hd;
    const float  *vbase = a.vc + (slot * a.max_len * a.nkv + kvh) * a.hd;
    for (int64_t j0 = lo; j0 < hi; j0 += ATTC_TK) {
        const int nk = (int)(hi - j0 < ATTC_TK ? hi - j0 : ATTC_TK);
        if (a.vec) { /* hdp = hd; rows past nk read nothing and are zero-filled */
            const int n4 = a.hdp / 4;
            for (int i = threadIdx.x; i < ATTC_TK * n4; i += blockDim.x) {
                const int     kk = i / n4, c4 = i - kk * n4;
                const int64_t off = kk < nk ? (j0 + kk) * kstride + 4 * c4 : 0;
                cp_async16_n(ks + kk * a.kst + 4 * c4, kbase + off, kk < nk ? 16 : 0);
                cp_async16_n(vs + kk * a.hdp + 4 * c4, vbase + off, kk < nk ? 16 : 0);
            }
            cp_commit();
            cp_wait<0>();
        } else {
            for (int i = threadIdx.x; i < ATTC_TK * a.hdp; i += blockDim.x) {
                const int  kk = i / a.hdp, d = i - kk * a.hdp;
                const bool in = kk < nk && d < a.hd;
                ks[kk * a.kst + d] = in ? kbase[(j0 + kk) * kstride + d] : 0.0f;
                vs[kk * a.hdp + d] = in ? vbase[(j0 + kk) * kstride + d] : 0.0f;
            }
        }
        __syncthreads();

        // scores: lane = key of the tile, against each of the warp's rows
        float         sc[RW];
        const float4 *k4 = (const float4 *)(ks + lane * a.kst);
#pragma unroll
        for (int w = 0; w < RW; w++)
            sc[w] = 0.0f;
        for (int d4 = 0; d4 < a.hdp / 4; d4++) {
            const float4 kv = k4[d4];
#pragma unroll
            for (int w = 0; w < RW; w++) {
                const float4 qv = ((const float4 *)(qs + (warp + ATTC_WARPS * w) * a.hdp))[d4];
                sc[w] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
            }
        }
        float pr[RW];
#pragma unroll
        for (int w = 0; w < RW; w++) {
            const bool  valid = lane < nk && j0 + lane <= p[w];
            const float sv = valid ? sc[w] * a.scale : -INFINITY;
            const float mt = warp_max(sv);
            pr[w] = 0.0f;
            if (mt == -INFINITY) /* warp-uniform: no key of this tile for the row */
                continue;
            const float mn = fmaxf(m[w], mt), corr = expf(m[w] - mn); /* 0 on the row's first key */
            pr[w] = valid ? expf(sv - mn) : 0.0f;
            l[w] = l[w] * corr + warp_sum(pr[w]);
#pragma unroll
            for (int j = 0; j < NJ; j++)
                acc[w][j] *= corr;
            m[w] = mn;
        }
        // P·V: lane accumulates dims lane, lane + 32, ...
#pragma unroll 4
        for (int kk = 0; kk < nk; kk++) {
            float pk[RW];
#pragma unroll
            for (int w = 0; w < RW; w++)
                pk[w] = __shfl_sync(0xffffffffu, pr[w], kk);
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int d = lane + 32 * j;
                if (d < a.hd) {
                    const float vv = vs[kk * a.hdp + d];
#pragma unroll
                    for (int w = 0; w < RW; w++)
                        acc[w][j] += pk[w] * vv;
                }
            }
        }
        __syncthreads(); /* the tile is read; the next one may overwrite it */
    }

#pragma unroll
    for (int w = 0; w < RW; w++) {
        const int64_t g = g_lo + warp + ATTC_WARPS * w, qrow = (g / group) * a.nq + kvh * group + g % group;
        if (g >= g_hi)
            continue;
        if (a.ns == 1) { /* the row's only split saw key 0, so l ≥ 1 */
            float       *o = a.out + qrow * a.hd;
            const float *gr = a.gate ? a.gate + qrow * a.hd : NULL;
            const float  inv = 1.0f / l[w];
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int d = lane + 32 * j;
                if (d < a.hd) {
                    float y = acc[w][j] * inv;
                    if (gr)
                        y *= 1.0f / (1.0f + expf(-gr[d]));
                    o[d] = y;
                }
            }
        } else {
            const int64_t pi = qrow * a.ns + split;
            if (lane == 0) {
                a.pml[2 * pi] = m[w];
                a.pml[2 * pi + 1] = l[w];
            }
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int d = lane + 32 * j;
                if (d < a.hd)
                    a.pacc[pi * a.hd + d] = acc[w][j];
            }
        }
    }
}

/* grid (T·nq), block 128: out = Σ_j e^{m_j − m} acc_j / Σ_j e^{m_j − m} l_j over the splits in
 * order (a split that saw no key has m = −inf, l = 0 and weighs 0), then the gate. */
static __global__ void attention_cached_combine_kernel(attc_args a) {
    __shared__ float wt[ATTC_MAX_SPLIT];
    __shared__ float den_s;
    const int64_t    row = blockIdx.x, t = row / a.nq;
    const int        s = seq_of(a.cu, a.n_seq, t);
    int64_t          bos, len, slot;
    const int        ok = seq_rows(a.cu, a.slots, s, a.T, &bos, &len, &slot) && t >= bos && t < bos + len &&
                   a.base[s] >= 0 && a.base[s] + len <= a.max_len;
    float *o = a.out + row * a.hd;
    if (!ok) {
        for (int d = threadIdx.x; d < a.hd; d += blockDim.x)
            o[d] = NAN;
        return;
    }
    const float *ml = a.pml + row * a.ns * 2;
    float        mx = -INFINITY;
    for (int j = 0; j < a.ns; j++)
        mx = fmaxf(mx, ml[2 * j]);
    for (int j = threadIdx.x; j < a.ns; j += blockDim.x)
        wt[j] = ml[2 * j] == -INFINITY ? 0.0f : expf(ml[2 * j] - mx);
    __syncthreads();
    if (threadIdx.x == 0) {
        float den = 0.0f;
        for (int j = 0; j < a.ns; j++)
            den += wt[j] * ml[2 * j + 1];
        den_s = den;
    }
    __syncthreads();
    const float *pa = a.pacc + row * a.ns * a.hd;
    const float *gr = a.gate ? a.gate + row * a.hd : NULL;
    for (int d = threadIdx.x; d < a.hd; d += blockDim.x) {
        float num = 0.0f;
        for (int j = 0; j < a.ns; j++)
            num += wt[j] * pa[(int64_t)j * a.hd + d];
        float y = num / den_s;
        if (gr)
            y *= 1.0f / (1.0f + expf(-gr[d]));
        o[d] = y;
    }
}

/* grid (channel chunks, min(T, 65535)), block CONVC_THREADS: out[t, c] from the K taps of
 * x̃ (state rows of the slot, then the sequence's rows), fp32 in tap order, then SiLU. */
static __global__ void conv1d_silu_cached_kernel(float *out, const float *x, const float *w,
                                                 const float *state, const int32_t *slots,
                                                 const int32_t *n_adv, const int32_t *cu, int n_seq,
                                                 int64_t T, int64_t C, int K) {
    for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
        const int s = seq_of(cu, n_seq, t);
        int64_t   bos, len, slot;
        const int ok = seq_rows(cu, slots, s, T, &bos, &len, &slot) && t >= bos && t < bos + len &&
                       (!n_adv || (n_adv[s] >= 0 && n_adv[s] <= len));
        const int64_t i = t - bos;
        const float  *st = ok && K > 1 ? state + slot * (K - 1) * C : NULL;
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < C;
             c += (int64_t)gridDim.x * blockDim.x) {
            if (!ok) {
                out[t * C + c] = NAN;
                continue;
            }
            float acc = 0.0f;
            for (int j = 0; j < K; j++) {
                const int64_t r = i - (K - 1) + j;
                acc += w[c * K + j] * (r < 0 ? st[(K - 1 + r) * C + c] : x[(bos + r) * C + c]);
            }
            out[t * C + c] = kn_silu(acc);
        }
    }
}

/* grid (channel chunks, min(n_seq, 65535)), block CONVC_THREADS: state row r ← x̃[a − (K−1) + r]
 * in increasing r; a state row read is a + r > r (a ≥ 1), not yet replaced. */
static __global__ void conv1d_state_kernel(const float *x, float *state, const int32_t *slots,
                                           const int32_t *n_adv, const int32_t *cu, int n_seq, int64_t T,
                                           int64_t C, int K) {
    for (int s = blockIdx.y; s < n_seq; s += gridDim.y) {
        int64_t       bos, len, slot;
        const int64_t adv = n_adv[s];
        if (!seq_rows(cu, slots, s, T, &bos, &len, &slot) || adv < 1 || adv > len)
            continue;
        float *st = state + slot * (K - 1) * C;
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < C;
             c += (int64_t)gridDim.x * blockDim.x)
            for (int r = 0; r < K - 1; r++) {
                const int64_t src = adv - (K - 1) + r;
                st[r * C + c] = src < 0 ? st[(K - 1 + src) * C + c] : x[(bos + src) * C + c];
            }
    }
}

typedef struct gdnc_args {
    float         *out;
    const float   *q, *k, *v, *g, *beta;
    float         *state;
    const int32_t *slots, *n_adv, *cu;
    int64_t        T;
    int            n_seq, nk, nv, dk, dv;
    float          scale;
} gdnc_args;

/* NR = state rows per thread, 8·NR ≥ dk. grid (n_seq·nv, ceil(dv/32)), block 32·GDNC_WARPS.
 * Dynamic shared memory: k_s, q_s [GDNC_CH][8·NR], v_s [GDNC_CH][32], g_s, b_s [GDNC_CH]. */
template <int NR> static __global__ void __launch_bounds__(32 * GDNC_WARPS) gdn_cached_kernel(gdnc_args a) {
    constexpr int           DKP = GDNC_WARPS * NR;
    extern __shared__ float smem[];
    float                  *k_s = smem, *q_s = k_s + GDNC_CH * DKP, *v_s = q_s + GDNC_CH * DKP;
    float                  *g_s = v_s + GDNC_CH * 32, *b_s = g_s + GDNC_CH;
    __shared__ float        red_kv[GDNC_WARPS][32], red_o[GDNC_WARPS][32];

    const int     s = blockIdx.x / a.nv, h = blockIdx.x % a.nv, kh = h / (a.nv / a.nk);
    const int     lane = threadIdx.x % 32, warp = threadIdx.x / 32, col = blockIdx.y * 32 + lane;
    int64_t       bos, len, slot;
    const int64_t adv = a.n_adv ? a.n_adv[s] : -1;
    if (!seq_rows(a.cu, a.slots, s, a.T, &bos, &len, &slot) || (a.n_adv && (adv < 0 || adv > len))) {
        if (a.out && bos >= 0 && bos < a.T) { /* flag the rows the sequence may own */
            const int64_t n = len < 0 ? 0 : (len < a.T - bos ? len : a.T - bos);
            for (int64_t i = threadIdx.x; i < n * 32; i += blockDim.x)
                if (blockIdx.y * 32 + i % 32 < a.dv)
                    a.out[((bos + i / 32) * a.nv + h) * (int64_t)a.dv + blockIdx.y * 32 + i % 32] = NAN;
        }
        return;
    }
    const int64_t n_run = a.out ? len : (adv > 0 ? adv : 0);
    if (n_run == 0)
        return;
    float *st = a.state + (slot * a.nv + h) * (int64_t)a.dk * a.dv;
    float  S[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) {
        const int row = warp + GDNC_WARPS * r;
        S[r] = row < a.dk && col < a.dv ? st[(int64_t)row * a.dv + col] : 0.0f;
    }

    for (int64_t t0 = 0; t0 < n_run; t0 += GDNC_CH) { /* t0: the chunk's first token in the sequence */
        const int L = (int)(n_run - t0 < GDNC_CH ? n_run - t0 : GDNC_CH);
        for (int i = threadIdx.x; i < GDNC_CH * DKP; i += blockDim.x) {
            const int     tau = i / DKP, d = i % DKP;
            const int64_t off = ((bos + t0 + tau) * a.nk + kh) * (int64_t)a.dk + d;
            const bool    in = tau < L && d < a.dk;
            k_s[i] = in ? a.k[off] : 0.0f;
            q_s[i] = in && a.out ? a.q[off] * a.scale : 0.0f;
        }
        for (int i = threadIdx.x; i < GDNC_CH * 32; i += blockDim.x) {
            const int tau = i / 32, c = blockIdx.y * 32 + i % 32;
            v_s[i] = tau < L && c < a.dv ? a.v[((bos + t0 + tau) * a.nv + h) * (int64_t)a.dv + c] : 0.0f;
        }
        for (int tau = threadIdx.x; tau < GDNC_CH; tau += blockDim.x) {
            g_s[tau] = tau < L ? a.g[(bos + t0 + tau) * a.nv + h] : 0.0f;
            b_s[tau] = tau < L ? a.beta[(bos + t0 + tau) * a.nv + h] : 0.0f;
        }
        __syncthreads();

        for (int tau = 0; tau < L; tau++) {
            const float *kt = k_s + tau * DKP, *qt = q_s + tau * DKP;
            float        pk = 0.0f;
#pragma unroll
            for (int r = 0; r < NR; r++)
                pk += S[r] * kt[warp + GDNC_WARPS * r];
            red_kv[warp][lane] = pk;
            __syncthreads();
            float kv = 0.0f;
#pragma unroll
            for (int w = 0; w < GDNC_WARPS; w++)
                kv += red_kv[w][lane];
            const float decay = expf(g_s[tau]);
            const float u = b_s[tau] * (v_s[tau * 32 + lane] - decay * kv);
            float       po = 0.0f;
#pragma unroll
            for (int r = 0; r < NR; r++) {
                S[r] = decay * S[r] + kt[warp + GDNC_WARPS * r] * u;
                po += S[r] * qt[warp + GDNC_WARPS * r];
            }
            if (t0 + tau == adv - 1) { /* the committed state: S after token n_adv − 1 */
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    const int row = warp + GDNC_WARPS * r;
                    if (row < a.dk && col < a.dv)
                        st[(int64_t)row * a.dv + col] = S[r];
                }
            }
            red_o[warp][lane] = po;
            __syncthreads();
            if (a.out && warp == 0 && col < a.dv) {
                float o = 0.0f;
#pragma unroll
                for (int w = 0; w < GDNC_WARPS; w++)
                    o += red_o[w][lane];
                a.out[((bos + t0 + tau) * a.nv + h) * (int64_t)a.dv + col] = o;
            }
        }
        /* the last token's second barrier ordered every read of the staged chunk before the
         * next chunk's writes, and every red_kv read before the next token's write */
    }
}

// ----------------------------------------------------------------------------
// launchers

cm_status kn_cuda_kv_cache_write(kn_ctx *ctx, float *kc, float *vc, const float *k, const float *v,
                                 const int32_t *slots, const int32_t *base, const int32_t *cu_seqlens,
                                 int n_seq, int64_t T, int nkv, int hd, int64_t max_len) {
    KN_CUDA_CHECK_ARG(ctx, "kv_cache_write: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && nkv > 0 && hd > 0 && max_len > 0,
                      "kv_cache_write: bad shape T=%lld nkv=%d hd=%d max_len=%lld (T >= 0, the others > 0)",
                      (long long)T, nkv, hd, (long long)max_len);
    KN_CUDA_CHECK_ARG(n_seq >= 0 && T >= n_seq && (T == 0 || n_seq > 0),
                      "kv_cache_write: T=%lld tokens for n_seq=%d sequences (each has at least one)",
                      (long long)T, n_seq);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(kc && vc && k && v && slots && base && cu_seqlens,
                      "kv_cache_write: kc, vc, k, v, slots, base or cu_seqlens is NULL");
    const int64_t row = (int64_t)nkv * hd;
    const int vec = row % 4 == 0 && ((uintptr_t)kc | (uintptr_t)vc | (uintptr_t)k | (uintptr_t)v) % 16 == 0;
    const int64_t gx = ((vec ? row / 4 : row) + KVW_THREADS - 1) / KVW_THREADS;
    dim3          grid((unsigned int)(gx < 65535 ? gx : 65535), (unsigned int)(T < 65535 ? T : 65535));
    kv_cache_write_kernel<<<grid, KVW_THREADS, 0, ctx->stream>>>(kc, vc, k, v, slots, base, cu_seqlens, n_seq,
                                                                 T, row, max_len, vec);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

template <int NJ, int RW>
static cm_status attention_cached_launch(kn_ctx *ctx, const attc_args *a, dim3 grid, size_t smem) {
    if (smem > 48 * 1024)
        KN_CUDA(cudaFuncSetAttribute(attention_cached_kernel<NJ, RW>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    attention_cached_kernel<NJ, RW><<<grid, 32 * ATTC_WARPS, smem, ctx->stream>>>(*a);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_attention_cached(kn_ctx *ctx, float *out, const float *q, const float *kc, const float *vc,
                                   const float *gate, const int32_t *slots, const int32_t *base,
                                   const int32_t *cu_seqlens, int n_seq, int64_t T, int nq, int nkv, int hd,
                                   int64_t max_len, float scale) {
    KN_CUDA_CHECK_ARG(ctx, "attention_cached: ctx is NULL");
    KN_CUDA_CHECK_ARG(
        T >= 0 && nq > 0 && nkv > 0 && hd > 0 && max_len > 0,
        "attention_cached: bad shape T=%lld nq=%d nkv=%d hd=%d max_len=%lld (T >= 0, the others > 0)",
        (long long)T, nq, nkv, hd, (long long)max_len);
    KN_CUDA_CHECK_ARG(nq % nkv == 0, "attention_cached: nq=%d must be a multiple of nkv=%d", nq, nkv);
    KN_CUDA_CHECK_ARG(n_seq >= 0 && T >= n_seq && (T == 0 || n_seq > 0),
                      "attention_cached: T=%lld tokens for n_seq=%d sequences (each has at least one)",
                      (long long)T, n_seq);
    if (hd > ATTC_MAX_HD)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "attention_cached: head dim %d is not supported by the cuda backend (max %d)", hd,
                       ATTC_MAX_HD);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && q && kc && vc && slots && base && cu_seqlens,
                      "attention_cached: out, q, kc, vc, slots, base or cu_seqlens is NULL");

    // rows per block from the mean rows per (sequence, kv head); splits to fill the device
    const int     group = nq / nkv;
    const int64_t mean_rows = (T * group + n_seq - 1) / n_seq;
    const int     rw = mean_rows <= ATTC_WARPS ? 1 : mean_rows <= 2 * ATTC_WARPS ? 2 : 4;
    const int     R = ATTC_WARPS * rw;
    const int64_t n_tiles = (T * group + R - 1) / R, n_blocks = (int64_t)nkv * (n_tiles + n_seq);
    KN_CUDA_CHECK_ARG(n_blocks <= INT32_MAX && T * nq <= INT32_MAX,
                      "attention_cached: T=%lld tokens with nq=%d heads exceed the cuda grid limits",
                      (long long)T, nq);
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        sms = 1;
    }
    int64_t       ns = (4 * (int64_t)sms + (int64_t)nkv * n_tiles - 1) / ((int64_t)nkv * n_tiles);
    const int64_t ns_cap = (max_len + ATTC_MIN_SPLIT - 1) / ATTC_MIN_SPLIT;
    ns = ns < ns_cap ? ns : ns_cap;
    ns = ns < ATTC_MAX_SPLIT ? (ns < 1 ? 1 : ns) : ATTC_MAX_SPLIT;

    attc_args a;
    a.out = out, a.q = q, a.kc = kc, a.vc = vc, a.gate = gate;
    a.slots = slots, a.base = base, a.cu = cu_seqlens;
    a.T = T, a.max_len = max_len, a.n_seq = n_seq, a.nq = nq, a.nkv = nkv, a.hd = hd;
    a.hdp = (hd + 3) / 4 * 4;
    a.kst = (a.hdp / 4) % 2 ? a.hdp : a.hdp + 4;
    a.n_tiles = (int)n_tiles, a.ns = (int)ns, a.scale = scale;
    a.vec = hd % 4 == 0 && ((uintptr_t)kc | (uintptr_t)vc) % 16 == 0;
    a.pacc = a.pml = NULL;
    if (ns > 1) {
        const size_t n_part = (size_t)(T * nq * ns);
        CM_TRY(kn_cuda_scratch_reserve(ctx, n_part * (size_t)(hd + 2) * sizeof(float)));
        a.pacc = (float *)ctx->scratch;
        a.pml = a.pacc + n_part * (size_t)hd;
    }
    const size_t smem = (size_t)(ATTC_TK * a.kst + ATTC_TK * a.hdp + R * a.hdp) * sizeof(float);
    int          optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device) != cudaSuccess) {
        cudaGetLastError();
        optin = 48 * 1024;
    }
    if (smem > (size_t)optin)
        return CM_FAIL(CM_ERR_UNSUPPORTED,
                       "attention_cached: %zu bytes of shared memory per block at head dim %d exceed the "
                       "device's %d",
                       smem, hd, optin);

    const dim3 grid((unsigned int)n_blocks, (unsigned int)ns);
    const int  nj = hd <= 32 ? 1 : hd <= 64 ? 2 : hd <= 128 ? 4 : 8;
    cm_status  st = CM_OK;
#define ATTC_CASE(NJ)                                                                                        \
    case NJ:                                                                                                 \
        st = rw == 1   ? attention_cached_launch<NJ, 1>(ctx, &a, grid, smem)                                 \
             : rw == 2 ? attention_cached_launch<NJ, 2>(ctx, &a, grid, smem)                                 \
                       : attention_cached_launch<NJ, 4>(ctx, &a, grid, smem);                                \
        break;
    switch (nj) {
        ATTC_CASE(1)
        ATTC_CASE(2)
        ATTC_CASE(4)
        ATTC_CASE(8)
    }
#undef ATTC_CASE
    if (st != CM_OK || ns == 1)
        return st;
    attention_cached_combine_kernel<<<(unsigned int)(T * nq), 128, 0, ctx->stream>>>(a);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_conv1d_silu_cached(kn_ctx *ctx, float *out, const float *x, const float *w, float *state,
                                     const int32_t *slots, const int32_t *n_adv, const int32_t *cu_seqlens,
                                     int n_seq, int64_t T, int64_t C, int K) {
    KN_CUDA_CHECK_ARG(ctx, "conv1d_silu_cached: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && C > 0 && K > 0,
                      "conv1d_silu_cached: bad shape T=%lld C=%lld K=%d (T >= 0, C > 0, K > 0)", (long long)T,
                      (long long)C, K);
    KN_CUDA_CHECK_ARG(n_seq >= 0 && T >= n_seq && (T == 0 || n_seq > 0),
                      "conv1d_silu_cached: T=%lld tokens for n_seq=%d sequences (each has at least one)",
                      (long long)T, n_seq);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(x && w && slots && cu_seqlens && (state || K == 1),
                      "conv1d_silu_cached: x, w, state, slots or cu_seqlens is NULL");
    if (out) {
        const uintptr_t o0 = (uintptr_t)out, x0 = (uintptr_t)x, bytes = (uintptr_t)(T * C) * sizeof(float);
        KN_CUDA_CHECK_ARG(o0 + bytes <= x0 || x0 + bytes <= o0,
                          "conv1d_silu_cached: out overlaps x (use a separate buffer)");
    }
    const int64_t gx = (C + CONVC_THREADS - 1) / CONVC_THREADS;
    if (out) {
        dim3 grid((unsigned int)(gx < 65535 ? gx : 65535), (unsigned int)(T < 65535 ? T : 65535));
        conv1d_silu_cached_kernel<<<grid, CONVC_THREADS, 0, ctx->stream>>>(out, x, w, state, slots, n_adv,
                                                                           cu_seqlens, n_seq, T, C, K);
        KN_CUDA_LAUNCHED(ctx);
    }
    if (n_adv && K > 1) { /* after out: the outputs read the old state rows */
        dim3 grid((unsigned int)(gx < 65535 ? gx : 65535), (unsigned int)(n_seq < 65535 ? n_seq : 65535));
        conv1d_state_kernel<<<grid, CONVC_THREADS, 0, ctx->stream>>>(x, state, slots, n_adv, cu_seqlens,
                                                                     n_seq, T, C, K);
        KN_CUDA_LAUNCHED(ctx);
    }
    return CM_OK;
}

cm_status kn_cuda_gdn_cached(kn_ctx *ctx, float *out, const float *q, const float *k, const float *v,
                             const float *g, const float *beta, float *state, const int32_t *slots,
                             const int32_t *n_adv, const int32_t *cu_seqlens, int n_seq, int64_t T, int nk,
                             int nv, int dk, int dv, float scale) {
    KN_CUDA_CHECK_ARG(ctx, "gdn_cached: ctx is NULL");
    KN_CUDA_CHECK_ARG(T >= 0 && nk > 0 && nv > 0 && dk > 0 && dv > 0,
                      "gdn_cached: bad shape T=%lld nk=%d nv=%d dk=%d dv=%d (T >= 0, the others > 0)",
                      (long long)T, nk, nv, dk, dv);
    KN_CUDA_CHECK_ARG(nv % nk == 0, "gdn_cached: nv=%d must be a multiple of nk=%d", nv, nk);
    KN_CUDA_CHECK_ARG(n_seq >= 0 && T >= n_seq && (T == 0 || n_seq > 0),
                      "gdn_cached: T=%lld tokens for n_seq=%d sequences (each has at least one)",
                      (long long)T, n_seq);
    if (dk > GDNC_MAX_DK)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "gdn_cached: dk=%d is not supported by the cuda backend (max %d)",
                       dk, GDNC_MAX_DK);
    KN_CUDA_CHECK_ARG((int64_t)n_seq * nv <= INT32_MAX && dv <= 65535 * 32,
                      "gdn_cached: n_seq·nv=%lld or dv=%d exceeds the cuda grid limits",
                      (long long)n_seq * nv, dv);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(k && v && g && beta && state && slots && cu_seqlens,
                      "gdn_cached: k, v, g, beta, state, slots or cu_seqlens is NULL");
    KN_CUDA_CHECK_ARG(!out || q, "gdn_cached: q is NULL but out is not (q may be NULL only without out)");
    if (!out && !n_adv)
        return CM_OK;

    gdnc_args a = {out, q, k, v, g, beta, state, slots, n_adv, cu_seqlens, T, n_seq, nk, nv, dk, dv, scale};
    dim3      grid((unsigned int)(n_seq * nv), (unsigned int)((dv + 31) / 32));
    int       nr = 1;
    while (GDNC_WARPS * nr < dk)
        nr *= 2;
    const size_t smem = (size_t)(2 * GDNC_CH * GDNC_WARPS * nr + GDNC_CH * 32 + 2 * GDNC_CH) * sizeof(float);
    switch (nr) {
#define GDNC_CASE(n)                                                                                         \
    case n:                                                                                                  \
        gdn_cached_kernel<n><<<grid, 32 * GDNC_WARPS, smem, ctx->stream>>>(a);                               \
        break;
        GDNC_CASE(1)
        GDNC_CASE(2)
        GDNC_CASE(4)
        GDNC_CASE(8)
        GDNC_CASE(16)
        GDNC_CASE(32)
#undef GDNC_CASE
    }
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
