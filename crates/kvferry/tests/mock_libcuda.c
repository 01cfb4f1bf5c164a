/* A mock CUDA driver (libcuda.so.1's driver API, the entry points kvferry uses), built with cc
 * by the tests: crates/kvferry/tests/gpu_driver.rs (the probe) and
 * crates/kvferry-cli/tests/doctor_gpu.rs (`kvferry doctor` with it on LD_LIBRARY_PATH).
 * -DINIT_RESULT=<cuInit's result> -DCOUNT=<GPUs> [-DNO_BUS_ID: an old driver lacking a symbol] */
#include <stdio.h>
#include <string.h>
#include <stddef.h>
int cuInit(unsigned flags) { (void)flags; return INIT_RESULT; }
int cuDriverGetVersion(int *v) { *v = 12040; return 0; }
int cuDeviceGetCount(int *n) { *n = COUNT; return 0; }
int cuDeviceGet(int *d, int i) { if (i < 0 || i >= COUNT) return 101; *d = i; return 0; }
int cuDeviceGetName(char *name, int len, int d) { snprintf(name, len, "Mock H200 #%d", d); return 0; }
int cuDeviceTotalMem_v2(size_t *b, int d) { (void)d; *b = (size_t)141 << 30; return 0; }
int cuDeviceGetAttribute(int *v, int attr, int d) { (void)d; *v = attr == 75 ? 9 : 0; return 0; }
#ifndef NO_BUS_ID
int cuDeviceGetPCIBusId(char *b, int len, int d) { snprintf(b, len, "0000:%02x:00.0", 0x17 + d); return 0; }
#endif
