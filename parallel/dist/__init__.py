"""The distributed plumbing: the communication log (comm.py, the only caller of torch.distributed),
process groups in and out (groups.py), the rank grid (dims.py) and step timing (timing.py)."""
