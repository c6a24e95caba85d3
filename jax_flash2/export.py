"""jax.export of functions that call the flash kernels.

jax.export refuses custom calls whose targets JAX itself does not promise to
keep stable, so exporting a function that uses flash_attention needs

    jax.export.export(jax.jit(f), disabled_checks=jax_flash2.export.disabled_checks())

The exported artifact names the FFI targets jax_flash2_attention_fwd / _bwd
with their operands (q, k, v, [the backward's out, lse, d_out, d_lse,]
alibi_slopes [B, H], q_segment_ids [B, T], kv_segment_ids [B, S],
dropout_seeds [B, H, 2], and the KV cache's kv_seqlens [B], block_table
[B, P] and kv_scales [B, 2, 1 or P, K]; an operand the call does not read is
a zero-size constant) and attributes (softmax_scale, window_left,
window_right, softcap, has_alibi, has_segment_ids, dropout_rate,
has_kv_seqlens, page_size; on CUDA also sm_count, segment_keys on the
forward and deterministic on the backward). On CUDA,
flash_attention_with_kvcache's append of k, v is a third target,
jax_flash2_kv_append (operands k_cache, v_cache, k, v,
cache_seqlens, block_table, k_scale, v_scale, zero-size where absent;
attribute page_size; its two results alias the caches). The process that
deserializes and runs it must `import jax_flash2` (which registers the
targets) from a version with the same FFI signature. float32 calls exported
for CUDA contain no attention custom call (they lower to plain JAX, see
_lowering). Gradients (`serialize(vjp_order=1)`), symbolic batch sizes and
several platforms (`platforms=("cpu", "cuda")`, with a CUDA build) export as
usual.

Exports are not partitioned: jax.export cannot serialize custom_partitioning,
so a function exported with shardings gathers q, k and v onto each device
(correct, not fast).
"""

from __future__ import annotations

from jax.export import DisabledSafetyCheck

from jax_flash2 import _ext

__all__ = ["TARGETS", "disabled_checks"]

# The FFI custom-call targets an exported module may contain.
TARGETS = (_ext.FORWARD_TARGET, _ext.BACKWARD_TARGET, _ext.KV_APPEND_TARGET)


def disabled_checks() -> list[DisabledSafetyCheck]:
  """The `disabled_checks` jax.export.export needs for the flash kernels."""
  return [DisabledSafetyCheck.custom_call(target) for target in TARGETS]
