// LoRA down-projections of a decode batch on tensor cores (see lora_down_mma.rs for why and
// how it is launched): for one to three adapters A_s [RANK, K] (bf16 or f16, row-major) sharing
// the input X [M, K],
//
//     T_s[M, RANK] = X * A_s^T     in f32,
//
// the SEGMENTS * RANK adapter rows side by side as the N = 8 * NT columns of `mma.m16n8k16`
// (X as the A operand, 16 rows a cube; the adapter rows as B, 8 a tile).
//
// K is cut into 32-deep steps; warp w of cube c takes steps (c * WARPS + w) * STEPS ..
// + STEPS (the last cube's may run short). A warp adds its steps' products into its
// accumulators in step order; the cube adds its warps' sums in warp order; where a row group
// has more than one cube (CUBES > 1) the cubes' sums are added in cube order: on sm_90 its
// cubes form clusters of CL, and each cube adds a share of the outputs from all the cluster's
// shared memory; where that leaves more than one sum (PARTS clusters, or CUBES cubes without
// clusters), each is stored and the group's last cube to finish (an atomic count, reset to 0
// by that cube for the next launch) adds them in order. The cut
// depends on K alone, so every output is the same chain of additions whatever M: a row's T is
// bit-identical alone or in any batch.
//
// Lane (g, t) (g = lane / 4, t = lane % 4) loads the 16 bytes at k = 8t .. 8t + 8 of a step
// from X's rows g and g + 8 and from the adapter rows 8j + g: the first two pairs of each go
// where `mma` calls k = (2t, 2t + 1) and (2t + 8, 2t + 9) of the step's first product, the
// last two into its second. X and the adapters take the same places, so this only reorders the
// sum over k; rows past M read row M - 1 and are not stored.
//
// The host prepends: WARPS, SEGMENTS, RANK, NT (SEGMENTS * RANK / 8), STEPS, CUBES, DEPTH
// (steps whose loads are in flight at once), IS_F16, CL (cubes a cluster, dividing CUBES; 1: no
// clusters).
// Then cuda_common.cu (the shared types, `imin`, `smem_addr`, `cluster_sync`).

// Scalars, packed by lora_down_mma.rs in this order.
struct Info {
    u32 m_rows, k_vecs, k_steps;
};

#define THREADS (WARPS * 32)
#define N_COLS (NT * 8)
// f32 sums of a cube: 16 rows by N_COLS.
#define TILE (16 * N_COLS)

// The operands' type as `mma` names it.
#if IS_F16
#define MMA_TYPE "f16"
#else
#define MMA_TYPE "bf16"
#endif

