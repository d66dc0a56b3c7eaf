"""Data plane: moves named tensors from a trainer into inference workers.

Knows nothing of engines or HTTP; uses only torch.
"""
