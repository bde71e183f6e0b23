/* kernels/kn_norm.cu — the row norms: rmsnorm (y = x·rsqrt(mean(x²) + eps)·(w or 1 + w)),
 * the GDN output norm rmsnorm_gated (y = w·(x·rsqrt(mean(x²) + eps))·silu(z)) and l2norm
 * (y = x·rsqrt(sum(x²) + eps)). One block per row (grid-stride over rows), 32..256 threads
 * by C: pass 1 reads the row with coalesced loads and sums x² in fp32 per thread, reduced by
 * warp shuffles and a 32-slot shared array; pass 2 re-reads the row (L1/L2 hits) and writes
 * y. The scale is 1/sqrtf (correctly rounded), so results are within a few ulp of the
 * double reference for rows up to ~10⁴. out may equal inp: each element is read, then
 * written, by the same thread. Writes out (=).
 * The bf16-output forms for the target's fast path: add_rmsnorm_bf16 (the residual add fused
 * into the norm that follows it; the add stays in x) and rmsnorm_gated_bf16 (a warp per row);
 * each writes the next GEMM's bf16 input with the f32 math of the kernels above, so the
 * conversion pass of gemm disappears; add_rmsnorm_fp8 and rmsnorm_gated_fp8 write that input
 * quantized for FP8 projections (kn_fp8_dev.h), so their quantization pass disappears too.
 * rmsnorm_typed is the drafter's norm on BF16 storage: the residual stream rounded and saved,
 * or a saved BF16 row read as it is, and the next GEMM's bf16 input written, in one pass. Where
 * C % 4 == 0 (C ≤ 8192) and the rows are aligned it holds each row in registers between the sum
 * and the write (rmsnorm_typed_vec_kernel: 16-byte F32 / 8-byte BF16 accesses, every load of a
 * thread in flight at once), so the row is read once: at the drafter's R = 8192, C = 5120 the
 * saving norm moves 16 B an element (x read and written back rounded, x_bf16, out, out_bf16:
 * 671 MB, ~160 µs at 4.2 TB/s), the norm of a saved row 4 B (bf16 in, bf16 out: 168 MB, ~40 µs).
 * Other shapes keep the scalar two-pass kernel. */
#include "kn_cuda.h"
#include "kn_cuda_ops.h"
#include "kn_device.h"
#include "kn_fp8_dev.h"
#include "kn_norm_int.h"

#include <cuda_bf16.h>

// ----------------------------------------------------------------------------
// kernels

static __device__ __forceinline__ float row_sumsq(const float *x, int64_t C, float *sh) {
    float s = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        s += x[c] * x[c];
    return block_sum(s, sh);
}

static __global__ void rmsnorm_kernel(float *out, const float *inp, const float *w, int64_t rows, int64_t C,
                                      float eps, int one_plus) {
    __shared__ float sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = inp + r * C;
        float       *y = out + r * C;
        float        scale = 1.0f / sqrtf(row_sumsq(x, C, sh) / (float)C + eps);
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            float wc = one_plus ? 1.0f + w[c] : w[c];
            y[c] = x[c] * scale * wc;
        }
    }
}

static __global__ void rmsnorm_gated_kernel(float *out, const float *xs, const float *zs, const float *w,
                                            int64_t rows, int64_t C, float eps) {
    __shared__ float sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = xs + r * C;
        const float *z = zs + r * C;
        float       *y = out + r * C;
        float        scale = 1.0f / sqrtf(row_sumsq(x, C, sh) / (float)C + eps);
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            float zc = z[c];
            y[c] = w[c] * (x[c] * scale) * kn_silu(zc);
        }
    }
}

static __global__ void l2norm_kernel(float *out, const float *inp, int64_t rows, int64_t C, float eps) {
    __shared__ float sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *x = inp + r * C;
        float       *y = out + r * C;
        float        scale = 1.0f / sqrtf(row_sumsq(x, C, sh) + eps);
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
            y[c] = x[c] * scale;
    }
}

