"""Emulated interconnects: ranks on emulated nodes (Linux network namespaces) behind shaped links.

    topology.py   the settings (NetSpec), and the names and addresses of everything created
    netns.py      create the namespaces, bridge and links; tear them down (a context manager)
    shaping.py    the tc commands that give each link its rate, delay and loss, and change them mid-run
    counters.py   the kernel's byte counters of a node's interfaces, read from inside its namespace
    probe.py      what a training process records around the timed steps (the summary's `net` block)
    predict.py    the bytes the communication log says cross between nodes, per gloo algorithm
    faults.py     link faults applied by launch.run at a given time (down, loss, latency spike)

docs/network.md and docs/network-bytes.md explain the emulation, the link model and what each prediction assumes.
"""
