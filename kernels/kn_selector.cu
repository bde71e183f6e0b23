/* kernels/kn_selector.cu — DFlash2's candidate selector (semantics and shapes in kn_backend.h,
 * kn_selector_params; the specification in ref/kn_selector_ref.c), forward and backward, fp32.
 *   forward  one block per row: thread 0 finds lab_pos and the candidates; one warp per candidate
 *            gathers S[cand] and dots it with P[pred]⊙u (lanes over Rk, butterfly sum); thread 0
 *            takes choice, logsumexp and ce over the K ≤ 64 scores.
 *   backward (1) one block per row: d = gscale·(softmax − onehot) from the stored scores (warp 0);
 *            per r, t = Σ_c d·S[cand] (c ascending), du = P[pred]·t, and two scratch rows, the dP
 *            contribution u⊙t and pu = P[pred]⊙u (a dS contribution is d·pu); dh += Σ_c d·W[cand]
 *            (threads over D). (2) the contribution ids sorted by target row, cub's radix sort
 *            (stable: a row's contributions stay in ascending (i, c)). (3) one block per tile of
 *            SEL_TILE sorted contributions (threads over Rk) sums each run in order; a run inside
 *            the tile is added to its row at once, a run crossing tiles leaves its pieces in
 *            scratch, and (4) one block per tile boundary adds those in tile order. Long runs (a
 *            frequent token among thousands of rows' candidates) are thus split over many blocks.
 * No atomics: every output element has one writer and one summation order (pieces of SEL_TILE
 * contributions, then the pieces in order), so results are bit-identical run to run. Scratch: the
 * ctx's, 4·(2·n·Rk + 5·n·K + 4·n) bytes, 8·Rk per tile and cub's (~25 MB at n 7680, K 16, Rk 256).
 * Token ids are device memory and not validated: an id outside [0, V) gives NaN scores (fwd) or
 * NaN gradients (bwd) and its dP/dS contributions are dropped, never an access outside the tables. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"

#include <cub/device/device_radix_sort.cuh>
#include <math.h>

#define SEL_THREADS 128         /* per block everywhere: 4 warps share a row's K candidates */
#define SEL_TILE    64          /* sorted contributions per reduction block */
#define SEL_NONE    0xffffffffu /* a key no row has: the neighbour of the first and last tile */

// ----------------------------------------------------------------------------
// kernels

static __device__ __forceinline__ bool sel_id_ok(int32_t v, int64_t V) {
    return v >= 0 && (int64_t)v < V;
}

static __device__ __forceinline__ float sel_nan() {
    return __int_as_float(0x7fc00000);
}