/* Pass 1 of the fused norms over one row of C4 float4 (16-byte aligned): x += y where y is
 * given (stored), and this thread's sum of the squares of x. */
static __device__ __forceinline__ float add_sumsq4(float4 *x4, const float4 *y4, int64_t C4) {
    float s = 0.0f;
    for (int64_t c = threadIdx.x; c < C4; c += blockDim.x) {
        float4 v = x4[c];
        if (y4) {
            float4 u = y4[c];
            v.x += u.x;
            v.y += u.y;
            v.z += u.z;
            v.w += u.w;
            x4[c] = v;
        }
        /* each square fused into the sum, written out: left to the compiler, which product of
           x² + y² it fused changed with unrelated code around it, and with it the bits */
        s = __fmaf_rn(v.w, v.w, __fmaf_rn(v.z, v.z, __fmaf_rn(v.y, v.y, __fmaf_rn(v.x, v.x, s))));
    }
    return s;
}

/* Pass 2 of the fused norms: four normed values of x as bf16, scaled by w (1 + w where
 * one_plus). One helper so that the bf16 and FP8 kernels compute the same products. */
static __device__ __forceinline__ void norm4_bf16(float4 v, float4 wc, float scale, int one_plus, __nv_bfloat162 *lo,
                                                  __nv_bfloat162 *hi) {
    if (one_plus) {
        wc.x += 1.0f;
        wc.y += 1.0f;
        wc.z += 1.0f;
        wc.w += 1.0f;
    }
    *lo = __floats2bfloat162_rn(v.x * scale * wc.x, v.y * scale * wc.y);
    *hi = __floats2bfloat162_rn(v.z * scale * wc.z, v.w * scale * wc.w);
}

/* One element of the gated norm, w · (x · scale) · silu(z), as bf16: shared by the bf16 and
 * FP8 kernels, which must give the same values. */
static __device__ __forceinline__ __nv_bfloat16 gated_bf16(float x, float z, float w, float scale) {
    return __float2bfloat16_rn(w * (x * scale) * kn_silu(z));
}

/* x += y (y may be NULL), then out = bf16(rmsnorm(x)): the residual add fused into the next
 * norm, which writes the bf16 input of the following GEMMs. One block per row; pass 1 adds,
 * stores x and sums squares (float4 when vec: C % 4 == 0 and 16-byte aligned rows), pass 2
 * re-reads the thread's own x (L1/L2) and writes bf16. Per element the f32 math is that of
 * add then rmsnorm_kernel. */
static __global__ void add_rmsnorm_bf16_kernel(__nv_bfloat16 *out, float *xs, const float *ys, const float *w,
                                               int64_t rows, int64_t C, float eps, int one_plus, int vec) {
    __shared__ float sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float         *x = xs + r * C;
        const float   *y = ys ? ys + r * C : NULL;
        __nv_bfloat16 *o = out + r * C;
        float          s = 0.0f;
        if (vec) {
            s = add_sumsq4((float4 *)x, (const float4 *)y, C / 4);
        } else {
            for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
                float v = x[c];
                if (y) {
                    v += y[c];
                    x[c] = v;
                }
                s += v * v;
            }
        }
        float scale = 1.0f / sqrtf(block_sum(s, sh) / (float)C + eps);
        if (vec) {
            const float4 *x4 = (const float4 *)x;
            const float4 *w4 = (const float4 *)w;
            for (int64_t c = threadIdx.x; c < C / 4; c += blockDim.x) {
                __nv_bfloat162 lo, hi;
                norm4_bf16(x4[c], w4[c], scale, one_plus, &lo, &hi);
                ((__nv_bfloat162 *)o)[2 * c] = lo;
                ((__nv_bfloat162 *)o)[2 * c + 1] = hi;
            }
        } else {
            for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
                float wc = one_plus ? 1.0f + w[c] : w[c];
                o[c] = __float2bfloat16_rn(x[c] * scale * wc);
            }
        }
    }
}

