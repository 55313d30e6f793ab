// The CUDA program the device checks run as a tenant would: it reports its pid and SM count,
// holds <MiB> of device memory, then is busy (a spinning kernel), idle (a context that does
// nothing) or faults (a write to an invalid address: one application XID, for the optional
// fault-domain step). Every CUDA error is printed with its number (807: the MPS server is not
// accepting new clients).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <unistd.h>
#include <cuda_runtime.h>

__global__ void spin(float* x, int n, long iters) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float v = x[i]; for (long k = 0; k < iters; k++) v = v * 1.0000001f + 0.000001f; x[i] = v; }
}
__global__ void bad(int* p) { *p = 1; }

static int said(const char* what, cudaError_t e) {
  printf("%s: %s (%d)\n", what, e == cudaSuccess ? "ok" : cudaGetErrorString(e), (int)e);
  fflush(stdout);
  return e == cudaSuccess ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc < 4) { fprintf(stderr, "usage: client busy|idle|fault <MiB> <seconds>\n"); return 64; }
  const char* mode = argv[1];
  size_t mib = strtoull(argv[2], 0, 10);
  int secs = atoi(argv[3]);
  cudaDeviceProp p;
  if (said("init", cudaGetDeviceProperties(&p, 0))) return 2;
  printf("pid=%d SMs=%d\n", getpid(), p.multiProcessorCount);
  void* held = 0;
  said("alloc", cudaMalloc(&held, mib << 20));
  if (!strcmp(mode, "fault")) {
    bad<<<1, 1>>>((int*)0x10);
    said("fault kernel", cudaDeviceSynchronize());
    return 3;
  }
  time_t end = time(0) + secs;
  if (!strcmp(mode, "busy")) {
    int n = 1 << 20; float* x = 0;
    if (said("busy alloc", cudaMalloc(&x, n * sizeof(float)))) return 4;
    while (time(0) < end) {
      spin<<<n / 256, 256>>>(x, n, 4000);
      cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) { said("busy", e); return 4; }
    }
  } else {
    while (time(0) < end) sleep(1);
  }
  return said("end", cudaDeviceSynchronize());
}
