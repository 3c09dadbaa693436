"""Python face of the compiled kernels and their PyTorch reference twins."""

from hstu.ops.attention import compiled_attention_available, hstu_attention

__all__ = ["hstu_attention", "compiled_attention_available"]