/* add_rmsnorm_bf16_kernel's vector path, with the bf16 output also quantized for an FP8 GEMM
 * (fp8_quantize_rows: q [Mp, C] e4m3, s [ceil(C/128), Mp]); out NULL: the bf16 values are only
 * quantized, not stored. blockDim.x is a multiple of 32, so
 * in pass 2 each warp's 32 float4 are one 1 × 128 group (the last one may be ragged: its
 * missing lanes hold zeros). Rows in [rows, Mp) are the padding: zero bytes and scales. Held
 * to 32 registers, so eight blocks share a multiprocessor (at 40, six did: 91 / 104 µs against
 * 86 / 93 µs without and with the bf16 output at the 27B shape, ncu; the same bytes). */
static __global__ void __launch_bounds__(256, 8)
    add_rmsnorm_fp8_kernel(__nv_bfloat16 *out, uint8_t *q, float *sc, float *xs, const float *ys,
                           const float *w, int64_t rows, int64_t Mp, int64_t C, float eps, int one_plus) {
    __shared__ float sh[32];
    const int        lane = threadIdx.x & 31;
    const int64_t    C4 = C / 4;
    for (int64_t r = blockIdx.x; r < Mp; r += gridDim.x) {
        if (r >= rows) {
            for (int64_t base = threadIdx.x - lane; base < C4; base += blockDim.x) {
                if (base + lane < C4)
                    ((uint32_t *)(q + r * C))[base + lane] = 0;
                if (lane == 0)
                    sc[(base / 32) * Mp + r] = 0.0f;
            }
            continue;
        }
        float4       *x4 = (float4 *)(xs + r * C);
        const float4 *w4 = (const float4 *)w;
        const float   scale = 1.0f / sqrtf(block_sum(add_sumsq4(x4, ys ? (const float4 *)(ys + r * C) : NULL, C4), sh) /
                                         (float)C + eps);
        for (int64_t base = threadIdx.x - lane; base < C4; base += blockDim.x) {
            const int64_t c = base + lane;
            const int     on = c < C4;
            float         a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (on) {
                __nv_bfloat162 lo, hi;
                norm4_bf16(x4[c], w4[c], scale, one_plus, &lo, &hi);
                if (out) {
                    ((__nv_bfloat162 *)(out + r * C))[2 * c] = lo;
                    ((__nv_bfloat162 *)(out + r * C))[2 * c + 1] = hi;
                }
                a[0] = __low2float(lo), a[1] = __high2float(lo), a[2] = __low2float(hi), a[3] = __high2float(hi);
            }
            float          g;
            const uint32_t packed = fp8_group_quant(a, on, &g);
            if (on)
                ((uint32_t *)(q + r * C))[c] = packed;
            if (lane == 0)
                sc[(base / 32) * Mp + r] = g;
        }
    }
}

/* out = bf16(rmsnorm_gated(x, z, w)), one warp per row (GDN rows are one head: C = dv, 128
 * for Qwen, where a block per row left most threads idle): lanes stride the row, a shuffle
 * reduction gives the scale, the second pass re-reads x and z (L1) and writes bf16. */
static __global__ void rmsnorm_gated_bf16_kernel(__nv_bfloat16 *out, const float *xs, const float *zs,
                                                 const float *w, int64_t rows, int64_t C, float eps) {
    const int     lane = threadIdx.x % 32;
    const int64_t n_warps = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += n_warps) {
        const float   *x = xs + r * C;
        const float   *z = zs + r * C;
        __nv_bfloat16 *o = out + r * C;
        float          s = 0.0f;
        for (int64_t c = lane; c < C; c += 32)
            s += x[c] * x[c];
        s = warp_sum(s);
        float scale = 1.0f / sqrtf(s / (float)C + eps);
        for (int64_t c = lane; c < C; c += 32) {
            float zc = z[c];
            o[c] = gated_bf16(x[c], zc, w[c], scale);
        }
    }
}

