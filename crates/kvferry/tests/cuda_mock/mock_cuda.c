/* The mock libcuda.so.1 of every test that needs a CUDA driver on a machine without a GPU,
 * built by the tests with cc (tests/cuda_mock/mod.rs `build`; tests/python/test_gpu_mock.py;
 * `scripts/gpu-check` runs the Rust ones). One source, three behaviours chosen at build time:
 *
 *   (default)  full memory: the probe, primary contexts, pointer classification, device and
 *              pinned allocations, synchronous and stream-ordered copies, streams and events
 *              (tests/gpu_memory.rs, kvferry-cli tests/cli.rs, test_gpu_mock.py);
 *   -DNO_MEM   probe only: cuInit, the version and the device queries, nothing else, as a
 *              driver older than CUDA 11.4 shows itself: kvferry reports GPU memory "too old"
 *              naming cuDevicePrimaryCtxRetain (kvferry-cli tests/doctor_gpu.rs,
 *              tests/gpu_driver.rs, tests/gpu_memory.rs);
 *   -DNO_BUS_ID  also without cuDeviceGetPCIBusId: too old even for the probe
 *              (tests/gpu_driver.rs).
 *
 * Other build-time knobs: INIT_RESULT (cuInit's result: 100 no device, 34 stub library),
 * COUNT (GPUs), VERSION (cuDriverGetVersion, 12040 by default), NO_DMABUF (GPUs report
 * DMA_BUF_SUPPORTED = 0 and cuMemGetHandleForAddressRange is absent), HOST_VISIBLE (device
 * pointers point at the bytes themselves, so a NIC can register them as nvidia-peermem lets
 * it: for the GPUDirect RDMA run in the Soft-RoCE VM only; the CPU could then touch them).
 *
 * Device memory is honest about where it lives: device pointers point into a reserved
 * PROT_NONE range, so any direct access by the CPU faults (as a real device pointer's does);
 * the bytes live in a separate mapping that only the copy functions below reach. Copies need
 * a current context, device ranges must lie inside one live allocation, and asynchronous
 * copies happen only when their stream is synchronised (or an event recorded after them is):
 * a missing wait shows as wrong bytes. cuPointerGetAttribute answers CUDA_ERROR_INVALID_VALUE
 * for memory it does not know, as the real driver does for plain host pointers. Virtual
 * memory management (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess, ...) maps
 * physical allocations back to back; each is reported as its own range, as the real driver
 * does, and a copy may run across mappings of one GPU made accessible. CUDA IPC handles work
 * across processes: device memory is a memfd that another process maps through /proc.
 *
 * Run-time knobs (full memory only): mock_cuda_fail_copies(code) makes every copy return
 * `code` (0: copies work again), e.g. 709 (context destroyed); mock_cuda_copy_delay_us(us)
 * makes every copy take that long when it runs; mock_cuda_copies(dev) counts the copies that
 * touched device `dev`'s memory so far; mock_cuda_queued() is the number of asynchronous
 * copies queued and not yet run, on every stream; mock_cuda_max_queued() the most that were
 * ever queued on one stream at once (reset by mock_cuda_reset_max_queued());
 * mock_cuda_ipc_open() the other processes' memory opened here (cuIpcOpenMemHandle) and not
 * closed yet. */
#define _GNU_SOURCE /* memfd_create */
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef INIT_RESULT
#define INIT_RESULT 0
#endif
#ifndef COUNT
#define COUNT 2
#endif
#ifndef VERSION
#define VERSION 12040
#endif

typedef unsigned long long CUdeviceptr;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_DEVICE = 101, INVALID_CONTEXT = 201, INVALID_HANDLE = 400 };

