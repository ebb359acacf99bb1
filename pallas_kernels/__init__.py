"""Attention kernels over the paged KV pool, each beside the reference it is tested against."""

from pallas_kernels.kv_cache import write_kv
from pallas_kernels.paged_attention import BACKENDS, paged_attention, reference_attention

__all__ = ["BACKENDS", "paged_attention", "reference_attention", "write_kv"]
