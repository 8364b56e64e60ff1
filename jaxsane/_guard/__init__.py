"""``guard``: the transform that checks a step's outputs inside its compiled program (``flags``), and its host
side that reads the flags late, names the failure (``failure``), dumps, locates and raises/skips/warns
(``host``, ``kept``, ``settings``); chex interplay in ``chex``.
"""
