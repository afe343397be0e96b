"""Chapter 6, ZeRO and FSDP: the closed forms (`formulas`), ZeRO wrapping real models
(`sharded`), measuring what a rank holds and sends (`measure`), the chapter's training runs
(`runs`), and the comparison with PyTorch's own FSDP2 and ZeroRedundancyOptimizer (`compare`)."""
