// The residual add + RMSNorm of a decode batch spread over a thread-block cluster, with the
// LoRA down-projections of the products that read the norm's output (see norm_cluster.rs for
// why and how it is launched). For RPC rows a cluster of CL = 8 cubes:
//
//     e = h + d            (or h + F(sum of SLICES f32 K-slices), or h alone), stored to h
//     y = F(e * inv_rms(e) * gain)
//     T_s[row, :] = y * A_s^T   (f32), s < SEGMENTS
//
// Vectors are 8 elements (16 bytes). The unfused kernel (the engine's `add_rms_norm`) gives a
// row to 256 units, unit t holding the vectors t, t + 256, ..., summing their squares in order
// and then adding the units' sums by a shared-memory tree with strides 128 .. 1. Here lane i of
// cube j is unit t = 32j + i with the same vectors (each warp-wide load 512 contiguous bytes;
// the loads of a cube's rows and vectors are spread over all its warps, the unit's sum of
// squares is made by the row's warp). The units' sums are exchanged through the cluster's shared memory:
// every cube's lane i reads the sums of the units i, i + 32, ..., i + 224, adds them by the
// tree's strides 128, 64, 32, and the warp's shuffle tree does the strides 16 .. 1: in every
// cube the same sum, the unfused kernel's bit for bit, and so is the norm.
//
// The LoRA sums: warp w takes the adapter rows w, w + WARPS, ...; its lanes take the cube's
// vectors as the units do (the adapters' loads are issued first, before anything waits), each
// lane adds its products in order, the warp by a shuffle tree, the cubes' sums in cube order
// (cube j adds the outputs j, j + 8, ... of the cluster from all cubes' shared memory). Per
// row, so a row's T is the same bits whatever the batch.
//
// The host prepends: WARPS, RPC (rows a cluster, <= WARPS), PER_UNIT (vectors a unit of the
// unfused kernel holds), SEGMENTS (0 to 3), RANK, AR (adapter rows a warp), LV (vectors a lane
// an adapter row), ADD, SLICES (0: a dense d), IS_F16.

// Scalars, packed by norm_cluster.rs in this order.
struct Info {
    u32 rows, vecs;
    float dim, eps;
};

#define CL 8
#define THREADS (WARPS * 32)
#define NA (SEGMENTS * RANK)
#define FULL 0xffffffffu
// (row, vector) pairs of a cube, and a warp.
#define PAIRS (RPC * PER_UNIT)
#define PPW ((PAIRS + WARPS - 1) / WARPS)

