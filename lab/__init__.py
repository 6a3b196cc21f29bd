"""Investigations of one host: scripts that answered a question about the machine they ran on.

Not part of the product: nothing in parallel/, launch/ or bench/ imports them. lab/README.md says
what each asked and which dated log under docs/log/ holds what it found. Run them from the
project's folder as modules: `python -m lab.<name>`, or `torchrun ... -m lab.<name>`."""
