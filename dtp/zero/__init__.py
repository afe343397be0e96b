"""Chapter 6, ZeRO and FSDP: the closed forms (`formulas`), ZeRO wrapping real models (`sharded`:
ZeRO-3 there, ZeRO-1/2 in `sharded_optimizer`, the policy in `mixed_precision`, pieces and the
`PieceTensor` user code sees in `pieces`), measuring what a rank holds and sends (`measure`), the
chapter's training runs (`runs`), and the comparison with PyTorch's own FSDP2 and
ZeroRedundancyOptimizer (`compare`: losses; `compare_interfaces`: what user code sees)."""
