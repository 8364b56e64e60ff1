"""Overfit one small batch: many configurations of the user's own step in one compiled program (``overfit``,
``setup``, ``sweep``), the result and its verdict (``result``, ``verdict``).
"""
