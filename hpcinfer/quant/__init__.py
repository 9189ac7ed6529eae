"""Weight quantization (docs/quantization.md)."""
