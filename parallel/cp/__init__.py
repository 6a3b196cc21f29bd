"""Context parallelism: the sequence split across ranks, attention computed across them.

  layout.py     which tokens rank r holds (2·cp chunks, r and 2·cp − 1 − r), cutting and joining
  blockwise.py  attention of one block of queries on one block of keys, with its log-sum-exp
  ring.py       ring attention: K, V blocks pass around the ring, blocks merged by online softmax
  ulysses.py    all-to-all: sequence-sharded -> head-sharded around an unchanged attention core
  transform.py  the model's embedding and attention cores replaced for one rank
  traffic.py    the bytes each sends, per layer and microbatch, as closed forms
  strategy.py   the strategies cp and cp_a2a (dp x cp), and the batch cut in front of a pipeline

Derivations and sources: docs/theory/context.md.
"""