static int inited;
int cuInit(unsigned flags) { (void)flags; if (INIT_RESULT == 0) inited = 1; return INIT_RESULT; }
int cuDriverGetVersion(int *v) { *v = VERSION; return 0; }
int cuDeviceGetCount(int *n) { *n = COUNT; return 0; }
int cuDeviceGet(int *d, int i) { if (i < 0 || i >= COUNT) return INVALID_DEVICE; *d = i; return 0; }
int cuDeviceGetName(char *name, int len, int d) { snprintf(name, len, "Mock H200 #%d", d); return 0; }
int cuDeviceTotalMem_v2(size_t *b, int d) { (void)d; *b = (size_t)141 << 30; return 0; }
#ifdef NO_DMABUF
#define DMABUF_SUPPORTED 0
#else
#define DMABUF_SUPPORTED 1
#endif
int cuDeviceGetAttribute(int *v, int attr, int d) { (void)d; *v = attr == 75 ? 9 : attr == 124 ? DMABUF_SUPPORTED : 0; return 0; }
#ifndef NO_BUS_ID
int cuDeviceGetPCIBusId(char *b, int len, int d) { snprintf(b, len, "0000:%02x:00.0", 0x17 + d); return 0; }
#endif

#ifndef NO_MEM
#define ARENA ((size_t)1 << 30)
#define MAX_ALLOCS 65536
/* vmm: a cuMemMap mapping (of physical allocation `handle`), usable once cuMemSetAccess
   made it `access`ible. */
/* ipc: memory of another process opened with cuIpcOpenMemHandle, its bytes at `bytes` (a
   mapping of `maplen` bytes at `map`); every other device allocation's bytes sit in dev_store
   at the offset its address has in dev_va. */
struct alloc { uintptr_t base; size_t size; int dev; int live; int host; int vmm; int access; unsigned long long handle; int ipc; char *bytes; void *map; size_t maplen; };
static struct alloc allocs[MAX_ALLOCS];
static int nallocs;
static char *dev_va;    /* reserved PROT_NONE: what device pointers point into */
static char *dev_store; /* the bytes: never handed out */
static int store_fd;    /* dev_store's memfd */
static size_t dev_top;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static volatile int fail_copies;
static volatile unsigned copy_delay_us;
static long copies[64];
static long queued, max_queued;

void mock_cuda_fail_copies(int code) { __atomic_store_n(&fail_copies, code, __ATOMIC_SEQ_CST); }
void mock_cuda_copy_delay_us(unsigned us) { __atomic_store_n(&copy_delay_us, us, __ATOMIC_SEQ_CST); }
long mock_cuda_copies(int dev) { return dev >= 0 && dev < 64 ? __atomic_load_n(&copies[dev], __ATOMIC_SEQ_CST) : -1; }
long mock_cuda_queued(void) { return __atomic_load_n(&queued, __ATOMIC_SEQ_CST); }
long mock_cuda_max_queued(void) { return __atomic_load_n(&max_queued, __ATOMIC_SEQ_CST); }
void mock_cuda_reset_max_queued(void) { __atomic_store_n(&max_queued, 0, __ATOMIC_SEQ_CST); }

/* Contexts: the primary context of device d is &ctx_tokens[d]; a per-thread stack. */
static char ctx_tokens[64];
static __thread void *ctx_stack[32];
static __thread int ctx_depth;
static int ctx_device(void *c) { return (int)((char *)c - ctx_tokens); }
static int valid_ctx(void *c) { return c && (char *)c >= ctx_tokens && (char *)c < ctx_tokens + COUNT; }

