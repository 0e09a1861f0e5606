"""What a benchmark sends: prompts, published data sets, and the workload drawn from them.

Below ``ddtree_ops.bench`` (which decides how it is sent); see README.md here."""
