// The decode product for a few tokens on tensor cores: hand-written CUDA (see gemv_mma.rs for
// why and how it is launched). One launch computes, for one weight or for two or three weights
// sharing `X` (q/k/v, gate/up: "segments"),
//
//     Y[M, N] = X[M, K] * deq(W)^T (+ bias) (+ s*T*B^T),     M <= 8 * M_TILES,
//
// with the weight as the `A` operand of `mma.m16n8k16` (16 weight rows) and the tokens as `B`
// (8 a tile; at batch 1 seven of the eight columns are idle, which costs nothing: the product
// is bound by the decoding, not by the tensor cores). Each warp owns RT tiles of 16 rows and
// takes every KP-th 128-deep chunk of the reduction; the KP warps of a row group add their sums
// in shared memory in warp order, so the result does not depend on timing.
//
// A lane (g, t) (g = lane / 4, t = lane % 4) loads 16 bytes (32 codes) of rows g and g + 8 a
// chunk: physical columns 32t .. 32t + 32, one or two block scales. The reduction order inside
// the chunk is permuted as in the staged kernel's spread decoding: step s = 2q + hs takes codes
// (i0, i0 + 4) and (i0 + 1, i0 + 5), i0 = 2hs, of the lane's word q, in the places `mma` calls
// k = (2t, 2t + 1) and (2t + 8, 2t + 9); the `B` registers take the same columns of `X`.
// Codes and scales of DEPTH chunks are in flight per warp, in registers (the loop is unrolled by
// DEPTH, so the ring needs no register moves); or, with STAGES > 0 (one row tile a warp), of
// STAGES chunks in a ring in shared memory filled by `cp.async`, which holds no registers while
// the bytes are on their way (the default: gemv_mma.rs `Knobs::DEFAULT` says why). `X` of
// the cube's K-slice is copied once into shared memory in that order, each lane's four `B`
// registers of a word in one 16-byte entry (entry (cl*4 + q)*4 + t of a token: the four lanes
// of a quad read 64 contiguous bytes, and at batch 1 the eight quads read the same ones).
//
// Decoding: each code's sign and three magnitude bits placed into a bf16 (the value times
// 2^-126; 2^63 of that is folded into the block scale, the rest onto the f32 sums at the end:
// powers of two, exact; `spread_bits`), times the block scale as a bf16 pair: the staged
// kernel's numbers.
//
// The host prepends: WARPS, KP (warps a row group), RT, M_TILES, BLOCK (16 NVFP4, 32 MXFP4),
// DEPTH, HAS_BIAS, HAS_LORA, SPLIT (f32 partial sums per K-slice, one weight only), SEGMENTS,
// MIN_CUBES (cubes a multiprocessor must hold: caps the registers), XS_TOKENS and XS_CHUNKS
// (the tokens and 128-deep chunks the shared copy of `X` holds: M and the slice's chunks),
// STAGES (0: the register ring of DEPTH chunks), SPREAD_SHIFTS (1: the decoding's shifts of
// sessions 12-31 instead of the multiply, for A/B runs), X_AHEAD_ON (0: `X` copied after the
// first weight loads, as before session 33), PDL (1: launched programmatically after the
// kernel before inside a captured step, graph.rs: the first weight loads and the scale table are read before
// `griddepcontrol.wait`, everything that kernel wrote after it).
// Then cuda_common.cu (the shared types, `imin`, `smem_addr`) and e2m1_spread.cu.

// Scalars, packed by gemv_mma.rs in this order (u32 then f32).
struct Info {
    u32 m_rows, n0, n1, n2, cubes0, cubes1, k_dim, split_chunks, rank;
    float scale0, scale1, scale2;
};

#define THREADS (WARPS * 32)
#define GROUPS (WARPS / KP)
#define ROWS (16 * RT)
#define CHUNK 128
// Accumulators a lane: RT row tiles x M_TILES token tiles x 4.
#define NACC (RT * M_TILES * 4)
// Block scales a lane's 32 codes of a row span.
#define LANE_BLOCKS (32 / BLOCK)
#define TWO_POW_63 9.223372036854775808e18f
// u32 words of one token's `X` in shared memory (16 pad words keep two tokens' entries off
// each other's banks).
#define XS_TOKEN_WORDS (XS_CHUNKS * 64 + 16)

// No header is included: NVRTC compiles this text as it is.

