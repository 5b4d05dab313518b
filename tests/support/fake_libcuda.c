/* A stand-in for libcuda, for testing kvpushd_client.gpu_doorbell without a GPU (tests/daemon/
 * test_gpu_doorbell_cpu.py compiles it). The functions the doorbell uses, with cuda.h's prototypes;
 * stream operations are queued and carried out only by fake_run() or cuCtxSynchronize (the GPU
 * "getting there"), so a test sees what a reader sees before and after. Device addresses differ
 * from host ones (DEV_OFFSET), so a host address passed where a device one belongs is caught.
 * Built with -DNO_MEMOPS it lacks cuStreamWriteValue64_v2, as a driver before CUDA 11.7. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef uint64_t cuuint64_t;

#define BAD 1 /* CUDA_ERROR_INVALID_VALUE */
#define DEV_OFFSET 0x100000000000ULL
#define CTX ((void *)0x1234)

int fake_memops = 1;      /* what CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS says */
int fake_has_ctx = 1;     /* whether a context is current */
unsigned long long fake_registered, fake_registered_size;
unsigned fake_register_flags;
int fake_unregistered, fake_synchronized, fake_allocs, fake_errors, fake_pushed, fake_popped;
unsigned long long fake_last_stream;

enum { WRITE64, MEMSET32, DTOH };
struct op { int kind; unsigned long long dst, src, n; };
static struct op ops[1 << 16];
static int nops;

void fake_reset(void) {
    fake_memops = 1; fake_has_ctx = 1;
    fake_registered = fake_registered_size = 0; fake_register_flags = 0;
    fake_unregistered = fake_synchronized = fake_allocs = fake_errors = fake_pushed = fake_popped = 0;
    fake_last_stream = 0; nops = 0;
}

static int registered(unsigned long long host, unsigned long long n) {
    return fake_registered && host >= fake_registered && host + n <= fake_registered + fake_registered_size;
}

static CUresult queue(int kind, unsigned long long dst, unsigned long long src, unsigned long long n, CUstream s) {
    if (nops == (int)(sizeof ops / sizeof ops[0])) { fake_errors++; return BAD; }
    ops[nops++] = (struct op){kind, dst, src, n};
    fake_last_stream = (unsigned long long)(uintptr_t)s;
    return 0;
}

int fake_queued(void) { return nops; }

int fake_run(void) { /* the stream gets there: carry out what was queued, in order */
    int done = nops;
    for (int i = 0; i < nops; i++) {
        struct op *o = &ops[i];
        if (o->kind == WRITE64) {
            *(volatile uint64_t *)(uintptr_t)(o->dst - DEV_OFFSET) = o->src;
        } else if (o->kind == MEMSET32) {
            uint32_t v = (uint32_t)o->src;
            for (unsigned long long k = 0; k < o->n; k++) memcpy((char *)(uintptr_t)(o->dst - DEV_OFFSET) + 4 * k, &v, 4);
        } else {
            memcpy((void *)(uintptr_t)o->dst, (void *)(uintptr_t)(o->src - DEV_OFFSET), o->n);
        }
    }
    nops = 0;
    return done;
}

CUresult cuInit(unsigned int flags) { return flags ? BAD : 0; }
CUresult cuGetErrorName(CUresult rc, const char **s) { (void)rc; *s = "CUDA_ERROR_FAKE"; return 0; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = fake_has_ctx ? CTX : NULL; return 0; }
CUresult cuCtxGetDevice(CUdevice *d) { if (!fake_has_ctx) return BAD; *d = 3; return 0; }
CUresult cuCtxPushCurrent_v2(CUcontext c) { if (c != CTX) { fake_errors++; return BAD; } fake_pushed++; return 0; }
CUresult cuCtxPopCurrent_v2(CUcontext *c) { *c = CTX; fake_popped++; return 0; }
CUresult cuCtxSynchronize(void) { fake_run(); fake_synchronized++; return 0; }

CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice dev) {
    if (dev != 3) { fake_errors++; return BAD; }
    *v = attr == 122 ? fake_memops : 0;
    return 0;
}

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) {
    if (fake_registered || ((uintptr_t)p & 4095) || (n & 4095)) { fake_errors++; return BAD; }
    fake_registered = (uintptr_t)p; fake_registered_size = n; fake_register_flags = flags;
    return 0;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned int flags) {
    if (flags || !registered((uintptr_t)p, 8)) { fake_errors++; return BAD; }
    *d = (uintptr_t)p + DEV_OFFSET;
    return 0;
}

CUresult cuMemHostUnregister(void *p) {
    if (!fake_registered || (uintptr_t)p != fake_registered) { fake_errors++; return BAD; }
    fake_registered = fake_registered_size = 0; fake_unregistered++;
    return 0;
}

#ifndef NO_MEMOPS
CUresult cuStreamWriteValue64_v2(CUstream s, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
    if (!fake_memops || flags || (addr & 7) || !registered(addr - DEV_OFFSET, 8)) { fake_errors++; return BAD; }
    return queue(WRITE64, addr, value, 8, s);
}
#endif

CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t n) {
    void *p = calloc(1, n);
    if (!p) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    *d = (uintptr_t)p + DEV_OFFSET; fake_allocs++;
    return 0;
}

CUresult cuMemFree_v2(CUdeviceptr d) { free((void *)(uintptr_t)(d - DEV_OFFSET)); fake_allocs--; return 0; }

CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream s) {
    if (d < DEV_OFFSET || (d & 3)) { fake_errors++; return BAD; }
    return queue(MEMSET32, d, v, n, s);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    /* into registered host memory only: a copy into pageable memory is not stream-ordered */
    if (src < DEV_OFFSET || !registered((uintptr_t)dst, n)) { fake_errors++; return BAD; }
    return queue(DTOH, (uintptr_t)dst, src, n, s);
}
