"""The planner: how long a sequence fits on a GPU, estimated on a CPU with fake tensors (`python -m
transformers.mst_planner --help`; docs/planner.md). A tool on top of the runtime: importing it registers nothing and
changes nothing; it reaches the runtime only through its extension points (standins.py)."""
