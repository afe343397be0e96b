"""Chapter 3, tensor parallelism: its closed forms, link figures and the measuring tools the
book, the notebook and the checks share (`tensor_parallel`)."""