/* rmsnorm_gated_bf16_kernel's rows quantized for an FP8 GEMM: one warp per row r = t·H + h of
 * C (a multiple of 128) for r < Tp·H. Pass 1 sums x² in the bf16 kernel's order (so the scale,
 * and every bf16 value, is that kernel's); pass 2 takes 128 columns at a time, lane l holding
 * four consecutive ones, which are one group of the [T, H·C] input. Tokens t ≥ T are the
 * padding: zero bytes and scales. */
static __global__ void rmsnorm_gated_fp8_kernel(uint8_t *q, float *sc, const float *xs, const float *zs,
                                                const float *w, int64_t T, int64_t Tp, int64_t H, int64_t C,
                                                float eps) {
    const int     lane = threadIdx.x % 32;
    const int64_t n_warps = (int64_t)gridDim.x * (blockDim.x / 32), K = H * C, G = C / 128;
    for (int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < Tp * H; r += n_warps) {
        const int64_t t = r / H, h = r % H;
        uint8_t      *qr = q + t * K + h * C;
        if (t >= T) {
            for (int64_t g = 0; g < G; g++) {
                ((uint32_t *)qr)[32 * g + lane] = 0;
                if (lane == 0)
                    sc[(h * G + g) * Tp + t] = 0.0f;
            }
            continue;
        }
        const float *x = xs + r * C, *z = zs + r * C;
        /* the first group's operands are loaded with pass 1's, so that a row costs one trip to
         * memory when C is 128 (the Qwen head) */
        const float4 x0 = *(const float4 *)(x + 4 * lane), z0 = *(const float4 *)(z + 4 * lane);
        const float4 w0 = *(const float4 *)(w + 4 * lane);
        float        s = 0.0f;
        for (int64_t c = lane; c < C; c += 32)
            s += x[c] * x[c];
        s = warp_sum(s);
        const float scale = 1.0f / sqrtf(s / (float)C + eps);
        for (int64_t g = 0; g < G; g++) {
            const int64_t c0 = 128 * g + 4 * lane;
            const float4  xv = g ? *(const float4 *)(x + c0) : x0, zv = g ? *(const float4 *)(z + c0) : z0;
            const float4  wv = g ? *(const float4 *)(w + c0) : w0;
            const float   xa[4] = {xv.x, xv.y, xv.z, xv.w}, za[4] = {zv.x, zv.y, zv.z, zv.w};
            const float   wa[4] = {wv.x, wv.y, wv.z, wv.w};
            float         a[4];
            for (int i = 0; i < 4; i++)
                a[i] = __bfloat162float(gated_bf16(xa[i], za[i], wa[i], scale));
            float          gs;
            const uint32_t packed = fp8_group_quant(a, 1, &gs);
            ((uint32_t *)qr)[32 * g + lane] = packed;
            if (lane == 0)
                sc[(h * G + g) * Tp + t] = gs;
        }
    }
}

/* rmsnorm_gated_fp8_kernel for C = 128 (the Qwen GDN head) with GN_RW consecutive rows per
 * warp, every load of those rows issued before the first reduction (one row per warp left the
 * kernel waiting on memory). The same f32 operations in the same order, so the same bytes. */
#define GN_RW 4

