"""The benchmarks a user runs: head-to-heads against PyTorch, the generators of the docs' tables and
the validation of virtual time against the wall clock. bench/README.md lists each with its question,
its command and how long it takes; bench/harness.py is what they share. Run them from the project's
folder as modules: `python -m bench.<name>`, or `torchrun ... -m bench.<name>`."""
