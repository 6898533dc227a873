"""Chapter 8, attention in today's models: the exercises, one module per section (8.1 ... 8.5),
each its exercises as data for :mod:`.._harness`."""

from .._harness import gather
from . import cache_bytes, caches, flexattention, memory_bound, rope

SECTIONS = (rope, flexattention, memory_bound, caches, cache_bytes)
#: The chapter's exercises in section order.
EXERCISES = gather(globals(), SECTIONS)
