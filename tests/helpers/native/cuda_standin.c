/*
 * CPU stand-in for the few CUDA driver and runtime symbols that NIXL's
 * LIBFABRIC plugin links (it is built with CUDA), so the plugin loads on a
 * machine without an NVIDIA driver. Every call answers "no CUDA device", which
 * is the truth on such a machine; the plugin then serves host memory only.
 *
 * Built by tools/libfabric/setup.sh twice from this one file:
 *   -DKVPUSH_STANDIN_DRIVER   -> libcuda.so.1     (cu* driver symbols, unversioned)
 *   -DKVPUSH_STANDIN_RUNTIME  -> libcudart.so.NN  (cuda* runtime symbols, versioned
 *                                                  libcudart.so.NN, only when the host
 *                                                  has no CUDA runtime of that version)
 * It must never be on the library path of a host with a real driver: the
 * setup script puts it there only when no real libcuda.so.1 loads, and
 * `kvpush doctor` flags a stand-in it finds on a host with NVIDIA devices
 * (the exported kvpush_cuda_standin symbol marks this library).
 */

#define NO_DEVICE 100 /* CUDA_ERROR_NO_DEVICE == cudaErrorNoDevice == 100 */

const char kvpush_cuda_standin[] = "kvpush CPU stand-in for CUDA: no device";

#ifdef KVPUSH_STANDIN_DRIVER
int cuCtxSetCurrent(void *ctx) {
    (void)ctx;
    return NO_DEVICE;
}

int cuDeviceGetPCIBusId(char *bus_id, int len, int dev) {
    (void)dev;
    if (bus_id && len > 0) {
        bus_id[0] = '\0';
    }
    return NO_DEVICE;
}

int cuPointerGetAttributes(unsigned int n, void *attrs, void **data, unsigned long long ptr) {
    (void)n;
    (void)attrs;
    (void)data;
    (void)ptr;
    return NO_DEVICE;
}
#endif

#ifdef KVPUSH_STANDIN_RUNTIME
int cudaSetDevice(int dev) {
    (void)dev;
    return NO_DEVICE;
}

const char *cudaGetErrorString(int err) {
    return err == 0 ? "no error" : "no CUDA-capable device is detected (kvpush CPU stand-in)";
}
#endif
