"""Model families for calibration: the facts live in :mod:`quantpipe.core.families`.

Re-exported here under the names calibration has always imported (one registry, one source).
"""

from quantpipe.core.families import (
    FAMILIES,
    ONE_PLUS_NORM_FAMILIES,
    Family,
    InputGroup,
    block_linear_names,
    family_for,
    get_blocks,
)

__all__ = ["FAMILIES", "ONE_PLUS_NORM_FAMILIES", "Family", "InputGroup", "block_linear_names",
           "family_for", "get_blocks"]
