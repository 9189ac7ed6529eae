"""HDF5 checkpoint format (one file, one dataset per tensor), sharded reads and converters."""
