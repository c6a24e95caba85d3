"""jax_flash2: FlashAttention-2 for JAX (CUDA and CPU kernels as XLA FFI calls)."""

from jax_flash2 import export, reference
from jax_flash2._plan import plan
from jax_flash2.api import AttentionConfig, flash_attention, flash_attention_varlen, kernel_info
from jax_flash2.context_parallel import ring_attention
from jax_flash2.kvcache import flash_attention_with_kvcache

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig", "export", "flash_attention", "flash_attention_varlen",
    "flash_attention_with_kvcache", "kernel_info", "plan",
    "reference", "ring_attention",
]