static __global__ void rmsnorm_gated_fp8_c128_kernel(uint8_t *q, float *sc, const float *xs, const float *zs,
                                                     const float *w, int T, int Tp, int H, float eps) {
    const int    lane = threadIdx.x % 32, n_warps = gridDim.x * (blockDim.x / 32);
    const int    R = Tp * H, RT = T * H;
    const float4 wv = *(const float4 *)(w + 4 * lane);
    for (int r0 = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * GN_RW; r0 < R; r0 += n_warps * GN_RW) {
        float  xq[GN_RW][4];
        float4 xv[GN_RW], zv[GN_RW];
#pragma unroll
        for (int i = 0; i < GN_RW; i++) {
            if (r0 + i >= RT)
                continue;
            const float *x = xs + (int64_t)(r0 + i) * 128, *z = zs + (int64_t)(r0 + i) * 128;
#pragma unroll
            for (int j = 0; j < 4; j++)
                xq[i][j] = x[lane + 32 * j];
            xv[i] = *(const float4 *)(x + 4 * lane);
            zv[i] = *(const float4 *)(z + 4 * lane);
        }
#pragma unroll
        for (int i = 0; i < GN_RW; i++) {
            const int r = r0 + i;
            if (r >= R) /* warp-uniform */
                break;
            const int t = r / H, h = r % H;
            uint32_t *qr = (uint32_t *)(q + ((int64_t)t * H + h) * 128);
            if (r >= RT) {
                qr[lane] = 0;
                if (lane == 0)
                    sc[(int64_t)h * Tp + t] = 0.0f;
                continue;
            }
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++)
                s += xq[i][j] * xq[i][j];
            s = warp_sum(s);
            const float scale = 1.0f / sqrtf(s / 128.0f + eps);
            const float xa[4] = {xv[i].x, xv[i].y, xv[i].z, xv[i].w}, za[4] = {zv[i].x, zv[i].y, zv[i].z, zv[i].w};
            const float wa[4] = {wv.x, wv.y, wv.z, wv.w};
            float       a[4];
#pragma unroll
            for (int k = 0; k < 4; k++)
                a[k] = __bfloat162float(gated_bf16(xa[k], za[k], wa[k], scale));
            float          gs;
            const uint32_t packed = fp8_group_quant(a, 1, &gs);
            qr[lane] = packed;
            if (lane == 0)
                sc[(int64_t)h * Tp + t] = gs;
        }
    }
}

/* The drafter's rmsnorm on typed storage (kn_norm_typed_params): x in F32 or BF16 (xbf); with round
 * the F32 x is first rounded to bf16 in place (and saved to x_bf16), pass 2 re-reading the value
 * this thread wrote; the normed rows go to out and/or out_bf16. The f32 math of rmsnorm_kernel. */
static __global__ void rmsnorm_typed_kernel(const kn_norm_typed_params p, int xbf) {
    __shared__ float sh[32];
    for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const int64_t o = r * p.C;
        float         s = 0.0f;
        for (int64_t c = threadIdx.x; c < p.C; c += blockDim.x) {
            float v = ld_f(p.x, xbf, o + c);
            if (p.round) {
                const __nv_bfloat16 b = __float2bfloat16_rn(v);
                v = __bfloat162float(b);
                ((float *)p.x)[o + c] = v;
                if (p.x_bf16)
                    ((__nv_bfloat16 *)p.x_bf16)[o + c] = b;
            }
            s += v * v;
        }
        const float scale = 1.0f / sqrtf(block_sum(s, sh) / (float)p.C + p.eps);
        for (int64_t c = threadIdx.x; c < p.C; c += blockDim.x) {
            const float wc = p.one_plus ? 1.0f + p.w[c] : p.w[c];
            const float y = ld_f(p.x, xbf, o + c) * scale * wc;
            if (p.out)
                p.out[o + c] = y;
            if (p.out_bf16)
                ((__nv_bfloat16 *)p.out_bf16)[o + c] = __float2bfloat16_rn(y);
        }
    }
}

/* rmsnorm_typed's vector path (C % 4 == 0, every row 16-byte aligned for F32, 8 for BF16; C ≤
 * 4·NORM_VEC_THREADS·4): one block per row, thread t holding the groups of four columns t + j·blockDim.x
 * (j < V) in registers from their load to the store, so the row crosses memory once (the scalar kernel
 * above read it twice, four bytes a thread at a time). All V loads of a thread are issued before the first
 * use, 16 bytes each (F32) or 8 (four bf16); with round the rounded values are stored back and saved to
 * x_bf16 in the same pass. The per-element f32 math is the scalar kernel's; the per-thread sum of squares
 * runs j by j, each group's four squares fused in order, so only its order of f32 additions differs. */
#define NORM_VEC_THREADS 512

