// CPU emulation of the CUDA features the kernels of cuda_src/ use, so that their logic can be checked against the
// NumPy ops with no GPU (hpcinfer/kernels/emulate.py builds a kernel file with g++ and this header forced in).
//   - blocks run one after the other; each CUDA thread of a block is a fiber (ucontext) on the calling OS thread,
//     switched at barriers only, so a run is deterministic and needs no locks; a fiber is entered once with
//     swapcontext, then switched with _setjmp/_longjmp, which save no signal mask (swapcontext's sigprocmask system
//     call at every switch made half the run time, ~8x slower on barrier-heavy kernels);
//   - __shared__ variables become static locals: one instance, shared by the threads of the running block;
//   - __syncthreads is a barrier over the block; a warp shuffle writes the lane's value to a per-warp slot array
//     between two barriers over the warp; a thread that returns leaves both barriers (as an exited GPU thread does);
//   - when every live thread of a block waits at a barrier that cannot complete (a divergent __syncthreads or
//     shuffle), the launch stops and reports a deadlock, where the GPU would give undefined results.
// Not a performance model and not a memory-model checker (the GPU run and compute-sanitizer are).
// Needs the CUDA toolkit headers (cuda_fp16.h with crt/host_defines.h) for __half / __nv_bfloat16 on the host.
#pragma once
#undef _FORTIFY_SOURCE   // its longjmp check refuses a jump to another stack
#include <setjmp.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <ucontext.h>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

namespace emu {

constexpr size_t kStack = 256 * 1024;   // per CUDA thread; the kernels keep a few hundred bytes of locals

struct Fiber {
    ucontext_t ctx;
    jmp_buf jb;
    bool started;
    uint3 tid;
    int linear;
    bool done;
};

struct Barrier {
    int arrived = 0, alive = 0;
    long gen = 0;
};

inline std::vector<Fiber> g_fibers;
inline int g_cur = 0;
inline ucontext_t g_scheduler;
inline jmp_buf g_sched_jb;
inline const std::function<void()>* g_fn = nullptr;
inline Barrier g_block_barrier;
inline std::vector<Barrier> g_warp_barriers;
inline std::vector<uint64_t> g_slots;    // 32 per warp
inline long g_progress = 0;               // arrivals, releases and exits: a scheduler pass without any is a deadlock
inline dim3 g_grid, g_blockdim;
inline uint3 g_block;

inline void yield() {
    if (!_setjmp(g_fibers[g_cur].jb)) _longjmp(g_sched_jb, 1);
}

inline void arrive(Barrier& b) {
    const long gen = b.gen;
    ++g_progress;
    if (++b.arrived == b.alive) {
        b.arrived = 0;
        ++b.gen;
        return;
    }
    while (b.gen == gen) yield();
}

inline void leave(Barrier& b) {
    --b.alive;
    if (b.arrived > 0 && b.arrived == b.alive) {
        b.arrived = 0;
        ++b.gen;
    }
}

inline void cp_async_flush();   // tensor-core section below
inline void tc_reset(int threads);
inline bool faulted();

inline void fiber_main() {
    (*g_fn)();
    cp_async_flush();
    Fiber& f = g_fibers[g_cur];
    leave(g_warp_barriers[f.linear / 32]);
    leave(g_block_barrier);
    f.done = true;
    ++g_progress;
    _longjmp(g_sched_jb, 1);   // never returns: the scheduler's frame of now, not the one of the first switch
}

inline void sync_block() { arrive(g_block_barrier); }

template <typename T>
inline T shfl(T v, int src) {
    static_assert(sizeof(T) <= 8, "shfl of a type over 8 bytes");
    const int linear = g_fibers[g_cur].linear, warp = linear / 32, lane = linear % 32;
    std::memcpy(&g_slots[warp * 32 + lane], &v, sizeof(T));
    arrive(g_warp_barriers[warp]);
    T r;
    std::memcpy(&r, &g_slots[warp * 32 + (src & 31)], sizeof(T));
    arrive(g_warp_barriers[warp]);
    return r;
}

inline std::vector<unsigned> block_order(unsigned count);   // below: the order of a launch's blocks

// 0: done; 1: block size not a multiple of 32; 2: deadlock (divergent barrier) in a block; 3: a fault (emu_fault()).
inline int launch(dim3 grid, dim3 block, const std::function<void()>& fn) {
    g_grid = grid;
    g_blockdim = block;
    g_fn = &fn;
    const int n = block.x * block.y * block.z;
    if (n % 32 != 0) return 1;
    std::unique_ptr<char[]> stacks(new char[n * kStack]);
    g_fibers.assign(n, Fiber{});
    const unsigned blocks = grid.x * grid.y * grid.z;
    const std::vector<unsigned> order = block_order(blocks);
    for (unsigned b : order) {
        const unsigned bx = b % grid.x, by = (b / grid.x) % grid.y, bz = b / (grid.x * grid.y);
        g_block = make_uint3(bx, by, bz);
        g_block_barrier = Barrier{0, n, 0};
        g_warp_barriers.assign(n / 32, Barrier{0, 32, 0});
        g_slots.assign(n, 0);
        tc_reset(n);
        for (int i = 0; i < n; ++i) {
            Fiber& f = g_fibers[i];
            f.linear = i;
            f.tid = make_uint3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
            f.done = false;
            f.started = false;
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = stacks.get() + (size_t)i * kStack;
            f.ctx.uc_stack.ss_size = kStack;
            f.ctx.uc_link = &g_scheduler;
            makecontext(&f.ctx, fiber_main, 0);
        }
        for (int remaining = n; remaining > 0;) {
            const long before = g_progress;
            for (int i = 0; i < n; ++i) {
                if (g_fibers[i].done) continue;
                g_cur = i;
                if (!_setjmp(g_sched_jb)) {
                    if (!g_fibers[i].started) {
                        g_fibers[i].started = true;
                        swapcontext(&g_scheduler, &g_fibers[i].ctx);
                    } else {
                        _longjmp(g_fibers[i].jb, 1);
                    }
                }
                if (g_fibers[i].done) --remaining;
            }
            if (faulted()) return 3;
            if (remaining > 0 && g_progress == before) {
                std::fprintf(stderr, "emu: deadlock in block (%u, %u, %u): every live thread waits at a "
                             "barrier that cannot complete (divergent __syncthreads or shuffle)\n", bx, by, bz);
                return 2;
            }
        }
    }
    return 0;
}

}  // namespace emu

