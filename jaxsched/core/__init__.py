"""The host core: requests, scheduling policy, the KV block manager, the scheduler, buckets and
the step-cost model. Plain Python and numpy, no jax (tests/test_runtime_deps.py checks)."""