// 16 bytes of codes, read once: not kept in L1 (`X` and the scales are).
__device__ __forceinline__ u32x4 load_stream(const u32x4* p) {
    u32x4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ u32 byte_perm(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// `spread_bits` (codes i and i + 4 of an E2M1 word as a bf16 pair), `mul_bf16x2`, `bf16_of`,
// `pack_bf16x2` and `mma_16816`: e2m1_spread.cu, which the host prepends.

__device__ __forceinline__ u32 word_of(const u32x4& v, int q) {
    return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

// One chunk's loads into one slot of the ring: the lane's 16 bytes of codes and its scale word
// for each of its rows.
__device__ __forceinline__ void load_chunk(
    u32x4 (&w)[RT][2], u32 (&s)[RT][2], const u32x4* __restrict__ codes,
    const u32* __restrict__ scale_bytes, const u32 (&row_vec)[RT][2],
    const u32 (&row_word)[RT][2], int c) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            w[r][h] = load_stream(codes + row_vec[r][h] + 4 * c);
            s[r][h] = scale_bytes[row_word[r][h] + c * (CHUNK / BLOCK / 4)];
        }
    }
}

// A word's four spread pairs (codes i and i + 4, i = 0..3) as bf16 pairs times 2^-126: one
// shift, four masks, four multiplies and four masks for the eight codes.
__device__ __forceinline__ void spread_word(u32 w, u32 (&p)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = spread_bits(w, i);
}

// The 8 steps of one chunk: decode, scale, `mma` into the accumulators of the step's parity.
// `xs[mt]` points at the lane's entries of chunk 0 for its token of tile mt, `cl` is the chunk
// within the cube's slice.
__device__ __forceinline__ void compute_chunk(
    const u32x4 (&w)[RT][2], const u32 (&s)[RT][2], const u32* const (&xs)[M_TILES], int cl,
    const u32* stab, u32 s_sel, float* acc) {
    u32 sc[RT][2][LANE_BLOCKS];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int b = 0; b < LANE_BLOCKS; ++b)
                sc[r][h][b] = stab[byte_perm(s[r][h], 0u, s_sel + b)];
        }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int blk = LANE_BLOCKS == 2 ? q / 2 : 0;
        // The lane's B registers of steps 2q and 2q + 1, for each token tile.
        u32x4 b[M_TILES];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            b[mt] = *(const u32x4*)(xs[mt] + (cl * 4 + q) * 16);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            u32 pg[4], pg8[4];
            spread_word(word_of(w[r][0], q), pg);
            spread_word(word_of(w[r][1], q), pg8);
#pragma unroll
            for (int hs = 0; hs < 2; ++hs) {
                u32 a[4];
                a[0] = mul_bf16x2(pg[2 * hs], sc[r][0][blk]);
                a[1] = mul_bf16x2(pg8[2 * hs], sc[r][1][blk]);
                a[2] = mul_bf16x2(pg[2 * hs + 1], sc[r][0][blk]);
                a[3] = mul_bf16x2(pg8[2 * hs + 1], sc[r][1][blk]);
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
                    mma_16816(acc + hs * NACC + (r * M_TILES + mt) * 4, a,
                              hs ? b[mt].z : b[mt].x, hs ? b[mt].w : b[mt].y);
            }
        }
    }
}

// `X` and LoRA's `T` are written by the kernel before this one. Launched programmatically
// (PDL) this kernel runs while they are being written, so it reads them through L2
// (`ld.global.cg`), never through the read-only path that `const __restrict__` allows, which
// assumes the data does not change while the kernel runs (without this, a 7B step captured
// with programmatic edges sampled other tokens from run to run, H200, 2026-11-29).
__device__ __forceinline__ u32x4 load_act(const u32x4* p) {
#if PDL
    u32x4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
#else
    return *p;
#endif
}

__device__ __forceinline__ float load_act(const float* p) {
#if PDL
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
#else
    return *p;
#endif
}

#if HAS_LORA
// The fragments of the LoRA term's 16-deep step rc: rows g and g + 8 of B [N, r] (bf16 pairs)
// as each row tile's A operand, s*T [M, r] (f32, rounded to bf16 pairs) as each token tile's B;
// zero past the rank, N and M.
struct LoraFrags {
    u32 af[RT][4];
    u32 bt[M_TILES][2];
};

