/* A stand-in for libcudart.so.13 on hosts without CUDA 13, so that the stock Mooncake 0.3.14
 * wheel (mooncake-transfer-engine-cuda13, the only 0.3.14 build on PyPI) imports and runs its
 * TCP transport for the interop and parity tests. It exports every symbol the wheel's
 * modules import from libcudart.so.13 (with that symbol version: cudart.map) and behaves as
 * the real runtime does on a host with no GPU: every call fails with cudaErrorNoDevice and
 * cudaGetDeviceCount reports 0 devices. The fat-binary registration the modules run at load
 * time succeeds (it returns a handle and registers nothing), as it does with the real runtime.
 * Built by scripts/mooncake-venv; the list was taken with
 *   nm -D --undefined-only --with-symbol-versions <wheel>/mooncake/NAME.so | grep @libcudart */
#include <stddef.h>
#include <string.h>

#define NO_DEVICE 100 /* cudaErrorNoDevice */

typedef int cudaError_t;

/* Calls that fail: every argument list collapses to "none" (the System V ABI lets a callee
 * ignore its arguments), and each returns cudaErrorNoDevice. */
#define FAIL(name) \
    cudaError_t name(void) { return NO_DEVICE; }

FAIL(cudaDeviceCanAccessPeer)
FAIL(cudaDeviceEnablePeerAccess)
FAIL(cudaDeviceGetAttribute)
FAIL(cudaDeviceGetPCIBusId)
FAIL(cudaDeviceGetStreamPriorityRange)
FAIL(cudaDeviceSynchronize)
FAIL(cudaEventCreate)
FAIL(cudaEventCreateWithFlags)
FAIL(cudaEventDestroy)
FAIL(cudaEventElapsedTime)
FAIL(cudaEventQuery)
FAIL(cudaEventRecord)
FAIL(cudaEventRecordWithFlags)
FAIL(cudaEventSynchronize)
FAIL(cudaFree)
FAIL(cudaFreeHost)
FAIL(cudaFuncGetAttributes)
FAIL(cudaGetDevice)
FAIL(cudaGetDeviceProperties)
FAIL(cudaGraphRetainUserObject)
FAIL(cudaHostAlloc)
FAIL(cudaHostGetDevicePointer)
FAIL(cudaHostRegister)
FAIL(cudaHostUnregister)
FAIL(cudaIpcCloseMemHandle)
FAIL(cudaIpcGetMemHandle)
FAIL(cudaIpcOpenMemHandle)
FAIL(cudaLaunchHostFunc)
FAIL(cudaLaunchKernelExC)
FAIL(cudaMalloc)
FAIL(cudaMallocHost)
FAIL(cudaMemcpy)
FAIL(cudaMemcpyAsync)
FAIL(cudaMemcpyBatchAsync)
FAIL(cudaMemset)
FAIL(cudaMemsetAsync)
FAIL(cudaSetDevice)
FAIL(cudaStreamCreateWithFlags)
FAIL(cudaStreamCreateWithPriority)
FAIL(cudaStreamDestroy)
FAIL(cudaStreamGetCaptureInfo)
FAIL(cudaStreamIsCapturing)
FAIL(cudaStreamQuery)
FAIL(cudaStreamSynchronize)
FAIL(cudaStreamUpdateCaptureDependencies)
FAIL(cudaStreamWaitEvent)
FAIL(cudaUserObjectCreate)
FAIL(cudaUserObjectRelease)
FAIL(__cudaGetKernel)
FAIL(__cudaLaunchKernel)
FAIL(__cudaPopCallConfiguration)

/* cudaPointerGetAttributes(attr, ptr): as the real runtime without a device, it fails; the
 * attributes are zeroed first (type cudaMemoryTypeUnregistered) for callers that read them
 * anyway. struct cudaPointerAttributes is 32 bytes in CUDA 13 (type, device, two pointers). */
cudaError_t cudaPointerGetAttributes(void *attr, const void *ptr) {
    (void)ptr;
    if (attr != NULL) memset(attr, 0, 32);
    return NO_DEVICE;
}

cudaError_t cudaGetDeviceCount(int *count) {
    if (count != NULL) *count = 0;
    return NO_DEVICE;
}

static cudaError_t last_error = NO_DEVICE;
cudaError_t cudaGetLastError(void) {
    cudaError_t e = last_error;
    last_error = 0;
    return e;
}

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case 0: return "no error";
    case NO_DEVICE: return "no CUDA-capable device is detected (libcudart.so.13 stand-in)";
    default: return "unrecognized error code";
    }
}

/* Kernel registration at module load: a handle, nothing registered. */
static void *fatbin_handle[4];
void **__cudaRegisterFatBinary(void *fat_cubin) {
    (void)fat_cubin;
    return fatbin_handle;
}
void __cudaRegisterFatBinaryEnd(void **handle) { (void)handle; }
void __cudaUnregisterFatBinary(void **handle) { (void)handle; }
void __cudaRegisterFunction(void) {}
unsigned __cudaPushCallConfiguration(void) { return NO_DEVICE; }
