"""Attention kernels over the paged KV pool, each beside the reference it is tested against."""

from pallas_kernels.backends import BACKENDS, AttentionBackend, choose
from pallas_kernels.kv_cache import write_kv
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.reference_attention import reference_attention

__all__ = ["BACKENDS", "AttentionBackend", "choose", "paged_attention", "reference_attention", "write_kv"]
