"""Cost measurements of the attention variants and their committed tables.

- ``benchmarks.cost``: ``python run.py mode=bench`` (``make bench``), every variant's time, memory, FLOPs and
  scaling against N, with baselines, machine limits and per-task throughput;
- ``benchmarks.dilated``: the dilated kernel against DilateFormer's ``nn.Unfold`` form (a script);
- ``benchmarks.measure``: the shared measurement code (timing, peak memory, FLOP and byte counts, fits);
- ``benchmarks.baselines``: the reference implementations the variants are compared with.
"""
