"""Mixed precision: each linear's measured sensitivity (``sensitivity``), the shared bit
accounting and upgrade order (``budget``) and the per-layer precision plan under an
average-bits budget with overrides (``plan``)."""
