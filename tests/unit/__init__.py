"""One rule at a time, on the function that holds it: the memory and throughput models, the search on known curves, the report."""
