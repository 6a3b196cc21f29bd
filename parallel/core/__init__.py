"""Floor 0: one process, no torch.distributed. The model and everything a single run needs.

model.py (the GPT, defined once), routing.py (a mixture of experts' top-k router), shape.py (the
model's shape as the formulas and the planner read it), data.py, optim.py, precision.py,
recompute.py, phases.py (the phases a step marks).
"""