__device__ __forceinline__ void lora_frags(
    LoraFrags& f, int rc, const float* lora_t, const u32* lora_b, float lora_scale, int rank,
    int m_rows, int n_cols, int n0, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        const int m = 8 * mt + g;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int col = rc * 16 + 2 * t + q * 8;
            f.bt[mt][q] = 0u;
            if (m < m_rows && col < rank) {
                const float* tr = lora_t + (long)m * rank + col;
                f.bt[mt][q] = pack_bf16x2(load_act(tr) * lora_scale, load_act(tr + 1) * lora_scale);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int col = rc * 16 + 2 * t + (q / 2) * 8;
            const int n = n0 + 16 * r + (q % 2) * 8 + g;
            f.af[r][q] = (n < n_cols && col < rank) ? lora_b[((long)n * rank + col) / 2] : 0u;
        }
    }
}
#endif

#if STAGES
// A warp's ring slot, in u32 words: the lanes' 16 bytes of codes of rows g ([lane]) and g + 8
// ([32 + lane]), then the scale bytes of the tile's 16 rows for the chunk (row after row).
#define ROW_SCALE_BYTES (CHUNK / BLOCK)
#define RING_CODE_WORDS (2 * 32 * 4)
#define RING_WORDS (RING_CODE_WORDS + 16 * ROW_SCALE_BYTES / 4)

