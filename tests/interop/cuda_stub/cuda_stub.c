/* A stand-in for the CUDA driver, libcuda.so.1, for the stock Mooncake 0.3.14 wheel on hosts
 * without a GPU driver (see cudart_stub.c). Every driver call the wheel's modules import fails
 * with CUDA_ERROR_NO_DEVICE, as the real driver does on a host with no GPU; cuGetErrorName and
 * cuGetErrorString answer (they succeed on the real driver too). The project's mock driver
 * (crates/kvferry/tests/cuda_mock/mock_cuda.c) is not used here: it emulates a device, and the
 * wheel's runtime stand-in has none, so the two would disagree.
 * Built by scripts/mooncake-venv; the list was taken with
 *   nm -D --undefined-only <wheel>/mooncake/NAME.so | grep ' cu[A-Z]' */
#include <stddef.h>

#define NO_DEVICE 100 /* CUDA_ERROR_NO_DEVICE */

typedef int CUresult;

#define FAIL(name) \
    CUresult name(void) { return NO_DEVICE; }

FAIL(cuInit)
FAIL(cuCtxGetCurrent)
FAIL(cuCtxGetDevice)
FAIL(cuCtxSetCurrent)
FAIL(cuDeviceGet)
FAIL(cuDeviceGetAttribute)
FAIL(cuDeviceGetPCIBusId)
FAIL(cuDevicePrimaryCtxRelease_v2)
FAIL(cuDevicePrimaryCtxRetain)
FAIL(cuFuncSetAttribute)
FAIL(cuLaunchKernel)
FAIL(cuLaunchKernelEx)
FAIL(cuMemAddressFree)
FAIL(cuMemAddressReserve)
FAIL(cuMemCreate)
FAIL(cuMemExportToShareableHandle)
FAIL(cuMemGetAddressRange_v2)
FAIL(cuMemGetAllocationGranularity)
FAIL(cuMemGetHandleForAddressRange)
FAIL(cuMemImportFromShareableHandle)
FAIL(cuMemMap)
FAIL(cuMemRelease)
FAIL(cuMemRetainAllocationHandle)
FAIL(cuMemSetAccess)
FAIL(cuMemUnmap)
FAIL(cuModuleGetFunction)
FAIL(cuModuleLoadDataEx)
FAIL(cuModuleUnload)
FAIL(cuPointerGetAttribute)
FAIL(cuPointerSetAttribute)
/* Mooncake's own code and what kvferry-style probes call first. */
FAIL(cuDriverGetVersion)

CUresult cuDeviceGetCount(int *count) {
    if (count != NULL) *count = 0;
    return NO_DEVICE;
}

static const char *error_text(CUresult e, int name) {
    switch (e) {
    case 0: return name ? "CUDA_SUCCESS" : "no error";
    case NO_DEVICE: return name ? "CUDA_ERROR_NO_DEVICE"
                                : "no CUDA-capable device is detected (libcuda.so.1 stand-in)";
    default: return NULL;
    }
}
CUresult cuGetErrorName(CUresult e, const char **s) {
    if (s == NULL) return 1; /* CUDA_ERROR_INVALID_VALUE */
    *s = error_text(e, 1);
    return *s ? 0 : 1;
}
CUresult cuGetErrorString(CUresult e, const char **s) {
    if (s == NULL) return 1;
    *s = error_text(e, 0);
    return *s ? 0 : 1;
}
