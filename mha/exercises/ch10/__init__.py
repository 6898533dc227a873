"""Chapter 10, attention in 2026's open models: the exercises, one module per section (10.1 ...),
each its exercises as data for :mod:`.._harness`."""

from . import deltanet, gated, mla, sinks, sparse

SECTIONS = (sinks, gated, mla, sparse, deltanet)
#: The chapter's exercises in section order.
EXERCISES = tuple(ex for section in SECTIONS for ex in section.EXERCISES)
for _section in SECTIONS:
    for _ex in _section.EXERCISES:
        globals()[_ex.name] = getattr(_section, _ex.name)  # the section's own checker
del _section, _ex
