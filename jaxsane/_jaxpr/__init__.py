"""The one jaxpr interpreter and its rule table (``interpret``), tracing once per signature (``trace_cache``),
how hard XLA compiles jaxsane's own programs (``compile_level``, ``compile_cache``) and why a step compiled
again (``recompile``).
"""
