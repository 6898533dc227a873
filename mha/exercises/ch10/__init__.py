"""Chapter 10, attention in 2026's open models: the exercises, one module per section (10.1 ...),
each its exercises as data for :mod:`.._harness`."""

from .._harness import gather
from . import conv_step, deltanet, gated, mla, sinks, sparse

SECTIONS = (sinks, gated, mla, sparse, deltanet, conv_step)
#: The chapter's exercises in section order.
EXERCISES = gather(globals(), SECTIONS)
