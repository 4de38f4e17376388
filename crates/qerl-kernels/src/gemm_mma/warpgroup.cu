// The decode-batch W4A16 product on Hopper's warpgroup MMA (`wgmma`), hand-written CUDA that
// cubecl 0.10 cannot emit (see warpgroup.rs for why, and how it is launched through cubecl's own
// stream). One launch computes, for one weight or for two or three weights sharing `X` (q/k/v,
// gate/up: "segments"),
//
//     Y[M, N] = X[M, K] * deq(W)^T (+ bias) (+ s*T*B^T)
//
// exactly as the staged kernel (staged.rs) does, with the same spread decoding, the same
// permuted reduction order inside a 64-deep chunk, the same split-K and the same outputs; only
// the `B` operand (the tokens' `X`) changes hands: the staged kernel's warps each read their
// `B` fragments from shared memory (256 bytes a `mma`, its binding limit), here the tensor
// cores read them for a whole warpgroup (4 warps, 64 weight rows) straight from shared memory,
// one `wgmma.m64nNk16` a 16-deep step for all `N = 8*M_TILES` tokens of the cube.
//
// The host prepends the configuration:
//   WARPS (4 or 8), M_TILES (1..8: tokens a cube = 8*M_TILES), BLOCK (16 NVFP4, 32 MXFP4),
//   DEPTH (chunks of codes in flight, 1..4), HAS_BIAS, HAS_LORA, SPLIT, M_MAJOR, OUT_F32,
//   SEGMENTS (1..3), MIN_CUBES (cubes a multiprocessor must hold: caps the registers), LBO,
//   SBO (descriptor strides), FOLD_NT (0, or SEGMENTS * FOLD_RANK / 8: the LoRA adapters of
//   rank FOLD_RANK, one a segment, whose `T` this launch computes itself, see "The folded
//   down-projection" below), SPREAD_SHIFTS (1: the decoding's shifts of sessions 12-31 for
//   A/B runs), and `wgmma_step` for this N in place of the marker below.
//
// The folded down-projection (FOLD_NT > 0, every segment with LoRA): `T_s = X * A_s^T` is not
// computed by a launch before this one; the grid is one-dimensional, its first `fold_cubes`
// cubes (one a 16-token group, dispatched first) compute `T` (K cut over their warps in a
// fixed order, the warps' sums added in warp order: deterministic and batch-invariant), store
// it and count themselves in `fold_counters[0]`; the product's cubes, which need `T` only in
// slice 0's epilogue, wait there for that count, so the down-projection runs beside the
// product instead of as a launch of its own. The last of slice 0's cubes to read `T` resets
// both counters to 0 for the next launch.
//
// Shared memory: `X` of one chunk (N tokens x 64) as 8x8 core matrices (128 bytes: 8 tokens x
// 8 values), core `((nb*4 + s)*2 + kh)` holding tokens `8nb..8nb+8` at the logical columns
// `8kh..8kh+8` of step `s`. A step's descriptor starts at its first core; the core next along
// K is 128 bytes on (LBO), the next 8 tokens 1024 (SBO).

// u32, u16, u32x4, f32x4, `imin` and `smem_addr`: cuda_common.cu, which the host prepends.
typedef unsigned long long u64;
struct __align__(8) u32x2 { u32 x, y; };
struct f32x2 { float x, y; };

// Scalars, packed by warpgroup.rs in this order (u32 then f32, little-endian).
struct Info {
    u32 m_rows, n0, n1, n2, n_total, cubes0, cubes1, k_dim, split_chunks, rank;
    float scale0, scale1, scale2;
    // The folded down-projection's cubes, and the product grid's x and y (FOLD_NT > 0).
    u32 fold_cubes, grid_x, grid_y;
};

#if OUT_F32
typedef float out_t;
#else
typedef u16 out_t;
#endif

