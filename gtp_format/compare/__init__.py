"""One comparison engine for checkpoints and in-memory tensors (``diff``, ``verify-roundtrip``, ranks).

- :mod:`gtp_format.compare.engine`: :func:`compare` walks the selected keys of two sides.
- :mod:`gtp_format.compare.sources`: the sides: a checkpoint folder, or a dict of tensors.
- :mod:`gtp_format.compare.values`: the rules, bitwise or within a tolerance.
- :mod:`gtp_format.compare.select`: ``--keys`` / ``--ignore`` globs.
- :mod:`gtp_format.compare.records`: what a comparison returns (records with stable codes, tallies).

Importing it never imports torch; comparing values does.
"""

from gtp_format.compare.engine import compare, compare_key, selected_keys, work
from gtp_format.compare.records import Difference, KeyResult, Report, Tally
from gtp_format.compare.select import EVERYTHING, KeyFilter
from gtp_format.compare.sources import CheckpointSource, TensorSource
from gtp_format.compare.values import BITWISE, EXACT, Rule

__all__ = ["BITWISE", "EVERYTHING", "EXACT", "CheckpointSource", "Difference", "KeyFilter", "KeyResult", "Report",
           "Rule", "Tally", "TensorSource", "compare", "compare_key", "selected_keys", "work"]
