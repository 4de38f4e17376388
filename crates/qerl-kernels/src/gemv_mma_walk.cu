// The shared-ring product at one token as a walk (appended by the host to gemv_mma.cu, whose
// helpers it uses, when WALK is 1; gemv_mma.rs says when and why).
//
// The launch has at most as many cubes along x as the multiprocessors hold at once; cube b
// takes tiles b, b + gridDim.x, ... < TILES (a tile: the GROUPS * ROWS weight rows one cube of
// gemv_mma.cu covers, of whichever segment it falls in). Each warp's chunks of all its tiles
// are one stream through its ring: the chunks of the next tile are on their way while the
// warp adds, reduces and stores the current one, and `X` and the scale tables are copied once
// a cube, not once a tile. Sums are the same as gemv_mma.cu's, bit for bit: the same chunks
// in the same order a warp, the same warp-order reduction, the same epilogue.
//
// The KP warps of a row group hand their sums to the group's first warp through `red`, one
// tile at a time, under two named barriers a group: FULL (the others have written) and EMPTY
// (the first warp has read them; the others wait for it before writing the next tile's).
//
// The host prepends, beyond gemv_mma.cu's: TILES (tiles of all segments), WALK.

#if WALK
#if !STAGES || RT != 1 || M_TILES != 1
#error "the walk takes the shared ring, one row tile a warp, one token tile"
#endif

// Where the warp's next chunk comes from: the lane's 16 bytes of rows g and g + 8, and row
// `lane & 15`'s scale bytes; each moves on by KP chunks a step.
struct ChunkSource {
    const u32x4* code0;
    const u32x4* code1;
    const unsigned char* scale;
};

// The segment of `tile` (every segment's N but the last is a multiple of the tile's rows) and
// its first tile.
__device__ __forceinline__ int segment_of(int tile, const Info& info, int& first_tile) {
    first_tile = 0;
    if (SEGMENTS > 1 && tile >= (int)info.cubes0) {
        if (SEGMENTS == 2 || tile < (int)info.cubes1) {
            first_tile = info.cubes0;
            return 1;
        }
        first_tile = info.cubes1;
        return 2;
    }
    return 0;
}

__device__ __forceinline__ int segment_cols(int seg, const Info& info) {
    return seg == 0 ? (int)info.n0 : seg == 1 ? (int)info.n1 : (int)info.n2;
}

// The source's chunk into the ring slot at shared address `slot` (gemv_mma.cu's issue_chunk),
// then the source moves on to the warp's next chunk of the tile.
__device__ __forceinline__ void issue_walk_chunk(u32 slot, ChunkSource& s, int lane) {
    cp_async_16(slot + lane * 16, s.code0);
    cp_async_16(slot + (32 + lane) * 16, s.code1);
    if (lane < 16) cp_async_row_scales(slot + RING_CODE_WORDS * 4 + lane * ROW_SCALE_BYTES, s.scale);
    s.code0 += 4 * KP;
    s.code1 += 4 * KP;
    s.scale += KP * ROW_SCALE_BYTES;
}

