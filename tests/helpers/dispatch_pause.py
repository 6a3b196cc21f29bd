"""A dispatch mode that sees every torch operation, with `pause` for what it must not see.

The planner's elementwise tables (codec.py, shard_copies.py) are held to the code by modes that count
what each operation reads and writes; what a collective's transport does, and the optimizer's step, are
not theirs to count. `pause(run)` returns `run` with the mode's `inside` set while it runs (and while
a handle it returns is waited for); pauses nest, as an optimizer step that posts collectives does.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class PausableMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.inside = False

    def pause(self, run):
        def paused(*args, **kwargs):
            outer, self.inside = self.inside, True
            try:
                out = run(*args, **kwargs)
            finally:
                self.inside = outer
            if hasattr(out, "wait"):
                out.wait = self.pause(out.wait)
            return out

        return paused
