"""The measurements of ``bench/bench_packing.py``, one module each, over the set-up they share (``common``):
``fill`` (carry-buffer fill ratio, CPU), ``throughput`` (packed vs padded tokens/s and MFU), ``vlm_phases``
(what ``--vlm`` measures after them, in order), ``compiled`` (regional torch.compile and its Inductor-tuned
re-runs), ``ab`` (the interleaved kernel / host-copy A/Bs), ``memory`` (peak memory per row length) and
``ddp`` (data-parallel scaling). The command line is ``bench/bench_packing.py``'s.
"""

__all__ = ["ab", "common", "compiled", "ddp", "fill", "memory", "throughput", "vlm_phases"]