__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CUBES) qerl_gemv_mma_walk(
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
    // Each segment's block scales times 2^63 as bf16 pairs.
    __shared__ u32 stab[SEGMENTS * 256];
    __shared__ __align__(16) u32 xs[XS_TOKENS * XS_TOKEN_WORDS];
    __shared__ __align__(16) u32 ring[WARPS * STAGES * RING_WORDS];
#if KP > 1
    __shared__ float red[WARPS * NACC * 32];
#endif

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int group = warp / KP, kpart = warp % KP;
    const int m_rows = info.m_rows, k_dim = info.k_dim, rank = info.rank;
    const int chunks = k_dim / CHUNK;
    int c0 = 0, c1 = chunks;
#if SPLIT
    c0 = imin(blockIdx.z * (int)info.split_chunks, chunks);
    c1 = imin(c0 + (int)info.split_chunks, chunks);
#endif
    const int first = c0 + kpart;
    // The warp's chunks a tile (0 where the slice is shallower than KP).
    const int steps = first < c1 ? (c1 - first + KP - 1) / KP : 0;
    const u32 s_sel = 0x4440u + (BLOCK == 16 ? 2 * (t & 1) : t);
    const u32 ring_slots = smem_addr(ring + warp * (STAGES * RING_WORDS));

    // The issue cursor: the next chunk to go out is step `next_step` of tile `next_tile`.
    int next_tile = blockIdx.x, next_step = 0;
    ChunkSource src;
    auto aim = [&](int tile) {
        int seg_tile0;
        const int seg = segment_of(tile, info, seg_tile0);
        const int n_cols = segment_cols(seg, info);
        const int n0 = ((tile - seg_tile0) * GROUPS + group) * ROWS;
        const u32x4* codes = seg == 0 ? codes0 : seg == 1 ? codes1 : codes2;
        const unsigned char* scales = (const unsigned char*)(seg == 0   ? scale_bytes0
                                                             : seg == 1 ? scale_bytes1
                                                                        : scale_bytes2);
        const u32 row0 = (u32)imin(n0 + g, n_cols - 1) * (u32)(k_dim / 32) + t;
        const u32 row1 = (u32)imin(n0 + 8 + g, n_cols - 1) * (u32)(k_dim / 32) + t;
        const u32 scale_row = (u32)imin(n0 + (lane & 15), n_cols - 1) * (u32)(k_dim / BLOCK);
        src.code0 = codes + row0 + 4 * first;
        src.code1 = codes + row1 + 4 * first;
        src.scale = scales + scale_row + first * ROW_SCALE_BYTES;
    };
    // Sends the cursor's chunk into `slot` (if any is left) and moves the cursor on; always
    // commits one group, so that `cp_async_wait_oldest` counts chunks.
    auto issue_next = [&](int slot) {
        if (steps > 0 && next_tile < TILES) {
            issue_walk_chunk(ring_slots + slot * RING_WORDS * 4, src, lane);
            if (++next_step == steps) {
                next_step = 0;
                next_tile += gridDim.x;
                if (next_tile < TILES) aim(next_tile);
            }
        }
        cp_async_commit();
    };
#if X_AHEAD
    // `X` and the scale tables are asked for first (gemv_mma.cu's X_AHEAD says why).
    XAhead xa;
    load_x_ahead(xa, x, m_rows, k_dim, c0, c1 - c0, tid);
    float st[SEGMENTS];
    st[0] = scale_table0[tid];
    if (SEGMENTS > 1) st[1] = scale_table1[tid];
    if (SEGMENTS > 2) st[2] = scale_table2[tid];
#endif
    if (next_tile < TILES) aim(next_tile);
    // The first loads go out before `X` is copied and the scale tables are built.
#pragma unroll
    for (int d = 0; d < STAGES; ++d) issue_next(d);

#if X_AHEAD
    store_x_ahead(xs, xa, m_rows, k_dim, c0, c1 - c0, tid);
#pragma unroll
    for (int i = 0; i < SEGMENTS; ++i) stab[i * 256 + tid] = stab_entry(st[i]);
#else
    copy_x(xs, x, m_rows, k_dim, c0, c1 - c0, tid);
    build_stab(stab, scale_table0, tid);
    if (SEGMENTS > 1) build_stab(stab + 256, scale_table1, tid);
    if (SEGMENTS > 2) build_stab(stab + 512, scale_table2, tid);
#endif
    __syncthreads();
    const u32* xs_lane[1] = {xs + t * 4};
    // Slice 0 carries the epilogue terms (the slices' sum is the output).
    const bool epilogue = !SPLIT || blockIdx.z == 0;

    int slot = 0;
    for (int tile = blockIdx.x, round = 0; tile < TILES; tile += gridDim.x, ++round) {
        int seg_tile0;
        const int seg = segment_of(tile, info, seg_tile0);
        const int n_cols = segment_cols(seg, info);
        const int n0 = ((tile - seg_tile0) * GROUPS + group) * ROWS;
#if HAS_LORA
        // The first LoRA step's fragments, loaded now so that the epilogue does not wait.
        const float* lora_t = seg == 0 ? lora_t0 : seg == 1 ? lora_t1 : lora_t2;
        const u32* lora_b = seg == 0 ? lora_b0 : seg == 1 ? lora_b1 : lora_b2;
        const float lora_scale = seg == 0 ? info.scale0 : seg == 1 ? info.scale1 : info.scale2;
        LoraFrags lora0;
        if (epilogue && kpart == 0)
            lora_frags(lora0, 0, lora_t, lora_b, lora_scale, rank, m_rows, n_cols, n0, g, t);
#endif
        float acc[2 * NACC];
#pragma unroll
        for (int i = 0; i < 2 * NACC; ++i) acc[i] = 0.0f;
        // Wait for the oldest chunk, take it into registers, compute, refill its slot with the
        // stream's chunk STAGES ahead (after the compute: the slot's reads are done).
        for (int i = 0; i < steps; ++i) {
            cp_async_wait_oldest();
            __syncwarp();
            const u32* rs = ring + (warp * STAGES + slot) * RING_WORDS;
            u32x4 w[1][2];
            u32 s[1][2];
            w[0][0] = *(const u32x4*)(rs + lane * 4);
            w[0][1] = *(const u32x4*)(rs + (32 + lane) * 4);
            const int sw = RING_CODE_WORDS + (BLOCK == 16 ? (t >> 1) : 0);
            s[0][0] = rs[sw + g * (ROW_SCALE_BYTES / 4)];
            s[0][1] = rs[sw + (g + 8) * (ROW_SCALE_BYTES / 4)];
            compute_chunk(w, s, xs_lane, first + i * KP - c0, stab + seg * 256, s_sel, acc);
            __syncwarp();
            issue_next(slot);
            slot = slot + 1 == STAGES ? 0 : slot + 1;
        }

        float res[NACC];
#pragma unroll
        for (int i = 0; i < NACC; ++i) res[i] = (acc[i] + acc[NACC + i]) * TWO_POW_63;
#if KP > 1
        // Barriers 1 .. GROUPS: FULL; GROUPS + 1 .. 2 GROUPS: EMPTY.
        const int full = 1 + group, empty = 1 + GROUPS + group;
        if (kpart != 0) {
            if (round > 0) bar_sync(empty, KP * 32);
#pragma unroll
            for (int i = 0; i < NACC; ++i) red[(warp * NACC + i) * 32 + lane] = res[i];
            bar_arrive(full, KP * 32);
            continue;
        }
        bar_sync(full, KP * 32);
#pragma unroll
        for (int j = 1; j < KP; ++j) {
#pragma unroll
            for (int i = 0; i < NACC; ++i) res[i] += red[((warp + j) * NACC + i) * 32 + lane];
        }
        if (tile + (int)gridDim.x < TILES) bar_arrive(empty, KP * 32);
#endif

#if HAS_LORA
        if (epilogue) {
            for (int rc = 0; rc < (rank + 15) / 16; ++rc) {
                LoraFrags f = lora0;
                if (rc > 0)
                    lora_frags(f, rc, lora_t, lora_b, lora_scale, rank, m_rows, n_cols, n0, g, t);
                mma_16816(res, f.af[0], f.bt[0][0], f.bt[0][1]);
            }
        }
#endif
        const u16* bias = seg == 0 ? bias0 : seg == 1 ? bias1 : bias2;
        u16* y = seg == 0 ? y0 : seg == 1 ? y1 : y2;
        store_tile(res, n0, n_cols, m_rows, bias, y, part, blockIdx.z, epilogue, g, t);
    }
}
#endif
