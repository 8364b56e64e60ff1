"""The bottom layer: every public exception and warning (``errors``), findings and their codes, root-cause
linking, ``Diagnosis``, ``History``, tree helpers, argument validation and the one "is this library code"
predicate (``frames``). Imports nothing else of jaxsane; host-side.
"""
