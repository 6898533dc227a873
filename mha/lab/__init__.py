"""The lab: the instruments the course measures and draws attention with.

The attention code a learner reads is one level up, in ``mha/`` (one module per concept); what is
here only observes it:

* :mod:`~mha.lab.timing` — how long a call takes (``torch.utils.benchmark``), and robust ratios;
* :mod:`~mha.lab.memory` — the peak bytes a call allocates, on the CPU and on CUDA;
* :mod:`~mha.lab.bench` — several implementations over a grid of sizes, in one table;
* :mod:`~mha.lab.fit` — the slope of a measured curve on log-log axes;
* :mod:`~mha.lab.claims` — print, assert and record a measured claim with its margin;
* :mod:`~mha.lab.hardware` — the device and which of torch's SDPA kernels run on it;
* :mod:`~mha.lab.viz` — pictures of matrices: weight heatmaps, keep-masks, tiles;
* :mod:`~mha.lab.charts` — pictures of measurements: log-log curves, ratios, bars;
* :mod:`~mha.lab.figures` — the book's one-off diagrams (the layer, the head split, the roofline);
* :mod:`~mha.lab.shapes` — the dimension walk: a layer run step by step, every shape in a table;
* :mod:`~mha.lab.demo` — show a deliberate error in a notebook without stopping it;
* :mod:`~mha.lab.processes` — start local processes in a gloo group and run jobs in them;
* :mod:`~mha.lab.writer` — the workbench of section 4.4: the course's prose as characters, a small
  model around a learner's attention layer, its training, its sampling and its attention maps.

Dependencies run one way: the lab imports the attention code (``mha.*``), never the reverse, and
``mha.exercises`` builds on both. Every module is also reachable as ``mha.<name>`` (``mha.bench``,
``mha.viz``...), loaded on first use, so that ``import mha`` stays light. This file imports
nothing.
"""

# The modules of the lab, in the order above: `mha` resolves `mha.<name>` to `mha.lab.<name>`.
MODULES = (
    "timing",
    "memory",
    "bench",
    "fit",
    "claims",
    "hardware",
    "viz",
    "charts",
    "figures",
    "shapes",
    "demo",
    "processes",
    "writer",
)