template <int V, bool XBF>
static __global__ void __launch_bounds__(NORM_VEC_THREADS)
    rmsnorm_typed_vec_kernel(const kn_norm_typed_params p) {
    __shared__ float sh[32];
    const int        C4 = (int)(p.C / 4);
    for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
        const int64_t  o = r * C4; /* the row's first group */
        kn_typed4<XBF> xv[V];
#pragma unroll
        for (int j = 0; j < V; j++)
            if (threadIdx.x + j * blockDim.x < C4)
                xv[j].load(p.x, o + threadIdx.x + j * blockDim.x);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < V; j++) {
            const int g = threadIdx.x + j * blockDim.x;
            if (g >= C4)
                continue;
            float4 v = xv[j].get();
            if (!XBF && p.round) {
                const uint2 b = f4_to_bf16x4(v);
                v = bf16x4_to_f4(b);
                xv[j].set(v);
                ((float4 *)p.x)[o + g] = v;
                if (p.x_bf16)
                    ((uint2 *)p.x_bf16)[o + g] = b;
            }
            s = __fmaf_rn(v.x, v.x, s);
            s = __fmaf_rn(v.w, v.w, __fmaf_rn(v.z, v.z, __fmaf_rn(v.y, v.y, s)));
        }
        const float scale = 1.0f / sqrtf(block_sum(s, sh) / (float)p.C + p.eps);
#pragma unroll
        for (int j = 0; j < V; j++) {
            const int g = threadIdx.x + j * blockDim.x;
            if (g >= C4)
                continue;
            const float4 v = xv[j].get();
            float4       w = ((const float4 *)p.w)[g];
            if (p.one_plus)
                w = make_float4(1.0f + w.x, 1.0f + w.y, 1.0f + w.z, 1.0f + w.w);
            const float4 y =
                make_float4(v.x * scale * w.x, v.y * scale * w.y, v.z * scale * w.z, v.w * scale * w.w);
            if (p.out)
                ((float4 *)p.out)[o + g] = y;
            if (p.out_bf16)
                st_bf16x4(p.out_bf16, o + g, y);
        }
    }
}

// ----------------------------------------------------------------------------
// launchers

static int norm_block(int64_t C) {
    int64_t b = (C + 31) / 32 * 32;
    return (int)(b < 256 ? b : 256);
}

static unsigned int norm_grid(int64_t rows) {
    return (unsigned int)(rows < (1 << 20) ? rows : (1 << 20));
}

/* The checks every launcher here starts with; op names the call in the messages. */
static cm_status norm_check(const kn_ctx *ctx, const char *op, int64_t rows, int64_t C, float eps) {
    KN_CUDA_CHECK_ARG(ctx, "%s: ctx is NULL", op);
    KN_CUDA_CHECK_ARG(rows >= 0 && C > 0, "%s: bad shape rows=%lld C=%lld (rows >= 0, C > 0)", op,
                      (long long)rows, (long long)C);
    KN_CUDA_CHECK_ARG(eps >= 0.0f, "%s: eps=%g must be >= 0", op, (double)eps);
    return CM_OK;
}

