// E2M1 code pairs as bf16 pairs, and the bf16 helpers, for the hand-written 4-bit products
// (`gemv_mma.cu`, `gemm_mma/warpgroup.cu`): the host prepends this text to theirs, after the
// configuration's `#define`s and cuda_common.cu (SPREAD_SHIFTS: 1 takes the shifts of
// sessions 12-31, for A/B runs). No header is included: NVRTC compiles the text as it is.

// w >> 8 as the high word of w * 2^24: on the FMA pipe (`IMAD.HI`), not the ALU pipe.
__device__ __forceinline__ unsigned int shr8_fma(unsigned int w) {
    unsigned int d;
    asm("mul.hi.u32 %0, %1, %2;" : "=r"(d) : "r"(w), "r"(1u << 24));
    return d;
}

// Codes i and i + 4 of an E2M1 word as a bf16 pair times 2^-126 (staged.rs' spread_bits):
// each code's magnitude bits at 6..8 and its sign at 15 of its half. The two codes' nibbles
// are masked out (after a shift by 8 for i >= 2) and one multiply places both copies each
// needs, at +a (magnitude) and +a + 6 (sign), a = 6 or 2: the copies do not overlap, so the
// product is their OR; a mask keeps the placed bits. Three instructions a pair, one of them
// on the FMA pipe, where shifting both copies took two shifts and two masks (the ALU pipe
// throttled the K loop: docs/design/w4a16-pipeline.md section 14).
__device__ __forceinline__ unsigned int spread_bits(unsigned int word, int i) {
#if SPREAD_SHIFTS
    const unsigned int s = word >> (4 * i);
    return ((s << 6) & 0x01C001C0u) | ((s << 12) & 0x80008000u);
#else
    const unsigned int v = (i >> 1) ? shr8_fma(word) : word;
    const unsigned int z = v & (0x000F000Fu << (4 * (i & 1)));
    return (z * ((i & 1) ? 260u : 4160u)) & 0x81C081C0u;
#endif
}

// bf16 helpers of the two 4-bit products.
__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 bf16_of(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// (lo, hi) as a bf16 pair, lo in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// d += A*B for one m16n8k16 tile (bf16 in, f32 sums).
__device__ __forceinline__ void mma_16816(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