int cuDevicePrimaryCtxRetain(void **pctx, int dev) {
    if (!inited) return NOT_INITIALIZED;
    if (dev < 0 || dev >= COUNT) return INVALID_DEVICE;
    *pctx = &ctx_tokens[dev];
    return 0;
}
int cuDevicePrimaryCtxRelease_v2(int dev) { return dev >= 0 && dev < COUNT ? 0 : INVALID_DEVICE; }
int cuCtxPushCurrent_v2(void *ctx) {
    if (!valid_ctx(ctx)) return INVALID_CONTEXT;
    if (ctx_depth >= 32) return INVALID_VALUE;
    ctx_stack[ctx_depth++] = ctx;
    return 0;
}
int cuCtxPopCurrent_v2(void **pctx) {
    if (ctx_depth == 0) return INVALID_CONTEXT;
    void *c = ctx_stack[--ctx_depth];
    if (pctx) *pctx = c;
    return 0;
}
int cuCtxSetCurrent(void *ctx) {
    if (ctx == NULL) { if (ctx_depth) ctx_depth--; return 0; }
    if (!valid_ctx(ctx)) return INVALID_CONTEXT;
    if (ctx_depth == 0) ctx_stack[ctx_depth++] = ctx; else ctx_stack[ctx_depth - 1] = ctx;
    return 0;
}
int cuCtxGetCurrent(void **pctx) { *pctx = ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; return 0; }
static void *current(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; }

static void arena(void) {
    if (dev_va) return;
    dev_va = mmap(NULL, ARENA, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    /* A memfd, so that another process can map it (CUDA IPC). */
    store_fd = memfd_create("kvf-mock-cuda-device-memory", MFD_CLOEXEC);
    if (store_fd < 0 || ftruncate(store_fd, ARENA) != 0) abort();
    dev_store = mmap(NULL, ARENA, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, store_fd, 0);
    if (dev_va == MAP_FAILED || dev_store == MAP_FAILED) abort();
#ifdef HOST_VISIBLE
    munmap(dev_va, ARENA);
    dev_va = dev_store;
#endif
}

/* The live allocation holding [p, p+n) (n >= 1), or NULL. Called with mu held. */
static struct alloc *find(uintptr_t p, size_t n, int host) {
    for (int i = 0; i < nallocs; i++) {
        struct alloc *a = &allocs[i];
        if (a->live && a->host == host && p >= a->base && p - a->base < a->size && n <= a->size - (p - a->base)) return a;
    }
    return NULL;
}

int cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    if (!inited) return NOT_INITIALIZED;
    void *c = current();
    if (!c) return INVALID_CONTEXT;
    if (bytes == 0) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    arena();
    size_t size = (bytes + 511) & ~(size_t)511;
    if (dev_top + size > ARENA || nallocs == MAX_ALLOCS) { pthread_mutex_unlock(&mu); return OUT_OF_MEMORY; }
    allocs[nallocs++] = (struct alloc){ (uintptr_t)(dev_va + dev_top), bytes, ctx_device(c), 1, 0 };
    *dptr = (CUdeviceptr)(uintptr_t)(dev_va + dev_top);
    dev_top += size; /* addresses are never reused */
    pthread_mutex_unlock(&mu);
    return 0;
}

static void drain_legacy(void);

