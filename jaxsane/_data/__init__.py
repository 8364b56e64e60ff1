"""``check_data``: reading the user's data (``read``), one pass over each split (``scan``, ``split``), row hashes
and matches for leakage and duplicates (``row_hash``, ``match``) and the ``data.*`` findings (``findings``).
"""
