"""Virtual device time: every run's step replayed as if each rank had a device of its own.

On a machine with fewer cores than ranks the wall clock measures the machine. A rank's thread CPU
time does not (parallel/dist/timing.py), its communication is known to the byte (dist/comm.py),
and a link model says how long those bytes take. The replay puts the step back together:

    events.py    what every rank saves of its timed steps (phases and calls, wall and CPU time)
    device.py    a rank's virtual device: its cores, and the clock its compute is read on
    graph.py     one step's events -> every rank's program: compute pieces, calls, posts, waits,
                 matched across ranks (collectives by order in their group, messages by peer)
    engine.py    the discrete-event simulator that plays the programs together
    links.py     link models: loopback, an emulated network's net.*, a cluster preset's links
    probe.py     this machine's loopback, probed with one rank per core
    virtual.py   a run's steps replayed: summary.json's `virtual` block and the virtual trace

docs/virtual-time.md says how it works, what it assumes, what it cannot see, and how well it
matches measured runs.
"""
