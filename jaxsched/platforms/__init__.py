"""What differs between a CPU and a GPU, decided in one record per platform (platform.py), and the
process settings a CPU engine applies when it starts (host_malloc.py, cpu_affinity.py)."""

from jaxsched.platforms.platform import CPU, GPU, Platform, expected, of

__all__ = ["CPU", "GPU", "Platform", "expected", "of"]
