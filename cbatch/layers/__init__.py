"""The model's building blocks over the flat step batch: the step batch itself, the paged KV
cache, the paged attention layer (which kernel a step calls) and the linear layer."""