int cuMemFree_v2(CUdeviceptr p) {
    drain_legacy(); /* as the driver's, it waits for the device */
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nallocs; i++) {
        if (allocs[i].live && !allocs[i].host && !allocs[i].vmm && !allocs[i].ipc && allocs[i].base == p) {
            allocs[i].live = 0;
            memset(dev_store + (p - (uintptr_t)dev_va), 0xdd, allocs[i].size);
            pthread_mutex_unlock(&mu);
            return 0;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

int cuMemHostAlloc(void **pp, size_t bytes, unsigned flags) {
    (void)flags;
    if (!inited) return NOT_INITIALIZED;
    if (bytes == 0) return INVALID_VALUE;
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    if (nallocs == MAX_ALLOCS) { pthread_mutex_unlock(&mu); munmap(p, bytes); return OUT_OF_MEMORY; }
    allocs[nallocs++] = (struct alloc){ (uintptr_t)p, bytes, 0, 1, 1 };
    pthread_mutex_unlock(&mu);
    *pp = p;
    return 0;
}

int cuMemFreeHost(void *p) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nallocs; i++) {
        if (allocs[i].live && allocs[i].host && allocs[i].base == (uintptr_t)p) {
            allocs[i].live = 0;
            pthread_mutex_unlock(&mu);
            munmap(p, allocs[i].size);
            return 0;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

/* CUpointer_attribute: 1 CONTEXT, 2 MEMORY_TYPE, 8 IS_MANAGED, 9 DEVICE_ORDINAL,
   11 RANGE_START_ADDR, 12 RANGE_SIZE. CUmemorytype: 1 HOST, 2 DEVICE. */
int cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    pthread_mutex_lock(&mu);
    struct alloc *a = find((uintptr_t)p, 1, 0);
    if (!a) a = find((uintptr_t)p, 1, 1);
    struct alloc c = a ? *a : (struct alloc){ 0 };
    pthread_mutex_unlock(&mu);
    if (!a) return INVALID_VALUE;
    switch (attr) {
    case 1: *(void **)data = &ctx_tokens[c.dev]; return 0;
    case 2: *(unsigned *)data = c.host ? 1 : 2; return 0;
    case 8: *(unsigned *)data = 0; return 0;
    case 9: *(int *)data = c.dev; return 0;
    case 11: *(CUdeviceptr *)data = c.base; return 0;
    case 12: *(size_t *)data = c.size; return 0;
    default: return INVALID_VALUE;
    }
}

/* Whether [p, p+n) is covered by accessible VMM mappings of one device, back to back (as the
   real driver allows a copy across them: one virtual range); its device in *dev. mu held. */
static int vmm_span(uintptr_t p, size_t n, int *dev) {
    uintptr_t end = p + n;
    struct alloc *a = find(p, 1, 0);
    if (!a || !a->vmm) return 0;
    *dev = a->dev;
    for (;;) {
        if (!a->vmm || !a->access || a->dev != *dev) return 0;
        uintptr_t e = a->base + a->size;
        if (e >= end) return 1;
        a = find(e, 1, 0);
        if (!a || a->base != e) return 0;
    }
}

/* The bytes behind device range [p, p+n) and its device, or NULL. */
static char *store(CUdeviceptr p, size_t n, int *dev) {
    pthread_mutex_lock(&mu);
    struct alloc *a = n ? find((uintptr_t)p, n, 0) : NULL;
    int ok = a && (!a->vmm || a->access);
    *dev = ok ? a->dev : -1;
    char *bytes = ok && a->bytes ? a->bytes + ((uintptr_t)p - a->base) : NULL;
    if (!a && n) ok = vmm_span((uintptr_t)p, n, dev);
    pthread_mutex_unlock(&mu);
    if (bytes) return bytes;
    return ok ? dev_store + ((uintptr_t)p - (uintptr_t)dev_va) : NULL;
}

/* A copy touching device `dev`'s memory happens now: counted, delayed, done. */
static void do_copy(int dev, char *dst, const char *src, size_t n) {
    __atomic_add_fetch(&copies[dev], 1, __ATOMIC_SEQ_CST);
    unsigned us = __atomic_load_n(&copy_delay_us, __ATOMIC_SEQ_CST);
    if (us) usleep(us);
    memmove(dst, src, n);
}

static int copy_check(void) {
    int f = __atomic_load_n(&fail_copies, __ATOMIC_SEQ_CST);
    if (f) return f;
    return current() ? 0 : INVALID_CONTEXT;
}

/* The synchronous copies are defined after the streams (below): like the driver's, host to
   device and device to device return before the copy is done (queued on the legacy stream;
   host bytes staged first), device to host waits for what the legacy stream has queued. */
#ifndef NO_DMABUF
/* DMA-BUF export of device memory (CUDA 11.7+): [p, p+n) must be page-aligned (address and
   size), type 1 (DMA_BUF_FD), and overlap a live device allocation. The mock's "dma-buf" is a
   plain memfd: no NIC driver imports it as a dma-buf (Soft-RoCE refuses dma-bufs anyway),
   which is what the tests of the refusal need. */
int cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t n, int type, unsigned long long flags) {
    if (!inited) return NOT_INITIALIZED;
    if (type != 1 || flags != 0 || n == 0 || (p & 4095) != 0 || (n & 4095) != 0) return INVALID_VALUE;
    int ok = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nallocs; i++) {
        struct alloc *a = &allocs[i];
        if (a->live && !a->host && !a->ipc && a->base < p + n && a->base + a->size > p) ok = 1;
    }
    pthread_mutex_unlock(&mu);
    if (!ok) return INVALID_VALUE;
    int fd = memfd_create("kvf-mock-dmabuf", MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    *(int *)handle = fd;
    return 0;
}
#endif

/* Virtual memory management (CUDA 10.2+), as PyTorch's expandable segments use it: a range of
   addresses reserved (cuMemAddressReserve), physical allocations made (cuMemCreate) and mapped
   into it back to back (cuMemMap), made accessible (cuMemSetAccess). cuPointerGetAttribute
   reports each mapping as its own range (RANGE_START_ADDR/RANGE_SIZE), as the real driver
   does; cuMemRetainAllocationHandle succeeds only inside a mapping. Mock limits: a physical
   allocation is mapped once, whole, at offset 0; reserved ranges are never handed out
   again. */
#define MAX_HANDLES 4096
/* live: references (cuMemCreate and each cuMemRetainAllocationHandle; cuMemRelease drops one). */
struct phys { size_t size; int dev; int live; int mapped; };
static struct phys handles[MAX_HANDLES]; /* handle h is handles[h - 1] */
static int nhandles;
struct reservation { uintptr_t base; size_t size; int live; };
static struct reservation reservations[1024];
static int nreservations;

int cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    (void)align; (void)addr; (void)flags;
    if (!inited) return NOT_INITIALIZED;
    if (size == 0 || size % 512) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    arena();
    if (dev_top + size > ARENA || nreservations == 1024) { pthread_mutex_unlock(&mu); return OUT_OF_MEMORY; }
    reservations[nreservations++] = (struct reservation){ (uintptr_t)(dev_va + dev_top), size, 1 };
    *ptr = (CUdeviceptr)(uintptr_t)(dev_va + dev_top);
    dev_top += size;
    pthread_mutex_unlock(&mu);
    return 0;
}

int cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    (void)prop; (void)option;
    *g = (size_t)2 << 20;
    return 0;
}

int cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nreservations; i++) {
        if (reservations[i].live && reservations[i].base == ptr && reservations[i].size == size) {
            reservations[i].live = 0;
            pthread_mutex_unlock(&mu);
            return 0;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

/* prop: CUmemAllocationProp, whose location.id (the device) is its fourth int. */
int cuMemCreate(unsigned long long *handle, size_t size, const void *prop, unsigned long long flags) {
    (void)flags;
    if (!inited) return NOT_INITIALIZED;
    int dev = ((const int *)prop)[3];
    if (dev < 0 || dev >= COUNT) return INVALID_DEVICE;
    if (size == 0 || size % 512) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (nhandles == MAX_HANDLES) { pthread_mutex_unlock(&mu); return OUT_OF_MEMORY; }
    handles[nhandles++] = (struct phys){ size, dev, 1, 0 };
    *handle = (unsigned long long)nhandles;
    pthread_mutex_unlock(&mu);
    return 0;
}

int cuMemRelease(unsigned long long h) {
    pthread_mutex_lock(&mu);
    int ok = h >= 1 && h <= (unsigned long long)nhandles && handles[h - 1].live > 0;
    if (ok) handles[h - 1].live--; /* (a mapped one stays usable until unmapped, as real) */
    pthread_mutex_unlock(&mu);
    return ok ? 0 : INVALID_HANDLE;
}

int cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, unsigned long long h, unsigned long long flags) {
    (void)flags;
    pthread_mutex_lock(&mu);
    int in_reservation = 0;
    for (int i = 0; i < nreservations; i++) {
        struct reservation *r = &reservations[i];
        if (r->live && ptr >= r->base && ptr - r->base < r->size && size <= r->size - (ptr - r->base)) in_reservation = 1;
    }
    int e = 0;
    if (!in_reservation || offset != 0 || h < 1 || h > (unsigned long long)nhandles || !handles[h - 1].live || handles[h - 1].size != size) e = INVALID_VALUE;
    else if (handles[h - 1].mapped || find(ptr, 1, 0) || find(ptr + size - 1, 1, 0) || nallocs == MAX_ALLOCS) e = INVALID_VALUE;
    if (!e) {
        handles[h - 1].mapped = 1;
        allocs[nallocs++] = (struct alloc){ ptr, size, handles[h - 1].dev, 1, 0, 1, 0, h };
    }
    pthread_mutex_unlock(&mu);
    return e;
}

/* desc: CUmemAccessDesc[count] (location, flags): any access granted makes the range usable. */
int cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
    (void)desc;
    if (count == 0) return INVALID_VALUE;
    pthread_mutex_lock(&mu);
    int found = 0;
    for (int i = 0; i < nallocs; i++) {
        struct alloc *a = &allocs[i];
        if (a->live && a->vmm && a->base >= ptr && a->base + a->size <= ptr + size) { a->access = 1; found = 1; }
    }
    pthread_mutex_unlock(&mu);
    return found ? 0 : INVALID_VALUE;
}

