"""parallel-sandbox: one small GPT trained by hand-written data, tensor, pipeline, context and expert
parallelism (and ZeRO, and all of them on one mesh), beside PyTorch's own.

The code is built in floors, and imports only go down: a module imports its own floor's modules
and the floors below, never one above. Read it bottom up:

    floor 0  core/          one process, no torch.distributed: the GPT (model.py), its shape as the
                            formulas read it (shape.py), data, optimizer, precision, recomputation
    floor 1  dist/ net/     the substrate: the mesh's dimensions (dist/dims.py, declared once), the
                            one caller of collectives with exact bytes (dist/comm.py), process groups;
                            links: emulated networks, wire counters, the link model
    floor 2  the contract   strategy.py (what every strategy implements), spec.py (the registry's
                            record), family.py (what a family declares: its options, rules, search
                            and summary), layout.py, algebra.py (ring factors, parameter counts, padding,
                            the per-op/per-group figure), model_state.py (what a rank's parameters,
                            gradients and optimizer state take), activations.py (bytes saved for backward)
    floor 3  the syncs      sync/: how the ranks that hold the same parameters agree on one update
                            (all-reduce, bucketed as DDP; ZeRO's shards and optimizer), which every
                            family plugs in
    floor 4  the families   dp/ zero/ tp/ pp/ cp/ moe/ diloco/: each folder a chapter with the same pages
                            (mechanism, strategy.py, rules.py, theory.py, __init__.py with its entries)
    floor 5  composition    compose/ (the recipe that alone knows every family, and the one table of
                            what runs), baselines/ (PyTorch's own), registry.py (every family's entries)
    floor 6  one run        run_plan.py (every rule before any process group), train.py, report/,
                            reliability/, runner.py (a run as a child process, bounded in time),
                            replay/ (virtual device time: the step replayed with a device per rank)
    floor 7  tools on runs  compare/ (the sweep), planner/ (what a cluster would do)
    floor 8  launch/        the command lines

Families do not import each other: what two of them share sits on a floor below (the syncs), and
where they meet is the composition's (parallel/compose/). tests/unit/test_floors.py holds the import
graph, lazy imports included, against `FLOORS`.
"""

# Each floor: the module prefixes it holds (a prefix is a module or a package and everything in it).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("parallel.core",)),
    ("substrate", ("parallel.dist", "parallel.net")),
    ("contract", ("parallel.strategy", "parallel.spec", "parallel.family", "parallel.layout", "parallel.algebra",
                  "parallel.model_state", "parallel.activations")),
    ("syncs", ("parallel.sync",)),
    ("families", ("parallel.dp", "parallel.zero", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.moe",
                  "parallel.diloco")),
    ("composition", ("parallel.compose", "parallel.baselines", "parallel.registry")),
    ("run", ("parallel.run_plan", "parallel.train", "parallel.report", "parallel.reliability", "parallel.runner",
             "parallel.replay")),
    ("tools", ("parallel.compare", "parallel.planner")),
    ("cli", ("launch",)),
)

# The floor whose packages must not import one another.
FAMILY_FLOOR = "families"