static __global__ void selector_fwd_kernel(kn_selector_params p) {
    __shared__ int32_t s_cand[KN_TOPK_MAX];
    __shared__ float   s_z[KN_TOPK_MAX], s_sc[KN_TOPK_MAX];
    __shared__ int     s_lp;
    const int64_t      i = blockIdx.x;
    const int          K = p.K, Rk = p.Rk;
    if (threadIdx.x == 0) {
        const int32_t lab = p.labels[i];
        int           lp = -1;
        for (int c = 0; c < K && lp < 0; c++)
            if (p.topk_idx[i * K + c] == lab)
                lp = c;
        const bool inject = lp < 0 && p.miss == KN_SEL_INJECT;
        for (int c = 0; c < K; c++) {
            const bool injected = inject && c == K - 1;
            s_cand[c] = injected ? lab : p.topk_idx[i * K + c];
            s_z[c] = injected ? p.label_logit[i] : p.topk_val[i * K + c];
        }
        s_lp = lp;
    }
    __syncthreads();
    const int32_t pv = p.pred[i];
    const bool    pok = sel_id_ok(pv, p.V);
    const float  *pr = p.P + (int64_t)(pok ? pv : 0) * Rk, *ur = p.u + i * Rk;
    const int     warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int c = warp; c < K; c += SEL_THREADS / 32) {
        const int32_t v = s_cand[c];
        const bool    ok = pok && sel_id_ok(v, p.V);
        float         acc = 0.0f;
        if (ok) {
            const float *sr = p.S + (int64_t)v * Rk;
            for (int r = lane; r < Rk; r += 32)
                acc = fmaf(pr[r] * ur[r], sr[r], acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            s_sc[c] = ok ? s_z[c] + acc : sel_nan();
            p.cand[i * K + c] = v;
            p.score[i * K + c] = s_sc[c];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int ch = 0;
        for (int c = 1; c < K; c++)
            if (s_sc[c] > s_sc[ch])
                ch = c;
        float s = 0.0f;
        for (int c = 0; c < K; c++)
            s += expf(s_sc[c] - s_sc[ch]);
        const int li = s_lp >= 0 ? s_lp : p.miss == KN_SEL_INJECT ? K - 1 : -1;
        p.ce[i] = li < 0 ? 0.0f : (s_sc[ch] + logf(s)) - s_sc[li];
        p.lab_pos[i] = s_lp;
        p.choice[i] = ch;
    }
}

/* The backward's scratch (device pointers into ctx->scratch). */
typedef struct sel_scratch {
    float    *d;            /* [n, K] */
    float    *pu, *cp;      /* [n, Rk]: P[pred]⊙u, the dP contribution u⊙t */
    uint32_t *keyP, *keyPs; /* [n] target rows (V for a bad id), before and after the sort */
    int32_t  *valP, *valPs; /* [n] contribution ids i */
    uint32_t *keyS, *keySs; /* [n·K] */
    int32_t  *valS, *valSs; /* [n·K] contribution ids i·K + c */
    float    *head, *tail;  /* [tiles of n·K, Rk]: pieces of runs that cross tiles (P uses the front) */
    void     *cub;
    size_t    cub_bytes;
} sel_scratch;

/* Step (1): one block per row. */
static __global__ void selector_bwd_row_kernel(kn_selector_params p, sel_scratch sc) {
    __shared__ float   s_d[KN_TOPK_MAX];
    __shared__ int32_t s_cand[KN_TOPK_MAX];
    __shared__ int     s_live;
    const int64_t      i = blockIdx.x, V = p.V;
    const int          K = p.K, Rk = p.Rk;
    if (threadIdx.x < 32) {
        const int    lane = threadIdx.x, lp = p.lab_pos[i];
        const int    li = lp >= 0 ? lp : p.miss == KN_SEL_INJECT ? K - 1 : -1;
        const float  g = p.gscale[i];
        const bool   live = li >= 0 && g != 0.0f;
        const float *srow = p.score + i * K;
        const float  x0 = lane < K ? srow[lane] : -INFINITY, x1 = lane + 32 < K ? srow[lane + 32] : -INFINITY;
        const float  m = warp_max(fmaxf(x0, x1));
        const float  e0 = lane < K ? expf(x0 - m) : 0.0f, e1 = lane + 32 < K ? expf(x1 - m) : 0.0f;
        const float  s = warp_sum(e0 + e1);
        for (int c = lane; c < K; c += 32) {
            const int32_t v = p.cand[i * K + c];
            const float   d = live ? g * ((c == lane ? e0 : e1) / s - (c == li ? 1.0f : 0.0f)) : 0.0f;
            s_d[c] = d;
            s_cand[c] = v;
            sc.d[i * K + c] = d;
            sc.keyS[i * K + c] = sel_id_ok(v, V) ? (uint32_t)v : (uint32_t)V;
            sc.valS[i * K + c] = (int32_t)(i * K + c);
        }
        if (lane == 0) {
            const int32_t pv = p.pred[i];
            s_live = live;
            sc.keyP[i] = sel_id_ok(pv, V) ? (uint32_t)pv : (uint32_t)V;
            sc.valP[i] = (int32_t)i;
        }
    }
    __syncthreads();
    const int32_t pv = p.pred[i];
    const bool    pok = sel_id_ok(pv, V), live = s_live;
    for (int r = threadIdx.x; r < Rk; r += blockDim.x) {
        const float pr = pok ? p.P[(int64_t)pv * Rk + r] : sel_nan(), ur = p.u[i * Rk + r];
        float       t = 0.0f;
        for (int c = 0; live && c < K; c++) {
            const int32_t v = s_cand[c];
            t = fmaf(s_d[c], sel_id_ok(v, V) ? p.S[(int64_t)v * Rk + r] : sel_nan(), t);
        }
        p.du[i * Rk + r] = pr * t;
        sc.cp[i * Rk + r] = ur * t;
        sc.pu[i * Rk + r] = pr * ur;
    }
    if (!p.dh || !live)
        return;
    const int bf = p.wdt == CM_DTYPE_BF16;
    for (int64_t col = threadIdx.x; col < p.D; col += blockDim.x) {
        float acc = 0.0f;
        for (int c = 0; c < K; c++) {
            const int32_t v = s_cand[c];
            acc = fmaf(s_d[c], sel_id_ok(v, V) ? ld_f(p.w, bf, (int64_t)v * p.D + col) : sel_nan(), acc);
        }
        p.dh[i * p.D + col] += acc;
    }
}

/* Step (3): tile t holds sorted positions [t·SEL_TILE, min(N, (t + 1)·SEL_TILE)). Contribution j
 * is weight[j]·rows[j / per_row, :] (weight NULL: 1, and then fmaf(1, x, acc) = acc + x exactly). A
 * piece (the part of a run in this tile) that is its whole run goes to dst; the first piece of a
 * run that began before the tile goes to head[t], the last of one that goes on after it to tail[t]. */
static __global__ void selector_tile_kernel(const uint32_t *__restrict__ key, const int32_t *__restrict__ val,
                                            int64_t N, int64_t V, int per_row, int Rk,
                                            const float *__restrict__ weight, const float *__restrict__ rows,
                                            float *__restrict__ dst, float *__restrict__ head,
                                            float *__restrict__ tail) {
    __shared__ uint32_t s_key[SEL_TILE + 2]; /* [0] and [nk + 1]: the neighbours outside the tile */
    __shared__ float    s_w[SEL_TILE];
    __shared__ int64_t  s_row[SEL_TILE];
    const int64_t       t = blockIdx.x, k0 = t * SEL_TILE, k1 = k0 + SEL_TILE < N ? k0 + SEL_TILE : N;
    const int           nk = (int)(k1 - k0);
    for (int k = threadIdx.x; k < nk; k += blockDim.x) {
        const int32_t j = val[k0 + k];
        s_key[k + 1] = key[k0 + k];
        s_w[k] = weight ? weight[j] : 1.0f;
        s_row[k] = (int64_t)(j / per_row) * Rk;
    }
    if (threadIdx.x == 0) {
        s_key[0] = k0 > 0 ? key[k0 - 1] : SEL_NONE;
        s_key[nk + 1] = k1 < N ? key[k1] : SEL_NONE;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < Rk; r += blockDim.x) {
        float acc = 0.0f;
        bool  first = true;
        for (int k = 0; k < nk; k++) {
            acc = fmaf(s_w[k], rows[s_row[k] + r], acc);
            const uint32_t v = s_key[k + 1];
            if (k < nk - 1 && s_key[k + 2] == v)
                continue;
            const bool before = first && s_key[0] == v, after = k == nk - 1 && s_key[nk + 1] == v;
            if (!before && !after) {
                if ((int64_t)v < V)
                    dst[(int64_t)v * Rk + r] += acc;
            } else {
                if (before)
                    head[t * Rk + r] = acc;
                if (after)
                    tail[t * Rk + r] = acc;
            }
            acc = 0.0f;
            first = false;
        }
    }
}

/* Step (4): block b − 1 looks at the boundary b between tiles b − 1 and b (1 ≤ b < tiles). The run
 * across it, when it starts in tile b − 1, is tail[b − 1] + head[b] + … + head[te] (te its last
 * tile), added to its row; a run that starts earlier belongs to an earlier boundary. */
static __global__ void selector_carry_kernel(const uint32_t *__restrict__ key, int64_t N, int64_t V, int Rk,
                                             const float *__restrict__ head, const float *__restrict__ tail,
                                             float *__restrict__ dst) {
    const int64_t  b = (int64_t)blockIdx.x + 1, kb = b * SEL_TILE;
    const uint32_t v = key[kb];
    if (key[kb - 1] != v || (b > 1 && key[kb - SEL_TILE - 1] == v) || (int64_t)v >= V)
        return;
    int64_t te = b;
    while ((te + 1) * SEL_TILE < N && key[(te + 1) * SEL_TILE] == v)
        te++;
    for (int r = threadIdx.x; r < Rk; r += blockDim.x) {
        float acc = tail[(b - 1) * Rk + r];
        for (int64_t t = b; t <= te; t++)
            acc += head[t * Rk + r];
        dst[(int64_t)v * Rk + r] += acc;
    }
}

// ----------------------------------------------------------------------------
// launchers

static cm_status sel_shape_check(const char *op, const kn_selector_params *p) {
    KN_CUDA_CHECK_ARG(
        p->n <= INT32_MAX / p->K,
        "%s: n=%lld rows of K=%d candidates exceed the I32 contribution ids of the cuda kernels", op,
        (long long)p->n, p->K);
    return CM_OK;
}

cm_status kn_cuda_selector_fwd(kn_ctx *ctx, const kn_selector_params *p) {
    CM_TRY(kn_selector_check("selector_fwd", ctx, p, 0));
    if (p->n == 0)
        return CM_OK;
    CM_TRY(sel_shape_check("selector_fwd", p));
    selector_fwd_kernel<<<(unsigned int)p->n, SEL_THREADS, 0, ctx->stream>>>(*p);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

static size_t sel_align(size_t x) {
    return (x + 255) & ~(size_t)255;
}

/* Sorts one contribution list by target row, then reduces it into dst (steps 2–4). */
static cm_status sel_reduce(kn_ctx *ctx, const sel_scratch *sc, const uint32_t *key, uint32_t *key_s,
                            const int32_t *val, int32_t *val_s, int64_t N, int64_t V, int bits, int per_row,
                            int Rk, const float *weight, const float *rows, float *dst) {
    size_t cub_bytes = sc->cub_bytes;
    KN_CUDA(cub::DeviceRadixSort::SortPairs(sc->cub, cub_bytes, key, key_s, val, val_s, (int)N, 0, bits,
                                            ctx->stream));
    const int64_t tiles = (N + SEL_TILE - 1) / SEL_TILE;
    selector_tile_kernel<<<(unsigned int)tiles, SEL_THREADS, 0, ctx->stream>>>(
        key_s, val_s, N, V, per_row, Rk, weight, rows, dst, sc->head, sc->tail);
    KN_CUDA_LAUNCHED(ctx);
    if (tiles > 1) {
        selector_carry_kernel<<<(unsigned int)(tiles - 1), SEL_THREADS, 0, ctx->stream>>>(
            key_s, N, V, Rk, sc->head, sc->tail, dst);
        KN_CUDA_LAUNCHED(ctx);
    }
    return CM_OK;
}

cm_status kn_cuda_selector_bwd(kn_ctx *ctx, const kn_selector_params *p) {
    CM_TRY(kn_selector_check("selector_bwd", ctx, p, 1));
    if (p->n == 0)
        return CM_OK;
    CM_TRY(sel_shape_check("selector_bwd", p));
    const int64_t n = p->n, nk = n * p->K, tiles = (nk + SEL_TILE - 1) / SEL_TILE;
    int           bits = 1; /* keys are ≤ V (V: a bad id) */
    while (bits < 32 && ((int64_t)1 << bits) <= p->V)
        bits++;
    /* cub's temporary storage, enough for either sort (size queries; nothing runs) */
    size_t cub_bytes = 0, cub_p = 0;
    KN_CUDA(cub::DeviceRadixSort::SortPairs(NULL, cub_bytes, (const uint32_t *)NULL, (uint32_t *)NULL,
                                            (const int32_t *)NULL, (int32_t *)NULL, (int)nk, 0, bits,
                                            ctx->stream));
    KN_CUDA(cub::DeviceRadixSort::SortPairs(NULL, cub_p, (const uint32_t *)NULL, (uint32_t *)NULL,
                                            (const int32_t *)NULL, (int32_t *)NULL, (int)n, 0, bits,
                                            ctx->stream));
    cub_bytes = cub_p > cub_bytes ? cub_p : cub_bytes;
    const size_t sz[13] = {
        sel_align((size_t)nk * 4),
        sel_align((size_t)n * p->Rk * 4),
        sel_align((size_t)n * p->Rk * 4),
        sel_align((size_t)n * 4),
        sel_align((size_t)n * 4),
        sel_align((size_t)n * 4),
        sel_align((size_t)n * 4),
        sel_align((size_t)nk * 4),
        sel_align((size_t)nk * 4),
        sel_align((size_t)nk * 4),
        sel_align((size_t)nk * 4),
        sel_align((size_t)tiles * p->Rk * 4),
        sel_align((size_t)tiles * p->Rk * 4),
    };
    size_t total = sel_align(cub_bytes);
    for (int k = 0; k < 13; k++)
        total += sz[k];
    CM_TRY(kn_cuda_scratch_reserve(ctx, total));
    char       *at = (char *)ctx->scratch;
    void       *part[13];
    sel_scratch sc;
    for (int k = 0; k < 13; k++) {
        part[k] = at;
        at += sz[k];
    }
    sc.d = (float *)part[0], sc.pu = (float *)part[1], sc.cp = (float *)part[2];
    sc.keyP = (uint32_t *)part[3], sc.keyPs = (uint32_t *)part[4];
    sc.valP = (int32_t *)part[5], sc.valPs = (int32_t *)part[6];
    sc.keyS = (uint32_t *)part[7], sc.keySs = (uint32_t *)part[8];
    sc.valS = (int32_t *)part[9], sc.valSs = (int32_t *)part[10];
    sc.head = (float *)part[11], sc.tail = (float *)part[12];
    sc.cub = at;
    sc.cub_bytes = sel_align(cub_bytes);

    selector_bwd_row_kernel<<<(unsigned int)n, SEL_THREADS, 0, ctx->stream>>>(*p, sc);
    KN_CUDA_LAUNCHED(ctx);
    /* dP: contribution i is u⊙t of row i; dS: contribution i·K + c is d[i, c]·pu[i] */
    CM_TRY(sel_reduce(ctx, &sc, sc.keyP, sc.keyPs, sc.valP, sc.valPs, n, p->V, bits, 1, p->Rk, NULL, sc.cp,
                      p->dP));
    CM_TRY(sel_reduce(ctx, &sc, sc.keyS, sc.keySs, sc.valS, sc.valSs, nk, p->V, bits, p->K, p->Rk, sc.d,
                      sc.pu, p->dS));
    return CM_OK;
}
