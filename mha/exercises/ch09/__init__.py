"""Chapter 9, serving attention: the exercises, one module per section (9.1 ...), each its
exercises as data for :mod:`.._harness`."""

from .._harness import gather
from . import cascade, chunked, distributed, hybrid, paged_cache, prefix, quant, varlen

SECTIONS = (paged_cache, varlen, quant, distributed, chunked, prefix, cascade, hybrid)
#: The chapter's exercises in section order.
EXERCISES = gather(globals(), SECTIONS)
