"""The optimizer step's time: elementwise passes over the parameters a rank's optimizer updates.

After the schedule, every rank steps the parameters its optimizer holds (parallel/core/optim.py): all
of them under dp, DiLoCo's inner steps and tp or pp (its own cut or stage), 1/n of each part under
ZeRO over n ranks (the shards of the optimizer state, parallel/model_state.py). Each tensor operation
of the update reads and writes every element once, so the step is memory-bound:

    seconds = elements stepped x bytes per element / rate

with the bytes per element summed over the update's own operations (below, in the order
`AdamW.update` and `SGD.update` run them) and the rate the codec's (codec.py: the GPU's HBM bandwidth,
or this machine's probe, run by every rank at once). It matters where compute per rank is
small beside the model: data parallelism over many ranks on one machine steps the whole model on every
rank for a 1/dp share of the batch's matmuls.

Under bf16 mixed precision (the GPU presets) the update is what Megatron-LM and DeepSpeed run: one fused
multi-tensor kernel over the fp32 master weights, fp32 main gradients and both moments, writing the
master weights, the moments and the bf16 weights the next forward reads (16 bytes in, 14 out).
"""

from __future__ import annotations

from fractions import Fraction

from parallel.model_state import model_state
from parallel.planner.codec import Pass, elementwise_seconds

# AdamW.update, per element in fp32: decay, the two moments, the denominator, the step (what each reads
# is its tensor arguments: addcmul_ names the gradient twice).
ADAMW = [Pass("p *= 1 - lr·wd", 4, 4), Pass("m.lerp_(g)", 8, 4), Pass("v *= beta2", 4, 4),
         Pass("v.addcmul_(g, g)", 12, 4), Pass("v.sqrt()", 4, 4), Pass("/ bias correction", 4, 4),
         Pass("+ eps", 4, 4), Pass("p.addcdiv_(m, denom)", 12, 4)]
SGD = [Pass("p *= 1 - lr·wd", 4, 4), Pass("p.add_(g)", 8, 4)]
PASSES = {"adamw": ADAMW, "sgd": SGD}
FUSED = {"adamw": [Pass("fused AdamW: p, g, m, v in; p, m, v, bf16 p out", 16, 14)],
         "sgd": [Pass("fused SGD: p, g in; p, bf16 p out", 8, 6)]}


def optimizer_passes(optimizer: str, precision: str) -> list[Pass]:
    return (FUSED if precision == "bf16" else PASSES)[optimizer]


def elements_stepped(parts: list[int], zero: int, shards: int) -> int:
    """The parameters one rank's optimizer updates: its parts, or ZeRO's padded 1/n of each (the
    optimizer state's count at one byte an element)."""
    return model_state(parts, (0, 0, 1), zero, shards)["optimizer_bytes"]


def optimizer_seconds(elements: int, optimizer: str, precision: str, rate: float | None) -> float:
    """One rank's optimizer step: its elements' bytes at the codec rate (0 where there is none)."""
    return elementwise_seconds([(optimizer_passes(optimizer, precision), Fraction(1))], elements, rate)