__device__ __forceinline__ void cp_async_16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// One row's scale bytes of a chunk (8 NVFP4, 4 MXFP4).
__device__ __forceinline__ void cp_async_row_scales(u32 dst, const void* src) {
#if ROW_SCALE_BYTES == 8
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Until at most STAGES - 1 groups (chunks) are on their way: the oldest has landed.
__device__ __forceinline__ void cp_async_wait_oldest() {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
}

// Chunk c of the warp's tile into the ring slot at shared address `slot`: each lane its 16
// bytes of rows g and g + 8, lanes 0-15 the scale bytes of row `lane` (byte `scale_row`).
__device__ __forceinline__ void issue_chunk(
    u32 slot, const u32x4* __restrict__ codes, const unsigned char* __restrict__ scales,
    const u32 (&row_vec)[RT][2], u32 scale_row, int lane, int c) {
    cp_async_16(slot + lane * 16, codes + row_vec[0][0] + 4 * c);
    cp_async_16(slot + (32 + lane) * 16, codes + row_vec[0][1] + 4 * c);
    if (lane < 16)
        cp_async_row_scales(slot + RING_CODE_WORDS * 4 + lane * ROW_SCALE_BYTES,
                            scales + scale_row + c * ROW_SCALE_BYTES);
}
#endif

// Item i of the copy of `X` of chunks c0 .. c0 + slice: 16 bytes (8 values) of a token, so
// consecutive items are consecutive in memory (`src`, in 16-byte units); its four B registers
// (pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7)) go to entry (cl*4 + q)*4 + t (`dst`, words).
__device__ __forceinline__ void x_item(int i, int slice, int k_dim, int c0, int& src, int& dst) {
    const int tok = i / (slice * 16), rem = i - tok * slice * 16;
    const int cl = rem >> 4, j = rem & 15, tt = j >> 2, q = j & 3;
    src = tok * (k_dim / 8) + (c0 + cl) * 16 + j;
    dst = tok * XS_TOKEN_WORDS + ((cl * 4 + q) * 4 + tt) * 4;
}

__device__ __forceinline__ void put_x(u32* xs, int dst, const u32x4& v) {
    u32x4 e;
    e.x = byte_perm(v.x, v.z, 0x5410u);
    e.y = byte_perm(v.x, v.z, 0x7632u);
    e.z = byte_perm(v.y, v.w, 0x5410u);
    e.w = byte_perm(v.y, v.w, 0x7632u);
    *(u32x4*)(xs + dst) = e;
}

// The copy of `X` of chunks c0 .. c0 + slice into `xs`, loads and stores in one pass.
__device__ __forceinline__ void copy_x(
    u32* xs, const u32x4* __restrict__ x, int m_rows, int k_dim, int c0, int slice, int tid) {
    const int items = m_rows * slice * 16;
    for (int i = tid; i < items; i += THREADS) {
        int src, dst;
        x_item(i, slice, k_dim, c0, src, dst);
        put_x(xs, dst, load_act(x + src));
    }
}

// Items of the copy of `X` a thread holds; where they are few (at one token), a kernel loads
// them (and its scale-table entry) into registers before its first weight loads and stores
// them after: `X` and the table, written by the launch before and found in L2, then do not
// queue behind the weights' first loads from DRAM (on an H200, 8% of the 7B gate/up
// product's stall samples sat on the copy of `X`, ncu, 2026-11-29).
#define X_ITEMS ((XS_TOKENS * XS_CHUNKS * 16 + THREADS - 1) / THREADS)
#define X_AHEAD (X_AHEAD_ON && X_ITEMS <= 4 && THREADS == 256)

#define X_HELD (X_ITEMS <= 4 ? X_ITEMS : 1)

struct XAhead {
    u32x4 v[X_HELD];
};

// The thread's items of the copy of `X` of chunks c0 .. c0 + slice: loaded from `x` into `a`
// (STORE false), or stored from `a` into `xs` (STORE true).
template <bool STORE>
__device__ __forceinline__ void x_ahead(
    u32* xs, XAhead& a, const u32x4* __restrict__ x, int m_rows, int k_dim, int c0, int slice,
    int tid) {
    const int items = m_rows * slice * 16;
#pragma unroll
    for (int j = 0; j < X_HELD; ++j) {
        const int i = tid + j * THREADS;
        int src, dst;
        x_item(i, slice, k_dim, c0, src, dst);
        if (i < items) {
            if (STORE)
                put_x(xs, dst, a.v[j]);
            else
                a.v[j] = load_act(x + src);
        }
    }
}

// Entry `tid` of a scale table (THREADS == 256) as `stab` holds it.
__device__ __forceinline__ u32 stab_entry(float scale) {
    const u32 h = bf16_of(scale * TWO_POW_63);
    return h | (h << 16);
}

// A weight's 256 block scales times 2^63 as bf16 pairs (both halves the same).
__device__ __forceinline__ void build_stab(u32* stab, const float* __restrict__ scale_table, int tid) {
    for (int i = tid; i < 256; i += THREADS) stab[i] = stab_entry(scale_table[i]);
}

// Stores a warp's sums `res[(r*M_TILES + mt)*4 + 2h + e]` (weight row n0 + 16r + 8h + g, token
// 8mt + 2t + e), with the bias where `epilogue`: into `y`, or slice `slice`'s partial sums.
__device__ __forceinline__ void store_tile(
    const float* res, int n0, int n_cols, int m_rows, const u16* __restrict__ bias, u16* y,
    float* part, int slice, bool epilogue, int g, int t) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = n0 + 16 * r + 8 * h + g;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int m = 8 * mt + 2 * t + e;
                    if (n < n_cols && m < m_rows) {
                        float v = res[(r * M_TILES + mt) * 4 + 2 * h + e];
#if HAS_BIAS
                        if (epilogue) {
                            float b;
                            asm("mov.b32 %0, %1;" : "=f"(b) : "r"(((u32)bias[n]) << 16));
                            v += b;
                        }
#endif
#if SPLIT
                        part[((long)slice * m_rows + m) * n_cols + n] = v;
#else
                        y[(long)m * n_cols + n] = (u16)bf16_of(v);
#endif
                    }
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CUBES) qerl_gemv_mma(
    const u32x4* __restrict__ x,
    const u32x4* __restrict__ codes0, const u32* __restrict__ scale_bytes0,
    const float* __restrict__ scale_table0, const u16* __restrict__ bias0,
    const float* __restrict__ lora_t0, const u32* __restrict__ lora_b0, u16* y0,
    const u32x4* __restrict__ codes1, const u32* __restrict__ scale_bytes1,
    const float* __restrict__ scale_table1, const u16* __restrict__ bias1,
    const float* __restrict__ lora_t1, const u32* __restrict__ lora_b1, u16* y1,
    const u32x4* __restrict__ codes2, const u32* __restrict__ scale_bytes2,
    const float* __restrict__ scale_table2, const u16* __restrict__ bias2,
    const float* __restrict__ lora_t2, const u32* __restrict__ lora_b2, u16* y2,
    float* part, const Info info) {
#if PDL && __CUDA_ARCH__ >= 900
    // The kernel after this one in a captured step may start its cubes once all of this
    // launch's are running (they wait for its completion before they read what it wrote).
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    // Block scales times 2^63 as bf16 pairs (both halves the same).
    __shared__ u32 stab[256];
    // `X` of the cube's slice in fragment order (see the top of this file).
    __shared__ __align__(16) u32 xs[XS_TOKENS * XS_TOKEN_WORDS];
#if STAGES
    // Each warp's ring; after the K loop its first NACC * 32 words take the warp's sums.
    __shared__ __align__(16) u32 ring[WARPS * STAGES * RING_WORDS];
#define RED(w, i) (((float*)ring)[(w) * (STAGES * RING_WORDS) + (i) * 32 + lane])
#elif KP > 1
    __shared__ float red[WARPS * NACC * 32];
#define RED(w, i) red[((w) * NACC + (i)) * 32 + lane]
#endif

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int group = warp / KP, kpart = warp % KP;
    const int cube = blockIdx.x;

    // This cube's segment (uniform per cube: every segment's N but the last is a multiple of
    // the cube's GROUPS * ROWS rows).
    const u32x4* codes = codes0;
    const u32* scale_bytes = scale_bytes0;
    const float* scale_table = scale_table0;
    const u16* bias = bias0;
    const float* lora_t = lora_t0;
    const u32* lora_b = lora_b0;
    u16* y = y0;
    int n_cols = info.n0, seg_cube0 = 0;
    float lora_scale = info.scale0;
    if (SEGMENTS > 1 && cube >= (int)info.cubes0) {
        if (SEGMENTS == 2 || cube < (int)info.cubes1) {
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
    const int n0 = ((cube - seg_cube0) * GROUPS + group) * ROWS;
    const int chunks = k_dim / CHUNK;
    int c0 = 0, c1 = chunks;
#if SPLIT
    c0 = imin(blockIdx.z * (int)info.split_chunks, chunks);
    c1 = imin(c0 + (int)info.split_chunks, chunks);
#endif

    // Rows g and g + 8 of each tile (a row past N reads row N - 1; never stored), in 32-bit
    // offsets at chunk 0: the lane's 16-byte vector, its scale word.
    u32 row_vec[RT][2], row_word[RT][2];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 n = (u32)imin(n0 + 16 * r + 8 * h + g, n_cols - 1);
            row_vec[r][h] = n * (u32)(k_dim / 32) + t;
            row_word[r][h] = n * (u32)(k_dim / BLOCK / 4) + (BLOCK == 16 ? (t >> 1) : 0);
        }
    }
    // Where the lane's scale bytes sit in its word: blocks 2t, 2t + 1 of the chunk's 8
    // (NVFP4), block t of 4 (MXFP4); as a `prmt` selector of that byte (the next block's is
    // one more), the other three bytes zero: the byte is the table index.
    const u32 s_sel = 0x4440u + (BLOCK == 16 ? 2 * (t & 1) : t);

    const int first = c0 + kpart;
#if X_AHEAD
    XAhead xa;
#if !PDL
    x_ahead<false>(xs, xa, x, m_rows, k_dim, c0, c1 - c0, tid);
#endif
    const float st = scale_table[tid];
#endif
    // The first loads go out before `X` is copied and the scale table is built.
#if STAGES
    const u32 ring_slots = smem_addr(ring + warp * (STAGES * RING_WORDS));
    const u32 scale_row = (u32)imin(n0 + (lane & 15), n_cols - 1) * (u32)(k_dim / BLOCK);
    const unsigned char* scales = (const unsigned char*)scale_bytes;
#pragma unroll
    for (int d = 0; d < STAGES; ++d) {
        const int c = first + d * KP;
        if (c < c1)
            issue_chunk(ring_slots + d * RING_WORDS * 4, codes, scales, row_vec, scale_row, lane,
                        c);
        cp_async_commit();
    }
    (void)row_word;
#else
    u32x4 wq[DEPTH][RT][2];
    u32 sq[DEPTH][RT][2];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
        const int c = first + d * KP;
        if (c < c1) load_chunk(wq[d], sq[d], codes, scale_bytes, row_vec, row_word, c);
    }