// d += A*B for one m16n8k16 tile.
__device__ __forceinline__ void mma_16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                          u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Partial sums written by other cubes of this launch: read from L2, past L1.
__device__ __forceinline__ f32x4 load_l2(const f32x4* p) {
    f32x4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void add4(f32x4& v, const f32x4& u) {
    v.x += u.x;
    v.y += u.y;
    v.z += u.z;
    v.w += u.w;
}

#if CL > 1
// 16 bytes at shared address `addr` of the cluster's cube `rank`.
__device__ __forceinline__ f32x4 load_cluster(u32 addr, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    f32x4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
    return v;
}

#endif

// Four consecutive sums (element e of the cube's tile, a multiple of 4) into T of their
// adapter, for rows below M.
__device__ __forceinline__ void store_t(float* t0, float* t1, float* t2, int row0, int m, int e,
                                        f32x4 v) {
    const int row = row0 + e / N_COLS, col = e % N_COLS;
    if (row >= m) return;
    const int s = col / RANK;
    float* t = s == 0 ? t0 : s == 1 ? t1 : t2;
    *(f32x4*)(t + row * RANK + col % RANK) = v;
}

// Sums a row group stores for its last cube: one a cluster, or one a cube without clusters.
#define PARTS (CUBES / CL)
#if CL > 1
#define CLUSTER_DIMS __cluster_dims__(CL, 1, 1)
#else
#define CLUSTER_DIMS
#endif

extern "C" __global__ void __launch_bounds__(THREADS) CLUSTER_DIMS qerl_lora_down_mma(
    const u32x4* __restrict__ x, const u32x4* __restrict__ a0, const u32x4* __restrict__ a1,
    const u32x4* __restrict__ a2, float* t0, float* t1, float* t2, float* sums, u32* counters,
    const Info info) {
    __shared__ __align__(16) float red[WARPS * TILE];
#if CUBES > 1 && CL < CUBES
    __shared__ u32 last;
#endif

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int cube = blockIdx.x, group = blockIdx.y;
    const int m = (int)info.m_rows, kv = (int)info.k_vecs, k_steps = (int)info.k_steps;
    const int row0 = group * 16;

    // This lane's vector of step 0 in X's rows g, g + 8 and in the adapter rows 8j + g.
    const u32x4* xg = x + (size_t)imin(row0 + g, m - 1) * kv + t;
    const u32x4* xh = x + (size_t)imin(row0 + g + 8, m - 1) * kv + t;
    const u32x4* ap[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int n = 8 * j + g, s = n / RANK;
        const u32x4* a = s == 0 ? a0 : s == 1 ? a1 : a2;
        ap[j] = a + (size_t)(n % RANK) * kv + t;
    }

    float acc[NT * 4];
#pragma unroll
    for (int i = 0; i < NT * 4; ++i) acc[i] = 0.0f;

    const int first = (cube * WARPS + warp) * STEPS;
    const int end = imin(first + STEPS, k_steps);
#pragma unroll 1
    for (int s0 = first; s0 < end; s0 += DEPTH) {
        u32x4 xa[DEPTH], xb[DEPTH], w[DEPTH][NT];
        // Steps past the end load the last one (in bounds) and are not used.
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int at = imin(s0 + d, k_steps - 1) * 4;
            xa[d] = xg[at];
            xb[d] = xh[at];
#pragma unroll
            for (int j = 0; j < NT; ++j) w[d][j] = ap[j][at];
        }
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            if (s0 + d < end) {
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    mma_16816(acc + 4 * j, xa[d].x, xb[d].x, xa[d].y, xb[d].y, w[d][j].x,
                              w[d][j].y);
                    mma_16816(acc + 4 * j, xa[d].z, xb[d].z, xa[d].w, xb[d].w, w[d][j].z,
                              w[d][j].w);
                }
            }
        }
    }

    // The warp's sums: accumulator (j, i) is row g + 8 (i / 2), column 8j + 2t + i % 2.
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        float* r = red + warp * TILE + 8 * j + 2 * t;
        r[g * N_COLS] = acc[4 * j];
        r[g * N_COLS + 1] = acc[4 * j + 1];
        r[(g + 8) * N_COLS] = acc[4 * j + 2];
        r[(g + 8) * N_COLS + 1] = acc[4 * j + 3];
    }
    __syncthreads();

    // The cube's sums, warps in order (into warp 0's place: each unit reads and writes its own).
    for (int e = 4 * tid; e < TILE; e += 4 * THREADS) {
        f32x4 v = *(const f32x4*)(red + e);
#pragma unroll
        for (int w2 = 1; w2 < WARPS; ++w2) add4(v, *(const f32x4*)(red + w2 * TILE + e));
#if CUBES == 1
        store_t(t0, t1, t2, row0, m, e, v);
#elif CL > 1
        *(f32x4*)(red + e) = v;
#else
        ((f32x4*)(sums + (size_t)(group * CUBES + cube) * TILE))[e / 4] = v;
#endif
    }
#if CUBES > 1 && CL > 1
    // Cube r of each cluster adds the vectors q = r, r + CL, ... of the tile over the cluster's
    // cubes in order (all loads in flight first): the group's sums where it is one cluster,
    // else the cluster's, stored for the global step.
    cluster_sync();
    const int rank = cube % CL;
    const u32 base = smem_addr(red);
    for (int q = tid * CL + rank; q < TILE / 4; q += THREADS * CL) {
        f32x4 p[CL];
#pragma unroll
        for (int c = 0; c < CL; ++c) p[c] = load_cluster(base + 16 * q, c);
        f32x4 v = p[0];
#pragma unroll
        for (int c = 1; c < CL; ++c) add4(v, p[c]);
#if CL == CUBES
        store_t(t0, t1, t2, row0, m, 4 * q, v);
#else
        ((f32x4*)(sums + (size_t)(group * PARTS + cube / CL) * TILE))[q] = v;
#endif
    }
    // No cube leaves while another may still read its shared memory.
    cluster_sync();
#endif
#if CUBES > 1 && CL < CUBES
    // The stores above must be visible to the last cube before this one is counted; the
    // group's last cube adds the PARTS stored sums in order.
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const u32 before = atomicAdd(counters + group, 1u);
        last = before == CUBES - 1;
        if (last) atomicExch(counters + group, 0u);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const f32x4* parts = (const f32x4*)(sums + (size_t)group * PARTS * TILE);
    for (int e = 4 * tid; e < TILE; e += 4 * THREADS) {
        f32x4 p[PARTS];
#pragma unroll
        for (int c = 0; c < PARTS; ++c) p[c] = load_l2(parts + c * (TILE / 4) + e / 4);
        f32x4 v = p[0];
#pragma unroll
        for (int c = 1; c < PARTS; ++c) add4(v, p[c]);
        store_t(t0, t1, t2, row0, m, e, v);
    }
#endif
}
