/* libcuda.so.1 for a host WITHOUT a GPU driver, so that NIXL's LIBFABRIC plugin (which links
 * libcuda.so.1 for VRAM) loads and serves host memory. Every entry point says "no device"
 * (CUDA_ERROR_NO_DEVICE = 100). scripts/libfabric.sh builds it into a folder of its own and puts
 * that folder on LD_LIBRARY_PATH only when the host has no driver (no libcuda.so.1 known to
 * ldconfig, no /dev/nvidiactl). The plugin imports the first three; libcudart looks up the rest. */
typedef int CUresult;
#define CUDA_ERROR_NO_DEVICE 100

CUresult cuCtxSetCurrent(void *ctx) { (void)ctx; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGetPCIBusId(char *id, int len, int dev) {
    (void)id; (void)len; (void)dev; return CUDA_ERROR_NO_DEVICE;
}
CUresult cuPointerGetAttributes(unsigned n, void *attrs, void **data, unsigned long long ptr) {
    (void)n; (void)attrs; (void)data; (void)ptr; return CUDA_ERROR_NO_DEVICE;
}
CUresult cuInit(unsigned flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDriverGetVersion(int *version) { (void)version; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGetCount(int *count) { if (count) *count = 0; return CUDA_ERROR_NO_DEVICE; }
CUresult cuGetProcAddress(const char *s, void **f, int v, unsigned long long fl) {
    (void)s; (void)v; (void)fl; if (f) *f = 0; return CUDA_ERROR_NO_DEVICE;
}
CUresult cuGetProcAddress_v2(const char *s, void **f, int v, unsigned long long fl, void *st) {
    (void)s; (void)v; (void)fl; (void)st; if (f) *f = 0; return CUDA_ERROR_NO_DEVICE;
}
CUresult cuGetExportTable(const void **table, const void *id) {
    (void)id; if (table) *table = 0; return CUDA_ERROR_NO_DEVICE;
}
