// Types and helpers the hand-written kernels share (gemv_mma.cu, gemm_mma/warpgroup.cu,
// lora_down_mma.cu, norm_cluster.cu): the host prepends this text after their `#define`s
// (cuda_source.rs `COMMON`). No header is included: NVRTC compiles the texts as they are.

typedef unsigned int u32;
typedef unsigned short u16;
struct __align__(16) u32x4 { u32 x, y, z, w; };
struct __align__(16) f32x4 { float x, y, z, w; };

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// The 32-bit shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Every unit of the cluster's cubes: what each stored to shared memory before is visible to all.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