#endif
#if PDL
    // Weights only above; `X`, LoRA's `T` and the outputs are the kernel before's business
    // until it has completed (sm_90 and later; graphs only make edges programmatic there).
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if X_AHEAD
    x_ahead<false>(xs, xa, x, m_rows, k_dim, c0, c1 - c0, tid);
#endif
#endif
    // Slice 0 carries the epilogue terms (the slices' sum is the output). The first LoRA step's
    // fragments are loaded now, so that the epilogue does not wait on them.
    const bool epilogue = !SPLIT || blockIdx.z == 0;
#if HAS_LORA
    LoraFrags lora0;
    if (epilogue && kpart == 0)
        lora_frags(lora0, 0, lora_t, lora_b, lora_scale, rank, m_rows, n_cols, n0, g, t);
#endif
#if X_AHEAD
    x_ahead<true>(xs, xa, x, m_rows, k_dim, c0, c1 - c0, tid);
    stab[tid] = stab_entry(st);
#else
    copy_x(xs, x, m_rows, k_dim, c0, c1 - c0, tid);
    build_stab(stab, scale_table, tid);
#endif
    __syncthreads();
    // This lane's entries: token 8mt + g of each tile (tokens past M read the last one; never
    // stored), quad t.
    const u32* xs_lane[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
        xs_lane[mt] = xs + imin(8 * mt + g, m_rows - 1) * XS_TOKEN_WORDS + t * 4;

    float acc[2 * NACC];
#pragma unroll
    for (int i = 0; i < 2 * NACC; ++i) acc[i] = 0.0f;
#if STAGES
    // Wait for the oldest chunk, take it into registers, compute, refill its slot STAGES chunks
    // ahead (after the compute: the slot's reads are done). Every lane reads the scale bytes
    // lanes 0-15 copied, hence the warp barriers.
    for (int c = first, slot = 0; c < c1; c += KP) {
        cp_async_wait_oldest();
        __syncwarp();
        const u32* rs = ring + (warp * STAGES + slot) * RING_WORDS;
        u32x4 w[RT][2];
        u32 s[RT][2];
        w[0][0] = *(const u32x4*)(rs + lane * 4);
        w[0][1] = *(const u32x4*)(rs + (32 + lane) * 4);
        const int sw = RING_CODE_WORDS + (BLOCK == 16 ? (t >> 1) : 0);
        s[0][0] = rs[sw + g * (ROW_SCALE_BYTES / 4)];
        s[0][1] = rs[sw + (g + 8) * (ROW_SCALE_BYTES / 4)];
        compute_chunk(w, s, xs_lane, c - c0, stab, s_sel, acc);
        __syncwarp();
        const int cn = c + STAGES * KP;
        if (cn < c1)
            issue_chunk(ring_slots + slot * RING_WORDS * 4, codes, scales, row_vec, scale_row,
                        lane, cn);
        cp_async_commit();
        slot = slot + 1 == STAGES ? 0 : slot + 1;
    }
#else
    for (int cb = first; cb < c1; cb += DEPTH * KP) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int c = cb + d * KP;
            if (c < c1) {
                compute_chunk(wq[d], sq[d], xs_lane, c - c0, stab, s_sel, acc);
                const int cn = c + DEPTH * KP;
                if (cn < c1) load_chunk(wq[d], sq[d], codes, scale_bytes, row_vec, row_word, cn);
            }
        }
    }
