"""Mixture of experts: routing (routing.py), expert-parallel dispatch and combine over a Communicator
(expert_parallel.py) and the all-to-all bytes that routing implies (traffic.py).

The MoE MLP itself lives in parallel/core/model.py, next to the dense MLP it replaces, so that there is
one model definition. Nothing is imported here: model.py imports routing.py, and
expert_parallel.py imports model.py, so an eager import in this file would be circular.
"""
