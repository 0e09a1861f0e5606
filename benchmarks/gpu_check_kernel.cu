// The SGLang 0.5.23 tree rejection-sampling kernel behind a C ABI, for benchmarks/gpu_check.py.
//
// SGLang builds `tree_speculative_sampling_target_only` at run time with tvm-ffi
// (kernels/ops/speculative/sampling.py -> kernels/jit/csrc/speculative/sampling.cuh); the
// lent GPU machine has no SGLang and no tvm-ffi, so this file launches the same kernel
// template (kernels/jit/include/sgl_kernel/speculative/sampling.cuh, FlashInfer's sampling
// headers under it) exactly as that launcher does: one block of 1024 threads per request,
// the dynamic shared memory of SamplingTempStorage<1024, SCAN_ALGO, REDUCE_ALGO>, VecSize
// = gcd(4, vocab), threshold_acc floored at 1e-9. The headers come from the cached wheels
// (gpu_check.py prepare); none of them is kept in this repository.
#include <cuda_runtime.h>

#include <cstdint>

#include <sgl_kernel/speculative/sampling.cuh>

namespace {

template <uint32_t VecSize, bool Deterministic>
int launch(int32_t* predicts, int32_t* accept_index, int32_t* accept_token_num, int64_t* candidates,
           int64_t* retrive_index, int64_t* retrive_next_token, int64_t* retrive_next_sibling,
           float* uniform_samples, float* uniform_final, float* target_probs, float* draft_probs,
           uint32_t batch_size, uint32_t spec_tokens, uint32_t draft_tokens, uint32_t vocab,
           float threshold_single, float threshold_acc, cudaStream_t stream) {
  using namespace flashinfer::sampling;
  constexpr uint32_t block_threads = 1024;
  constexpr size_t smem_size = sizeof(SamplingTempStorage<block_threads, SCAN_ALGO, REDUCE_ALGO>);
  auto kernel = sglang::speculative_sampling::TreeSpeculativeSamplingTargetOnly<
      block_threads, SCAN_ALGO, REDUCE_ALGO, VecSize, Deterministic, float, int32_t, int64_t>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_size);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (batch_size == 0) return 0;
  kernel<<<batch_size, block_threads, smem_size, stream>>>(
      predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
      retrive_next_sibling, uniform_samples, uniform_final, target_probs, draft_probs, batch_size,
      spec_tokens, draft_tokens, vocab, threshold_single, threshold_acc > 1e-9f ? threshold_acc : 1e-9f);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int ddtree_tree_sampling(int vec_size, int deterministic, void* predicts, void* accept_index,
                                    void* accept_token_num, void* candidates, void* retrive_index,
                                    void* retrive_next_token, void* retrive_next_sibling, void* uniform_samples,
                                    void* uniform_final, void* target_probs, void* draft_probs, uint32_t batch_size,
                                    uint32_t spec_tokens, uint32_t draft_tokens, uint32_t vocab,
                                    float threshold_single, float threshold_acc, void* stream) {
#define DDTREE_ARGS                                                                                            \
  static_cast<int32_t*>(predicts), static_cast<int32_t*>(accept_index), static_cast<int32_t*>(accept_token_num), \
      static_cast<int64_t*>(candidates), static_cast<int64_t*>(retrive_index),                                   \
      static_cast<int64_t*>(retrive_next_token), static_cast<int64_t*>(retrive_next_sibling),                    \
      static_cast<float*>(uniform_samples), static_cast<float*>(uniform_final), static_cast<float*>(target_probs), \
      static_cast<float*>(draft_probs), batch_size, spec_tokens, draft_tokens, vocab, threshold_single,          \
      threshold_acc, static_cast<cudaStream_t>(stream)
  switch (vec_size * 2 + (deterministic ? 1 : 0)) {
    case 2: return launch<1, false>(DDTREE_ARGS);
    case 3: return launch<1, true>(DDTREE_ARGS);
    case 4: return launch<2, false>(DDTREE_ARGS);
    case 5: return launch<2, true>(DDTREE_ARGS);
    case 8: return launch<4, false>(DDTREE_ARGS);
    case 9: return launch<4, true>(DDTREE_ARGS);
    default: return -1;
  }
#undef DDTREE_ARGS
}