#if IS_F16
__device__ __forceinline__ float to_f32(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)h));
    return f;
}
__device__ __forceinline__ u32 of_f32(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#else
__device__ __forceinline__ float to_f32(u32 h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ u32 of_f32(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// Element k of a vector of 8.
__device__ __forceinline__ u32 elem(const u32x4& v, int k) {
    const u32 w = k < 2 ? v.x : k < 4 ? v.y : k < 6 ? v.z : v.w;
    return (k & 1) ? w >> 16 : w & 0xffffu;
}

__device__ __forceinline__ u32x4 pack(const u32* e) {
    u32x4 v;
    v.x = e[0] | e[1] << 16;
    v.y = e[2] | e[3] << 16;
    v.z = e[4] | e[5] << 16;
    v.w = e[6] | e[7] << 16;
    return v;
}

__device__ __forceinline__ float comp(const f32x4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The f32 at shared address `addr` of the cluster's cube `rank`.
__device__ __forceinline__ float load_cluster(u32 addr, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// Global loads as volatile asm, which keeps them in program order. ptxas still places the
// K-slices' additions between their loads, and in-order issue holds the later loads behind the
// earlier ones' round trips (SASS and stall sampling, H200, 2026-11-29: about four round trips
// a pair where one would do; a barrier between the loads and the additions measured no
// faster).
__device__ __forceinline__ f32x4 ld_f32x4(const f32x4* p) {
    f32x4 v;
    asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ u32x4 ld_u32x4(const u32x4* p) {
    u32x4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ u32x4 ld_nc_u32x4(const u32x4* p) {
    u32x4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// What the add reads for one vector: h's, and d's or the K-slices'.
struct Loaded {
    u32x4 x;
#if ADD && SLICES == 0
    u32x4 d;
#elif ADD
    f32x4 p[SLICES][2];
#endif
};

__device__ __forceinline__ void load_residual(Loaded& l, const u32x4* h, const u32x4* d,
                                              const f32x4* parts, size_t at, size_t stride) {
#if ADD && SLICES == 0
    l.d = ld_nc_u32x4(d + at);
#elif ADD
#pragma unroll
    for (int s = 0; s < SLICES; ++s) {
        l.p[s][0] = ld_f32x4(parts + s * stride + 2 * at);
        l.p[s][1] = ld_f32x4(parts + s * stride + 2 * at + 1);
    }
#endif
    l.x = ld_u32x4(h + at);
}

// The vector after the add, as the unfused kernel rounds it: each sum in f32, rounded once to
// F (the K-slices added in slice order and rounded, then added to h and rounded).
__device__ __forceinline__ u32x4 residual(const Loaded& l) {
#if !ADD
    return l.x;
#else
    u32 e[8];
#if SLICES == 0
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = of_f32(to_f32(elem(l.x, k)) + to_f32(elem(l.d, k)));
#else
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        f32x4 p = l.p[0][q];
#pragma unroll
        for (int s = 1; s < SLICES; ++s) {
            p.x += l.p[s][q].x;
            p.y += l.p[s][q].y;
            p.z += l.p[s][q].z;
            p.w += l.p[s][q].w;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float dk = to_f32(of_f32(comp(p, i)));
            e[4 * q + i] = of_f32(to_f32(elem(l.x, 4 * q + i)) + dk);
        }
    }
#endif
    return pack(e);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS) __cluster_dims__(CL, 1, 1)
    qerl_norm_cluster(u32x4* h, const u32x4* __restrict__ d, const f32x4* __restrict__ parts,
                      const f32x4* __restrict__ gain, const u32x4* __restrict__ a0,
                      const u32x4* __restrict__ a1, const u32x4* __restrict__ a2,
                      u32x4* __restrict__ y, float* t0, float* t1, float* t2, const Info info) {
    // The sums of squares of this cube's units, its rows of y, and its LoRA sums.
    __shared__ float sq_part[RPC][32];
    __shared__ u32x4 ys[RPC][LV * 32];
#if SEGMENTS > 0
    __shared__ float lora_part[RPC * NA];
#endif

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int j = blockIdx.x;  // the cube's rank in its cluster
    const int rows = (int)info.rows, vecs = (int)info.vecs;
    const int row0 = blockIdx.y * RPC;
#if SEGMENTS > 0
    // The adapters' vectors of this warp's rows and this lane's columns, loaded first.
    u32x4 av[AR][LV];
#pragma unroll
    for (int q = 0; q < AR; ++q) {
        const int a = imin(warp + WARPS * q, NA - 1);
        const int s = a / RANK;
        const u32x4* ap = (s == 0 ? a0 : s == 1 ? a1 : a2) + (size_t)(a % RANK) * vecs;
#pragma unroll
        for (int l = 0; l < LV; ++l) av[q][l] = ld_nc_u32x4(ap + imin(32 * j + lane + 256 * l, vecs - 1));
    }
#endif

    // The norm. The cube's (row, vector) pairs are spread over all warps: pair p = (r, u) =
    // (p % RPC, p / RPC) of warp p % WARPS, lane i the vector 32j + i + 256u of row row0 + r
    // (rows past the end repeat the last one, never stored).
    const size_t stride = (size_t)rows * vecs * 2;
    u32x4 e[PPW];
    f32x4 g[PPW][2];
#pragma unroll
    for (int q = 0; q < PPW; ++q) {
        const int p = warp + WARPS * q, r = p % RPC, u = p / RPC;
        const int v = imin(32 * j + lane + 256 * u, vecs - 1);
        const int row = imin(row0 + r, rows - 1);
        if (p < PAIRS) {
            Loaded l;
            load_residual(l, h, d, parts, (size_t)row * vecs + v, stride);
            g[q][0] = ld_f32x4(gain + 2 * v);
            g[q][1] = ld_f32x4(gain + 2 * v + 1);
            e[q] = residual(l);
        }
    }
#pragma unroll
    for (int q = 0; q < PPW; ++q) {
        const int p = warp + WARPS * q, r = p % RPC, u = p / RPC;
        const int v = 32 * j + lane + 256 * u;
        if (p < PAIRS && v < vecs) {
#if ADD
            if (row0 + r < rows) h[(size_t)(row0 + r) * vecs + v] = e[q];
#endif
            ys[r][lane + 32 * u] = e[q];
        }
    }
    __syncthreads();
    // Warp r: unit 32j + i's sum of squares of row r, over its vectors in order.
    if (warp < RPC) {
        float sq = 0.0f;
#pragma unroll
        for (int u = 0; u < PER_UNIT; ++u) {
            if (32 * j + lane + 256 * u < vecs) {
                const u32x4 ev = ys[warp][lane + 32 * u];
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float f = to_f32(elem(ev, k));
                    sq += f * f;
                }
            }
        }
        sq_part[warp][lane] = sq;
    }
    cluster_sync();
#pragma unroll
    for (int q = 0; q < PPW; ++q) {
        const int p = warp + WARPS * q, r = p % RPC, u = p / RPC;
        const int v = 32 * j + lane + 256 * u;
        if (p < PAIRS) {
            // Units i + 32c of the cluster's cube c, added by the strides 128, 64, 32, then
            // 16 .. 1: the row's sum of squares, the same in every warp and cube.
            const u32 at = smem_addr(&sq_part[r][lane]);
            float s8[CL];
#pragma unroll
            for (int c = 0; c < CL; ++c) s8[c] = load_cluster(at, c);
#pragma unroll
            for (int s = CL / 2; s > 0; s >>= 1) {
#pragma unroll
                for (int c = 0; c < s; ++c) s8[c] += s8[c + s];
            }
            float sum = s8[0];
#pragma unroll
            for (int s = 16; s > 0; s >>= 1) sum += __shfl_down_sync(FULL, sum, s);
            sum = __shfl_sync(FULL, sum, 0);
            const float inv = 1.0f / sqrtf(sum / info.dim + info.eps);
            if (v < vecs) {
                u32 o[8];
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    o[k] = of_f32(to_f32(elem(e[q], k)) * inv * comp(g[q][k / 4], k % 4));
                const u32x4 ov = pack(o);
                if (row0 + r < rows) y[(size_t)(row0 + r) * vecs + v] = ov;
                // In place of e (warp r read it before the cluster barrier).
                ys[r][lane + 32 * u] = ov;
            }
        }
    }
#if SEGMENTS > 0
    __syncthreads();
    // The LoRA sums of the cube's columns: lane products in order, then the warp's tree.
#pragma unroll
    for (int r = 0; r < RPC; ++r) {
        float acc[AR];
#pragma unroll
        for (int q = 0; q < AR; ++q) acc[q] = 0.0f;
#pragma unroll
        for (int l = 0; l < LV; ++l) {
            if (32 * j + lane + 256 * l < vecs) {
                const u32x4 xv = ys[r][lane + 32 * l];
#pragma unroll
                for (int q = 0; q < AR; ++q) {
#pragma unroll
                    for (int k = 0; k < 8; ++k)
                        acc[q] = fmaf(to_f32(elem(xv, k)), to_f32(elem(av[q][l], k)), acc[q]);
                }
            }
        }
#pragma unroll
        for (int q = 0; q < AR; ++q) {
            float v = acc[q];
#pragma unroll
            for (int s = 16; s > 0; s >>= 1) v += __shfl_down_sync(FULL, v, s);
            const int a = warp + WARPS * q;
            if (lane == 0 && a < NA) lora_part[r * NA + a] = v;
        }
    }
    cluster_sync();
    // Cube j adds the outputs j, j + 8, ... over the cluster's cubes, in cube order.
    const u32 base = smem_addr(lora_part);
    for (int o = j + CL * tid; o < RPC * NA; o += CL * THREADS) {
        float p[CL];
#pragma unroll
        for (int c = 0; c < CL; ++c) p[c] = load_cluster(base + 4 * o, c);
        float v = p[0];
#pragma unroll
        for (int c = 1; c < CL; ++c) v += p[c];
        const int r = o / NA, a = o % NA;
        if (row0 + r < rows) {
            const int s = a / RANK;
            float* tp = s == 0 ? t0 : s == 1 ? t1 : t2;
            tp[(size_t)(row0 + r) * RANK + a % RANK] = v;
        }
    }
#endif
    // No cube leaves while another may still read its shared memory.
    cluster_sync();
}