int cuMemUnmap(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&mu);
    int found = 0;
    for (int i = 0; i < nallocs; i++) {
        struct alloc *a = &allocs[i];
        if (a->live && a->vmm && a->base >= ptr && a->base + a->size <= ptr + size) {
            a->live = 0;
            handles[a->handle - 1].mapped = 0;
            memset(dev_store + (a->base - (uintptr_t)dev_va), 0xdd, a->size);
            found = 1;
        }
    }
    pthread_mutex_unlock(&mu);
    return found ? 0 : INVALID_VALUE;
}

int cuMemRetainAllocationHandle(unsigned long long *h, void *addr) {
    pthread_mutex_lock(&mu);
    struct alloc *a = find((uintptr_t)addr, 1, 0);
    int ok = a && a->vmm;
    if (ok) { *h = a->handle; handles[a->handle - 1].live++; }
    pthread_mutex_unlock(&mu);
    return ok ? 0 : INVALID_VALUE;
}

/* CUDA IPC (legacy handles, cuIpcGetMemHandle): a handle names a cuMemAlloc allocation (the
   whole of it, whatever interior pointer was given); cuIpcOpenMemHandle in another process
   maps the same bytes at a device address of its own (the allocation's base), reached only
   through copies as every device address here; cuIpcCloseMemHandle unmaps it. As the real
   driver: a handle opened in its own process is refused, VMM memory has no IPC handle,
   cuMemFree does not free opened memory. The mock's handle: magic, pid, the exporter's memfd,
   the allocation's offset in it, its size and device. */
struct ipc_handle { char magic[8]; int pid; int fd; unsigned long long off, size; int dev; char pad[28]; };
typedef struct { char reserved[64]; } CUipcMemHandle;
_Static_assert(sizeof(struct ipc_handle) == 64, "CUipcMemHandle is 64 bytes");

int cuIpcGetMemHandle(CUipcMemHandle *out, CUdeviceptr p) {
    if (!inited) return NOT_INITIALIZED;
    pthread_mutex_lock(&mu);
    struct alloc *a = find((uintptr_t)p, 1, 0);
    int ok = a && !a->vmm && !a->ipc;
    struct ipc_handle h = { "KVFMOCK", getpid(), store_fd, 0, 0, 0, { 0 } };
    if (ok) { h.off = a->base - (uintptr_t)dev_va; h.size = a->size; h.dev = a->dev; }
    pthread_mutex_unlock(&mu);
    if (!ok) return INVALID_VALUE;
    memcpy(out, &h, sizeof h);
    return 0;
}

int cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned flags) {
    (void)flags;
    struct ipc_handle h;
    memcpy(&h, &handle, sizeof h);
    if (!current()) return INVALID_CONTEXT;
    if (memcmp(h.magic, "KVFMOCK", 8) != 0 || h.size == 0 || h.dev < 0 || h.dev >= COUNT) return INVALID_VALUE;
    if (h.pid == getpid()) return INVALID_CONTEXT; /* a process cannot open its own handle */
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", h.pid, h.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return INVALID_VALUE; /* the exporter is gone */
    size_t page = (size_t)sysconf(_SC_PAGESIZE), delta = h.off % page, maplen = h.size + delta;
    void *m = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)(h.off - delta));
    close(fd);
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    arena();
    size_t size = (h.size + 511) & ~(size_t)511;
    if (dev_top + size > ARENA || nallocs == MAX_ALLOCS) { pthread_mutex_unlock(&mu); munmap(m, maplen); return OUT_OF_MEMORY; }
    uintptr_t base = (uintptr_t)(dev_va + dev_top);
    dev_top += size;
    allocs[nallocs++] = (struct alloc){ base, h.size, h.dev, 1, 0, 0, 0, 0, 1, (char *)m + delta, m, maplen };
    pthread_mutex_unlock(&mu);
    *pdptr = base;
    return 0;
}

/* Knob: memory of other processes opened here and not closed yet (cuIpcOpenMemHandle's). */
long mock_cuda_ipc_open(void) {
    long n = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nallocs; i++) n += allocs[i].live && allocs[i].ipc;
    pthread_mutex_unlock(&mu);
    return n;
}

