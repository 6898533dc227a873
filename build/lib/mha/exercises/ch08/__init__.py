"""Chapter 8, attention in today's models: the exercises, one module per section (8.1 ... 8.5),
each its exercises as data for :mod:`.._harness`."""

from . import cache_bytes, caches, flexattention, memory_bound, rope

SECTIONS = (rope, flexattention, memory_bound, caches, cache_bytes)
#: The chapter's exercises in section order.
EXERCISES = tuple(ex for section in SECTIONS for ex in section.EXERCISES)
for _section in SECTIONS:
    for _ex in _section.EXERCISES:
        globals()[_ex.name] = getattr(_section, _ex.name)  # the section's own checker
del _section, _ex
