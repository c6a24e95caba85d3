#include "flash_cpu.h"

#include <algorithm>
#include <vector>

#include "convert.h"
#include "cpu_kernels.h"

namespace jax_flash2::cpu {
namespace {

const KernelTable& Kernels() {
  static const KernelTable* table = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &avx512::kTable;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &avx2::kTable;
    return &baseline::kTable;
  }();
  return *table;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

const char* SelectedIsa() { return Kernels().isa; }

void ForwardCpu(const FlashParams& p, ParallelRunner& runner) {
  const KernelTable& kernels = Kernels();
  const int64_t m_blocks = CeilDiv(p.seqlen_q, kBlockM);
  std::vector<float> workspace(runner.num_workers() * WorkspaceFloats(p.head_dim));
  runner.Run(p.batch * p.num_heads_q * m_blocks, [&](int64_t task, int worker) {
    const int64_t m_block = task % m_blocks;
    const int64_t h = (task / m_blocks) % p.num_heads_q;
    const int64_t b = task / (m_blocks * p.num_heads_q);
    kernels.forward_block(p, workspace.data() + worker * WorkspaceFloats(p.head_dim), b, h, m_block);
  });
}

void BackwardCpu(const FlashParams& p, ParallelRunner& runner) {
  const KernelTable& kernels = Kernels();
  const int64_t d = p.head_dim;
  const int64_t rows = p.batch * p.seqlen_q * p.num_heads_q;

  // Preprocess: D = rowsum(dO * O) - dLSE, [B, H, T].
  std::vector<float> dvec(rows);
  runner.Run(p.batch * p.num_heads_q, [&](int64_t bh, int) {
    const int64_t b = bh / p.num_heads_q, h = bh % p.num_heads_q;
    std::vector<float> o_row(d), do_row(d);
    for (int64_t t = 0; t < p.seqlen_q; ++t) {
      const int64_t offset = b * p.o_batch_stride + t * p.o_row_stride + h * p.o_head_stride;
      LoadRow(p.o, p.dtype, offset, d, o_row.data());
      LoadRow(p.d_o, p.dtype, offset, d, do_row.data());
      float sum = 0.0f;
      for (int64_t c = 0; c < d; ++c) sum += o_row[c] * do_row[c];
      const int64_t stat = bh * p.seqlen_q + t;
      dvec[stat] = sum - p.d_lse[stat];
    }
  });

  // Tasks own (b, kv_head, chunk of key blocks): dK/dV are written by exactly one
  // task. dQ gets one float32 accumulator per chunk, so no two tasks add into the
  // same one; chunks only split the keys when B * K alone can't feed every worker.
  const int64_t n_blocks = CeilDiv(p.seqlen_k, kBlockN);
  const int64_t bk = p.batch * p.num_heads_kv;
  const int64_t chunks = std::clamp<int64_t>(CeilDiv(2 * runner.num_workers(), bk), 1, n_blocks);
  std::vector<float> dq_accum(chunks * rows * d, 0.0f);
  std::vector<float> workspace(runner.num_workers() * WorkspaceFloats(d));
  runner.Run(bk * chunks, [&](int64_t task, int worker) {
    const int64_t chunk = task % chunks;
    const int64_t kv_head = (task / chunks) % p.num_heads_kv;
    const int64_t b = task / (chunks * p.num_heads_kv);
    kernels.backward_blocks(p, workspace.data() + worker * WorkspaceFloats(d), dvec.data(),
                            dq_accum.data() + chunk * rows * d, b, kv_head,
                            chunk * n_blocks / chunks, (chunk + 1) * n_blocks / chunks);
  });

  // dQ = scale * sum over chunks, in the input dtype.
  runner.Run(p.batch * p.seqlen_q, [&](int64_t bt, int) {
    std::vector<float> row(d);
    for (int64_t h = 0; h < p.num_heads_q; ++h) {
      const int64_t base = (bt * p.num_heads_q + h) * d;
      for (int64_t c = 0; c < d; ++c) {
        float sum = 0.0f;
        for (int64_t k = 0; k < chunks; ++k) sum += dq_accum[k * rows * d + base + c];
        row[c] = sum * p.softmax_scale;
      }
      const int64_t b = bt / p.seqlen_q, t = bt % p.seqlen_q;
      StoreRow(row.data(), d, p.dq, p.dtype,
               b * p.q_batch_stride + t * p.q_row_stride + h * p.q_head_stride);
    }
  });
}

}  // namespace jax_flash2::cpu