int cuIpcCloseMemHandle(CUdeviceptr p) {
    drain_legacy();
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nallocs; i++) {
        struct alloc *a = &allocs[i];
        if (a->live && a->ipc && a->base == p) {
            a->live = 0;
            void *m = a->map;
            size_t len = a->maplen;
            pthread_mutex_unlock(&mu);
            munmap(m, len);
            return 0;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

/* Streams: asynchronous copies are queued and happen only when something waits for them
   (cuStreamSynchronize, or cuEventSynchronize of an event recorded after them), in order: a
   caller that reads a bounce buffer before waiting sees stale bytes, one that reuses it too
   early sends the wrong ones. */
struct op { int dev; char *dst; const char *src; size_t n; char *owned; };
struct stream { struct op *ops; long issued, done; int cap; pthread_mutex_t mu; };
struct event { struct stream *s; long seq; };

int cuStreamCreate(void **ps, unsigned flags) {
    (void)flags;
    if (!current()) return INVALID_CONTEXT;
    struct stream *s = calloc(1, sizeof *s);
    if (!s) return OUT_OF_MEMORY;
    pthread_mutex_init(&s->mu, NULL);
    *ps = s;
    return 0;
}

/* Runs the queued copies of `s` up to sequence number `upto`. */
static void run_until(struct stream *s, long upto) {
    pthread_mutex_lock(&s->mu);
    while (s->done < upto && s->done < s->issued) {
        struct op o = s->ops[s->done % s->cap];
        do_copy(o.dev, o.dst, o.src, o.n);
        free(o.owned);
        s->done++;
        __atomic_sub_fetch(&queued, 1, __ATOMIC_SEQ_CST);
    }
    pthread_mutex_unlock(&s->mu);
}

/* The legacy default stream (the stream handle NULL): where the synchronous copies queue. */
static struct stream legacy = { .mu = PTHREAD_MUTEX_INITIALIZER };

static void drain_legacy(void) { run_until(&legacy, legacy.issued); }

int cuStreamSynchronize(void *h) {
    struct stream *s = h ? h : &legacy;
    run_until(s, s->issued);
    return 0;
}

int cuCtxSynchronize(void) { drain_legacy(); return 0; }

int cuStreamDestroy_v2(void *h) {
    struct stream *s = h;
    if (!s) return INVALID_HANDLE;
    cuStreamSynchronize(s);
    free(s->ops);
    free(s);
    return 0;
}

static int enqueue_owned(struct stream *s, int dev, char *dst, const char *src, size_t n, char *owned);

static int enqueue(struct stream *s, int dev, char *dst, const char *src, size_t n) {
    return enqueue_owned(s, dev, dst, src, n, NULL);
}

static int enqueue_owned(struct stream *s, int dev, char *dst, const char *src, size_t n, char *owned) {
    if (!s) { do_copy(dev, dst, src, n); free(owned); return 0; }
    pthread_mutex_lock(&s->mu);
    if (s->issued - s->done == s->cap) {
        int cap = s->cap ? s->cap * 2 : 16;
        struct op *o = malloc(cap * sizeof *o);
        if (!o) { pthread_mutex_unlock(&s->mu); return OUT_OF_MEMORY; }
        for (long i = s->done; i < s->issued; i++) o[i % cap] = s->ops[i % s->cap];
        free(s->ops);
        s->ops = o;
        s->cap = cap;
    }
    s->ops[s->issued % s->cap] = (struct op){ dev, dst, src, n, owned };
    s->issued++;
    long depth = s->issued - s->done, m = __atomic_load_n(&max_queued, __ATOMIC_SEQ_CST);
    while (depth > m && !__atomic_compare_exchange_n(&max_queued, &m, depth, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    __atomic_add_fetch(&queued, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *stream) {
    int e = copy_check(), dev;
    if (e) return e;
    char *s = store(src, n, &dev);
    return s ? enqueue(stream, dev, dst, s, n) : INVALID_VALUE;
}

int cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *stream) {
    int e = copy_check(), dev;
    if (e) return e;
    char *d = store(dst, n, &dev);
    return d ? enqueue(stream, dev, d, src, n) : INVALID_VALUE;
}

int cuEventCreate(void **pe, unsigned flags) {
    (void)flags;
    if (!current()) return INVALID_CONTEXT;
    struct event *e = calloc(1, sizeof *e);
    if (!e) return OUT_OF_MEMORY;
    *pe = e;
    return 0;
}
int cuEventRecord(void *h, void *stream) {
    struct event *e = h;
    if (!e) return INVALID_HANDLE;
    e->s = stream;
    e->seq = stream ? ((struct stream *)stream)->issued : 0;
    return 0;
}
int cuEventSynchronize(void *h) {
    struct event *e = h;
    if (!e) return INVALID_HANDLE;
    if (e->s) run_until(e->s, e->seq);
    return 0;
}
int cuEventDestroy_v2(void *e) { free(e); return 0; }

int cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    int e = copy_check();
    if (e) return e;
    int dev;
    char *s = store(src, n, &dev);
    if (!s) return INVALID_VALUE;
    drain_legacy(); /* after what the legacy stream queued before it */
    do_copy(dev, dst, s, n);
    return 0;
}

int cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    int e = copy_check();
    if (e) return e;
    int dev;
    char *d = store(dst, n, &dev);
    if (!d) return INVALID_VALUE;
    /* Pageable host memory: staged, then the DMA "may not have completed" on return. */
    char *staged = malloc(n ? n : 1);
    if (!staged) return OUT_OF_MEMORY;
    memcpy(staged, src, n);
    return enqueue_owned(&legacy, dev, d, staged, n, staged);
}

int cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    int e = copy_check();
    if (e) return e;
    int dd, ds;
    char *d = store(dst, n, &dd), *s = store(src, n, &ds);
    if (!d || !s) return INVALID_VALUE;
    (void)ds;
    /* No host-side synchronisation: queued on the legacy stream. */
    return enqueue(&legacy, dd, d, s, n);
}
#endif /* NO_MEM */
