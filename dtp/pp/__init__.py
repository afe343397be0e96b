"""Chapter 4, pipeline parallelism: schedules, the timeline simulator and their closed forms
(`schedules`), what torch.distributed.pipelining does (`torch_pipelining`), Gantt charts
(`plots`) and the notebook's schedule explorer (`widgets`)."""