#define THREADS (WARPS * 32)
#define N_TOK (8 * M_TILES)
#define CHUNK 64
// u32 words of one chunk's `X` buffer: N_TOK tokens x 64 bf16.
#define BUF_WORDS (N_TOK * 32)
#define WIDTH (WARPS * 16)
#define TWO_POW_63 9.223372036854775808e18f
#define FOLD (FOLD_NT > 0)
#if FOLD
// The folded down-projection: the segments' T columns side by side, a cube's f32 sums (16
// tokens), its steps in flight.
#define FOLD_COLS (FOLD_NT * 8)
#define FOLD_TILE (16 * FOLD_COLS)
#define FOLD_DEPTH (FOLD_NT <= 2 ? 4 : 2)
#define XS_WORDS (2 * BUF_WORDS > WARPS * FOLD_TILE ? 2 * BUF_WORDS : WARPS * FOLD_TILE)
// T is written by this launch's own cubes: no read-only path for it.
#define T_RESTRICT
#else
#define XS_WORDS (2 * BUF_WORDS)
#define T_RESTRICT __restrict__
#endif

// No header is included: NVRTC compiles this text as it is.

// `spread_bits` (codes i and i + 4 of an E2M1 word as a bf16 pair), `mul_bf16x2`, `bf16_of`,
// `pack_bf16x2` and `mma_16816`: e2m1_spread.cu, which the host prepends.