#define threadIdx (emu::g_fibers[emu::g_cur].tid)
#define blockIdx (emu::g_block)
#define blockDim (emu::g_blockdim)
#define gridDim (emu::g_grid)

inline void __syncthreads() { emu::sync_block(); }
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
    return emu::shfl(v, (emu::g_fibers[emu::g_cur].linear % 32) ^ mask);
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) { return emu::shfl(v, src); }
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// ---- decode attention's single-launch combine (issue 29): device-wide counters, fences, L2 loads -----------------
// Blocks run one after another, so an atomic is a plain read-modify-write and a fence has nothing to order.
inline int atomicAdd(int* p, int v) {
    const int old = *p;
    *p = old + v;
    return old;
}
inline void __threadfence() {}
template <typename T>
inline T __ldcg(const T* p) { return *p; }

// The order the blocks of a launch run in: 0 (the default) x fastest, then y, then z; another seed, a permutation of
// them drawn from it (a kernel whose result must not depend on which block finishes last is run in several).
namespace emu {
inline unsigned g_block_seed = 0;
inline std::vector<unsigned> block_order(unsigned count) {
    std::vector<unsigned> order(count);
    for (unsigned i = 0; i < count; ++i) order[i] = i;
    unsigned state = g_block_seed;
    for (unsigned i = count; i > 1 && g_block_seed; --i) {           // Fisher-Yates with a small LCG
        state = state * 1664525u + 1013904223u;
        std::swap(order[i - 1], order[(state >> 8) % i]);
    }
    return order;
}
}  // namespace emu
extern "C" __attribute__((visibility("default"))) void emu_set_block_order(unsigned seed) { emu::g_block_seed = seed; }