cm_status kn_cuda_rmsnorm(kn_ctx *ctx, float *out, const float *inp, const float *w, int64_t rows, int64_t C,
                          float eps, int one_plus) {
    CM_TRY(norm_check(ctx, "rmsnorm", rows, C, eps));
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && inp && w, "rmsnorm: out, inp or w is NULL");
    rmsnorm_kernel<<<norm_grid(rows), norm_block(C), 0, ctx->stream>>>(out, inp, w, rows, C, eps,
                                                                       one_plus ? 1 : 0);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_rmsnorm_gated(kn_ctx *ctx, float *out, const float *x, const float *z, const float *w,
                                int64_t rows, int64_t C, float eps) {
    CM_TRY(norm_check(ctx, "rmsnorm_gated", rows, C, eps));
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && x && z && w, "rmsnorm_gated: out, x, z or w is NULL");
    rmsnorm_gated_kernel<<<norm_grid(rows), norm_block(C), 0, ctx->stream>>>(out, x, z, w, rows, C, eps);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_l2norm(kn_ctx *ctx, float *out, const float *inp, int64_t rows, int64_t C, float eps) {
    CM_TRY(norm_check(ctx, "l2norm", rows, C, eps));
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && inp, "l2norm: out or inp is NULL");
    l2norm_kernel<<<norm_grid(rows), norm_block(C), 0, ctx->stream>>>(out, inp, rows, C, eps);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_add_rmsnorm_bf16(kn_ctx *ctx, uint16_t *out, float *x, const float *y, const float *w,
                                   int64_t rows, int64_t C, float eps, int one_plus) {
    CM_TRY(norm_check(ctx, "add_rmsnorm_bf16", rows, C, eps));
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && x && w, "add_rmsnorm_bf16: out, x or w is NULL");
    const int vec = C % 4 == 0 && (uintptr_t)x % 16 == 0 && (!y || (uintptr_t)y % 16 == 0) &&
                    (uintptr_t)w % 16 == 0 && (uintptr_t)out % 8 == 0;
    add_rmsnorm_bf16_kernel<<<norm_grid(rows), norm_block(vec ? C / 4 : C), 0, ctx->stream>>>(
        (__nv_bfloat16 *)out, x, y, w, rows, C, eps, one_plus ? 1 : 0, vec);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_add_rmsnorm_fp8(kn_ctx *ctx, uint16_t *out, uint8_t *q, float *s, float *x, const float *y,
                                  const float *w, int64_t rows, int64_t C, float eps, int one_plus) {
    CM_TRY(norm_check(ctx, "add_rmsnorm_fp8", rows, C, eps));
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(q && s && x && w, "add_rmsnorm_fp8: q, s, x or w is NULL");
    if (C % 16 || (uintptr_t)x % 16 || (y && (uintptr_t)y % 16) || (uintptr_t)w % 16 || (uintptr_t)out % 8 ||
        (uintptr_t)q % 16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "add_rmsnorm_fp8: C=%lld is not a multiple of 16 or a row is not "
                       "16-byte aligned; run add_rmsnorm_bf16 and fp8_quantize_rows",
                       (long long)C);
    const int64_t Mp = kn_fp8_rows(rows);
    add_rmsnorm_fp8_kernel<<<norm_grid(Mp), norm_block(C / 4), 0, ctx->stream>>>((__nv_bfloat16 *)out, q, s, x, y, w,
                                                                                rows, Mp, C, eps, one_plus ? 1 : 0);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_rmsnorm_gated_fp8(kn_ctx *ctx, uint8_t *q, float *s, const float *x, const float *z,
                                    const float *w, int64_t T, int64_t H, int64_t C, float eps) {
    CM_TRY(norm_check(ctx, "rmsnorm_gated_fp8", T * H, C, eps));
    KN_CUDA_CHECK_ARG(H > 0, "rmsnorm_gated_fp8: H=%lld must be > 0", (long long)H);
    if (T == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(q && s && x && z && w, "rmsnorm_gated_fp8: q, s, x, z or w is NULL");
    if (C % 128 || (uintptr_t)x % 16 || (uintptr_t)z % 16 || (uintptr_t)w % 16 || (uintptr_t)q % 16)
        return CM_FAIL(CM_ERR_UNSUPPORTED, "rmsnorm_gated_fp8: C=%lld is not a multiple of 128 or a row is not "
                       "16-byte aligned; run rmsnorm_gated_bf16 and fp8_quantize_rows",
                       (long long)C);
    const int     per_block = 8; /* warps per block of 256 threads */
    const int64_t Tp = kn_fp8_rows(T);
    if (C == 128 && Tp * H < ((int64_t)1 << 30)) {
        const int64_t blocks = (Tp * H + per_block * GN_RW - 1) / (per_block * GN_RW);
        rmsnorm_gated_fp8_c128_kernel<<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 32 * per_block, 0,
                                        ctx->stream>>>(q, s, x, z, w, (int)T, (int)Tp, (int)H, eps);
    } else {
        const int64_t blocks = (Tp * H + per_block - 1) / per_block;
        rmsnorm_gated_fp8_kernel<<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 32 * per_block, 0,
                                   ctx->stream>>>(q, s, x, z, w, T, Tp, H, C, eps);
    }
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_rmsnorm_gated_bf16(kn_ctx *ctx, uint16_t *out, const float *x, const float *z,
                                     const float *w, int64_t rows, int64_t C, float eps) {
    CM_TRY(norm_check(ctx, "rmsnorm_gated_bf16", rows, C, eps));
    if (rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(out && x && z && w, "rmsnorm_gated_bf16: out, x, z or w is NULL");
    const int     per_block = 8; /* rows (warps) per block of 256 threads */
    const int64_t blocks = (rows + per_block - 1) / per_block;
    rmsnorm_gated_bf16_kernel<<<(unsigned int)(blocks < (1 << 20) ? blocks : (1 << 20)), 32 * per_block, 0,
                                ctx->stream>>>((__nv_bfloat16 *)out, x, z, w, rows, C, eps);
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}

cm_status kn_cuda_rmsnorm_typed(kn_ctx *ctx, const kn_norm_typed_params *p) {
    KN_CUDA_CHECK_ARG(p, "rmsnorm_typed: params is NULL");
    CM_TRY(norm_check(ctx, "rmsnorm_typed", p->rows, p->C, p->eps));
    KN_CUDA_CHECK_ARG(p->x_dt == CM_DTYPE_F32 || p->x_dt == CM_DTYPE_BF16,
                      "rmsnorm_typed: x in %s is not supported (F32 or BF16)", cm_dtype_name(p->x_dt));
    KN_CUDA_CHECK_ARG(!p->round || p->x_dt == CM_DTYPE_F32, "rmsnorm_typed: round needs x in F32");
    KN_CUDA_CHECK_ARG(!p->x_bf16 || p->round, "rmsnorm_typed: x_bf16 is written only with round");
    KN_CUDA_CHECK_ARG(p->out || p->out_bf16, "rmsnorm_typed: no output (out or out_bf16)");
    if (p->rows == 0)
        return CM_OK;
    KN_CUDA_CHECK_ARG(p->x && p->w, "rmsnorm_typed: x or w is NULL");
    const int     xbf = p->x_dt == CM_DTYPE_BF16;
    const int64_t C4 = p->C / 4;
    if (p->C % 4 == 0 && C4 <= 4 * NORM_VEC_THREADS && (uintptr_t)p->x % (xbf ? 8 : 16) == 0 &&
        ((uintptr_t)p->w | (uintptr_t)p->out) % 16 == 0 &&
        ((uintptr_t)p->x_bf16 | (uintptr_t)p->out_bf16) % 8 == 0) {
        /* kn_norm_vec_shape: at 5120, a row of 20 KB in F32 in flight per block */
        const unsigned int grid = norm_grid(p->rows);
        int                block = 0;
        const int          per = kn_norm_vec_shape(C4, &block);
        if (per == 4 && xbf)
            rmsnorm_typed_vec_kernel<4, true><<<grid, block, 0, ctx->stream>>>(*p);
        else if (per == 4)
            rmsnorm_typed_vec_kernel<4, false><<<grid, block, 0, ctx->stream>>>(*p);
        else if (xbf)
            rmsnorm_typed_vec_kernel<1, true><<<grid, block, 0, ctx->stream>>>(*p);
        else
            rmsnorm_typed_vec_kernel<1, false><<<grid, block, 0, ctx->stream>>>(*p);
    } else {
        rmsnorm_typed_kernel<<<norm_grid(p->rows), norm_block(p->C), 0, ctx->stream>>>(*p, xbf);
    }
    KN_CUDA_LAUNCHED(ctx);
    return CM_OK;
}
