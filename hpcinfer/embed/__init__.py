"""Embedding jobs (`[embed]`, docs/embed.md): inputs, batches bucketed by length, pooling and the HDF5 output."""