// ---- tensor cores and asynchronous copies (cuda_src/tc_mma.cuh takes these under HPCINFER_EMU) -----------------
// mma.sync.m16n8k16 (f16 / bf16 in, float32 accumulate), ldmatrix .m8n8 .x1/.x2/.x4 (.trans) and cp.async with
// commit_group / wait_group, on the fragment layouts of the PTX ISA (listed in cuda_src/tc_mma.cuh). The warp-wide
// ones exchange their operands through a per-warp area between two warp barriers, as a shuffle does, so a lane
// that does not reach them is a deadlock. The mma's products are exact in float32 (11- or 8-bit significands) and
// summed in k order onto C: the hardware's order differs, so tests compare with a tolerance. cp.async copies only
// at the wait_group that retires its group (the source is read at issue): a read of the destination before the
// wait sees the old bytes, as it may on a GPU. A misaligned ldmatrix row or cp.async address is a fault: the launch
// stops and reports it (status 3).
#define HPCINFER_EMU 1
namespace emu {

struct WarpOperands {
    uint32_t a[32][4];
    uint32_t b[32][2];
    float c[32][4];
    const unsigned char* row[32];
};

struct PendingCopy {
    void* dst;
    unsigned char bytes[16];
    int size;
    long group;        // -1 until committed
};

struct AsyncCopies {
    std::vector<PendingCopy> pending;
    long committed = 0;
};

inline std::vector<WarpOperands> g_warp_operands;
inline std::vector<AsyncCopies> g_async;      // per thread of the running block
inline char g_fault[256] = "";

inline void fault(const char* what, const void* p) {
    if (!g_fault[0]) std::snprintf(g_fault, sizeof g_fault, "%s (address %p, thread %d)", what, p, g_fibers[g_cur].linear);
}

inline bool faulted() { return g_fault[0] != 0; }

extern "C" __attribute__((visibility("default"))) const char* emu_fault() { return g_fault; }

inline void tc_reset(int threads) {
    g_fault[0] = 0;
    g_warp_operands.resize((threads + 31) / 32);
    g_async.assign(threads, AsyncCopies{});
}

inline float bits_to_float(uint16_t h, bool bf16) {
    if (bf16) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    __half_raw raw;
    raw.x = h;
    return __half2float(__half(raw));
}

inline float half_of(uint32_t reg, int hi, bool bf16) { return bits_to_float((uint16_t)(reg >> (16 * hi)), bf16); }

inline void mma_m16n8k16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2], bool bf16) {
    const int linear = g_fibers[g_cur].linear, warp = linear / 32, lane = linear % 32;
    WarpOperands& w = g_warp_operands[warp];
    for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
    for (int i = 0; i < 2; ++i) w.b[lane][i] = b[i];
    arrive(g_warp_barriers[warp]);
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, q = l % 4;
        for (int h = 0; h < 2; ++h) {
            A[g][2 * q + h] = half_of(w.a[l][0], h, bf16);
            A[g + 8][2 * q + h] = half_of(w.a[l][1], h, bf16);
            A[g][2 * q + 8 + h] = half_of(w.a[l][2], h, bf16);
            A[g + 8][2 * q + 8 + h] = half_of(w.a[l][3], h, bf16);
            B[2 * q + h][g] = half_of(w.b[l][0], h, bf16);
            B[2 * q + 8 + h][g] = half_of(w.b[l][1], h, bf16);
        }
    }
    arrive(g_warp_barriers[warp]);   // every lane has read the operands: the area may be reused
    const int g = lane / 4, q = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i / 2), n = 2 * q + i % 2;
        float d = c[i];
        for (int k = 0; k < 16; ++k) d += A[r][k] * B[k][n];
        c[i] = d;
    }
}

inline uint32_t read_u32(const unsigned char* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

inline uint16_t read_u16(const unsigned char* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

// r[j] for j < count (1, 2 or 4 matrices); rows given by lanes 0 .. 8 count - 1.
inline void ldmatrix(unsigned* r, int count, bool trans, const void* row) {
    const int linear = g_fibers[g_cur].linear, warp = linear / 32, lane = linear % 32;
    WarpOperands& w = g_warp_operands[warp];
    w.row[lane] = static_cast<const unsigned char*>(row);
    if (lane < 8 * count && reinterpret_cast<uintptr_t>(row) % 16) fault("ldmatrix: row address not 16-byte aligned", row);
    arrive(g_warp_barriers[warp]);
    for (int j = 0; j < count; ++j) {
        if (!trans) {
            r[j] = read_u32(w.row[8 * j + lane / 4] + 4 * (lane % 4));
        } else {
            const uint16_t lo = read_u16(w.row[8 * j + 2 * (lane % 4)] + 2 * (lane / 4));
            const uint16_t hi = read_u16(w.row[8 * j + 2 * (lane % 4) + 1] + 2 * (lane / 4));
            r[j] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
    }
    arrive(g_warp_barriers[warp]);
}

inline void cp_async(void* dst, const void* src, int size, int src_bytes) {
    if (reinterpret_cast<uintptr_t>(dst) % size || (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % size))
        fault("cp.async: address not aligned to the copy size", src_bytes > 0 ? src : dst);
    PendingCopy copy{dst, {}, size, -1};
    if (src_bytes > 0) std::memcpy(copy.bytes, src, src_bytes);
    g_async[g_fibers[g_cur].linear].pending.push_back(copy);
}

inline void cp_async_commit() {
    AsyncCopies& a = g_async[g_fibers[g_cur].linear];
    for (PendingCopy& p : a.pending)
        if (p.group < 0) p.group = a.committed;
    ++a.committed;
}

// Completes the copies of every committed group but the newest `newest_pending` ones.
inline void cp_async_wait(int newest_pending) {
    AsyncCopies& a = g_async[g_fibers[g_cur].linear];
    std::vector<PendingCopy> keep;
    for (PendingCopy& p : a.pending) {
        if (p.group >= 0 && p.group < a.committed - newest_pending)
            std::memcpy(p.dst, p.bytes, p.size);
        else
            keep.push_back(p);
    }
    a.pending.swap(keep);
}

// A thread that exits with copies in flight: they land (a GPU completes them too).
inline void cp_async_flush() {
    const int linear = g_fibers[g_cur].linear;
    if (linear >= (int)g_async.size()) return;
    for (PendingCopy& p : g_async[linear].pending) std::memcpy(p.dst, p.bytes, p.size);
    g_async[linear].pending.clear();
}

inline void syncwarp() { arrive(g_warp_barriers[g_fibers[g_cur].linear / 32]); }

}  // namespace emu
