"""Chapter 5, expert parallelism: the MoE layer, its routing, capacity and all-to-all (`moe`),
routing as practised since DeepSeek-V3 (`routing`: bias balancing, node-limited routing), shared and
fine-grained experts (`experts`), and EP beside TP with sequence parallelism (`tp_ep`)."""
