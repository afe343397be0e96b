"""Chapter 2, data parallelism: communication costs in closed form (`costs`: ring all-reduce, the
alpha-beta model, bus bandwidth, DDP's buckets), a network of simulated ranks for collectives written
in numpy (`simulated`), what torch's DDP really does (`ddp_observed`), and the chapter's figures
(`plots`)."""
