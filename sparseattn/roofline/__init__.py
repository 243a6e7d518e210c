"""The roofline cost model: predict when a sparse layout beats a dense kernel, and check it.

The source material's equation, priced per kernel launch::

    T = T_route + T_index + max(F_tile / P_eff, D_HBM / W_eff) + T_launch

* :func:`ceilings` -> :class:`Ceilings` -- matmul rate per dtype, HBM read bandwidth, launch latency, SM count:
  recorded for the H200 (``sparseattn/data/ceilings-h200.json``, every value with its source), measured
  once and cached on any other GPU (:func:`measure_ceilings`).
* :func:`cost` ``(layout, shape, pass_="fwd" | "bwd" | "decode", routing=None, config=None,
  deterministic=True, *, pages=None, keep=None, impl="sparseattn" | "flex" | "cudnn", graph=False,
  rebuild_layout=False, device=None, host_ms=None, l2_flush=False)`` -> :class:`Cost`: every term, the
  prediction and the bound
  (``"compute"``, ``"memory"`` or ``"overhead"``). ``shape`` is a :class:`Shape` or a dict
  ``(B, Hq, Hkv, D, dtype)``; decode takes a :class:`~sparseattn.PagedKVCache` (or None and
  ``seq_len``/``page_size`` in the shape) with a :class:`~sparseattn.PageSelection` or a kept fraction.
* :func:`crossover` ``(family, pass_="fwd", *, shape=None, grid=None, ...)`` -> :class:`Crossover`: the length
  (``"window"``, ``"sinks_window"``) or kept fraction (``"block_random"``, ``"documents"``, ``"decode"``)
  where our predicted time drops below cuDNN's on the pattern's envelope (causal or dense).
* :func:`report` ``(pattern_or_layout, shape=None, *, N=None, pass_="fwd", measure=False, ...)`` ->
  :class:`Report`: "will sparse be faster here?" -- for a mask_mod, a recorded pattern name, a layout or (decode)
  a cache: predicted (and on a GPU measured) times of ours, FlexAttention and cuDNN, the verdict with our
  speedup over cuDNN, and our dominant term. The entry point for users::

      >>> import sparseattn.roofline as R
      >>> print(R.report("sinks64+window1024", N=16384, pass_="bwd").verdict)   # doctest: +SKIP

* :func:`profile_step` ``(fn, *args, **kwargs)`` -> :class:`StepProfile`: one step under ``torch.profiler``,
  split into route / index / kernel / launch (:func:`.profile.example_steps`: the two steps the book profiles).

Around them: :mod:`.cases` (the named layouts of the recorded benchmarks, shared with
:mod:`sparseattn.bench`), :mod:`.timing` (GPU timers, CUDA-graph capture, compiled FlexAttention, SDPA
backends; re-exported by the bench), :mod:`.measure` (the small timings of ``report(measure=True)``) and the
``python -m sparseattn.roofline`` commands.

How the terms are computed:

* counts (:mod:`.counts`) are exact and physical: the programs each kernel launches, in dispatch order, and
  their inner-loop steps over full and partial tiles; flops of whole tiles (forward 2 tile matmuls a step;
  backward 7, or 5 with atomic dQ); requested bytes (what each program loads and stores) and compulsory
  HBM bytes ``D_HBM`` (each distinct byte once: repeated K/V reads by the programs of one head hit L2).
* ``F_tile / P_eff`` (:mod:`.model`): programs are dealt to the SMs, each to the SM that frees first; a
  program costs ``program_overhead + full steps + (1 + partial_overhead) x partial steps`` steps of
  ``flops / (P x eff_compute / SMs)``. The last finish time is the compute term, so wave tails, short rows
  and mask work are in it. ``D_HBM / W_eff`` with ``W_eff = W x eff_memory``. Decode steps are timed by a
  calibrated ``step_us`` (an SM's share of the bandwidth, or latency when few programs run).
* ``T_launch``: a calibrated fixed device cost per call; an eager call takes the larger of its device time
  and its host time ``T_host`` (calls issued back to back, :mod:`.host`; ``cost(host_ms=...)`` takes this
  machine's measured host time; ``l2_flush=True`` prices the call as ``do_bench`` times it, its device time
  while the host hides behind the L2 flush and the kernels), a CUDA-graph replay (``graph=True``) the
  device time alone.
  ``T_index``: layout rebuild (fixed cost + cells a mask_mod without an exact tile rule evaluates), only
  with ``rebuild_layout=True``; ``T_route``: the routing time you pass.

Calibration (:mod:`.calibrate`; ``python -m sparseattn.roofline calibrate``)
-----------------------------------------------------------------------------
Efficiencies and overheads are fitted per implementation and pass on the recorded H200 runs
(``book/data/bench/{prefill,backward,decode_keep,decode,layout}-h200.json``; prefill: B=1, 16 heads, D=128,
bf16) and evaluated on points disjoint from the fit:

* prefill, ours and FlexAttention, forward and backward: fitted on ``causal`` and ``window1024`` (N = 4k to
  64k forward, 32k backward), evaluated on ``sinks64+window1024`` and ``random10%+diag`` -- layouts the fit
  never saw, and for the backward also ``documents64`` and ``window333`` (both suites re-recorded on 2026-12-02
  with the kernels as they are and their fast launch path). The short end of the same two layouts is fitted
  on the host suites' CUDA-graph replays (``device_ms``, N = 2k and 4k): they pin the per-call device cost
  that the long sequences cannot separate from the per-tile rate. cuDNN: fitted at N = 4k, 16k, 64k,
  evaluated at 8k and 32k (backward: fitted dense, evaluated causal);
* decode: fitted on batch 8 and 32 (decode_keep, CUDA graph and eager), evaluated on batch 1 and on the
  decode suite (page sizes 16, 64, 128); cuDNN decode likewise;
* layout build and transpose: fitted at N = 32k, evaluated at 131k;
* the crossover sweep (``book/data/bench/crossover-h200.json``, :mod:`sparseattn.bench.crossover`; when
  recorded) is evaluated only: a 2048-token window, 64 sinks + a 1024-token window, block-random + diagonal
  and equal documents at N = 1k to 16k, decode at B = 4 and 16. Each prefill row is two points: its eager
  event time (``ms``, priced with the host time the run measured at the start of the part on a layout it
  does not sweep) and its CUDA-graph replay (``device_ms``, the ``"... graph"`` points). A sweep point that
  re-measures the layout and shape of a calibration point (the cuDNN forward at 4k and 16k; one document at
  4k and 16k, which is the causal layout) is a ``"repeat"`` and left out.

Parameters a model's calibration points cannot separate are tied to another model's (listed under
``tied`` in the record; e.g. the backward's partial-tile overhead is the forward's).

Predicted / measured on the evaluation points::

    evaluation points                      n  median    p10    p90 in +-25%
    prefill (fwd + bwd, ours)             19    1.02   0.92   1.13      95%
    prefill baselines (Flex, cuDNN)       19    0.97   0.87   1.04      95%
    decode, CUDA graph (ours)             10    1.05   1.01   1.50      70%
    decode, eager (ours)                  16    0.98   0.63   1.30      62%
    decode (cuDNN)                         7    0.97   0.97   0.98     100%
    layout build + transpose              14    0.28   0.17   0.88      14%
    crossover sweep: ours, device        120    0.97   0.81   1.13      88%
    crossover sweep: Flex, cuDNN, device 128    0.95   0.82   1.06      96%
    crossover sweep: ours, eager         101    0.96   0.78   1.14      90%
    crossover sweep: Flex, cuDNN, eager  119    0.97   0.86   1.31      86%
    all kernel models (no eager decode)  523    0.97   0.82   1.12      90%
    crossover sweep: device (all)        248    0.96   0.82   1.08      92%
    crossover sweep: eager (all)         220    0.96   0.83   1.21      88%
    crossover sweep (all)                468    0.96   0.82   1.12      90%

Outside +-25%::

    flex bwd sinks64+window1024 N=32768                   0.71
    sparseattn-atomic bwd window333 N=32768               1.31
    sparseattn decode keep0.01 N=131072 B=1 ps=16 eager   1.56
    sparseattn decode keep0.01 N=131072 B=1 ps=16 graph   1.69
    sparseattn decode keep0.02 N=131072 B=1 ps=16 eager   1.55
    sparseattn decode keep0.02 N=131072 B=1 ps=16 graph   1.48
    sparseattn decode keep0.05 N=131072 B=1 ps=16 graph   1.35
    sparseattn decode keep0.10 N=131072 B=1 ps=16 eager   0.74
    sparseattn decode keep0.20 N=131072 B=1 ps=16 eager   0.62
    sparseattn decode keep0.30 N=131072 B=1 ps=16 eager   0.63
    sparseattn decode keep0.50 N=131072 B=1 ps=16 eager   0.59
    sparseattn transpose causal N=131072                  0.23
    sparseattn transpose window1024 N=131072              0.60
    sparseattn layout sinks64+window1024 N=131072         0.22
    sparseattn transpose sinks64+window1024 N=131072      0.59
    sparseattn layout dilated4&causal N=131072            0.29
    sparseattn transpose dilated4&causal N=131072         0.17
    sparseattn layout documents&causal N=131072           0.25
    sparseattn transpose documents&causal N=131072        0.31
    sparseattn layout block_random10% N=131072            0.67
    sparseattn transpose block_random10% N=131072         0.28
    sparseattn layout arbitrary(no rule) N=131072         0.12
    sparseattn transpose arbitrary(no rule) N=131072      0.17
    sparseattn decode keep0.02 N=65536 B=4 ps=16 graph (crossover)  1.39
    sparseattn decode keep0.02 N=16384 B=16 ps=16 graph (crossover)  1.28
    ... and 44 more (python -m sparseattn.roofline accuracy)

Why those fail:

* backward at N = 32k (``backward-h200.json``): FlexAttention's backward took 1.57x its window time on
  ``sinks64+window1024`` (ours 1.23x) with 11% more tiles; the model prices tiles and programs and has no
  term for that, so it predicts Flex 0.71x of what it took. Our atomic backward on ``window333``, predicted
  1.3x what it took: at 333 tokens most listed tiles are partial, and the backward's partial-tile overhead
  is tied to the forward's, which the calibration layouts cannot separate (the deterministic path there:
  1.12x, inside the band).
* the sweep's forward on random tiles and on documents, predicted low: the calibration layouts (causal,
  window) have about as many partial tiles as programs, so the fit cannot tell a cost per program from a cost
  per partial tile; it put 1.08 tile-equivalents on each partial tile and none on a program, and layouts
  with many programs and few partial tiles come out cheap.
* the sweep's eager points at N < 8k: the host can set the time there -- our window backward's eager times
  at N = 1k-2k (0.19-0.26 ms) are 1.7-3.1x its device times there -- and the host's time per call is not
  steady within one run nor the same from layout to layout, while the part's host time, measured once on one
  probe layout, prices them all alike. ``do_bench`` flushes the L2 cache with a device memset before every
  call and the host prepares the call meanwhile, so a call is priced at its device time while its host time
  fits in the flush and its kernels (:mod:`.host`; cuDNN's causal forward at 1k: 0.024 ms eager, its probe
  0.071 ms of host per call, the flush 0.058 ms). That edge is sharp where the host is not: our forward on
  sixteen documents at N = 2k took 0.026 ms eager, its device time, and was priced at the probe's 0.082 ms,
  past the flush and its predicted kernels (0.075 ms). The graph replays of the same calls follow the
  model.
* decode at batch 1 with 1-5% of the pages kept (CUDA graph): 14-22 us. The fixed cost per replay (22 us)
  was fitted at batch 8 and 32, where it cannot be told apart from the cost per wave of programs, so batch 1
  is over-predicted. A measured launch latency (``Ceilings.launch_us``) would pin it.
* eager decode: the host issues each call in 66-176 us, varying from point to point within one run; a single
  host time per call cannot follow it (the graph replays of the same points are predicted).
* layout builds and transposes: the build's term is one constant fitted at 32k (0.54 ms; the seven builds
  there took 0.31-0.77 ms), and the builds at 131k took 0.95-8.04x of it (0.51-4.36 ms). Below 2^17 tiles a
  build classifies every tile in one kernel, above it the mask's tile rule decides most tiles first, so the
  cost changes form with the size; the model has no term for which path a build takes.

The recorded ceilings come from the project's toolchain notes and the bench data (see ``sources``);
``python -m sparseattn.roofline check --out DIR`` on a GPU measures them and re-checks predictions against
new measurements. Refit after replacing them.
"""
from .ceilings import Ceilings, ceilings, measure_ceilings
from .counts import Shape
from .crossover import Crossover, Report, crossover, report
from .model import Cost, cost
from .profile import StepProfile, profile_step

__all__ = ["Ceilings", "ceilings", "measure_ceilings", "Shape", "Cost", "cost", "Crossover", "crossover",
           "Report", "report", "StepProfile", "profile_step"]
