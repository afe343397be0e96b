"""Chapter 8, context parallelism: blockwise and ring attention, zigzag, Ulysses, and their bytes
and memory (`context_parallel`)."""