#endif

    // The two parities' sums, with the half of 2^126 the block scales did not carry.
    float res[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) res[i] = (acc[i] + acc[NACC + i]) * TWO_POW_63;

#if KP > 1
    // The row group's first warp adds the others' sums, in warp order.
    if (kpart != 0) {
#pragma unroll
        for (int i = 0; i < NACC; ++i) RED(warp, i) = res[i];
    }
    __syncthreads();
    if (kpart != 0) return;
#pragma unroll
    for (int j = 1; j < KP; ++j) {
#pragma unroll
        for (int i = 0; i < NACC; ++i) res[i] += RED(warp + j, i);
    }
#endif

#if HAS_LORA
    // res += (s*T)[M, r] * B[N, r]^T: 16-deep steps with B's rows as the A operand (step 0's
    // fragments were loaded before the K loop).
    if (epilogue) {
        for (int rc = 0; rc < (rank + 15) / 16; ++rc) {
            LoraFrags f = lora0;
            if (rc > 0) lora_frags(f, rc, lora_t, lora_b, lora_scale, rank, m_rows, n_cols, n0, g, t);
#pragma unroll
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
                    mma_16816(res + (r * M_TILES + mt) * 4, f.af[r], f.bt[mt][0], f.bt[mt][1]);
            }
        }
    }
#endif

    store_tile(res, n0, n_cols, m_rows, bias, y, part, blockIdx.z, epilogue, g, t);
}
