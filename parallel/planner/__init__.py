"""The planner: will a model fit, what will each step wait on, which layout wins (launch/plan.py).

    shape.py      the model: the sandbox GPT's fields, and grouped-query attention, gated MLP width,
                  tied head, RMSNorm, rotary positions for shapes the GPT does not have
    cluster.py    the devices and their two link classes (conf/cluster/, datasheet figures)
    enumerate.py  every layout run_plan.py accepts, over the registry's entries and their layout rules
    memory.py     parameters, gradients, optimizer state, saved activations (exact for this GPT), buffers
    links.py      which of a group's bytes stay in a node and which cross between nodes
    traffic.py    bytes per group and link class, from the registry's closed forms (the families' theory.py)
    remedies.py   what else it reads of hybrid sharding, low-precision collectives and DiLoCo (the ZeRO
                  stage and shard group, the sync period, the outer state)
    timing.py     compute, exposed communication and the bubble (parallel/pp/simulator.py)
    predict.py    one layout -> one row of plan.json
    search.py     all rows, ranked; the conf/parallel preset that runs each
    report.py plots.py   the table, report.md, plan.json, the two plots
    validate.py   run layouts, read their summary.json, add measured columns and errors

The derivations are in docs/theory/planner.md; how to use it,
docs/planner.md; what it found, docs/planner-examples.md and docs/planner-validation.md.
"""
