"""Several devices: tensor-parallel layouts over a mesh, and one engine core over several hosts."""
