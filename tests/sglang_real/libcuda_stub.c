/* Test-only stand-in for the NVIDIA driver library libcuda.so.1, for machines without a GPU.

   The sglang-kernel 0.4.10 wheel (sgl_kernel) is built for CUDA only; its extension modules
   link against libcuda.so.1 and resolve these 14 driver entry points when they are loaded.
   Every entry point here reports CUDA_ERROR_NO_DEVICE (100), so `import sgl_kernel`
   succeeds and any real use finds no GPU. Built by tests/sglang_real/setup_env.py into
   .cache/sglang-cpu/stub/ and put on LD_LIBRARY_PATH only for the CPU test server. */
#define STUB(name) int name(void) { return 100; }
STUB(cuCtxFromGreenCtx) STUB(cuCtxPopCurrent_v2) STUB(cuCtxPushCurrent_v2)
STUB(cuDevResourceGenerateDesc) STUB(cuDevSmResourceSplitByCount) STUB(cuDeviceGetDevResource)
STUB(cuDriverGetVersion) STUB(cuGetErrorString) STUB(cuGetProcAddress_v2) STUB(cuGreenCtxCreate)
STUB(cuGreenCtxDestroy) STUB(cuGreenCtxGetDevResource) STUB(cuPointerGetAttribute) STUB(cuStreamCreate)
