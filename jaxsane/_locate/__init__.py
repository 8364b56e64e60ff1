"""Where a NaN is born: the equation-by-equation replay (``replay``), the data-flow analysis (``flow``),
origins and their causes (``origins``, ``nan_causes``, ``nan_values``), the result (``result``: ``LocateReport``)
and the post-mortem debugger at the origin (``debugger``).
"""