// A K-major operand without swizzle: start, LBO (next core along K), SBO (next 8 rows).
__device__ __forceinline__ u64 smem_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((LBO & 0x3FFFF) >> 4) << 16)
        | ((u64)((SBO & 0x3FFFF) >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Keeps the compiler from moving reads or writes of `r` across the asynchronous steps.
__device__ __forceinline__ void fence_operand(float& r) {
    asm volatile("" : "+f"(r)::"memory");
}
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// d += A*B for one m16n8k16 tile (the LoRA steps).

#if FOLD
// Two f32 of T, written by this launch's fold cubes: from L2 (after the acquire below).
__device__ __forceinline__ f32x2 load_t2(const float* p) {
    f32x2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// One fold cube: T_s[row0 .. row0 + 16, FOLD_RANK] = X * A_s^T for the 16-token group
// `group`, the segments' adapter rows side by side as FOLD_COLS columns, as lora_down_mma.cu
// computes one group in one cube: lane (g, t) loads 16 bytes at
// k = 8t .. 8t + 8 of each 32-deep step from X's rows g and g + 8 and from the adapter rows
// 8j + g (the same places in X and A: only the order of the sum over k changes); warp w takes
// the steps w * per .. (w + 1) * per; the warps' sums meet in `red` in warp order.
__device__ __forceinline__ void fold_lora_down(const u32x4* x, const u32x4* a0,
                                               const u32x4* a1, const u32x4* a2, float* t0,
                                               float* t1, float* t2, float* red,
                                               u32* counters, int group, int m, int k_dim) {
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int kv = k_dim / 8, k_steps = k_dim / 32, row0 = group * 16;
    const u32x4* xg = x + (long)imin(row0 + g, m - 1) * kv + t;
    const u32x4* xh = x + (long)imin(row0 + g + 8, m - 1) * kv + t;
    const u32x4* ap[FOLD_NT];
#pragma unroll
    for (int j = 0; j < FOLD_NT; ++j) {
        const int n = 8 * j + g, sg = n / FOLD_RANK;
        const u32x4* a = sg == 0 ? a0 : sg == 1 ? a1 : a2;
        ap[j] = a + (long)(n % FOLD_RANK) * kv + t;
    }
    float acc[FOLD_NT * 4];
#pragma unroll
    for (int i = 0; i < FOLD_NT * 4; ++i) acc[i] = 0.0f;
    const int per = (k_steps + WARPS - 1) / WARPS;
    const int first = warp * per, end = imin(first + per, k_steps);
#pragma unroll 1
    for (int s0 = first; s0 < end; s0 += FOLD_DEPTH) {
        u32x4 xa[FOLD_DEPTH], xb[FOLD_DEPTH], w[FOLD_DEPTH][FOLD_NT];
        // Steps past the end load the last one (in bounds) and are not used.
#pragma unroll
        for (int d = 0; d < FOLD_DEPTH; ++d) {
            const int at = imin(s0 + d, k_steps - 1) * 4;
            xa[d] = xg[at];
            xb[d] = xh[at];
#pragma unroll
            for (int j = 0; j < FOLD_NT; ++j) w[d][j] = ap[j][at];
        }
#pragma unroll
        for (int d = 0; d < FOLD_DEPTH; ++d) {
            if (s0 + d < end) {
#pragma unroll
                for (int j = 0; j < FOLD_NT; ++j) {
                    const u32 a0[4] = {xa[d].x, xb[d].x, xa[d].y, xb[d].y};
                    const u32 a1[4] = {xa[d].z, xb[d].z, xa[d].w, xb[d].w};
                    mma_16816(acc + 4 * j, a0, w[d][j].x, w[d][j].y);
                    mma_16816(acc + 4 * j, a1, w[d][j].z, w[d][j].w);
                }
            }
        }
    }
    // Accumulator (j, i): row g + 8 (i / 2), column 8j + 2t + i % 2.
#pragma unroll
    for (int j = 0; j < FOLD_NT; ++j) {
        float* r = red + warp * FOLD_TILE + 8 * j + 2 * t;
        r[g * FOLD_COLS] = acc[4 * j];
        r[g * FOLD_COLS + 1] = acc[4 * j + 1];
        r[(g + 8) * FOLD_COLS] = acc[4 * j + 2];
        r[(g + 8) * FOLD_COLS + 1] = acc[4 * j + 3];
    }
    __syncthreads();
    for (int e = 4 * tid; e < FOLD_TILE; e += 4 * THREADS) {
        f32x4 v = *(const f32x4*)(red + e);
#pragma unroll
        for (int w2 = 1; w2 < WARPS; ++w2) {
            const f32x4 u = *(const f32x4*)(red + w2 * FOLD_TILE + e);
            v.x += u.x;
            v.y += u.y;
            v.z += u.z;
            v.w += u.w;
        }
        const int row = row0 + e / FOLD_COLS, col = e % FOLD_COLS, sg = col / FOLD_RANK;
        float* tout = sg == 0 ? t0 : sg == 1 ? t1 : t2;
        if (row < m) *(f32x4*)(tout + (long)row * FOLD_RANK + col % FOLD_RANK) = v;
    }
    // Every store visible GPU-wide before the cube is counted.
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(counters, 1u);
}
#endif

// @wgmma_step@

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CUBES) qerl_wgmma_w4a16(
    const u32x4* __restrict__ x,
    const u32x2* __restrict__ codes0, const u32* __restrict__ scale_bytes0,
    const float* __restrict__ scale_table0, const u16* __restrict__ bias0,
    const float* T_RESTRICT lora_t0, const u32* __restrict__ lora_b0, out_t* y0,
    const u32x2* __restrict__ codes1, const u32* __restrict__ scale_bytes1,
    const float* __restrict__ scale_table1, const u16* __restrict__ bias1,
    const float* T_RESTRICT lora_t1, const u32* __restrict__ lora_b1, out_t* y1,
    const u32x2* __restrict__ codes2, const u32* __restrict__ scale_bytes2,
    const float* __restrict__ scale_table2, const u16* __restrict__ bias2,
    const float* T_RESTRICT lora_t2, const u32* __restrict__ lora_b2, out_t* y2,
    const u32x4* __restrict__ fold_a0, const u32x4* __restrict__ fold_a1,
    const u32x4* __restrict__ fold_a2, u32* fold_counters, const Info info) {
    __shared__ float stab[256];
    __shared__ __align__(128) u32 xs[XS_WORDS];

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
#if FOLD
    // A one-dimensional grid: the fold cubes first, then the product's (x fastest).
    const int lin = (int)blockIdx.x - (int)info.fold_cubes;
    if (lin < 0) {
        fold_lora_down(x, fold_a0, fold_a1, fold_a2, (float*)lora_t0, (float*)lora_t1,
                       (float*)lora_t2, (float*)xs, fold_counters, blockIdx.x,
                       (int)info.m_rows, (int)info.k_dim);
        return;
    }
    const int grid_xy = (int)(info.grid_x * info.grid_y);
    const int block_x = lin % (int)info.grid_x;
    const int block_y = (lin / (int)info.grid_x) % (int)info.grid_y;
    const int block_z = lin / grid_xy;
#else
    const int block_x = blockIdx.x, block_y = blockIdx.y, block_z = blockIdx.z;
#endif
    const int cube_n = M_MAJOR ? block_y : block_x;
    const int cube_m = M_MAJOR ? block_x : block_y;

    // This cube's segment (uniform per cube: every segment's N is a multiple of WIDTH).
    const u32x2* codes = codes0;
    const u32* scale_bytes = scale_bytes0;
    const float* scale_table = scale_table0;
    const u16* bias = bias0;
    const float* lora_t = lora_t0;
    const u32* lora_b = lora_b0;
    out_t* y = y0;
    int n_cols = info.n0, seg_cube0 = 0;
    float lora_scale = info.scale0;
    if (SEGMENTS > 1 && cube_n >= (int)info.cubes0) {
        if (SEGMENTS == 2 || cube_n < (int)info.cubes1) {
            codes = codes1; scale_bytes = scale_bytes1; scale_table = scale_table1;
            bias = bias1; lora_t = lora_t1; lora_b = lora_b1; y = y1;
            n_cols = info.n1; seg_cube0 = info.cubes0; lora_scale = info.scale1;
        } else {
            codes = codes2; scale_bytes = scale_bytes2; scale_table = scale_table2;
            bias = bias2; lora_t = lora_t2; lora_b = lora_b2; y = y2;
            n_cols = info.n2; seg_cube0 = info.cubes1; lora_scale = info.scale2;
        }
    }
    const int m_rows = info.m_rows, k_dim = info.k_dim, rank = info.rank;
    const int n0 = ((cube_n - seg_cube0) * WARPS + warp) * 16;
    const int m0 = cube_m * N_TOK;
    const int chunks = k_dim / CHUNK, last_chunk = chunks - 1;
    int c0 = 0, c1 = chunks;
    long out0 = 0;
    int y_stride = n_cols;
#if SPLIT
    {
        const int z = block_z;
        c0 = imin(z * (int)info.split_chunks, chunks);
        c1 = imin(c0 + (int)info.split_chunks, chunks);
        y_stride = info.n_total;
        out0 = (long)z * m_rows * info.n_total + (long)seg_cube0 * WIDTH;
    }
#endif

    for (int i = tid; i < 256; i += THREADS) stab[i] = scale_table[i];

    // The copy of `X`: item = (token n, 16-byte group j = 2tt + w of the chunk's 64 values);
    // lanes take 8 tokens x 4 groups, so each of the four words lands conflict-free.
    constexpr int items = N_TOK * 8;
    constexpr int per = (N_TOK * 8 + THREADS - 1) / THREADS;
    int x_off[per];
    int st_off[per];
    bool st_ok[per];
#pragma unroll
    for (int u = 0; u < per; ++u) {
        const int item = tid + u * THREADS;
        st_ok[u] = item < items;
        const int ic = imin(item, items - 1);
        const int tt = ic & 3, nlo = (ic >> 2) & 7, w = (ic >> 5) & 1, nb = ic >> 6;
        const int tok = imin(m0 + nb * 8 + nlo, m_rows - 1);
        x_off[u] = tok * (k_dim / 8) + 2 * tt + w;
        st_off[u] = ((nb * 4 + 2 * w) * 2) * 32 + nlo * 4 + tt;
    }
    u32x4 xr[per];
#pragma unroll
    for (int u = 0; u < per; ++u) xr[u] = x[x_off[u] + imin(c0, last_chunk) * 8];
    // Stores the chunk in `xr` into buffer `b`: word q of a group (values q%4 and q%4 + 4 of its
    // 8, see the layout above) goes to core `base + q`.
#define STORE_X(b)                                                                       \
    _Pragma("unroll") for (int u = 0; u < per; ++u) {                                   \
        if (st_ok[u]) {                                                                  \
            const u32x4 v = xr[u];                                                       \
            u32* dst = xs + (b) * BUF_WORDS + st_off[u];                                 \
            dst[0] = (v.x & 0xffffu) | (v.z << 16);                                      \
            dst[32] = (v.x >> 16) | (v.z & 0xffff0000u);                                 \
            dst[64] = (v.y & 0xffffu) | (v.w << 16);                                     \
            dst[96] = (v.y >> 16) | (v.w & 0xffff0000u);                                 \
        }                                                                                \
    }
    STORE_X(0);
#pragma unroll
    for (int u = 0; u < per; ++u) xr[u] = x[x_off[u] + imin(c0 + 1, last_chunk) * 8];

    // Rows g and g + 8 of this warp's 16 (a row past N reads row N - 1; never stored).
    // 32-bit offsets (a weight of up to 2^32 codes): the row's 8-byte code pair and block at
    // chunk 0; chunk c adds 4 pairs and CHUNK / BLOCK blocks.
    u32 row_pair0[2], row_block0[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 n = (u32)imin(n0 + h * 8 + g, n_cols - 1);
        row_pair0[h] = n * (u32)(k_dim / 16) + t;
        row_block0[h] = (n * (u32)k_dim + 16 * t) / BLOCK;
    }
    u32x2 wq[DEPTH + 1][2];
    u32 sq[DEPTH + 1][2];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
        const int c = imin(c0 + d, last_chunk);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            wq[d][h] = codes[row_pair0[h] + c * 4];
            sq[d][h] = scale_bytes[(row_block0[h] + c * (CHUNK / BLOCK)) >> 2];
        }
    }

    float acc[N_TOK / 2];
#pragma unroll
    for (int i = 0; i < N_TOK / 2; ++i) acc[i] = 0.0f;

    fence_proxy_async();
    __syncthreads();

    const u32 xs_base = smem_addr(xs);
    int buf = 0;
    for (int c = c0; c < c1; ++c) {
        // Chunk c's codes, then the next load into the ring's end.
        u32x2 w0 = wq[0][0], w1 = wq[0][1];
        u32 s0 = sq[0][0], s1 = sq[0][1];
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            wq[d][0] = wq[d + 1][0];
            wq[d][1] = wq[d + 1][1];
            sq[d][0] = sq[d + 1][0];
            sq[d][1] = sq[d + 1][1];
        }
        {
            const int cn = imin(c + DEPTH, last_chunk);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                wq[DEPTH - 1][h] = codes[row_pair0[h] + cn * 4];
                sq[DEPTH - 1][h] = scale_bytes[(row_block0[h] + cn * (CHUNK / BLOCK)) >> 2];
            }
        }
        // One block scale a row for the lane's 16 codes, with 2^63 of the placement's 2^126.
        u32 sc[2];
        {
            const u32 b0 = row_block0[0] + c * (CHUNK / BLOCK);
            const u32 b1 = row_block0[1] + c * (CHUNK / BLOCK);
            const u32 byte0 = (s0 >> ((b0 & 3) * 8)) & 0xffu;
            const u32 byte1 = (s1 >> ((b1 & 3) * 8)) & 0xffu;
            const u32 h0 = bf16_of(stab[byte0] * TWO_POW_63);
            const u32 h1 = bf16_of(stab[byte1] * TWO_POW_63);
            sc[0] = h0 | (h0 << 16);
            sc[1] = h1 | (h1 << 16);
        }
        // Step s: code pairs (i0, i0 + 4) and (i0 + 1, i0 + 5) of word s / 2.
        u32 a[4][4];
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const int i0 = 2 * (s % 2);
            const u32 wg = (s / 2) ? w0.y : w0.x;
            const u32 wg8 = (s / 2) ? w1.y : w1.x;
            a[s][0] = mul_bf16x2(spread_bits(wg, i0), sc[0]);
            a[s][1] = mul_bf16x2(spread_bits(wg8, i0), sc[1]);
            a[s][2] = mul_bf16x2(spread_bits(wg, i0 + 1), sc[0]);
            a[s][3] = mul_bf16x2(spread_bits(wg8, i0 + 1), sc[1]);
        }
