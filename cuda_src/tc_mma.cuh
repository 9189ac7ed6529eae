// Tensor-core and asynchronous-copy primitives (inline PTX, sm_80+), shared by the tensor-core GEMM kernels
// (tc_gemm.cu, tc_quant_gemm.cu). Each is one small device function so that the CPU kernel emulator
// (tests/helpers/cuda_emu.h, which defines HPCINFER_EMU) can take its branch: there the same operations run on the
// fragment layouts of the PTX ISA ("Matrix fragments for mma.m16n8k16", "ldmatrix"), so a kernel's indexing is
// checked on the CPU. Fragment layouts (lane = 4 g + q, g = lane / 4, q = lane % 4), 16-bit elements, low half first:
//   mma.m16n8k16 A (16 x 16, row-major):  a0 = A[g][2q..2q+1]     a1 = A[g+8][2q..2q+1]
//                                         a2 = A[g][2q+8..2q+9]   a3 = A[g+8][2q+8..2q+9]
//   B (16 x 8, K x N, "col"):             b0 = B[2q..2q+1][g]     b1 = B[2q+8..2q+9][g]
//   C / D (16 x 8, float32):              c0, c1 = C[g][2q], C[g][2q+1]   c2, c3 = C[g+8][2q], C[g+8][2q+1]
//   ldmatrix .m8n8 .x1 / .x2 / .x4: lanes 8 j .. 8 j + 7 give the 16-byte row addresses of matrix j (shared memory,
//   16-byte aligned); lane l receives r[j] = M_j[l / 4][2 (l % 4) .. 2 (l % 4) + 1] (.trans: M_j[2 (l % 4)][l / 4]
//   and M_j[2 (l % 4) + 1][l / 4]).
// cp.async.cg (16 bytes, L2 only: streamed weights do not pollute L1): src_bytes < 16 fills the rest with zeros
// (0: nothing is read, so an out-of-range row may pass any valid address); completion only at wait_group.
#pragma once
#include "common.cuh"

// D = A B + C, float32 accumulate; the inputs are f16 or bf16 by the tag's type (call with storage_t()).
__device__ __forceinline__ void tc_mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2], __half) {
#ifdef HPCINFER_EMU
    emu::mma_m16n8k16(c, a, b, false);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ void tc_mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                       __nv_bfloat16) {
#ifdef HPCINFER_EMU
    emu::mma_m16n8k16(c, a, b, true);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

#ifndef HPCINFER_EMU
__device__ __forceinline__ unsigned tc_smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#endif

// Four 8 x 8 matrices of 16-bit elements from shared memory (lanes 8 j .. 8 j + 7: the rows of matrix j).
__device__ __forceinline__ void tc_ldmatrix_x4(unsigned (&r)[4], const void* row) {
#ifdef HPCINFER_EMU
    emu::ldmatrix(r, 4, false, row);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tc_smem_addr(row)));
#endif
}

__device__ __forceinline__ void tc_ldmatrix_x2(unsigned (&r)[2], const void* row) {
#ifdef HPCINFER_EMU
    emu::ldmatrix(r, 2, false, row);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(tc_smem_addr(row)));
#endif
}

__device__ __forceinline__ void tc_ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
#ifdef HPCINFER_EMU
    emu::ldmatrix(r, 4, true, row);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tc_smem_addr(row)));
#endif
}

// 16 bytes global -> shared, asynchronously; src_bytes (0 or 16) of them read, the rest zero.
__device__ __forceinline__ void tc_cp_async16(void* dst, const void* src, int src_bytes) {
#ifdef HPCINFER_EMU
    emu::cp_async(dst, src, 16, src_bytes);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tc_smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
#endif
}

__device__ __forceinline__ void tc_cp_async_commit() {
#ifdef HPCINFER_EMU
    emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void tc_cp_async_wait() {
#ifdef HPCINFER_EMU
    emu::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ void tc_syncwarp() {
#ifdef HPCINFER_EMU
    emu::syncwarp();
#else
    __syncwarp();
#endif
}

// Two 16-bit values packed low-first into one 32-bit register (an mma operand).
template <typename S>
__device__ __forceinline__ unsigned tc_pack2(S lo, S hi) {
    unsigned short l, h;
    memcpy(&l, &lo, 2);
    memcpy(&h, &hi, 2);
    return (unsigned)l | ((unsigned)h << 16);
}