#pragma unroll
        for (int i = 0; i < N_TOK / 2; ++i) fence_operand(acc[i]);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const u64 desc = smem_desc(xs_base + (buf * BUF_WORDS + s * 2 * 32) * 4);
            wgmma_step(acc, a[s][0], a[s][1], a[s][2], a[s][3], desc);
        }
        wgmma_commit();
        // Chunk c + 1 into the other buffer (its readers, chunk c - 1's steps, have finished),
        // then chunk c + 2's loads, while the tensor cores work.
        if (buf) {
            STORE_X(0);
        } else {
            STORE_X(1);
        }
#pragma unroll
        for (int u = 0; u < per; ++u) xr[u] = x[x_off[u] + imin(c + 2, last_chunk) * 8];
        wgmma_wait_all();
#pragma unroll
        for (int i = 0; i < N_TOK / 2; ++i) fence_operand(acc[i]);
        fence_proxy_async();
        __syncthreads();
        buf ^= 1;
    }

    // The half of 2^126 the block scales did not carry (a power of two: exact).
#pragma unroll
    for (int i = 0; i < N_TOK / 2; ++i) acc[i] *= TWO_POW_63;

#if HAS_LORA
    // acc += (s*T)[M, r] * B[N, r]^T: 16-deep steps with B's rows as the A operand (slice 0).
    if (!SPLIT || block_z == 0) {
#if FOLD
        // T from the fold cubes: wait for all of them (they were dispatched first and wait on
        // nothing, and this comes after the whole K loop: in practice no wait at all).
        while (load_acquire(fold_counters) < info.fold_cubes) {
        }
#endif
        for (int rc = 0; rc < (rank + 15) / 16; ++rc) {
            u32 af[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int h = q % 2;
                const int col = rc * 16 + 2 * t + (q / 2) * 8;
                const int n = n0 + h * 8 + g;
                af[q] = (n < n_cols && col < rank) ? lora_b[((long)n * rank + col) / 2] : 0u;
            }
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                const int m = m0 + mt * 8 + g;
                u32 bf[2];
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int col = rc * 16 + 2 * t + q * 8;
                    bf[q] = 0u;
                    if (m < m_rows && col < rank) {
                        const float* tr = lora_t + (long)m * rank + col;
#if FOLD
                        const f32x2 tv = load_t2(tr);
#else
                        const f32x2 tv = {tr[0], tr[1]};
#endif
                        bf[q] = pack_bf16x2(tv.x * lora_scale, tv.y * lora_scale);
                    }
                }
                mma_16816(acc + 4 * mt, af, bf[0], bf[1]);
            }
        }
#if FOLD
        // The last of slice 0's cubes to have read T resets the counters for the next launch.
        __syncthreads();
        if (tid == 0) {
            const u32 readers = info.grid_x * info.grid_y;
            if (atomicAdd(fold_counters + 1, 1u) == readers - 1) {
                atomicExch(fold_counters, 0u);
                atomicExch(fold_counters + 1, 0u);
            }
        }
#endif
    }
#endif

    // acc[4*mt + 2h + e]: weight row n0 + 8h + g, token m0 + 8mt + 2t + e.
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n = n0 + h * 8 + g;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = m0 + mt * 8 + 2 * t + e;
                if (n < n_cols && m < m_rows) {
                    float v = acc[4 * mt + 2 * h + e];
#if HAS_BIAS
                    {
                        float b;
                        asm("mov.b32 %0, %1;" : "=f"(b) : "r"(((u32)bias[n]) << 16));
                        v += b;
                    }
#endif
#if OUT_F32
                    y[out0 + (long)m * y_stride + n] = v;
#else
                    y[out0 + (long)m * y_stride + n] = (u16)bf16_of(v);
#endif
                }
            }
        }
    }
}
